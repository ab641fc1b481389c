/* `shoal serve`: the OpenAI-compatible HTTP server. Starts like a service:
 * binds the port first (a port in use is refused before anything is loaded)
 * and runs the HTTP loop on its own thread at once, answering /health 503
 * "starting" with what it waits for; then wires the pieces in order --
 * tokenizer, model (engine), workers, scheduler (model thread), API -- on
 * this thread (the spawned workers' parent-death signal is tied to it),
 * hands every request to the API once it is open, and waits for the loop to
 * end (SIGINT/SIGTERM), then takes everything down in reverse. Flags are
 * documented in docs/CONFIG.md. */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/commands.h"
#include "kernels/kernels.h"
#include "common/err.h"
#include "common/log.h"
#include "common/memplan.h"
#include "common/metrics.h"
#include "common/suggest.h"
#include "coordinator/api/api.h"
#include "coordinator/cmd/webui.h"
#include "coordinator/obs/obs.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/pcache/pcache.h"
#include "coordinator/engine/engine.h"
#include "coordinator/text/text.h"
#include "proto/fprint.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal serve --model DIR [options]\n"
            "\n"
            "Serves the OpenAI-compatible API (docs/API.md) for the model in DIR, and the live\n"
            "cluster page at http://HOST:PORT/ (docs/METRICS.md). The port is bound first:\n"
            "/health answers 503 \"starting\" until the model and every worker are ready.\n"
            "\n"
            "  --model DIR            model directory (config.json, safetensors, tiktoken.model)\n"
            "  --tokenizer DIR        tiktoken.model + tokenizer_config.json from DIR instead of\n"
            "                         the model's folder; refused unless it is the model's\n"
            "                         vocabulary (config.json vocab_size; K3's sha256 for K3)\n"
            "  --host ADDR            bind address (default 127.0.0.1); any non-loopback\n"
            "                         address requires --api-key unless --insecure\n"
            "  --port N               TCP port (default 8000; 0 picks a free one)\n"
            "  --api-key KEY          require 'Authorization: Bearer KEY' (all but /health)\n"
            "  --api-key-file PATH    the same, the key read from the first line of PATH\n"
            "  --insecure             allow a non-loopback --host without an API key\n"
            "  --model-name NAME      the model id clients use (default: DIR's base name)\n"
            "  --queue N              requests that may wait for the model (default 64);\n"
            "                         more are refused with 429\n"
            "  --max-context N        tokens per sequence, prompt + completion\n"
            "                         (default: the model's max_position_embeddings, or what the\n"
            "                         memory plan holds per slot; logged at start; above the\n"
            "                         model's maximum: refused)\n"
            "  --slots N              sequences decoded together, one token each per step\n"
            "                         (default: what the state budget holds of full-context\n"
            "                         sequences, 1..8; 1 = one request at a time)\n"
            "  --step-tokens N        tokens one step may run: decode tokens + prompt chunks\n"
            "                         (default 256); prompts get at least half of it\n"
            "  --state-gb G           memory for the slots' sequence states, GiB (fractions\n"
            "                         allowed; default: a quarter of the usable memory, at\n"
            "                         most a full-context sequence per slot, 8 without\n"
            "                         --slots); a request whose state does not fit waits\n"
            "                         in the queue\n"
            "  --keep N               sequence states kept for conversation reuse (default 8, 0 off)\n"
            "  --keep-mb N            memory those states may use, MiB (default 1024)\n"
            "  --prefix-cache-gb G    prefix cache in memory, GiB (fractions allowed; 0 = off;\n"
            "                         default: half the sequence state budget, at most 8 GiB,\n"
            "                         off when that holds no capture of 1024 tokens; logged):\n"
            "                         prompt states captured at message ends and every\n"
            "                         --prefix-cache-stride tokens; a prompt sharing a captured\n"
            "                         prefix prefills only the rest (same logits); counts against\n"
            "                         the state budget (evicted first when a request needs the room)\n"
            "  --prefix-cache-dir DIR also keep every capture in DIR, so it survives a restart\n"
            "                         (files of another model, or damaged, are refused by name\n"
            "                         and recomputed); with or without --prefix-cache-gb\n"
            "  --prefix-cache-disk-gb G  cap of the files in --prefix-cache-dir, GiB; least\n"
            "                         recently used removed first (default: half of the free\n"
            "                         space plus what the cache holds, at most 64 GiB; logged)\n"
            "  --prefix-cache-stride N  capture every N prompt tokens too (default 1024, 0 off)\n"
            "  --memo N               deterministic responses memoised (default 256, 0 off)\n"
            "  --memo-mb N            memory the memo may use, MiB (default 64)\n"
            "  --threads N            OpenMP threads for the forward (default: all)\n"
            "  --max-body-kb N        request body limit, KiB (default 4096)\n"
            "  --max-header-kb N      request line + headers limit, KiB (default 16)\n"
            "  --max-connections N    open client connections (default 256); when full the\n"
            "                         oldest idle one is closed to make room\n"
            "  --max-connections-per-addr N  of those, from one client address (default 64)\n"
            "  --header-timeout S     seconds for a new connection's first byte and for a\n"
            "                         request's headers (default 10)\n"
            "  --request-timeout S    seconds a client has to send one request (default 30)\n"
            "  --idle-timeout S       seconds a kept-alive connection may idle (default 60)\n"
            "  --write-timeout S      seconds a response may stall unread (default 30)\n"
            "  --trace FILE           record every routing decision (docs/METRICS.md)\n"
            "  --numerics CLASS       portable (default: the fp32-activation order) or mu (the matrix-unit\n"
            "                         order: AMX where it passes its self-test, an exact emulation elsewhere);\n"
            "                         every worker must compute the same class (docs/CONFIG.md)\n"
            "  --trunk-gb G           trunk RAM budget: small|medium|large|auto or GiB; resident\n"
            "                         layers + streamed ones, same tokens (docs/CONFIG.md);\n"
            "                         default: the trunk is mapped\n"
            "  --trunk-no-direct      buffered reads for --trunk-gb (no O_DIRECT)\n"
            "  --draft ngram|off      speculative decoding of every request (default ngram):\n"
            "                         drafts from the prompt + output verified in one pass; same ids\n"
            "  --draft-max K          most drafted tokens per pass, 1..16 (default 8, adapted)\n"
            "  --draft-ngram-min N    shortest match that drafts, 1..64 (default 2)\n"
            "  --draft-cost A[,B]     a verify pass of k drafts costs 1 + B + A*k passes (0.2,0.3)\n"
            "  --mask-thread auto|on|off  structured-output masks computed on a thread while the forward\n"
            "                         runs: auto (default) when the last forward took >= 10 ms, on at\n"
            "                         every step, off after the forward (same masks, same ids)\n"
            "\n");
    shoal_dist_usage(f);
}

/* What the API's callbacks read: worker states and the coordinator metrics. */
typedef struct {
    shoal_dist *dist;
    shoal_cmetrics *cm;
    shoal_model *model;
    uint64_t trunk_budget, trunk_resident; /* from the model's trunk plan */
    long queue;                             /* --queue */
    shoal_api *api;                         /* for the cluster page's snapshots */
    shoal_webui *web;                       /* the cluster page (coordinator/cmd/webui.h) */
    shoal_pcache *pcache;                  /* NULL: no prefix cache */
    shoal_sched *sched;
} serve_ctx;

