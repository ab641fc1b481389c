/* Offline replay of routing traces against the cache policies (see replay.h). */
#include "coordinator/cmd/replay.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

void shoal_replay_keys(const shoal_trace_file *f, uint32_t **keys, uint64_t *n)
{
    const shoal_trace_hdr *h = shoal_trace_file_hdr(f);
    uint64_t nrec = shoal_trace_file_count(f), cap = 1024, m = 0;
    uint32_t *k = shoal_xmalloc(cap * sizeof *k);
    uint8_t *seen = shoal_xcalloc(h->num_experts, 1);
    uint64_t i = 0;
    while (i < nrec) { /* one request: consecutive records of one layer */
        shoal_trace_rec r;
        shoal_trace_file_get(f, i, &r);
        uint32_t layer = r.layer;
        uint64_t j = i;
        for (; j < nrec; j++) {
            shoal_trace_file_get(f, j, &r);
            if (r.layer != layer)
                break;
            for (uint32_t x = 0; x < r.n; x++)
                seen[r.experts[x]] = 1;
        }
        int first = 1;
        for (uint32_t e = 0; e < h->num_experts; e++) {
            if (!seen[e])
                continue;
            seen[e] = 0;
            if (m == cap) {
                cap *= 2;
                k = realloc(k, cap * sizeof *k);
                if (!k)
                    SHOAL_PANIC("out of memory");
            }
            k[m++] = (layer * h->num_experts + e) | (first ? SHOAL_REPLAY_GROUP : 0);
            first = 0;
        }
        i = j;
    }
    free(seen);
    *keys = k;
    *n = m;
}

int shoal_replay_run(const uint32_t *keys, uint64_t n, uint32_t nkeys, uint32_t nslots, shoal_cachepol_kind kind,
                     uint64_t aging, const uint64_t *seed, uint64_t *hits, char *err, size_t errlen)
{
    *hits = 0;
    shoal_cachepol *p = NULL;
    shoal_cachepol_opts o = {.kind = kind, .nslots = nslots, .nkeys = nkeys, .aging = aging};
    int rc = shoal_cachepol_open(&p, &o, err, errlen);
    if (rc)
        return rc;
    if (seed)
        shoal_cachepol_seed(p, seed);
    uint64_t *nextpos = NULL, *last = NULL;
    if (kind == SHOAL_CACHEPOL_OPT) { /* next use of each access, from a backward pass */
        nextpos = shoal_xmalloc((n ? n : 1) * sizeof *nextpos);
        last = shoal_xmalloc(nkeys * sizeof *last);
        for (uint32_t i = 0; i < nkeys; i++)
            last[i] = UINT64_MAX;
        for (uint64_t i = n; i-- > 0;) {
            uint32_t key = keys[i] & ~SHOAL_REPLAY_GROUP;
            nextpos[i] = last[key];
            last[key] = i;
        }
    }
    uint8_t *pinned = shoal_xcalloc(nslots, 1);
    int32_t *pass = shoal_xmalloc(nslots * sizeof *pass);
    uint32_t npass = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t key = keys[i] & ~SHOAL_REPLAY_GROUP;
        if (key >= nkeys) {
            rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "replay: key %u out of range", key);
            break;
        }
        if ((keys[i] & SHOAL_REPLAY_GROUP) || npass == nslots) { /* a new request, or the pass is full */
            for (uint32_t j = 0; j < npass; j++)
                pinned[pass[j]] = 0;
            npass = 0;
        }
        if (nextpos)
            shoal_cachepol_set_next(p, key, nextpos[i]);
        int hit;
        int64_t ev;
        int slot = shoal_cachepol_access(p, key, pinned, &hit, &ev);
        if (slot < 0) {
            rc = shoal_err_set(err, errlen, SHOAL_EINTERNAL, "replay: no slot (all pinned)");
            break;
        }
        pinned[slot] = 1;
        pass[npass++] = slot;
        *hits += (uint64_t)hit;
    }
    free(pinned);
    free(pass);
    free(nextpos);
    free(last);
    shoal_cachepol_close(p);
    return rc;
}

