/* wmetrics: expert-server counters, their exposition, and the /metrics
 * responder. Names: docs/METRICS.md. */
#include "worker/wmetrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "common/log.h"
#include "cli/version.h"
#include "kernels/kernels.h"
#include "proto/proto.h"

#define NTYPES 17  /* message types 0 (undecodable) .. 16 (TRUNK_X) */
#define NPERR 12   /* ERROR codes 0 (unknown) .. 11 */

struct shoal_wmetrics {
    char id[SHOAL_PROTO_MAX_ID + 1];
    int num_layers, num_experts;
    uint8_t is_moe[SHOAL_MAX_LAYERS];
    uint64_t expert_bytes, owned, start_ns;
    shoal_metrics_counter requests[NTYPES], errors[NPERR];
    shoal_metrics_counter bytes_in, bytes_out, send_failed;
    shoal_metrics_counter batches, tokens, pairs, experts, queue_us, compute_us;
    shoal_metrics_hist queue_h, compute_h;
    shoal_metrics_counter *hits; /* [num_layers * num_experts] */
    shoal_metrics_counter cache_hits, cache_misses, cache_bytes, cache_read_us;
    shoal_metrics_counter pf_reads, pf_bytes, pf_hits, pf_wasted, pf_dropped;
    shoal_metrics_counter act_f32, act_bf16; /* activation payload bytes by wire dtype */
    shoal_metrics_counter relay[SHOAL_WRELAY_N], relay_in_bytes;
    uint32_t cache_slots;
    uint64_t cache_slot_bytes;
    /* HTTP responder */
    int lfd;
    pthread_t th;
    int running;
    atomic_int stop;
};

int shoal_wmetrics_open(shoal_wmetrics **out, const shoal_wmetrics_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (o->num_layers < 1 || o->num_layers > SHOAL_MAX_LAYERS || !o->is_moe || o->num_experts < 1 ||
        o->num_experts > 65536)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "wmetrics: %d layers x %d experts out of range",
                             o->num_layers, o->num_experts);
    shoal_wmetrics *wm = shoal_xcalloc(1, sizeof *wm);
    snprintf(wm->id, sizeof wm->id, "%s", o->id ? o->id : "");
    wm->num_layers = o->num_layers;
    wm->num_experts = o->num_experts;
    memcpy(wm->is_moe, o->is_moe, (size_t)o->num_layers);
    wm->expert_bytes = o->expert_bytes;
    wm->owned = o->owned;
    wm->start_ns = shoal_metrics_now_ns();
    wm->hits = shoal_xcalloc((size_t)o->num_layers * (size_t)o->num_experts, sizeof *wm->hits);
    wm->lfd = -1;
    *out = wm;
    return 0;
}

void shoal_wmetrics_close(shoal_wmetrics *wm)
{
    if (!wm)
        return;
    if (wm->running) {
        atomic_store(&wm->stop, 1);
        pthread_join(wm->th, NULL);
    }
    if (wm->lfd >= 0)
        close(wm->lfd);
    free(wm->hits);
    free(wm);
}

/* the types a worker is sent: requests and the two notices */
static int worker_bound(int t)
{
    switch (t) {
    case SHOAL_MSG_HELLO: case SHOAL_MSG_PING: case SHOAL_MSG_STATS: case SHOAL_MSG_SHUTDOWN:
    case SHOAL_MSG_EXPERT_BATCH: case SHOAL_MSG_PREFETCH: case SHOAL_MSG_TRUNK_BATCH: case SHOAL_MSG_PROBE:
    case SHOAL_MSG_TRUNK_X:
        return 1;
    default:
        return 0;
    }
}

/* ---- updates ------------------------------------------------------------ */

void shoal_wmetrics_request(shoal_wmetrics *wm, int type, uint64_t bytes)
{
    if (!wm)
        return;
    shoal_metrics_add(&wm->requests[type > 0 && type < NTYPES ? type : 0], 1);
    shoal_metrics_add(&wm->bytes_in, bytes);
}

void shoal_wmetrics_reply(shoal_wmetrics *wm, uint64_t bytes, int perr)
{
    if (!wm)
        return;
    shoal_metrics_add(&wm->bytes_out, bytes);
    if (perr)
        shoal_metrics_add(&wm->errors[perr > 0 && perr < NPERR ? perr : 0], 1);
}

void shoal_wmetrics_send_failed(shoal_wmetrics *wm)
{
    if (wm)
        shoal_metrics_add(&wm->send_failed, 1);
}