static int workers_cb(void *ud, shoal_api_worker *w, int cap)
{
    serve_ctx *c = ud;
    int n = shoal_dist_nworkers(c->dist);
    for (int i = 0; i < n && i < cap; i++) {
        const char *name = shoal_dist_worker_name(c->dist, i);
        shoal_cmetrics_worker_totals t;
        shoal_cmetrics_get_worker(c->cm, i, &t);
        snprintf(w[i].name, sizeof w[i].name, "%s", name ? name : "?");
        char why[512]; /* the client's whole reason (fingerprints are 64 hex digits each): never cut */
        w[i].up = shoal_dist_worker_up(c->dist, i, why, sizeof why);
        shoal_spawn_state ls;
        w[i].local = !shoal_dist_local_state(c->dist, i, &ls);
        if (w[i].local) {
            w[i].restarts = ls.restarts;
            w[i].hangs = ls.hangs;
            w[i].backing_off = ls.backing_off;
            w[i].backoff_s = ls.backoff_s;
            w[i].next_try_s = ls.next_try_s;
            w[i].next_try_unix = ls.next_try_unix;
        }
        if (w[i].up)
            snprintf(w[i].state, sizeof w[i].state, "ready");
        else if (w[i].local && ls.backing_off) /* a crash loop: the supervisor waits before the next restart */
            snprintf(w[i].state, sizeof w[i].state, "down: crash-looping, backing off: next restart in %.1f s (%d restarts so far)",
                     ls.next_try_s, ls.restarts);
        else /* the client keeps reconnecting it in the background */
            snprintf(w[i].state, sizeof w[i].state, "down: %s (%llu timeouts, %llu errors so far)", why,
                     (unsigned long long)t.timeouts, (unsigned long long)t.errors);
    }
    return n;
}

static int covered_cb(void *ud, char *why, size_t whylen)
{
    serve_ctx *c = ud;
    return shoal_dist_covered(c->dist, why, whylen);
}

static void metric1(shoal_metrics_buf *b, const char *name, shoal_metrics_type t, const char *help, double v)
{
    shoal_metrics_family(b, name, t, help);
    shoal_metrics_sample(b, name, NULL, 0, v);
}

/* The prefix cache (docs/METRICS.md): all 0 when it is off. */
static void pcache_metrics(serve_ctx *c, shoal_metrics_buf *b)
{
    shoal_pcache_stats p;
    shoal_pcache_get_stats(c->pcache, &p);
    shoal_sched_stats ss = {0};
    if (c->sched)
        shoal_sched_get_stats(c->sched, &ss);
    const shoal_metrics_type C = SHOAL_METRICS_COUNTER, G = SHOAL_METRICS_GAUGE;
    metric1(b, "shoal_prefilled_tokens_total", C, "Prompt tokens run through the forward (neither kept nor cached).",
            (double)ss.prefilled_tokens);
    metric1(b, "shoal_prefix_cache_waits_total", C,
            "Requests that waited for another request's prefix capture instead of prefilling it again.",
            (double)ss.cache_waits);
    metric1(b, "shoal_prefix_cache_lookups_total", C, "Prompts looked up in the prefix cache.", (double)p.lookups);
    metric1(b, "shoal_prefix_cache_hits_total", C, "Prompts resumed from a captured prefix.", (double)p.hits);
    metric1(b, "shoal_prefix_cache_saved_tokens_total", C, "Prompt tokens not prefilled thanks to a captured prefix.",
            (double)p.tokens_saved);
    metric1(b, "shoal_prefix_cache_captures_total", C, "Prompt states captured.", (double)p.captures);
    metric1(b, "shoal_prefix_cache_capture_bytes_total", C, "Bytes of the captured states.", (double)p.capture_bytes);
    metric1(b, "shoal_prefix_cache_capture_seconds_total", C, "Seconds spent copying captured states.",
            p.capture_s);
    metric1(b, "shoal_prefix_cache_evictions_total", C, "Captured states evicted from memory (budget).",
            (double)p.evictions);
    metric1(b, "shoal_prefix_cache_disk_reads_total", C, "Captured states read from --prefix-cache-dir.",
            (double)p.disk_reads);
    metric1(b, "shoal_prefix_cache_disk_read_bytes_total", C, "Bytes of those reads.", (double)p.disk_read_bytes);
    metric1(b, "shoal_prefix_cache_disk_read_seconds_total", C, "Seconds spent reading and verifying them.",
            p.disk_read_s);
    metric1(b, "shoal_prefix_cache_disk_writes_total", C, "Captured states written to --prefix-cache-dir.",
            (double)p.disk_writes);
    metric1(b, "shoal_prefix_cache_disk_write_bytes_total", C, "Bytes of those writes.", (double)p.disk_write_bytes);
    metric1(b, "shoal_prefix_cache_disk_write_seconds_total", C, "Seconds spent writing them.", p.disk_write_s);
    metric1(b, "shoal_prefix_cache_refused_total", C,
            "State files refused (another model, bad header, size or checksum) and recomputed.", (double)p.refused);
    metric1(b, "shoal_prefix_cache_bytes", G, "Bytes of captured states held in memory.", (double)p.mem_bytes);
    metric1(b, "shoal_prefix_cache_budget_bytes", G, "Memory the prefix cache may hold (--prefix-cache-gb).",
            (double)p.mem_budget);
    metric1(b, "shoal_prefix_cache_entries", G, "Captured states held in memory.", (double)p.mem_entries);
    metric1(b, "shoal_prefix_cache_disk_bytes", G, "Bytes of the files in --prefix-cache-dir (and being written).",
            (double)p.disk_bytes);
    metric1(b, "shoal_prefix_cache_disk_budget_bytes", G,
            "Bytes the files in --prefix-cache-dir may hold (--prefix-cache-disk-gb).", (double)p.disk_budget);
    metric1(b, "shoal_prefix_cache_disk_evictions_total", C,
            "Files removed from --prefix-cache-dir to keep it within its budget.", (double)p.disk_evictions);
    metric1(b, "shoal_prefix_cache_removed_files_total", C,
            "Damaged state files and unfinished writes removed from --prefix-cache-dir.", (double)p.removed);
    metric1(b, "shoal_prefix_cache_disk_entries", G, "Captured states indexed in --prefix-cache-dir.",
            (double)p.disk_entries);
}

