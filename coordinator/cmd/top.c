/* `shoal top`: a live per-shard view of a running coordinator, read from its
 * Prometheus /metrics (docs/METRICS.md): the requests (tokens/s, running and
 * queued, time to first token and between tokens), then one row per expert
 * server with its status, experts owned, load share against its fair share,
 * round-trip p50 / p99, weight GB/s while computing, and memory. Latencies
 * and rates are windowed -- the increase of the histogram buckets and
 * counters over the last --window seconds (and 1 min) -- so a spike leaves
 * them once it is older than the window. ncurses, plain ASCII, no mouse,
 * redrawn every --interval seconds or on a key, resize-aware: usable over
 * SSH. `--once` prints the same table once as plain text for scripts (since
 * start, or over --window S when given: two reads S apart).
 *
 * The HTTP GET here is a small blocking client with deadlines (connect, read)
 * and a size cap; every byte from the socket is checked (status line,
 * headers, chunked framing) before the exposition parser sees the body, and
 * every string drawn (names, labels, error text) is reduced to printable
 * ASCII first: a hostile /metrics cannot send escape sequences to the
 * terminal. */
#include <arpa/inet.h>
#include <curses.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/suggest.h"
#include "common/err.h"
#include "common/log.h"
#include "common/metrics.h"
#include "coordinator/cmd/webui.h"

#define MAX_BODY (64u << 20)
#define MAX_ROWS 4096
#define ID_MAX 64

/* ---- HTTP GET ------------------------------------------------------------ */

typedef struct {
    char host[256], port[8], path[512];
    const char *key; /* API key sent as "Authorization: Bearer KEY" (NULL: none); checked by key_ok */
} url_t;

/* Printable ASCII only, in place: every other byte (control bytes, ESC, DEL,
 * and every byte of a non-ASCII character, C1 controls included) becomes '?'. */
static char *clean(char *t)
{
    for (unsigned char *p = (unsigned char *)t; *p; p++)
        if (*p < 0x20 || *p > 0x7e)
            *p = '?';
    return t;
}

/* http://HOST:PORT[/path], or HOST:PORT[/path] (http implied) */
static int parse_url(const char *u, url_t *out, char *err, size_t errlen)
{
    const char *h = u;
    if (!strncmp(u, "http://", 7))
        h = u + 7;
    else if (strstr(u, "://"))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "coordinator URL '%s': only http:// (or HOST:PORT)", u);
    const char *slash = strchr(h, '/');
    size_t hl = slash ? (size_t)(slash - h) : strlen(h);
    if (hl == 0 || hl >= sizeof out->host)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "coordinator URL '%s': bad host", u);
    char hp[256];
    memcpy(hp, h, hl);
    hp[hl] = 0;
    char *colon = strrchr(hp, ':');
    snprintf(out->port, sizeof out->port, "80");
    if (colon && !strchr(colon, ']')) {
        *colon = 0;
        char *end;
        long p = strtol(colon + 1, &end, 10);
        if (*end || p < 1 || p > 65535)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "coordinator URL '%s': bad port", u);
        snprintf(out->port, sizeof out->port, "%ld", p);
    }
    char *h0 = hp;
    size_t hn = strlen(hp);
    if (hn >= 2 && hp[0] == '[' && hp[hn - 1] == ']') { /* [IPv6] */
        hp[hn - 1] = 0;
        h0 = hp + 1;
    }
    if (!*h0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "coordinator URL '%s': bad host", u);
    snprintf(out->host, sizeof out->host, "%s", h0);
    const char *path = slash && strcmp(slash, "/") ? slash : "/metrics";
    if (strlen(path) >= sizeof out->path)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "coordinator URL '%s': path too long", u);
    snprintf(out->path, sizeof out->path, "%s", path);
    return 0;
}

static double mono_s(void)
{
    return (double)shoal_metrics_now_ns() / 1e9;
}

/* Decode a chunked body in place; returns the decoded length or -1. */
static long dechunk(char *b, size_t n)
{
    size_t in = 0, out = 0;
    for (;;) {
        char *eol = memchr(b + in, '\n', n - in);
        if (!eol)
            return -1;
        char *end;
        errno = 0;
        unsigned long sz = strtoul(b + in, &end, 16);
        if (errno || end == b + in || sz > n)
            return -1;
        in = (size_t)(eol - b) + 1;
        if (sz == 0)
            return (long)out;
        if (sz > n - in)
            return -1;
        memmove(b + out, b + in, sz);
        out += sz;
        in += sz;
        if (in < n && b[in] == '\r')
            in++;
        if (in >= n || b[in] != '\n')
            return -1;
        in++;
    }
}

#define MAX_KEY 4096

/* A key goes into a header line: printable ASCII without spaces only (a CR or
 * LF would let a key file inject headers), 1 .. MAX_KEY - 1 bytes. */
static int key_ok(const char *k)
{
    size_t n = strlen(k);
    if (!n || n >= MAX_KEY)
        return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)k[i] <= 0x20 || (unsigned char)k[i] >= 0x7f)
            return 0;
    return 1;
}

/* The first line of path (without its line end) into out[cap]; 0 or -1 (printed). */
static int read_key_file(const char *path, char *out, size_t cap)
{
    int rc = 0;
    FILE *f = shoal_fopen_regular(path, &rc);
    if (!f) {
        fprintf(stderr, "shoal top: --api-key-file %s: %s\n", path,
                rc == SHOAL_EFORMAT ? "not a regular file" : strerror(-rc));
        return -1;
    }
    size_t n = fread(out, 1, cap - 1, f);
    int more = fgetc(f) != EOF;
    fclose(f);
    out[n] = 0;
    out[strcspn(out, "\r\n")] = 0;
    if (more && strlen(out) == n) {
        fprintf(stderr, "shoal top: --api-key-file %s: the key is longer than %zu bytes\n", path, cap - 2);
        return -1;
    }
    return 0;
}

/* GET url; on success *body (malloc'd, NUL-terminated) and *blen. A 503
 * is a success too when ok503 (the body of /health while degraded). */