void shoal_wmetrics_batch(shoal_wmetrics *wm, uint32_t T, uint32_t n, uint32_t distinct, uint64_t queue_us,
                          uint64_t compute_us)
{
    if (!wm)
        return;
    shoal_metrics_add(&wm->batches, 1);
    shoal_metrics_add(&wm->tokens, T);
    shoal_metrics_add(&wm->pairs, n);
    shoal_metrics_add(&wm->experts, distinct);
    shoal_metrics_add(&wm->queue_us, queue_us);
    shoal_metrics_add(&wm->compute_us, compute_us);
    shoal_metrics_observe(&wm->queue_h, queue_us * 1000u);
    shoal_metrics_observe(&wm->compute_h, compute_us * 1000u);
}

void shoal_wmetrics_expert(shoal_wmetrics *wm, int layer, int expert, uint32_t count)
{
    if (!wm || layer < 0 || layer >= wm->num_layers || expert < 0 || expert >= wm->num_experts)
        return;
    shoal_metrics_add(&wm->hits[(size_t)layer * wm->num_experts + expert], count);
}

void shoal_wmetrics_activation(shoal_wmetrics *wm, int dtype, uint64_t bytes)
{
    if (wm)
        shoal_metrics_add(dtype == SHOAL_WIRE_BF16 ? &wm->act_bf16 : &wm->act_f32, bytes);
}

void shoal_wmetrics_cache_config(shoal_wmetrics *wm, uint32_t slots, uint64_t slot_bytes)
{
    if (!wm)
        return;
    wm->cache_slots = slots; /* set before the HTTP thread starts */
    wm->cache_slot_bytes = slot_bytes;
}

void shoal_wmetrics_cache(shoal_wmetrics *wm, uint64_t hits, uint64_t misses, uint64_t bytes, uint64_t read_us)
{
    if (!wm)
        return;
    shoal_metrics_add(&wm->cache_hits, hits);
    shoal_metrics_add(&wm->cache_misses, misses);
    shoal_metrics_add(&wm->cache_bytes, bytes);
    shoal_metrics_add(&wm->cache_read_us, read_us);
}

void shoal_wmetrics_prefetch(shoal_wmetrics *wm, uint64_t reads, uint64_t bytes, uint64_t hits, uint64_t wasted)
{
    if (!wm)
        return;
    shoal_metrics_add(&wm->pf_reads, reads);
    shoal_metrics_add(&wm->pf_bytes, bytes);
    shoal_metrics_add(&wm->pf_hits, hits);
    shoal_metrics_add(&wm->pf_wasted, wasted);
}

void shoal_wmetrics_relay(shoal_wmetrics *wm, shoal_wrelay_event ev)
{
    if (wm && ev >= 0 && ev < SHOAL_WRELAY_N)
        shoal_metrics_add(&wm->relay[ev], 1);
}

void shoal_wmetrics_relay_in_bytes(shoal_wmetrics *wm, uint64_t bytes)
{
    if (wm)
        shoal_metrics_add(&wm->relay_in_bytes, bytes);
}

void shoal_wmetrics_prefetch_dropped(shoal_wmetrics *wm)
{
    if (wm)
        shoal_metrics_add(&wm->pf_dropped, 1);
}

uint64_t shoal_wmetrics_expert_hits(shoal_wmetrics *wm, int layer, int expert)
{
    if (!wm || layer < 0 || layer >= wm->num_layers || expert < 0 || expert >= wm->num_experts)
        return 0;
    return shoal_metrics_get(&wm->hits[(size_t)layer * wm->num_experts + expert]);
}

/* ---- exposition --------------------------------------------------------- */

uint64_t shoal_wmetrics_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return 0;
    unsigned long long size = 0, rss = 0;
    int n = fscanf(f, "%llu %llu", &size, &rss);
    fclose(f);
    if (n != 2)
        return 0;
    long page = sysconf(_SC_PAGESIZE);
    return rss * (unsigned long long)(page > 0 ? page : 4096);
}

static void one(shoal_metrics_buf *b, const char *name, shoal_metrics_type t, const char *help,
                const shoal_metrics_label *l, double v)
{
    shoal_metrics_family(b, name, t, help);
    shoal_metrics_sample(b, name, l, 1, v);
}

