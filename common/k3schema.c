/* K3 tensor schema (common/k3schema.h), transcribed from SPEC §2 tables:
 * 2.1 globals, 2.2 every layer, 2.3 KDA, 2.4 MLA, 2.5 dense MLP, 2.6 MoE. */
#include "common/k3schema.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

#define P "language_model."

typedef struct {
    const shoal_k3cfg *c;
    shoal_k3schema_fn fn;
    void *ctx;
    shoal_dtype trunk;
    int rc;
} emitter;

static void emit(emitter *em, shoal_tensor_class cls, int layer, int expert, shoal_dtype dt, int ndim,
                 int64_t d0, int64_t d1, int64_t d2, const char *fmt, ...) __attribute__((format(printf, 10, 11)));
static void emit(emitter *em, shoal_tensor_class cls, int layer, int expert, shoal_dtype dt, int ndim,
                 int64_t d0, int64_t d1, int64_t d2, const char *fmt, ...)
{
    if (em->rc)
        return;
    shoal_k3schema_entry e = {.dtype = dt, .alt_dtype = -1, .ndim = ndim, .shape = {d0, d1, d2},
                              .cls = cls, .layer = layer, .expert = expert};
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(e.name, sizeof e.name, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof e.name)
        SHOAL_PANIC("schema name too long: %s", e.name);
    if (cls == SHOAL_TC_EXPERT && em->c->expert_format == SHOAL_EXPERTS_UNQUANTIZED && dt != SHOAL_DT_BF16)
        e.alt_dtype = SHOAL_DT_BF16;
    if (strstr(e.name, ".A_log"))
        e.min_dim0 = 1;
    em->rc = em->fn(&e, em->ctx);
}

static shoal_dtype trunk_dtype(const shoal_k3cfg *c)
{
    return strcmp(c->dtype, "float32") ? SHOAL_DT_BF16 : SHOAL_DT_F32;
}

static void emit_globals_head(emitter *em)
{
    const shoal_k3cfg *c = em->c;
    emit(em, SHOAL_TC_GLOBAL, -1, -1, em->trunk, 2, c->vocab_size, c->hidden_size, 0,
         P "model.embed_tokens.weight");
}

static void emit_globals_tail(emitter *em)
{
    const shoal_k3cfg *c = em->c;
    int d = c->hidden_size;
    emit(em, SHOAL_TC_GLOBAL, -1, -1, em->trunk, 1, d, 0, 0, P "model.norm.weight");
    emit(em, SHOAL_TC_GLOBAL, -1, -1, em->trunk, 1, d, 0, 0, P "model.output_attn_res_norm.weight");
    emit(em, SHOAL_TC_GLOBAL, -1, -1, em->trunk, 2, 1, d, 0, P "model.output_attn_res_proj.weight");
    emit(em, SHOAL_TC_GLOBAL, -1, -1, em->trunk, 2, c->vocab_size, d, 0, P "lm_head.weight");
}

static void emit_expert(emitter *em, int L, int e)
{
    const shoal_k3cfg *c = em->c;
    static const char *const w[3] = {"w1", "w3", "w2"}; /* gate, up, down */
    int64_t rows[3] = {c->moe_intermediate_size, c->moe_intermediate_size, c->latent_size};
    int64_t cols[3] = {c->latent_size, c->latent_size, c->moe_intermediate_size};
    for (int k = 0; k < 3; k++) {
        if (c->expert_format == SHOAL_EXPERTS_MXFP4) {
            emit(em, SHOAL_TC_EXPERT, L, e, SHOAL_DT_U8, 2, rows[k], cols[k] / 2, 0,
                 P "model.layers.%d.block_sparse_moe.experts.%d.%s.weight_packed", L, e, w[k]);
            emit(em, SHOAL_TC_EXPERT, L, e, SHOAL_DT_U8, 2, rows[k], cols[k] / c->expert_group_size, 0,
                 P "model.layers.%d.block_sparse_moe.experts.%d.%s.weight_scale", L, e, w[k]);
        } else {
            emit(em, SHOAL_TC_EXPERT, L, e, em->trunk, 2, rows[k], cols[k], 0,
                 P "model.layers.%d.block_sparse_moe.experts.%d.%s.weight", L, e, w[k]);
        }
    }
}