/* ---- CLI ------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal trace replay FILE --cache-slots N[,N...] [--heat TRACE] [--aging N] [--json]\n"
               "\n"
               "Replays the expert accesses of a routing trace (one request per layer per chunk,\n"
               "distinct experts in ascending order, as `shoal expert --cache-slots N` fetches them)\n"
               "against the replacement policies and prints the hit rate of each:\n"
               "  lru       least recently used\n"
               "  lfu       frequency with aging (the worker's default)\n"
               "  lfu+heat  lfu starting from the per-expert hits of --heat TRACE (another run)\n"
               "  opt       Belady's optimum (knows the future: the upper bound)\n"
               "Slots count whole experts across all layers (a worker owning every expert).\n"
               "\n"
               "  --cache-slots LIST  comma-separated slot counts\n"
               "  --heat TRACE        seed for lfu+heat (same model)\n"
               "  --aging N           lfu: halve the counts every N accesses (default 4 x keys)\n"
               "  --json              one JSON object per slot count\n"
               "\n"
               "exit codes: 0 ok, 2 usage error, 3 invalid trace\n");
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

int shoal_replay_cmd(int argc, char **argv)
{
    const char *file = NULL, *heat = NULL, *slots_s = NULL;
    uint64_t aging = 0;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cache-slots") && i + 1 < argc) {
            slots_s = argv[++i];
        } else if (!strcmp(argv[i], "--heat") && i + 1 < argc) {
            heat = argv[++i];
        } else if (!strcmp(argv[i], "--aging") && i + 1 < argc) {
            if (parse_u64(argv[++i], &aging)) {
                fprintf(stderr, "shoal trace replay: bad --aging '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' || file) {
            fprintf(stderr, "shoal trace replay: unexpected argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        } else {
            file = argv[i];
        }
    }
    if (!file || !slots_s) {
        usage(stderr);
        return 2;
    }
    uint32_t slots[256];
    int nslots = 0;
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", slots_s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        uint64_t v;
        if (nslots == 256 || parse_u64(tok, &v) || v < 1 || v > (1u << 30)) {
            fprintf(stderr, "shoal trace replay: bad --cache-slots entry '%s'\n", tok);
            return 2;
        }
        slots[nslots++] = (uint32_t)v;
    }
    char err[1024];
    shoal_trace_file *f = NULL, *hf = NULL;
    if (shoal_trace_open(&f, file, err, sizeof err)) {
        fprintf(stderr, "shoal trace replay: %s\n", err);
        return 3;
    }
    const shoal_trace_hdr *h = shoal_trace_file_hdr(f);
    uint32_t nkeys = h->num_layers * h->num_experts;
    uint64_t *seed = NULL;
    if (heat) {
        if (shoal_trace_open(&hf, heat, err, sizeof err)) {
            fprintf(stderr, "shoal trace replay: %s\n", err);
            shoal_trace_file_close(f);
            return 3;
        }
        const shoal_trace_hdr *hh = shoal_trace_file_hdr(hf);
        if (hh->num_layers != h->num_layers || hh->num_experts != h->num_experts ||
            memcmp(hh->fingerprint, h->fingerprint, sizeof h->fingerprint)) {
            fprintf(stderr, "shoal trace replay: --heat %s is a trace of another model\n", heat);
            shoal_trace_file_close(f);
            shoal_trace_file_close(hf);
            return 3;
        }
        shoal_trace_stats s;
        shoal_trace_stats_compute(hf, &s);
        seed = shoal_xmalloc(nkeys * sizeof *seed);
        memcpy(seed, s.hits, nkeys * sizeof *seed);
        shoal_trace_stats_free(&s);
    }
    uint32_t *keys;
    uint64_t n;
    shoal_replay_keys(f, &keys, &n);
    /* distinct keys: the slots a fully resident cache needs */
    uint8_t *seen = shoal_xcalloc(nkeys, 1);
    uint64_t distinct = 0, requests = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t key = keys[i] & ~SHOAL_REPLAY_GROUP;
        distinct += !seen[key];
        seen[key] = 1;
        requests += (keys[i] & SHOAL_REPLAY_GROUP) != 0;
    }
    free(seen);
    if (!json)
        printf("trace %s: %llu records, %llu requests, %llu expert fetches, %llu distinct experts (k %u)\n"
               "%10s %9s %8s %8s %9s %8s\n",
               file, (unsigned long long)shoal_trace_file_count(f), (unsigned long long)requests,
               (unsigned long long)n, (unsigned long long)distinct, h->k, "slots", "share", "lru", "lfu",
               heat ? "lfu+heat" : "-", "opt");
    int status = 0;
    for (int si = 0; si < nslots && !status; si++) {
        uint32_t s = slots[si];
        if (s < h->k) { /* the worker refuses fewer than one token's experts */
            fprintf(stderr, "shoal trace replay: %u slots is below the minimum of k = %u\n", s, h->k);
            status = 2;
            break;
        }
        uint64_t hl = 0, hf1 = 0, hh = 0, ho = 0;
        if (shoal_replay_run(keys, n, nkeys, s, SHOAL_CACHEPOL_LRU, 0, NULL, &hl, err, sizeof err) ||
            shoal_replay_run(keys, n, nkeys, s, SHOAL_CACHEPOL_LFU, aging, NULL, &hf1, err, sizeof err) ||
            (seed && shoal_replay_run(keys, n, nkeys, s, SHOAL_CACHEPOL_LFU, aging, seed, &hh, err, sizeof err)) ||
            shoal_replay_run(keys, n, nkeys, s, SHOAL_CACHEPOL_OPT, 0, NULL, &ho, err, sizeof err)) {
            fprintf(stderr, "shoal trace replay: %s\n", err);
            status = 3;
            break;
        }
        double d = n ? (double)n : 1.0;
        if (json) {
            printf("{\"trace\":\"%s\",\"slots\":%u,\"distinct\":%llu,\"fetches\":%llu,\"requests\":%llu,"
                   "\"lru\":%.6f,\"lfu\":%.6f,",
                   file, s, (unsigned long long)distinct, (unsigned long long)n, (unsigned long long)requests,
                   (double)hl / d, (double)hf1 / d);
            if (seed)
                printf("\"lfu_heat\":%.6f,", (double)hh / d);
            printf("\"opt\":%.6f}\n", (double)ho / d);
        } else {
            char hs[16] = "-";
            if (seed)
                snprintf(hs, sizeof hs, "%.4f", (double)hh / d);
            printf("%10u %9.3f %8.4f %8.4f %9s %8.4f\n", s, distinct ? (double)s / (double)distinct : 0.0,
                   (double)hl / d, (double)hf1 / d, hs, (double)ho / d);
        }
    }
    free(keys);
    free(seed);
    shoal_trace_file_close(hf);
    shoal_trace_file_close(f);
    return status;
}
