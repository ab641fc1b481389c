/* HTTP layer: the request parser on hand-written requests (limits, chunked
 * bodies, pipelining, byte-at-a-time delivery), and the server over loopback
 * sockets (keep-alive, chunked streaming from another thread, slow and idle
 * clients, a disconnect aborting an open exchange, a client that stops
 * reading). Expected values are the HTTP/1.1 rules (RFC 9112), not the code. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/api/http.h"
#include "tests/unit/test.h"

/* ---- parser -------------------------------------------------------------- */

static shoal_http_parser *mk(size_t hdr, size_t body)
{
    shoal_http_parser *p;
    char err[128];
    if (shoal_http_parser_create(&p, hdr, body, err, sizeof err))
        return NULL;
    return p;
}

static void t_parse_get(void)
{
    shoal_http_parser *p = mk(4096, 1024);
    const char *r = "GET /v1/models?x=1 HTTP/1.1\r\nHost: a\r\nX-Thing:  v  \r\nEmpty:\r\n\r\n";
    int st;
    long n = shoal_http_parser_feed(p, r, strlen(r), &st);
    CHECK_EQ_INT(n, (long)strlen(r));
    const shoal_http_request *q = shoal_http_parser_request(p);
    CHECK(q != NULL);
    if (q) {
        CHECK(!strcmp(q->method, "GET"));
        CHECK(!strcmp(q->url, "/v1/models?x=1"));
        CHECK(!strcmp(q->path, "/v1/models"));
        CHECK_EQ_INT(q->keep_alive, 1);
        CHECK_EQ_INT(q->nheaders, 3);
        CHECK(!strcmp(shoal_http_request_header(q, "x-thing"), "v"));
        CHECK(!strcmp(shoal_http_request_header(q, "HOST"), "a"));
        CHECK(!strcmp(shoal_http_request_header(q, "empty"), ""));
        CHECK(shoal_http_request_header(q, "absent") == NULL);
        CHECK_EQ_INT(q->body_len, 0);
    }
    shoal_http_parser_free(p);
}

static void t_parse_pipelined_and_bytewise(void)
{
    const char *r = "POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
                    "POST /b HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                    "3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                    "GET /c HTTP/1.0\r\n\r\n";
    const char *paths[] = {"/a", "/b", "/c"}, *bodies[] = {"hello", "abcde", ""};
    int keep[] = {1, 1, 0};
    for (int bytewise = 0; bytewise < 2; bytewise++) {
        shoal_http_parser *p = mk(4096, 1024);
        size_t off = 0, len = strlen(r);
        int got = 0;
        while (off < len && got < 3) {
            int st;
            size_t give = bytewise ? 1 : len - off;
            long n = shoal_http_parser_feed(p, r + off, give, &st);
            CHECK(n >= 0);
            if (n < 0)
                break;
            off += (size_t)n;
            const shoal_http_request *q = shoal_http_parser_request(p);
            if (q) {
                CHECK(!strcmp(q->path, paths[got]));
                CHECK_EQ_INT(q->body_len, strlen(bodies[got]));
                CHECK(!strcmp(q->body, bodies[got]));
                CHECK_EQ_INT(q->keep_alive, keep[got]);
                got++;
                shoal_http_parser_next(p);
            }
        }
        CHECK_EQ_INT(got, 3);
        CHECK_EQ_INT(off, len);
        shoal_http_parser_free(p);
    }
}

static int feed_status(size_t hdr, size_t body, const char *r)
{
    shoal_http_parser *p = mk(hdr, body);
    int st = 0;
    long n = shoal_http_parser_feed(p, r, strlen(r), &st);
    if (n >= 0)
        st = shoal_http_parser_request(p) ? 0 : -1; /* -1: incomplete */
    shoal_http_parser_free(p);
    return st;
}

