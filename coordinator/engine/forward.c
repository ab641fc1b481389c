/* The K3 forward of one chunk (SPEC §3), engine numerics of §3.9: fp32 from
 * the stored values, AttnRes prefix sums in fp32, routed-expert outputs
 * rounded to bf16 (by the expert kernel).
 *
 * Batched prefill and token-by-token decode are bit-identical because every
 * per-token value is produced by the same sequence of operations either way:
 * the matrix kernels give each output row independently of T (kernels.h), and
 * everything else here is a per-token loop over that token's own row, or, for
 * the recurrent KDA state and the MLA cache, a loop over tokens in chunk order.
 * Nothing here sums across tokens. */
#include <math.h>
#include <string.h>
#include <time.h>

#include <omp.h>

#include "common/err.h"
#include "coordinator/engine/engine_int.h"
#include "kernels/kernels.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Monitoring: charge the time since the previous mark to phase ph (nothing
 * without a cmetrics object; two clock reads per mark, no allocation). */
static inline void mark(shoal_model *m, shoal_cmetrics_phase ph)
{
    if (!m->cm)
        return;
    uint64_t t = shoal_metrics_now_ns();
    shoal_cmetrics_add_phase(m->cm, ph, t - m->t_mark);
    m->t_mark = t;
}

static size_t max_z(size_t a, size_t b)
{
    return a > b ? a : b;
}

static int nblocks_max(const shoal_k3cfg *c)
{
    int n = 0;
    for (int L = 0; L < c->num_layers; L++)
        n += c->block_start[L] ? 1 : 0;
    return n;
}

/* Widths of the per-layer work area, per token. */
static size_t work_width(const shoal_k3cfg *c)
{
    size_t C = (size_t)c->kda_heads * c->kda_head_dim;
    size_t qdim = (size_t)c->mla_heads * (c->qk_nope_dim + c->qk_rope_dim);
    size_t mla_o = (size_t)c->mla_heads * c->v_head_dim;
    size_t kv = (size_t)c->kv_lora_rank + c->qk_rope_dim;
    size_t fshared = (size_t)c->num_shared_experts * c->moe_intermediate_size;
    /* KDA: q~, k~, v~, G, z, o, o', f_a out (rank = f_a rows = kda_head_dim), beta logits */
    size_t kda = c->num_kda ? 7 * C + (size_t)c->kda_head_dim + (size_t)c->kda_heads : 0;
    /* MLA: q_a out, q, c_kv, G, o */
    size_t mla = c->num_mla ? (size_t)c->q_lora_rank + qdim + kv + 2 * mla_o : 0;
    size_t dense = 2 * (size_t)c->intermediate_size;
    /* MoE: router logits, z, r, shared gate + up, r_up */
    size_t moe = c->num_moe ? (size_t)c->num_experts + 2 * (size_t)c->latent_size + 2 * fshared + (size_t)c->hidden_size
                            : 0;
    return max_z(max_z(kda, mla), max_z(dense, moe));
}

size_t shoal__engine_scratch_layout(shoal__scratch *sc, float *base, const shoal_k3cfg *c, int Tmax,
                                    int max_context)
{
    size_t off = 0;
    size_t T = (size_t)Tmax, d = (size_t)c->hidden_size;
    size_t C = (size_t)c->kda_heads * c->kda_head_dim;
#define TAKE(field, n)                                                                  \
    do {                                                                                \
        sc->field = base ? (void *)(base + off) : NULL;                                 \
        off += ((size_t)(n) + 15) & ~(size_t)15; /* 64-byte granules keep rows aligned */ \
    } while (0)
    sc->work_w = (work_width(c) + 15) & ~(size_t)15;
    TAKE(P, T * d);
    TAKE(blocks, (size_t)nblocks_max(c) * T * d);
    TAKE(x, T * d);
    TAKE(xn, T * d);
    TAKE(a, T * d);
    TAKE(work, T * sc->work_w);
    TAKE(tq, C);
    TAKE(tk, C);
    TAKE(tv, C);
    TAKE(tg, C);
    TAKE(beta, c->kda_heads);
    /* MLA attention runs on blocks of up to SHOAL_MLA_TBLOCK tokens of one sequence */
    size_t tb = T < SHOAL_MLA_TBLOCK ? T : SHOAL_MLA_TBLOCK;
    TAKE(q_lat, tb * c->mla_heads * c->kv_lora_rank);
    TAKE(ctx, tb * c->mla_heads * c->kv_lora_rank);
    TAKE(q_pe, tb * c->mla_heads * c->qk_rope_dim);
    TAKE(att, tb * c->mla_heads * (size_t)max_context);
    TAKE(res_s, nblocks_max(c) + 1);
    TAKE(rsig, 2 * (size_t)c->num_experts);
    TAKE(tpos, T);
    TAKE(seen, c->num_experts);
#undef TAKE
    return off;
}

/* y[T, rows] = x[T, cols] · W^T for W as stored. */
static void mm(float *y, const shoal__wmat *w, const float *x, int T)
{
    if (w->dt == SHOAL_DT_BF16)
        shoal_gemm_bf16(y, (const uint16_t *)w->p, x, w->rows, w->cols, T);
    else
        shoal_gemm_f32(y, (const float *)w->p, x, w->rows, w->cols, T);
}

