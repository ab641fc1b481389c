/* Model open: config, tensor binding with shape/dtype checks, expert backend,
 * scratch (engine.h). Every problem with the tensors is collected and the
 * model refused once, naming each missing or mis-shaped tensor. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "common/err.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "coordinator/engine/engine_int.h"
#include "coordinator/engine/experts_local.h"

/* ---- problem list --------------------------------------------------------- */

typedef struct {
    char *err;
    size_t errlen, used;
    int n;
} problems;

static void problem(problems *pr, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(problems *pr, const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    SHOAL_ERROR("model: %s", line);
    pr->n++;
    if (pr->err && pr->errlen > pr->used + 1) {
        int w = snprintf(pr->err + pr->used, pr->errlen - pr->used, "%s%s", pr->used ? "\n" : "", line);
        if (w > 0)
            pr->used += (size_t)w < pr->errlen - pr->used ? (size_t)w : pr->errlen - pr->used - 1;
    }
}

/* ---- inventory (common/k3schema) ------------------------------------------- */

typedef struct {
    problems *pr;
    int remote_experts;
    uint64_t unexpected;
} inventory;

static void on_inventory_problem(const char *line, void *ctx)
{
    inventory *in = ctx;
    /* routed experts live on the expert servers when they are remote
     * ("shared_experts." does not contain ".experts.") */
    if (in->remote_experts && strstr(line, ".experts."))
        return;
    if (!strncmp(line, "unexpected", 10)) {
        if (in->unexpected++ < 8)
            SHOAL_WARN("model: %s (ignored)", line);
        return;
    }
    problem(in->pr, "%s", line);
}

/* ---- binding -------------------------------------------------------------- */

typedef struct {
    shoal_model *m;
    problems *pr;
    char prefix[64];
    /* F32 low-16-bit census per tensor kind (SPEC §3.9) */
    struct {
        char kind[64];
        uint64_t nonzero, total;
    } f32[32];
    int nf32;
} binder;

static float *own(shoal_model *m, size_t n)
{
    if (m->n_owned == m->cap_owned) {
        m->cap_owned = m->cap_owned ? 2 * m->cap_owned : 256;
        m->owned = shoal_xrealloc(m->owned, sizeof(float *) * (size_t)m->cap_owned);
    }
    float *p = shoal_xmalloc(sizeof(float) * (n ? n : 1));
    m->owned[m->n_owned++] = p;
    m->owned_bytes += sizeof(float) * (n ? n : 1);
    return p;
}

/* the kind of a tensor name: the part after "layers.<L>." (or the whole name) */
static const char *kind_of(const char *name)
{
    const char *p = strstr(name, "layers.");
    if (!p)
        return name;
    p += 7;
    while (*p >= '0' && *p <= '9')
        p++;
    return *p == '.' ? p + 1 : p;
}

static void census(binder *b, const shoal_tensor *t)
{
    if (t->dtype != SHOAL_DT_F32)
        return;
    const char *k = kind_of(t->name);
    int i;
    for (i = 0; i < b->nf32; i++)
        if (!strcmp(b->f32[i].kind, k))
            break;
    if (i == b->nf32) {
        if (b->nf32 == (int)(sizeof b->f32 / sizeof b->f32[0]))
            return;
        snprintf(b->f32[i].kind, sizeof b->f32[i].kind, "%s", k);
        b->nf32++;
    }
    const uint8_t *p = t->data;
    uint64_t n = t->nbytes / 4, nz = 0;
    for (uint64_t j = 0; j < n; j++) {
        uint32_t u;
        memcpy(&u, p + 4 * j, 4);
        nz += (u & 0xffffu) != 0;
    }
    b->f32[i].nonzero += nz;
    b->f32[i].total += n;
    SHOAL_DEBUG("model: F32 %s: %llu of %llu elements have non-zero low 16 bits", t->name, (unsigned long long)nz,
                (unsigned long long)n);
}

static const shoal_tensor *find(binder *b, const char *suffix, int layer)
{
    char name[256];
    if (layer >= 0)
        snprintf(name, sizeof name, "%smodel.layers.%d.%s", b->prefix, layer, suffix);
    else
        snprintf(name, sizeof name, "%s%s", b->prefix, suffix);
    const shoal_tensor *t = shoal_st_find(b->m->st, name);
    if (!t)
        problem(b->pr, "missing tensor %s", name);
    return t;
}

static void shape_str(char *buf, size_t n, const shoal_tensor *t)
{
    size_t u = 0;
    u += (size_t)snprintf(buf + u, n - u, "[");
    for (int i = 0; i < t->ndim && u < n; i++)
        u += (size_t)snprintf(buf + u, n - u, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (u < n)
        snprintf(buf + u, n - u, "]");
}

/* A matrix [rows, cols], BF16 or F32, borrowed from the mapping (copied only
 * if the mapping is misaligned for its element type). */
static shoal__wmat bind_mat(binder *b, const char *suffix, int layer, int rows, int cols)
{
    shoal__wmat w = {0};
    const shoal_tensor *t = find(b, suffix, layer);
    if (!t)
        return w;
    char sh[96];
    shape_str(sh, sizeof sh, t);
    if (t->dtype != SHOAL_DT_BF16 && t->dtype != SHOAL_DT_F32) {
        problem(b->pr, "tensor %s: dtype %s, expected BF16 or F32", t->name, shoal_dtype_name(t->dtype));
        return w;
    }
    if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        problem(b->pr, "tensor %s: shape %s, expected [%d, %d]", t->name, sh, rows, cols);
        return w;
    }
    w.dt = t->dtype;
    w.rows = rows;
    w.cols = cols;
    w.t = t;
    size_t esz = shoal_dtype_size(t->dtype);
    if (b->m->opts.trunk_mode != SHOAL_TRUNK_MAPPED) {
        /* read with pread into owned memory, never through the mapping (its
         * pages would count as resident): no census of the matrices */
        if (t->file_offset % esz)
            problem(b->pr, "tensor %s: data at byte %llu of its file is not aligned to its %zu-byte elements (run "
                    "without --trunk-gb)", t->name, (unsigned long long)t->file_offset, esz);
        return w;
    }
    census(b, t);
    if ((uintptr_t)t->data % esz) {
        float *c = own(b->m, (t->nbytes + 3) / 4);
        memcpy(c, t->data, t->nbytes);
        w.p = c;
    } else {
        w.p = t->data;
    }
    return w;
}

/* A vector of n values (shape [n], or [1, n] when as_row), any float dtype,
 * widened to an owned fp32 copy. min_n: accept a longer stored vector and use
 * its first n entries (A_log is stored [128] for 96 heads). */
static float *bind_vec(binder *b, const char *suffix, int layer, int n, int longer_ok, int as_row)
{
    const shoal_tensor *t = find(b, suffix, layer);
    if (!t)
        return NULL;
    char sh[96];
    shape_str(sh, sizeof sh, t);
    if (t->dtype != SHOAL_DT_BF16 && t->dtype != SHOAL_DT_F32 && t->dtype != SHOAL_DT_F16) {
        problem(b->pr, "tensor %s: dtype %s, expected BF16 or F32", t->name, shoal_dtype_name(t->dtype));
        return NULL;
    }
    int64_t len = t->ndim == 1 ? t->shape[0] : -1;
    if (as_row && t->ndim == 2 && t->shape[0] == 1)
        len = t->shape[1];
    if (len < 0 || (longer_ok ? len < n : len != n)) {
        problem(b->pr, "tensor %s: shape %s, expected [%s%d]%s", t->name, sh, as_row ? "1, " : "", n,
                longer_ok ? " or longer" : "");
        return NULL;
    }
    census(b, t);
    float *all = own(b->m, (size_t)len);
    if (shoal_tensor_to_f32(t, all, (size_t)len)) {
        problem(b->pr, "tensor %s: cannot widen to fp32", t->name);
        return NULL;
    }
    return all;
}

/* conv taps [C, 1, K] */
static float *bind_conv(binder *b, const char *suffix, int layer, int C, int K)
{
    const shoal_tensor *t = find(b, suffix, layer);
    if (!t)
        return NULL;
    char sh[96];
    shape_str(sh, sizeof sh, t);
    if (!((t->ndim == 3 && t->shape[0] == C && t->shape[1] == 1 && t->shape[2] == K) ||
          (t->ndim == 2 && t->shape[0] == C && t->shape[1] == K))) {
        problem(b->pr, "tensor %s: shape %s, expected [%d, 1, %d]", t->name, sh, C, K);
        return NULL;
    }
    census(b, t);
    float *v = own(b->m, (size_t)C * K);
    if (shoal_tensor_to_f32(t, v, (size_t)C * K)) {
        problem(b->pr, "tensor %s: dtype %s, expected F32 or BF16", t->name, shoal_dtype_name(t->dtype));
        return NULL;
    }
    return v;
}

static uint64_t mat_bytes(const shoal__wmat *w)
{
    return (uint64_t)w->rows * (uint64_t)w->cols * (w->dt == SHOAL_DT_F32 ? 4u : 2u);
}

static void bind_all(binder *b)
{
    shoal_model *m = b->m;
    const shoal_k3cfg *c = &m->cfg;
    int d = c->hidden_size, V = c->vocab_size;
    int H = c->kda_heads, D = c->kda_head_dim, C = H * D;
    int Hm = c->mla_heads, qh = c->qk_nope_dim + c->qk_rope_dim;
    int kv = c->kv_lora_rank + c->qk_rope_dim;
    int Fs = c->num_shared_experts * c->moe_intermediate_size;
    uint64_t tb = 0, vecs = 0;

    m->embed = bind_mat(b, "model.embed_tokens.weight", -1, V, d);
    m->lm_head = bind_mat(b, "lm_head.weight", -1, V, d);
    m->final_norm = bind_vec(b, "model.norm.weight", -1, d, 0, 0);
    m->out_res_norm = bind_vec(b, "model.output_attn_res_norm.weight", -1, d, 0, 0);
    m->out_res_proj = bind_vec(b, "model.output_attn_res_proj.weight", -1, d, 0, 1);
    vecs += 3 * (uint64_t)d;

    int ik = 0, im = 0;
    for (int L = 0; L < c->num_layers; L++) {
        shoal__layer *ly = &m->layers[L];
        ly->kind = c->attn[L];
        ly->moe = c->is_moe[L];
        ly->kda_idx = ly->kind == SHOAL_ATTN_KDA ? ik++ : -1;
        ly->mla_idx = ly->kind == SHOAL_ATTN_MLA ? im++ : -1;
        ly->in_norm = bind_vec(b, "input_layernorm.weight", L, d, 0, 0);
        ly->post_norm = bind_vec(b, "post_attention_layernorm.weight", L, d, 0, 0);
        ly->attn_res_norm = bind_vec(b, "self_attention_res_norm.weight", L, d, 0, 0);
        ly->attn_res_proj = bind_vec(b, "self_attention_res_proj.weight", L, d, 0, 1);
        ly->mlp_res_norm = bind_vec(b, "mlp_res_norm.weight", L, d, 0, 0);
        ly->mlp_res_proj = bind_vec(b, "mlp_res_proj.weight", L, d, 0, 1);
        vecs += 6 * (uint64_t)d;
        if (ly->kind == SHOAL_ATTN_KDA) {
            ly->q_proj = bind_mat(b, "self_attn.q_proj.weight", L, C, d);
            ly->k_proj = bind_mat(b, "self_attn.k_proj.weight", L, C, d);
            ly->v_proj = bind_mat(b, "self_attn.v_proj.weight", L, C, d);
            ly->q_conv = bind_conv(b, "self_attn.q_conv1d.weight", L, C, c->conv_kernel);
            ly->k_conv = bind_conv(b, "self_attn.k_conv1d.weight", L, C, c->conv_kernel);
            ly->v_conv = bind_conv(b, "self_attn.v_conv1d.weight", L, C, c->conv_kernel);
            ly->f_a = bind_mat(b, "self_attn.f_a_proj.weight", L, D, d);
            ly->f_b = bind_mat(b, "self_attn.f_b_proj.weight", L, C, D);
            ly->b_proj = bind_mat(b, "self_attn.b_proj.weight", L, H, d);
            ly->A_log = bind_vec(b, "self_attn.A_log", L, H, 1, 0);
            ly->dt_bias = bind_vec(b, "self_attn.dt_bias", L, C, 0, 0);
            ly->o_norm = bind_vec(b, "self_attn.o_norm.weight", L, D, 0, 0);
            ly->g_proj = bind_mat(b, "self_attn.g_proj.weight", L, C, d);
            ly->o_proj = bind_mat(b, "self_attn.o_proj.weight", L, d, C);
            tb += mat_bytes(&ly->q_proj) + mat_bytes(&ly->k_proj) + mat_bytes(&ly->v_proj) + mat_bytes(&ly->f_a) +
                  mat_bytes(&ly->f_b) + mat_bytes(&ly->b_proj);
            vecs += 3 * (uint64_t)C * c->conv_kernel + H + C + D;
        } else {
            ly->q_a = bind_mat(b, "self_attn.q_a_proj.weight", L, c->q_lora_rank, d);
            ly->q_a_norm = bind_vec(b, "self_attn.q_a_layernorm.weight", L, c->q_lora_rank, 0, 0);
            ly->q_b = bind_mat(b, "self_attn.q_b_proj.weight", L, Hm * qh, c->q_lora_rank);
            ly->kv_a = bind_mat(b, "self_attn.kv_a_proj_with_mqa.weight", L, kv, d);
            ly->kv_a_norm = bind_vec(b, "self_attn.kv_a_layernorm.weight", L, c->kv_lora_rank, 0, 0);
            ly->kv_b = bind_mat(b, "self_attn.kv_b_proj.weight", L, Hm * (c->qk_nope_dim + c->v_head_dim),
                                c->kv_lora_rank);
            ly->g_proj = bind_mat(b, "self_attn.g_proj.weight", L, Hm * c->v_head_dim, d);
            ly->o_proj = bind_mat(b, "self_attn.o_proj.weight", L, d, Hm * c->v_head_dim);
            tb += mat_bytes(&ly->q_a) + mat_bytes(&ly->q_b) + mat_bytes(&ly->kv_a) + mat_bytes(&ly->kv_b);
            vecs += (uint64_t)c->q_lora_rank + c->kv_lora_rank;
        }
        tb += mat_bytes(&ly->g_proj) + mat_bytes(&ly->o_proj);
        if (!ly->moe) {
            ly->mlp_gate = bind_mat(b, "mlp.gate_proj.weight", L, c->intermediate_size, d);
            ly->mlp_up = bind_mat(b, "mlp.up_proj.weight", L, c->intermediate_size, d);
            ly->mlp_down = bind_mat(b, "mlp.down_proj.weight", L, d, c->intermediate_size);
            tb += mat_bytes(&ly->mlp_gate) + mat_bytes(&ly->mlp_up) + mat_bytes(&ly->mlp_down);
        } else {
            ly->router = bind_mat(b, "block_sparse_moe.gate.weight", L, c->num_experts, d);
            ly->router_bias = bind_vec(b, "block_sparse_moe.gate.e_score_correction_bias", L, c->num_experts, 0, 0);
            ly->rdown = bind_mat(b, "block_sparse_moe.routed_expert_down_proj.weight", L, c->latent_size, d);
            ly->rup = bind_mat(b, "block_sparse_moe.routed_expert_up_proj.weight", L, d, c->latent_size);
            if (c->latent_norm)
                ly->rnorm = bind_vec(b, "block_sparse_moe.routed_expert_norm.weight", L, c->latent_size, 0, 0);
            ly->sh_gate = bind_mat(b, "block_sparse_moe.shared_experts.gate_proj.weight", L, Fs, d);
            ly->sh_up = bind_mat(b, "block_sparse_moe.shared_experts.up_proj.weight", L, Fs, d);
            ly->sh_down = bind_mat(b, "block_sparse_moe.shared_experts.down_proj.weight", L, d, Fs);
            tb += mat_bytes(&ly->router) + mat_bytes(&ly->rdown) + mat_bytes(&ly->rup) + mat_bytes(&ly->sh_gate) +
                  mat_bytes(&ly->sh_up) + mat_bytes(&ly->sh_down);
            vecs += (uint64_t)c->num_experts + c->latent_size;
        }
    }
    /* vectors are counted at their stored width: bf16 unless the trunk is f32 */
    m->trunk_bytes_fixed = tb + vecs * (m->embed.dt == SHOAL_DT_F32 ? 4u : 2u);
    m->lm_head_bytes = mat_bytes(&m->lm_head);
    m->embed_row_bytes = (uint64_t)d * (m->embed.dt == SHOAL_DT_F32 ? 4u : 2u);
}

/* ---- stop ids ------------------------------------------------------------- */

static void add_eos(shoal_model_info *in, int id)
{
    if (id < 0)
        return;
    for (int i = 0; i < in->n_eos; i++)
        if (in->eos[i] == id)
            return;
    if (in->n_eos == SHOAL_MAX_EOS)
        return;
    int i = in->n_eos++;
    while (i > 0 && in->eos[i - 1] > id) {
        in->eos[i] = in->eos[i - 1];
        i--;
    }
    in->eos[i] = id;
}

/* tokenizer_config.json: eos_token (a string or {"content": ...}) resolved
 * through added_tokens_decoder {"<id>": {"content": ...}}. Absent file: no
 * extra id. A present but unreadable or unresolvable entry is refused. */
static int tokenizer_eos(const char *dir, int vocab, int *out_id, char *err, size_t errlen)
{
    char path[4096];
    *out_id = -1;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    int orc = 0;
    FILE *f = shoal_fopen_regular(path, &orc); /* a FIFO must not block the load */
    if (!f)
        return orc == -ENOENT ? 0 : shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: %s", path,
                                                  orc == SHOAL_EFORMAT ? "not a regular file" : strerror(-orc));
    json_error_t je;
    json_t *root = json_loadf(f, JSON_DECODE_INT_AS_REAL, &je);
    fclose(f);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s:%d: %s", path, je.line, je.text);
    int rc = 0;
    json_t *eos = json_object_get(root, "eos_token");
    const char *name = NULL;
    if (json_is_string(eos))
        name = json_string_value(eos);
    else if (json_is_object(eos) && json_is_string(json_object_get(eos, "content")))
        name = json_string_value(json_object_get(eos, "content"));
    else if (eos && !json_is_null(eos))
        rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: eos_token is neither a string nor {content}", path);
    if (name) {
        json_t *dec = json_object_get(root, "added_tokens_decoder");
        const char *key;
        json_t *v;
        int found = 0;
        json_object_foreach(dec, key, v)
        {
            json_t *ct = json_object_get(v, "content");
            if (json_is_string(ct) && !strcmp(json_string_value(ct), name)) {
                char *end;
                long id = strtol(key, &end, 10);
                if (*end || id < 0 || id >= vocab) {
                    rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                                       "%s: added_tokens_decoder key \"%s\" for eos_token is not an id in [0, %d)",
                                       path, key, vocab);
                } else {
                    *out_id = (int)id;
                    found = 1;
                }
                break;
            }
        }
        if (!found && !rc)
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                               "%s: eos_token \"%s\" not found in added_tokens_decoder", path, name);
    }
    json_decref(root);
    return rc;
}