static void emit_layer(emitter *em, int L, int with_experts)
{
    const shoal_k3cfg *c = em->c;
    const shoal_tensor_class K = SHOAL_TC_LAYER;
    const shoal_dtype T = em->trunk, F = SHOAL_DT_F32;
    int64_t d = c->hidden_size;
#define LP P "model.layers.%d."
    /* §2.2 */
    emit(em, K, L, -1, T, 1, d, 0, 0, LP "input_layernorm.weight", L);
    emit(em, K, L, -1, T, 1, d, 0, 0, LP "post_attention_layernorm.weight", L);
    emit(em, K, L, -1, T, 1, d, 0, 0, LP "self_attention_res_norm.weight", L);
    emit(em, K, L, -1, T, 2, 1, d, 0, LP "self_attention_res_proj.weight", L);
    emit(em, K, L, -1, T, 1, d, 0, 0, LP "mlp_res_norm.weight", L);
    emit(em, K, L, -1, T, 2, 1, d, 0, LP "mlp_res_proj.weight", L);
    if (c->attn[L] == SHOAL_ATTN_KDA) {
        /* §2.3 */
        int64_t H = c->kda_heads, D = c->kda_head_dim, C = H * D;
        emit(em, K, L, -1, T, 2, C, d, 0, LP "self_attn.q_proj.weight", L);
        emit(em, K, L, -1, T, 2, C, d, 0, LP "self_attn.k_proj.weight", L);
        emit(em, K, L, -1, T, 2, C, d, 0, LP "self_attn.v_proj.weight", L);
        emit(em, K, L, -1, F, 3, C, 1, c->conv_kernel, LP "self_attn.q_conv1d.weight", L);
        emit(em, K, L, -1, F, 3, C, 1, c->conv_kernel, LP "self_attn.k_conv1d.weight", L);
        emit(em, K, L, -1, F, 3, C, 1, c->conv_kernel, LP "self_attn.v_conv1d.weight", L);
        emit(em, K, L, -1, T, 2, D, d, 0, LP "self_attn.f_a_proj.weight", L);
        emit(em, K, L, -1, T, 2, C, D, 0, LP "self_attn.f_b_proj.weight", L);
        emit(em, K, L, -1, T, 2, H, d, 0, LP "self_attn.b_proj.weight", L);
        emit(em, K, L, -1, F, 1, H, 0, 0, LP "self_attn.A_log", L);
        emit(em, K, L, -1, F, 1, C, 0, 0, LP "self_attn.dt_bias", L);
        emit(em, K, L, -1, F, 1, D, 0, 0, LP "self_attn.o_norm.weight", L);
        emit(em, K, L, -1, T, 2, C, d, 0, LP "self_attn.g_proj.weight", L);
        emit(em, K, L, -1, T, 2, d, C, 0, LP "self_attn.o_proj.weight", L);
    } else {
        /* §2.4 */
        int64_t H = c->mla_heads, nope = c->qk_nope_dim, rope = c->qk_rope_dim, vd = c->v_head_dim;
        int64_t ql = c->q_lora_rank, kvl = c->kv_lora_rank;
        emit(em, K, L, -1, T, 2, ql, d, 0, LP "self_attn.q_a_proj.weight", L);
        emit(em, K, L, -1, T, 1, ql, 0, 0, LP "self_attn.q_a_layernorm.weight", L);
        emit(em, K, L, -1, T, 2, H * (nope + rope), ql, 0, LP "self_attn.q_b_proj.weight", L);
        emit(em, K, L, -1, T, 2, kvl + rope, d, 0, LP "self_attn.kv_a_proj_with_mqa.weight", L);
        emit(em, K, L, -1, T, 1, kvl, 0, 0, LP "self_attn.kv_a_layernorm.weight", L);
        emit(em, K, L, -1, T, 2, H * (nope + vd), kvl, 0, LP "self_attn.kv_b_proj.weight", L);
        emit(em, K, L, -1, T, 2, H * vd, d, 0, LP "self_attn.g_proj.weight", L);
        emit(em, K, L, -1, T, 2, d, H * vd, 0, LP "self_attn.o_proj.weight", L);
    }
    if (!c->is_moe[L]) {
        /* §2.5 */
        int64_t I = c->intermediate_size;
        emit(em, K, L, -1, T, 2, I, d, 0, LP "mlp.gate_proj.weight", L);
        emit(em, K, L, -1, T, 2, I, d, 0, LP "mlp.up_proj.weight", L);
        emit(em, K, L, -1, T, 2, d, I, 0, LP "mlp.down_proj.weight", L);
        return;
    }
    /* §2.6 */
    int64_t E = c->num_experts, lat = c->latent_size, sw = (int64_t)c->num_shared_experts * c->moe_intermediate_size;
#define MP LP "block_sparse_moe."
    emit(em, K, L, -1, T, 2, E, d, 0, MP "gate.weight", L);
    emit(em, K, L, -1, F, 1, E, 0, 0, MP "gate.e_score_correction_bias", L);
    emit(em, K, L, -1, T, 2, lat, d, 0, MP "routed_expert_down_proj.weight", L);
    if (c->latent_norm)
        emit(em, K, L, -1, T, 1, lat, 0, 0, MP "routed_expert_norm.weight", L);
    emit(em, K, L, -1, T, 2, d, lat, 0, MP "routed_expert_up_proj.weight", L);
    if (sw) {
        emit(em, K, L, -1, T, 2, sw, d, 0, MP "shared_experts.gate_proj.weight", L);
        emit(em, K, L, -1, T, 2, sw, d, 0, MP "shared_experts.up_proj.weight", L);
        emit(em, K, L, -1, T, 2, d, sw, 0, MP "shared_experts.down_proj.weight", L);
    }
#undef MP
#undef LP
    if (with_experts)
        for (int e = 0; e < c->num_experts && !em->rc; e++)
            emit_expert(em, L, e);
}