/* The matrices of one step that read the same input x[T, cols]: the
 * remote ones (shoal_model_set_rmat) go out in one request, the local ones
 * are computed while it is on its way, then the request is gathered. Each
 * output is what mm() gives in-process, bit for bit, wherever it runs
 * (rmat.h). One round trip per call when any matrix is remote, none
 * otherwise. */
typedef struct {
    const shoal__wmat *w;
    float *y;
    const shoal__wmat *pre; /* a chained job: y = w(pre(x)), both remote (the layer's fab_chain) */
} mmjob;

static int mm_set(shoal_model *m, int layer, const float *x, int T, const mmjob *j, int n, char *err, size_t errlen)
{
    shoal_rmat_job rj[SHOAL_RMAT_MAX_JOBS];
    int nr = 0;
    for (int i = 0; i < n; i++)
        if (j[i].w->remote)
            rj[nr++] = (shoal_rmat_job){.name = j[i].w->t->name, .rows = j[i].w->rows, .cols = j[i].w->cols,
                                        .y = j[i].y, .pre = j[i].pre ? j[i].pre->t->name : NULL,
                                        .pre_rows = j[i].pre ? j[i].pre->rows : 0,
                                        .pre_cols = j[i].pre ? j[i].pre->cols : 0};
    double t0 = nr ? now_s() : 0.0;
    if (nr) {
        int rc = m->rmat.vt->submit(m->rmat.self, layer, rj, nr, x, T, err, errlen);
        if (rc)
            return rc;
    }
    for (int i = 0; i < n; i++)
        if (!j[i].w->remote)
            mm(j[i].y, j[i].w, x, T);
    if (nr) {
        int rc = m->rmat.vt->gather(m->rmat.self, err, errlen);
        m->stats.rmat_requests++;
        m->stats.rmat_s += now_s() - t0;
        if (rc)
            return rc;
    }
    return 0;
}

static int mm1(shoal_model *m, int layer, float *y, const shoal__wmat *w, const float *x, int T, char *err,
               size_t errlen)
{
    mmjob j = {w, y, NULL};
    return mm_set(m, layer, x, T, &j, 1, err, errlen);
}

/* AttnRes (SPEC §3.2): out = Σ_i softmax(s)_i v_i over V = [blocks 0..nb-1 of
 * token t, p], s_i = Σ_j (v_i[j] / rms(v_i)) · w_norm[j] · w_proj[j]. The mixed
 * values are the raw v_i. fp32 throughout, candidates in list order. */
static void attn_res(float *out, const float *blocks, size_t bstride, int nb, const float *p, const float *wn,
                     const float *wp, int d, float eps, float *s)
{
    for (int i = 0; i <= nb; i++) {
        const float *v = i < nb ? blocks + (size_t)i * bstride : p;
        float ss = 0.0f;
        for (int j = 0; j < d; j++)
            ss += v[j] * v[j];
        float inv = 1.0f / sqrtf(ss / (float)d + eps);
        float acc = 0.0f;
        for (int j = 0; j < d; j++)
            acc += (v[j] * inv) * wn[j] * wp[j];
        s[i] = acc;
    }
    shoal_softmax(s, nb + 1);
    for (int j = 0; j < d; j++)
        out[j] = 0.0f;
    for (int i = 0; i <= nb; i++) {
        const float *v = i < nb ? blocks + (size_t)i * bstride : p;
        float ai = s[i];
        for (int j = 0; j < d; j++)
            out[j] += ai * v[j];
    }
}

/* ---- KDA (SPEC §3.3) ---------------------------------------------------- */

