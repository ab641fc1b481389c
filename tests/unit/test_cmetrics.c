/* coordinator/cmetrics: a hand-computed set of exchanges (two workers, two
 * MoE layers) and phases; the totals, load shares, per-layer imbalance,
 * network time (rtt - queue - compute) and the exposition's values.
 * With SHOAL_METRICS_DUMP=PATH, writes this case's exposition there for
 * tests/e2e/test_metrics_expo.py. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/obs/cmetrics.h"
#include "test.h"

static const uint8_t is_moe[3] = {0, 1, 1};

/* w0 "a": layer 1: 3 pairs, rtt 1000 µs (queue 100, compute 600 -> net 300);
 *         layer 2: 5 pairs, rtt 2000 µs (queue 0, compute 1500 -> net 500)
 * w1 "b": layer 1: 1 pair, rtt 500 µs (queue 50, compute 400 -> net 50);
 *         layer 2: 3 pairs, rtt 4000 µs (queue 0, compute 3900 -> net 100)
 * shares: a 8/12, b 4/12; imbalance L1 3/2 = 1.5, L2 5/4 = 1.25 */
static shoal_cmetrics *build(void)
{
    shoal_cmetrics *cm = NULL;
    char err[256];
    shoal_cmetrics_opts o = {.num_layers = 3, .is_moe = is_moe, .num_experts = 4, .expert_bytes = 1000,
                             .max_workers = 2};
    CHECK_EQ_INT(shoal_cmetrics_open(&cm, &o, err, sizeof err), 0);
    if (!cm)
        return NULL;
    CHECK_EQ_INT(shoal_cmetrics_set_worker(cm, 0, "a", "ipc:///tmp/a", 4, 4000, 1 << 30), 0);
    CHECK_EQ_INT(shoal_cmetrics_set_worker(cm, 1, "b\"x", "tcp://127.0.0.1:5", 4, 4000, 1 << 30), 0);
    CHECK(shoal_cmetrics_set_worker(cm, 2, "c", "", 0, 0, 0) == SHOAL_EINVAL);
    shoal_cmetrics_worker_up(cm, 0, 1);
    shoal_cmetrics_worker_up(cm, 1, 0);
    shoal_cmetrics_xchg x;
    x = (shoal_cmetrics_xchg){.tokens = 2, .pairs = 3, .experts = 2, .bytes_out = 100, .bytes_in = 200,
                              .rtt_ns = 1000000, .queue_us = 100, .compute_us = 600};
    shoal_cmetrics_exchange(cm, 0, 1, &x);
    x = (shoal_cmetrics_xchg){.tokens = 2, .pairs = 5, .experts = 3, .bytes_out = 100, .bytes_in = 300,
                              .rtt_ns = 2000000, .queue_us = 0, .compute_us = 1500};
    shoal_cmetrics_exchange(cm, 0, 2, &x);
    x = (shoal_cmetrics_xchg){.tokens = 1, .pairs = 1, .experts = 1, .bytes_out = 50, .bytes_in = 70,
                              .rtt_ns = 500000, .queue_us = 50, .compute_us = 400};
    shoal_cmetrics_exchange(cm, 1, 1, &x);
    x = (shoal_cmetrics_xchg){.tokens = 2, .pairs = 3, .experts = 2, .bytes_out = 100, .bytes_in = 90,
                              .rtt_ns = 4000000, .queue_us = 0, .compute_us = 3900};
    shoal_cmetrics_exchange(cm, 1, 2, &x);
    /* trunk rows: w0 two TRUNK_BATCHes: 12 rows x 2 tokens, 3000 weight bytes,
     * rtt 800 µs (queue 100, compute 500 -> net 200); 4 rows x 1 token, 1000
     * bytes, rtt 300 µs (queue 0, compute 350 -> net clamped to 0) */
    shoal_cmetrics_txchg tx = {.rows = 24, .weight_bytes = 3000, .bytes_out = 40, .bytes_in = 116,
                               .rtt_ns = 800000, .queue_us = 100, .compute_us = 500};
    shoal_cmetrics_trunk(cm, 0, &tx);
    tx = (shoal_cmetrics_txchg){.rows = 4, .weight_bytes = 1000, .bytes_out = 30, .bytes_in = 32,
                                .rtt_ns = 300000, .queue_us = 0, .compute_us = 350};
    shoal_cmetrics_trunk(cm, 0, &tx);
    shoal_cmetrics_trunk(cm, 5, &tx); /* no such worker: ignored */
    shoal_cmetrics_layer_wait(cm, 1, 300000, 0);
    shoal_cmetrics_layer_wait(cm, 2, 3500000, 1);
    shoal_cmetrics_failure_add(cm, 1, SHOAL_CMETRICS_TIMEOUT);
    shoal_cmetrics_failure_add(cm, 1, SHOAL_CMETRICS_STALE);
    shoal_cmetrics_failure_add(cm, 0, SHOAL_CMETRICS_ERROR);
    /* failover: w1 lost twice (3 + 2 pairs), all taken over by w0, after
     * 0.3 s and 0.1 s; 4 pairs of replicated experts picked on w0, 1 on w1 */
    shoal_cmetrics_failover(cm, 1, 3);
    shoal_cmetrics_failover(cm, 1, 2);
    shoal_cmetrics_takeover(cm, 1, 0, 5);
    shoal_cmetrics_takeover(cm, 1, 7, 5); /* no such worker: ignored */
    shoal_cmetrics_failover_time(cm, 300000000);
    shoal_cmetrics_failover_time(cm, 100000000);
    shoal_cmetrics_replica_pick(cm, 0, 4);
    shoal_cmetrics_replica_pick(cm, 1, 1);
    shoal_cmetrics_forward(cm, 2);
    shoal_cmetrics_forward(cm, 1);
    shoal_cmetrics_spec(cm, 5, 3, 4, 2);
    shoal_cmetrics_spec(cm, 1, 1, 0, 0);
    shoal_cmetrics_add_phase(cm, SHOAL_PHASE_ATTENTION, 3000000);
    shoal_cmetrics_add_phase(cm, SHOAL_PHASE_EXPERTS, 1500000);
    shoal_cmetrics_add_phase(cm, SHOAL_PHASE_SAMPLING, 300000);
    return cm;
}