static void metrics_cb(void *ud, shoal_metrics_buf *b)
{
    serve_ctx *c = ud;
    shoal_metrics_process_families(b, SHOAL_VERSION, shoal_isa_name(shoal_kernels_cpu_best()),
                                   shoal_isa_name(shoal_kernels_isa()), shoal_numerics_name(shoal_kernels_numerics()),
                                   shoal_kernels_mu_engine());
    int nw = shoal_dist_nworkers(c->dist);
    for (int i = 0; i < nw; i++) { /* the local workers' backoff, as of this scrape */
        shoal_spawn_state ls;
        if (!shoal_dist_local_state(c->dist, i, &ls))
            shoal_cmetrics_worker_backoff(c->cm, i, ls.backing_off ? ls.next_try_s : 0);
    }
    shoal_cmetrics_write(c->cm, b);
    shoal_metrics_family(b, "shoal_sched_queue_capacity", SHOAL_METRICS_GAUGE,
                         "Requests that may wait for the model (--queue); more are refused with 429.");
    shoal_metrics_sample(b, "shoal_sched_queue_capacity", NULL, 0, (double)c->queue);
    /* the trunk budget (--trunk-gb): all 0 when the trunk is mapped */
    uint64_t rd;
    double stall;
    shoal_model_trunk_counters(c->model, &rd, &stall);
    shoal_metrics_family(b, "shoal_trunk_budget_bytes", SHOAL_METRICS_GAUGE,
                         "Trunk memory budget applied (--trunk-gb); 0 when the trunk is mapped.");
    shoal_metrics_sample(b, "shoal_trunk_budget_bytes", NULL, 0, (double)c->trunk_budget);
    shoal_metrics_family(b, "shoal_trunk_resident_bytes", SHOAL_METRICS_GAUGE,
                         "Trunk weight bytes held resident under the budget.");
    shoal_metrics_sample(b, "shoal_trunk_resident_bytes", NULL, 0, (double)c->trunk_resident);
    shoal_metrics_family(b, "shoal_trunk_read_bytes_total", SHOAL_METRICS_COUNTER,
                         "Trunk bytes the streaming reader read from disk.");
    shoal_metrics_sample(b, "shoal_trunk_read_bytes_total", NULL, 0, (double)rd);
    shoal_metrics_family(b, "shoal_trunk_stall_seconds_total", SHOAL_METRICS_COUNTER,
                         "Seconds forwards waited for a streamed trunk unit.");
    shoal_metrics_sample(b, "shoal_trunk_stall_seconds_total", NULL, 0, stall);
    shoal_metrics_family(b, "shoal_forward_allocations_total", SHOAL_METRICS_COUNTER,
                         "Heap allocations caught inside the forward (should stay 0).");
    shoal_metrics_sample(b, "shoal_forward_allocations_total", NULL, 0, (double)shoal_engine_alloc_count());
    pcache_metrics(c, b);
}

/* ---- the start ------------------------------------------------------------
 * The listener is open before anything is loaded; until the API is, every
 * request is answered here: /health 503 {"status":"starting","waiting_for"}
 * (with the details for an authorised caller), anything else 401 without
 * the key, else 503 not_ready. */
typedef struct {
    _Atomic(shoal_api *) api; /* set once everything is open: requests go to it */
    const char *api_key;
    shoal_http *http;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char stage[96];   /* what the start waits for: "the model to load" */
    char detail[768]; /* the details: directory, workers' endpoints */
    uint64_t t0_ns, stage_ns;
    int ticker_stop;
    atomic_int loop_done; /* the HTTP loop ended (a signal) */
} boot_t;

static double since_s(uint64_t t_ns)
{
    return (double)(shoal_metrics_now_ns() - t_ns) / 1e9;
}

/* The start's next stage, logged; fmt (may be NULL) the details. */
static void boot_stage(boot_t *b, const char *stage, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void boot_stage(boot_t *b, const char *stage, const char *fmt, ...)
{
    pthread_mutex_lock(&b->mu);
    snprintf(b->stage, sizeof b->stage, "%s", stage);
    b->detail[0] = 0;
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(b->detail, sizeof b->detail, fmt, ap);
        va_end(ap);
    }
    b->stage_ns = shoal_metrics_now_ns();
    SHOAL_INFO("serve: starting (%.1f s): waiting for %s%s%s", since_s(b->t0_ns), b->stage, b->detail[0] ? ": " : "",
               b->detail);
    pthread_mutex_unlock(&b->mu);
}

/* Progress while a stage lasts: a log line every 2 s on a terminal, every
 * 10 s otherwise (a service manager's journal). */
static void *boot_ticker(void *arg)
{
    boot_t *b = arg;
    int every = isatty(2) ? 2 : 10;
    pthread_mutex_lock(&b->mu);
    while (!b->ticker_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += every;
        pthread_cond_timedwait(&b->cv, &b->mu, &ts);
        if (!b->ticker_stop && since_s(b->stage_ns) >= every - 0.5)
            SHOAL_INFO("serve: starting (%.0f s): still waiting for %s (%.0f s)", since_s(b->t0_ns), b->stage,
                       since_s(b->stage_ns));
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void *boot_loop(void *arg)
{
    boot_t *b = arg;
    shoal_http_run(b->http);
    atomic_store(&b->loop_done, 1);
    return NULL;
}

static void boot_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req)
{
    boot_t *b = ud;
    shoal_api *api = atomic_load(&b->api);
    if (api) {
        shoal_api_on_request(api, ex, req);
        return;
    }
    int auth = shoal_api_key_ok(b->api_key, req);
    char stage[96], detail[768];
    pthread_mutex_lock(&b->mu);
    memcpy(stage, b->stage, sizeof stage);
    memcpy(detail, b->detail, sizeof detail);
    double el = since_s(b->t0_ns);
    pthread_mutex_unlock(&b->mu);
    json_t *body;
    int status = 503;
    const char *extra = "Retry-After: 1\r\n";
    if (!strcmp(req->path, "/health")) {
        body = json_pack("{s:s,s:b,s:s,s:f}", "status", "starting", "ready", 0, "waiting_for", stage, "elapsed_s",
                         el);
        json_t *d = auth && detail[0] ? json_string(detail) : NULL; /* NULL for bytes that are not UTF-8 */
        if (d)
            json_object_set_new(body, "detail", d);
    } else if (!auth) {
        status = 401;
        extra = "WWW-Authenticate: Bearer\r\n";
        body = json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message",
                         shoal_http_request_header(req, "authorization") ? "Incorrect API key provided"
                                                                         : "You didn't provide an API key "
                                                                           "(Authorization: Bearer KEY)",
                         "type", "invalid_request_error", "param", "code", "invalid_api_key");
    } else {
        char msg[160];
        snprintf(msg, sizeof msg, "the server is starting: waiting for %s", stage);
        body = json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message", msg, "type", "server_error", "param", "code",
                         "not_ready");
    }
    char *txt = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!txt)
        SHOAL_PANIC("serve: cannot format the starting answer");
    shoal_http_respond(ex, status, "application/json", extra, txt, strlen(txt));
    free(txt);
}

/* /health's view for the cluster page: status and the workers' states. */
static json_t *health_json(serve_ctx *c)
{
    static shoal_api_worker w[64];
    int n = workers_cb(c, w, 64), all_up = 1;
    json_t *ws = json_array();
    for (int i = 0; i < n && i < 64; i++) {
        json_t *st = json_string(w[i].state), *nm = json_string(w[i].name);
        json_array_append_new(ws, json_pack("{s:o,s:b,s:o}", "endpoint", nm ? nm : json_string("?"), "up", w[i].up,
                                            "state", st ? st : json_string("?")));
        all_up &= w[i].up != 0;
    }
    char why[512];
    const char *status = all_up ? "ok" : covered_cb(c, why, sizeof why) ? "degraded" : "unavailable";
    return json_pack("{s:s,s:o}", "status", status, "workers", ws);
}