static int http_get_st(const url_t *u, double timeout_s, int ok503, char **body, size_t *blen, char *err,
                       size_t errlen)
{
    *body = NULL;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int gr = getaddrinfo(u->host, u->port, &hints, &ai);
    if (gr)
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: %s", u->host, gai_strerror(gr));
    double deadline = mono_s() + timeout_s;
    int fd = -1, rc = 0;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0)
            continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) && errno != EINPROGRESS) {
            close(fd);
            fd = -1;
            continue;
        }
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int ms = (int)((deadline - mono_s()) * 1000);
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (ms <= 0 || poll(&p, 1, ms) != 1 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) || soerr) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return shoal_err_set(err, errlen, SHOAL_EIO, "cannot connect to %s:%s", u->host, u->port);
    char req[1024 + MAX_KEY];
    int v6 = strchr(u->host, ':') != NULL;
    int rl = snprintf(req, sizeof req,
                      "GET %s HTTP/1.1\r\nHost: %s%s%s:%s\r\nAccept: text/plain\r\n%s%s%sConnection: close\r\n\r\n",
                      u->path, v6 ? "[" : "", u->host, v6 ? "]" : "", u->port, u->key ? "Authorization: Bearer " : "",
                      u->key ? u->key : "", u->key ? "\r\n" : "");
    size_t off = 0;
    while (off < (size_t)rl) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int ms = (int)((deadline - mono_s()) * 1000);
        if (ms <= 0 || poll(&p, 1, ms) != 1) {
            rc = shoal_err_set(err, errlen, SHOAL_ETIMEOUT, "%s:%s: timed out sending", u->host, u->port);
            goto out;
        }
        ssize_t w = send(fd, req + off, (size_t)rl - off, MSG_NOSIGNAL);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            rc = shoal_err_set(err, errlen, -errno, "%s:%s: %s", u->host, u->port, strerror(errno));
            goto out;
        }
        if (w > 0)
            off += (size_t)w;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = shoal_xmalloc(cap);
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = (int)((deadline - mono_s()) * 1000);
        if (ms <= 0 || poll(&p, 1, ms) != 1) {
            free(buf);
            rc = shoal_err_set(err, errlen, SHOAL_ETIMEOUT, "%s:%s: no complete answer within %.0f s", u->host,
                               u->port, timeout_s);
            goto out;
        }
        if (len + 1 >= cap) {
            if (cap >= MAX_BODY) {
                free(buf);
                rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "%s:%s: answer larger than %u bytes", u->host,
                                   u->port, MAX_BODY);
                goto out;
            }
            cap *= 2;
            buf = shoal_xrealloc(buf, cap);
        }
        ssize_t r = recv(fd, buf + len, cap - 1 - len, 0);
        if (r < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (r < 0) {
            free(buf);
            rc = shoal_err_set(err, errlen, -errno, "%s:%s: %s", u->host, u->port, strerror(errno));
            goto out;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    buf[len] = 0;
    /* status line, headers */
    int status = 0;
    if (len < 12 || strncmp(buf, "HTTP/1.", 7) || sscanf(buf + 9, "%3d", &status) != 1) {
        free(buf);
        rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "%s:%s: not an HTTP/1.x answer", u->host, u->port);
        goto out;
    }
    char *hend = strstr(buf, "\r\n\r\n");
    size_t hl = 4;
    if (!hend) {
        hend = strstr(buf, "\n\n");
        hl = 2;
    }
    if (!hend) {
        free(buf);
        rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "%s:%s: truncated HTTP header", u->host, u->port);
        goto out;
    }
    if (status != 200 && !(ok503 && status == 503)) {
        char line[128];
        size_t ll = strcspn(buf, "\r\n");
        snprintf(line, sizeof line, "%.*s", (int)(ll < 100 ? ll : 100), buf);
        free(buf);
        rc = shoal_err_set(err, errlen, SHOAL_EPEER, "GET http://%s:%s%s: %s", u->host, u->port, u->path, line);
        goto out;
    }
    int chunked = 0;
    for (char *h = strchr(buf, '\n') + 1; h < hend; h = strchr(h, '\n') + 1)
        if (!strncasecmp(h, "transfer-encoding:", 18) && strstr(h, "chunked") && strstr(h, "chunked") < hend)
            chunked = 1;
    char *b = hend + hl;
    size_t n = len - (size_t)(b - buf);
    if (chunked) {
        long d = dechunk(b, n);
        if (d < 0) {
            free(buf);
            rc = shoal_err_set(err, errlen, SHOAL_EPROTO, "%s:%s: bad chunked body", u->host, u->port);
            goto out;
        }
        n = (size_t)d;
    }
    memmove(buf, b, n);
    buf[n] = 0;
    *body = buf;
    *blen = n;
out:
    close(fd);
    return rc;
}

static int http_get(const url_t *u, double timeout_s, char **body, size_t *blen, char *err, size_t errlen)
{
    return http_get_st(u, timeout_s, 0, body, blen, err, errlen);
}

/* ---- the model of the table ---------------------------------------------- */

/* One histogram series as exposed: cumulative counts by ascending `le`. */
#define HB 64
typedef struct {
    int n;
    double le[HB], cum[HB];
} hist_t;

static void hist_add(hist_t *h, const shoal_metrics_parsed *s)
{
    const char *l = shoal_metrics_label_get(s, "le");
    if (!l || h->n == HB)
        return;
    char *end;
    double le = !strcmp(l, "+Inf") ? INFINITY : strtod(l, &end);
    if (isnan(le) || (le != INFINITY && *end) || (h->n && le <= h->le[h->n - 1]) || !(s->value >= 0))
        return; /* out of order or malformed: ignored */
    h->le[h->n] = le;
    h->cum[h->n++] = s->value;
}

/* The q-quantile of now - base (base NULL or of other bounds: now alone), as
 * Prometheus' histogram_quantile: linear inside the bucket holding rank q *
 * count; NaN when nothing was observed. */
