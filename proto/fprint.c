/* Model fingerprint (PROTOCOL.md §5). The text format is the contract: a
 * change here is a protocol major version. */
#include "proto/fprint.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"

static void line(shoal_fprint *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line(shoal_fprint *f, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof buf - 1)
        SHOAL_PANIC("fingerprint line too long");
    buf[n++] = '\n';
    crypto_generichash_update(&f->st, (const unsigned char *)buf, (unsigned long long)n);
}

void shoal_fprint_begin(shoal_fprint *f, const shoal_k3cfg *c)
{
    crypto_generichash_init(&f->st, NULL, 0, SHOAL_PROTO_FP_BYTES);
    line(f, "shoal model fingerprint 1");
    line(f, "num_layers=%d", c->num_layers);
    line(f, "hidden_size=%d", c->hidden_size);
    line(f, "vocab_size=%d", c->vocab_size);
    line(f, "latent_size=%d", c->latent_size);
    line(f, "moe_intermediate_size=%d", c->moe_intermediate_size);
    line(f, "num_experts=%d", c->num_experts);
    line(f, "experts_per_token=%d", c->experts_per_token);
    line(f, "first_k_dense=%d", c->first_k_dense);
    line(f, "moe_layer_freq=%d", c->moe_layer_freq);
    line(f, "expert_format=%s", c->expert_format == SHOAL_EXPERTS_MXFP4 ? "mxfp4" : "unquantized");
    line(f, "expert_group_size=%d", c->expert_group_size);
    line(f, "situ_beta=%.9g", (double)c->situ_beta);
    line(f, "situ_linear_beta=%.9g", (double)c->situ_linear_beta);
    char buf[4 * SHOAL_MAX_LAYERS + 16];
    size_t at = 0;
    buf[0] = 0;
    for (int l = 0; l < c->num_layers && l < SHOAL_MAX_LAYERS; l++)
        if (c->is_moe[l])
            at += (size_t)snprintf(buf + at, sizeof buf - at, "%s%d", at ? "," : "", l);
    line(f, "moe_layers=%s", buf);
}

void shoal_fprint_tensor(shoal_fprint *f, const char *name, const char *dtype, int ndim, const int64_t *shape,
                         uint64_t nbytes)
{
    char dims[256];
    size_t at = 0;
    dims[0] = 0;
    for (int i = 0; i < ndim && at < sizeof dims; i++)
        at += (size_t)snprintf(dims + at, sizeof dims - at, "%s%lld", i ? "," : "", (long long)shape[i]);
    line(f, "tensor %s %s [%s] %llu", name, dtype, dims, (unsigned long long)nbytes);
}

void shoal_fprint_end(shoal_fprint *f, uint8_t out[SHOAL_PROTO_FP_BYTES])
{
    crypto_generichash_final(&f->st, out, SHOAL_PROTO_FP_BYTES);
}

int shoal_fprint_expert_name(char *buf, size_t cap, const char *prefix, int layer, int expert, int w,
                             const char *part)
{
    int n = snprintf(buf, cap, "%s%d.block_sparse_moe.experts.%d.w%d.%s", prefix, layer, expert, w, part);
    return n < 0 || (size_t)n >= cap ? SHOAL_ERANGE : 0;
}

const char *shoal_fprint_prefix(const shoal_st *st, const shoal_k3cfg *cfg)
{
    static const char *prefixes[] = {"language_model.model.layers.", "model.layers."};
    const char *part = cfg->expert_format == SHOAL_EXPERTS_MXFP4 ? "weight_packed" : "weight";
    int first = -1;
    for (int l = 0; l < cfg->num_layers && first < 0; l++)
        if (cfg->is_moe[l])
            first = l;
    if (first < 0)
        return NULL;
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
        char name[256];
        if (!shoal_fprint_expert_name(name, sizeof name, prefixes[i], first, 0, 1, part) && shoal_st_find(st, name))
            return prefixes[i];
    }
    return NULL;
}

int shoal_fprint_model(uint8_t out[SHOAL_PROTO_FP_BYTES], const shoal_k3cfg *cfg, const shoal_st *st, char *err,
                       size_t errlen)
{
    const char *prefix = shoal_fprint_prefix(st, cfg);
    if (!prefix)
        return shoal_err_set(err, errlen, SHOAL_EMODEL, "no routed-expert tensors found (expected e.g. "
                             "language_model.model.layers.L.block_sparse_moe.experts.0.w1.*)");
    static const int ws[3] = {1, 3, 2};
    static const char *mx[2] = {"weight_packed", "weight_scale"}, *plain[1] = {"weight"};
    int mxfp4 = cfg->expert_format == SHOAL_EXPERTS_MXFP4;
    shoal_fprint f;
    shoal_fprint_begin(&f, cfg);
    for (int l = 0; l < cfg->num_layers; l++) {
        if (!cfg->is_moe[l])
            continue;
        for (int e = 0; e < cfg->num_experts; e++)
            for (int w = 0; w < 3; w++)
                for (int p = 0; p < (mxfp4 ? 2 : 1); p++) {
                    char name[256];
                    if (shoal_fprint_expert_name(name, sizeof name, prefix, l, e, ws[w], mxfp4 ? mx[p] : plain[p]))
                        return shoal_err_set(err, errlen, SHOAL_EMODEL, "expert tensor name too long");
                    const shoal_tensor *t = shoal_st_find(st, name);
                    if (!t)
                        return shoal_err_set(err, errlen, SHOAL_EMODEL, "missing routed-expert tensor %s", name);
                    shoal_fprint_tensor(&f, name, shoal_dtype_name(t->dtype), t->ndim, t->shape, t->nbytes);
                }
    }
    shoal_fprint_end(&f, out);
    return 0;
}