/* The cluster page's snapshot (loop thread): our own exposition and health. */
static char *cluster_source(void *ud)
{
    serve_ctx *c = ud;
    shoal_metrics_buf b = {0};
    shoal_api_metrics_text(c->api, &b);
    json_t *h = health_json(c);
    char err[256];
    char *out = shoal_webui_cluster_json(b.p ? b.p : "", b.len, h, err, sizeof err);
    if (!out)
        SHOAL_WARN("serve: cluster page: %s", err);
    json_decref(h);
    shoal_metrics_buf_free(&b);
    return out;
}

static int route_cb(void *ud, shoal_http_ex *ex, const shoal_http_request *req, int authorised)
{
    serve_ctx *c = ud;
    return shoal_webui_route(c->web, ex, req, authorised);
}

static int parse_long(const char *flag, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "shoal serve: %s must be an integer in %ld..%ld (got '%s')\n", flag, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int is_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1)
        return IN6_IS_ADDR_LOOPBACK(&a6);
    return 0;
}

/* The key file's first line (without its line end), whole: a key longer
 * than the buffer is refused, never cut. */
static int read_key_file(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "shoal serve: --api-key-file %s: %s\n", path, strerror(errno));
        return -1;
    }
    char *line = NULL;
    size_t lcap = 0;
    ssize_t n = getline(&line, &lcap, f);
    fclose(f);
    if (n <= 0) {
        free(line);
        fprintf(stderr, "shoal serve: --api-key-file %s is empty\n", path);
        return -1;
    }
    line[strcspn(line, "\r\n")] = '\0';
    size_t len = strlen(line);
    if (len >= cap) {
        memset(line, 0, (size_t)n);
        free(line);
        fprintf(stderr, "shoal serve: --api-key-file %s: the key is %zu bytes, more than the %zu allowed\n", path,
                len, cap - 1);
        return -1;
    }
    memcpy(out, line, len + 1);
    memset(line, 0, (size_t)n);
    free(line);
    if (!out[0]) {
        fprintf(stderr, "shoal serve: --api-key-file %s: the first line is empty\n", path);
        return -1;
    }
    return 0;
}

/* A key is compared exactly as the client sends it after "Bearer "; HTTP
 * trims blanks around a header value, so a key that starts or ends with one
 * (or holds a control byte) could never match: refused at start. */
static int check_key(const char *k)
{
    size_t n = strlen(k);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)k[i] < 0x20 || k[i] == 0x7f)
            return -1;
    return n && k[0] != ' ' && k[n - 1] != ' ' ? 0 : -1;
}