static double hist_q(const hist_t *now, const hist_t *base, double q)
{
    int n = now->n;
    if (!n)
        return NAN;
    int use_base = base && base->n == n;
    for (int i = 0; use_base && i < n; i++)
        use_base = base->le[i] == now->le[i] && base->cum[i] <= now->cum[i]; /* else a restart: since start */
    double c[HB] = {0};
    for (int i = 0; i < n; i++)
        c[i] = now->cum[i] - (use_base ? base->cum[i] : 0);
    double total = c[n - 1];
    if (!(total > 0))
        return NAN;
    double rank = q * total;
    int i = 0;
    while (i < n - 1 && c[i] < rank)
        i++;
    if (isinf(now->le[i]))
        return i > 0 ? now->le[i - 1] : NAN;
    double lo = i > 0 ? now->le[i - 1] : 0, below = i > 0 ? c[i - 1] : 0, in = c[i] - below;
    return in > 0 ? lo + (now->le[i] - lo) * (rank - below) / in : now->le[i];
}

typedef struct {
    char id[ID_MAX + 1], endpoint[160];
    hist_t rtt; /* shoal_worker_rtt_seconds */
    int up;
    double owned, share, fair, p50, p99, weight_bytes, compute_s, expert_bytes, mem_total;
    double requests, errors, timeouts;
    /* trunk rows (--trunk remote): TRUNK_BATCH exchanges */
    double t_requests, t_weight, t_out, t_in, t_queue_s, t_compute_s, t_network_s;
    double t_lost, t_took; /* trunk rows lost to failover / taken over from others */
    double backoff_s;      /* a crash-looping local worker: seconds to its next restart */
    /* failover (replicas): times it was lost mid-exchange, pairs it took over
     * from others, and who took its pairs over (the largest takers) */
    double failovers, took, picks;
    char taker[4][ID_MAX + 1];
    double taken[4];
    int ntakers;
} row_t;

typedef struct {
    row_t *rows;
    int n;
    double tokens, uptime, worst_imb;
    int worst_layer;
    double failovers, resent, fo_p50, fo_p99;
    double trunk_failovers, resent_rows;
    /* the requests: generated tokens, running / queued, TTFT and ITL */
    double completion, running, queued, reqs_done;
    int have_sched;
    hist_t ttft, itl;
    double t; /* when it was read (monotonic seconds) */
    /* prefix cache (shoal serve --prefix-cache-gb / -dir) */
    double pc_lookups, pc_hits, pc_saved, pc_bytes, pc_entries, pc_disk, pc_refused;
} view_t;

/* ---- the window: past reads, to take differences from ----------------- */

typedef struct {
    char id[ID_MAX + 1];
    hist_t rtt;
} snaprow_t;

typedef struct {
    double t, completion, reqs_done;
    hist_t ttft, itl;
    int n;
    snaprow_t *rows;
} snap_t;

#define NSNAP 256
static snap_t g_snap[NSNAP]; /* a ring, oldest first from g_first */
static int g_first, g_nsnap;
static double g_window = 10; /* --window */

static void snap_push(const view_t *v)
{
    if (g_nsnap && v->t - g_snap[(g_first + g_nsnap - 1) % NSNAP].t < 0.25)
        return; /* at most 4 a second: the ring covers more than a minute */
    snap_t *sn;
    if (g_nsnap == NSNAP) {
        sn = &g_snap[g_first];
        g_first = (g_first + 1) % NSNAP;
        free(sn->rows);
    } else {
        sn = &g_snap[(g_first + g_nsnap++) % NSNAP];
    }
    sn->t = v->t;
    sn->completion = v->completion;
    sn->reqs_done = v->reqs_done;
    sn->ttft = v->ttft;
    sn->itl = v->itl;
    sn->n = v->n;
    sn->rows = shoal_xcalloc((size_t)(v->n ? v->n : 1), sizeof *sn->rows);
    for (int i = 0; i < v->n; i++) {
        memcpy(sn->rows[i].id, v->rows[i].id, sizeof sn->rows[i].id);
        sn->rows[i].rtt = v->rows[i].rtt;
    }
}

/* The newest read at least w seconds before t (or the oldest one there is,
 * younger than that); NULL when there is none before t. */
static const snap_t *snap_base(double t, double w)
{
    const snap_t *best = NULL;
    for (int k = 0; k < g_nsnap; k++) {
        const snap_t *sn = &g_snap[(g_first + k) % NSNAP];
        if (sn->t >= t - 1e-9)
            break;
        if (!best || sn->t <= t - w)
            best = sn;
    }
    return best;
}

static const hist_t *snap_rtt(const snap_t *sn, const char *id)
{
    for (int i = 0; sn && i < sn->n; i++)
        if (!strcmp(sn->rows[i].id, id))
            return &sn->rows[i].rtt;
    return NULL;
}

static row_t *row_of(view_t *v, const char *id)
{
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->rows[i].id, id))
            return &v->rows[i];
    if (v->n == MAX_ROWS)
        return NULL;
    row_t *r = &v->rows[v->n++];
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "%s", id);
    r->p50 = r->p99 = NAN;
    r->up = -1;
    return r;
}

