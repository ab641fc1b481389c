/* K3 config reader (common/k3cfg.h): jansson for the JSON, then every field
 * checked against what the engine implements. Problems are collected, not
 * returned at the first one, so one run lists everything that is wrong. */
#include "common/k3cfg.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"

typedef struct {
    char *err;
    size_t errlen, used;
    int nbad;
    const char *pre; /* "text_config." for the nested form, "" for the flat one */
} probs;

static void bad(probs *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void bad(probs *p, const char *fmt, ...)
{
    p->nbad++;
    if (!p->err || !p->errlen || p->used + 1 >= p->errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(p->err + p->used, p->errlen - p->used, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    p->used += (size_t)n;
    if (p->used + 1 < p->errlen) {
        p->err[p->used++] = '\n';
        p->err[p->used] = 0;
    } else {
        p->used = p->errlen - 1;
    }
}

static const char *jtype(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "?";
}

/* Integer field in [lo, hi]; returns 1 if read. */
static int get_int(probs *p, const json_t *o, const char *sub, const char *key, long long lo, long long hi,
                   int *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v) {
        bad(p, "%s%s%s: missing", p->pre, sub, key);
        return 0;
    }
    if (!json_is_integer(v)) {
        bad(p, "%s%s%s: expected an integer, got %s", p->pre, sub, key, jtype(v));
        return 0;
    }
    long long x = json_integer_value(v);
    if (x < lo || x > hi) {
        bad(p, "%s%s%s: %lld is out of range [%lld, %lld]", p->pre, sub, key, x, lo, hi);
        return 0;
    }
    *out = (int)x;
    return 1;
}

static int get_num(probs *p, const json_t *o, const char *sub, const char *key, double lo, double hi,
                   float *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v) {
        bad(p, "%s%s%s: missing", p->pre, sub, key);
        return 0;
    }
    if (!json_is_number(v)) {
        bad(p, "%s%s%s: expected a number, got %s", p->pre, sub, key, jtype(v));
        return 0;
    }
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi)) {
        bad(p, "%s%s%s: %g is out of range [%g, %g]", p->pre, sub, key, x, lo, hi);
        return 0;
    }
    *out = (float)x;
    return 1;
}

static int get_bool(probs *p, const json_t *o, const char *sub, const char *key, int *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v) {
        bad(p, "%s%s%s: missing", p->pre, sub, key);
        return 0;
    }
    if (!json_is_boolean(v)) {
        bad(p, "%s%s%s: expected a boolean, got %s", p->pre, sub, key, jtype(v));
        return 0;
    }
    *out = json_is_true(v);
    return 1;
}

static const char *get_str(probs *p, const json_t *o, const char *sub, const char *key)
{
    const json_t *v = json_object_get(o, key);
    if (!v) {
        bad(p, "%s%s%s: missing", p->pre, sub, key);
        return NULL;
    }
    if (!json_is_string(v)) {
        bad(p, "%s%s%s: expected a string, got %s", p->pre, sub, key, jtype(v));
        return NULL;
    }
    return json_string_value(v);
}

/* A field the engine supports with exactly one value (a checked choice). */
static void want_str(probs *p, const json_t *o, const char *key, const char *want)
{
    const char *s = get_str(p, o, "", key);
    if (s && strcmp(s, want))
        bad(p, "%s%s: '%.64s' is not supported (only '%s')", p->pre, key, s, want);
}

static void want_bool(probs *p, const json_t *o, const char *sub, const char *key, int want)
{
    int b;
    if (get_bool(p, o, sub, key, &b) && b != want)
        bad(p, "%s%s%s: %s is not supported (only %s)", p->pre, sub, key, b ? "true" : "false",
            want ? "true" : "false");
}

/* Optional field: when present it must have the one supported value. */
static void opt_int_eq(probs *p, const json_t *o, const char *key, int want)
{
    const json_t *v = json_object_get(o, key);
    if (!v)
        return;
    if (!json_is_integer(v) || json_integer_value(v) != want)
        bad(p, "%s%s: must be %d when present", p->pre, key, want);
}