static void t_parse_refusals(void)
{
    /* headers over the byte limit */
    char big[2048];
    snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: h\r\nX: %0600d\r\n\r\n", 0);
    CHECK_EQ_INT(feed_status(512, 1024, big), 431);
    CHECK_EQ_INT(feed_status(1024, 1024, big), 0);
    /* a URL alone over the limit */
    char url[1200] = "GET /";
    memset(url + 5, 'a', 900);
    strcpy(url + 905, " HTTP/1.1\r\nHost: h\r\n\r\n");
    CHECK_EQ_INT(feed_status(512, 1024, url), 431);
    /* too many header fields */
    char many[8192] = "GET / HTTP/1.1\r\nHost: h\r\n";
    for (int i = 0; i < SHOAL_HTTP_MAX_HEADERS + 1; i++)
        snprintf(many + strlen(many), sizeof many - strlen(many), "X%d: y\r\n", i);
    strcat(many, "\r\n");
    CHECK_EQ_INT(feed_status(8192, 1024, many), 431);
    /* declared body over the limit: refused before any body byte arrives */
    CHECK_EQ_INT(feed_status(4096, 10, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n\r\n"), 413);
    CHECK_EQ_INT(feed_status(4096, 10, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\n0123456789"), 0);
    /* chunked body over the limit */
    CHECK_EQ_INT(feed_status(4096, 10, "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                                       "6\r\nabcdef\r\n6\r\nabcdef\r\n0\r\n\r\n"),
                 413);
    /* both Content-Length and chunked (request smuggling) */
    CHECK_EQ_INT(feed_status(4096, 100, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n"
                                        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
                 400);
    /* two different Content-Length values */
    CHECK_EQ_INT(feed_status(4096, 100, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n"
                                        "Content-Length: 4\r\n\r\nabcd"),
                 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\n\r\n"), 400);          /* no Host */
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/2.0\r\nHost: h\r\n\r\n"), 505);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / FTP/1.1\r\nHost: h\r\n\r\n"), 400);
    /* a well-formed line with a method nobody implements: 501 (RFC 9110 15.6.2) */
    CHECK_EQ_INT(feed_status(4096, 100, "BREW / HTTP/1.1\r\nHost: h\r\n\r\n"), 501);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost h\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GET /\x01 HTTP/1.1\r\nHost: h\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
                                        "zz\r\n"),
                 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: h\r\nExpect: teapot\r\n\r\n"), 417);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: h\r\n"), -1); /* incomplete */
    /* a refused parser stays refused */
    shoal_http_parser *p = mk(4096, 100);
    int st;
    CHECK(shoal_http_parser_feed(p, "xx\r\n", 4, &st) < 0);
    CHECK_EQ_INT(st, 400);
    CHECK(shoal_http_parser_feed(p, "GET / HTTP/1.1\r\n\r\n", 18, &st) < 0);
    CHECK_STR_CONTAINS(shoal_http_parser_error(p), "malformed");
    shoal_http_parser_free(p);
}

static void t_parse_continue(void)
{
    shoal_http_parser *p = mk(4096, 100);
    const char *h = "POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n";
    int st;
    CHECK_EQ_INT(shoal_http_parser_feed(p, h, strlen(h), &st), (long)strlen(h));
    CHECK(shoal_http_parser_in_progress(p));
    CHECK_EQ_INT(shoal_http_parser_take_continue(p), 1);
    CHECK_EQ_INT(shoal_http_parser_take_continue(p), 0);
    CHECK_EQ_INT(shoal_http_parser_feed(p, "ok", 2, &st), 2);
    CHECK(shoal_http_parser_request(p) != NULL);
    shoal_http_parser_free(p);
}


/* Issue 20 item 12: the smaller HTTP defects, each by its rule. */
/* Offers one more byte at a time (bytes not consumed are offered again, as
 * the server does). Returns the refusal status or 0. */
static int feed_bytewise(const char *r, const shoal_http_request **q, shoal_http_parser **pp)
{
    shoal_http_parser *p = mk(4096, 1024);
    size_t off = 0, avail = 0, len = strlen(r);
    int st = 0;
    while (off + avail < len && !shoal_http_parser_request(p)) {
        avail++;
        long n = shoal_http_parser_feed(p, r + off, avail, &st);
        if (n < 0)
            break;
        off += (size_t)n;
        avail -= (size_t)n;
    }
    *q = shoal_http_parser_request(p);
    *pp = p;
    return st;
}

static void t_parse_two_hosts_and_obs_fold_refused(void)
{
    /* RFC 9112 3.2: a request with more than one Host is a 400 */
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"), 400);
    /* RFC 9112 5.2: obs-fold may be refused with 400 (we do) */
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: a\r\nX: one\r\n two\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: a\r\nX: one\r\n\ttwo\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: a\r\nX:\r\n two\r\n\r\n"), 400);
    /* a value with inner blanks is not a fold */
    CHECK_EQ_INT(feed_status(4096, 100, "GET / HTTP/1.1\r\nHost: a\r\nX: one two\r\n\r\n"), 0);
    /* the fold split across feeds is still seen */
    const shoal_http_request *q;
    shoal_http_parser *p;
    CHECK_EQ_INT(feed_bytewise("GET / HTTP/1.1\r\nHost: a\r\nX: one\r\n two\r\n\r\n", &q, &p), 400);
    shoal_http_parser_free(p);
    CHECK_EQ_INT(feed_bytewise("GET / HTTP/1.1\r\nHost: a\r\nX: one two\r\n\r\n", &q, &p), 0);
    CHECK(q != NULL);
    shoal_http_parser_free(p);
}

static void t_parse_unknown_method_501_bytewise(void)
{
    const shoal_http_request *q;
    shoal_http_parser *p;
    CHECK_EQ_INT(feed_bytewise("BREW /pot HTTP/1.1\r\nHost: a\r\n\r\n", &q, &p), 501);
    CHECK_STR_CONTAINS(shoal_http_parser_error(p), "BREW");
    shoal_http_parser_free(p);
    /* not a request line at all: 400, at once (a TLS hello waits for nothing) */
    CHECK_EQ_INT(feed_status(4096, 100, "\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "GARBAGE\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "BREW / FTP/1.1\r\n\r\n"), 400);
    CHECK_EQ_INT(feed_status(4096, 100, "BREW /"), -1); /* can still become a request line */
}

static void t_parse_absolute_form_routed_by_path(void)
{
    shoal_http_parser *p = mk(4096, 1024);
    const char *r = "GET http://example.com:8000/v1/models?x=1 HTTP/1.1\r\nHost: example.com\r\n\r\n";
    int st;
    CHECK_EQ_INT(shoal_http_parser_feed(p, r, strlen(r), &st), (long)strlen(r));
    const shoal_http_request *q = shoal_http_parser_request(p);
    CHECK(q && !strcmp(q->path, "/v1/models"));
    shoal_http_parser_free(p);
    p = mk(4096, 1024);
    r = "GET HTTP://h HTTP/1.1\r\nHost: h\r\n\r\n";
    CHECK_EQ_INT(shoal_http_parser_feed(p, r, strlen(r), &st), (long)strlen(r));
    q = shoal_http_parser_request(p);
    CHECK(q && !strcmp(q->path, "/"));
    shoal_http_parser_free(p);
}

static void t_parse_chunk_size_overflow_named(void)
{
    shoal_http_parser *p = mk(4096, 1024);
    const char *r = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n";
    int st;
    CHECK_EQ_INT(shoal_http_parser_feed(p, r, strlen(r), &st), -1);
    CHECK_EQ_INT(st, 400);
    CHECK_STR_CONTAINS(shoal_http_parser_error(p), "chunk size");
    CHECK(strstr(shoal_http_parser_error(p), "content-length") == NULL);
    shoal_http_parser_free(p);
}

/* ---- server -------------------------------------------------------------- */

typedef struct {
    shoal_http *h;
    pthread_t loop_thread;
    atomic_int aborts;
    atomic_int requests;
} srv;

typedef struct {
    srv *s;
    shoal_http_ex *ex;
    int step;
} streamer;

static void stream_step(void *arg);

static void *stream_thread(void *arg)
{
    streamer *st = arg;
    for (int i = 0; i < 3; i++) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
        shoal_http_post(st->s->h, stream_step, st);
    }
    return NULL;
}

static void stream_step(void *arg)
{
    streamer *st = arg;
    char buf[64];
    int n = snprintf(buf, sizeof buf, "data: %d\n\n", st->step);
    shoal_http_stream_write(st->ex, buf, (size_t)n);
    if (++st->step == 3) {
        shoal_http_stream_end(st->ex);
        free(st);
    }
}

typedef struct {
    srv *s;
    shoal_http_ex *ex;
} held;

static void held_abort(void *arg)
{
    held *hd = arg;
    atomic_fetch_add(&hd->s->aborts, 1);
    CHECK(shoal_http_ex_aborted(hd->ex));
    shoal_http_stream_end(hd->ex); /* the owner still ends it: frees it */
    free(hd);
}

static void handler(void *ud, shoal_http_ex *ex, const shoal_http_request *req)
{
    srv *s = ud;
    atomic_fetch_add(&s->requests, 1);
    if (!strcmp(req->path, "/echo")) {
        shoal_http_respond(ex, 200, "text/plain", "X-Test: 1\r\n", req->body, req->body_len);
    } else if (!strcmp(req->path, "/stream")) {
        shoal_http_stream_begin(ex, 200, "text/event-stream", NULL);
        streamer *st = calloc(1, sizeof *st);
        st->s = s;
        st->ex = ex;
        pthread_t t;
        pthread_create(&t, NULL, stream_thread, st);
        pthread_detach(t);
    } else if (!strcmp(req->path, "/hold")) {
        held *hd = calloc(1, sizeof *hd);
        hd->s = s;
        hd->ex = ex;
        shoal_http_stream_begin(ex, 200, "text/event-stream", NULL);
        shoal_http_stream_write(ex, "data: 0\n\n", 9);
        shoal_http_ex_on_abort(ex, held_abort, hd);
    } else if (!strcmp(req->path, "/flood")) {
        /* a large response to a client that does not read it */
        shoal_http_stream_begin(ex, 200, "application/octet-stream", NULL);
        static char chunk[65536];
        held *hd = calloc(1, sizeof *hd);
        hd->s = s;
        hd->ex = ex;
        shoal_http_ex_on_abort(ex, held_abort, hd);
        for (int i = 0; i < 256 && !shoal_http_ex_aborted(ex); i++)
            shoal_http_stream_write(ex, chunk, sizeof chunk);
    } else {
        shoal_http_respond(ex, 404, NULL, NULL, "{}", 2);
    }
}

static void *loop_main(void *arg)
{
    srv *s = arg;
    shoal_http_run(s->h);
    return NULL;
}

static int write_timeout_ms = 300;

static int srv_start(srv *s, int req_ms, int idle_ms)
{
    memset(s, 0, sizeof *s);
    shoal_http_opts o = {
        .host = "127.0.0.1",
        .port = 0,
        .max_header_bytes = 4096,
        .max_body_bytes = 65536,
        .max_connections = 8,
        .request_timeout_ms = req_ms,
        .idle_timeout_ms = idle_ms,
        .write_timeout_ms = write_timeout_ms,
        .max_write_queue = 1 << 20,
        .on_request = handler,
        .ud = s,
    };
    char err[256];
    if (shoal_http_open(&s->h, &o, err, sizeof err)) {
        fprintf(stderr, "open: %s\n", err);
        return -1;
    }
    pthread_create(&s->loop_thread, NULL, loop_main, s);
    return shoal_http_port(s->h);
}

static void srv_stop(srv *s)
{
    shoal_http_stop(s->h);
    pthread_join(s->loop_thread, NULL);
    shoal_http_close(s->h);
}

static int dial(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads until `want` appears, EOF, or the deadline. Returns bytes read; *eof
 * is set when the peer closed. */
static size_t read_until(int fd, char *buf, size_t cap, const char *want, int ms, int *eof)
{
    size_t n = 0;
    *eof = 0;
    buf[0] = '\0';
    while (n + 1 < cap) {
        if (want && strstr(buf, want))
            break;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, ms) <= 0)
            break;
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r <= 0) {
            *eof = 1;
            break;
        }
        n += (size_t)r;
        buf[n] = '\0';
    }
    return n;
}