static int collect(void *ctx, const shoal_metrics_parsed *s)
{
    view_t *v = ctx;
    const char *n = s->name;
    if (!strcmp(n, "shoal_forward_tokens_total"))
        v->tokens = s->value;
    else if (!strcmp(n, "shoal_completion_tokens_total"))
        v->completion = s->value;
    else if (!strcmp(n, "shoal_sched_running")) {
        v->running = s->value;
        v->have_sched = 1;
    } else if (!strcmp(n, "shoal_sched_queued"))
        v->queued = s->value;
    else if (!strcmp(n, "shoal_request_ttft_seconds_bucket"))
        hist_add(&v->ttft, s);
    else if (!strcmp(n, "shoal_request_inter_token_seconds_bucket"))
        hist_add(&v->itl, s);
    else if (!strcmp(n, "shoal_request_ttft_seconds_count"))
        v->reqs_done = s->value;
    else if (!strcmp(n, "shoal_trunk_failovers_total"))
        v->trunk_failovers = s->value;
    else if (!strcmp(n, "shoal_failover_resent_trunk_rows_total"))
        v->resent_rows = s->value;
    else if (!strcmp(n, "shoal_coordinator_uptime_seconds"))
        v->uptime = s->value;
    else if (!strcmp(n, "shoal_layer_imbalance")) {
        const char *l = shoal_metrics_label_get(s, "layer");
        if (l && s->value > v->worst_imb) {
            v->worst_imb = s->value;
            v->worst_layer = atoi(l);
        }
    }
    else if (!strcmp(n, "shoal_failovers_total"))
        v->failovers = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_lookups_total"))
        v->pc_lookups = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_hits_total"))
        v->pc_hits = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_saved_tokens_total"))
        v->pc_saved = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_bytes"))
        v->pc_bytes = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_entries"))
        v->pc_entries = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_disk_entries"))
        v->pc_disk = s->value;
    else if (!strcmp(n, "shoal_prefix_cache_refused_total"))
        v->pc_refused = s->value;
    else if (!strcmp(n, "shoal_failover_resent_pairs_total"))
        v->resent = s->value;
    else if (!strcmp(n, "shoal_failover_seconds")) {
        const char *q = shoal_metrics_label_get(s, "quantile");
        if (q && !strcmp(q, "0.5"))
            v->fo_p50 = s->value;
        else if (q && !strcmp(q, "0.99"))
            v->fo_p99 = s->value;
    } else if (!strcmp(n, "shoal_failover_takeover_pairs_total")) {
        const char *from = shoal_metrics_label_get(s, "from"), *to = shoal_metrics_label_get(s, "to");
        if (!from || !to || strlen(from) > ID_MAX || strlen(to) > ID_MAX)
            return 0;
        row_t *r = row_of(v, from);
        if (!r)
            return 0;
        /* keep the 4 largest takers, largest first */
        int at = r->ntakers < 4 ? r->ntakers++ : 3;
        if (at == 3 && r->ntakers == 4 && r->taken[3] >= s->value)
            return 0;
        snprintf(r->taker[at], sizeof r->taker[at], "%s", to);
        r->taken[at] = s->value;
        for (; at > 0 && r->taken[at - 1] < r->taken[at]; at--) {
            char t[ID_MAX + 1];
            double x = r->taken[at];
            memcpy(t, r->taker[at], sizeof t);
            memcpy(r->taker[at], r->taker[at - 1], sizeof t);
            r->taken[at] = r->taken[at - 1];
            memcpy(r->taker[at - 1], t, sizeof t);
            r->taken[at - 1] = x;
        }
        return 0;
    }
    if (strncmp(n, "shoal_worker_", 13))
        return 0;
    const char *w = shoal_metrics_label_get(s, "worker");
    if (!w || strlen(w) > ID_MAX)
        return 0;
    row_t *r = row_of(v, w);
    if (!r)
        return 0;
    n += 13;
    if (!strcmp(n, "info")) {
        const char *e = shoal_metrics_label_get(s, "endpoint");
        snprintf(r->endpoint, sizeof r->endpoint, "%s", e ? e : "");
    } else if (!strcmp(n, "up"))
        r->up = s->value != 0;
    else if (!strcmp(n, "experts_owned"))
        r->owned = s->value;
    else if (!strcmp(n, "load_share"))
        r->share = s->value;
    else if (!strcmp(n, "fair_share"))
        r->fair = s->value;
    else if (!strcmp(n, "rtt_seconds_bucket"))
        hist_add(&r->rtt, s);
    else if (!strcmp(n, "restart_backoff_seconds"))
        r->backoff_s = s->value;
    else if (!strcmp(n, "lost_trunk_rows_total"))
        r->t_lost = s->value;
    else if (!strcmp(n, "takeover_trunk_rows_total"))
        r->t_took = s->value;
    else if (!strcmp(n, "weight_bytes_total"))
        r->weight_bytes = s->value;
    else if (!strcmp(n, "compute_seconds_total"))
        r->compute_s = s->value;
    else if (!strcmp(n, "expert_bytes"))
        r->expert_bytes = s->value;
    else if (!strcmp(n, "memory_total_bytes"))
        r->mem_total = s->value;
    else if (!strcmp(n, "requests_total"))
        r->requests = s->value;
    else if (!strcmp(n, "errors_total"))
        r->errors = s->value;
    else if (!strcmp(n, "timeouts_total"))
        r->timeouts = s->value;
    else if (!strcmp(n, "failovers_total"))
        r->failovers = s->value;
    else if (!strcmp(n, "takeover_pairs_total"))
        r->took = s->value;
    else if (!strcmp(n, "replica_picks_total"))
        r->picks = s->value;
    else if (!strcmp(n, "trunk_requests_total"))
        r->t_requests = s->value;
    else if (!strcmp(n, "trunk_weight_bytes_total"))
        r->t_weight = s->value;
    else if (!strcmp(n, "trunk_sent_bytes_total"))
        r->t_out = s->value;
    else if (!strcmp(n, "trunk_received_bytes_total"))
        r->t_in = s->value;
    else if (!strcmp(n, "trunk_queue_seconds_total"))
        r->t_queue_s = s->value;
    else if (!strcmp(n, "trunk_compute_seconds_total"))
        r->t_compute_s = s->value;
    else if (!strcmp(n, "trunk_network_seconds_total"))
        r->t_network_s = s->value;
    return 0;
}

static int fetch(const url_t *u, view_t *v, char *err, size_t errlen)
{
    char *body = NULL;
    size_t blen = 0;
    int rc = http_get(u, 5.0, &body, &blen, err, errlen);
    if (rc)
        return rc;
    row_t *rows = v->rows;
    memset(v, 0, sizeof *v);
    v->rows = rows;
    v->fo_p50 = v->fo_p99 = NAN;
    v->worst_layer = -1;
    v->t = mono_s();
    rc = shoal_metrics_parse(body, blen, collect, v, err, errlen);
    free(body);
    return rc;
}

/* The windowed figures of a read: each shard's p50 / p99 over the window
 * (since start when base is NULL: --once without --window). */