static void t_totals(void)
{
    shoal_cmetrics *cm = build();
    if (!cm)
        return;
    CHECK_EQ_INT(shoal_cmetrics_workers(cm), 2);
    shoal_cmetrics_totals t;
    shoal_cmetrics_get_totals(cm, &t);
    CHECK_EQ_INT(t.tokens, 3);
    CHECK_EQ_INT(t.chunks, 2);
    CHECK_EQ_INT(t.spec_fed, 6);
    CHECK_EQ_INT(t.spec_passes, 4);
    CHECK_EQ_INT(t.spec_drafted, 4);
    CHECK_EQ_INT(t.spec_accepted, 2);
    CHECK_NEAR(t.phase_s[SHOAL_PHASE_ATTENTION], 0.003, 1e-12);
    CHECK_NEAR(t.phase_s[SHOAL_PHASE_SAMPLING], 0.0003, 1e-12);
    shoal_cmetrics_worker_totals a, b;
    shoal_cmetrics_get_worker(cm, 0, &a);
    shoal_cmetrics_get_worker(cm, 1, &b);
    CHECK_EQ_INT(a.requests, 2);
    CHECK_EQ_INT(a.pairs, 8);
    CHECK_EQ_INT(a.tokens, 4);
    CHECK_EQ_INT(a.weight_bytes, 5000);
    CHECK_EQ_INT(a.bytes_out, 200);
    CHECK_EQ_INT(a.bytes_in, 500);
    CHECK_NEAR(a.share, 8.0 / 12, 1e-12);
    CHECK_NEAR(b.share, 4.0 / 12, 1e-12);
    CHECK_NEAR(a.fair, 0.5, 1e-12);
    CHECK_NEAR(a.queue_s, 100e-6, 1e-12);
    CHECK_NEAR(a.compute_s, 2100e-6, 1e-12);
    CHECK_NEAR(a.network_s, 800e-6, 1e-12);
    CHECK_NEAR(b.network_s, 150e-6, 1e-12);
    CHECK_NEAR(a.rtt_s, 3e-3, 1e-12);
    CHECK_EQ_INT(a.errors, 1);
    CHECK_EQ_INT(b.timeouts, 1);
    CHECK_EQ_INT(b.stale, 1);
    CHECK_EQ_INT(a.slowest, 1);
    CHECK_EQ_INT(b.slowest, 1);
    CHECK_EQ_INT(a.up, 1);
    CHECK_EQ_INT(b.up, 0);
    /* two observations 1 ms and 2 ms: p50 in the bucket of 1 ms */
    CHECK(a.rtt_p50 > 1e-3 / 1.19 && a.rtt_p50 < 1e-3 * 1.19);
    CHECK(a.rtt_p99 <= 2e-3 + 1e-12 && a.rtt_p99 > 2e-3 / 1.19);
    CHECK_NEAR(shoal_cmetrics_layer_imbalance(cm, 1), 1.5, 1e-12);
    CHECK_NEAR(shoal_cmetrics_layer_imbalance(cm, 2), 1.25, 1e-12);
    CHECK_NEAR(shoal_cmetrics_layer_imbalance(cm, 0), 0, 0);
    shoal_cmetrics_close(cm);
}

