/* store: the RAM-budgeted expert store (worker/store.h) on the tiny model --
 * every owned expert fetched through the minimum number of slots has exactly
 * the bytes of the read-only mapping (each tensor compared) and gives a
 * bit-identical shoal_expert_ffn output; O_DIRECT and buffered reads; passes
 * (more experts than slots); counters (hits, misses, bytes); a budget below
 * the minimum refused naming the minimum; experts not owned refused. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "common/log.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "proto/shard.h"
#include "tests/unit/test.h"
#include "worker/bank.h"
#include "worker/store.h"

typedef struct {
    shoal_k3cfg cfg;
    shoal_st *st_map, *st_hdr;
    shoal_proto_range *ranges;
    size_t nranges;
    shoal_shard *own;
    shoal_bank *bank;
} fixture;

static int fx_open(fixture *x, const char *ranges)
{
    char err[512], path[4096];
    const char *model = test_src_path("tests/models/tiny-k3");
    snprintf(path, sizeof path, "%s/config.json", model);
    memset(x, 0, sizeof *x);
    if (shoal_k3cfg_load(&x->cfg, path, err, sizeof err))
        return -1;
    shoal_st_opts m1 = {.map = 1}, m0 = {.map = 0};
    if (shoal_st_open(&x->st_map, model, &m1, err, sizeof err) || shoal_st_open(&x->st_hdr, model, &m0, err, sizeof err))
        return -1;
    if (shoal_shard_parse(ranges, &x->ranges, &x->nranges, err, sizeof err) ||
        shoal_shard_open(&x->own, x->ranges, x->nranges, x->cfg.num_layers, x->cfg.is_moe, x->cfg.num_experts, err,
                         sizeof err) ||
        shoal_bank_open(&x->bank, x->st_map, &x->cfg, x->own, err, sizeof err))
        return -1;
    return 0;
}

static void fx_close(fixture *x)
{
    shoal_bank_close(x->bank);
    shoal_shard_close(x->own);
    free(x->ranges);
    shoal_st_close(x->st_map);
    shoal_st_close(x->st_hdr);
}

static size_t wbytes(const shoal_expert_w *w, int which)
{
    size_t rows = which == 2 ? (size_t)w->d : (size_t)w->f, cols = which == 2 ? (size_t)w->f : (size_t)w->d;
    switch (w->kind) {
    case SHOAL_EXPERT_MXFP4: return rows * cols / 2;
    case SHOAL_EXPERT_BF16: return rows * cols * 2;
    default: return rows * cols * 4;
    }
}

static int same_expert(const shoal_expert_w *a, const shoal_expert_w *b)
{
    if (a->kind != b->kind || a->d != b->d || a->f != b->f)
        return 0;
    if (memcmp(a->w1, b->w1, wbytes(a, 1)) || memcmp(a->w3, b->w3, wbytes(a, 3)) || memcmp(a->w2, b->w2, wbytes(a, 2)))
        return 0;
    if (a->kind == SHOAL_EXPERT_MXFP4) {
        size_t s13 = (size_t)a->f * (size_t)a->d / 32, s2 = (size_t)a->d * (size_t)a->f / 32;
        if (memcmp(a->w1_scale, b->w1_scale, s13) || memcmp(a->w3_scale, b->w3_scale, s13) ||
            memcmp(a->w2_scale, b->w2_scale, s2))
            return 0;
    }
    return 1;
}

static void check_all(fixture *x, int no_direct)
{
    char err[512];
    uint64_t sb;
    uint32_t mins;
    CHECK_EQ_INT(shoal_store_plan(x->st_hdr, &x->cfg, x->own, &sb, &mins, err, sizeof err), 0);
    CHECK_EQ_INT((int)mins, x->cfg.experts_per_token);
    shoal_store *s = NULL;
    shoal_store_opts o = {.slots = mins, .policy = SHOAL_CACHEPOL_LFU, .io_threads = 3, .no_direct = no_direct};
    int rc = shoal_store_open(&s, x->st_hdr, &x->cfg, x->own, &o, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    shoal_store_stats st;
    shoal_store_stats_get(s, &st);
    CHECK_EQ_INT((int)st.slots, (int)mins);
    if (no_direct)
        CHECK_EQ_INT(st.direct, 0);
    int d = x->cfg.latent_size, f = x->cfg.moe_intermediate_size, T = 3;
    float *xin = malloc((size_t)T * d * sizeof *xin), *h = malloc(2 * (size_t)T * f * sizeof *h);
    uint16_t *ya = malloc((size_t)T * d * 2), *yb = malloc((size_t)T * d * 2);
    for (int i = 0; i < T * d; i++)
        xin[i] = (float)((i * 37) % 101 - 50) / 25.0f;
    int E = x->cfg.num_experts, bad = 0, fetched = 0;
    int32_t *ids = malloc((size_t)E * sizeof *ids);
    const shoal_expert_w **views = malloc((size_t)E * sizeof *views);
    for (int l = 0; l < x->cfg.num_layers; l++) {
        int n = 0;
        for (int e = 0; e < E; e++)
            if (shoal_bank_get(x->bank, l, e))
                ids[n++] = e;
        for (int i = 0; i < n;) { /* passes of at most `slots` experts */
            int got = shoal_store_fetch(s, l, ids + i, n - i, views, err, sizeof err);
            CHECK_MSG(got >= 1 && got <= (int)mins, "fetch: %d %s", got, err);
            if (got < 1)
                break;
            for (int j = 0; j < got; j++) {
                CHECK_EQ_INT(shoal_store_wait(s, j, err, sizeof err), 0);
                const shoal_expert_w *w = shoal_bank_get(x->bank, l, ids[i + j]);
                bad += !same_expert(views[j], w);
                shoal_expert_ffn(ya, w, xin, T, x->cfg.situ_beta, x->cfg.situ_linear_beta, h);
                shoal_expert_ffn(yb, views[j], xin, T, x->cfg.situ_beta, x->cfg.situ_linear_beta, h);
                bad += memcmp(ya, yb, (size_t)T * d * 2) != 0;
                fetched++;
            }
            i += got;
        }
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(fetched > 0);
    shoal_store_stats_get(s, &st);
    /* each expert once, more experts than slots: all misses, each read a slot's spans */
    CHECK_EQ_INT((int)st.misses, fetched);
    CHECK_EQ_INT((int)st.hits, 0);
    CHECK(st.bytes_read >= (uint64_t)fetched * st.expert_bytes && st.bytes_read <= (uint64_t)fetched * st.slot_bytes);
    /* the same experts again within one pass: hits, no reads */
    int l1 = -1;
    for (int l = 0; l < x->cfg.num_layers && l1 < 0; l++)
        if (x->cfg.is_moe[l])
            l1 = l;
    int32_t two[2] = {ids[0], ids[1]};
    uint64_t before = st.bytes_read;
    (void)shoal_store_fetch(s, l1, two, 2, views, err, sizeof err);
    CHECK_EQ_INT(shoal_store_fetch(s, l1, two, 2, views, err, sizeof err), 2);
    CHECK_EQ_INT(shoal_store_wait(s, 1, err, sizeof err), 0); /* out of order is fine */
    CHECK_EQ_INT(shoal_store_wait(s, 0, err, sizeof err), 0);
    CHECK(shoal_store_wait(s, 2, err, sizeof err) == SHOAL_EINVAL);
    shoal_store_stats_get(s, &st);
    CHECK(st.hits >= 2);
    CHECK(st.bytes_read <= before + 2 * st.slot_bytes);
    free(xin), free(h), free(ya), free(yb), free(ids), free(views);
    shoal_store_close(s);
}