/* ---- open / close --------------------------------------------------------- */

/* The stored kind of the routed experts: MXFP4 from the config, else the
 * dtype of the first expert's w1 (BF16 when the store lacks experts). */
static shoal_expert_kind expert_kind(const shoal_model *m, const char *prefix)
{
    const shoal_k3cfg *c = &m->cfg;
    if (c->expert_format == SHOAL_EXPERTS_MXFP4)
        return SHOAL_EXPERT_MXFP4;
    for (int L = 0; L < c->num_layers; L++) {
        if (!c->is_moe[L])
            continue;
        char name[256];
        snprintf(name, sizeof name, "%smodel.layers.%d.block_sparse_moe.experts.0.w1.weight", prefix, L);
        const shoal_tensor *t = shoal_st_find(m->st, name);
        return t && t->dtype == SHOAL_DT_F32 ? SHOAL_EXPERT_F32 : SHOAL_EXPERT_BF16;
    }
    return SHOAL_EXPERT_BF16;
}

void shoal_model_seq_bytes(const shoal_k3cfg *c, size_t *fixed, size_t *per_token)
{
    size_t C = (size_t)c->kda_heads * c->kda_head_dim;
    *fixed = sizeof(float) * ((size_t)c->num_kda * c->kda_heads * (size_t)c->kda_head_dim * c->kda_head_dim +
                              (size_t)c->num_kda * 3 * (size_t)(c->conv_kernel - 1) * C);
    *per_token = sizeof(float) * (size_t)c->num_mla * ((size_t)c->kv_lora_rank + c->qk_rope_dim);
}