void shoal_wmetrics_write(shoal_wmetrics *wm, shoal_metrics_buf *b)
{
    shoal_metrics_label wl[1] = {{"worker", wm->id}};
    shoal_metrics_process_families(b, SHOAL_VERSION, shoal_isa_name(shoal_kernels_cpu_best()),
                                   shoal_isa_name(shoal_kernels_isa()), shoal_numerics_name(shoal_kernels_numerics()),
                                   shoal_kernels_mu_engine());
    one(b, "shoal_expert_server_uptime_seconds", SHOAL_METRICS_GAUGE, "Seconds since the expert server started.", wl,
        (double)(shoal_metrics_now_ns() - wm->start_ns) / 1e9);
    one(b, "shoal_expert_server_resident_bytes", SHOAL_METRICS_GAUGE,
        "Resident memory of the expert server process (mapped expert weights it touched included).", wl,
        (double)shoal_wmetrics_rss_bytes());
    one(b, "shoal_expert_server_experts_owned", SHOAL_METRICS_GAUGE, "(layer, expert) pairs this server owns.", wl,
        (double)wm->owned);
    one(b, "shoal_expert_server_expert_bytes", SHOAL_METRICS_GAUGE, "Bytes of the expert weights this server owns.",
        wl, (double)(wm->owned * wm->expert_bytes));

    shoal_metrics_family(b, "shoal_expert_server_requests_total", SHOAL_METRICS_COUNTER,
                         "Messages received, by type (\"?\" for those whose type did not decode).");
    for (int t = 0; t < NTYPES; t++) {
        uint64_t v = shoal_metrics_get(&wm->requests[t]);
        const char *tn = t ? shoal_msg_type_name(t) : "?";
        if (!v && !worker_bound(t)) /* list what a worker is sent always, the rest (replies, "?") if seen */
            continue;
        shoal_metrics_label l[2] = {{"worker", wm->id}, {"type", tn}};
        shoal_metrics_sample(b, "shoal_expert_server_requests_total", l, 2, (double)v);
    }
    shoal_metrics_family(b, "shoal_expert_server_errors_total", SHOAL_METRICS_COUNTER,
                         "ERROR replies sent, by PROTOCOL.md error code.");
    for (int e = 1; e < NPERR; e++) {
        shoal_metrics_label l[2] = {{"worker", wm->id}, {"code", shoal_perr_name(e)}};
        shoal_metrics_sample(b, "shoal_expert_server_errors_total", l, 2, (double)shoal_metrics_get(&wm->errors[e]));
    }
    one(b, "shoal_expert_server_send_failures_total", SHOAL_METRICS_COUNTER,
        "Replies that could not be sent (peer gone, ZeroMQ error).", wl, (double)shoal_metrics_get(&wm->send_failed));
    one(b, "shoal_expert_server_received_bytes_total", SHOAL_METRICS_COUNTER, "Bytes of all frames received.", wl,
        (double)shoal_metrics_get(&wm->bytes_in));
    one(b, "shoal_expert_server_sent_bytes_total", SHOAL_METRICS_COUNTER, "Bytes of all reply frames sent.", wl,
        (double)shoal_metrics_get(&wm->bytes_out));
    shoal_metrics_family(b, "shoal_expert_server_activation_bytes_total", SHOAL_METRICS_COUNTER,
                         "Payload bytes of the activation frames of served requests (EXPERT_BATCH act, TRUNK_BATCH "
                         "x), by wire dtype.");
    for (int k = 0; k < 2; k++) {
        shoal_metrics_label l[2] = {{"worker", wm->id}, {"dtype", k ? "bf16" : "f32"}};
        shoal_metrics_sample(b, "shoal_expert_server_activation_bytes_total", l, 2,
                             (double)shoal_metrics_get(k ? &wm->act_bf16 : &wm->act_f32));
    }
    one(b, "shoal_expert_server_batches_total", SHOAL_METRICS_COUNTER, "EXPERT_BATCH requests served.", wl,
        (double)shoal_metrics_get(&wm->batches));
    one(b, "shoal_expert_server_tokens_total", SHOAL_METRICS_COUNTER, "Activation rows in served batches.", wl,
        (double)shoal_metrics_get(&wm->tokens));
    one(b, "shoal_expert_server_pairs_total", SHOAL_METRICS_COUNTER, "(token, expert) pairs computed.", wl,
        (double)shoal_metrics_get(&wm->pairs));
    one(b, "shoal_expert_server_weight_bytes_total", SHOAL_METRICS_COUNTER,
        "Expert weight bytes read: each distinct expert of a batch once.", wl,
        (double)shoal_metrics_get(&wm->experts) * (double)wm->expert_bytes);
    one(b, "shoal_expert_server_queue_seconds_total", SHOAL_METRICS_COUNTER,
        "Seconds served batches waited behind earlier requests (the replies' queue_us).", wl,
        (double)shoal_metrics_get(&wm->queue_us) / 1e6);
    one(b, "shoal_expert_server_compute_seconds_total", SHOAL_METRICS_COUNTER,
        "Seconds computing served batches (the replies' compute_us).", wl,
        (double)shoal_metrics_get(&wm->compute_us) / 1e6);
    one(b, "shoal_expert_server_cache_slots", SHOAL_METRICS_GAUGE,
        "Experts the RAM-budgeted expert cache holds at once (0: experts mapped, no cache).", wl,
        (double)wm->cache_slots);
    one(b, "shoal_expert_server_cache_bytes", SHOAL_METRICS_GAUGE, "Bytes allocated for the expert cache's slots.", wl,
        (double)wm->cache_slots * (double)wm->cache_slot_bytes);
    one(b, "shoal_expert_server_cache_hits_total", SHOAL_METRICS_COUNTER,
        "Expert fetches found resident in the expert cache (prefetch hits apart).", wl,
        (double)shoal_metrics_get(&wm->cache_hits));
    one(b, "shoal_expert_server_cache_misses_total", SHOAL_METRICS_COUNTER,
        "Expert fetches read from disk into the expert cache.", wl, (double)shoal_metrics_get(&wm->cache_misses));
    one(b, "shoal_expert_server_disk_read_bytes_total", SHOAL_METRICS_COUNTER,
        "Bytes the expert cache read from disk (aligned spans).", wl, (double)shoal_metrics_get(&wm->cache_bytes));
    one(b, "shoal_expert_server_disk_read_seconds_total", SHOAL_METRICS_COUNTER,
        "Seconds the request handler waited for expert reads.", wl,
        (double)shoal_metrics_get(&wm->cache_read_us) / 1e6);
    one(b, "shoal_expert_server_prefetch_reads_total", SHOAL_METRICS_COUNTER,
        "Experts read into the expert cache because of a PREFETCH hint.", wl,
        (double)shoal_metrics_get(&wm->pf_reads));
    one(b, "shoal_expert_server_prefetch_read_bytes_total", SHOAL_METRICS_COUNTER,
        "Bytes read from disk for PREFETCH hints (aligned spans).", wl, (double)shoal_metrics_get(&wm->pf_bytes));
    one(b, "shoal_expert_server_prefetch_hits_total", SHOAL_METRICS_COUNTER,
        "Expert fetches served by a hinted read (the expert's first use after its hint).", wl,
        (double)shoal_metrics_get(&wm->pf_hits));
    one(b, "shoal_expert_server_prefetch_wasted_total", SHOAL_METRICS_COUNTER,
        "Hinted experts evicted before any use.", wl, (double)shoal_metrics_get(&wm->pf_wasted));
    one(b, "shoal_expert_server_prefetch_dropped_total", SHOAL_METRICS_COUNTER,
        "PREFETCH notices dropped (malformed, before HELLO, not an MoE layer).", wl,
        (double)shoal_metrics_get(&wm->pf_dropped));
    static const char *const relay_name[SHOAL_WRELAY_N][2] = {
        {"shoal_expert_server_relay_in_total", "TRUNK_X inputs taken from a relay parent (PROTOCOL.md 3.9)."},
        {"shoal_expert_server_relay_out_total", "TRUNK_X inputs forwarded to a relay child."},
        {"shoal_expert_server_relay_parked_total", "Relayed requests and inputs parked to wait for their other half."},
        {"shoal_expert_server_relay_expired_total", "Parked relayed requests and inputs that expired unpaired."},
        {"shoal_expert_server_relay_dropped_total",
         "Relayed inputs not forwarded or not kept (child queue full, park full, unknown peer)."},
        {"shoal_expert_server_relay_refused_total", "TRUNK_X from a connection that is not a relay parent."}};
    for (int i = 0; i < SHOAL_WRELAY_N; i++)
        one(b, relay_name[i][0], SHOAL_METRICS_COUNTER, relay_name[i][1], wl,
            (double)shoal_metrics_get(&wm->relay[i]));
    one(b, "shoal_expert_server_relay_in_bytes_total", SHOAL_METRICS_COUNTER,
        "Bytes of the x frames (header included) of TRUNK_X taken from a relay parent.", wl,
        (double)shoal_metrics_get(&wm->relay_in_bytes));
    shoal_metrics_snap s;
    shoal_metrics_family(b, "shoal_expert_server_queue_wait_seconds", SHOAL_METRICS_HISTOGRAM,
                         "Per served batch: time from taking it off the socket to starting it.");
    shoal_metrics_snapshot(&wm->queue_h, &s);
    shoal_metrics_hist_samples(b, "shoal_expert_server_queue_wait_seconds", wl, 1, &s);
    shoal_metrics_family(b, "shoal_expert_server_compute_time_seconds", SHOAL_METRICS_HISTOGRAM,
                         "Per served batch: time computing its experts.");
    shoal_metrics_snapshot(&wm->compute_h, &s);
    shoal_metrics_hist_samples(b, "shoal_expert_server_compute_time_seconds", wl, 1, &s);

    shoal_metrics_family(b, "shoal_expert_server_expert_pairs_total", SHOAL_METRICS_COUNTER,
                         "Tokens routed to one (layer, expert) of this server; experts never hit are omitted.");
    for (int l = 0; l < wm->num_layers; l++) {
        if (!wm->is_moe[l])
            continue;
        for (int e = 0; e < wm->num_experts; e++) {
            uint64_t v = shoal_metrics_get(&wm->hits[(size_t)l * wm->num_experts + e]);
            if (!v)
                continue;
            char ls[16], es[16];
            snprintf(ls, sizeof ls, "%d", l);
            snprintf(es, sizeof es, "%d", e);
            shoal_metrics_label lab[3] = {{"worker", wm->id}, {"layer", ls}, {"expert", es}};
            shoal_metrics_sample(b, "shoal_expert_server_expert_pairs_total", lab, 3, (double)v);
        }
    }
}

