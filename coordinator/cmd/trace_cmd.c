/* trace_cmd: `shoal trace stats FILE [--plan plan.json]` (heat, concentration,
 * a placement's expected balance, from obs/trace.h) and `shoal trace replay`
 * (replay.c). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "common/err.h"
#include "coordinator/cmd/replay.h"
#include "coordinator/obs/obs.h"
#include "proto/proto.h"

/* ---- `shoal trace` ------------------------------------------------------ */

static void trace_usage(FILE *f)
{
    fprintf(f, "usage: shoal trace stats FILE [--plan plan.json] [--top N] [--all]\n"
               "       shoal trace replay FILE --cache-slots N[,N...]  (expert cache policies; --help)\n"
               "\n"
               "Summarises a routing trace written by `shoal run|serve --trace FILE`\n"
               "(format: docs/METRICS.md, \"Routing traces\"):\n"
               "  per-layer concentration: hottest expert / mean, share of the hottest 10%%\n"
               "  of experts, normalised entropy, experts never chosen;\n"
               "  the hottest experts (heat = hits / the layer's mean hits per expert);\n"
               "  with --plan: each worker's expected load share against its fair share\n"
               "  (1/N), the imbalance (max/mean share), per-layer imbalance, and the\n"
               "  layer-weighted imbalance (expected slowdown from waiting on the slowest\n"
               "  worker at every MoE layer).\n"
               "\n"
               "  --plan FILE   placement plan (plan.json: docs/METRICS.md)\n"
               "  --top N       hottest experts to list (default 10)\n"
               "  --all         list every (layer, expert) with its hits and heat\n"
               "\n"
               "exit codes: 0 ok, 2 usage error, 3 invalid trace or plan\n");
}

typedef struct {
    uint32_t l, e;
    uint64_t h;
} hot_cell;

static int cmp_hot(const void *a, const void *b)
{
    const hot_cell *x = a, *y = b;
    if (x->h != y->h)
        return x->h < y->h ? 1 : -1;
    if (x->l != y->l)
        return x->l < y->l ? -1 : 1;
    return x->e < y->e ? -1 : x->e > y->e;
}