int shoal_model_open(shoal_model **out, const char *dir, const shoal_model_opts *opts, char *err, size_t errlen)
{
    *out = NULL;
    if (!opts || opts->max_context < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "model open: opts.max_context must be > 0");
    if (opts->max_batch < 0 || opts->threads < 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "model open: negative max_batch or threads");
    shoal_model *m = shoal_xcalloc(1, sizeof *m);
    m->opts = *opts;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int rc = shoal_k3cfg_load(&m->cfg, path, err, errlen);
    if (rc)
        goto fail;
    const shoal_k3cfg *c = &m->cfg;
    if (opts->threads > 0)
        omp_set_num_threads(opts->threads);
    rc = shoal_kernels_init();
    if (rc) {
        shoal_err_set(err, errlen, rc, "kernels: cannot select them (SHOAL_ISA, SHOAL_MX_DECODE, SHOAL_MU_FOLD or SHOAL_AMX_VARIANT names a kernel this build or CPU lacks?)");
        goto fail;
    }

    shoal_st_opts so = {.map = 1};
    rc = shoal_st_open(&m->st, dir, &so, err, errlen);
    if (rc)
        goto fail;

    problems pr = {.err = err, .errlen = errlen};
    if (err && errlen)
        err[0] = 0;
    binder b = {.m = m, .pr = &pr};
    /* nested kimi_k3 checkpoints prefix every text tensor with "language_model." */
    snprintf(b.prefix, sizeof b.prefix, "%s",
             shoal_st_find(m->st, "language_model.model.embed_tokens.weight") ? "language_model." : "");
    m->layers = shoal_xcalloc((size_t)c->num_layers, sizeof *m->layers);
    /* the schema names every tensor the model must have; only a complete
     * inventory is bound (the binder re-checks what it reads) */
    inventory inv = {.pr = &pr, .remote_experts = opts->remote_experts};
    char sum[512];
    shoal_k3schema_check(c, m->st, NULL, on_inventory_problem, &inv, sum, sizeof sum);
    if (inv.unexpected > 8)
        SHOAL_WARN("model: %llu unexpected text tensors in all (ignored)", (unsigned long long)inv.unexpected);
    if (pr.n == 0)
        bind_all(&b);
    if (!opts->remote_experts && c->num_moe > 0 && pr.n == 0) {
        /* the backend appends its own problems (one per line) to err */
        char pre[80];
        snprintf(pre, sizeof pre, "%smodel.layers.", b.prefix);
        char *eb = NULL;
        size_t eblen = 0;
        if (err && errlen > pr.used + 2) {
            eb = err + pr.used + (pr.used ? 1 : 0);
            eblen = errlen - pr.used - (pr.used ? 1 : 0);
        }
        int erc = shoal_experts_local_open(&m->experts, m->st, c, pre, opts->max_batch ? opts->max_batch : 256, eb,
                                           eblen);
        if (erc) {
            if (eb && *eb) {
                if (pr.used)
                    err[pr.used] = '\n';
                for (const char *q = eb; *q; q++)
                    pr.n += *q == '\n';
                pr.n++;
                pr.used += strlen(eb) + (pr.used ? 1 : 0);
            } else {
                pr.n++;
            }
        } else {
            m->have_experts = 1;
        }
    }
    if (!pr.n)
        shoal__engine_mapped_open(m, b.prefix);
    if (pr.n) {
        char tail[64];
        snprintf(tail, sizeof tail, "\n(%d problem%s with the model's tensors)", pr.n, pr.n == 1 ? "" : "s");
        if (err && errlen > pr.used + strlen(tail) + 1)
            strcat(err, tail);
        rc = SHOAL_EMODEL;
        goto fail;
    }
    if (!opts->quiet && b.nf32) { /* one debug line: it is the same at every start */
        char line[1024];
        size_t u = 0;
        for (int i = 0; i < b.nf32 && u < sizeof line; i++)
            u += (size_t)snprintf(line + u, sizeof line - u, "%s%s %llu/%llu", i ? ", " : "", b.f32[i].kind,
                                  (unsigned long long)b.f32[i].nonzero, (unsigned long long)b.f32[i].total);
        SHOAL_DEBUG("model: F32 tensors, elements with non-zero low 16 bits (not bf16-exact) of all: %s", line);
    }

    /* info */
    shoal_model_info *in = &m->info;
    in->cfg = &m->cfg;
    in->vocab = c->vocab_size;
    in->max_context = opts->max_context;
    in->max_batch = opts->max_batch ? opts->max_batch : 256;
    add_eos(in, c->eos_token_id);
    int tok_eos;
    rc = tokenizer_eos(opts->tokenizer_dir ? opts->tokenizer_dir : dir, c->vocab_size, &tok_eos, err, errlen);
    if (rc)
        goto fail;
    add_eos(in, tok_eos);
    shoal_model_seq_bytes(c, &in->seq_fixed_bytes, &in->seq_bytes_per_token);
    in->trunk_bytes_per_token = m->trunk_bytes_fixed + m->lm_head_bytes + m->embed_row_bytes;
    in->expert_kind = expert_kind(m, b.prefix);
    in->expert_bytes = c->num_moe ? shoal_experts_local_expert_bytes(c, in->expert_kind) : 0;
    in->remote_experts = opts->remote_experts;

    /* scratch size, then the trunk under a budget (its plan is printed
     * before anything large is allocated), then the scratch */
    int B = in->max_batch, k = c->experts_per_token;
    m->scratch_floats = shoal__engine_scratch_layout(&m->sc, NULL, c, B, opts->max_context);
    in->trunk_mode = opts->trunk_mode;
    if (opts->trunk_mode != SHOAL_TRUNK_MAPPED) {
        rc = shoal__engine_trunk_open(m, sizeof(float) * m->scratch_floats, err, errlen);
        if (rc)
            goto fail;
    } else {
        m->n_head = 1;
        m->head = shoal_xcalloc(1, sizeof *m->head);
        m->head[0] = m->lm_head;
    }
    if (posix_memalign((void **)&m->scratch, 64, sizeof(float) * m->scratch_floats))
        SHOAL_PANIC("out of memory: %zu bytes of forward scratch", sizeof(float) * m->scratch_floats);
    memset(m->scratch, 0, sizeof(float) * m->scratch_floats);
    in->scratch_bytes = sizeof(float) * m->scratch_floats;
    shoal__engine_scratch_layout(&m->sc, m->scratch, c, B, opts->max_context);
    m->topk_ids = shoal_xcalloc((size_t)B * (k > 0 ? k : 1), sizeof(int32_t));
    m->topk_w = shoal_xcalloc((size_t)B * (k > 0 ? k : 1), sizeof(float));
    m->ex_y = shoal_xcalloc((size_t)B * (k > 0 ? k : 1) * (c->latent_size > 0 ? c->latent_size : 1), sizeof(uint16_t));
    m->seqv = shoal_xcalloc((size_t)B, sizeof(shoal_seq *));

    if (!opts->quiet) {
        SHOAL_INFO("model: %s: %d layers (%d KDA, %d MLA, %d MoE), d=%d, vocab %d, experts %d top-%d (%s%s), "
                   "trunk %s, gate %s, kernels %s, numerics %s (mu path %s), %d threads",
                   dir, c->num_layers, c->num_kda, c->num_mla, c->num_moe, c->hidden_size, c->vocab_size,
                   c->num_experts, c->experts_per_token,
                   c->expert_format == SHOAL_EXPERTS_MXFP4 ? "MXFP4" : "unquantized",
                   opts->remote_experts ? ", remote" : "", m->embed.dt == SHOAL_DT_F32 ? "F32" : "BF16",
                   c->gate == SHOAL_GATE_LOWER_BOUND ? "lower-bound" : "softplus",
                   shoal_isa_name(shoal_kernels_isa()), shoal_numerics_name(shoal_kernels_numerics()),
                   shoal_kernels_mu_engine(), omp_get_max_threads());
        SHOAL_INFO("model: sequence state %zu B fixed (KDA states + conv windows) + %zu B per token (MLA latent "
                   "cache); forward scratch %zu MiB for %d tokens per chunk, %d max context",
                   in->seq_fixed_bytes, in->seq_bytes_per_token, sizeof(float) * m->scratch_floats >> 20, B,
                   opts->max_context);
        SHOAL_INFO("model: weight bytes per decoded token: trunk %llu + %d routed experts x %llu per MoE layer",
                   (unsigned long long)in->trunk_bytes_per_token, c->experts_per_token,
                   (unsigned long long)in->expert_bytes);
    }
    *out = m;
    return 0;
fail:
    shoal_model_close(m);
    return rc ? rc : SHOAL_ECONFIG;
}