static void sends(int fd, const char *s)
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void t_server_keepalive_and_pipelining(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    CHECK(port > 0);
    int fd = dial(port);
    CHECK(fd >= 0);
    char buf[8192];
    int eof;
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc");
    read_until(fd, buf, sizeof buf, "abc", 2000, &eof);
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 200 OK\r\n");
    CHECK_STR_CONTAINS(buf, "Content-Length: 3\r\n");
    CHECK_STR_CONTAINS(buf, "Connection: keep-alive\r\n");
    CHECK_STR_CONTAINS(buf, "X-Test: 1\r\n");
    CHECK(!eof);
    /* two pipelined requests, answered in order on the same connection */
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nfirst"
              "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nConnection: close\r\n\r\nsecond");
    size_t n = read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK(n > 0);
    CHECK(eof); /* Connection: close honoured */
    char *a = strstr(buf, "first"), *b = strstr(buf, "second");
    CHECK(a && b && a < b);
    CHECK_STR_CONTAINS(buf, "Connection: close\r\n");
    close(fd);
    srv_stop(&s);
    CHECK_EQ_INT(atomic_load(&s.requests), 3);
}

static void t_server_stream_from_thread(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    int fd = dial(port);
    char buf[8192];
    int eof;
    sends(fd, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    read_until(fd, buf, sizeof buf, "0\r\n\r\n", 3000, &eof);
    CHECK_STR_CONTAINS(buf, "Transfer-Encoding: chunked\r\n");
    CHECK_STR_CONTAINS(buf, "Content-Type: text/event-stream\r\n");
    /* each event is one chunk: size in hex, the data, CRLF */
    CHECK_STR_CONTAINS(buf, "9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n");
    /* the connection is reusable after the stream */
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
    read_until(fd, buf, sizeof buf, "\r\n\r\nok", 2000, &eof);
    CHECK_STR_CONTAINS(buf, "\r\n\r\nok");
    close(fd);
    /* HTTP/1.0: no chunked coding, the close ends the body */
    fd = dial(port);
    sends(fd, "GET /stream HTTP/1.0\r\n\r\n");
    read_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    CHECK(eof);
    CHECK(strstr(buf, "Transfer-Encoding") == NULL);
    CHECK_STR_CONTAINS(buf, "\r\n\r\ndata: 0\n\ndata: 1\n\ndata: 2\n\n");
    close(fd);
    srv_stop(&s);
}

static void t_server_refusals_answered(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    char buf[8192];
    int eof;
    int fd = dial(port);
    sends(fd, "GARBAGE\r\n\r\n");
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 400 Bad Request\r\n");
    CHECK_STR_CONTAINS(buf, "\"error\":{\"message\":");
    CHECK(eof);
    close(fd);
    fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n");
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 413 ");
    CHECK(eof);
    close(fd);
    fd = dial(port);
    char big[6000];
    snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: x\r\nX: %05000d\r\n\r\n", 0);
    sends(fd, big);
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 431 ");
    close(fd);
    srv_stop(&s);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void t_server_slow_and_idle_clients(void)
{
    srv s;
    int port = srv_start(&s, 300, 400);
    char buf[8192];
    int eof;
    /* slow sender: part of the headers, then nothing -> 408 within the deadline */
    int fd = dial(port);
    double t0 = now_ms();
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\n");
    read_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    double dt = now_ms() - t0;
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 408 ");
    CHECK(eof);
    CHECK_MSG(dt >= 250 && dt < 2000, "408 after %.0f ms", dt);
    close(fd);
    /* trickling a byte at a time does not extend the request deadline */
    fd = dial(port);
    t0 = now_ms();
    const char *req = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz";
    int got408 = 0;
    for (size_t i = 0; req[i] && now_ms() - t0 < 3000; i++) {
        if (write(fd, req + i, 1) != 1)
            break;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 50) > 0) {
            read_until(fd, buf, sizeof buf, NULL, 500, &eof);
            got408 = strstr(buf, " 408 ") != NULL;
            break;
        }
    }
    CHECK(got408);
    close(fd);
    /* a new connection that sends nothing: closed silently at the first-byte
     * deadline (the header deadline, here the request one: 300 ms) */
    fd = dial(port);
    t0 = now_ms();
    size_t n = read_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    dt = now_ms() - t0;
    CHECK(eof);
    CHECK_EQ_INT(n, 0);
    CHECK_MSG(dt >= 250 && dt < 2000, "first-byte close after %.0f ms", dt);
    close(fd);
    /* a kept-alive connection after a request: closed at the idle deadline */
    fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
    read_until(fd, buf, sizeof buf, "\r\n\r\nok", 2000, &eof);
    t0 = now_ms();
    n = read_until(fd, buf, sizeof buf, NULL, 3000, &eof);
    dt = now_ms() - t0;
    CHECK(eof);
    CHECK_EQ_INT(n, 0);
    CHECK_MSG(dt >= 350 && dt < 2000, "idle close after %.0f ms", dt);
    close(fd);
    srv_stop(&s);
}

