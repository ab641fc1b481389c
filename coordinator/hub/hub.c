/* hub: whole files and byte ranges from a Hugging Face-style store over a
 * libcurl multi handle (hub.h). One loop drives up to `parallel` easy handles;
 * every response is checked at its headers (status, Content-Range,
 * Content-Digest, ETag) before its body is kept, and classified when it ends:
 * accepted, retried after a backoff, or fatal. */
#include <ctype.h>
#include <curl/curl.h>
#include <errno.h>
#include <math.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/hub/hub.h"

struct shoal_hub {
    char *endpoint, *repo, *rev, *ua;
    int has_token;
    struct curl_slist *hdrs;
    int parallel, retries;
    double backoff;
    long stall;
    void (*on_retry)(void *, const char *, double, int, int);
    void *retry_ctx;
    CURLM *multi;
    shoal_hub_stats st;
    struct {
        char *file, *url;
        char letag[128], cetag[128]; /* the hub's X-Linked-Etag and the final URL's ETag then */
    } *cdn; /* a file's last final URL (after the hub's redirect) */
    int ncdn;
};

static int cdn_find(const shoal_hub *h, const char *file)
{
    for (int i = 0; i < h->ncdn; i++)
        if (!strcmp(h->cdn[i].file, file) && h->cdn[i].url)
            return i;
    return -1;
}

static void cdn_set(shoal_hub *h, const char *file, const char *url, const char *letag, const char *cetag)
{
    int i = 0;
    while (i < h->ncdn && strcmp(h->cdn[i].file, file))
        i++;
    if (i == h->ncdn) {
        if (!url)
            return;
        h->cdn = shoal_xrealloc(h->cdn, (size_t)(h->ncdn + 1) * sizeof *h->cdn);
        memset(&h->cdn[i], 0, sizeof h->cdn[i]);
        h->cdn[h->ncdn++].file = shoal_xstrdup(file);
    }
    free(h->cdn[i].url);
    h->cdn[i].url = url ? shoal_xstrdup(url) : NULL;
    snprintf(h->cdn[i].letag, sizeof h->cdn[i].letag, "%s", url ? letag : "");
    snprintf(h->cdn[i].cetag, sizeof h->cdn[i].cetag, "%s", url ? cetag : "");
}

/* One transfer in flight: the piece it fills and what its responses said. */
typedef struct {
    CURL *e;
    shoal_hub *h;
    size_t idx;
    shoal_hub_piece *p;
    int whole; /* GET of a whole file into a growing buffer */
    int via_cdn; /* sent to a remembered final URL */
    int si;      /* the segment being written, and how far into it */
    uint64_t so;
    size_t max;
    char *buf;
    size_t cap;
    long status;
    int range_ok, refused_200, bad_range, too_many, too_big, io_err;
    char crange[160], etag[128], letag[128];
    double retry_after;
    int64_t clen; /* the final response's Content-Length; -1: none */
    int has_digest;
    uint8_t digest[32];
    crypto_hash_sha256_state sha;
    crypto_generichash_state b2;
    uint64_t got;
    char body[256];
    size_t nbody;
    char errbuf[CURL_ERROR_SIZE];
    shoal_hub_progress_fn prog;
    void *ctx;
} xfer;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int curl_ready(char *err, size_t errlen)
{
    static int done = 0;
    if (done)
        return 0;
    if (curl_global_init(CURL_GLOBAL_DEFAULT))
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "libcurl initialisation failed");
    if (sodium_init() < 0)
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "libsodium initialisation failed");
    done = 1;
    return 0;
}

static int repo_ok(const char *r)
{
    const char *s = strchr(r, '/');
    if (!s || s == r || !s[1] || strchr(s + 1, '/'))
        return 0;
    for (const char *c = r; *c; c++)
        if (*c != '/' && !isalnum((unsigned char)*c) && *c != '-' && *c != '_' && *c != '.')
            return 0;
    return strstr(r, "..") == NULL;
}