/* ---- /metrics responder -------------------------------------------------- */

/* The /metrics responder: one thread multiplexes up to MAX_CONNS connections
 * with poll(2), all non-blocking. Each connection has one deadline for the
 * whole exchange (CONN_DEADLINE_MS from accept: read the request head, write
 * the answer), so a client that drips a byte a second, or never reads,
 * holds only its own slot and only until its deadline; every other scrape is
 * answered meanwhile. When every slot is taken, the oldest connection is
 * closed to make room for the new one. */
#define MAX_CONNS 16
#define CONN_DEADLINE_MS 2000
#define REQ_MAX 8192

typedef struct {
    int fd;            /* -1: free */
    uint64_t deadline; /* ms, monotonic */
    uint64_t opened;   /* ms, for "the oldest" */
    size_t len;        /* request bytes read */
    char req[REQ_MAX];
    char *out;         /* the answer (owned), out_len bytes, out_off sent */
    size_t out_len, out_off;
} conn;

static uint64_t mono_ms(void)
{
    return shoal_metrics_now_ns() / 1000000u;
}

static void conn_close(conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->out);
    c->fd = -1;
    c->out = NULL;
    c->len = c->out_len = c->out_off = 0;
}

static void respond(conn *c, int status, const char *reason, const char *ctype, const char *body, size_t blen)
{
    char hdr[256];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n", status,
                     reason, ctype, blen);
    c->out = shoal_xmalloc((size_t)n + blen);
    memcpy(c->out, hdr, (size_t)n);
    if (blen)
        memcpy(c->out + n, body, blen);
    c->out_len = (size_t)n + blen;
    c->out_off = 0;
}