static void apply_window(view_t *v, const snap_t *base)
{
    for (int i = 0; i < v->n; i++) {
        row_t *r = &v->rows[i];
        const hist_t *b = base ? snap_rtt(base, r->id) : NULL;
        hist_t empty = {0};
        if (base && !b)
            b = &empty; /* a shard new since the base: all its observations are in the window */
        r->p50 = b && !b->n ? hist_q(&r->rtt, NULL, 0.5) : hist_q(&r->rtt, b, 0.5);
        r->p99 = b && !b->n ? hist_q(&r->rtt, NULL, 0.99) : hist_q(&r->rtt, b, 0.99);
    }
}

/* ---- sorting and rendering ----------------------------------------------- */

typedef enum { SORT_NAME, SORT_SHARE, SORT_P50, SORT_P99, SORT_GBPS, SORT_MEM, SORT_ERRORS } sort_key;
static const char *const sort_names[] = {"name", "share", "p50", "p99", "gbps", "mem", "errors"};
static sort_key g_sort;
static int g_reverse;

static double gbps(const row_t *r)
{
    return r->compute_s > 0 ? r->weight_bytes / r->compute_s / 1e9 : 0;
}

static double key_of(const row_t *r, sort_key k)
{
    switch (k) {
    case SORT_SHARE: return r->share;
    case SORT_P50: return isnan(r->p50) ? -1 : r->p50;
    case SORT_P99: return isnan(r->p99) ? -1 : r->p99;
    case SORT_GBPS: return gbps(r);
    case SORT_MEM: return r->expert_bytes;
    case SORT_ERRORS: return r->errors + r->timeouts;
    case SORT_NAME: return 0;
    }
    return 0;
}

/* name ascending; numbers descending (the busiest / slowest first); ties by
 * name; --reverse / 'r' flips */
static int cmp_rows(const void *a, const void *b)
{
    const row_t *x = a, *y = b;
    int c = 0;
    if (g_sort != SORT_NAME) {
        double kx = key_of(x, g_sort), ky = key_of(y, g_sort);
        c = kx > ky ? -1 : kx < ky ? 1 : 0;
    }
    if (!c)
        c = strcmp(x->id, y->id);
    return g_reverse ? -c : c;
}

static void fmt_ms(char *b, size_t n, double s)
{
    if (isnan(s))
        snprintf(b, n, "-");
    else
        snprintf(b, n, "%.3f", s * 1e3);
}

static void fmt_gib(char *b, size_t n, double bytes)
{
    if (bytes >= 1024.0 * 1024 * 1024 * 10)
        snprintf(b, n, "%.0fG", bytes / (1024.0 * 1024 * 1024));
    else if (bytes >= 1024.0 * 1024 * 1024)
        snprintf(b, n, "%.1fG", bytes / (1024.0 * 1024 * 1024));
    else
        snprintf(b, n, "%.1fM", bytes / (1024.0 * 1024));
}

#define LINE_MAX_ 256

/* The table as text lines (shared by --once and the live view). Returns the
 * number of lines written into lines[max]. */
static int g_header_line; /* the table header's line, drawn reversed */

/* "p50 A p99 B ms" of h over [base, now] (since start when base is NULL) */
static void fmt_pair(char *b, size_t n, const hist_t *h, const hist_t *base)
{
    char a[16], c[16];
    fmt_ms(a, sizeof a, hist_q(h, base, 0.5));
    fmt_ms(c, sizeof c, hist_q(h, base, 0.99));
    snprintf(b, n, "p50 %s p99 %s ms", a, c);
}

/* The requests over [base, v] (since start when base is NULL): tokens/s,
 * TTFT and ITL. */
static void request_line(char *line, const view_t *v, const snap_t *base, const char *label)
{
    char tt[64], it[64], win[48];
    double span = base ? v->t - base->t : v->uptime;
    double tps = span > 0 ? (v->completion - (base ? base->completion : 0)) / span : 0;
    double done = v->reqs_done - (base ? base->reqs_done : 0);
    fmt_pair(tt, sizeof tt, &v->ttft, base ? &base->ttft : NULL);
    fmt_pair(it, sizeof it, &v->itl, base ? &base->itl : NULL);
    if (base)
        snprintf(win, sizeof win, "last %.0f s", span);
    else
        snprintf(win, sizeof win, "since start");
    snprintf(line, LINE_MAX_, "%s%.1f tokens/s, %.0f started; TTFT %s; ITL %s (%s)", label, tps < 0 ? 0 : tps,
             done < 0 ? 0 : done, tt, it, win);
}