void shoal_model_close(shoal_model *m)
{
    if (!m)
        return;
    if (m->seqs_alive)
        SHOAL_PANIC("shoal_model_close with %d sequences alive", m->seqs_alive);
    if (m->experts.vt && m->experts.vt->close)
        m->experts.vt->close(m->experts.self);
    if (m->rmat.vt && m->rmat.vt->close)
        m->rmat.vt->close(m->rmat.self);
    shoal__engine_trunk_close(m);
    free(m->head);
    for (int i = 0; i < m->n_owned; i++)
        free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->scratch);
    free(m->topk_ids);
    free(m->pf_mark);
    free(m->pf_list);
    free(m->pf_topk);
    free(m->topk_w);
    free(m->ex_y);
    free(m->seqv);
    shoal__engine_mapped_close(m);
    shoal_st_close(m->st);
    free(m);
}

void shoal_model_get_info(const shoal_model *m, shoal_model_info *out)
{
    *out = m->info;
}

const shoal_st *shoal_model_store(const shoal_model *m)
{
    return m->st;
}

void shoal_model_set_prefetch(shoal_model *m, int on)
{
    if (on && !m->pf_mark) {
        int E = m->cfg.num_experts > 0 ? m->cfg.num_experts : 1, k = m->cfg.experts_per_token > 0
                                                                        ? m->cfg.experts_per_token
                                                                        : 1;
        m->pf_mark = shoal_xcalloc((size_t)E, sizeof *m->pf_mark);
        m->pf_list = shoal_xcalloc((size_t)E, sizeof *m->pf_list);
        m->pf_topk = shoal_xcalloc((size_t)k, sizeof *m->pf_topk);
    }
    m->pf_on = on && m->cfg.num_moe > 0;
    m->pf_layer = -1;
}