int shoal_hub_open(shoal_hub **out, const shoal_hub_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    int rc = curl_ready(err, errlen);
    if (rc)
        return rc;
    if (!o->repo || !repo_ok(o->repo))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--repo '%s' is not OWNER/NAME (letters, digits, '-', '_', '.')",
                             o->repo ? o->repo : "");
    if (!o->revision || !*o->revision)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "no --revision");
    const char *ep = o->endpoint && *o->endpoint ? o->endpoint : "https://huggingface.co";
    if (strncmp(ep, "http://", 7) && strncmp(ep, "https://", 8))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--endpoint '%s' is not an http:// or https:// URL", ep);
    if (o->token) {
        for (const char *c = o->token; *c; c++)
            if ((unsigned char)*c <= ' ' || *c == 0x7f)
                return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                     "the token holds a space or control character (it is not printed)");
        if (!*o->token)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "the token is empty");
    }
    shoal_hub *h = shoal_xcalloc(1, sizeof *h);
    size_t n = strlen(ep);
    h->endpoint = shoal_xstrdup(ep);
    while (n > 8 && h->endpoint[n - 1] == '/')
        h->endpoint[--n] = 0;
    h->repo = shoal_xstrdup(o->repo);
    h->ua = shoal_xstrdup(o->user_agent ? o->user_agent : "shoal");
    char *rev = curl_easy_escape(NULL, o->revision, 0);
    if (!rev)
        SHOAL_PANIC("curl_easy_escape");
    h->rev = shoal_xstrdup(rev);
    curl_free(rev);
    if (o->token) {
        size_t tn = strlen(o->token) + 32;
        char *line = shoal_xmalloc(tn);
        snprintf(line, tn, "Authorization: Bearer %s", o->token);
        h->hdrs = curl_slist_append(NULL, line);
        sodium_memzero(line, tn);
        free(line);
        h->has_token = 1;
    }
    h->parallel = o->parallel > 0 ? o->parallel : 8;
    h->retries = o->retries > 0 ? o->retries : o->retries < 0 ? 0 : 8;
    h->backoff = o->backoff_s > 0 ? o->backoff_s : 1.0;
    h->stall = o->stall_s > 0 ? o->stall_s : 60;
    h->on_retry = o->on_retry;
    h->retry_ctx = o->retry_ctx;
    h->multi = curl_multi_init();
    if (!h->multi)
        SHOAL_PANIC("curl_multi_init");
    curl_multi_setopt(h->multi, CURLMOPT_PIPELINING, (long)CURLPIPE_MULTIPLEX);
    curl_multi_setopt(h->multi, CURLMOPT_MAX_HOST_CONNECTIONS, (long)h->parallel);
    curl_multi_setopt(h->multi, CURLMOPT_MAXCONNECTS, (long)h->parallel * 2);
    *out = h;
    return 0;
}

void shoal_hub_close(shoal_hub *h)
{
    if (!h)
        return;
    curl_multi_cleanup(h->multi);
    curl_slist_free_all(h->hdrs); /* the token line: freed by libcurl (not wiped) */
    free(h->endpoint);
    free(h->repo);
    free(h->rev);
    free(h->ua);
    for (int i = 0; i < h->ncdn; i++) {
        free(h->cdn[i].file);
        free(h->cdn[i].url);
    }
    free(h->cdn);
    free(h);
}

void shoal_hub_get_stats(const shoal_hub *h, shoal_hub_stats *s)
{
    *s = h->st;
}

void shoal_hub_url(const shoal_hub *h, const char *file, char *out, size_t n)
{
    size_t k = (size_t)snprintf(out, n, "%s/%s/resolve/%s/", h->endpoint, h->repo, h->rev);
    /* escape each path segment of file */
    const char *s = file;
    while (*s && k < n) {
        const char *slash = strchr(s, '/');
        size_t len = slash ? (size_t)(slash - s) : strlen(s);
        char *esc = curl_easy_escape(NULL, s, (int)len);
        if (!esc)
            SHOAL_PANIC("curl_easy_escape");
        k += (size_t)snprintf(out + k, k < n ? n - k : 0, "%s%s", esc, slash ? "/" : "");
        curl_free(esc);
        s += len + (slash ? 1 : 0);
    }
}

