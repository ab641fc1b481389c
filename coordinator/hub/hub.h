/* hub: an HTTP client for a Hugging Face-style model store (the files of a
 * repository revision at ENDPOINT/OWNER/NAME/resolve/REV/FILE), over libcurl:
 * whole small files, and byte ranges (HTTP Range, 206) fetched many at a time
 * (a curl multi handle: HTTP/2 multiplexing over TLS where the server offers
 * it, otherwise reused HTTP/1.1 connections), streamed into a file
 * descriptor at given offsets or into memory, never buffered whole.
 *
 * Each response is checked before a byte is kept: 206 with a Content-Range
 * naming exactly the bytes asked for, exactly that many bytes, and when the
 * server sends an RFC 9530 Content-Digest (sha-256), that digest. A 200 to a
 * Range request (a server that ignores Range, or a file that changed under
 * If-Range) is refused at the headers, before its body is read. Transport
 * errors, truncated bodies, digest mismatches, 408, 429 and 5xx are retried
 * with exponential backoff and jitter (Retry-After honoured); 401, 403, 404
 * and 416 fail at once with a message naming the URL and what to do.
 * Redirects (the hub sends resolve URLs to a CDN) are followed, and where a
 * file's final URL is remembered, its later ranges go there directly (one
 * request instead of two; a 403/404/410 from a remembered URL, an expired
 * signature, falls back to the resolve URL). The bearer token goes to the
 * endpoint's host only, never into a message or log.
 * May use: common/ and libcurl. Not thread-safe: one caller thread per hub. */
#ifndef SHOAL_HUB_H
#define SHOAL_HUB_H

#include <stddef.h>
#include <stdint.h>

typedef struct shoal_hub shoal_hub;

typedef struct {
    const char *endpoint; /* "https://huggingface.co" when NULL */
    const char *repo;     /* OWNER/NAME */
    const char *revision; /* a commit hash, branch or tag */
    const char *token;    /* bearer token or NULL; never printed */
    const char *user_agent; /* "shoal" when NULL */
    int parallel;         /* transfers in flight (0: 8) */
    int retries;          /* attempts after the first, per request (0: 8; -1: none) */
    double backoff_s;     /* first wait before a retry, doubled each time up to 60 s (0: 1 s) */
    long stall_s;         /* a transfer under 1 KiB/s for this long is retried (0: 60 s) */
    /* told of each retry before its wait (may be NULL): why, the wait, the attempt about to be made and the most */
    void (*on_retry)(void *ctx, const char *why, double wait_s, int attempt, int attempts);
    void *retry_ctx;
} shoal_hub_opts;

typedef struct {
    uint64_t requests;  /* HTTP requests started (each retry is one) */
    uint64_t retried;   /* of those, retries */
    uint64_t bytes;     /* body bytes received and kept */
    uint64_t discarded; /* body bytes received then thrown away (failed attempts) */
    int http2;          /* 1 once a response came over HTTP/2 */
} shoal_hub_stats;

/* Where a piece's bytes go when they are not one run: the next len bytes to
 * offset dst of the piece's fd. */
typedef struct {
    uint64_t dst, len;
} shoal_hub_seg;

/* One byte range of a repository file to fetch. */
typedef struct {
    const char *file;     /* path in the repository */
    const char *if_range; /* an ETag sent as If-Range (a changed file then answers 200: refused), or NULL */
    uint64_t off, len;    /* the bytes [off, off + len), len > 0 */
    int fd;               /* destination file (pwrite at dst + i), or -1 for mem */
    uint64_t dst;
    const shoal_hub_seg *seg; /* nseg > 0: the bytes go to these runs of fd, in order (lens sum to len) */
    int nseg;
    void *mem;            /* destination of len bytes when fd < 0 */
    /* filled on success */
    uint64_t total;        /* the file's size (Content-Range) */
    char etag[128];        /* X-Linked-Etag, else ETag, of the first response; "" when none */
    uint8_t blake2b[32];   /* BLAKE2b-256 of the bytes kept */
    void *user;
} shoal_hub_piece;

/* Called once per piece whose bytes are all in place. Return 0 to accept
 * it, 1 to have it fetched again (counted as a failed attempt; err says
 * why), or a negative code to stop the whole fetch. */
typedef int (*shoal_hub_done_fn)(void *ctx, shoal_hub_piece *p, char *err, size_t errlen);
/* Bytes kept so far changed by delta (negative when a failed attempt's bytes are thrown away). */
typedef void (*shoal_hub_progress_fn)(void *ctx, int64_t delta);

int shoal_hub_open(shoal_hub **out, const shoal_hub_opts *o, char *err, size_t errlen);
void shoal_hub_close(shoal_hub *h); /* accepts NULL */

/* ENDPOINT/OWNER/NAME/resolve/REV/FILE, with REV and FILE escaped (no token in it). */
void shoal_hub_url(const shoal_hub *h, const char *file, char *out, size_t n);

/* The whole file into a new buffer (*n bytes, NUL-terminated), at most max
 * bytes. SHOAL_ENOTFOUND when the hub has no such file (404): callers may
 * skip optional files. etag may be NULL. */
int shoal_hub_get(shoal_hub *h, const char *file, size_t max, char **buf, size_t *n, char *etag, size_t etaglen,
                  char *err, size_t errlen);

/* Fetch the n pieces, parallel transfers at a time. done may be NULL; prog
 * may be NULL. 0, or the first fatal error (err names the URL and bytes). */
int shoal_hub_fetch(shoal_hub *h, shoal_hub_piece *p, size_t n, shoal_hub_done_fn done, shoal_hub_progress_fn prog,
                    void *ctx, char *err, size_t errlen);

void shoal_hub_get_stats(const shoal_hub *h, shoal_hub_stats *s);

#endif