int shoal_model_set_experts(shoal_model *m, shoal_experts *b, char *err, size_t errlen)
{
    if (!b || !b->vt || !b->vt->submit || !b->vt->gather)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "set_experts: backend without submit/gather");
    if (m->experts.vt && m->experts.vt->close)
        m->experts.vt->close(m->experts.self);
    m->experts = *b;
    m->have_experts = 1;
    b->vt = NULL;
    b->self = NULL;
    return 0;
}

/* Every matrix the forward applies with mm() (forward.c): the layers' and
 * lm_head (one slice when mapped). kv_b is applied per head (not listed). */
static int each_wmat(shoal_model *m, shoal__wmat **out, int cap)
{
    int n = 0;
    for (int L = 0; L < m->cfg.num_layers; L++) {
        shoal__layer *ly = &m->layers[L];
        shoal__wmat *w[] = {&ly->g_proj,   &ly->o_proj,  &ly->q_proj,  &ly->k_proj,   &ly->v_proj,  &ly->f_a,
                            &ly->f_b,      &ly->b_proj,  &ly->q_a,     &ly->q_b,      &ly->kv_a,    &ly->mlp_gate,
                            &ly->mlp_up,   &ly->mlp_down, &ly->router, &ly->rdown,    &ly->rup,     &ly->sh_gate,
                            &ly->sh_up,    &ly->sh_down};
        for (size_t i = 0; i < sizeof w / sizeof *w; i++)
            if (w[i]->t && n < cap)
                out[n++] = w[i];
    }
    for (int i = 0; i < m->n_head && n < cap; i++)
        out[n++] = &m->head[i];
    return n;
}