static void trim_value(const char *v, size_t n, char *out, size_t cap)
{
    while (n && (*v == ' ' || *v == '\t'))
        v++, n--;
    while (n && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' '))
        n--;
    if (n >= cap)
        n = cap - 1;
    memcpy(out, v, n);
    out[n] = 0;
}

/* "bytes A-B/T" naming exactly the bytes asked for. */
static int crange_ok(const char *s, uint64_t off, uint64_t len, uint64_t *total)
{
    unsigned long long a, b, t;
    char tail;
    if (strncasecmp(s, "bytes ", 6) || sscanf(s + 6, "%llu-%llu/%llu%c", &a, &b, &t, &tail) != 3)
        return 0;
    if (a != off || b != off + len - 1 || t <= b)
        return 0;
    *total = t;
    return 1;
}

static size_t on_header(char *b, size_t sz, size_t nm, void *u)
{
    xfer *x = u;
    size_t n = sz * nm;
    if (n >= 5 && !strncmp(b, "HTTP/", 5)) { /* a new response (a redirect's, then the final one) */
        const char *sp = memchr(b, ' ', n);
        x->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        x->crange[0] = x->etag[0] = 0;
        x->has_digest = 0;
        x->retry_after = 0;
        x->clen = -1;
        return n;
    }
    if (n <= 2) { /* end of this response's headers */
        if (x->status == 200 && !x->whole) {
            x->refused_200 = 1;
            return 0; /* abort before the body: never a whole shard */
        }
        if (x->status == 206 && !x->whole) {
            uint64_t t;
            if (!crange_ok(x->crange, x->p->off, x->p->len, &t)) {
                x->bad_range = 1;
                return 0;
            }
            x->p->total = t;
            x->range_ok = 1;
        }
        return n;
    }
    const char *colon = memchr(b, ':', n);
    if (!colon)
        return n;
    size_t kn = (size_t)(colon - b), vn = n - kn - 1;
    const char *v = colon + 1;
    if (kn == 13 && !strncasecmp(b, "content-range", 13))
        trim_value(v, vn, x->crange, sizeof x->crange);
    else if (kn == 4 && !strncasecmp(b, "etag", 4))
        trim_value(v, vn, x->etag, sizeof x->etag);
    else if (kn == 14 && !strncasecmp(b, "content-length", 14)) {
        char tmp[32], *end = NULL;
        trim_value(v, vn, tmp, sizeof tmp);
        errno = 0;
        unsigned long long cl = strtoull(tmp, &end, 10);
        x->clen = tmp[0] >= '0' && tmp[0] <= '9' && !*end && !errno && cl <= INT64_MAX ? (int64_t)cl : -2;
    } else if (kn == 13 && !strncasecmp(b, "x-linked-etag", 13) && !x->letag[0])
        trim_value(v, vn, x->letag, sizeof x->letag);
    else if (kn == 11 && !strncasecmp(b, "retry-after", 11)) {
        char tmp[32];
        trim_value(v, vn, tmp, sizeof tmp);
        x->retry_after = atof(tmp);
    } else if (kn == 14 && !strncasecmp(b, "content-digest", 14)) {
        char tmp[512];
        trim_value(v, vn, tmp, sizeof tmp);
        char *s = strstr(tmp, "sha-256=:");
        if (s) {
            s += 9;
            char *e = strchr(s, ':');
            size_t bl = 0;
            if (e && !sodium_base642bin(x->digest, 32, s, (size_t)(e - s), NULL, &bl, NULL,
                                        sodium_base64_VARIANT_ORIGINAL) &&
                bl == 32)
                x->has_digest = 1;
        }
    }
    return n;
}