/* A 1-indexed layer list; marks seen[L] (0-indexed). Returns entries read. */
static int get_layers(probs *p, const json_t *la, const char *key, int nl, uint8_t *seen, uint8_t tag)
{
    const json_t *v = json_object_get(la, key);
    if (!v) {
        bad(p, "%slinear_attn_config.%s: missing", p->pre, key);
        return 0;
    }
    if (!json_is_array(v)) {
        bad(p, "%slinear_attn_config.%s: expected an array, got %s", p->pre, key, jtype(v));
        return 0;
    }
    size_t i;
    const json_t *x;
    int n = 0;
    json_array_foreach(v, i, x) {
        if (!json_is_integer(x)) {
            bad(p, "%slinear_attn_config.%s[%zu]: expected an integer, got %s", p->pre, key, i, jtype(x));
            continue;
        }
        long long l = json_integer_value(x);
        if (nl <= 0) /* num_hidden_layers itself is bad: range unknown */
            continue;
        if (l < 1 || l > nl) {
            bad(p, "%slinear_attn_config.%s[%zu]: layer %lld is outside 1..%d (the list is 1-indexed)", p->pre,
                key, i, l, nl);
            continue;
        }
        if (seen[l - 1] & tag) {
            bad(p, "%slinear_attn_config.%s: layer %lld listed twice", p->pre, key, l);
            continue;
        }
        seen[l - 1] |= tag;
        n++;
    }
    return n;
}

static void read_quant(probs *p, const json_t *q, shoal_k3cfg *c)
{
    const char *pre = "quantization_config.";
    if (!json_is_object(q)) {
        bad(p, "%s%s: expected an object, got %s", p->pre, "quantization_config", jtype(q));
        return;
    }
    const char *m = get_str(p, q, pre, "quant_method");
    if (m && strcmp(m, "compressed-tensors"))
        bad(p, "%squantization_config.quant_method: '%.64s' is not supported (only 'compressed-tensors')", p->pre,
            m);
    const json_t *fmt = json_object_get(q, "format");
    if (fmt && (!json_is_string(fmt) || strcmp(json_string_value(fmt), "mxfp4-pack-quantized")))
        bad(p, "%squantization_config.format: only 'mxfp4-pack-quantized' is supported", p->pre);
    const json_t *groups = json_object_get(q, "config_groups");
    if (!groups) {
        bad(p, "%squantization_config.config_groups: missing", p->pre);
        return;
    }
    if (!json_is_object(groups) || json_object_size(groups) != 1) {
        bad(p, "%squantization_config.config_groups: expected an object with exactly one group", p->pre);
        return;
    }
    const char *gname;
    const json_t *g;
    json_object_foreach((json_t *)groups, gname, g) {
        char sub[160];
        if (!json_is_object(g)) {
            bad(p, "%squantization_config.config_groups.%s: expected an object", p->pre, gname);
            return;
        }
        snprintf(sub, sizeof sub, "quantization_config.config_groups.%.64s.", gname);
        const char *gf = get_str(p, g, sub, "format");
        if (gf && strcmp(gf, "mxfp4-pack-quantized"))
            bad(p, "%s%sformat: '%.64s' is not supported (only 'mxfp4-pack-quantized')", p->pre, sub, gf);
        const json_t *tg = json_object_get(g, "targets");
        if (!json_is_array(tg) || json_array_size(tg) != 1 || !json_is_string(json_array_get(tg, 0)) ||
            strcmp(json_string_value(json_array_get(tg, 0)), "Linear"))
            bad(p, "%s%stargets: must be [\"Linear\"]", p->pre, sub);
        const json_t *w = json_object_get(g, "weights");
        if (!json_is_object(w)) {
            bad(p, "%s%sweights: %s", p->pre, sub, w ? "expected an object" : "missing");
            return;
        }
        snprintf(sub, sizeof sub, "quantization_config.config_groups.%.64s.weights.", gname);
        int bits, gs, sym;
        if (get_int(p, w, sub, "num_bits", 1, 64, &bits) && bits != 4)
            bad(p, "%s%snum_bits: %d is not supported (MXFP4 has 4)", p->pre, sub, bits);
        const char *ty = get_str(p, w, sub, "type");
        if (ty && strcmp(ty, "float"))
            bad(p, "%s%stype: '%.64s' is not supported (only 'float')", p->pre, sub, ty);
        const char *stg = get_str(p, w, sub, "strategy");
        if (stg && strcmp(stg, "group"))
            bad(p, "%s%sstrategy: '%.64s' is not supported (only 'group')", p->pre, sub, stg);
        if (get_int(p, w, sub, "group_size", 1, 1 << 20, &gs)) {
            if (gs != 32)
                bad(p, "%s%sgroup_size: %d is not supported (MXFP4 groups are 32)", p->pre, sub, gs);
            else
                c->expert_group_size = gs;
        }
        if (get_bool(p, w, sub, "symmetric", &sym) && !sym)
            bad(p, "%s%ssymmetric: false is not supported", p->pre, sub);
    }
    c->expert_format = SHOAL_EXPERTS_MXFP4;
}

