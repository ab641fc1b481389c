/* HTTP/1.1 server: the only libuv user in the tree. Owns the event loop, the
 * listening socket and every client connection; parses requests with the
 * Debian http-parser library under hard limits (header bytes, header count,
 * body bytes), keeps connections alive between requests, times out slow and
 * idle clients, and writes plain, chunked and server-sent-event responses.
 * It knows nothing of the model: each complete request is handed to one
 * callback (on the loop thread) as an exchange, which the callback -- or a
 * later callback posted from another thread with shoal_http_post -- answers.
 * Callers: the OpenAI API layer (coordinator/api/api.c), `shoal serve`, tests.
 *
 * Threads: one thread runs shoal_http_run and owns the loop; every function
 * here must be called on that thread, except shoal_http_post and
 * shoal_http_stop, which any thread may call until shoal_http_close.
 *
 * Exchanges: on_request receives an exchange that must be ended exactly once,
 * by shoal_http_respond or shoal_http_stream_end (immediately or later, always
 * on the loop thread). The request fields (method, path, headers, body) are
 * valid only during on_request: copy what you keep. If the client goes away
 * first, the abort callback (if set) runs once on the loop thread; later
 * writes are silently dropped, and the owner must still end the exchange,
 * which then only frees it. While an exchange is open the connection reads no
 * further request (pipelined bytes wait: one request in flight per
 * connection), but still notices a disconnect: a reset, or an EOF (FIN)
 * while an exchange with an abort callback is open -- TCP cannot tell a
 * half-close from a client that is gone, and such an exchange (a generation)
 * would otherwise run to its end for nobody; its abort callback runs. A client
 * that half-closes otherwise (EOF after requests answered at once) still gets
 * its answers, then the connection closes.
 * A HEAD request is handed over like GET; the response's body is not sent. 
 *
 * The pure request parser (shoal_http_parser_*) is exported separately so that
 * tests and the fuzz target can drive it without sockets. */
#ifndef SHOAL_HTTP_H
#define SHOAL_HTTP_H

#include <stddef.h>
#include <stdint.h>

/* ---- request parser (no I/O) --------------------------------------------- */

#define SHOAL_HTTP_MAX_HEADERS 64

typedef struct {
    const char *method;   /* "GET", "POST", ... */
    const char *url;      /* request target as received (path and query) */
    const char *path;     /* the target without "?query" (not percent-decoded) */
    int http_major, http_minor;
    int keep_alive;       /* the connection may serve another request after this */
    int nheaders;
    const char *name[SHOAL_HTTP_MAX_HEADERS];  /* lower-cased */
    const char *value[SHOAL_HTTP_MAX_HEADERS]; /* as received, surrounding blanks trimmed */
    const char *body;     /* NUL-terminated copy (chunked bodies de-chunked) */
    size_t body_len;
} shoal_http_request;

typedef struct shoal_http_parser shoal_http_parser;

/* Limits: max_header_bytes bounds the request line plus all header lines
 * (exceeded -> 431), max_body_bytes the decoded body (exceeded, or a larger
 * Content-Length announced -> 413). Both required, > 0. */
int shoal_http_parser_create(shoal_http_parser **out, size_t max_header_bytes, size_t max_body_bytes,
                             char *err, size_t errlen);
void shoal_http_parser_free(shoal_http_parser *p); /* accepts NULL */

/* Feeds bytes. Returns how many were consumed (parsing stops right after a
 * complete request, so the rest belongs to the next one), or -1 on a request
 * the server must refuse: *status receives the HTTP status to answer (400,
 * 413, 417, 431, 505) and shoal_http_parser_error the reason; the connection
 * must then be closed. A consumed count of 0 with len > 0 means a complete
 * request is pending (call shoal_http_parser_next first). */
long shoal_http_parser_feed(shoal_http_parser *p, const char *data, size_t len, int *status);
/* The complete request, or NULL while it is still incomplete. Borrowed: valid
 * until shoal_http_parser_next or _free. */
const shoal_http_request *shoal_http_parser_request(const shoal_http_parser *p);
/* Forget the current request and parse the next one. */
void shoal_http_parser_next(shoal_http_parser *p);
/* 1 while a request has started (some bytes of it consumed) but is not complete. */
int shoal_http_parser_in_progress(const shoal_http_parser *p);
/* 1, once per request, when its headers asked for "Expect: 100-continue" and
 * its body has not been read yet: the server sends the interim response. */
int shoal_http_parser_take_continue(shoal_http_parser *p);
const char *shoal_http_parser_error(const shoal_http_parser *p);

/* Header lookup, name case-insensitive; NULL when absent. */
const char *shoal_http_request_header(const shoal_http_request *r, const char *name);

/* ---- server -------------------------------------------------------------- */

typedef struct shoal_http shoal_http;
typedef struct shoal_http_ex shoal_http_ex;

typedef void (*shoal_http_request_fn)(void *ud, shoal_http_ex *ex, const shoal_http_request *req);

