/* HTTP/1.1 server over libuv and http-parser (see http.h for the contract).
 *
 * Per connection: bytes are appended to an input buffer and fed to the
 * request parser. A complete request pauses the parser and becomes an
 * exchange; until the exchange ends the connection keeps reading (to notice a
 * disconnect) but parses nothing more, so pipelined requests are answered in
 * order, one at a time. One timer per connection carries whichever deadline
 * applies: idle (between requests), request (a request being received),
 * write (queued response bytes not draining), close (a graceful close that
 * cannot flush). Abort callbacks never run inside a caller's respond/write:
 * they are delivered from the connection's close callback. */
#include "coordinator/api/http.h"

#include <ctype.h>
#include <errno.h>
#include <http_parser.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <uv.h>

#include "common/err.h"
#include "common/log.h"

/* ======================================================================== */
/* request parser                                                           */
/* ======================================================================== */

enum { ITEM_NONE, ITEM_URL, ITEM_FIELD, ITEM_VALUE };

struct shoal_http_parser {
    http_parser hp;
    size_t max_hdr, max_body;
    char *hbuf; /* url and header names/values, each NUL-terminated */
    size_t hlen, hcap;
    int item;
    size_t url_off;
    int nh;
    size_t name_off[SHOAL_HTTP_MAX_HEADERS], value_off[SHOAL_HTTP_MAX_HEADERS];
    char *body;
    size_t blen, bcap;
    int started, headers_done, complete, want_continue;
    int status; /* non-zero once the request is refused */
    int fold_lf;            /* obs-fold scan: 1 after LF, 2 after LF CR; -1 past the headers */
    char line[256];         /* the request line's first bytes (an unknown method's 501) */
    size_t line_len, line_seen; /* line_seen: bytes of the line looked at so far */
    int line_done;          /* its LF came */
    int badm;               /* http-parser refused the method: reading the line to tell 501 from 400 */
    char errmsg[160];
    shoal_http_request req;
};

static int refuse(shoal_http_parser *p, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int refuse(shoal_http_parser *p, int status, const char *fmt, ...)
{
    if (!p->status) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->errmsg, sizeof p->errmsg, fmt, ap);
        va_end(ap);
        p->status = status;
    }
    return 1; /* non-zero aborts http_parser_execute */
}

static int hput(shoal_http_parser *p, const char *s, size_t n, int lower)
{
    /* one byte of slack stays free for the terminating NUL */
    if (n > p->hcap || p->hlen + n + 1 > p->hcap)
        return refuse(p, 431, "request header fields are larger than %zu bytes", p->max_hdr);
    for (size_t i = 0; i < n; i++)
        p->hbuf[p->hlen++] = lower ? (char)tolower((unsigned char)s[i]) : s[i];
    return 0;
}

static int hterm(shoal_http_parser *p)
{
    if (p->hlen + 1 > p->hcap)
        return refuse(p, 431, "request header fields are larger than %zu bytes", p->max_hdr);
    p->hbuf[p->hlen++] = '\0';
    return 0;
}

/* Close the item being assembled; a header whose value never came gets "". */
static int finish_item(shoal_http_parser *p)
{
    int rc = 0;
    if (p->item == ITEM_URL) {
        rc = hterm(p);
    } else if (p->item == ITEM_FIELD) {
        rc = hterm(p);
        if (!rc) {
            p->value_off[p->nh] = p->hlen;
            rc = hterm(p);
        }
        p->nh++;
    } else if (p->item == ITEM_VALUE) {
        /* trailing blanks are not part of the value (RFC 9110 5.5) */
        size_t start = p->value_off[p->nh];
        while (p->hlen > start && (p->hbuf[p->hlen - 1] == ' ' || p->hbuf[p->hlen - 1] == '\t'))
            p->hlen--;
        rc = hterm(p);
        p->nh++;
    }
    p->item = ITEM_NONE;
    return rc;
}

static int on_message_begin(http_parser *hp)
{
    shoal_http_parser *p = hp->data;
    p->started = 1;
    return 0;
}

static int on_url(http_parser *hp, const char *at, size_t n)
{
    shoal_http_parser *p = hp->data;
    if (p->item != ITEM_URL) {
        p->item = ITEM_URL;
        p->url_off = p->hlen;
    }
    return hput(p, at, n, 0);
}

static int on_header_field(http_parser *hp, const char *at, size_t n)
{
    shoal_http_parser *p = hp->data;
    if (p->item != ITEM_FIELD) {
        if (finish_item(p))
            return 1;
        if (p->nh >= SHOAL_HTTP_MAX_HEADERS)
            return refuse(p, 431, "more than %d request header fields", SHOAL_HTTP_MAX_HEADERS);
        p->item = ITEM_FIELD;
        p->name_off[p->nh] = p->hlen;
    }
    return hput(p, at, n, 1);
}

static int on_header_value(http_parser *hp, const char *at, size_t n)
{
    shoal_http_parser *p = hp->data;
    if (p->item != ITEM_VALUE) {
        if (p->item != ITEM_FIELD) /* http-parser never does this; refuse rather than misfile */
            return refuse(p, 400, "header value without a name");
        if (hterm(p))
            return 1;
        p->item = ITEM_VALUE;
        p->value_off[p->nh] = p->hlen;
    }
    return hput(p, at, n, 0);
}

static void build_request(shoal_http_parser *p)
{
    shoal_http_request *r = &p->req;
    r->method = http_method_str((enum http_method)p->hp.method);
    r->url = p->hbuf + p->url_off;
    r->http_major = p->hp.http_major;
    r->http_minor = p->hp.http_minor;
    r->nheaders = p->nh;
    for (int i = 0; i < p->nh; i++) {
        r->name[i] = p->hbuf + p->name_off[i];
        r->value[i] = p->hbuf + p->value_off[i];
    }
    r->body = p->blen ? p->body : "";
    r->body_len = p->blen;
}