static int render(const view_t *v, const snap_t *base, const snap_t *base60, const char *url,
                  char (*lines)[LINE_MAX_], int max)
{
    int k = 0;
    double maxshare = 0, sumshare = 0;
    int up = 0;
    for (int i = 0; i < v->n; i++) {
        maxshare = fmax(maxshare, v->rows[i].share);
        sumshare += v->rows[i].share;
        up += v->rows[i].up == 1;
    }
    double imb = v->n && sumshare > 0 ? maxshare / (sumshare / v->n) : 0;
    if (k < max)
        snprintf(lines[k++], LINE_MAX_, "shoal top - %s - up %.0f s, %.0f tokens, %d/%d shards up", url, v->uptime,
                 v->tokens, up, v->n);
    if (k < max && v->have_sched) {
        char head[64];
        snprintf(head, sizeof head, "requests: %.0f running, %.0f queued; ", v->running, v->queued);
        request_line(lines[k++], v, base, head);
    }
    if (k < max && v->have_sched && base60 && base60 != base)
        request_line(lines[k++], v, base60, "          1 min: ");
    if (k < max) {
        if (v->worst_layer >= 0)
            snprintf(lines[k++], LINE_MAX_,
                     "load imbalance (max/mean share) %.3f; worst layer %d at %.3f; sorted by %s%s", imb,
                     v->worst_layer, v->worst_imb, sort_names[g_sort], g_reverse ? " (reversed)" : "");
        else
            snprintf(lines[k++], LINE_MAX_, "load imbalance (max/mean share) %.3f; sorted by %s%s", imb,
                     sort_names[g_sort], g_reverse ? " (reversed)" : "");
    }
    g_header_line = k;
    if (k < max)
        snprintf(lines[k++], LINE_MAX_, "%-20s %-7s %8s %7s %7s %6s %9s %9s %7s %13s %9s %6s %6s %8s", "SHARD",
                 "STATUS", "EXPERTS", "SHARE", "FAIR", "xFAIR", "P50(ms)", "P99(ms)", "GB/s", "MEM/HOST", "REQS", "ERR",
                 "LOST", "TOOK");
    for (int i = 0; i < v->n && k < max; i++) {
        const row_t *r = &v->rows[i];
        char p50[16], p99[16], mem[16], host[16], mh[40];
        fmt_ms(p50, sizeof p50, r->p50);
        fmt_ms(p99, sizeof p99, r->p99);
        fmt_gib(mem, sizeof mem, r->expert_bytes);
        fmt_gib(host, sizeof host, r->mem_total);
        snprintf(mh, sizeof mh, "%s/%s", mem, host);
        snprintf(lines[k++], LINE_MAX_,
                 "%-20.20s %-7s %8.0f %7.3f %7.3f %6.2f %9s %9s %7.3f %13s %9.0f %6.0f %6.0f %8.0f", r->id,
                 r->up == 1 ? "up" : r->up == 0 ? (r->backoff_s > 0 ? "BACKOFF" : "DOWN") : "?", r->owned, r->share, r->fair,
                 r->fair > 0 ? r->share / r->fair : 0, p50, p99, gbps(r), mh, r->requests, r->errors + r->timeouts,
                 r->failovers, r->took);
    }
    /* failover: the totals, and for every shard that is down, who took its
     * pairs over (since start, the largest first) */
    if (v->pc_lookups > 0 && k < max)
        snprintf(lines[k++], LINE_MAX_,
                 "prefix cache: %.0f hits of %.0f prompts, %.0f tokens not prefilled; %.1f MiB in memory (%.0f "
                 "captures), %.0f on disk, %.0f files refused",
                 v->pc_hits, v->pc_lookups, v->pc_saved, v->pc_bytes / 1048576.0, v->pc_entries, v->pc_disk,
                 v->pc_refused);
    if (v->failovers > 0 && k < max) {
        char a[16], b[16];
        fmt_ms(a, sizeof a, v->fo_p50);
        fmt_ms(b, sizeof b, v->fo_p99);
        snprintf(lines[k++], LINE_MAX_, "failovers %.0f (%.0f in trunk steps), %.0f pairs resent and %.0f trunk rows "
                 "resent to other owners; time lost per failover p50 %s ms, p99 %s ms (since start)",
                 v->failovers, v->trunk_failovers, v->resent, v->resent_rows, a, b);
    }
    for (int i = 0; i < v->n && k < max; i++) {
        const row_t *r = &v->rows[i];
        if (r->up != 0)
            continue;
        char who[LINE_MAX_] = "";
        size_t at = 0;
        for (int j = 0; j < r->ntakers && at < sizeof who; j++)
            at += (size_t)snprintf(who + at, sizeof who - at, "%s%.20s (%.0f pairs)", j ? ", " : "", r->taker[j],
                                   r->taken[j]);
        if (r->backoff_s > 0)
            snprintf(lines[k++], LINE_MAX_, "%.20s is DOWN, crash-looping: backing off, next restart in %.0f s; %s%.150s",
                     r->id, r->backoff_s, r->ntakers ? "taken over by " : "nothing taken over", who);
        else
            snprintf(lines[k++], LINE_MAX_, "%.20s is DOWN; %s%.180s", r->id,
                     r->ntakers ? "taken over by " : "nothing taken over (no replica asked yet)", who);
    }
    /* trunk rows, when some shard computes them: per-request means of the
     * network / queue / compute split, bytes read and on the wire */
    int any_trunk = 0;
    for (int i = 0; i < v->n; i++)
        any_trunk |= v->rows[i].t_requests > 0;
    if (any_trunk && k < max)
        snprintf(lines[k++], LINE_MAX_, "%-20s %9s %11s %11s %9s %9s %9s %9s %9s", "TRUNK SHARD", "TREQS", "READ(GB)",
                 "WIRE(MB)", "NET(ms)", "QUEUE(ms)", "COMP(ms)", "LOSTROWS", "TOOKROWS");
    for (int i = 0; any_trunk && i < v->n && k < max; i++) {
        const row_t *r = &v->rows[i];
        if (r->t_requests <= 0)
            continue;
        double q = r->t_requests;
        snprintf(lines[k++], LINE_MAX_, "%-20.20s %9.0f %11.3f %11.3f %9.3f %9.3f %9.3f %9.0f %9.0f", r->id,
                 r->t_requests, r->t_weight / 1e9, (r->t_out + r->t_in) / 1e6, r->t_network_s * 1e3 / q,
                 r->t_queue_s * 1e3 / q, r->t_compute_s * 1e3 / q, r->t_lost, r->t_took);
    }
    for (int i = 0; i < k; i++) /* names and labels come from the peer: printable ASCII only */
        clean(lines[i]);
    return k;
}