static void t_bytes_and_outputs(void)
{
    fixture x;
    if (fx_open(&x, "1-8:0-23")) {
        fx_close(&x);
        SKIP("tests/models/tiny-k3 not loadable");
    }
    check_all(&x, 0);
    check_all(&x, 1);
    fx_close(&x);
}

static void t_refusals(void)
{
    fixture x;
    if (fx_open(&x, "1-8:0-11")) {
        fx_close(&x);
        SKIP("tests/models/tiny-k3 not loadable");
    }
    char err[512];
    shoal_store *s = NULL;
    uint64_t sb;
    uint32_t mins;
    CHECK_EQ_INT(shoal_store_plan(x.st_hdr, &x.cfg, x.own, &sb, &mins, err, sizeof err), 0);
    shoal_store_opts o = {.cache_bytes = (mins - 1) * sb, .policy = SHOAL_CACHEPOL_LRU};
    CHECK_EQ_INT(shoal_store_open(&s, x.st_hdr, &x.cfg, x.own, &o, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "minimum");
    char want[64];
    snprintf(want, sizeof want, "%llu bytes", (unsigned long long)mins * sb);
    CHECK_STR_CONTAINS(err, want);
    CHECK(s == NULL);
    o.cache_bytes = mins * sb;
    CHECK_EQ_INT(shoal_store_open(&s, x.st_hdr, &x.cfg, x.own, &o, err, sizeof err), 0);
    const shoal_expert_w *v[2];
    CHECK(x.cfg.experts_per_token > 0);
    int32_t notmine[1] = {12};
    CHECK_EQ_INT(shoal_store_fetch(s, 1, notmine, 1, v, err, sizeof err), SHOAL_ERANGE);
    /* a request mixing an owned expert with one not owned: refused before any
     * slot is handed out (a slot handed out and not filled would later be a
     * "hit" on garbage) */
    int32_t mixed[2] = {3, 12};
    CHECK_EQ_INT(shoal_store_fetch(s, 1, mixed, 2, v, err, sizeof err), SHOAL_ERANGE);
    shoal_store_stats st0;
    shoal_store_stats_get(s, &st0);
    CHECK_EQ_INT((int)(st0.hits + st0.misses), 0);
    int32_t three[1] = {3};
    CHECK_EQ_INT(shoal_store_fetch(s, 1, three, 1, v, err, sizeof err), 1);
    CHECK_EQ_INT(shoal_store_wait(s, 0, err, sizeof err), 0);
    shoal_store_stats_get(s, &st0);
    CHECK_EQ_INT((int)st0.misses, 1);
    {
        const shoal_expert_w *bw = shoal_bank_get(x.bank, 1, 3);
        CHECK(v[0]->w1 && bw && !memcmp(v[0]->w1, bw->w1, (size_t)bw->f * (size_t)bw->d / 2));
    }
    int32_t dense[1] = {0};
    CHECK_EQ_INT(shoal_store_fetch(s, 0, dense, 1, v, err, sizeof err), SHOAL_ERANGE); /* layer 0 is dense */
    CHECK(shoal_store_owns(s, 1, 11) && !shoal_store_owns(s, 1, 12));
    shoal_store_close(s);
    /* a huge budget is capped at the experts owned */
    o.cache_bytes = 1ull << 40;
    CHECK_EQ_INT(shoal_store_open(&s, x.st_hdr, &x.cfg, x.own, &o, err, sizeof err), 0);
    shoal_store_stats st;
    shoal_store_stats_get(s, &st);
    CHECK_EQ_INT((int)st.slots, 8 * 12);
    shoal_store_close(s);
    fx_close(&x);
}

/* Fetch experts[n] of layer l through the store (in passes), checking every
 * view against the mapped bank; returns the mismatches (-1: a call failed). */
static int fetch_check(fixture *x, shoal_store *s, int l, const int32_t *ids, int n)
{
    char err[512];
    const shoal_expert_w *views[64];
    int bad = 0;
    for (int i = 0; i < n;) {
        int got = shoal_store_fetch(s, l, ids + i, n - i, views, err, sizeof err);
        if (got < 1)
            return -1;
        for (int j = 0; j < got; j++) {
            if (shoal_store_wait(s, j, err, sizeof err))
                return -1;
            bad += !same_expert(views[j], shoal_bank_get(x->bank, l, ids[i + j]));
        }
        i += got;
    }
    return bad;
}

/* Prefetch hints: hinted experts read ahead are prefetch hits (not resident
 * hits, not misses) with the mapped bytes; a second use is a resident hit;
 * hinted experts evicted unused are counted wasted; ids not owned or out of
 * range are skipped; a fetch right after a hint, with every slot still being
 * filled by the hint's reads, waits for them and gets the right bytes. */
static void t_prefetch(void)
{
    fixture x;
    if (fx_open(&x, "1-8:0-17")) {
        fx_close(&x);
        SKIP("tests/models/tiny-k3 not loadable");
    }
    char err[512];
    uint64_t sb;
    uint32_t mins;
    CHECK_EQ_INT(shoal_store_plan(x.st_hdr, &x.cfg, x.own, &sb, &mins, err, sizeof err), 0);
    int k = (int)mins;
    CHECK(k >= 2 && 3 * k <= 18);
    if (k < 2 || 3 * k > 18) {
        fx_close(&x);
        return;
    }
    for (int pol = 0; pol < 2; pol++) {
        shoal_store *s = NULL;
        shoal_store_opts o = {.slots = 2 * mins, .policy = pol ? SHOAL_CACHEPOL_LFU : SHOAL_CACHEPOL_LRU,
                              .io_threads = 3};
        CHECK_EQ_INT(shoal_store_open(&s, x.st_hdr, &x.cfg, x.own, &o, err, sizeof err), 0);
        if (!s)
            break;
        int32_t a[18], b[18], c[18];
        for (int i = 0; i < k; i++)
            a[i] = i, b[i] = k + i, c[i] = 2 * k + i;
        /* hint A, then use it */
        CHECK_EQ_INT(shoal_store_prefetch(s, 2, a, k), k);
        CHECK_EQ_INT(fetch_check(&x, s, 2, a, k), 0);
        shoal_store_stats st;
        shoal_store_stats_get(s, &st);
        CHECK_EQ_INT((int)st.prefetch_hits, k);
        CHECK_EQ_INT((int)st.hits, 0);
        CHECK_EQ_INT((int)st.misses, 0);
        CHECK_EQ_INT((int)st.prefetch_reads, k);
        CHECK(st.bytes_read == 0 && st.prefetch_bytes >= (uint64_t)k * st.expert_bytes);
        /* used again: resident hits; hinting resident experts reads nothing */
        CHECK_EQ_INT(shoal_store_prefetch(s, 2, a, k), 0);
        CHECK_EQ_INT(fetch_check(&x, s, 2, a, k), 0);
        shoal_store_stats_get(s, &st);
        CHECK_EQ_INT((int)st.hits, k);
        CHECK_EQ_INT((int)st.prefetch_hits, k);
        /* hint B (fills the other k slots), then C, which evicts B unused: wasted */
        CHECK_EQ_INT(shoal_store_prefetch(s, 2, b, k), k);
        shoal_store_drain(s);
        CHECK_EQ_INT(shoal_store_prefetch(s, 2, c, k), k);
        shoal_store_drain(s);
        shoal_store_stats_get(s, &st);
        CHECK_EQ_INT((int)st.prefetch_reads, 3 * k);
        /* C's k reads evict k of A and B (2k slots): LRU the least recently
         * stamped, A (used before B was hinted); LFU the fewest uses, B (none,
         * A twice) -- B's k hinted experts are then wasted */
        CHECK_EQ_INT((int)st.prefetch_wasted, pol ? k : 0);
        CHECK_EQ_INT(fetch_check(&x, s, 2, c, k), 0);
        shoal_store_stats_get(s, &st);
        CHECK_EQ_INT((int)st.prefetch_hits, 2 * k);
        /* not owned (18..23 are not), out of range, negative: skipped */
        int32_t odd[3] = {-1, 18, 999};
        CHECK_EQ_INT(shoal_store_prefetch(s, 2, odd, 3), 0);
        CHECK_EQ_INT(shoal_store_prefetch(s, 0, a, k), 0); /* dense layer: nothing owned */
        CHECK_EQ_INT(shoal_store_prefetch(s, 99, a, k), 0);
        shoal_store_close(s);
    }
    /* the minimum cache: a hint takes every slot; the next fetch (other
     * experts) finds every slot still being filled, waits, and is right */
    for (int rep = 0; rep < 20; rep++) {
        shoal_store *s = NULL;
        shoal_store_opts o = {.slots = mins, .policy = SHOAL_CACHEPOL_LFU, .io_threads = 2};
        CHECK_EQ_INT(shoal_store_open(&s, x.st_hdr, &x.cfg, x.own, &o, err, sizeof err), 0);
        if (!s)
            break;
        int32_t a[18], b[18];
        for (int i = 0; i < k; i++)
            a[i] = i, b[i] = k + i;
        CHECK_EQ_INT(shoal_store_prefetch(s, 3, a, k), k);
        CHECK_EQ_INT(fetch_check(&x, s, 3, b, k), 0); /* waits for slots as A's reads land, in passes */
        shoal_store_drain(s); /* A's last reads may still be landing: the counts below are then exact */
        CHECK_EQ_INT(shoal_store_prefetch(s, 4, b, k), k);
        CHECK_EQ_INT(fetch_check(&x, s, 4, b, k), 0); /* hinted: prefetch hits, maybe still in flight */
        CHECK_EQ_INT(fetch_check(&x, s, 3, a, k), 0);
        shoal_store_stats st;
        shoal_store_stats_get(s, &st);
        CHECK_EQ_INT((int)st.prefetch_hits, k);
        CHECK_EQ_INT((int)(st.prefetch_wasted), k); /* A evicted unused by the fetch of B */
        shoal_store_close(s);
    }
    fx_close(&x);
}

int main(void)
{
    test_binary = "test_store";
    shoal_log_set_level(SHOAL_LOG_ERROR);
    shoal_kernels_init();
    RUN(t_bytes_and_outputs);
    RUN(t_refusals);
    RUN(t_prefetch);
    return test_finish();
}