typedef struct {
    int found;
    double v;
    const char *name, *k1, *v1, *k2, *v2, *k3, *v3;
} find_ctx;

static int find(void *ctx, const shoal_metrics_parsed *s)
{
    find_ctx *c = ctx;
    if (strcmp(s->name, c->name))
        return 0;
    if (c->k1 && (!shoal_metrics_label_get(s, c->k1) || strcmp(shoal_metrics_label_get(s, c->k1), c->v1)))
        return 0;
    if (c->k2 && (!shoal_metrics_label_get(s, c->k2) || strcmp(shoal_metrics_label_get(s, c->k2), c->v2)))
        return 0;
    if (c->k3 && (!shoal_metrics_label_get(s, c->k3) || strcmp(shoal_metrics_label_get(s, c->k3), c->v3)))
        return 0;
    c->found++;
    c->v = s->value;
    return 0;
}

static double get(const shoal_metrics_buf *b, const char *name, const char *k1, const char *v1, const char *k2,
                  const char *v2)
{
    find_ctx c = {0, NAN, name, k1, v1, k2, v2, NULL, NULL};
    if (k2 && !strcmp(k2, "quantile")) { /* per-layer quantiles: layer 2 */
        c.k3 = "layer";
        c.v3 = "2";
    }
    char err[128];
    CHECK_EQ_INT(shoal_metrics_parse(b->p, b->len, find, &c, err, sizeof err), 0);
    CHECK_MSG(c.found == 1, "%s %s=%s: %d samples", name, k1 ? k1 : "", v1 ? v1 : "", c.found);
    return c.v;
}