static int parse_root(shoal_k3cfg *c, json_t *root, probs *p)
{
    memset(c, 0, sizeof *c);
    if (!json_is_object(root)) {
        bad(p, "config: the top level must be an object");
        return 0;
    }
    const char *mt = get_str(p, root, "", "model_type");
    if (!mt)
        return 0;
    const json_t *t = root;
    if (!strcmp(mt, "kimi_k3")) {
        t = json_object_get(root, "text_config");
        if (!json_is_object(t)) {
            bad(p, "text_config: %s", t ? "expected an object" : "missing (model_type kimi_k3 is the nested form)");
            return 0;
        }
        p->pre = "text_config.";
        const char *tmt = get_str(p, t, "", "model_type");
        if (tmt && strcmp(tmt, "kimi_linear"))
            bad(p, "text_config.model_type: '%.64s' is not supported (only 'kimi_linear')", tmt);
    } else if (strcmp(mt, "kimi_linear")) {
        bad(p, "model_type: '%.64s' is not supported (only 'kimi_k3' nested or 'kimi_linear' flat)", mt);
        return 0;
    }
    snprintf(c->model_type, sizeof c->model_type, "%s", mt);

    /* trunk dtype: "dtype" (transformers >= 4.56) or the older "torch_dtype" */
    const char *dkey = json_object_get(t, "dtype") ? "dtype" : "torch_dtype";
    const char *dt = json_object_get(t, dkey) ? get_str(p, t, "", dkey) : NULL;
    if (!json_object_get(t, dkey))
        bad(p, "%sdtype: missing", p->pre);
    else if (dt && strcmp(dt, "bfloat16") && strcmp(dt, "float32"))
        bad(p, "%s%s: '%.32s' is not supported (only 'bfloat16' or 'float32')", p->pre, dkey, dt);
    else if (dt)
        snprintf(c->dtype, sizeof c->dtype, "%s", dt);

    const int DIM = 1 << 20;
    get_int(p, t, "", "vocab_size", 1, 1 << 24, &c->vocab_size);
    get_int(p, t, "", "hidden_size", 1, DIM, &c->hidden_size);
    int nl_ok = get_int(p, t, "", "num_hidden_layers", 1, SHOAL_MAX_LAYERS, &c->num_layers);
    get_num(p, t, "", "rms_norm_eps", 1e-30, 1.0, &c->rms_norm_eps);
    get_int(p, t, "", "max_position_embeddings", 1, 1 << 30, &c->max_position);

    get_int(p, t, "", "num_attention_heads", 1, 4096, &c->mla_heads);
    const json_t *ql = json_object_get(t, "q_lora_rank");
    if (ql && json_is_null(ql))
        bad(p, "%sq_lora_rank: null (MLA without a low-rank query) is not supported", p->pre);
    else
        get_int(p, t, "", "q_lora_rank", 1, DIM, &c->q_lora_rank);
    get_int(p, t, "", "kv_lora_rank", 1, DIM, &c->kv_lora_rank);
    get_int(p, t, "", "qk_nope_head_dim", 1, 65536, &c->qk_nope_dim);
    get_int(p, t, "", "qk_rope_head_dim", 0, 65536, &c->qk_rope_dim);
    get_int(p, t, "", "v_head_dim", 1, 65536, &c->v_head_dim);
    want_bool(p, t, "", "mla_use_nope", 1);
    want_bool(p, t, "", "mla_use_output_gate", 1);
    const json_t *kvh = json_object_get(t, "num_key_value_heads");
    if (kvh && c->mla_heads && (!json_is_integer(kvh) || json_integer_value(kvh) != c->mla_heads))
        bad(p, "%snum_key_value_heads: must equal num_attention_heads (%d) when present", p->pre, c->mla_heads);

    /* KDA */
    const json_t *la = json_object_get(t, "linear_attn_config");
    uint8_t seen[SHOAL_MAX_LAYERS] = {0};
    int nk = 0, nm = 0;
    if (!la) {
        bad(p, "%slinear_attn_config: missing", p->pre);
    } else if (!json_is_object(la)) {
        bad(p, "%slinear_attn_config: expected an object, got %s", p->pre, jtype(la));
    } else {
        const char *sub = "linear_attn_config.";
        get_int(p, la, sub, "num_heads", 1, 4096, &c->kda_heads);
        get_int(p, la, sub, "head_dim", 1, 65536, &c->kda_head_dim);
        get_int(p, la, sub, "short_conv_kernel_size", 1, 64, &c->conv_kernel);
        want_bool(p, la, sub, "use_full_rank_gate", 1);
        const json_t *glb = json_object_get(la, "gate_lower_bound");
        if (!glb) {
            c->gate = SHOAL_GATE_SOFTPLUS; /* the Kimi-Linear gate: defined by absence, SPEC §3.3 */
        } else if (get_num(p, la, sub, "gate_lower_bound", -1e6, 0.0, &c->gate_lower_bound)) {
            c->gate = SHOAL_GATE_LOWER_BOUND;
        }
        int nlay = nl_ok ? c->num_layers : 0;
        nk = get_layers(p, la, "kda_layers", nlay, seen, 1);
        nm = get_layers(p, la, "full_attn_layers", nlay, seen, 2);
        if (nlay) {
            int nboth = 0, nnone = 0, fb = -1, fn = -1;
            for (int l = 0; l < nlay; l++) {
                if (seen[l] == 3 && !nboth++)
                    fb = l + 1;
                if (seen[l] == 0 && !nnone++)
                    fn = l + 1;
            }
            if (nboth)
                bad(p, "%slinear_attn_config: %d layer(s) listed as both KDA and MLA (first: %d, 1-indexed)", p->pre,
                    nboth, fb);
            if (nnone)
                bad(p, "%slinear_attn_config: %d layer(s) in neither kda_layers nor full_attn_layers (first: %d, "
                       "1-indexed)",
                    p->pre, nnone, fn);
        }
    }

    /* MLPs, MoE */
    const char *act = get_str(p, t, "", "hidden_act");
    if (act && strcmp(act, "situ"))
        bad(p, "%shidden_act: '%.32s' is not supported (only 'situ')", p->pre, act);
    get_num(p, t, "", "activation_situ_beta", 1e-6, 1e6, &c->situ_beta);
    get_num(p, t, "", "activation_situ_linear_beta", 1e-6, 1e6, &c->situ_linear_beta);
    get_int(p, t, "", "intermediate_size", 1, DIM, &c->intermediate_size);
    get_int(p, t, "", "moe_intermediate_size", 1, DIM, &c->moe_intermediate_size);
    get_int(p, t, "", "routed_expert_hidden_size", 1, DIM, &c->latent_size);
    get_bool(p, t, "", "latent_moe_use_norm", &c->latent_norm);
    int ne_ok = get_int(p, t, "", "num_experts", 1, 1 << 16, &c->num_experts);
    if (get_int(p, t, "", "num_experts_per_token", 1, 1 << 16, &c->experts_per_token) && ne_ok &&
        c->experts_per_token > c->num_experts)
        bad(p, "%snum_experts_per_token: %d exceeds num_experts %d", p->pre, c->experts_per_token, c->num_experts);
    get_int(p, t, "", "num_shared_experts", 0, 64, &c->num_shared_experts);
    int fk_ok = get_int(p, t, "", "first_k_dense_replace", 0, SHOAL_MAX_LAYERS, &c->first_k_dense);
    int mf_ok = get_int(p, t, "", "moe_layer_freq", 1, SHOAL_MAX_LAYERS, &c->moe_layer_freq);
    get_bool(p, t, "", "moe_renormalize", &c->renormalize);
    get_num(p, t, "", "routed_scaling_factor", 1e-6, 1e6, &c->routed_scaling);
    want_str(p, t, "moe_router_activation_func", "sigmoid");
    want_str(p, t, "topk_method", "noaux_tc");
    const json_t *ug = json_object_get(t, "use_grouped_topk");
    if (ug && json_is_true(ug)) { /* grouping is a no-op only with one group */
        opt_int_eq(p, t, "num_expert_group", 1);
        opt_int_eq(p, t, "topk_group", 1);
    } else if (ug && !json_is_false(ug)) {
        bad(p, "%suse_grouped_topk: expected a boolean, got %s", p->pre, jtype(ug));
    }
    opt_int_eq(p, t, "num_nextn_predict_layers", 0);
    want_bool(p, t, "", "tie_word_embeddings", 0);
    get_int(p, t, "", "attn_res_block_size", 1, SHOAL_MAX_LAYERS, &c->attn_res_block_size);

    /* experts storage: quantization_config present -> MXFP4, absent -> unquantized */
    const json_t *q = json_object_get(t, "quantization_config");
    if (q) {
        read_quant(p, q, c);
    } else {
        c->expert_format = SHOAL_EXPERTS_UNQUANTIZED;
        c->expert_group_size = 0;
    }
    if (c->expert_format == SHOAL_EXPERTS_MXFP4) {
        if (c->latent_size % 32)
            bad(p, "%srouted_expert_hidden_size: %d is not a multiple of the MXFP4 group (32)", p->pre,
                c->latent_size);
        if (c->moe_intermediate_size % 32)
            bad(p, "%smoe_intermediate_size: %d is not a multiple of the MXFP4 group (32)", p->pre,
                c->moe_intermediate_size);
    }

    int vocab = c->vocab_size > 0 ? c->vocab_size : 1 << 24;
    get_int(p, t, "", "bos_token_id", 0, vocab - 1, &c->bos_token_id);
    get_int(p, t, "", "eos_token_id", 0, vocab - 1, &c->eos_token_id);
    get_int(p, t, "", "pad_token_id", 0, vocab - 1, &c->pad_token_id);

    /* derived schedule */
    if (p->nbad == 0) {
        if (fk_ok && mf_ok && c->first_k_dense > c->num_layers)
            bad(p, "%sfirst_k_dense_replace: %d exceeds num_hidden_layers %d", p->pre, c->first_k_dense,
                c->num_layers);
        for (int l = 0; l < c->num_layers; l++) {
            c->attn[l] = (seen[l] & 2) ? SHOAL_ATTN_MLA : SHOAL_ATTN_KDA;
            /* MOD KimiDecoderLayer: MoE iff layer_idx >= first_k_dense_replace
             * and layer_idx % moe_layer_freq == 0 */
            c->is_moe[l] = l >= c->first_k_dense && l % c->moe_layer_freq == 0;
            c->block_start[l] = l % c->attn_res_block_size == 0;
            c->num_moe += c->is_moe[l];
        }
        c->num_kda = nk;
        c->num_mla = nm;
    }
    return p->nbad == 0;
}