int shoal_model_set_rmat(shoal_model *m, shoal_rmat *b, int *nremote, char *err, size_t errlen)
{
    if (!b || !b->vt || !b->vt->has || !b->vt->submit || !b->vt->gather)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "set_rmat: backend without has/submit/gather");
    if (m->ts || m->tunits)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "remote trunk rows need the mapped trunk: drop the trunk budget (--trunk-gb)");
    int cap = 20 * m->cfg.num_layers + m->n_head, n = 0;
    shoal__wmat **all = shoal_xcalloc((size_t)cap, sizeof *all);
    int k = each_wmat(m, all, cap);
    for (int i = 0; i < k; i++) {
        shoal__wmat *w = all[i];
        w->remote = w->t_off == 0 && w->rows == (int)w->t->shape[0] &&
                    b->vt->has(b->self, w->t->name, w->rows, w->cols);
        n += w->remote;
    }
    for (int L = 0; L < m->cfg.num_layers; L++) {
        shoal__layer *ly = &m->layers[L];
        ly->fab_chain = 0;
        if (ly->kind == SHOAL_ATTN_KDA && ly->f_a.remote && ly->f_b.remote && b->vt->has_chain)
            ly->fab_chain = b->vt->has_chain(b->self, ly->f_a.t->name, ly->f_a.rows, ly->f_a.cols, ly->f_b.t->name,
                                             ly->f_b.rows, ly->f_b.cols) == 1;
    }
    /* The coordinator holds none of the remote rows: each remote matrix's
     * pages are given up (and made inaccessible, so a stray read faults
     * rather than making them resident again), and so is the embedding
     * table, whose rows the forward then reads with pread (a mapped lookup
     * would make the page-cache folio around each row resident, up to MiBs
     * per token on a kernel with large folios). A tensor another, local
     * view still reads (tied embeddings, a sliced lm_head) is kept. */
    uint64_t rel = 0;
    int rc = 0;
    for (int i = 0; i < k && !rc; i++) {
        int shared = 0;
        for (int j = 0; j < k && all[i]->remote; j++)
            shared |= !all[j]->remote && all[j]->t == all[i]->t;
        shared |= all[i]->t == m->embed.t;
        uint64_t r = 0;
        if (all[i]->remote && !shared)
            rc = shoal_st_release(m->st, all[i]->t, &r, err, errlen);
        rel += r;
    }
    int emb_shared = 0;
    for (int j = 0; j < k; j++)
        emb_shared |= !all[j]->remote && all[j]->t == m->embed.t;
    free(all);
    if (!rc && n && !emb_shared && !m->emb_rows) {
        uint64_t r = 0;
        size_t eb = (size_t)m->info.max_batch * (size_t)m->cfg.hidden_size * shoal_dtype_size(m->embed.dt);
        if (posix_memalign(&m->emb_rows, 64, eb))
            SHOAL_PANIC("out of memory: embedding row buffer");
        memset(m->emb_rows, 0, eb);
        m->embed_pread = 1;
        rc = shoal_st_release(m->st, m->embed.t, &r, err, errlen);
        rel += r;
    }
    if (rc)
        return rc; /* the backend is not taken: the caller closes it */
    if (n)
        SHOAL_INFO("trunk: %.1f MiB of remote matrices and the embedding table given up here%s",
                   (double)rel / 1048576.0, m->embed_pread ? " (embedding rows are read with pread)" : "");
    if (m->rmat.vt && m->rmat.vt->close)
        m->rmat.vt->close(m->rmat.self);
    m->rmat = *b;
    b->vt = NULL;
    b->self = NULL;
    if (nremote)
        *nremote = n;
    return 0;
}