static size_t on_body(char *b, size_t sz, size_t nm, void *u)
{
    xfer *x = u;
    size_t n = sz * nm;
    if ((x->whole && x->status != 200) || (!x->whole && x->status != 206)) {
        size_t k = n < sizeof x->body - 1 - x->nbody ? n : sizeof x->body - 1 - x->nbody;
        memcpy(x->body + x->nbody, b, k);
        x->nbody += k;
        x->body[x->nbody] = 0;
        return n;
    }
    if (x->whole) {
        if (x->got + n > x->max) {
            x->too_big = 1;
            return 0;
        }
        if (x->got + n + 1 > x->cap) {
            x->cap = (x->got + n + 1) * 2;
            x->buf = shoal_xrealloc(x->buf, x->cap);
        }
        memcpy(x->buf + x->got, b, n);
    } else {
        if (!x->range_ok || x->got + n > x->p->len) {
            x->too_many = x->range_ok;
            return 0;
        }
        if (x->p->fd >= 0) {
            shoal_hub_seg one = {x->p->dst, x->p->len};
            const shoal_hub_seg *sg = x->p->nseg > 0 ? x->p->seg : &one;
            size_t w = 0;
            while (w < n) {
                while (x->so == sg[x->si].len) {
                    x->si++;
                    x->so = 0;
                }
                size_t k = n - w;
                if (k > sg[x->si].len - x->so)
                    k = (size_t)(sg[x->si].len - x->so);
                ssize_t r = pwrite(x->p->fd, b + w, k, (off_t)(sg[x->si].dst + x->so));
                if (r < 0 && errno == EINTR)
                    continue;
                if (r <= 0) {
                    x->io_err = r < 0 ? errno : EIO;
                    return 0;
                }
                w += (size_t)r;
                x->so += (uint64_t)r;
            }
        } else {
            memcpy((char *)x->p->mem + x->got, b, n);
        }
    }
    if (x->has_digest) /* only a response that carries one is hashed twice */
        crypto_hash_sha256_update(&x->sha, (const unsigned char *)b, n);
    crypto_generichash_update(&x->b2, (const unsigned char *)b, n);
    x->got += n;
    if (x->prog && !x->whole)
        x->prog(x->ctx, (int64_t)n);
    return n;
}

static void start(shoal_hub *h, xfer *x, shoal_hub_piece *p, size_t idx, int whole, size_t max)
{
    CURL *e = x->e;
    shoal_hub_progress_fn prog = x->prog;
    void *ctx = x->ctx;
    free(x->buf);
    memset(x, 0, sizeof *x);
    x->e = e;
    x->h = h;
    x->p = p;
    x->idx = idx;
    x->whole = whole;
    x->max = max;
    x->prog = prog;
    x->ctx = ctx;
    x->clen = -1;
    crypto_hash_sha256_init(&x->sha);
    crypto_generichash_init(&x->b2, NULL, 0, 32);
    char url[8192];
    int ci = whole ? -1 : cdn_find(h, p->file);
    const char *cached = ci >= 0 ? h->cdn[ci].url : NULL;
    if (cached)
        snprintf(url, sizeof url, "%s", cached);
    else
        shoal_hub_url(h, p->file, url, sizeof url);
    x->via_cdn = cached != NULL;
    size_t epn = strlen(h->endpoint);
    int same_host = !cached || (!strncmp(url, h->endpoint, epn) && url[epn] == '/');
    curl_easy_reset(e);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_PRIVATE, x);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    /* http and https only, for the request and for every redirect: a hub
     * that redirects to ftp:// or file:// is refused at once, never followed */
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(e, CURLOPT_MAXREDIRS, 10L);
    curl_easy_setopt(e, CURLOPT_USERAGENT, h->ua);
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_2TLS);
    curl_easy_setopt(e, CURLOPT_PIPEWAIT, 1L);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT, 30L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1024L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, h->stall);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->errbuf);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
    if (h->hdrs && same_host) /* never the token to a CDN host */
        curl_easy_setopt(e, CURLOPT_HTTPHEADER, h->hdrs);
    if (!whole) {
        char r[64];
        snprintf(r, sizeof r, "%llu-%llu", (unsigned long long)p->off, (unsigned long long)(p->off + p->len - 1));
        curl_easy_setopt(e, CURLOPT_RANGE, r);
    }
    curl_multi_add_handle(h->multi, e);
    h->st.requests++;
}

enum { DONE_OK = 0, DONE_RETRY = 1 };

/* What the finished transfer x means: DONE_OK, DONE_RETRY (why in msg) or a
 * negative fatal code (msg says what to do). */