int shoal_k3schema_globals(const shoal_k3cfg *c, shoal_k3schema_fn fn, void *ctx)
{
    emitter em = {.c = c, .fn = fn, .ctx = ctx, .trunk = trunk_dtype(c)};
    emit_globals_head(&em);
    emit_globals_tail(&em);
    return em.rc;
}

int shoal_k3schema_layer(const shoal_k3cfg *c, int layer, int with_experts, shoal_k3schema_fn fn, void *ctx)
{
    if (layer < 0 || layer >= c->num_layers)
        return SHOAL_EINVAL;
    emitter em = {.c = c, .fn = fn, .ctx = ctx, .trunk = trunk_dtype(c)};
    emit_layer(&em, layer, with_experts);
    return em.rc;
}

int shoal_k3schema_foreach(const shoal_k3cfg *c, shoal_k3schema_fn fn, void *ctx)
{
    emitter em = {.c = c, .fn = fn, .ctx = ctx, .trunk = trunk_dtype(c)};
    emit_globals_head(&em);
    for (int L = 0; L < c->num_layers && !em.rc; L++)
        emit_layer(&em, L, 1);
    emit_globals_tail(&em);
    return em.rc;
}

typedef struct {
    shoal_k3schema_entry *out;
    int n;
} collect_ctx;

static int collect(const shoal_k3schema_entry *e, void *ctx)
{
    collect_ctx *cc = ctx;
    if (cc->n >= SHOAL_K3SCHEMA_EXPERT_MAX)
        SHOAL_PANIC("more than %d tensors per expert", SHOAL_K3SCHEMA_EXPERT_MAX);
    cc->out[cc->n++] = *e;
    return 0;
}

int shoal_k3schema_expert(const shoal_k3cfg *c, int layer, int expert,
                          shoal_k3schema_entry out[SHOAL_K3SCHEMA_EXPERT_MAX])
{
    if (layer < 0 || layer >= c->num_layers || !c->is_moe[layer] || expert < 0 || expert >= c->num_experts)
        return SHOAL_EINVAL;
    collect_ctx cc = {.out = out};
    emitter em = {.c = c, .fn = collect, .ctx = &cc, .trunk = trunk_dtype(c)};
    emit_expert(&em, layer, expert);
    return cc.n;
}

uint64_t shoal_k3schema_nbytes(const shoal_k3schema_entry *e)
{
    uint64_t n = shoal_dtype_size(e->dtype);
    for (int i = 0; i < e->ndim; i++)
        n *= (uint64_t)e->shape[i];
    return n;
}

static int sum_one(const shoal_k3schema_entry *e, void *ctx)
{
    shoal_k3schema_totals *t = ctx;
    uint64_t b = shoal_k3schema_nbytes(e);
    t->count[e->cls]++;
    t->bytes[e->cls] += b;
    if (e->cls == SHOAL_TC_LAYER)
        t->layer_bytes[e->layer] += b;
    else if (e->cls == SHOAL_TC_EXPERT)
        t->expert_bytes[e->layer] += b;
    return 0;
}

