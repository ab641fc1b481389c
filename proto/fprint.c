/* Model fingerprint (PROTOCOL.md §5). The text format is the contract: a
 * change here is a protocol major version. */
#include "proto/fprint.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"
#include "common/k3schema.h"

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

int shoal_fprint_model(uint8_t out[SHOAL_PROTO_FP_BYTES], const shoal_k3cfg *cfg, const shoal_st *st, char *err,
                       size_t errlen)
{
    /* k3schema enumerates an expert's tensors in the order of PROTOCOL.md §5:
     * w1, w3, w2, each weight_packed then weight_scale (or weight alone). */
    shoal_fprint f;
    shoal_fprint_begin(&f, cfg);
    for (int l = 0; l < cfg->num_layers; l++) {
        if (!cfg->is_moe[l])
            continue;
        for (int e = 0; e < cfg->num_experts; e++) {
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(cfg, l, e, ent);
            if (n < 0)
                return shoal_err_set(err, errlen, SHOAL_EMODEL, "layer %d expert %d: not in the K3 schema", l, e);
            for (int i = 0; i < n; i++) {
                const shoal_tensor *t = shoal_st_find(st, ent[i].name);
                if (!t)
                    return shoal_err_set(err, errlen, SHOAL_EMODEL, "missing routed-expert tensor %s", ent[i].name);
                shoal_fprint_tensor(&f, t->name, shoal_dtype_name(t->dtype), t->ndim, t->shape, t->nbytes);
            }
        }
    }
    shoal_fprint_end(&f, out);
    return 0;
}

void shoal_fprint_trunk_begin(shoal_fprint *f)
{
    crypto_generichash_init(&f->st, NULL, 0, SHOAL_PROTO_FP_BYTES);
    line(f, "shoal trunk fingerprint 1");
}

int shoal_fprint_trunk(uint8_t out[SHOAL_PROTO_FP_BYTES], const shoal_st *st, const shoal_proto_trows *t, size_t n,
                       char *err, size_t errlen)
{
    shoal_fprint f;
    shoal_fprint_trunk_begin(&f);
    for (size_t i = 0; i < n; i++) {
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++)
            seen = !strcmp(t[j].name, t[i].name);
        if (seen)
            continue;
        const shoal_tensor *x = shoal_st_find(st, t[i].name);
        if (!x)
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "trunk fingerprint: tensor %s is not in the model",
                                 t[i].name);
        shoal_fprint_tensor(&f, x->name, shoal_dtype_name(x->dtype), x->ndim, x->shape, x->nbytes);
    }
    shoal_fprint_end(&f, out);
    return 0;
}