static int on_headers_complete(http_parser *hp)
{
    shoal_http_parser *p = hp->data;
    if (finish_item(p))
        return 1;
    /* the path: the url up to '?' or '#', stored after the headers; an
     * absolute-form target (RFC 9112 3.2.2, "http://host/path") is routed by
     * its path */
    const char *url = p->hbuf + p->url_off;
    if (!strncasecmp(url, "http://", 7) || !strncasecmp(url, "https://", 8)) {
        const char *auth = strstr(url, "//") + 2;
        const char *slash = auth + strcspn(auth, "/?#");
        url = *slash == '/' ? slash : "/";
    }
    size_t plen = strcspn(url, "?#");
    size_t path_off = p->hlen;
    if (hput(p, url, plen, 0) || hterm(p))
        return 1;
    p->req.path = p->hbuf + path_off;
    build_request(p);
    p->headers_done = 1;
    if (hp->http_major != 1)
        return refuse(p, 505, "HTTP version %d.%d is not supported", hp->http_major, hp->http_minor);
    int nhost = 0;
    for (int i = 0; i < p->nh; i++)
        nhost += !strcmp(p->req.name[i], "host");
    if (hp->http_minor >= 1 && nhost == 0)
        return refuse(p, 400, "HTTP/1.1 request without a Host header");
    if (nhost > 1) /* RFC 9112 3.2: more than one Host is a 400 */
        return refuse(p, 400, "more than one Host header");
    int chunked = (hp->flags & F_CHUNKED) != 0;
    int has_length = (hp->flags & F_CONTENTLENGTH) != 0;
    if (has_length && hp->content_length > p->max_body)
        return refuse(p, 413, "request body of %llu bytes is larger than %zu bytes",
                      (unsigned long long)hp->content_length, p->max_body);
    const char *expect = shoal_http_request_header(&p->req, "expect");
    if (expect) {
        if (strcasecmp(expect, "100-continue"))
            return refuse(p, 417, "unsupported Expect value");
        p->want_continue = chunked || (has_length && hp->content_length > 0);
    }
    return 0;
}

static int on_body(http_parser *hp, const char *at, size_t n)
{
    shoal_http_parser *p = hp->data;
    if (n > p->max_body - p->blen)
        return refuse(p, 413, "request body is larger than %zu bytes", p->max_body);
    if (p->blen + n + 1 > p->bcap) {
        size_t cap = p->bcap ? p->bcap : 4096;
        while (cap < p->blen + n + 1)
            cap *= 2;
        if (cap > p->max_body + 1)
            cap = p->max_body + 1;
        p->body = shoal_xrealloc(p->body, cap);
        p->bcap = cap;
    }
    memcpy(p->body + p->blen, at, n);
    p->blen += n;
    p->body[p->blen] = '\0';
    return 0;
}

static int on_message_complete(http_parser *hp)
{
    shoal_http_parser *p = hp->data;
    p->complete = 1;
    build_request(p);
    p->req.keep_alive = http_should_keep_alive(hp) && !hp->upgrade;
    http_parser_pause(hp, 1);
    return 0;
}

static const http_parser_settings parser_settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

int shoal_http_parser_create(shoal_http_parser **out, size_t max_header_bytes, size_t max_body_bytes,
                             char *err, size_t errlen)
{
    *out = NULL;
    if (max_header_bytes == 0 || max_header_bytes > (64u << 20))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: max_header_bytes must be in 1..64 MiB");
    if (max_body_bytes == 0 || max_body_bytes > (1ull << 32))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: max_body_bytes must be in 1..4 GiB");
    shoal_http_parser *p = shoal_xcalloc(1, sizeof *p);
    p->max_hdr = max_header_bytes;
    p->max_body = max_body_bytes;
    /* the path copy and the NULs are counted against the limit too */
    p->hcap = max_header_bytes;
    p->hbuf = shoal_xmalloc(p->hcap);
    /* http-parser has its own (compile-time) header limit; ours is the one that
     * applies as long as it is the smaller */
    http_parser_init(&p->hp, HTTP_REQUEST);
    p->hp.data = p;
    *out = p;
    return 0;
}

void shoal_http_parser_free(shoal_http_parser *p)
{
    if (!p)
        return;
    free(p->hbuf);
    free(p->body);
    free(p);
}

void shoal_http_parser_next(shoal_http_parser *p)
{
    p->hlen = 0;
    p->item = ITEM_NONE;
    p->url_off = 0;
    p->nh = 0;
    p->blen = 0;
    if (p->bcap > 65536) { /* one large body does not pin memory for the connection's life */
        free(p->body);
        p->body = NULL;
        p->bcap = 0;
    }
    p->started = p->headers_done = p->complete = p->want_continue = 0;
    p->fold_lf = 0;
    p->line_len = p->line_seen = 0;
    p->line_done = p->badm = 0;
    memset(&p->req, 0, sizeof p->req);
    http_parser_pause(&p->hp, 0);
}

/* A request line "TOKEN SP TARGET SP HTTP/d.d" at data[0..len): > 0 the
 * length of TOKEN; 0 when what came so far can still become one (no line end
 * yet, within max); < 0 when it cannot. */
static int sniff_request_line(const char *data, size_t len, size_t max)
{
    static const char tchar[] = "!#$%&'*+-.^_`|~";
    static const char proto[] = "HTTP/d.d";
    size_t lim = len < max ? len : max;
    const char *nl = memchr(data, '\n', lim);
    size_t ll = nl ? (size_t)(nl - data) : lim;
    if (ll && data[ll - 1] == '\r') /* its CR, or a CR whose LF is still to come */
        ll--;
    size_t i = 0;
    while (i < ll && data[i] && (isalnum((unsigned char)data[i]) || strchr(tchar, data[i])))
        i++;
    if (i > 64 || (i < ll && (i == 0 || data[i] != ' ')))
        return -1;
    size_t t = i + 1, te = t;
    while (te < ll && data[te] != ' ' && (unsigned char)data[te] > 0x20 && data[te] != 0x7f)
        te++;
    if (te < ll && data[te] != ' ')
        return -1;
    /* the version, as far as it came */
    for (size_t k = te + 1; k < ll; k++) {
        char want = k - te - 1 < sizeof proto - 1 ? proto[k - te - 1] : 0;
        if (!want || (want == 'd' ? !isdigit((unsigned char)data[k]) : data[k] != want))
            return -1;
    }
    if (!nl)
        return len < max ? 0 : -1;
    if (te == t || te >= ll || ll - te - 1 != sizeof proto - 1)
        return -1;
    return (int)i;
}