static int kda_layer(shoal_model *m, const shoal__layer *ly, int L, shoal_seq *const *seqs, int T, char *err,
                     size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    shoal__scratch *sc = &m->sc;
    int H = c->kda_heads, D = c->kda_head_dim, K = c->conv_kernel;
    size_t C = (size_t)H * D;
    float *qt = sc->work, *kt = qt + (size_t)T * C, *vt = kt + (size_t)T * C, *G = vt + (size_t)T * C;
    float *z = G + (size_t)T * C, *o = z + (size_t)T * C, *on = o + (size_t)T * C;
    float *fa = on + (size_t)T * C, *bl = fa + (size_t)T * ly->f_a.rows;
    const float *xn = sc->xn;

    int rc;
    if (ly->fab_chain) { /* f_b(f_a(xn)) computed on the trunk servers in the same round trip */
        mmjob j[] = {{&ly->q_proj, qt, NULL}, {&ly->k_proj, kt, NULL}, {&ly->v_proj, vt, NULL},
                     {&ly->g_proj, G, NULL},  {&ly->b_proj, bl, NULL}, {&ly->f_b, z, &ly->f_a}};
        if ((rc = mm_set(m, L, xn, T, j, 6, err, errlen)))
            return rc;
    } else {
        mmjob j[] = {{&ly->q_proj, qt, NULL}, {&ly->k_proj, kt, NULL}, {&ly->v_proj, vt, NULL},
                     {&ly->g_proj, G, NULL},  {&ly->f_a, fa, NULL},    {&ly->b_proj, bl, NULL}};
        if ((rc = mm_set(m, L, xn, T, j, 6, err, errlen)))
            return rc;
        if ((rc = mm1(m, L, z, &ly->f_b, fa, T, err, errlen)))
            return rc;
    }

    const float qscale = 1.0f / sqrtf((float)D);
    size_t win = (size_t)(K - 1) * C;
    for (int t = 0; t < T; t++) {
        shoal_seq *s = seqs[t];
        float *S = s->kda_S + (size_t)ly->kda_idx * H * (size_t)D * D;
        float *w = s->kda_conv + (size_t)ly->kda_idx * 3 * win;
        int ckj = s->ck_arm ? sc->tpos[t] - s->ck_base : -1; /* shoal_seq_verify: keep what a rewind needs */
        if (ckj == 0) {
            memcpy(s->ck_S0 + (size_t)ly->kda_idx * H * (size_t)D * D, S, sizeof(float) * H * (size_t)D * D);
            memcpy(s->ck_conv0 + (size_t)ly->kda_idx * 3 * win, w, sizeof(float) * 3 * win);
        }
        if (ckj >= 0 && ckj < s->ck_cap) {
            float *r = s->ck_tok + ((size_t)ckj * c->num_kda + (size_t)ly->kda_idx) * s->ck_tok_w + 4 * C + H;
            memcpy(r, qt + (size_t)t * C, sizeof(float) * C);
            memcpy(r + C, kt + (size_t)t * C, sizeof(float) * C);
            memcpy(r + 2 * C, vt + (size_t)t * C, sizeof(float) * C);
        }
        shoal_kda_conv_step(sc->tq, w, qt + (size_t)t * C, ly->q_conv, (int)C, K);
        shoal_kda_conv_step(sc->tk, w + win, kt + (size_t)t * C, ly->k_conv, (int)C, K);
        shoal_kda_conv_step(sc->tv, w + 2 * win, vt + (size_t)t * C, ly->v_conv, (int)C, K);
        for (int h = 0; h < H; h++) {
            shoal_l2norm(sc->tq + (size_t)h * D, D, 1e-6f);
            shoal_l2norm(sc->tk + (size_t)h * D, D, 1e-6f);
        }
        for (size_t i = 0; i < C; i++)
            sc->tq[i] *= qscale;
        shoal_kda_gate(sc->tg, z + (size_t)t * C, ly->A_log, ly->dt_bias, H, D, c->gate == SHOAL_GATE_LOWER_BOUND,
                       c->gate_lower_bound);
        for (int h = 0; h < H; h++)
            sc->beta[h] = shoal_sigmoid(bl[(size_t)t * H + h]);
        if (ckj >= 0 && ckj < s->ck_cap) {
            float *r = s->ck_tok + ((size_t)ckj * c->num_kda + (size_t)ly->kda_idx) * s->ck_tok_w;
            memcpy(r, sc->tq, sizeof(float) * C);
            memcpy(r + C, sc->tk, sizeof(float) * C);
            memcpy(r + 2 * C, sc->tv, sizeof(float) * C);
            memcpy(r + 3 * C, sc->tg, sizeof(float) * C);
            memcpy(r + 4 * C, sc->beta, sizeof(float) * H);
        }
        shoal_kda_step(o + (size_t)t * C, S, sc->tq, sc->tk, sc->tv, sc->tg, sc->beta, H, D);
        shoal_gated_rmsnorm(on + (size_t)t * C, o + (size_t)t * C, G + (size_t)t * C, ly->o_norm, H, D,
                            c->rms_norm_eps);
    }
    return mm1(m, L, sc->a, &ly->o_proj, on, T, err, errlen);
}

/* ---- gated NoPE MLA, absorbed (SPEC §3.4) -------------------------------- */