static void stop_ticker(boot_t *b, pthread_t *t, int *on)
{
    if (!*on)
        return;
    pthread_mutex_lock(&b->mu);
    b->ticker_stop = 1;
    pthread_cond_signal(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(*t, NULL);
    *on = 0;
}

/* --max-context when not given: the model's declared maximum, or less when
 * the memory plan cannot hold it -- what one slot's share of the sequence
 * state budget (--state-gb, else a quarter of the usable memory; --slots,
 * else 8 slots) holds of one sequence. Logged with the reason. */
static long default_context(const shoal_k3cfg *cfg, double state_gb, long slots)
{
    size_t fixed, per;
    shoal_model_seq_bytes(cfg, &fixed, &per);
    long most = cfg->max_position;
    uint64_t budget;
    const char *from;
    if (state_gb > 0) {
        budget = (uint64_t)(state_gb * 1073741824.0);
        from = "--state-gb";
    } else {
        shoal_memplan_probe mp;
        shoal_memplan_read("", &mp);
        uint64_t usable = shoal_memplan_usable(&mp);
        if (usable == UINT64_MAX) {
            long n = most < 16384 ? most : 16384;
            SHOAL_INFO("serve: context %ld tokens per sequence (default: the usable memory is unknown, so at most "
                       "16384; the model allows %ld; --max-context sets it)", n, most);
            return n;
        }
        budget = usable / 4;
        from = "a quarter of the usable memory";
    }
    long nslots = slots ? slots : 8;
    uint64_t share = budget / (uint64_t)nslots;
    uint64_t fit = share > fixed && per ? (share - fixed) / per : 0;
    long n = fit >= (uint64_t)most ? most : (long)fit;
    if (n < 16)
        n = most < 16 ? most : 16; /* the state budget check below names what is missing */
    char b1[32], b2[32];
    if (n == most)
        SHOAL_INFO("serve: context %ld tokens per sequence (default: the model's maximum, max_position_embeddings; "
                   "%s per sequence, within 1/%ld of the state budget %s from %s)",
                   n, shoal_memplan_fmt(fixed + (uint64_t)n * per, b1, sizeof b1), nslots,
                   shoal_memplan_fmt(budget, b2, sizeof b2), from);
    else
        SHOAL_INFO("serve: context %ld tokens per sequence (default: what 1/%ld of the state budget %s from %s holds; "
                   "the model allows %ld: give --max-context and --state-gb for more)",
                   n, nslots, shoal_memplan_fmt(budget, b1, sizeof b1), from, most);
    return n;
}

int shoal_cmd_serve(int argc, char **argv)
{
    const char *model_dir = NULL, *host = "127.0.0.1", *api_key = NULL, *key_file = NULL;
    char model_name[128] = "";
    long port = 8000, queue = 64, max_context = 0, keep = 8, keep_mb = 1024, memo = 256, memo_mb = 64;
    long slots = 0, step_tokens = 256;
    double state_gb = 0;
    long threads = 0, max_body_kb = 4096, max_header_kb = 16, max_conn = 256;
    long req_to = 30, idle_to = 60, write_to = 30, hdr_to = 10, max_per_addr = 64;
    int insecure = 0, trunk_no_direct = 0;
    shoal_draft_opts draft = {.mode = SHOAL_DRAFT_NGRAM, .max = 8};
    int mask_thread = SHOAL_MASK_THREAD_AUTO;
    shoal_trunk_mode trunk_mode = SHOAL_TRUNK_MAPPED;
    uint64_t trunk_budget = 0;
    const char *trace_path = NULL;
    const char *tokenizer_dir = NULL;
    double pcache_gb = -1, pcache_disk_gb = 0; /* -1 / 0: the defaults (automatic) */
    const char *pcache_dir = NULL;
    long pcache_stride = 1024;
    shoal_pcache *pcache = NULL;
    shoal_dist_opts dopts = {0};
    int bad = 0;
    /* flags take their value as the next argument; the distributed-experts
     * flags are parsed by coordinator/cluster/dist.c */
    static const struct {
        const char *flag;
        long lo, hi;
    } nums[] = {
        {"--port", 0, 65535},         {"--queue", 1, 1000000},   {"--max-context", 16, 1 << 24},
        {"--keep", 0, 64},            {"--keep-mb", 0, 1 << 20}, {"--memo", 0, 4096},
        {"--memo-mb", 0, 1 << 16},    {"--threads", 0, 4096},    {"--max-body-kb", 1, 1 << 20},
        {"--max-header-kb", 1, 1024}, {"--max-connections", 1, 100000},
        {"--request-timeout", 1, 3600}, {"--idle-timeout", 1, 3600}, {"--write-timeout", 1, 3600},
        {"--header-timeout", 1, 3600}, {"--max-connections-per-addr", 1, 100000},
        {"--slots", 1, 256},          {"--step-tokens", 1, 1 << 20},
        {"--prefix-cache-stride", 0, 1 << 24},
    };
    long *dsts[] = {&port, &queue, &max_context, &keep, &keep_mb, &memo, &memo_mb, &threads, &max_body_kb,
                    &max_header_kb, &max_conn, &req_to, &idle_to, &write_to, &hdr_to, &max_per_addr, &slots, &step_tokens,
                    &pcache_stride};
    for (int i = 1; i < argc && !bad; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int dr = shoal_dist_parse_arg(&dopts, "shoal serve", argc, argv, &i);
        if (dr < 0)
            return 2;
        if (dr > 0)
            continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--insecure")) {
            insecure = 1;
            continue;
        }
        if (!strcmp(a, "--trunk-no-direct")) {
            trunk_no_direct = 1;
            continue;
        }
        if (!strcmp(a, "--mask-thread")) {
            if (v && !strcmp(v, "auto"))
                mask_thread = SHOAL_MASK_THREAD_AUTO;
            else if (v && !strcmp(v, "on"))
                mask_thread = SHOAL_MASK_THREAD_ON;
            else if (v && !strcmp(v, "off"))
                mask_thread = SHOAL_MASK_THREAD_OFF;
            else {
                fprintf(stderr, "shoal serve: --mask-thread needs auto, on or off\n");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--draft")) {
            if (!v || shoal_draft_parse_mode(v, &draft.mode)) {
                fprintf(stderr, "shoal serve: --draft needs ngram or off\n");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--draft-ngram-min")) {
            char *end = NULL;
            long k = v ? strtol(v, &end, 10) : 0;
            if (!v || *end || k < 1 || k > 64) {
                fprintf(stderr, "shoal serve: --draft-ngram-min needs a number in 1..64\n");
                bad = 1;
            }
            draft.ngram_min = (int)k;
            draft.ngram_max = k > 16 ? (int)k : 0;
            i++;
            continue;
        }
        if (!strcmp(a, "--draft-cost")) {
            if (!v || shoal_draft_parse_cost(v, &draft)) {
                fprintf(stderr, "shoal serve: --draft-cost needs A[,B] with 0 < A < 1, 0 <= B <= 4\n");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--state-gb")) {
            char *end = NULL;
            state_gb = v ? strtod(v, &end) : 0;
            if (!v || end == v || *end || !(state_gb > 0) || state_gb > 1 << 20) {
                fprintf(stderr, "shoal serve: --state-gb needs a size in GiB > 0 (got '%s')\n", v ? v : "");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--prefix-cache-gb")) {
            char *end = NULL;
            pcache_gb = v ? strtod(v, &end) : -1;
            if (!v || end == v || *end || !(pcache_gb >= 0) || pcache_gb > 1 << 20) {
                fprintf(stderr, "shoal serve: --prefix-cache-gb needs a size in GiB >= 0 (got '%s')\n", v ? v : "");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--prefix-cache-disk-gb")) {
            char *end = NULL;
            pcache_disk_gb = v ? strtod(v, &end) : -1;
            if (!v || end == v || *end || !(pcache_disk_gb > 0) || pcache_disk_gb > 1 << 20) {
                fprintf(stderr, "shoal serve: --prefix-cache-disk-gb needs a size in GiB > 0 (got '%s')\n",
                        v ? v : "");
                bad = 1;
            }
            i++;
            continue;
        }
        if (!strcmp(a, "--prefix-cache-dir")) {
            if (!v || !*v) {
                fprintf(stderr, "shoal serve: --prefix-cache-dir needs a directory\n");
                bad = 1;
            }
            pcache_dir = v;
            i++;
            continue;
        }
        if (!strcmp(a, "--draft-max")) {
            char *end = NULL;
            long k = v ? strtol(v, &end, 10) : 0;
            if (!v || *end || k < 1 || k > SHOAL_DRAFT_MAX_K) {
                fprintf(stderr, "shoal serve: --draft-max needs a number in 1..%d\n", SHOAL_DRAFT_MAX_K);
                bad = 1;
            }
            draft.max = (int)k;
            i++;
            continue;
        }
        if (!strcmp(a, "--numerics")) {
            shoal_numerics nc;
            if (shoal_numerics_parse(v, &nc)) {
                fprintf(stderr, "shoal serve: --numerics takes portable or mu, not '%s'\n", v ? v : "");
                bad = 1;
            } else
                shoal_kernels_set_numerics(nc);
            i++;
            continue;
        }
        if (!strcmp(a, "--trunk-gb")) {
            if (!v || shoal_model_parse_trunk(v, &trunk_mode, &trunk_budget)) {
                fprintf(stderr, "shoal serve: --trunk-gb needs small|medium|large|auto or a size in GiB\n");
                bad = 1;
            }
            i++;
            continue;
        }
        int found = 0;
        for (size_t n = 0; n < sizeof nums / sizeof nums[0]; n++) {
            if (strcmp(a, nums[n].flag))
                continue;
            found = 1;
            if (!v) {
                fprintf(stderr, "shoal serve: %s needs a value\n", a);
                bad = 1;
            } else {
                bad = parse_long(a, v, nums[n].lo, nums[n].hi, dsts[n]) != 0;
                i++;
            }
        }
        if (found)
            continue;
        const char **sdst = !strcmp(a, "--model")          ? &model_dir
                            : !strcmp(a, "--host")         ? &host
                            : !strcmp(a, "--api-key")      ? &api_key
                            : !strcmp(a, "--api-key-file") ? &key_file
                            : !strcmp(a, "--trace")        ? &trace_path
                            : !strcmp(a, "--tokenizer")    ? &tokenizer_dir
                                                           : NULL;
        if (sdst || !strcmp(a, "--model-name")) {
            if (!v) {
                fprintf(stderr, "shoal serve: %s needs a value\n", a);
                bad = 1;
            } else if (sdst) {
                *sdst = v;
            } else if (strlen(v) >= sizeof model_name) {
                fprintf(stderr, "shoal serve: --model-name is longer than %zu bytes\n", sizeof model_name - 1);
                bad = 1;
            } else {
                memcpy(model_name, v, strlen(v) + 1);
            }
            i++;
            continue;
        }
        shoal_suggest_unknown_flag("shoal serve", a, usage);
        bad = 1;
    }
    if (bad)
        return 2;
    if (shoal_dist_enabled(&dopts) < 0) {
        fprintf(stderr, "shoal serve: give --worker ENDPOINT ..., --workers N or --plan FILE, only one\n");
        return 2;
    }
    if (!model_dir) {
        fprintf(stderr, "shoal serve: --model DIR is required\n");
        usage(stderr);
        return 2;
    }
    if (api_key && key_file) {
        fprintf(stderr, "shoal serve: give --api-key or --api-key-file, not both\n");
        return 2;
    }
    char key_buf[4097]; /* 4096 bytes of key at most */
    if (key_file) {
        if (read_key_file(key_file, key_buf, sizeof key_buf))
            return 2;
        api_key = key_buf;
    }
    if (api_key && !api_key[0]) {
        fprintf(stderr, "shoal serve: --api-key must not be empty\n");
        return 2;
    }
    if (api_key && check_key(api_key)) {
        fprintf(stderr, "shoal serve: the API key must not start or end with a space nor hold control bytes\n");
        return 2;
    }
    {
        /* one message for a name, before the key check: `--host localhost`
         * used to be told it is reachable from other machines, then (with
         * --insecure) that it is not an address */
        struct in_addr a4;
        struct in6_addr a6;
        if (inet_pton(AF_INET, host, &a4) != 1 && inet_pton(AF_INET6, host, &a6) != 1) {
            fprintf(stderr,
                    "shoal serve: --host %s is not an IP address; give one (127.0.0.1 or ::1 for this machine\n"
                    "             only, 0.0.0.0 or :: for every interface)\n",
                    host);
            return 2;
        }
    }
    if (!is_loopback(host) && !api_key && !insecure) {
        fprintf(stderr,
                "shoal serve: --host %s is reachable from other machines: give --api-key (or --api-key-file),\n"
                "             or --insecure to serve it without authentication\n",
                host);
        return 2;
    }
    if (!model_name[0]) { /* the directory's base name */
        char tmp[PATH_MAX];
        snprintf(tmp, sizeof tmp, "%s", model_dir);
        size_t l = strlen(tmp);
        while (l > 1 && tmp[l - 1] == '/')
            tmp[--l] = '\0';
        const char *b = strrchr(tmp, '/');
        b = b ? b + 1 : tmp;
        if (strlen(b) >= sizeof model_name) {
            fprintf(stderr, "shoal serve: the model directory's name is too long: give --model-name\n");
            return 2;
        }
        memcpy(model_name, b, strlen(b) + 1);
    }
    shoal_log_set_role("C");

    char err[1024];
    int rc, status = 3;
    shoal_model *model = NULL;
    shoal_tok *tok = NULL;
    shoal_sched *sched = NULL;
    shoal_api *api = NULL;
    shoal_http *http = NULL;
    shoal_trace *trace = NULL;
    serve_ctx ctx = {0};
    boot_t boot = {.api_key = api_key, .t0_ns = shoal_metrics_now_ns()};
    pthread_mutex_init(&boot.mu, NULL);
    pthread_cond_init(&boot.cv, NULL);
    boot.stage_ns = boot.t0_ns;
    snprintf(boot.stage, sizeof boot.stage, "the listener");
    pthread_t loop_thr, ticker_thr;
    int loop_on = 0, ticker_on = 0;

    /* the port first: one in use is refused before anything is loaded, and
     * health probes see "starting" rather than a refused connection */
    shoal_http_opts ho = {
        .host = host,
        .port = (int)port,
        .max_header_bytes = (size_t)max_header_kb << 10,
        .max_body_bytes = (size_t)max_body_kb << 10,
        .max_connections = (int)max_conn,
        .max_per_addr = (int)max_per_addr,
        .header_timeout_ms = (int)hdr_to * 1000,
        .request_timeout_ms = (int)req_to * 1000,
        .idle_timeout_ms = (int)idle_to * 1000,
        .write_timeout_ms = (int)write_to * 1000,
        .max_write_queue = 64u << 20,
        .handle_signals = 1,
        .on_request = boot_request,
        .ud = &boot,
    };
    rc = shoal_http_open(&http, &ho, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = rc == SHOAL_EINVAL ? 2 : 4; /* a --host that is no address is a usage mistake */
        goto out;
    }
    boot.http = http;
    if (pthread_create(&loop_thr, NULL, boot_loop, &boot)) {
        fprintf(stderr, "shoal serve: cannot start the HTTP thread\n");
        status = 4;
        goto out;
    }
    loop_on = 1;
    ticker_on = pthread_create(&ticker_thr, NULL, boot_ticker, &boot) == 0;
    SHOAL_INFO("serve: bound http://%s%s%s:%d; /health answers 503 \"starting\" until the model and the workers "
               "are ready",
               strchr(host, ':') ? "[" : "", host, strchr(host, ':') ? "]" : "", shoal_http_port(http));

    /* the model directory, named when it is not one */
    {
        struct stat st;
        char cpath[PATH_MAX];
        snprintf(cpath, sizeof cpath, "%s/config.json", model_dir);
        int bad_dir = stat(model_dir, &st) ? errno : S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
        if (bad_dir) {
            fprintf(stderr, "shoal serve: --model %s: %s (a model directory holds config.json, the safetensors "
                            "and tiktoken.model)\n",
                    model_dir, strerror(bad_dir));
            goto out;
        }
        if (stat(cpath, &st)) {
            fprintf(stderr, "shoal serve: --model %s: no config.json there: not a model directory\n", model_dir);
            goto out;
        }
    }
    /* the tokenizer (--tokenizer DIR, else the model's folder) must be the
     * model's vocabulary: size, and K3's digest for K3's config */
    const char *tok_dir = tokenizer_dir ? tokenizer_dir : model_dir;
    boot_stage(&boot, "the tokenizer", "%s", tok_dir);
    shoal_tok_opts to = {0};
    rc = shoal_tok_open(&tok, tok_dir, &to, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: tokenizer of %s: %s\n", tok_dir, err);
        goto out;
    }
    {
        shoal_k3cfg cfg;
        char cpath[PATH_MAX];
        snprintf(cpath, sizeof cpath, "%s/config.json", model_dir);
        rc = shoal_k3cfg_load(&cfg, cpath, err, sizeof err);
        if (!rc)
            rc = shoal_tok_check_model(tok, tok_dir, cpath, cfg.vocab_size, err, sizeof err);
        if (rc) {
            fprintf(stderr, "shoal serve: %s\n", err);
            goto out;
        }
        if (max_context > cfg.max_position) {
            fprintf(stderr, "shoal serve: --max-context %ld is above the model's maximum, %d (max_position_embeddings "
                            "in %s)\n",
                    max_context, cfg.max_position, cpath);
            status = 2;
            goto out;
        }
        if (!max_context)
            max_context = default_context(&cfg, state_gb, slots);
        else
            SHOAL_INFO("serve: context %ld tokens per sequence (--max-context; the model allows %d)", max_context,
                       cfg.max_position);
    }
    if (atomic_load(&boot.loop_done))
        goto stopped;
    boot_stage(&boot, "the model to load", "%s, context %ld", model_dir, max_context);
    shoal_model_opts mo = {.max_context = (int)max_context, .threads = (int)threads,
                           .remote_experts = shoal_dist_enabled(&dopts), .trunk_mode = trunk_mode,
                           .trunk_budget = trunk_budget, .trunk_no_direct = trunk_no_direct,
                           .tokenizer_dir = tokenizer_dir};
    rc = shoal_model_open(&model, model_dir, &mo, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: model: %s\n", err);
        goto out;
    }
    shoal_model_guard(model); /* a mapped file truncated under a read: one line naming it */
    shoal_model_info info;
    shoal_model_get_info(model, &info);
    ctx.model = model;
    ctx.queue = queue;
    ctx.trunk_budget = info.trunk_budget;
    ctx.trunk_resident = info.trunk_resident_bytes;
    SHOAL_INFO("serve: model loaded in %.1f s", since_s(boot.stage_ns));
    if (atomic_load(&boot.loop_done))
        goto stopped;
    /* every worker must answer its HELLO (and own its experts) before we serve */
    if (shoal_dist_enabled(&dopts)) {
        char who[700] = "";
        size_t at = 0;
        for (int i = 0; i < dopts.nworker && at < sizeof who; i++)
            at += (size_t)snprintf(who + at, sizeof who - at, "%s%s", i ? ", " : "", dopts.worker[i]);
        if (dopts.nlocal)
            snprintf(who, sizeof who, "%d local workers (--workers)", dopts.nlocal);
        else if (dopts.plan)
            snprintf(who, sizeof who, "the workers of %s", dopts.plan);
        boot_stage(&boot, "the workers to answer", "%s; HELLO deadline %d ms", who,
                   dopts.hello_timeout_ms ? dopts.hello_timeout_ms : 60000);
    }
    dopts.cancel = &boot.loop_done;
    if (shoal_dist_enabled(&dopts) && (rc = shoal_dist_start(&ctx.dist, &dopts, model_dir, model, err, sizeof err))) {
        if (rc == SHOAL_ECANCELED)
            goto stopped;
        fprintf(stderr, "shoal serve: workers: %s\n", err);
        status = shoal_err_exit_code(rc); /* as `shoal run`: a gap or a mismatch is 3, a usage mistake 2 */
        goto out;
    }
    shoal_cmetrics_opts cmo = {.num_layers = info.cfg->num_layers, .is_moe = info.cfg->is_moe,
                               .num_experts = info.cfg->num_experts, .expert_bytes = info.expert_bytes,
                               .max_workers = shoal_dist_nworkers(ctx.dist)};
    if ((rc = shoal_cmetrics_open(&ctx.cm, &cmo, err, sizeof err)) ||
        (rc = shoal_dist_set_metrics(ctx.dist, ctx.cm, err, sizeof err))) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = 4;
        goto out;
    }
    if (trace_path) {
        shoal_trace_hdr th = {.num_layers = (uint32_t)info.cfg->num_layers,
                              .num_experts = (uint32_t)info.cfg->num_experts,
                              .k = (uint32_t)info.cfg->experts_per_token};
        if (shoal_fprint_model(th.fingerprint, info.cfg, shoal_model_store(model), err, sizeof err))
            memset(th.fingerprint, 0, sizeof th.fingerprint); /* no expert tensors here: unknown */
        if ((rc = shoal_trace_create(&trace, trace_path, &th, err, sizeof err))) {
            fprintf(stderr, "shoal serve: %s\n", err);
            status = 2;
            goto out;
        }
    }
    shoal_model_set_monitor(model, ctx.cm, trace);
    /* the memory plan of the slots' sequence states */
    /* a sequence's state, with its drafting room when --draft is on */
    uint64_t full_state = info.seq_fixed_bytes + (uint64_t)info.max_context * info.seq_bytes_per_token +
                          shoal_spec_bytes(model, &draft);
    uint64_t state_bytes;
    const char *state_from;
    if (state_gb > 0) {
        state_bytes = (uint64_t)(state_gb * 1073741824.0);
        state_from = "--state-gb";
    } else {
        shoal_memplan_probe mp;
        shoal_memplan_read("", &mp);
        uint64_t usable = shoal_memplan_usable(&mp);
        /* room for a full-context sequence in every slot (8 when --slots is not given) */
        uint64_t cap = (uint64_t)(slots ? slots : 8) * full_state;
        state_bytes = usable == UINT64_MAX ? cap : usable / 4;
        if (state_bytes > cap)
            state_bytes = cap;
        if (state_bytes < full_state)
            state_bytes = full_state;
        state_from = "default: a quarter of the usable memory, at most a full-context sequence per slot";
    }
    if (state_bytes < full_state) {
        char b1[32], b2[32];
        fprintf(stderr,
                "shoal serve: --state-gb %s is below one full-context sequence's state (%s for %d tokens); raise it "
                "or lower --max-context\n",
                shoal_memplan_fmt(state_bytes, b1, sizeof b1), shoal_memplan_fmt(full_state, b2, sizeof b2),
                info.max_context);
        status = 2;
        goto out;
    }
    if (!slots) {
        uint64_t n = state_bytes / full_state;
        slots = n < 1 ? 1 : n > 8 ? 8 : (long)n;
    }
    /* a default budget makes room for the prefix cache's memory on top of
     * the slots' (with --state-gb the captures share the given budget) */
    if (state_gb <= 0 && pcache_gb > 0)
        state_bytes += (uint64_t)(pcache_gb * 1073741824.0);
    /* the prefix cache's default (docs/CONFIG.md "Prefix cache default"):
     * half the state budget, at most 8 GiB, shared with the slots (a
     * capture only takes what they leave and gives way to a request), and
     * off when that cannot hold one capture of a 1024-token prefix */
    uint64_t pcache_bytes = pcache_gb > 0 ? (uint64_t)(pcache_gb * 1073741824.0) : 0;
    char pcache_why[192] = "--prefix-cache-gb";
    if (pcache_gb < 0) {
        uint64_t one = info.seq_fixed_bytes + 1024ull * info.seq_bytes_per_token;
        uint64_t half = state_bytes / 2, cap = UINT64_C(8) << 30;
        pcache_bytes = half < cap ? half : cap;
        char b1[32], b2[32];
        if (pcache_bytes < one) {
            snprintf(pcache_why, sizeof pcache_why,
                     "default: off, half the state budget (%s) cannot hold one capture of 1024 tokens (%s)",
                     shoal_memplan_fmt(half, b1, sizeof b1), shoal_memplan_fmt(one, b2, sizeof b2));
            pcache_bytes = 0;
        } else {
            snprintf(pcache_why, sizeof pcache_why,
                     "default: half the state budget, at most 8 GiB, shared with the slots; a capture of 1024 "
                     "tokens is %s", shoal_memplan_fmt(one, b1, sizeof b1));
        }
    }
    if (slots > info.max_batch) {
        fprintf(stderr, "shoal serve: --slots %ld is more than the model's batch (%d)\n", slots, info.max_batch);
        status = 2;
        goto out;
    }
    {
        char b1[32], b2[32], b3[32];
        SHOAL_INFO("serve: memory plan: sequence state budget %s (%s); one full-context sequence %s (%zu B fixed + "
                   "%d tokens x %zu B + %zu B drafting room); a request holds fixed + drafting + (prompt + "
                   "max_tokens) x per token; slots %ld, step tokens %ld; forward scratch %s",
                   shoal_memplan_fmt(state_bytes, b1, sizeof b1), state_from,
                   shoal_memplan_fmt(full_state, b2, sizeof b2), info.seq_fixed_bytes, info.max_context,
                   info.seq_bytes_per_token, shoal_spec_bytes(model, &draft), slots, step_tokens,
                   shoal_memplan_fmt(info.scratch_bytes, b3, sizeof b3));
    }
    if (pcache_bytes > 0 || pcache_dir) {
        uint8_t fp[SHOAL_PCACHE_FP_BYTES];
        shoal_pcache_opts pco = {.model = model,
                                 .fingerprint = fp,
                                 .mem_bytes = pcache_bytes,
                                 .dir = pcache_dir,
                                 .disk_bytes = pcache_disk_gb > 0 ? (uint64_t)(pcache_disk_gb * 1073741824.0)
                                                                  : SHOAL_PCACHE_DISK_AUTO};
        if ((rc = shoal_pcache_fingerprint(fp, model, err, sizeof err)) ||
            (rc = shoal_pcache_open(&pcache, &pco, err, sizeof err))) {
            fprintf(stderr, "shoal serve: prefix cache: %s\n", err);
            status = shoal_err_exit_code(rc); /* a directory in use by another server: 4, like a port in use */
            goto out;
        }
        shoal_pcache_stats pst;
        shoal_pcache_get_stats(pcache, &pst);
        char b1[32], b2[32], b3[32], dirs[1200] = "";
        if (pcache_dir)
            snprintf(dirs, sizeof dirs,
                     ", directory %s holding %s of at most %s (%s; %llu captures indexed, %llu files refused, "
                     "%llu removed)",
                     pcache_dir, shoal_memplan_fmt(pst.disk_bytes, b2, sizeof b2),
                     shoal_memplan_fmt(pst.disk_budget, b3, sizeof b3),
                     pcache_disk_gb > 0 ? "--prefix-cache-disk-gb"
                                        : "default: half the free space plus the cache's files, at most 64 GiB",
                     (unsigned long long)pst.disk_entries, (unsigned long long)pst.refused,
                     (unsigned long long)pst.removed);
        SHOAL_INFO("serve: prefix cache: %s in memory (%s)%s, a capture every %ld tokens and at each message end",
                   shoal_memplan_fmt(pco.mem_bytes, b1, sizeof b1), pcache_why, dirs, pcache_stride);
        ctx.pcache = pcache;
    }
    shoal_sched_opts so = {
        .model = model,
        .pcache = pcache,
        .pcache_stride = (int)pcache_stride,
        .tok = tok,
        .queue_size = (int)queue,
        .slots = (int)slots,
        .step_tokens = (int)step_tokens,
        .state_bytes = (size_t)state_bytes,
        .keep_seqs = (int)keep,
        .keep_bytes = (size_t)keep_mb << 20,
        .memo_entries = (int)memo,
        .memo_bytes = (size_t)memo_mb << 20,
        .threads = (int)threads,
        .cm = ctx.cm,
        .draft = draft,
        .mask_thread = mask_thread,
    };
    rc = shoal_sched_open(&sched, &so, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: %s\n", err);
        goto out;
    }
    ctx.sched = sched;
    shoal_api_opts ao = {
        .limits = {.model_name = model_name, .vocab = shoal_tok_n_vocab(tok), .max_context = info.max_context},
        .api_key = api_key,
        .sched = sched,
        .model = model,
        .workers = workers_cb,
        .covered = covered_cb,
        .metrics = metrics_cb,
        .route = route_cb,
        .ud = &ctx,
    };
    rc = shoal_api_open(&api, &ao, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = 2;
        goto out;
    }
    ctx.api = api;
    if ((rc = shoal_webui_open(&ctx.web, http, NULL, cluster_source, &ctx, 500, err, sizeof err))) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = 4;
        goto out;
    }
    shoal_api_set_http(api, http);
    shoal_api_set_ready(api, 1);
    atomic_store(&boot.api, api); /* from now on every request goes to the API */
    if (atomic_load(&boot.loop_done))
        goto stopped;
    SHOAL_INFO("serve: ready in %.1f s", since_s(boot.t0_ns));
    SHOAL_INFO("serve: model '%s' (%s), context %d, %ld slot%s, queue %ld, %d expert worker%s, %s", model_name,
               model_dir, info.max_context, slots, slots == 1 ? "" : "s", queue, shoal_dist_nworkers(ctx.dist), shoal_dist_nworkers(ctx.dist) == 1 ? "" : "s",
               api_key ? "API key required" : "no API key");
    /* one machine-readable line on stdout for scripts and tests */
    printf("shoal serve: listening on http://%s%s%s:%d\n", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", shoal_http_port(http));
    fflush(stdout);
    stop_ticker(&boot, &ticker_thr, &ticker_on);
    pthread_join(loop_thr, NULL); /* until SIGINT/SIGTERM */
    loop_on = 0;
    status = 0;
    goto out;
stopped: /* a signal during the start: a clean stop */
    SHOAL_INFO("serve: stopped while starting");
    status = 0;
out:
    stop_ticker(&boot, &ticker_thr, &ticker_on);
    if (loop_on) { /* the start failed or was stopped: end the loop before closing what it serves */
        shoal_http_stop(http);
        pthread_join(loop_thr, NULL);
    }
    shoal_webui_close(ctx.web); /* its ticker posts to the loop: stopped before the server closes */
    ctx.sched = NULL;
    shoal_sched_close(sched); /* after the loop: every exchange is aborted by now */
    shoal_api_close(api);
    shoal_pcache_close(pcache); /* the scheduler used it; before the model its states came from */
    shoal_http_close(http);
    if (model)
        shoal_model_set_monitor(model, NULL, NULL);
    shoal_model_guard(NULL);
    shoal_model_close(model); /* closes the expert client */
    shoal_dist_stop(ctx.dist); /* then the spawned workers */
    shoal_cmetrics_close(ctx.cm);
    if (trace) {
        uint64_t nrec = shoal_trace_count(trace);
        if (shoal_trace_close(trace, err, sizeof err)) {
            fprintf(stderr, "shoal serve: trace: %s\n", err);
            if (!status)
                status = 4;
        } else {
            SHOAL_INFO("trace %s: %llu routing records", trace_path, (unsigned long long)nrec);
        }
    }
    shoal_tok_close(tok);
    if (key_file)
        memset(key_buf, 0, sizeof key_buf);
    {
        struct rusage ru;
        char r1[32], r2[32];
        uint64_t mx = getrusage(RUSAGE_SELF, &ru) ? 0 : (uint64_t)ru.ru_maxrss * 1024u;
        SHOAL_INFO("peak resident memory: %s (getrusage ru_maxrss), %s (VmHWM)", shoal_memplan_fmt(mx, r1, sizeof r1),
                   shoal_memplan_fmt(shoal_memplan_peak_rss(), r2, sizeof r2));
    }
    pthread_cond_destroy(&boot.cv);
    pthread_mutex_destroy(&boot.mu);
    return status;
}