typedef struct {
    const char *host;         /* bind address (IPv4 or IPv6 literal); required */
    int port;                 /* 0: an ephemeral port (see shoal_http_port) */
    size_t max_header_bytes;  /* required, > 0 */
    size_t max_body_bytes;    /* required, > 0 */
    /* Live client connections in all, and from one address (0: no
     * per-address limit). When a limit is reached the oldest idle connection
     * is closed to make room; with none idle the new one is closed at once.
     * max_connections required, > 0. */
    int max_connections;
    int max_per_addr;
    /* Deadlines in milliseconds, all required, > 0:
     *   request: first byte of a request until it is complete (slow senders
     *            get 408 and are closed);
     *   idle:    a kept-alive connection waiting for its next request;
     *   write:   queued response bytes making no progress (a client that
     *            stopped reading is dropped). */
    int request_timeout_ms;
    /* header: a new connection's first byte, and a request's line and
     * headers from its first byte (kept below request and idle); 0: the
     * request deadline. Much shorter than idle, so silent connections do not
     * hold slots for the keep-alive time. */
    int header_timeout_ms;
    int idle_timeout_ms;
    int write_timeout_ms;
    /* Response bytes queued but unsent for one connection (each write's
     * bookkeeping counted too) before the client is dropped as too slow;
     * required, > 0. Beyond 64 KiB queued, pipelined requests of the
     * connection are neither parsed nor read until the client reads. */
    size_t max_write_queue;
    int handle_signals;       /* 1: SIGINT/SIGTERM stop the loop */
    shoal_http_request_fn on_request; /* required */
    void *ud;
} shoal_http_opts;

/* Counters (loop thread; read with shoal_http_get_stats). */
typedef struct {
    uint64_t connections;     /* accepted */
    uint64_t refused_connections; /* over a limit with no idle one to close */
    uint64_t evicted_connections; /* idle ones closed to make room */
    uint64_t requests;        /* complete requests handed to on_request */
    uint64_t bad_requests;    /* refused by the parser (400/413/417/431/505) */
    uint64_t timeouts;        /* request or write deadlines hit */
    uint64_t aborted;         /* exchanges whose client went away first */
    uint64_t bytes_in, bytes_out;
    int open_connections;
} shoal_http_stats;

/* Creates the loop, binds and listens (so an address in use is reported here,
 * naming it). */
int shoal_http_open(shoal_http **out, const shoal_http_opts *o, char *err, size_t errlen);
/* Runs the loop on the calling thread until shoal_http_stop (or a signal with
 * handle_signals); then closes the listener and every connection (aborting
 * open exchanges) and runs the posted callbacks still queued. Returns 0. */
int shoal_http_run(shoal_http *h);
/* Any thread: make shoal_http_run return soon. */
void shoal_http_stop(shoal_http *h);
/* After shoal_http_run returned and no other thread can still post.
 * Accepts NULL. */
void shoal_http_close(shoal_http *h);
int shoal_http_port(const shoal_http *h); /* the bound port */
void shoal_http_get_stats(const shoal_http *h, shoal_http_stats *out);

/* Any thread: run fn(arg) on the loop thread soon, in posting order. Never
 * blocks beyond a short lock. Returns 0 (fn then runs exactly once, at the
 * latest at the end of shoal_http_run), or SHOAL_EINVAL once the server is
 * stopping (fn does not run and the caller keeps arg). */
int shoal_http_post(shoal_http *h, void (*fn)(void *arg), void *arg);

/* Loop thread: run work(arg) on libuv's thread pool (off the loop, so a long
 * piece of work -- parsing a 4 MB request -- does not stall every other
 * connection), then done(arg, canceled) back on the loop thread; canceled is
 * 1 when the pool dropped the work unrun (stopping). 0, or SHOAL_EINVAL when
 * it cannot be queued (the caller keeps arg and may run both itself). */
int shoal_http_work(shoal_http *h, void (*work)(void *arg), void (*done)(void *arg, int canceled), void *arg);

/* ---- exchanges (loop thread) ---------------------------------------------- */

/* Peer address ("127.0.0.1", "::1"), valid until the exchange ends. */
const char *shoal_http_ex_peer(const shoal_http_ex *ex);
/* 1 once the client has gone away (writes are then dropped). */
int shoal_http_ex_aborted(const shoal_http_ex *ex);
/* cb(arg) runs once if the client goes away before the exchange ends. */
void shoal_http_ex_on_abort(shoal_http_ex *ex, void (*cb)(void *arg), void *arg);

/* extra_headers: NULL or complete "Name: value\r\n" lines built by the caller
 * from trusted text (never from request bytes unchecked). */
int shoal_http_respond(shoal_http_ex *ex, int status, const char *content_type, const char *extra_headers,
                       const void *body, size_t len);
/* Starts a streamed body (chunked on HTTP/1.1; on HTTP/1.0 the connection
 * closes at the end instead). */
int shoal_http_stream_begin(shoal_http_ex *ex, int status, const char *content_type,
                            const char *extra_headers);
int shoal_http_stream_write(shoal_http_ex *ex, const void *data, size_t len);
/* Ends a streamed exchange (or frees an aborted one). */
int shoal_http_stream_end(shoal_http_ex *ex);

const char *shoal_http_status_text(int status);

#endif