static int mla_layer(shoal_model *m, const shoal__layer *ly, int L, shoal_seq *const *seqs, int T, char *err,
                     size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    shoal__scratch *sc = &m->sc;
    int Hm = c->mla_heads, dn = c->qk_nope_dim, dr = c->qk_rope_dim, dv = c->v_head_dim, R = c->kv_lora_rank;
    int qr = c->q_lora_rank, qh = dn + dr, row = R + dr;
    size_t qdim = (size_t)Hm * qh, od = (size_t)Hm * dv;
    float *qa = sc->work, *q = qa + (size_t)T * qr, *ckv = q + (size_t)T * qdim, *G = ckv + (size_t)T * row;
    float *o = G + (size_t)T * od;
    const float *xn = sc->xn;

    int rc;
    {
        mmjob j[] = {{&ly->q_a, qa, NULL}, {&ly->kv_a, ckv, NULL}, {&ly->g_proj, G, NULL}};
        if ((rc = mm_set(m, L, xn, T, j, 3, err, errlen)))
            return rc;
    }
    for (int t = 0; t < T; t++)
        shoal_rmsnorm(qa + (size_t)t * qr, qa + (size_t)t * qr, ly->q_a_norm, qr, 1e-6f);
    if ((rc = mm1(m, L, q, &ly->q_b, qa, T, err, errlen)))
        return rc;
    /* cache rows first: token t attends to positions 0..tpos[t] of its own
     * sequence, which includes earlier tokens of this chunk */
    for (int t = 0; t < T; t++) {
        float *r = ckv + (size_t)t * row;
        shoal_rmsnorm(r, r, ly->kv_a_norm, R, 1e-6f);
        shoal_seq *s = seqs[t];
        float *dst = s->mla + ((size_t)ly->mla_idx * s->capacity + (size_t)sc->tpos[t]) * row;
        memcpy(dst, r, sizeof(float) * (size_t)row);
    }
    const float scale = 1.0f / sqrtf((float)qh);
    const shoal__wmat *kvb = &ly->kv_b;
    size_t esz = kvb->dt == SHOAL_DT_BF16 ? 2 : 4;
    size_t HR = (size_t)Hm * R, HP = (size_t)Hm * dr;
    for (int t0 = 0; t0 < T;) {
        /* a block of tokens of one sequence at consecutive positions (a
         * prefill chunk; one token in decode): the batched attention walks
         * the cache once per block, and equals the per-token form bit for bit */
        shoal_seq *s = seqs[t0];
        int n = 1;
        while (t0 + n < T && n < SHOAL_MLA_TBLOCK && seqs[t0 + n] == s && sc->tpos[t0 + n] == sc->tpos[t0] + n)
            n++;
        for (int j = 0; j < n; j++) {
            const float *qt = q + (size_t)(t0 + j) * qdim;
            float *ql = sc->q_lat + j * HR, *qp = sc->q_pe + j * HP;
            /* q_lat[h] = W_UK_h^T q_nope_h: W_UK_h = kv_b rows [h*(dn+dv), +dn) */
#pragma omp parallel for schedule(static)
            for (int h = 0; h < Hm; h++) {
                const char *wuk = (const char *)kvb->p + (size_t)h * (dn + dv) * R * esz;
                if (kvb->dt == SHOAL_DT_BF16)
                    shoal_gemv_t_bf16(ql + (size_t)h * R, (const uint16_t *)wuk, qt + (size_t)h * qh, dn, R);
                else
                    shoal_gemv_t_f32(ql + (size_t)h * R, (const float *)wuk, qt + (size_t)h * qh, dn, R);
                memcpy(qp + (size_t)h * dr, qt + (size_t)h * qh + dn, sizeof(float) * (size_t)dr);
            }
        }
        const float *cache = s->mla + (size_t)ly->mla_idx * s->capacity * row;
        shoal_mla_attend_prefill(sc->ctx, sc->q_lat, sc->q_pe, cache, sc->tpos[t0], n, Hm, R, dr, scale, sc->att);
        for (int j = 0; j < n; j++) {
            float *ot = o + (size_t)(t0 + j) * od;
            const float *cj = sc->ctx + j * HR;
            /* o_h = W_UV_h ctx_h: W_UV_h = kv_b rows [h*(dn+dv)+dn, +dv) */
#pragma omp parallel for schedule(static)
            for (int h = 0; h < Hm; h++) {
                const char *wuv = (const char *)kvb->p + ((size_t)h * (dn + dv) + dn) * R * esz;
                if (kvb->dt == SHOAL_DT_BF16)
                    shoal_gemm_bf16(ot + (size_t)h * dv, (const uint16_t *)wuv, cj + (size_t)h * R, dv, R, 1);
                else
                    shoal_gemm_f32(ot + (size_t)h * dv, (const float *)wuv, cj + (size_t)h * R, dv, R, 1);
            }
            const float *gt = G + (size_t)(t0 + j) * od;
            for (size_t i = 0; i < od; i++)
                ot[i] *= shoal_sigmoid(gt[i]);
        }
        t0 += n;
    }
    return mm1(m, L, sc->a, &ly->o_proj, o, T, err, errlen);
}

/* ---- FFNs ---------------------------------------------------------------- */

static int dense_mlp(shoal_model *m, const shoal__layer *ly, int L, int T, char *err, size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    shoal__scratch *sc = &m->sc;
    size_t F = (size_t)c->intermediate_size;
    float *g = sc->work, *u = g + (size_t)T * F;
    mmjob j[] = {{&ly->mlp_gate, g, NULL}, {&ly->mlp_up, u, NULL}};
    int rc = mm_set(m, L, sc->xn, T, j, 2, err, errlen);
    if (rc)
        return rc;
    shoal_situ_glu(g, g, u, (int)((size_t)T * F), c->situ_beta, c->situ_linear_beta);
    return mm1(m, L, sc->a, &ly->mlp_down, g, T, err, errlen);
}

/* Router (SPEC §3.5): fp32 logits, sigmoid, bias for selection only, top-k
 * (ties to the lower id, returned ascending), renormalised unbiased weights. */