/* ---- the command ---------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal top --coordinator [http://]HOST:PORT [--once] [--interval S] [--window S] [--sort KEY]\n"
               "                 [--reverse]\n"
               "\n"
               "A running `shoal serve`, from its /metrics: requests running and queued, tokens/s,\n"
               "time to first token (TTFT) and between tokens (ITL) over the last --window seconds\n"
               "and the last minute; then one row per expert server (shard): status, experts\n"
               "owned, load share vs fair share (1/N) and their ratio, round-trip p50/p99 (ms,\n"
               "over the window), weight GB/s while computing, expert weights / host memory,\n"
               "requests, errors + timeouts, failovers; trunk rows lost and taken over.\n"
               "\n"
               "  --coordinator URL  the coordinator's HTTP address, http://HOST:PORT or HOST:PORT\n"
               "                     (path default /metrics)\n"
               "  --once             print the table once as plain text and exit (latencies since\n"
               "                     start; with --window S: two reads S seconds apart)\n"
               "  --interval S       refresh period of the live view (default 2)\n"
               "  --window S         latencies and rates over the last S seconds (default 10)\n"
               "  --web PORT         instead of the terminal view, serve the live cluster page for\n"
               "                     this coordinator on http://127.0.0.1:PORT/ (0: a free port,\n"
               "                     printed); the page needs the same key as the coordinator\n"
               "  --web-host ADDR    the page's bind address (default 127.0.0.1)\n"
               "  --sort KEY         name, share, p50, p99, gbps, mem, errors (default share)\n"
               "  --reverse          reverse the order\n"
               "  --api-key KEY      the coordinator's key (`shoal serve --api-key`), sent as a Bearer token\n"
               "  --api-key-file F   the same, read from the first line of F (keeps it out of `ps`)\n"
               "                     (neither given: the environment variable SHOAL_API_KEY, if set)\n"
               "\n"
               "keys in the live view: n s p l g m e = sort by name, share, p50, p99 (latency),\n"
               "GB/s, memory, errors; r = reverse; space = refresh now; q = quit.\n"
               "\n"
               "exit codes: 0 ok, 2 usage error, 4 the coordinator could not be read\n");
}

static int parse_sort(const char *s, sort_key *out)
{
    for (int i = 0; i < (int)(sizeof sort_names / sizeof sort_names[0]); i++)
        if (!strcmp(s, sort_names[i])) {
            *out = (sort_key)i;
            return 0;
        }
    return -1;
}

/* One read into v, its window applied; 0 or the error (in err). */
static int read_view(const url_t *u, view_t *v, char *err, size_t errlen)
{
    int rc = fetch(u, v, err, errlen);
    if (!rc)
        apply_window(v, snap_base(v->t, g_window));
    return rc;
}

static int live(const url_t *u, const char *url, double interval, view_t *v)
{
    static char lines[MAX_ROWS + 8][LINE_MAX_];
    char err[512] = "";
    int have = 0;
    if (!initscr()) {
        fprintf(stderr, "shoal top: cannot initialise the terminal (TERM=%s)\n", getenv("TERM") ? getenv("TERM") : "");
        return 4;
    }
    cbreak();
    noecho();
    keypad(stdscr, TRUE);
    curs_set(0);
    double next = 0;
    for (;;) {
        if (mono_s() >= next) {
            err[0] = 0;
            int ok = read_view(u, v, err, sizeof err) == 0;
            have |= ok;
            if (ok)
                snap_push(v);
            clean(err);
            next = mono_s() + interval;
        }
        if (have)
            qsort(v->rows, (size_t)v->n, sizeof *v->rows, cmp_rows);
        int n = have ? render(v, snap_base(v->t, g_window), snap_base(v->t, 60), url, lines, MAX_ROWS + 8) : 0;
        erase();
        int H = LINES, W = COLS;
        for (int i = 0; i < n && i < H - 1; i++) {
            if (i == g_header_line)
                attron(A_REVERSE);
            mvaddnstr(i, 0, lines[i], W);
            if (i == g_header_line)
                attroff(A_REVERSE);
        }
        if (!have)
            mvaddnstr(0, 0, "shoal top: waiting for the coordinator", W);
        if (err[0])
            mvaddnstr(H - 2 > n ? n + 1 : H - 2, 0, err, W);
        mvaddnstr(H - 1, 0, "sort: n)ame s)hare p)50 l)atency p99 g)b/s m)em e)rrors  r)everse  q)uit", W);
        refresh();
        int ms = (int)((next - mono_s()) * 1000);
        timeout(ms > 0 ? ms : 0);
        int c = getch();
        if (c == 'q' || c == 'Q')
            break;
        switch (c) {
        case 'n': g_sort = SORT_NAME; break;
        case 's': g_sort = SORT_SHARE; break;
        case 'p': g_sort = SORT_P50; break;
        case 'l': g_sort = SORT_P99; break;
        case 'g': g_sort = SORT_GBPS; break;
        case 'm': g_sort = SORT_MEM; break;
        case 'e': g_sort = SORT_ERRORS; break;
        case 'r': g_reverse = !g_reverse; break;
        case ' ': next = 0; break;
        default: break;
        }
    }
    endwin();
    return 0;
}

/* ---- --web: the cluster page for any coordinator ------------------------ */

typedef struct {
    url_t metrics, health;
} web_src;

/* The snapshot, read from the coordinator on the loop thread (a blocking
 * GET with its deadline: one browser tab's wait, nobody else's). */
static char *web_source(void *ud)
{
    web_src *w = ud;
    char *body = NULL, *hbody = NULL, err[512];
    size_t blen = 0, hlen = 0;
    if (http_get(&w->metrics, 5.0, &body, &blen, err, sizeof err)) {
        SHOAL_WARN("top --web: %s", clean(err));
        return NULL;
    }
    json_t *h = NULL;
    if (!http_get_st(&w->health, 5.0, 1, &hbody, &hlen, err, sizeof err))
        h = json_loadb(hbody, hlen, 0, NULL);
    free(hbody);
    char *out = shoal_webui_cluster_json(body, blen, json_is_object(h) ? h : NULL, err, sizeof err);
    if (!out)
        SHOAL_WARN("top --web: %s", clean(err));
    json_decref(h);
    free(body);
    return out;
}

static void web_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req)
{
    shoal_webui **w = ud;
    shoal_webui_on_request(*w, ex, req);
}