/* http-parser stopped at the first byte of a method it does not know, as at
 * garbage: a well-formed request line with an unknown method is 501 (RFC 9110
 * 15.6.2), anything else 400. The line is consumed here up to its end. */
static long bad_method(shoal_http_parser *p, size_t len, int *status)
{
    int m = sniff_request_line(p->line, p->line_len, p->line_done ? p->line_len + 1 : sizeof p->line + 1);
    if (m == 0 && !p->line_done && p->line_seen < p->max_hdr && p->line_len < sizeof p->line)
        return (long)len;
    if (m > 0)
        refuse(p, 501, "method '%.*s' is not implemented", m > 32 ? 32 : m, p->line);
    else
        refuse(p, 400, "malformed HTTP request: invalid HTTP method");
    *status = p->status;
    return -1;
}

long shoal_http_parser_feed(shoal_http_parser *p, const char *data, size_t len, int *status)
{
    *status = 0;
    if (p->status) {
        *status = p->status;
        return -1;
    }
    if (p->complete || len == 0)
        return 0;
    /* obs-fold (a header line starting with SP or HT): http-parser joins it
     * to the value; RFC 9112 5.2 lets a server refuse it, and we do (a
     * classic request-smuggling vector). Scanned on the raw bytes up to the
     * end of the headers; the request line's first bytes are kept for a 501. */
    for (size_t i = 0; i < len && p->fold_lf >= 0; i++) {
        char ch = data[i];
        if (!p->line_done) {
            if (p->line_len == 0 && (ch == '\r' || ch == '\n'))
                continue; /* empty lines before a request are ignored (RFC 9112 2.2) */
            if (p->line_len < sizeof p->line)
                p->line[p->line_len++] = ch;
            p->line_seen++;
            if (ch == '\n') {
                p->line_done = 1;
                p->fold_lf = 1;
            }
            continue;
        }
        if (p->fold_lf == 1 && (ch == ' ' || ch == '\t')) {
            refuse(p, 400, "obsolete line folding in a header field");
            *status = p->status;
            return -1;
        }
        if (p->fold_lf >= 1 && ch == '\n')
            p->fold_lf = -1; /* the empty line: the headers are over */
        else if (p->fold_lf == 1 && ch == '\r')
            p->fold_lf = 2;
        else
            p->fold_lf = ch == '\n';
    }
    if (p->badm)
        return bad_method(p, len, status);
    size_t n = http_parser_execute(&p->hp, &parser_settings, data, len);
    enum http_errno e = HTTP_PARSER_ERRNO(&p->hp);
    if (p->status) {
        *status = p->status;
        return -1;
    }
    if (e == HPE_PAUSED && p->complete) {
        /* bytes after the request were scanned as its own; the next request
         * scans them again from the start */
        return (long)n;
    }
    if (e == HPE_INVALID_METHOD) {
        p->badm = 1;
        p->started = 1;
        return bad_method(p, len, status);
    }
    if (e != HPE_OK) {
        int st = e == HPE_HEADER_OVERFLOW ? 431 : 400;
        if (e == HPE_INVALID_CONTENT_LENGTH && (p->hp.flags & F_CHUNKED))
            refuse(p, 400, "malformed HTTP request: invalid chunk size (too large)");
        else
            refuse(p, st, "malformed HTTP request: %s", http_errno_description(e));
        *status = p->status;
        return -1;
    }
    if (n != len) {
        refuse(p, 400, "malformed HTTP request");
        *status = p->status;
        return -1;
    }
    return (long)n;
}

const shoal_http_request *shoal_http_parser_request(const shoal_http_parser *p)
{
    return p->complete ? &p->req : NULL;
}

int shoal_http_parser_in_progress(const shoal_http_parser *p)
{
    return p->started && !p->complete;
}

int shoal_http_parser_take_continue(shoal_http_parser *p)
{
    if (!p->want_continue || !p->headers_done)
        return 0;
    p->want_continue = 0;
    return !p->complete;
}

const char *shoal_http_parser_error(const shoal_http_parser *p)
{
    return p->status ? p->errmsg : "";
}

const char *shoal_http_request_header(const shoal_http_request *r, const char *name)
{
    for (int i = 0; i < r->nheaders; i++)
        if (!strcasecmp(r->name[i], name))
            return r->value[i];
    return NULL;
}

const char *shoal_http_status_text(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}

/* ======================================================================== */
/* server                                                                   */
/* ======================================================================== */

enum { PH_IDLE, PH_READING, PH_HANDLING };
enum { TM_NONE, TM_IDLE, TM_REQUEST, TM_WRITE, TM_CLOSE };

typedef struct conn conn;

struct shoal_http_ex {
    shoal_http *h;
    conn *c;          /* NULL once the connection is gone */
    conn *dead_conn;  /* closing connection that still owes the abort callback */
    int streaming, chunked, aborted, close_after, head_sent;
    int head_only; /* a HEAD request: the head of the GET answer, no body bytes */
    void (*abort_cb)(void *);
    void *abort_arg;
    char peer[64];
};

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_shutdown_t sreq;
    shoal_http *h;
    shoal_http_parser *p;
    char *in;
    size_t in_len, in_cap;
    shoal_http_ex *ex;         /* the open exchange */
    shoal_http_ex *abort_due;  /* aborted exchange whose callback runs at close */
    int phase, timer_kind;
    int keep_alive, http_minor;
    int closing, handles_closing, handles_open, reading, in_feed;
    int paused;      /* not parsing (nor reading) while its responses are not read */
    int eof;         /* the client half-closed: answer what came, then close */
    int in_headers;  /* a request started and its headers are not complete */
    uint64_t req_start, idle_since; /* loop ms: the request's first byte; entering idle */
    size_t wq_bytes; /* queued response bytes plus each write's bookkeeping */
    conn *prev, *next;
    char peer[64];
};