static void route(shoal_model *m, const shoal__layer *ly, const float *logits, int T, uint64_t *distinct)
{
    const shoal_k3cfg *c = &m->cfg;
    int E = c->num_experts, k = c->experts_per_token;
    float *sig = m->sc.rsig, *choice = sig + E;
    int32_t stamp = ++m->stamp;
    for (int t = 0; t < T; t++) {
        const float *lg = logits + (size_t)t * E;
        for (int e = 0; e < E; e++) {
            sig[e] = shoal_sigmoid(lg[e]);
            choice[e] = sig[e] + ly->router_bias[e];
        }
        int32_t *ids = m->topk_ids + (size_t)t * k;
        float *w = m->topk_w + (size_t)t * k;
        shoal_topk(ids, choice, E, k);
        float sum = 0.0f;
        for (int j = 0; j < k; j++) {
            w[j] = sig[ids[j]];
            sum += w[j];
        }
        for (int j = 0; j < k; j++) {
            if (c->renormalize)
                w[j] = w[j] / (sum + 1e-20f);
            w[j] *= c->routed_scaling;
            if (m->sc.seen[ids[j]] != stamp) {
                m->sc.seen[ids[j]] = stamp;
                (*distinct)++;
            }
        }
    }
}

/* Prefetch hint: the next MoE layer's router (with its selection bias)
 * applied to this layer's FFN input xn -- a real, cheap guess of the next
 * layer's routing, since the residual stream changes little from one layer to
 * the next -- top-k per token, the union handed to the backend. lg is scratch
 * that the routing of this layer no longer needs; the submitted z and ids are
 * not touched. Under --trunk-gb the routers are pinned resident (trunk.c), so
 * a streamed next layer is hinted too. */
static void hint_next(shoal_model *m, int L, int T, float *lg)
{
    const shoal_k3cfg *c = &m->cfg;
    int N = L + 1;
    while (N < c->num_layers && !m->layers[N].moe)
        N++;
    if (N >= c->num_layers)
        return;
    if (!m->layers[N].router.p || m->layers[N].router.remote)
        return; /* not in memory (trunk.c pins the routers, so this is only a safeguard), or on a trunk
                   server (a hint never waits on a round trip) */
    const shoal__layer *ny = &m->layers[N];
    int E = c->num_experts, k = c->experts_per_token;
    mm(lg, &ny->router, m->sc.xn, T);
    float *choice = m->sc.rsig;
    if (++m->pf_tag == 0) {
        memset(m->pf_mark, 0, (size_t)E * sizeof *m->pf_mark);
        m->pf_tag = 1;
    }
    int n = 0;
    for (int t = 0; t < T; t++) {
        const float *l = lg + (size_t)t * E;
        for (int e = 0; e < E; e++)
            choice[e] = shoal_sigmoid(l[e]) + ny->router_bias[e];
        shoal_topk(m->pf_topk, choice, E, k);
        for (int j = 0; j < k; j++) {
            int32_t e = m->pf_topk[j];
            if (m->pf_mark[e] != m->pf_tag) {
                m->pf_mark[e] = m->pf_tag;
                m->pf_list[n++] = e;
            }
        }
    }
    for (int i = 1; i < n; i++) { /* ascending (the wire wants it) */
        int32_t v = m->pf_list[i];
        int j = i;
        for (; j > 0 && m->pf_list[j - 1] > v; j--)
            m->pf_list[j] = m->pf_list[j - 1];
        m->pf_list[j] = v;
    }
    m->pf_layer = N;
    m->pf_n = n;
    m->experts.vt->hint(m->experts.self, N, m->pf_list, n);
}

/* The hint made for layer L against its routing (route() stamped the experts
 * it used in sc.seen). */
static void score_hint(shoal_model *m, int L)
{
    if (m->pf_layer != L)
        return;
    uint64_t used = 0, hit = 0;
    for (int e = 0; e < m->cfg.num_experts; e++)
        if (m->sc.seen[e] == m->stamp) {
            used++;
            hit += m->pf_mark[e] == m->pf_tag;
        }
    m->stats.prefetch_hinted += (uint64_t)m->pf_n;
    m->stats.prefetch_hinted_used += hit;
    m->stats.prefetch_used += used;
    m->pf_layer = -1;
}