static int web(const url_t *u, const char *host, int port, const char *key)
{
    web_src src = {*u, *u};
    snprintf(src.health.path, sizeof src.health.path, "/health");
    shoal_http *http = NULL;
    shoal_webui *w = NULL;
    char err[512];
    shoal_http_opts ho = {.host = host, .port = port, .max_header_bytes = 16 << 10, .max_body_bytes = 1 << 10,
                          .max_connections = 64, .max_per_addr = 32, .header_timeout_ms = 10000,
                          .request_timeout_ms = 30000, .idle_timeout_ms = 60000, .write_timeout_ms = 30000,
                          .max_write_queue = 16u << 20, .handle_signals = 1, .on_request = web_request,
                          .ud = &w}; /* requests come once the loop runs: w is set by then */
    shoal_log_set_role("T");
    int rc = shoal_http_open(&http, &ho, err, sizeof err);
    if (!rc)
        rc = shoal_webui_open(&w, http, key, web_source, &src, 1000, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal top: --web: %s\n", err);
        shoal_http_close(http);
        return rc == SHOAL_EINVAL ? 2 : 4;
    }
    printf("shoal top: cluster page on http://%s%s%s:%d/ for %s:%s\n", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", shoal_http_port(http), u->host, u->port);
    fflush(stdout);
    shoal_http_run(http);
    shoal_webui_close(w);
    shoal_http_close(http);
    return 0;
}

int shoal_cmd_top(int argc, char **argv)
{
    const char *url = NULL, *key = NULL, *key_file = NULL;
    int once = 0, window_given = 0;
    long web_port = -1;
    const char *web_host = "127.0.0.1";
    double interval = 2;
    g_window = 10;
    g_sort = SORT_SHARE;
    g_reverse = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--coordinator") && val) {
            url = val;
            i++;
        } else if (!strcmp(a, "--api-key") && val) {
            key = val;
            i++;
        } else if (!strcmp(a, "--api-key-file") && val) {
            key_file = val;
            i++;
        } else if (!strcmp(a, "--once")) {
            once = 1;
        } else if (!strcmp(a, "--reverse")) {
            g_reverse = 1;
        } else if (!strcmp(a, "--web") && val) {
            char *end;
            web_port = strtol(val, &end, 10);
            if (*end || web_port < 0 || web_port > 65535) {
                fprintf(stderr, "shoal top: --web needs a port 0..65535\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--web-host") && val) {
            web_host = val;
            i++;
        } else if (!strcmp(a, "--window") && val) {
            char *end;
            g_window = strtod(val, &end);
            if (*end || !(g_window >= 0.5 && g_window <= 60)) {
                fprintf(stderr, "shoal top: --window must be 0.5 .. 60 seconds\n");
                return 2;
            }
            window_given = 1;
            i++;
        } else if (!strcmp(a, "--interval") && val) {
            char *end;
            interval = strtod(val, &end);
            if (*end || !(interval >= 0.1 && interval <= 3600)) {
                fprintf(stderr, "shoal top: --interval must be 0.1 .. 3600 seconds\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--sort") && val) {
            if (parse_sort(val, &g_sort)) {
                fprintf(stderr, "shoal top: unknown --sort key '%s'\n", val);
                return 2;
            }
            i++;
        } else {
            if (a[0] == '-' && shoal_suggest_flag(a, usage) && strcmp(shoal_suggest_flag(a, usage), a))
                shoal_suggest_unknown_flag("shoal top", a, usage);
            else {
                fprintf(stderr, "shoal top: unknown or incomplete option '%s'\n", a);
                usage(stderr);
            }
            return 2;
        }
    }
    if (!url) {
        usage(stderr);
        return 2;
    }
    url_t u;
    char err[512];
    if (parse_url(url, &u, err, sizeof err)) {
        fprintf(stderr, "shoal top: %s\n", err);
        return 2;
    }
    static char key_buf[MAX_KEY + 1];
    if (key && key_file) {
        fprintf(stderr, "shoal top: give --api-key or --api-key-file, not both\n");
        return 2;
    }
    if (key_file) {
        if (read_key_file(key_file, key_buf, sizeof key_buf))
            return 2;
        key = key_buf;
    } else if (!key && getenv("SHOAL_API_KEY")) {
        key = getenv("SHOAL_API_KEY");
    }
    if (key && !key_ok(key)) {
        fprintf(stderr, "shoal top: the API key must be 1 to %d printable ASCII bytes without spaces\n", MAX_KEY - 1);
        return 2;
    }
    u.key = key;
    view_t v = {.rows = shoal_xcalloc(MAX_ROWS, sizeof(row_t))};
    int status = 0;
    if (web_port >= 0) {
        /* the page shows the cluster's addresses: beyond this machine only behind the key */
        struct in_addr a4;
        struct in6_addr a6;
        int loop = (inet_pton(AF_INET, web_host, &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127) ||
                   (inet_pton(AF_INET6, web_host, &a6) == 1 && IN6_IS_ADDR_LOOPBACK(&a6));
        if (!loop && !key) {
            fprintf(stderr, "shoal top: --web-host %s is reachable from other machines: give --api-key (the "
                            "page then requires it)\n", web_host);
            free(v.rows);
            return 2;
        }
        status = web(&u, web_host, (int)web_port, key);
    } else if (once) {
        /* since start; over --window S: a first read, S seconds, the second */
        int rc = 0;
        if (window_given && !(rc = fetch(&u, &v, err, sizeof err))) {
            snap_push(&v);
            struct timespec ts = {(time_t)g_window, (long)((g_window - (double)(time_t)g_window) * 1e9)};
            nanosleep(&ts, NULL);
        }
        if (!rc)
            rc = fetch(&u, &v, err, sizeof err);
        const snap_t *base = window_given && !rc ? snap_base(v.t, g_window) : NULL;
        if (rc) {
            fprintf(stderr, "shoal top: %s\n", clean(err));
            status = 4;
        } else {
            static char lines[MAX_ROWS + 8][LINE_MAX_];
            apply_window(&v, base);
            qsort(v.rows, (size_t)v.n, sizeof *v.rows, cmp_rows);
            int n = render(&v, base, NULL, url, lines, MAX_ROWS + 8);
            for (int i = 0; i < n; i++)
                printf("%s\n", lines[i]);
        }
    } else {
        status = live(&u, url, interval, &v);
    }
    free(v.rows);
    for (int k = 0; k < g_nsnap; k++)
        free(g_snap[(g_first + k) % NSNAP].rows);
    g_nsnap = g_first = 0;
    return status;
}