static void t_exposition(void)
{
    shoal_cmetrics *cm = build();
    if (!cm)
        return;
    shoal_metrics_buf b = {0};
    shoal_cmetrics_write(cm, &b);
    CHECK_NEAR(get(&b, "shoal_forward_tokens_total", NULL, NULL, NULL, NULL), 3, 0);
    CHECK_NEAR(get(&b, "shoal_phase_seconds_total", "phase", "experts", NULL, NULL), 0.0015, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_pairs_total", "worker", "a", NULL, NULL), 8, 0);
    CHECK_NEAR(get(&b, "shoal_worker_pairs_total", "worker", "b\"x", NULL, NULL), 4, 0);
    CHECK_NEAR(get(&b, "shoal_worker_load_share", "worker", "a", NULL, NULL), 8.0 / 12, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_fair_share", "worker", "b\"x", NULL, NULL), 0.5, 0);
    CHECK_NEAR(get(&b, "shoal_worker_network_seconds_total", "worker", "a", NULL, NULL), 800e-6, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_weight_bytes_total", "worker", "a", NULL, NULL), 5000, 0);
    CHECK_NEAR(get(&b, "shoal_worker_sent_bytes_total", "worker", "b\"x", NULL, NULL), 150, 0);
    CHECK_NEAR(get(&b, "shoal_worker_received_bytes_total", "worker", "b\"x", NULL, NULL), 160, 0);
    CHECK_NEAR(get(&b, "shoal_worker_timeouts_total", "worker", "b\"x", NULL, NULL), 1, 0);
    CHECK_NEAR(get(&b, "shoal_worker_up", "worker", "b\"x", NULL, NULL), 0, 0);
    CHECK_NEAR(get(&b, "shoal_layer_imbalance", "layer", "2", NULL, NULL), 1.25, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_layer_pairs_total", "worker", "a", "layer", "2"), 5, 0);
    CHECK_NEAR(get(&b, "shoal_worker_rtt_seconds_count", "worker", "a", NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_worker_rtt_seconds_sum", "worker", "a", NULL, NULL), 0.003, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_layer_rtt_seconds_count", "worker", "b\"x", "layer", "2"), 1, 0);
    double p50 = get(&b, "shoal_worker_layer_rtt_seconds", "worker", "b\"x", "quantile", "0.5");
    CHECK(p50 > 4e-3 / 1.19 && p50 <= 4e-3);
    CHECK_NEAR(get(&b, "shoal_layer_wait_seconds_count", "layer", "1", NULL, NULL), 1, 0);
    CHECK_NEAR(get(&b, "shoal_worker_info", "worker", "a", "endpoint", "ipc:///tmp/a"), 1, 0);
    /* trunk rows apart from the expert exchanges */
    CHECK_NEAR(get(&b, "shoal_worker_requests_total", "worker", "a", NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_requests_total", "worker", "a", NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_requests_total", "worker", "b\"x", NULL, NULL), 0, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_rows_total", "worker", "a", NULL, NULL), 28, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_weight_bytes_total", "worker", "a", NULL, NULL), 4000, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_sent_bytes_total", "worker", "a", NULL, NULL), 70, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_received_bytes_total", "worker", "a", NULL, NULL), 148, 0);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_queue_seconds_total", "worker", "a", NULL, NULL), 100e-6, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_compute_seconds_total", "worker", "a", NULL, NULL), 850e-6, 1e-15);
    CHECK_NEAR(get(&b, "shoal_worker_trunk_network_seconds_total", "worker", "a", NULL, NULL), 200e-6, 1e-15);
    /* the expert network time is unchanged by them (800 µs, as above) */
    CHECK_NEAR(get(&b, "shoal_worker_network_seconds_total", "worker", "a", NULL, NULL), 800e-6, 1e-15);
    /* failover */
    CHECK_NEAR(get(&b, "shoal_failovers_total", NULL, NULL, NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_failover_resent_pairs_total", NULL, NULL, NULL, NULL), 5, 0);
    CHECK_NEAR(get(&b, "shoal_failover_seconds_count", NULL, NULL, NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_failover_seconds_sum", NULL, NULL, NULL, NULL), 0.4, 1e-12);
    CHECK_NEAR(get(&b, "shoal_failover_takeover_pairs_total", "from", "b\"x", "to", "a"), 5, 0);
    CHECK(!strstr(b.p, "shoal_failover_takeover_pairs_total{from=\"a\""));
    CHECK_NEAR(get(&b, "shoal_worker_failovers_total", "worker", "b\"x", NULL, NULL), 2, 0);
    CHECK_NEAR(get(&b, "shoal_worker_failovers_total", "worker", "a", NULL, NULL), 0, 0);
    CHECK_NEAR(get(&b, "shoal_worker_lost_pairs_total", "worker", "b\"x", NULL, NULL), 5, 0);
    CHECK_NEAR(get(&b, "shoal_worker_takeover_pairs_total", "worker", "a", NULL, NULL), 5, 0);
    CHECK_NEAR(get(&b, "shoal_worker_replica_picks_total", "worker", "a", NULL, NULL), 4, 0);
    CHECK_NEAR(get(&b, "shoal_worker_replica_picks_total", "worker", "b\"x", NULL, NULL), 1, 0);
    /* no layer 0 (dense) series */
    CHECK(!strstr(b.p, "layer=\"0\""));
    shoal_metrics_buf_free(&b);

    /* the report names the figures too */
    char *txt = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&txt, &len);
    shoal_cmetrics_report(cm, f, NULL);
    fclose(f);
    CHECK_STR_CONTAINS(txt, "over 3 forward tokens");
    CHECK_STR_CONTAINS(txt, "attention      1.0000"); /* 3 ms / 3 tokens */
    CHECK_STR_CONTAINS(txt, "b\"x");
    free(txt);
    shoal_cmetrics_close(cm);
}

static void t_duplicate_ids(void)
{
    shoal_cmetrics *cm = NULL;
    char err[256];
    shoal_cmetrics_opts o = {.num_layers = 3, .is_moe = is_moe, .num_experts = 4, .max_workers = 2};
    CHECK_EQ_INT(shoal_cmetrics_open(&cm, &o, err, sizeof err), 0);
    shoal_cmetrics_set_worker(cm, 0, "w", "e0", 0, 0, 0);
    shoal_cmetrics_set_worker(cm, 1, "w", "e1", 0, 0, 0);
    shoal_metrics_buf b = {0};
    shoal_cmetrics_write(cm, &b);
    CHECK_STR_CONTAINS(b.p, "shoal_worker_up{worker=\"w\"}");
    CHECK_STR_CONTAINS(b.p, "shoal_worker_up{worker=\"w~1\"}");
    shoal_metrics_buf_free(&b);
    shoal_cmetrics_close(cm);
    shoal_cmetrics_close(NULL);
}

int main(void)
{
    const char *dump = getenv("SHOAL_METRICS_DUMP");
    if (dump) {
        shoal_cmetrics *cm = build();
        shoal_metrics_buf b = {0};
        shoal_cmetrics_write(cm, &b);
        FILE *f = fopen(dump, "w");
        int ok = f && fwrite(b.p, 1, b.len, f) == b.len;
        if (f && fclose(f))
            ok = 0;
        shoal_metrics_buf_free(&b);
        shoal_cmetrics_close(cm);
        return ok && !test_case_failed ? 0 : 1;
    }
    test_binary = "test_cmetrics";
    RUN(t_totals);
    RUN(t_exposition);
    RUN(t_duplicate_ids);
    return test_finish();
}
