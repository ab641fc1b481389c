/* `shoal serve`: the OpenAI-compatible HTTP server. Wires the pieces in
 * order -- model (engine), tokenizer, scheduler (model thread), API, HTTP
 * listener -- marks the server ready once the model (and every worker)
 * answered, runs the loop on this thread until SIGINT/SIGTERM, then takes
 * everything down in reverse. Flags are documented in docs/CONFIG.md. */
#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "cli/commands.h"
#include "common/err.h"
#include "common/log.h"
#include "common/memplan.h"
#include "coordinator/api/api.h"
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
            "Serves the OpenAI-compatible API (docs/API.md) for the model in DIR.\n"
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
            "                         (default: the model's max_position_embeddings, at most 16384)\n"
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
            "  --prefix-cache-gb G    prefix cache in memory, GiB (fractions allowed; default 0 = off):\n"
            "                         prompt states captured at message ends and every\n"
            "                         --prefix-cache-stride tokens; a prompt sharing a captured\n"
            "                         prefix prefills only the rest (same logits); counts against\n"
            "                         --state-gb (evicted first when a request needs the room)\n"
            "  --prefix-cache-dir DIR also keep every capture in DIR, so it survives a restart\n"
            "                         (files of another model, or damaged, are refused by name\n"
            "                         and recomputed); with or without --prefix-cache-gb\n"
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
            "  --trunk-gb G           trunk RAM budget: small|medium|large|auto or GiB; resident\n"
            "                         layers + streamed ones, same tokens (docs/CONFIG.md);\n"
            "                         default: the trunk is mapped\n"
            "  --trunk-no-direct      buffered reads for --trunk-gb (no O_DIRECT)\n"
            "  --draft ngram|off      speculative decoding of every request (default ngram):\n"
            "                         drafts from the prompt + output verified in one pass; same ids\n"
            "  --draft-max K          most drafted tokens per pass, 1..16 (default 8, adapted)\n"
            "  --draft-ngram-min N    shortest match that drafts, 1..64 (default 2)\n"
            "  --draft-cost A[,B]     a verify pass of k drafts costs 1 + B + A*k passes (0.2,0.3)\n"
            "\n");
    shoal_dist_usage(f);
}

/* What the API's callbacks read: worker states and the coordinator metrics. */
typedef struct {
    shoal_dist *dist;
    shoal_cmetrics *cm;
    shoal_model *model;
    uint64_t trunk_budget, trunk_resident; /* from the model's trunk plan */
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
    metric1(b, "shoal_prefix_cache_disk_entries", G, "Captured states indexed in --prefix-cache-dir.",
            (double)p.disk_entries);
}

static void metrics_cb(void *ud, shoal_metrics_buf *b)
{
    serve_ctx *c = ud;
    int nw = shoal_dist_nworkers(c->dist);
    for (int i = 0; i < nw; i++) { /* the local workers' backoff, as of this scrape */
        shoal_spawn_state ls;
        if (!shoal_dist_local_state(c->dist, i, &ls))
            shoal_cmetrics_worker_backoff(c->cm, i, ls.backing_off ? ls.next_try_s : 0);
    }
    shoal_cmetrics_write(c->cm, b);
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
    shoal_trunk_mode trunk_mode = SHOAL_TRUNK_MAPPED;
    uint64_t trunk_budget = 0;
    const char *trace_path = NULL;
    const char *tokenizer_dir = NULL;
    double pcache_gb = 0;
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
        fprintf(stderr, "shoal serve: unknown option '%s' (see --help)\n", a);
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

    /* the tokenizer (--tokenizer DIR, else the model's folder) must be the
     * model's vocabulary: size, and K3's digest for K3's config */
    const char *tok_dir = tokenizer_dir ? tokenizer_dir : model_dir;
    shoal_tok_opts to = {0};
    rc = shoal_tok_open(&tok, tok_dir, &to, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: tokenizer: %s\n", err);
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
        if (!max_context)
            max_context = cfg.max_position < 16384 ? cfg.max_position : 16384;
    }
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
    ctx.trunk_budget = info.trunk_budget;
    ctx.trunk_resident = info.trunk_resident_bytes;
    /* every worker must answer its HELLO (and own its experts) before we serve */
    if (shoal_dist_enabled(&dopts) && (rc = shoal_dist_start(&ctx.dist, &dopts, model_dir, model, err, sizeof err))) {
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
    if (pcache_gb > 0 || pcache_dir) {
        uint8_t fp[SHOAL_PCACHE_FP_BYTES];
        shoal_pcache_opts pco = {.model = model,
                                 .fingerprint = fp,
                                 .mem_bytes = (uint64_t)(pcache_gb * 1073741824.0),
                                 .dir = pcache_dir};
        if ((rc = shoal_pcache_fingerprint(fp, model, err, sizeof err)) ||
            (rc = shoal_pcache_open(&pcache, &pco, err, sizeof err))) {
            fprintf(stderr, "shoal serve: prefix cache: %s\n", err);
            status = rc == SHOAL_EINVAL ? 2 : 3;
            goto out;
        }
        shoal_pcache_stats pst;
        shoal_pcache_get_stats(pcache, &pst);
        char b1[32];
        SHOAL_INFO("serve: prefix cache: %s in memory%s%s (%llu captures indexed there, %llu files refused), a "
                   "capture every %ld tokens and at each message end",
                   shoal_memplan_fmt(pco.mem_bytes, b1, sizeof b1), pcache_dir ? ", directory " : "",
                   pcache_dir ? pcache_dir : "", (unsigned long long)pst.disk_entries,
                   (unsigned long long)pst.refused, pcache_stride);
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
        .ud = &ctx,
    };
    rc = shoal_api_open(&api, &ao, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = 2;
        goto out;
    }
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
        .on_request = shoal_api_on_request,
        .ud = api,
    };
    rc = shoal_http_open(&http, &ho, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal serve: %s\n", err);
        status = rc == SHOAL_EINVAL ? 2 : 4; /* a --host that is no address is a usage mistake */
        goto out;
    }
    shoal_api_set_http(api, http);
    shoal_api_set_ready(api, 1);
    SHOAL_INFO("serve: model '%s' (%s), context %d, %ld slot%s, queue %ld, %d expert worker%s, %s", model_name,
               model_dir, info.max_context, slots, slots == 1 ? "" : "s", queue, shoal_dist_nworkers(ctx.dist), shoal_dist_nworkers(ctx.dist) == 1 ? "" : "s",
               api_key ? "API key required" : "no API key");
    /* one machine-readable line on stdout for scripts and tests */
    printf("shoal serve: listening on http://%s%s%s:%d\n", strchr(host, ':') ? "[" : "", host,
           strchr(host, ':') ? "]" : "", shoal_http_port(http));
    fflush(stdout);
    shoal_http_run(http);
    status = 0;
out:
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
    return status;
}