typedef struct post {
    void (*fn)(void *);
    void *arg;
    struct post *next;
} post;

struct shoal_http {
    shoal_http_opts o;
    char host[128];
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t async;
    uv_signal_t sigint, sigterm;
    int port;
    int stopping;
    conn *conns;
    shoal_http_stats st;
    pthread_mutex_t mu; /* guards the post list, posts_closed, stop_requested */
    post *post_head, *post_tail;
    int posts_closed, stop_requested, ran;
};

typedef struct {
    uv_write_t req;
    conn *c;
    size_t len;
    char data[];
} wbuf;

static void conn_close(conn *c, int graceful);
static void feed_conn(conn *c);
static void send_error_close(conn *c, int status, const char *msg);
static void alloc_cb(uv_handle_t *hd, size_t suggested, uv_buf_t *buf);
static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

static void arm(conn *c, int kind, int ms);

static void timer_cb(uv_timer_t *t)
{
    conn *c = t->data;
    int kind = c->timer_kind;
    c->timer_kind = TM_NONE;
    switch (kind) {
    case TM_IDLE:
        conn_close(c, 0);
        break;
    case TM_REQUEST:
        c->h->st.timeouts++;
        SHOAL_INFO("access: %s refused: 408 the request was not received in time", c->peer);
        send_error_close(c, 408, "the request was not received in time");
        break;
    case TM_WRITE:
    case TM_CLOSE:
        c->h->st.timeouts++;
        conn_close(c, 0);
        break;
    default:
        break;
    }
}

/* The deadline for the first byte of a connection and for a request's
 * headers: much shorter than the keep-alive idle time, so connections that
 * send nothing (or dribble headers) cannot hold the server's slots. */
static int header_ms(const shoal_http *h)
{
    int ms = h->o.header_timeout_ms > 0 ? h->o.header_timeout_ms : h->o.request_timeout_ms;
    return ms < h->o.request_timeout_ms ? ms : h->o.request_timeout_ms;
}

static int first_byte_ms(const shoal_http *h)
{
    int ms = header_ms(h);
    return ms < h->o.idle_timeout_ms ? ms : h->o.idle_timeout_ms;
}

static void arm(conn *c, int kind, int ms)
{
    c->timer_kind = kind;
    uv_timer_start(&c->timer, timer_cb, (uint64_t)ms, 0);
}

static void disarm(conn *c)
{
    c->timer_kind = TM_NONE;
    uv_timer_stop(&c->timer);
}

static void handle_closed(uv_handle_t *hd)
{
    conn *c = hd->data;
    if (--c->handles_open > 0)
        return;
    shoal_http *h = c->h;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->st.open_connections--;
    shoal_http_ex *ex = c->abort_due;
    if (ex) {
        ex->dead_conn = NULL;
        if (ex->abort_cb)
            ex->abort_cb(ex->abort_arg);
    }
    shoal_http_parser_free(c->p);
    free(c->in);
    free(c);
}

static void close_handles(conn *c)
{
    if (c->handles_closing)
        return;
    c->handles_closing = 1;
    if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = 0;
    }
    uv_timer_stop(&c->timer);
    c->handles_open = 2;
    uv_close((uv_handle_t *)&c->tcp, handle_closed);
    uv_close((uv_handle_t *)&c->timer, handle_closed);
}

static void shutdown_cb(uv_shutdown_t *req, int status)
{
    conn *c = req->data;
    if (status < 0)
        close_handles(c);
    /* else linger: read and discard until the client's EOF or the close
     * deadline, so that closing with unread input does not reset the
     * connection before the client has read our last response */
}

/* graceful: flush queued writes, send FIN, linger (bounded by the write
 * deadline); otherwise close at once. An open exchange is aborted either way
 * (its callback runs from the close callback). */
static void conn_close(conn *c, int graceful)
{
    if (c->closing) {
        if (!graceful)
            close_handles(c);
        return;
    }
    c->closing = 1;
    if (c->ex) {
        shoal_http_ex *ex = c->ex;
        ex->aborted = 1;
        ex->c = NULL;
        ex->dead_conn = c;
        c->abort_due = ex;
        c->ex = NULL;
        c->h->st.aborted++;
    }
    if (graceful) {
        c->sreq.data = c;
        if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, shutdown_cb) == 0) {
            arm(c, TM_CLOSE, c->h->o.write_timeout_ms);
            if (!c->reading && uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb) == 0)
                c->reading = 1;
            return;
        }
    }
    close_handles(c);
}

/* What one queued write costs: its bytes, its uv_write_t and the allocator's
 * overhead -- a flood of small responses is bounded by memory, not by the
 * payload bytes alone. */
#define WRITE_OVERHEAD (sizeof(wbuf) + 64)
/* Pipelined requests are not parsed while more than this is queued unread:
 * a client that sends and never reads stops being read. */
#define PAUSE_BYTES ((size_t)64 << 10)

static void write_cb(uv_write_t *req, int status)
{
    wbuf *w = (wbuf *)req;
    conn *c = w->c;
    c->wq_bytes -= w->len + WRITE_OVERHEAD;
    free(w);
    if (status < 0) {
        if (status != UV_ECANCELED && !c->closing)
            conn_close(c, 0);
        return;
    }
    if (c->paused && !c->closing && c->wq_bytes <= PAUSE_BYTES / 2) {
        c->paused = 0;
        feed_conn(c);
        if (c->closing)
            return;
    }
    if (c->timer_kind == TM_WRITE && !c->closing) {
        if (c->wq_bytes > 0)
            arm(c, TM_WRITE, c->h->o.write_timeout_ms); /* progress: a fresh deadline */
        else if (c->phase == PH_IDLE)
            arm(c, TM_IDLE, c->h->o.idle_timeout_ms);
        else
            disarm(c);
    }
}

