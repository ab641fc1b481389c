/* Private to the engine module (engine.c, model.c, forward.c): the bound
 * model, sequence state and scratch layouts. Not for other modules. */
#ifndef SHOAL_ENGINE_INT_H
#define SHOAL_ENGINE_INT_H

#include <stdatomic.h>
#include <stdint.h>

#include "coordinator/engine/engine.h"
#include "coordinator/engine/tstream.h"

/* A weight matrix W[rows, cols] as stored (BF16 or F32): borrowed from the
 * store's mapping (trunk mapped), from a resident unit's copy, or NULL for a
 * streamed unit (the forward points a copy of its owner at the buffer). */
typedef struct {
    const void *p;
    shoal_dtype dt; /* SHOAL_DT_BF16 or SHOAL_DT_F32 */
    int rows, cols;
    const shoal_tensor *t; /* where it is stored */
    uint64_t t_off;        /* first byte within t (lm_head row slices) */
    int remote;            /* computed by the rmat backend (shoal_model_set_rmat) */
} shoal__wmat;

/* A trunk unit under a budget (model.c): one layer's matrices, or one row
 * slice of lm_head. */
typedef struct {
    shoal_tstream_ext *ext; /* [u.n_ext] */
    size_t *field;          /* [u.n_ext]: byte offset of each matrix in its owner (shoal__layer or head piece) */
    shoal_tstream_unit u;
    void *mem;  /* resident copy (owned), or NULL */
    int stream; /* index in the streamed order, or -1 */
    int layer;  /* layer, or -1 for an lm_head slice */
    int pinned; /* always resident (a MoE layer's router: the prefetch hint reads it a layer early) */
} shoal__tunit;

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
    int fab_chain; /* f_b(f_a(xn)) goes out as one chained remote job with the step on xn (rmat.h) */
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
    /* lm_head as row slices (one slice, the whole matrix, when mapped) */
    shoal__wmat *head;
    int n_head;

    /* trunk budget (opts.trunk_mode != MAPPED): units [num_layers + n_head],
     * the streamed ones in order, the reader, the embedding row buffer */
    shoal__tunit *tunits;
    int n_tunits;
    shoal_tstream_unit *sunits;
    int n_sunits;
    shoal_tstream *ts;
    void *emb_rows; /* [max_batch, d] as stored */
    int embed_pread; /* 1: mapped trunk, but embedding rows are read with shoal_st_pread into
                      * emb_rows (the trunk is remote: the table's pages were given up) */
    uint64_t ts_base_read; /* reader bytes at the last stats reset */
    double ts_base_stall;
    uint64_t owned_bytes;  /* fp32 copies */
    float *final_norm, *out_res_norm, *out_res_proj;
    shoal__layer *layers;

    /* every fp32 copy made at load (freed at close) */
    float **owned;
    int n_owned, cap_owned;

    shoal_experts experts;
    int have_experts;

    /* mapped.c: per file of the store, the bytes the model reads through the
     * mapping (0: none), and whether its truncation was logged */
    uint64_t *map_need;
    atomic_int *map_reported;
    int map_nfiles;
    shoal_rmat rmat; /* remote trunk matmuls; vt NULL: all in-process */

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

    /* prefetch hints (shoal_model_set_prefetch, forward.c hint_next) */
    int pf_on;
    int pf_layer;      /* the layer the last hint was for; -1: none pending */
    uint32_t pf_tag;   /* pf_mark[e] == pf_tag: e was hinted for pf_layer */
    uint32_t *pf_mark; /* [num_experts] */
    int32_t *pf_list;  /* [num_experts] the hint, ascending */
    int32_t *pf_topk;  /* [k] */
    int pf_n;

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
    /* rewind (shoal_seq_verify / shoal_seq_rewind): while ck_arm, the
     * forward keeps, per KDA layer, the state and conv windows before the
     * chunk's first token (j = position - ck_base = 0) and, for each token
     * j < ck_cap, the exact inputs of its delta-rule step (q, k, v, g after
     * conv, norms and gate; beta) and its pre-conv rows; a rewind to after
     * token j restores the first and replays steps 0..j (the same kernel on
     * the same inputs: the same bits), the windows rebuilt from the rows.
     * ck_n: tokens reachable (0 after any other forward, a reset or a copy) */
    float *ck_S0;    /* [num_kda, H, D, D] */
    float *ck_conv0; /* [num_kda, 3, K-1, C] */
    float *ck_tok;   /* [ck_cap, num_kda, ck_tok_w]: q, k, v, g [C each], beta [H], raw q, k, v [C each] */
    float *ck_o;     /* [C] replay output (discarded) */
    size_t ck_tok_w;
    int ck_cap, ck_arm, ck_base, ck_n;
};

/* forward.c: lay the scratch out from base (NULL: just count) for Tmax tokens
 * and max_context; returns the floats needed. */
size_t shoal__engine_scratch_layout(shoal__scratch *sc, float *base, const shoal_k3cfg *c, int Tmax,
                                    int max_context);
/* Run T tokens: token t is ids[t] at position seqs[t]->pos + (number of earlier
 * tokens of the same sequence in this chunk). A sequence's tokens must be
 * consecutive in the chunk's order of appearance. Positions advance on success.
 * logits: NULL, or [nrows, vocab]: the logits of tokens rows[0..nrows)
 * (strictly increasing), or of the last nrows tokens when rows is NULL
 * (nrows = T: all; 1: the last). Returns 0 or a negative code (err names the
 * cause). */
int shoal__engine_forward(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int T, float *logits,
                          const int *rows, int nrows, char *err, size_t errlen);

/* trunk.c: plan, load and start the trunk under a budget (opts.trunk_mode
 * != MAPPED), after the binding and info, before the scratch is allocated;
 * 0 or a code (SHOAL_ECONFIG: the budget cannot work, err names the
 * minimum). close frees what open made (safe on a partial open). */
int shoal__engine_trunk_open(shoal_model *m, size_t scratch_bytes, char *err, size_t errlen);
void shoal__engine_trunk_close(shoal_model *m);
/* The struct a unit's matrices live in (a shoal__layer or a head slice), and
 * pointing a copy of it at a buffer holding the unit. */
void *shoal__engine_trunk_owner(shoal_model *m, const shoal__tunit *tu);
void shoal__engine_trunk_point(void *owner, const shoal__tunit *tu, const void *buf);

/* mapped.c: the files the forward reads through the mapping. open records,
 * per file, the end of the last tensor read from it (routed experts only
 * when they are in-process); check fstat()s those files (each distinct one,
 * a few µs for K3's shards) and returns SHOAL_EIO naming the first one now
 * shorter than that, logging it once per file: a file truncated under the
 * mapping would otherwise turn the next read into SIGBUS, killing the
 * server. Called before every forward; thread-safe (reads only). */
void shoal__engine_mapped_open(shoal_model *m, const char *prefix);
int shoal__engine_mapped_check(const shoal_model *m, char *err, size_t errlen);
void shoal__engine_mapped_close(shoal_model *m);

/* Allocation guard (allocguard.c): armed around forwards. */
void shoal__engine_guard_arm(int on);

#endif