void shoal_model_get_stats(const shoal_model *m, shoal_model_stats *out)
{
    *out = m->stats;
    if (m->ts) {
        shoal_tstream_stats st;
        shoal_tstream_get_stats(m->ts, &st);
        out->trunk_read_bytes += st.bytes_read - m->ts_base_read;
        out->trunk_stall_s += st.stall_s - m->ts_base_stall;
    }
}

void shoal_model_trunk_counters(const shoal_model *m, uint64_t *read_bytes, double *stall_s)
{
    *read_bytes = 0;
    *stall_s = 0;
    if (m->ts) {
        shoal_tstream_stats st;
        shoal_tstream_get_stats(m->ts, &st);
        *read_bytes = st.bytes_read;
        *stall_s = st.stall_s;
    }
}

void shoal_model_reset_stats(shoal_model *m)
{
    memset(&m->stats, 0, sizeof m->stats);
    if (m->ts) {
        shoal_tstream_stats st;
        shoal_tstream_get_stats(m->ts, &st);
        m->ts_base_read = st.bytes_read;
        m->ts_base_stall = st.stall_s;
    }
}

void shoal_model_set_cancel(shoal_model *m, const atomic_int *flag)
{
    m->cancel = flag;
}

void shoal_model_set_monitor(shoal_model *m, shoal_cmetrics *cm, shoal_trace *trace)
{
    m->cm = cm;
    m->rtrace = trace;
}