static int classify(shoal_hub *h, xfer *x, CURLcode res, char *msg, size_t n)
{
    char url[8192];
    shoal_hub_url(h, x->p->file, url, sizeof url);
    char what[160];
    if (x->whole)
        snprintf(what, sizeof what, "%s", x->p->file);
    else
        snprintf(what, sizeof what, "%s bytes %llu-%llu", x->p->file, (unsigned long long)x->p->off,
                 (unsigned long long)(x->p->off + x->p->len - 1));
    if (x->refused_200)
        return shoal_err_set(msg, n, SHOAL_EPROTO,
                             "%s answered 200 with the whole file to a Range request for %s: the server ignores "
                             "HTTP Range, which shoal pull needs (it never downloads a whole shard)",
                             url, what);
    if (x->io_err)
        return shoal_err_set(msg, n, -x->io_err, "%s: writing the download failed: %s", what, strerror(x->io_err));
    if (x->too_big)
        return shoal_err_set(msg, n, SHOAL_ERANGE, "%s is larger than %zu bytes", url, x->max);
    if (x->bad_range) {
        shoal_err_set(msg, n, SHOAL_EPROTO, "%s: Content-Range '%s' is not the bytes asked for", what, x->crange);
        return DONE_RETRY;
    }
    if (x->too_many) {
        shoal_err_set(msg, n, SHOAL_EPROTO, "%s: the server sent more bytes than asked for", what);
        return DONE_RETRY;
    }
    long st = x->status;
    if (x->via_cdn && (st == 403 || st == 404 || st == 410)) { /* an expired signed URL: ask the hub again */
        cdn_set(h, x->p->file, NULL, NULL, NULL);
        shoal_err_set(msg, n, SHOAL_EPEER, "%s: HTTP %ld from the remembered CDN URL", what, st);
        return DONE_RETRY;
    }
    if (res == CURLE_UNSUPPORTED_PROTOCOL) { /* a redirect to ftp:// and the like: not retried */
        char *to = NULL;
        curl_easy_getinfo(x->e, CURLINFO_EFFECTIVE_URL, &to);
        return shoal_err_set(msg, n, SHOAL_EPROTO,
                             "%s: the server redirected to %.200s, which is not http:// or https:// (refused; shoal "
                             "pull follows only http and https)",
                             what, to && strcmp(to, url) ? to : "another protocol");
    }
    if (res != CURLE_OK) {
        shoal_err_set(msg, n, SHOAL_EIO, "%s: %s%s%s (after %llu of %llu bytes)", what, curl_easy_strerror(res),
                      x->errbuf[0] ? ": " : "", x->errbuf, (unsigned long long)x->got,
                      (unsigned long long)(x->whole ? 0 : x->p->len));
        return DONE_RETRY;
    }
    if (st == 401)
        return shoal_err_set(msg, n, SHOAL_EPEER,
                             "401 Unauthorized from %s: %s", url,
                             h->has_token ? "the hub refused the token (from HF_TOKEN or --token-file; it is not "
                                            "printed): check that it is valid"
                                          : "the repository needs a token: set HF_TOKEN or pass --token-file FILE");
    if (st == 403)
        return shoal_err_set(msg, n, SHOAL_EPEER,
                             "403 Forbidden from %s: the token has no access to %s (a gated repository: accept its "
                             "terms on the hub with this account first)",
                             url, h->repo);
    if (st == 404)
        return shoal_err_set(msg, n, SHOAL_ENOTFOUND,
                             "404 Not Found: %s (check --repo, --revision and that the file exists there)", url);
    if (st == 416)
        return shoal_err_set(msg, n, SHOAL_ERANGE,
                             "416 Range Not Satisfiable for %s: the file on the hub is shorter than its header says",
                             what);
    if (st == 408 || st == 429 || (st >= 500 && st <= 599)) {
        shoal_err_set(msg, n, SHOAL_EPEER, "%s: HTTP %ld%s%.120s", what, st, x->nbody ? ": " : "", x->body);
        return DONE_RETRY;
    }
    if (st != (x->whole ? 200 : 206))
        return shoal_err_set(msg, n, SHOAL_EPROTO, "%s: unexpected HTTP %ld from %s%s%.120s", what, st, url,
                             x->nbody ? ": " : "", x->body);
    /* every response's body is exactly its Content-Length, small files too
     * (libcurl lets a chunked body override a lying Content-Length) */
    if (x->clen == -2 || (x->clen >= 0 && x->got != (uint64_t)x->clen)) {
        char cl[32] = "unreadable";
        if (x->clen >= 0)
            snprintf(cl, sizeof cl, "%lld bytes", (long long)x->clen);
        shoal_err_set(msg, n, SHOAL_EIO, "%s: the body is %llu bytes, its Content-Length says %s: truncated, not kept",
                      what, (unsigned long long)x->got, cl);
        return DONE_RETRY;
    }
    if (!x->whole && x->got != x->p->len) {
        shoal_err_set(msg, n, SHOAL_EIO, "%s: the body was truncated (%llu of %llu bytes)", what,
                      (unsigned long long)x->got, (unsigned long long)x->p->len);
        return DONE_RETRY;
    }
    if (x->has_digest) {
        uint8_t got[32];
        crypto_hash_sha256_final(&x->sha, got);
        if (memcmp(got, x->digest, 32)) {
            shoal_err_set(msg, n, SHOAL_EIO, "%s: the bytes received do not match the response's Content-Digest",
                          what);
            return DONE_RETRY;
        }
    }
    const char *tag = x->letag[0] ? x->letag : x->etag;
    if (!x->whole && !x->via_cdn) {
        char *eff = NULL;
        curl_easy_getinfo(x->e, CURLINFO_EFFECTIVE_URL, &eff);
        if (eff && strcmp(eff, url))
            cdn_set(h, x->p->file, eff, x->letag, x->etag);
    } else if (x->via_cdn) { /* the tag the hub gave, unless the final URL's own ETag changed since */
        int ci = cdn_find(h, x->p->file);
        if (ci >= 0 && (!x->etag[0] || !h->cdn[ci].cetag[0] || !strcmp(x->etag, h->cdn[ci].cetag)) &&
            h->cdn[ci].letag[0])
            tag = h->cdn[ci].letag;
    }
    snprintf(x->p->etag, sizeof x->p->etag, "%s", tag);
    crypto_generichash_final(&x->b2, x->p->blake2b, 32);
    if (x->whole)
        x->p->total = x->got;
    return DONE_OK;
}