/* Queue bytes (copied). Returns 0, or -1 when the connection was dropped. */
static int conn_write(conn *c, const char *a, size_t alen, const char *b, size_t blen, const char *z,
                      size_t zlen)
{
    if (c->closing)
        return -1;
    size_t n = alen + blen + zlen;
    if (c->wq_bytes + n + WRITE_OVERHEAD > c->h->o.max_write_queue) {
        SHOAL_WARN("http: %s is not reading its response (%zu bytes queued); dropping it", c->peer,
                   c->wq_bytes);
        c->h->st.timeouts++;
        conn_close(c, 0);
        return -1;
    }
    wbuf *w = shoal_xmalloc(sizeof *w + n);
    w->c = c;
    w->len = n;
    if (alen)
        memcpy(w->data, a, alen);
    if (blen)
        memcpy(w->data + alen, b, blen);
    if (zlen)
        memcpy(w->data + alen + blen, z, zlen);
    uv_buf_t buf = uv_buf_init(w->data, (unsigned)n);
    int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &buf, 1, write_cb);
    if (rc < 0) {
        free(w);
        conn_close(c, 0);
        return -1;
    }
    c->wq_bytes += n + WRITE_OVERHEAD;
    c->h->st.bytes_out += n;
    if (c->phase == PH_HANDLING && c->timer_kind != TM_WRITE && c->wq_bytes > 0)
        arm(c, TM_WRITE, c->h->o.write_timeout_ms);
    return 0;
}

static size_t json_escape(char *dst, size_t cap, const char *s)
{
    size_t o = 0;
    for (; *s && o + 7 < cap; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\') {
            dst[o++] = '\\';
            dst[o++] = (char)ch;
        } else if (ch < 0x20) {
            o += (size_t)snprintf(dst + o, cap - o, "\\u%04x", ch);
        } else {
            dst[o++] = (char)ch;
        }
    }
    dst[o] = '\0';
    return o;
}

/* An error answered by this layer (JSON body in OpenAI's shape), then a
 * graceful close. */
static void send_error_close(conn *c, int status, const char *msg)
{
    char esc[512], body[768], head[256];
    json_escape(esc, sizeof esc, msg);
    int bn = snprintf(body, sizeof body,
                      "{\"error\":{\"message\":\"%s\",\"type\":\"invalid_request_error\","
                      "\"param\":null,\"code\":null}}",
                      esc);
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                      "Connection: close\r\n\r\n",
                      status, shoal_http_status_text(status), bn);
    disarm(c);
    conn_write(c, head, (size_t)hn, body, (size_t)bn, NULL, 0);
    conn_close(c, 1);
}

static void refuse_conn(conn *c, int status, const char *msg)
{
    c->h->st.bad_requests++;
    SHOAL_INFO("access: %s refused: %d %s", c->peer, status, msg); /* our text, no client bytes */
    send_error_close(c, status, msg);
}

static void finish_exchange(shoal_http_ex *ex)
{
    conn *c = ex->c;
    if (ex->dead_conn) /* its close callback must not call back into a freed exchange */
        ex->dead_conn->abort_due = NULL;
    int close_after = ex->close_after;
    free(ex);
    if (!c)
        return;
    c->ex = NULL;
    if (!c->keep_alive || close_after || c->h->stopping) {
        conn_close(c, 1);
        return;
    }
    shoal_http_parser_next(c->p);
    c->phase = PH_IDLE;
    c->idle_since = uv_now(&c->h->loop);
    if (c->timer_kind != TM_WRITE || c->wq_bytes == 0)
        arm(c, TM_IDLE, c->h->o.idle_timeout_ms);
    feed_conn(c);
}

static void alloc_cb(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    conn *c = hd->data;
    (void)suggested;
    const size_t chunk = 65536;
    if (c->in_cap - c->in_len < chunk) {
        c->in_cap = c->in_len + chunk;
        c->in = shoal_xrealloc(c->in, c->in_cap);
    }
    *buf = uv_buf_init(c->in + c->in_len, (unsigned)(c->in_cap - c->in_len));
}

static void read_cb(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = s->data;
    (void)buf;
    if (c->closing) { /* lingering: discard */
        if (nread < 0)
            close_handles(c);
        return;
    }
    if (nread == UV_EOF) {
        if (c->phase == PH_HANDLING && c->ex && c->ex->abort_cb) {
            /* FIN while an answer is still being produced (a generation):
             * the client is gone. TCP cannot tell a close (what a client
             * timeout does) from a half-close, and waiting for a reset at our
             * first write would keep a non-streamed generation's slot to its
             * end; so the exchange is aborted now and the generation stops at
             * its next token (docs/API.md, "Cancellation"). */
            conn_close(c, 0);
            return;
        }
        /* a half-close between requests, or while one is answered at once:
         * the client may still read. What it sent complete is answered (in
         * order), then the connection closes; a request cut by the EOF
         * cannot complete and is dropped. */
        c->eof = 1;
        if (c->reading) {
            uv_read_stop(s);
            c->reading = 0;
        }
        if (c->phase != PH_HANDLING)
            feed_conn(c);
        return;
    }
    if (nread < 0) {
        /* reset: whatever was in flight is abandoned */
        conn_close(c, c->phase != PH_HANDLING && !shoal_http_parser_in_progress(c->p));
        return;
    }
    if (nread == 0)
        return;
    c->in_len += (size_t)nread;
    c->h->st.bytes_in += (uint64_t)nread;
    if (c->phase == PH_HANDLING) {
        /* pipelined bytes wait; a client that keeps sending stops being read */
        if (c->in_len > c->h->o.max_header_bytes + c->h->o.max_body_bytes + 65536 && c->reading) {
            uv_read_stop(s);
            c->reading = 0;
        }
        return;
    }
    feed_conn(c);
}

