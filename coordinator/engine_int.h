/* Private to the engine module (engine.c, model.c, forward.c): the bound
 * model, sequence state and scratch layouts. Not for other modules. */
#ifndef SHOAL_ENGINE_INT_H
#define SHOAL_ENGINE_INT_H

#include <stdatomic.h>
#include <stdint.h>

#include "coordinator/engine.h"

/* A weight matrix W[rows, cols] as stored (BF16 or F32), borrowed from the
 * store's mapping. */
typedef struct {
    const void *p;
    shoal_dtype dt; /* SHOAL_DT_BF16 or SHOAL_DT_F32 */
    int rows, cols;
} shoal__wmat;

typedef struct {
    shoal_attn_kind kind;
    int moe;     /* 0: dense MLP */
    int kda_idx; /* index among KDA layers, or -1 */
    int mla_idx; /* index among MLA layers, or -1 */

    /* widened fp32 copies (owned by the model) of the small vectors */
    float *in_norm, *post_norm;
    float *attn_res_norm, *attn_res_proj; /* self_attention_res_{norm,proj} */
    float *mlp_res_norm, *mlp_res_proj;
    shoal__wmat g_proj, o_proj;

    /* KDA */
    shoal__wmat q_proj, k_proj, v_proj, f_a, f_b, b_proj;
    float *q_conv, *k_conv, *v_conv; /* [C, 1, K] fp32 copies */
    float *A_log;                          /* first kda_heads entries */
    float *dt_bias;                        /* [C] */
    float *o_norm;                         /* [D] */

    /* MLA */
    shoal__wmat q_a, q_b, kv_a, kv_b;
    float *q_a_norm, *kv_a_norm;

    /* dense MLP */
    shoal__wmat mlp_gate, mlp_up, mlp_down;

    /* MoE (non-expert part) */
    shoal__wmat router, rdown, rup, sh_gate, sh_up, sh_down;
    float *router_bias; /* [E] */
    float *rnorm;       /* [latent] */
} shoal__layer;

/* Forward scratch (forward.c lays it out): [Tmax, width] buffers. */
typedef struct {
    float *P;      /* [T, d] running prefix sum / layer input */
    float *blocks; /* [nblocks, T, d] block-residual list */
    float *x;      /* [T, d] AttnRes mix */
    float *xn;     /* [T, d] normed sublayer input */
    float *a;      /* [T, d] sublayer output */
    float *work;   /* [T, work_w] per-layer temporaries (attention or FFN) */
    size_t work_w;
    /* per-token temporaries */
    float *tq, *tk, *tv, *tg; /* [C] conv outputs and gate */
    float *beta;              /* [H] */
    float *q_lat, *ctx;       /* [Hm, R] */
    float *q_pe;              /* [Hm, P] */
    float *att;               /* [Hm, max_context] attention scores */
    float *res_s;             /* [nblocks + 1] AttnRes scores */
    float *rsig;              /* [2E] router sigmoid and selection scores */
    int32_t *tpos;            /* [T] positions */
    int32_t *seen;            /* [E] expert stamps (distinct experts per chunk) */
} shoal__scratch;

struct shoal_model {
    shoal_k3cfg cfg;
    shoal_st *st;
    shoal_model_opts opts;
    shoal_model_info info;

    shoal__wmat embed, lm_head;
    float *final_norm, *out_res_norm, *out_res_proj;
    shoal__layer *layers;

    /* every fp32 copy made at load (freed at close) */
    float **owned;
    int n_owned, cap_owned;

    shoal_experts experts;
    int have_experts;

    /* trunk bytes read per chunk (all matrices and vectors except the
     * embedding table and lm_head), and those two separately */
    uint64_t trunk_bytes_fixed, lm_head_bytes, embed_row_bytes;

    /* scratch, sized at open for max_batch tokens (see forward.c) */
    float *scratch;
    size_t scratch_floats;
    shoal__scratch sc;
    int32_t stamp;
    int32_t *topk_ids; /* [max_batch, k] */
    float *topk_w;     /* [max_batch, k] */
    uint16_t *ex_y;    /* [max_batch, k, latent] bf16 bits */
    shoal_seq **seqv;  /* [max_batch] per-token sequence pointers for prefill */

    const atomic_int *cancel;
    shoal_model_stats stats;
    /* monitoring (shoal_model_set_monitor): borrowed; t_mark is the end of
     * the last timed phase of the running forward */
    shoal_cmetrics *cm;
    shoal_trace *rtrace;
    uint64_t t_mark;
    /* test/debug hook: called after each layer (layer = num_layers for the
     * final AttnRes mix) with the chunk's [T, d] layer outputs P */
    void (*trace)(void *ctx, int layer, int T, const float *P, int d);
    void *trace_ctx;
    int seqs_alive;
};

struct shoal_seq {
    shoal_model *m;
    int pos, capacity;
    float *kda_S;    /* [num_kda, H, D, D] */
    float *kda_conv; /* [num_kda, 3, K-1, C] windows of q, k, v */
    float *mla;      /* [num_mla, capacity, R + P] */
    int broken;      /* a forward failed part-way: state invalid until reset/copy */
    size_t bytes;
};

/* forward.c: lay the scratch out from base (NULL: just count) for Tmax tokens
 * and max_context; returns the floats needed. */
size_t shoal__engine_scratch_layout(shoal__scratch *sc, float *base, const shoal_k3cfg *c, int Tmax,
                                    int max_context);
/* Run T tokens: token t is ids[t] at position seqs[t]->pos + (number of earlier
 * tokens of the same sequence in this chunk). A sequence's tokens must be
 * consecutive in the chunk's order of appearance. Positions advance on success.
 * logits: NULL, or [T, vocab] when all_logits, else [1, vocab] for the last
 * token. Returns 0 or a negative code (err names the cause). */
int shoal__engine_forward(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int T, float *logits,
                          int all_logits, char *err, size_t errlen);

/* Allocation guard (engine.c): armed around forwards. */
void shoal__engine_guard_arm(int on);

#endif