static double backoff(const shoal_hub *h, int attempt, double retry_after)
{
    double d = h->backoff * pow(2.0, attempt - 1);
    if (d > 60)
        d = 60;
    d *= 0.5 + 0.5 * (double)randombytes_uniform(1000) / 1000.0;
    if (retry_after > d)
        d = retry_after < 300 ? retry_after : 300;
    return d;
}

/* The transfer loop for n pieces (whole: each a whole-file GET into
 * memory, p->mem then owned by the caller). */
static int fetch_core(shoal_hub *h, shoal_hub_piece *p, size_t n, int whole, size_t max, shoal_hub_done_fn done,
                      shoal_hub_progress_fn prog, void *ctx, char *err, size_t errlen)
{
    if (!n)
        return 0;
    size_t ns = (size_t)h->parallel < n ? (size_t)h->parallel : n;
    xfer *xs = shoal_xcalloc(ns, sizeof *xs);
    unsigned char *state = shoal_xcalloc(n, 1); /* 0 waiting, 1 in flight, 2 done */
    int *att = shoal_xcalloc(n, sizeof *att);
    double *after = shoal_xcalloc(n, sizeof *after);
    char *last = shoal_xcalloc(n, 512);
    for (size_t k = 0; k < ns; k++) {
        xs[k].e = curl_easy_init();
        if (!xs[k].e)
            SHOAL_PANIC("curl_easy_init");
        xs[k].idx = (size_t)-1;
        xs[k].prog = prog;
        xs[k].ctx = ctx;
    }
    size_t ndone = 0, first = 0, active = 0;
    int rc = 0;
    while (ndone < n && !rc) {
        double t = now_s(), wake = -1;
        while (first < n && state[first] == 2)
            first++;
        for (size_t k = 0; k < ns; k++) {
            if (xs[k].idx != (size_t)-1)
                continue;
            size_t i = first;
            for (; i < n; i++) {
                if (state[i] == 0 && after[i] <= t)
                    break;
            }
            if (i == n)
                break;
            state[i] = 1;
            start(h, &xs[k], &p[i], i, whole, max);
            active++;
        }
        for (size_t i = first; i < n; i++)
            if (state[i] == 0 && after[i] > t && (wake < 0 || after[i] < wake))
                wake = after[i];
        int running = 0;
        curl_multi_perform(h->multi, &running);
        CURLMsg *m;
        int q;
        while ((m = curl_multi_info_read(h->multi, &q)) && !rc) {
            if (m->msg != CURLMSG_DONE)
                continue;
            xfer *x = NULL;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
            CURLcode res = m->data.result;
            curl_multi_remove_handle(h->multi, x->e);
            active--;
            long ver = 0;
            curl_easy_getinfo(x->e, CURLINFO_HTTP_VERSION, &ver);
            if (ver == CURL_HTTP_VERSION_2_0)
                h->st.http2 = 1;
            size_t i = x->idx;
            char *why = last + i * 512;
            int c = classify(h, x, res, why, 512);
            if (c == DONE_OK && done) {
                c = done(ctx, x->p, why, 512);
                if (c > 0)
                    c = DONE_RETRY;
            }
            if (c == DONE_OK) {
                state[i] = 2;
                ndone++;
                h->st.bytes += x->got;
                if (whole) {
                    x->p->mem = x->buf ? x->buf : shoal_xcalloc(1, 1);
                    ((char *)x->p->mem)[x->got] = 0;
                    x->p->len = x->got;
                    x->buf = NULL;
                }
            } else {
                h->st.discarded += x->got;
                if (prog && !whole && x->got)
                    prog(ctx, -(int64_t)x->got);
                if (c == DONE_RETRY && att[i] < h->retries) {
                    att[i]++;
                    h->st.retried++;
                    double wait = backoff(h, att[i], x->retry_after);
                    after[i] = now_s() + wait;
                    if (h->on_retry)
                        h->on_retry(h->retry_ctx, why, wait, att[i] + 1, h->retries + 1);
                    state[i] = 0;
                    if (i < first)
                        first = i;
                } else if (c == DONE_RETRY) {
                    rc = shoal_err_set(err, errlen, SHOAL_EIO, "giving up after %d attempts: %s", att[i] + 1, why);
                } else {
                    rc = shoal_err_set(err, errlen, c, "%s", why);
                }
            }
            x->idx = (size_t)-1;
        }
        if (rc || ndone == n)
            break;
        int ms = 200;
        if (!active && wake > 0) {
            double d = wake - now_s();
            ms = d <= 0 ? 0 : d > 1 ? 1000 : (int)(d * 1000) + 1;
        }
        curl_multi_poll(h->multi, NULL, 0, ms, NULL);
    }
    for (size_t k = 0; k < ns; k++) {
        if (xs[k].idx != (size_t)-1)
            curl_multi_remove_handle(h->multi, xs[k].e);
        curl_easy_cleanup(xs[k].e);
        free(xs[k].buf);
    }
    free(xs);
    free(state);
    free(att);
    free(after);
    free(last);
    return rc;
}

int shoal_hub_fetch(shoal_hub *h, shoal_hub_piece *p, size_t n, shoal_hub_done_fn done, shoal_hub_progress_fn prog,
                    void *ctx, char *err, size_t errlen)
{
    for (size_t i = 0; i < n; i++)
        if (!p[i].len || (p[i].fd < 0 && !p[i].mem))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s: an empty range or no destination", p[i].file);
    return fetch_core(h, p, n, 0, 0, done, prog, ctx, err, errlen);
}

int shoal_hub_get(shoal_hub *h, const char *file, size_t max, char **buf, size_t *n, char *etag, size_t etaglen,
                  char *err, size_t errlen)
{
    shoal_hub_piece p = {.file = file, .fd = -1};
    *buf = NULL;
    *n = 0;
    int rc = fetch_core(h, &p, 1, 1, max, NULL, NULL, NULL, err, errlen);
    if (rc)
        return rc;
    *buf = p.mem;
    *n = (size_t)p.len;
    if (etag)
        snprintf(etag, etaglen, "%s", p.etag);
    return 0;
}