/* Reads again unless the client half-closed or its responses pile up.
 * Returns -1 when the connection was dropped. */
static int want_reading(conn *c)
{
    if (c->reading || c->eof || c->paused || c->closing)
        return 0;
    if (uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb) < 0) {
        conn_close(c, 0);
        return -1;
    }
    c->reading = 1;
    return 0;
}

static void feed_conn(conn *c)
{
    if (c->in_feed)
        return;
    c->in_feed = 1;
    shoal_http *h = c->h;
    while (!c->closing && c->phase != PH_HANDLING) {
        if (c->wq_bytes > PAUSE_BYTES) {
            /* the client sends requests but does not read the answers: stop
             * reading it (write_cb resumes; the write deadline drops it) */
            c->paused = 1;
            if (c->reading) {
                uv_read_stop((uv_stream_t *)&c->tcp);
                c->reading = 0;
            }
            break;
        }
        if (c->in_len == 0) {
            if (c->eof) { /* half-closed and everything sent was answered */
                conn_close(c, 1);
                break;
            }
            want_reading(c);
            break;
        }
        int status;
        long n = shoal_http_parser_feed(c->p, c->in, c->in_len, &status);
        if (n < 0) {
            refuse_conn(c, status, shoal_http_parser_error(c->p));
            break;
        }
        if (n > 0) {
            memmove(c->in, c->in + n, c->in_len - (size_t)n);
            c->in_len -= (size_t)n;
        }
        if (c->phase == PH_IDLE && (shoal_http_parser_in_progress(c->p) || shoal_http_parser_request(c->p))) {
            c->phase = PH_READING;
            c->req_start = uv_now(&h->loop);
            c->in_headers = 1;
            arm(c, TM_REQUEST, header_ms(h));
        }
        if (c->in_headers && c->p->headers_done) {
            /* headers in: the rest of the request deadline is the body's */
            c->in_headers = 0;
            uint64_t used = uv_now(&h->loop) - c->req_start;
            int left = used >= (uint64_t)h->o.request_timeout_ms ? 1 : h->o.request_timeout_ms - (int)used;
            arm(c, TM_REQUEST, left);
        }
        if (shoal_http_parser_take_continue(c->p)) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            if (conn_write(c, cont, sizeof cont - 1, NULL, 0, NULL, 0))
                break;
        }
        const shoal_http_request *req = shoal_http_parser_request(c->p);
        if (!req) {
            if (c->eof) { /* cut by the client's EOF: it cannot complete */
                conn_close(c, 1);
                break;
            }
            want_reading(c);
            break; /* needs more bytes */
        }
        disarm(c);
        c->in_headers = 0;
        c->phase = PH_HANDLING;
        c->keep_alive = req->keep_alive && !c->eof;
        c->http_minor = req->http_minor;
        shoal_http_ex *ex = shoal_xcalloc(1, sizeof *ex);
        ex->h = h;
        ex->c = c;
        ex->head_only = !strcmp(req->method, "HEAD");
        snprintf(ex->peer, sizeof ex->peer, "%s", c->peer);
        c->ex = ex;
        h->st.requests++;
        /* keep noticing a disconnect while the exchange is open */
        if (want_reading(c))
            break;
        h->o.on_request(h->o.ud, ex, req);
    }
    c->in_feed = 0;
}

/* A connection that may be closed to make room: between requests, nothing
 * queued, nothing half-received. */
static int evictable(const conn *c)
{
    return !c->closing && c->phase == PH_IDLE && !c->ex && c->wq_bytes == 0 && c->in_len == 0 &&
           !shoal_http_parser_in_progress(c->p);
}

static void on_connection(uv_stream_t *server, int status)
{
    shoal_http *h = server->data;
    if (status < 0) {
        SHOAL_WARN("http: accept failed: %s", uv_strerror(status));
        return;
    }
    conn *c = shoal_xcalloc(1, sizeof *c);
    c->h = h;
    uv_tcp_init(&h->loop, &c->tcp);
    uv_timer_init(&h->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->prev = NULL;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->st.open_connections++;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0) {
        close_handles(c);
        return;
    }
    struct sockaddr_storage ss;
    int sl = sizeof ss;
    snprintf(c->peer, sizeof c->peer, "?");
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET6)
            uv_ip6_name((struct sockaddr_in6 *)&ss, c->peer, sizeof c->peer);
        else
            uv_ip4_name((struct sockaddr_in *)&ss, c->peer, sizeof c->peer);
    }
    /* Limits: max_connections live ones in all, max_per_addr from one
     * address. When either is reached the oldest idle connection (of that
     * address, for the second) is closed to make room, so connections that
     * only sit there cannot lock others out; with none idle the new one is
     * closed. Lingering closes do not count (their fds are bounded by the
     * write deadline and by the hard cap of twice the limit). */
    int live = 0, same = 0;
    conn *old_all = NULL, *old_addr = NULL;
    for (conn *o = h->conns; o; o = o->next) {
        if (o == c || o->closing || o->handles_closing)
            continue;
        int mine = !strcmp(o->peer, c->peer);
        live++;
        same += mine;
        if (evictable(o)) {
            if (!old_all || o->idle_since < old_all->idle_since)
                old_all = o;
            if (mine && (!old_addr || o->idle_since < old_addr->idle_since))
                old_addr = o;
        }
    }
    int refuse_it = h->stopping || h->st.open_connections > 2 * h->o.max_connections;
    int per_addr = h->o.max_per_addr > 0 ? h->o.max_per_addr : h->o.max_connections;
    if (!refuse_it && same >= per_addr) {
        if (old_addr) {
            h->st.evicted_connections++;
            if (old_addr == old_all)
                old_all = NULL;
            conn_close(old_addr, 0);
            live--;
        } else {
            refuse_it = 1;
        }
    }
    if (!refuse_it && live >= h->o.max_connections) {
        if (old_all) {
            h->st.evicted_connections++;
            conn_close(old_all, 0);
        } else {
            refuse_it = 1;
        }
    }
    if (refuse_it) {
        h->st.refused_connections++;
        close_handles(c);
        return;
    }
    h->st.connections++;
    uv_tcp_nodelay(&c->tcp, 1);
    char err[128];
    if (shoal_http_parser_create(&c->p, h->o.max_header_bytes, h->o.max_body_bytes, err, sizeof err)) {
        close_handles(c);
        return;
    }
    c->phase = PH_IDLE;
    c->idle_since = uv_now(&h->loop);
    arm(c, TM_IDLE, first_byte_ms(h)); /* the first byte is due soon, not after the idle time */
    feed_conn(c); /* starts reading */
}