int shoal_k3cfg_parse(shoal_k3cfg *cfg, const char *json, size_t len, char *err, size_t errlen)
{
    probs p = {.err = err, .errlen = errlen, .pre = ""};
    if (err && errlen)
        err[0] = 0;
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        memset(cfg, 0, sizeof *cfg);
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "config: malformed JSON at line %d column %d: %s",
                             je.line, je.column, je.text);
    }
    int ok = parse_root(cfg, root, &p);
    json_decref(root);
    if (!ok) {
        /* drop the trailing newline of the last line */
        if (err && p.used && p.used < errlen && err[p.used - 1] == '\n')
            err[p.used - 1] = 0;
        return SHOAL_ECONFIG;
    }
    return 0;
}

int shoal_k3cfg_load(shoal_k3cfg *cfg, const char *path, char *err, size_t errlen)
{
    int orc = 0;
    FILE *f = shoal_fopen_regular(path, &orc); /* a FIFO must not block the load */
    if (!f)
        return orc == SHOAL_EFORMAT ? shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: not a regular file", path)
                                    : shoal_err_set(err, errlen, orc, "%s: %s", path, strerror(-orc));
    char *buf;
    size_t n;
    int rc = shoal_read_stream(f, 64u << 20, &buf, &n);
    fclose(f);
    if (rc == -EFBIG)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: larger than 64 MiB, not a config", path);
    if (rc)
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: read error", path);
    char tmp[8192];
    rc = shoal_k3cfg_parse(cfg, buf, n, err ? tmp : NULL, err ? sizeof tmp : 0);
    free(buf);
    if (rc && err) {
        /* prefix every line with the file name */
        size_t o = 0;
        err[0] = 0;
        for (char *line = tmp, *nl; line && *line && o + 1 < errlen; line = nl ? nl + 1 : NULL) {
            nl = strchr(line, '\n');
            int k = snprintf(err + o, errlen - o, "%s%s: %.*s", o ? "\n" : "", path,
                             nl ? (int)(nl - line) : (int)strlen(line), line);
            if (k < 0)
                break;
            o += (size_t)k;
            if (o >= errlen)
                o = errlen - 1;
        }
    }
    return rc;
}