static void t_server_disconnect_aborts(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    char buf[4096];
    int eof;
    int fd = dial(port);
    sends(fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    read_until(fd, buf, sizeof buf, "data: 0", 2000, &eof);
    CHECK_STR_CONTAINS(buf, "data: 0");
    /* a reset, not a FIN: a half-close (FIN) is a client still waiting for
     * its answer (t_server_half_closed_post_answered) */
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
    for (int i = 0; i < 200 && atomic_load(&s.aborts) == 0; i++) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK_EQ_INT(atomic_load(&s.aborts), 1);
    /* an exchange still open at stop is aborted too */
    fd = dial(port);
    sends(fd, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    read_until(fd, buf, sizeof buf, "data: 0", 2000, &eof);
    srv_stop(&s);
    CHECK_EQ_INT(atomic_load(&s.aborts), 2);
    close(fd);
}

static void t_server_non_reader_dropped(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    int fd = dial(port);
    int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sends(fd, "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n");
    /* never read: 16 MiB offered, 1 MiB queue limit -> dropped, exchange aborted */
    for (int i = 0; i < 400 && atomic_load(&s.aborts) == 0; i++) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK_EQ_INT(atomic_load(&s.aborts), 1);
    close(fd);
    srv_stop(&s);
}

static void t_server_stop_prompt(void)
{
    /* a refused client lingers (the server waits for its EOF up to the write
     * deadline); stopping must not wait for that */
    write_timeout_ms = 10000;
    srv s;
    int port = srv_start(&s, 2000, 2000);
    write_timeout_ms = 300;
    int fd = dial(port);
    char buf[4096];
    int eof;
    sends(fd, "GARBAGE\r\n\r\n");
    read_until(fd, buf, sizeof buf, "}}", 2000, &eof);
    CHECK_STR_CONTAINS(buf, " 400 ");
    double t0 = now_ms();
    srv_stop(&s);
    double dt = now_ms() - t0;
    CHECK_MSG(dt < 2000, "stop took %.0f ms", dt);
    close(fd);
}

static void count_post(void *arg)
{
    atomic_fetch_add((atomic_int *)arg, 1);
}

static void t_server_post_after_stop_refused(void)
{
    srv s;
    srv_start(&s, 2000, 2000);
    atomic_int ran = 0;
    CHECK_EQ_INT(shoal_http_post(s.h, count_post, &ran), 0);
    shoal_http_stop(s.h);
    pthread_join(s.loop_thread, NULL);
    CHECK_EQ_INT(atomic_load(&ran), 1); /* accepted posts run, at the latest at the end */
    CHECK(shoal_http_post(s.h, count_post, &ran) < 0);
    CHECK_EQ_INT(atomic_load(&ran), 1);
    shoal_http_close(s.h);
}


/* Issue 20 item 12: a POST whose client half-closes after sending still gets
 * its answer, then the connection closes. */
static void t_server_half_closed_post_answered(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    char buf[4096];
    int eof;
    int fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    shutdown(fd, SHUT_WR);
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK_STR_CONTAINS(buf, "HTTP/1.1 200 OK\r\n");
    CHECK_STR_CONTAINS(buf, "\r\n\r\nhello");
    CHECK(eof);
    close(fd);
    /* two pipelined, then the half-close: both answered in order */
    fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
              "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo");
    shutdown(fd, SHUT_WR);
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    char *a = strstr(buf, "\r\n\r\none"), *b = strstr(buf, "\r\n\r\ntwo");
    CHECK(a && b && a < b);
    CHECK(eof);
    close(fd);
    /* a request cut by the half-close: nothing to answer, closed */
    fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nabc");
    shutdown(fd, SHUT_WR);
    size_t n = read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK(eof);
    CHECK_EQ_INT(n, 0);
    close(fd);
    srv_stop(&s);
}

/* Issue 20 item 12: HEAD is answered like GET, without the body. */
static void t_server_head_without_body(void)
{
    srv s;
    int port = srv_start(&s, 2000, 2000);
    char buf[4096];
    int eof;
    int fd = dial(port);
    /* the 404 route answers "{}" (2 bytes): HEAD announces them, sends none;
     * the next response follows the head at once */
    sends(fd, "HEAD /nothing HTTP/1.1\r\nHost: x\r\n\r\nGET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    read_until(fd, buf, sizeof buf, NULL, 2000, &eof);
    CHECK(!strncmp(buf, "HTTP/1.1 404 ", 13));
    CHECK_STR_CONTAINS(buf, "Content-Length: 2\r\n");
    CHECK_STR_CONTAINS(buf, "\r\n\r\nHTTP/1.1 404 ");
    char *second = strstr(buf, "\r\n\r\nHTTP/1.1 404 ");
    CHECK(second && strstr(second + 4, "\r\n\r\n{}") != NULL);
    close(fd);
    srv_stop(&s);
}

/* Issue 20 item 2: a client that pipelines requests and never reads the
 * answers stops being read once 64 KiB of responses are queued; the server
 * does not parse (nor buffer) the rest. */
static void t_server_pipelining_flood_paused(void)
{
    srv s;
    int port = srv_start(&s, 5000, 5000);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    static const char one[] = "GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n";
    /* 13.6 MB of requests: more than the kernel's socket buffers on both
     * sides take (autotuned to a few MB each), so what the server does with
     * the rest shows */
    enum { N = 400000 };
    size_t total = N * (sizeof one - 1), sent = 0;
    char *all = malloc(total);
    for (int i = 0; i < N; i++)
        memcpy(all + (size_t)i * (sizeof one - 1), one, sizeof one - 1);
    double t0 = now_ms();
    while (sent < total && now_ms() - t0 < 2500) {
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        if (poll(&pf, 1, 100) <= 0)
            continue;
        ssize_t w = send(fd, all + sent, total - sent, MSG_DONTWAIT);
        if (w > 0)
            sent += (size_t)w;
    }
    struct timespec ts = {0, 200 * 1000 * 1000};
    nanosleep(&ts, NULL);
    int handled = atomic_load(&s.requests);
    /* each 404 answer is ~110 bytes + bookkeeping: 64 KiB pause + what the
     * sockets hold; far fewer than were sent */
    CHECK_MSG(sent < total, "the server kept reading: all %zu bytes taken", sent);
    CHECK_MSG(handled < N / 2, "%d of %d pipelined requests parsed while nothing was read", handled, N);
    close(fd);
    free(all);
    /* and others are still served */
    char buf[4096];
    int eof;
    fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
    read_until(fd, buf, sizeof buf, "\r\n\r\nok", 2000, &eof);
    CHECK_STR_CONTAINS(buf, "\r\n\r\nok");
    close(fd);
    srv_stop(&s);
}

/* Issue 20 item 3: connections that send nothing cannot lock a real client
 * out: when the server is full the oldest idle one is closed to make room. */
static void t_server_silent_connections_evicted(void)
{
    srv s;
    int port = srv_start(&s, 3000, 3000); /* max_connections 8 */
    int silent[20];
    for (int i = 0; i < 20; i++)
        silent[i] = dial(port);
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    char buf[4096];
    int eof;
    int fd = dial(port);
    sends(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok");
    read_until(fd, buf, sizeof buf, "\r\n\r\nok", 2000, &eof);
    CHECK_STR_CONTAINS(buf, "\r\n\r\nok");
    close(fd);
    shoal_http_stats st;
    shoal_http_get_stats(s.h, &st); /* racy read of counters; only a lower bound matters */
    /* 21 connections for 8 places: 13 closed, by eviction (oldest idle) or,
     * while evicted ones are still closing, by the hard cap (2 x the limit) */
    CHECK_MSG(st.evicted_connections >= 1 && st.evicted_connections + st.refused_connections >= 13,
              "%llu evicted, %llu refused", (unsigned long long)st.evicted_connections,
              (unsigned long long)st.refused_connections);
    for (int i = 0; i < 20; i++)
        close(silent[i]);
    srv_stop(&s);
}

int main(void)
{
    test_binary = "test_http";
    RUN(t_parse_get);
    RUN(t_parse_pipelined_and_bytewise);
    RUN(t_parse_refusals);
    RUN(t_parse_continue);
    RUN(t_parse_two_hosts_and_obs_fold_refused);
    RUN(t_parse_unknown_method_501_bytewise);
    RUN(t_parse_absolute_form_routed_by_path);
    RUN(t_parse_chunk_size_overflow_named);
    RUN(t_server_keepalive_and_pipelining);
    RUN(t_server_stream_from_thread);
    RUN(t_server_refusals_answered);
    RUN(t_server_slow_and_idle_clients);
    RUN(t_server_disconnect_aborts);
    RUN(t_server_half_closed_post_answered);
    RUN(t_server_head_without_body);
    RUN(t_server_pipelining_flood_paused);
    RUN(t_server_silent_connections_evicted);
    RUN(t_server_non_reader_dropped);
    RUN(t_server_post_after_stop_refused);
    RUN(t_server_stop_prompt);
    return test_finish();
}