/* ---- loop control ------------------------------------------------------- */

static void run_posts(shoal_http *h)
{
    pthread_mutex_lock(&h->mu);
    post *list = h->post_head;
    h->post_head = h->post_tail = NULL;
    pthread_mutex_unlock(&h->mu);
    while (list) {
        post *nx = list->next;
        list->fn(list->arg);
        free(list);
        list = nx;
    }
}

static void begin_stop(shoal_http *h)
{
    if (h->stopping)
        return;
    h->stopping = 1;
    SHOAL_INFO("http: stopping");
    uv_close((uv_handle_t *)&h->listener, NULL);
    if (h->o.handle_signals) {
        uv_close((uv_handle_t *)&h->sigint, NULL);
        uv_close((uv_handle_t *)&h->sigterm, NULL);
    }
    for (conn *c = h->conns; c; c = c->next)
        conn_close(c, 0); /* lingering ones too: stopping does not wait for them */
    /* from here posts are refused (their callers clean up themselves); the
     * ones already queued run at the end of shoal_http_run */
    pthread_mutex_lock(&h->mu);
    h->posts_closed = 1;
    pthread_mutex_unlock(&h->mu);
    uv_close((uv_handle_t *)&h->async, NULL);
}

static void async_cb(uv_async_t *a)
{
    shoal_http *h = a->data;
    run_posts(h);
    pthread_mutex_lock(&h->mu);
    int stop = h->stop_requested;
    pthread_mutex_unlock(&h->mu);
    if (stop)
        begin_stop(h);
}

static void signal_cb(uv_signal_t *s, int signum)
{
    shoal_http *h = s->data;
    SHOAL_INFO("http: signal %d", signum);
    begin_stop(h);
}

int shoal_http_open(shoal_http **out, const shoal_http_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->host || !o->on_request)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: host and on_request are required");
    if (o->port < 0 || o->port > 65535)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: port %d is out of range", o->port);
    if (!o->max_header_bytes || !o->max_body_bytes || o->max_connections <= 0 || o->request_timeout_ms <= 0 ||
        o->idle_timeout_ms <= 0 || o->write_timeout_ms <= 0 || !o->max_write_queue)
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "http: every limit and timeout must be set and positive");
    if (strlen(o->host) >= sizeof ((shoal_http *)0)->host)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: host is too long");
    struct sockaddr_storage addr;
    int rc;
    if (strchr(o->host, ':'))
        rc = uv_ip6_addr(o->host, o->port, (struct sockaddr_in6 *)&addr);
    else
        rc = uv_ip4_addr(o->host, o->port, (struct sockaddr_in *)&addr);
    if (rc < 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "http: --host %s is not an IP address", o->host);

    shoal_http *h = shoal_xcalloc(1, sizeof *h);
    h->o = *o;
    snprintf(h->host, sizeof h->host, "%s", o->host);
    h->o.host = h->host;
    pthread_mutex_init(&h->mu, NULL);
    uv_loop_init(&h->loop);
    uv_tcp_init(&h->loop, &h->listener);
    h->listener.data = h;
    rc = uv_tcp_bind(&h->listener, (const struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&h->listener, 511, on_connection);
    if (rc < 0) {
        shoal_err_set(err, errlen, rc == UV_EADDRINUSE ? -EADDRINUSE : SHOAL_EIO, "http: cannot listen on %s:%d: %s",
                      o->host, o->port, uv_strerror(rc));
        uv_close((uv_handle_t *)&h->listener, NULL);
        uv_run(&h->loop, UV_RUN_DEFAULT);
        uv_loop_close(&h->loop);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return rc == UV_EADDRINUSE ? -EADDRINUSE : SHOAL_EIO;
    }
    struct sockaddr_storage bound;
    int bl = sizeof bound;
    uv_tcp_getsockname(&h->listener, (struct sockaddr *)&bound, &bl);
    h->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    uv_async_init(&h->loop, &h->async, async_cb);
    h->async.data = h;
    if (o->handle_signals) {
        uv_signal_init(&h->loop, &h->sigint);
        uv_signal_init(&h->loop, &h->sigterm);
        h->sigint.data = h->sigterm.data = h;
        uv_signal_start(&h->sigint, signal_cb, SIGINT);
        uv_signal_start(&h->sigterm, signal_cb, SIGTERM);
    }
    /* a write to a reset connection must be an error, not a process kill */
    signal(SIGPIPE, SIG_IGN);
    *out = h;
    return 0;
}

int shoal_http_run(shoal_http *h)
{
    h->ran = 1;
    pthread_mutex_lock(&h->mu);
    int stop = h->stop_requested;
    pthread_mutex_unlock(&h->mu);
    if (stop)
        begin_stop(h);
    uv_run(&h->loop, UV_RUN_DEFAULT);
    /* begin_stop refused further posts and closed the async handle: run the
     * ones still queued */
    run_posts(h);
    uv_run(&h->loop, UV_RUN_DEFAULT); /* close callbacks the posts caused */
    return 0;
}

void shoal_http_stop(shoal_http *h)
{
    pthread_mutex_lock(&h->mu);
    h->stop_requested = 1;
    if (!h->posts_closed) /* under the lock: the handle cannot be closing */
        uv_async_send(&h->async);
    pthread_mutex_unlock(&h->mu);
}