void shoal_k3schema_sum(const shoal_k3cfg *c, shoal_k3schema_totals *out)
{
    memset(out, 0, sizeof *out);
    shoal_k3schema_foreach(c, sum_one, out);
    for (int L = 0; L < c->num_layers; L++)
        if (c->is_moe[L]) {
            shoal_k3schema_entry e[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(c, L, 0, e);
            for (int i = 0; i < n; i++)
                out->bytes_per_expert += shoal_k3schema_nbytes(&e[i]);
            break;
        }
}

int shoal_k3schema_is_vision(const char *name)
{
    return !strncmp(name, "vision_tower.", 13) || !strncmp(name, "mm_projector.", 13);
}

/* ---- inventory check ------------------------------------------------------ */

typedef struct {
    const shoal_st *st;
    shoal_k3schema_report *rep;
    shoal_k3schema_problem_fn problem;
    void *pctx;
    uint8_t *seen; /* per store tensor */
    const shoal_tensor *base;
    char first[512];
} check_ctx;

static void fmt_shape(char *b, size_t n, int ndim, const int64_t *shape)
{
    size_t o = (size_t)snprintf(b, n, "[");
    for (int i = 0; i < ndim && o < n; i++)
        o += (size_t)snprintf(b + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o < n)
        snprintf(b + o, n - o, "]");
}

static void report(check_ctx *cc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void report(check_ctx *cc, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (!cc->first[0])
        snprintf(cc->first, sizeof cc->first, "%s", line);
    if (cc->problem)
        cc->problem(line, cc->pctx);
}

static int check_one(const shoal_k3schema_entry *e, void *ctx)
{
    check_ctx *cc = ctx;
    shoal_k3schema_report *r = cc->rep;
    char want[96], have[96];
    r->expected++;
    fmt_shape(want, sizeof want, e->ndim, e->shape);
    if (e->min_dim0)
        snprintf(want, sizeof want, "[>= %lld]", (long long)e->shape[0]);
    const shoal_tensor *t = shoal_st_find(cc->st, e->name);
    if (!t) {
        r->missing++;
        report(cc, "missing %s (want %s%s%s %s)", e->name, shoal_dtype_name(e->dtype),
               e->alt_dtype >= 0 ? " or " : "", e->alt_dtype >= 0 ? shoal_dtype_name((shoal_dtype)e->alt_dtype) : "",
               want);
        return 0;
    }
    cc->seen[t - cc->base] = 1;
    int ok = (t->dtype == e->dtype || (e->alt_dtype >= 0 && (int)t->dtype == e->alt_dtype)) && t->ndim == e->ndim;
    for (int i = 0; ok && i < e->ndim; i++)
        ok = i == 0 && e->min_dim0 ? t->shape[0] >= e->shape[0] : t->shape[i] == e->shape[i];
    if (!ok) {
        r->mismatched++;
        fmt_shape(have, sizeof have, t->ndim, t->shape);
        report(cc, "mismatch %s: want %s%s%s %s, have %s %s", e->name, shoal_dtype_name(e->dtype),
               e->alt_dtype >= 0 ? " or " : "", e->alt_dtype >= 0 ? shoal_dtype_name((shoal_dtype)e->alt_dtype) : "",
               want, shoal_dtype_name(t->dtype), have);
        return 0;
    }
    r->present++;
    if (e->min_dim0) {
        int n = (int)t->shape[0];
        if (!r->a_log_min || n < r->a_log_min)
            r->a_log_min = n;
        if (n > r->a_log_max)
            r->a_log_max = n;
    }
    if (e->cls == SHOAL_TC_EXPERT && t->dtype != e->dtype)
        r->experts_bf16 = 1;
    r->count[e->cls]++;
    r->bytes[e->cls] += t->nbytes;
    if (e->cls == SHOAL_TC_LAYER)
        r->layer_bytes[e->layer] += t->nbytes;
    else if (e->cls == SHOAL_TC_EXPERT)
        r->expert_bytes[e->layer] += t->nbytes;
    return 0;
}

int shoal_k3schema_check(const shoal_k3cfg *c, const shoal_st *st, shoal_k3schema_report *rep,
                         shoal_k3schema_problem_fn problem, void *pctx, char *err, size_t errlen)
{
    shoal_k3schema_report local;
    if (!rep)
        rep = &local;
    memset(rep, 0, sizeof *rep);
    size_t n = shoal_st_count(st);
    check_ctx cc = {.st = st, .rep = rep, .problem = problem, .pctx = pctx,
                    .seen = shoal_xcalloc(n ? n : 1, 1), .base = n ? shoal_st_at(st, 0) : NULL};
    shoal_k3schema_foreach(c, check_one, &cc);
    for (size_t i = 0; i < n; i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        if (cc.seen[i])
            continue;
        if (shoal_k3schema_is_vision(t->name)) {
            rep->vision_count++;
            rep->vision_bytes += t->nbytes;
            continue;
        }
        char have[96];
        fmt_shape(have, sizeof have, t->ndim, t->shape);
        rep->unexpected++;
        report(&cc, "unexpected %s (%s %s)", t->name, shoal_dtype_name(t->dtype), have);
    }
    free(cc.seen);
    if (rep->missing || rep->mismatched || rep->unexpected)
        return shoal_err_set(err, errlen, SHOAL_EMODEL,
                             "inventory: %llu missing, %llu mismatched, %llu unexpected of %llu expected tensors; "
                             "first: %s",
                             (unsigned long long)rep->missing, (unsigned long long)rep->mismatched,
                             (unsigned long long)rep->unexpected, (unsigned long long)rep->expected, cc.first);
    return 0;
}