static int moe_layer(shoal_model *m, const shoal__layer *ly, int L, int T, char *err, size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    shoal__scratch *sc = &m->sc;
    int E = c->num_experts, k = c->experts_per_token, lat = c->latent_size, d = c->hidden_size;
    size_t Fs = (size_t)c->num_shared_experts * c->moe_intermediate_size;
    float *lg = sc->work, *z = lg + (size_t)T * E, *r = z + (size_t)T * lat, *sg = r + (size_t)T * lat;
    float *su = sg + (size_t)T * Fs, *ru = su + (size_t)T * Fs;

    /* everything that reads xn in one step: the router and the latent down
     * projection (needed before the expert submit), and the shared experts'
     * gate and up projections with them, so a remote trunk takes one round
     * trip for all four */
    {
        mmjob j[] = {{&ly->router, lg, NULL}, {&ly->rdown, z, NULL}, {&ly->sh_gate, sg, NULL}, {&ly->sh_up, su, NULL}};
        int rc = mm_set(m, L, sc->xn, T, j, 4, err, errlen);
        if (rc)
            return rc;
    }
    uint64_t distinct = 0;
    route(m, ly, lg, T, &distinct);
    if (m->pf_on)
        score_hint(m, L);
    if (m->rtrace)
        shoal_trace_record(m->rtrace, L, T, k, m->topk_ids);
    mark(m, SHOAL_PHASE_ROUTING);

    double t0 = now_s();
    int rc = m->experts.vt->submit(m->experts.self, L, T, k, z, m->topk_ids, err, errlen);
    mark(m, SHOAL_PHASE_EXPERTS);
    if (rc)
        return rc;
    if (m->pf_on && m->experts.vt->hint) { /* while the workers compute */
        hint_next(m, L, T, lg);
        mark(m, SHOAL_PHASE_ROUTING);
    }
    /* shared experts while the backend works (gate and up came with the router) */
    shoal_situ_glu(sg, sg, su, (int)((size_t)T * Fs), c->situ_beta, c->situ_linear_beta);
    rc = mm1(m, L, sc->a, &ly->sh_down, sg, T, err, errlen);
    mark(m, SHOAL_PHASE_SHARED);
    if (rc) { /* the expert request is outstanding: end it before failing */
        char e2[256];
        m->experts.vt->gather(m->experts.self, m->ex_y, e2, sizeof e2);
        return rc;
    }
    rc = m->experts.vt->gather(m->experts.self, m->ex_y, err, errlen);
    mark(m, SHOAL_PHASE_EXPERTS);
    m->stats.experts_s += now_s() - t0;
    if (rc)
        return rc;
    m->stats.expert_bytes += distinct * m->info.expert_bytes;
    m->stats.expert_pairs += (uint64_t)T * (uint64_t)k;

    /* weighted sum in ascending expert-id order (the slots' order), fp32, then
     * the latent norm after the full sum */
    for (int t = 0; t < T; t++) {
        float *rt = r + (size_t)t * lat;
        const float *w = m->topk_w + (size_t)t * k;
        const uint16_t *y = m->ex_y + (size_t)t * k * lat;
        for (int i = 0; i < lat; i++)
            rt[i] = 0.0f;
        for (int j = 0; j < k; j++) {
            const uint16_t *yj = y + (size_t)j * lat;
            for (int i = 0; i < lat; i++)
                rt[i] += w[j] * shoal_bf16_to_f32(yj[i]);
        }
        if (c->latent_norm)
            shoal_rmsnorm(rt, rt, ly->rnorm, lat, c->rms_norm_eps);
    }
    if ((rc = mm1(m, L, ru, &ly->rup, r, T, err, errlen)))
        return rc;
    size_t n = (size_t)T * d;
    for (size_t i = 0; i < n; i++)
        sc->a[i] = ru[i] + sc->a[i];
    return 0;
}

/* ---- one chunk ------------------------------------------------------------ */

/* the token of logits row i: rows[i], or the last nrows tokens when rows is NULL */
#define ROW(i) (rows ? rows[(i)] : T - nrows + (i))