int shoal_http_post(shoal_http *h, void (*fn)(void *), void *arg)
{
    post *p = shoal_xmalloc(sizeof *p);
    p->fn = fn;
    p->arg = arg;
    p->next = NULL;
    pthread_mutex_lock(&h->mu);
    if (h->posts_closed) {
        pthread_mutex_unlock(&h->mu);
        free(p);
        return SHOAL_EINVAL;
    }
    if (h->post_tail)
        h->post_tail->next = p;
    else
        h->post_head = p;
    h->post_tail = p;
    /* inside the lock: run() cannot close the async handle between our check and the send */
    uv_async_send(&h->async);
    pthread_mutex_unlock(&h->mu);
    return 0;
}

typedef struct {
    uv_work_t w;
    void (*work)(void *);
    void (*done)(void *, int);
    void *arg;
} hwork;

static void hwork_run(uv_work_t *w)
{
    hwork *x = (hwork *)w;
    x->work(x->arg);
}

static void hwork_after(uv_work_t *w, int status)
{
    hwork *x = (hwork *)w;
    x->done(x->arg, status == UV_ECANCELED);
    free(x);
}

int shoal_http_work(shoal_http *h, void (*work)(void *), void (*done)(void *, int), void *arg)
{
    hwork *x = shoal_xcalloc(1, sizeof *x);
    x->work = work;
    x->done = done;
    x->arg = arg;
    if (uv_queue_work(&h->loop, &x->w, hwork_run, hwork_after) < 0) {
        free(x);
        return SHOAL_EINVAL;
    }
    return 0;
}

void shoal_http_close(shoal_http *h)
{
    if (!h)
        return;
    if (!h->ran) { /* opened but never run: close the handles here */
        begin_stop(h);
        uv_run(&h->loop, UV_RUN_DEFAULT);
        run_posts(h);
    }
    if (uv_loop_close(&h->loop) != 0)
        SHOAL_WARN("http: loop closed with handles still open");
    pthread_mutex_destroy(&h->mu);
    free(h);
}

int shoal_http_port(const shoal_http *h)
{
    return h->port;
}

void shoal_http_get_stats(const shoal_http *h, shoal_http_stats *out)
{
    *out = h->st;
}

/* ---- exchanges ---------------------------------------------------------- */

const char *shoal_http_ex_peer(const shoal_http_ex *ex)
{
    return ex->peer;
}

int shoal_http_ex_aborted(const shoal_http_ex *ex)
{
    return ex->aborted;
}

void shoal_http_ex_on_abort(shoal_http_ex *ex, void (*cb)(void *), void *arg)
{
    ex->abort_cb = cb;
    ex->abort_arg = arg;
}

static int head(shoal_http_ex *ex, int status, const char *ctype, const char *extra, long content_length)
{
    conn *c = ex->c;
    char buf[1024];
    int stream = content_length < 0;
    if (stream && c->http_minor == 0)
        ex->close_after = 1; /* HTTP/1.0: no chunked coding, the close ends the body */
    else if (stream)
        ex->chunked = 1;
    int keep = c->keep_alive && !ex->close_after && !c->h->stopping;
    int n = snprintf(buf, sizeof buf, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n", status,
                     shoal_http_status_text(status), ctype ? ctype : "application/json");
    if (!stream)
        n += snprintf(buf + n, sizeof buf - (size_t)n, "Content-Length: %ld\r\n", content_length);
    else if (ex->chunked)
        n += snprintf(buf + n, sizeof buf - (size_t)n, "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n");
    else
        n += snprintf(buf + n, sizeof buf - (size_t)n, "Cache-Control: no-cache\r\n");
    n += snprintf(buf + n, sizeof buf - (size_t)n, "Connection: %s\r\n", keep ? "keep-alive" : "close");
    if (!keep)
        ex->close_after = 1;
    size_t elen = extra ? strlen(extra) : 0;
    if ((size_t)n >= sizeof buf)
        SHOAL_PANIC("http: response head overflow");
    ex->head_sent = 1;
    return conn_write(c, buf, (size_t)n, extra, elen, "\r\n", 2);
}

int shoal_http_respond(shoal_http_ex *ex, int status, const char *content_type, const char *extra_headers,
                       const void *body, size_t len)
{
    if (ex->streaming || ex->head_sent)
        SHOAL_PANIC("http: respond on an exchange that already started a response");
    if (ex->c && !ex->aborted) {
        if (head(ex, status, content_type, extra_headers, (long)len) == 0 && len && ex->c && !ex->head_only)
            conn_write(ex->c, body, len, NULL, 0, NULL, 0);
    }
    finish_exchange(ex);
    return 0;
}

int shoal_http_stream_begin(shoal_http_ex *ex, int status, const char *content_type, const char *extra_headers)
{
    if (ex->streaming || ex->head_sent)
        SHOAL_PANIC("http: stream_begin twice");
    ex->streaming = 1;
    if (!ex->c || ex->aborted)
        return SHOAL_ECANCELED;
    return head(ex, status, content_type, extra_headers, -1) ? SHOAL_ECANCELED : 0;
}

int shoal_http_stream_write(shoal_http_ex *ex, const void *data, size_t len)
{
    if (!ex->streaming)
        SHOAL_PANIC("http: stream_write before stream_begin");
    if (!ex->c || ex->aborted)
        return SHOAL_ECANCELED;
    if (len == 0 || ex->head_only)
        return 0;
    if (!ex->chunked)
        return conn_write(ex->c, data, len, NULL, 0, NULL, 0) ? SHOAL_ECANCELED : 0;
    char pre[24];
    int n = snprintf(pre, sizeof pre, "%zx\r\n", len);
    return conn_write(ex->c, pre, (size_t)n, data, len, "\r\n", 2) ? SHOAL_ECANCELED : 0;
}

int shoal_http_stream_end(shoal_http_ex *ex)
{
    if (ex->c && !ex->aborted && ex->streaming && ex->chunked && !ex->head_only)
        conn_write(ex->c, "0\r\n\r\n", 5, NULL, 0, NULL, 0);
    finish_exchange(ex);
    return 0;
}