/* The request head is complete (or the buffer full, or the peer half-closed):
 * build the answer. Only the request line matters. */
static void answer(shoal_wmetrics *wm, conn *c)
{
    char *req = c->req;
    req[c->len] = 0;
    char *eol = strpbrk(req, "\r\n");
    if (!eol) {
        static const char m[] = "bad request\n";
        respond(c, 400, "Bad Request", "text/plain", m, sizeof m - 1);
        return;
    }
    *eol = 0;
    char method[16], path[1024], version[16];
    if (sscanf(req, "%15s %1023s %15s", method, path, version) != 3 || strncmp(version, "HTTP/1.", 7)) {
        static const char m[] = "bad request\n";
        respond(c, 400, "Bad Request", "text/plain", m, sizeof m - 1);
        return;
    }
    if (strcmp(method, "GET") && strcmp(method, "HEAD")) {
        static const char m[] = "only GET\n";
        respond(c, 405, "Method Not Allowed", "text/plain", m, sizeof m - 1);
        return;
    }
    char *q = strchr(path, '?');
    if (q)
        *q = 0;
    if (strcmp(path, "/metrics")) {
        static const char m[] = "not found: try /metrics\n";
        respond(c, 404, "Not Found", "text/plain", m, sizeof m - 1);
        return;
    }
    shoal_metrics_buf b = {0};
    shoal_wmetrics_write(wm, &b);
    int head = !strcmp(method, "HEAD");
    respond(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", head ? "" : b.p, head ? 0 : b.len);
    shoal_metrics_buf_free(&b);
}

static int head_complete(const conn *c)
{
    return strstr(c->req, "\r\n\r\n") || strstr(c->req, "\n\n");
}

/* Progress on one ready connection; closes it when done or failed. */
static void conn_step(shoal_wmetrics *wm, conn *c, short revents)
{
    if (!c->out) {
        if (!(revents & (POLLIN | POLLHUP | POLLERR)))
            return;
        ssize_t r = recv(c->fd, c->req + c->len, REQ_MAX - 1 - c->len, 0);
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        if (r < 0) {
            conn_close(c);
            return;
        }
        c->len += (size_t)r;
        c->req[c->len] = 0;
        if (r > 0 && !head_complete(c) && c->len < REQ_MAX - 1)
            return;
        answer(wm, c); /* complete, full, or half-closed: answer what came */
    }
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return; /* POLLOUT later */
        if (w <= 0) {
            conn_close(c);
            return;
        }
        c->out_off += (size_t)w;
    }
    conn_close(c);
}