int shoal__engine_forward(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int T, float *logits,
                          const int *rows, int nrows, char *err, size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    shoal__scratch *sc = &m->sc;
    int d = c->hidden_size;
    size_t dd = (size_t)d;
    float eps = c->rms_norm_eps;
    double t0 = now_s();

    if (T < 1 || T > m->info.max_batch)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "forward: %d tokens (max_batch %d)", T, m->info.max_batch);
    if (!m->have_experts && c->num_moe > 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "forward: no routed-expert backend set");
    if (logits && (nrows < 1 || nrows > T))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "forward: %d logits rows of %d tokens", nrows, T);
    for (int i = 0; logits && rows && i < nrows; i++)
        if (rows[i] < 0 || rows[i] >= T || (i && rows[i] <= rows[i - 1]))
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "forward: logits row %d is %d (rows must increase within [0, %d))", i, rows[i], T);
    /* a model file truncated under the mapping: refuse by name, nothing read
     * or changed yet (instead of SIGBUS at the first lost page) */
    int mrc = shoal__engine_mapped_check(m, err, errlen);
    if (mrc) {
        /* the reader reads ahead into the next forward's units and may have
         * kept a read error from the truncated file: drop it, so the forward
         * after the file is restored reads afresh (resumed below) */
        if (m->ts && m->n_sunits)
            shoal_tstream_reset(m->ts);
        return mrc;
    }
    /* positions: a sequence's k-th token in this chunk is at its pos + k */
    for (int t = 0; t < T; t++)
        sc->tpos[t] = seqs[t]->pos++;
    for (int t = T - 1; t >= 0; t--)
        seqs[t]->pos = sc->tpos[t];
    for (int t = 0; t < T; t++) {
        if (seqs[t]->m != m)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "forward: sequence of another model");
        if (sc->tpos[t] >= seqs[t]->capacity)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "forward: sequence full (capacity %d tokens)",
                                 seqs[t]->capacity);
        if (seqs[t]->broken)
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "forward: sequence broken by an earlier failure (reset or copy into it first)");
        if (ids[t] < 0 || ids[t] >= c->vocab_size)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "forward: token id %d outside [0, %d)", (int)ids[t],
                                 c->vocab_size);
    }

    /* a reader stopped by an earlier failure starts again (a thread: before
     * the guard) */
    if (m->ts && m->n_sunits) {
        int r = shoal_tstream_resume(m->ts, err, errlen);
        if (r)
            return r;
    }
    shoal__engine_guard_arm(1);
    if (m->cm)
        m->t_mark = shoal_metrics_now_ns();
    int nb = 0, rc = 0, held = 0;
    /* under a trunk budget: this forward reads lm_head only if it wants logits */
    if (m->ts && m->n_sunits)
        shoal_tstream_begin(m->ts, logits != NULL);

    /* embedding rows (exact widening); under a budget, and with the trunk
     * remote, each row is read from the file (the table is not held) */
    size_t erow = dd * shoal_dtype_size(m->embed.dt);
    for (int t = 0; t < T; t++) {
        float *p = sc->P + (size_t)t * dd;
        const void *src;
        if (m->ts) {
            void *dst = (char *)m->emb_rows + (size_t)t * erow;
            rc = shoal_tstream_pread(m->ts, m->embed.t->file, m->embed.t->file_offset + (uint64_t)ids[t] * erow, erow,
                                     dst, m->embed.t->name, err, errlen);
            if (rc)
                goto fail;
            m->stats.trunk_read_bytes += erow;
            src = dst;
        } else if (m->embed_pread) {
            void *dst = (char *)m->emb_rows + (size_t)t * erow;
            rc = shoal_st_pread(m->st, m->embed.t, (uint64_t)ids[t] * erow, dst, erow, err, errlen);
            if (rc)
                goto fail;
            src = dst;
        } else {
            src = (const char *)m->embed.p + (size_t)ids[t] * erow;
        }
        if (m->embed.dt == SHOAL_DT_BF16) {
            const uint16_t *e = src;
            for (int j = 0; j < d; j++)
                p[j] = shoal_bf16_to_f32(e[j]);
        } else {
            memcpy(p, src, sizeof(float) * dd);
        }
    }

    size_t bstride = (size_t)T * dd; /* blocks[b][t] at blocks + b*bstride + t*d */
    for (int L = 0; L < c->num_layers; L++) {
        const shoal__layer *ly = &m->layers[L];
        /* under a budget, a streamed part of the layer (attention, FFN) is
         * in the reader's buffer, waited for (with a deadline) right before
         * it is needed and released right after; ly then points at a copy
         * aimed at the buffer */
        shoal__layer lyc;
        const shoal__tunit *ua = m->tunits ? &m->tunits[2 * L] : NULL, *uf = ua ? ua + 1 : NULL;
        if (ua && (ua->stream >= 0 || uf->stream >= 0)) {
            lyc = *ly;
            ly = &lyc;
        }
        if (ua && ua->stream >= 0) {
            const void *buf;
            rc = shoal_tstream_acquire(m->ts, ua->stream, &buf, err, errlen);
            if (rc)
                goto fail;
            held = 1;
            shoal__engine_trunk_point(&lyc, ua, buf);
        }
        /* 1. x = AttnRes(B, h) (h itself while B is empty) */
        for (int t = 0; t < T; t++) {
            float *x = sc->x + (size_t)t * dd;
            const float *p = sc->P + (size_t)t * dd;
            if (nb > 0)
                attn_res(x, sc->blocks + (size_t)t * dd, bstride, nb, p, ly->attn_res_norm, ly->attn_res_proj, d,
                         eps, sc->res_s);
            else
                memcpy(x, p, sizeof(float) * dd);
        }
        /* 2. a block boundary saves the layer input and restarts the prefix */
        int restart = c->block_start[L];
        if (restart)
            memcpy(sc->blocks + (size_t)nb++ * bstride, sc->P, sizeof(float) * bstride);
        /* 3. attention on RMSNorm(x) */
        for (int t = 0; t < T; t++)
            shoal_rmsnorm(sc->xn + (size_t)t * dd, sc->x + (size_t)t * dd, ly->in_norm, d, eps);
        rc = ly->kind == SHOAL_ATTN_KDA ? kda_layer(m, ly, L, seqs, T, err, errlen)
                                        : mla_layer(m, ly, L, seqs, T, err, errlen);
        if (rc)
            goto fail;
        if (held) { /* the attention matrices are done with */
            shoal_tstream_release(m->ts);
            held = 0;
        }
        /* 4. prefix */
        if (restart)
            memcpy(sc->P, sc->a, sizeof(float) * bstride);
        else
            for (size_t i = 0; i < bstride; i++)
                sc->P[i] = sc->P[i] + sc->a[i];
        /* 5-6. FFN on RMSNorm(AttnRes(B, P)) */
        for (int t = 0; t < T; t++) {
            float *x = sc->x + (size_t)t * dd;
            attn_res(x, sc->blocks + (size_t)t * dd, bstride, nb, sc->P + (size_t)t * dd, ly->mlp_res_norm,
                     ly->mlp_res_proj, d, eps, sc->res_s);
            shoal_rmsnorm(sc->xn + (size_t)t * dd, x, ly->post_norm, d, eps);
        }
        mark(m, SHOAL_PHASE_ATTENTION);
        if (uf && uf->stream >= 0) {
            const void *buf;
            rc = shoal_tstream_acquire(m->ts, uf->stream, &buf, err, errlen);
            if (rc)
                goto fail;
            held = 1;
            shoal__engine_trunk_point(&lyc, uf, buf);
        }
        if (ly->moe) {
            rc = moe_layer(m, ly, L, T, err, errlen);
            if (rc)
                goto fail;
        } else if ((rc = dense_mlp(m, ly, L, T, err, errlen))) {
            goto fail;
        }
        /* 7. prefix */
        for (size_t i = 0; i < bstride; i++)
            sc->P[i] = sc->P[i] + sc->a[i];
        if (held) {
            shoal_tstream_release(m->ts);
            held = 0;
        }
        mark(m, ly->moe ? SHOAL_PHASE_COMBINE : SHOAL_PHASE_DENSE);
        if (m->trace)
            m->trace(m->trace_ctx, L, T, sc->P, d);
    }
    /* final AttnRes, norm, head */
    for (int t = 0; t < T; t++) {
        float *x = sc->x + (size_t)t * dd;
        attn_res(x, sc->blocks + (size_t)t * dd, bstride, nb, sc->P + (size_t)t * dd, m->out_res_norm,
                 m->out_res_proj, d, eps, sc->res_s);
        shoal_rmsnorm(sc->xn + (size_t)t * dd, x, m->final_norm, d, eps);
    }
    if (m->trace)
        m->trace(m->trace_ctx, c->num_layers, T, sc->x, d);
    if (logits) {
        /* lm_head slice by slice (one slice when mapped): rows r0.. of the
         * wanted tokens' logits; a multi-row chunk with several slices goes
         * token by token (each output row is independent of T: kernels.h).
         * The wanted tokens' normed rows are gathered into x (free now) when
         * they are not the whole chunk. */
        int V = c->vocab_size, r0 = 0;
        const float *hx = sc->xn;
        if (nrows > 1 && nrows < T) {
            for (int t = 0; t < nrows; t++)
                memcpy(sc->x + (size_t)t * dd, sc->xn + (size_t)ROW(t) * dd, sizeof(float) * dd);
            hx = sc->x;
        }
        for (int i = 0; i < m->n_head; i++) {
            const shoal__wmat *w = &m->head[i];
            shoal__wmat wc;
            const shoal__tunit *tu = m->tunits ? &m->tunits[2 * c->num_layers + i] : NULL;
            if (tu && tu->stream >= 0) {
                const void *buf;
                rc = shoal_tstream_acquire(m->ts, tu->stream, &buf, err, errlen);
                if (rc)
                    goto fail;
                held = 1;
                wc = *w;
                shoal__engine_trunk_point(&wc, tu, buf);
                w = &wc;
            }
            if (nrows == 1)
                rc = mm1(m, c->num_layers, logits + r0, w, sc->xn + (size_t)ROW(0) * dd, 1, err, errlen);
            else if (m->n_head == 1)
                rc = mm1(m, c->num_layers, logits, w, hx, nrows, err, errlen);
            else
                for (int t = 0; t < nrows; t++)
                    mm(logits + (size_t)t * V + r0, w, sc->xn + (size_t)ROW(t) * dd, 1); /* sliced: never remote */
            if (rc)
                goto fail;
            if (held) {
                shoal_tstream_release(m->ts);
                held = 0;
            }
            r0 += w->rows;
        }
        m->stats.trunk_bytes += m->lm_head_bytes;
        /* Non-finite logits (a NaN lm_head, an overflowed activation) would be
         * sampled as id 0 forever (the sampler skips NaN): fail the forward by
         * name instead. A scan of what was just written, no allocation; finite
         * logits pass untouched, so a normal run's tokens cannot change. */
        for (int t = 0; t < nrows; t++) {
            const float *lg = logits + (size_t)t * V;
            int bad = 0, first = -1;
            for (int v = 0; v < V; v++)
                if (!isfinite(lg[v])) {
                    bad++;
                    if (first < 0)
                        first = v;
                }
            if (bad) {
                rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                                   "non-finite logits: %d of %d are NaN or Inf (first id %d) at position %d; the "
                                   "model's weights (lm_head?) or activations are not finite, refusing to sample",
                                   bad, V, first, sc->tpos[ROW(t)]);
                goto fail;
            }
        }
    }
    mark(m, SHOAL_PHASE_HEAD);
    shoal_cmetrics_forward(m->cm, (uint32_t)T);
    shoal__engine_guard_arm(0);

    for (int t = 0; t < T; t++) {
        seqs[t]->pos = sc->tpos[t] + 1;
        if (!seqs[t]->ck_arm)
            seqs[t]->ck_n = 0; /* saved states of an earlier verify are stale now */
    }
    m->stats.tokens += (uint64_t)T;
    m->stats.chunks++;
    m->stats.trunk_bytes += m->trunk_bytes_fixed + (uint64_t)T * m->embed_row_bytes;
    m->stats.forward_s += now_s() - t0;
    return 0;
fail:
    /* the states already hold part of this chunk: unusable until reset/copy */
    for (int t = 0; t < T; t++)
        seqs[t]->broken = 1;
    shoal__engine_guard_arm(0);
    /* the reader is part-way through this forward's units: stop it (the next
     * forward starts it again at a fresh cycle) */
    if (m->ts && m->n_sunits)
        shoal_tstream_reset(m->ts);
    m->stats.forward_s += now_s() - t0;
    return rc;
}
#undef ROW