static int trace_stats_cmd(int argc, char **argv)
{
    const char *file = NULL, *plan = NULL;
    long top = 10;
    int all = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--plan") && i + 1 < argc) {
            plan = argv[++i];
        } else if (!strcmp(argv[i], "--top") && i + 1 < argc) {
            char *end;
            top = strtol(argv[++i], &end, 10);
            if (*end || top < 0 || top > 1000000) {
                fprintf(stderr, "shoal trace stats: bad --top '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(argv[i], "--all")) {
            all = 1;
        } else if (argv[i][0] == '-' || file) {
            fprintf(stderr, "shoal trace stats: unexpected argument '%s'\n", argv[i]);
            trace_usage(stderr);
            return 2;
        } else {
            file = argv[i];
        }
    }
    if (!file) {
        trace_usage(stderr);
        return 2;
    }
    char err[1024];
    shoal_trace_file *f = NULL;
    int rc = shoal_trace_open(&f, file, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal trace stats: %s\n", err);
        return 3;
    }
    const shoal_trace_hdr *h = shoal_trace_file_hdr(f);
    shoal_trace_stats s;
    shoal_trace_stats_compute(f, &s);
    int zero_fp = 1;
    for (int i = 0; i < 32; i++)
        zero_fp &= h->fingerprint[i] == 0;
    char hex[2 * SHOAL_PROTO_FP_BYTES + 1];
    shoal_proto_hex(h->fingerprint, hex);
    printf("trace %s: format %d, %u layers x %u experts, k %u, model fingerprint %s\n", file, SHOAL_TRACE_MAJOR,
           h->num_layers, h->num_experts, h->k, zero_fp ? "unknown" : hex);
    printf("records %llu, tokens %llu, pairs %llu\n", (unsigned long long)s.records, (unsigned long long)s.tokens,
           (unsigned long long)s.pairs);
    if (shoal_trace_file_trailing(f))
        printf("warning: %llu trailing bytes of a partial last record ignored\n",
               (unsigned long long)shoal_trace_file_trailing(f));

    printf("\nper-layer concentration (uniform routing: max/mean 1, top10%% ~0.1, entropy 1, cold 0)\n");
    printf("%6s %10s %12s %9s %8s %8s %6s\n", "layer", "tokens", "pairs", "max/mean", "top10%", "entropy", "cold");
    for (uint32_t l = 0; l < s.num_layers; l++) {
        shoal_trace_conc c;
        if (!shoal_trace_layer_conc(&s, l, &c))
            continue;
        printf("%6u %10llu %12llu %9.3f %8.3f %8.3f %6u\n", l, (unsigned long long)s.layer_records[l],
               (unsigned long long)s.layer_pairs[l], c.max_over_mean, c.top10_share, c.entropy, c.cold);
    }

    size_t cells = (size_t)s.num_layers * s.num_experts, nhot = 0;
    hot_cell *hot = shoal_xmalloc(sizeof *hot * (cells ? cells : 1));
    for (uint32_t l = 0; l < s.num_layers; l++)
        for (uint32_t e = 0; e < s.num_experts; e++) {
            uint64_t v = s.hits[(size_t)l * s.num_experts + e];
            if (all || v)
                hot[nhot++] = (hot_cell){l, e, v};
        }
    if (!all)
        qsort(hot, nhot, sizeof *hot, cmp_hot);
    size_t show = all ? nhot : (size_t)top < nhot ? (size_t)top : nhot;
    printf("\n%s (heat = hits / the layer's mean hits per expert)\n", all ? "per-expert heat" : "hottest experts");
    printf("%6s %7s %12s %8s %8s\n", "layer", "expert", "hits", "share", "heat");
    for (size_t i = 0; i < show; i++) {
        double P = (double)s.layer_pairs[hot[i].l];
        double share = P > 0 ? (double)hot[i].h / P : 0, heat = P > 0 ? (double)hot[i].h * s.num_experts / P : 0;
        printf("%6u %7u %12llu %8.4f %8.3f\n", hot[i].l, hot[i].e, (unsigned long long)hot[i].h, share, heat);
    }
    free(hot);

    int status = 0;
    if (plan) {
        shoal_trace_plan p;
        shoal_trace_load ld;
        if ((rc = shoal_trace_plan_read(&p, plan, s.num_layers, s.num_experts, err, sizeof err)) ||
            (rc = shoal_trace_plan_load(&p, &s, &ld, err, sizeof err))) {
            fprintf(stderr, "shoal trace stats: %s\n", err);
            shoal_trace_plan_free(&p);
            status = 3;
        } else {
            printf("\nplan %s: %d workers\n", plan, p.nworkers);
            printf("%-20s %10s %8s %8s %9s\n", "worker", "owned", "share", "fair", "share/fair");
            for (int w = 0; w < p.nworkers; w++)
                printf("%-20s %10llu %8.4f %8.4f %9.3f\n", p.names[w], (unsigned long long)ld.owned[w], ld.share[w],
                       ld.fair[w], ld.share[w] / ld.fair[w]);
            double worst = 0;
            uint32_t worst_l = 0;
            for (uint32_t l = 0; l < s.num_layers; l++)
                if (ld.layer_imb[l] > worst) {
                    worst = ld.layer_imb[l];
                    worst_l = l;
                }
            printf("imbalance (max/mean share): %.3f\n", ld.imbalance);
            printf("per-layer imbalance (max/mean load): worst %.3f at layer %u\n", worst, worst_l);
            printf("layer-weighted imbalance (sum of per-layer max / sum of per-layer mean): %.3f\n",
                   ld.layer_weighted);
            shoal_trace_load_free(&ld);
            shoal_trace_plan_free(&p);
        }
    }
    shoal_trace_stats_free(&s);
    shoal_trace_file_close(f);
    return status;
}

int shoal_cmd_trace(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        trace_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "stats"))
        return trace_stats_cmd(argc - 1, argv + 1);
    if (!strcmp(argv[1], "replay")) /* replay.c */
        return shoal_replay_cmd(argc - 1, argv + 1);
    fprintf(stderr, "shoal trace: unknown subcommand '%s'\n", argv[1]);
    trace_usage(stderr);
    return 2;
}