static void *http_main(void *arg)
{
    shoal_wmetrics *wm = arg;
    conn *cs = shoal_xcalloc(MAX_CONNS, sizeof *cs);
    for (int i = 0; i < MAX_CONNS; i++)
        cs[i].fd = -1;
    struct pollfd p[MAX_CONNS + 1];
    int idx[MAX_CONNS + 1];
    while (!atomic_load(&wm->stop)) {
        uint64_t now = mono_ms();
        int np = 0, timeout = 200; /* the stop flag's tick */
        p[np++] = (struct pollfd){.fd = wm->lfd, .events = POLLIN};
        for (int i = 0; i < MAX_CONNS; i++) {
            if (cs[i].fd < 0)
                continue;
            if (now >= cs[i].deadline) { /* the whole exchange ran out of time */
                conn_close(&cs[i]);
                continue;
            }
            int left = (int)(cs[i].deadline - now);
            if (left < timeout)
                timeout = left;
            idx[np] = i;
            p[np++] = (struct pollfd){.fd = cs[i].fd, .events = cs[i].out ? POLLOUT : POLLIN};
        }
        int r = poll(p, (nfds_t)np, timeout);
        if (r <= 0)
            continue;
        for (int k = 1; k < np; k++)
            if (p[k].revents)
                conn_step(wm, &cs[idx[k]], p[k].revents);
        if (p[0].revents & POLLIN) {
            int fd = accept4(wm->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0)
                continue;
            conn *slot = NULL, *oldest = NULL;
            for (int i = 0; i < MAX_CONNS && !slot; i++) {
                if (cs[i].fd < 0)
                    slot = &cs[i];
                else if (!oldest || cs[i].opened < oldest->opened)
                    oldest = &cs[i];
            }
            if (!slot) { /* full: the oldest goes (it is the likeliest to be stuck) */
                conn_close(oldest);
                slot = oldest;
            }
            slot->fd = fd;
            slot->opened = mono_ms();
            slot->deadline = slot->opened + CONN_DEADLINE_MS;
            slot->len = 0;
            slot->req[0] = 0;
        }
    }
    for (int i = 0; i < MAX_CONNS; i++)
        conn_close(&cs[i]);
    free(cs);
    return NULL;
}

int shoal_wmetrics_listen(shoal_wmetrics *wm, const char *host, int port, int *bound, char *err, size_t errlen)
{
    if (wm->running || port < 0 || port > 65535)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "metrics: bad port %d (or already listening)", port);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (!host || !strcmp(host, "localhost"))
        host = "127.0.0.1";
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "metrics: '%s' is not an IPv4 address", host);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "metrics: socket: %s", strerror(errno));
    int one_ = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one_, sizeof one_);
    if (bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 16)) {
        int e = errno;
        close(fd);
        return shoal_err_set(err, errlen, -e, "metrics: bind %s:%d: %s", host, port, strerror(e));
    }
    socklen_t al = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &al);
    wm->lfd = fd;
    if (pthread_create(&wm->th, NULL, http_main, wm)) {
        wm->lfd = -1;
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "metrics: cannot start the HTTP thread");
    }
    wm->running = 1;
    if (bound)
        *bound = ntohs(a.sin_port);
    return 0;
}
