/* K3 tensor schema: from a parsed config (common/k3cfg.h), every tensor the
 * engine needs, exactly as ../shared/k3/SPEC.md §2 names them: name (with the
 * `language_model.` prefix), dtype, shape and class. Pure functions of the
 * config, no I/O and no allocation except in shoal_k3schema_check. Used by the
 * engine loader, `shoal inspect`, and the distributed model fingerprint (the
 * order of shoal_k3schema_foreach is stable: globals first, then layer by
 * layer, each layer's non-expert tensors then its experts 0..E-1, each expert
 * w1, w3, w2 and, for MXFP4, weight_packed before weight_scale).
 *
 * dtypes: the trunk is BF16 or F32 as the config's dtype says; A_log, dt_bias,
 * the conv taps, KDA o_norm and e_score_correction_bias are F32; MXFP4 experts
 * are U8 `weight_packed` [rows, cols/2] and `weight_scale` [rows, cols/32];
 * unquantized experts are `.weight` [rows, cols] in BF16 or the trunk dtype.
 * `A_log` is stored longer than the head count in the real checkpoint ([128]
 * for 96 heads): any length >= kda_heads is accepted and recorded.
 * Vision tensors (`vision_tower.`, `mm_projector.`) are counted and ignored.
 * Thread-safety: all functions are reentrant. */
#ifndef SHOAL_K3SCHEMA_H
#define SHOAL_K3SCHEMA_H

#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "common/st.h"

typedef enum {
    SHOAL_TC_GLOBAL = 0, /* embed, lm_head, final norm and AttnRes: trunk outside the layers */
    SHOAL_TC_LAYER = 1,  /* a layer's non-expert tensors (attention, norms, router, latent, shared) */
    SHOAL_TC_EXPERT = 2, /* one routed expert's tensors */
    SHOAL_TC_COUNT
} shoal_tensor_class;

#define SHOAL_K3SCHEMA_NAME_MAX 128
#define SHOAL_K3SCHEMA_EXPERT_MAX 6 /* tensors per routed expert (MXFP4) */

typedef struct {
    char name[SHOAL_K3SCHEMA_NAME_MAX];
    shoal_dtype dtype;
    int alt_dtype;      /* another accepted dtype, or -1 (unquantized experts: BF16) */
    int ndim;
    int64_t shape[3];
    int min_dim0;       /* 1: shape[0] is a lower bound, not exact (A_log) */
    shoal_tensor_class cls;
    int layer;          /* -1 for SHOAL_TC_GLOBAL */
    int expert;         /* -1 unless SHOAL_TC_EXPERT */
} shoal_k3schema_entry;

/* Called once per entry; a non-zero return stops the walk and is returned. */
typedef int (*shoal_k3schema_fn)(const shoal_k3schema_entry *e, void *ctx);

/* Every tensor, in the stable order described above. */
int shoal_k3schema_foreach(const shoal_k3cfg *c, shoal_k3schema_fn fn, void *ctx);
/* The globals only, or one layer (with its experts when with_experts). */
int shoal_k3schema_globals(const shoal_k3cfg *c, shoal_k3schema_fn fn, void *ctx);
int shoal_k3schema_layer(const shoal_k3cfg *c, int layer, int with_experts, shoal_k3schema_fn fn, void *ctx);
/* One routed expert's tensors into out[]; returns their count (6 MXFP4, 3
 * unquantized), or SHOAL_EINVAL for a dense layer or an expert out of range. */
int shoal_k3schema_expert(const shoal_k3cfg *c, int layer, int expert,
                          shoal_k3schema_entry out[SHOAL_K3SCHEMA_EXPERT_MAX]);

/* Bytes of an entry with its primary dtype and exact shape (A_log: kda_heads). */
uint64_t shoal_k3schema_nbytes(const shoal_k3schema_entry *e);

typedef struct {
    uint64_t count[SHOAL_TC_COUNT];
    uint64_t bytes[SHOAL_TC_COUNT];
    uint64_t layer_bytes[SHOAL_MAX_LAYERS];  /* SHOAL_TC_LAYER bytes of layer L */
    uint64_t expert_bytes[SHOAL_MAX_LAYERS]; /* all routed experts of layer L */
    uint64_t bytes_per_expert;               /* one routed expert (0 if no MoE layer) */
} shoal_k3schema_totals;

/* Counts and bytes from the config alone (A_log counted as [kda_heads]). */
void shoal_k3schema_sum(const shoal_k3cfg *c, shoal_k3schema_totals *out);

/* Inventory of a store against the schema. */
typedef struct {
    uint64_t expected, present;  /* schema entries; of those, found with the right dtype/shape */
    uint64_t missing, mismatched, unexpected; /* problems (unexpected: text tensors not in the schema) */
    uint64_t vision_count, vision_bytes;      /* counted and ignored */
    uint64_t count[SHOAL_TC_COUNT], bytes[SHOAL_TC_COUNT]; /* of the tensors as stored */
    uint64_t layer_bytes[SHOAL_MAX_LAYERS], expert_bytes[SHOAL_MAX_LAYERS];
    int a_log_min, a_log_max; /* stored A_log lengths seen (0 if no KDA layer) */
    int experts_bf16;         /* unquantized experts stored as BF16 under an F32 trunk */
} shoal_k3schema_report;

/* Called once per problem with one line: "missing NAME (want BF16 [a, b])",
 * "mismatch NAME: want BF16 [a, b], have F32 [c]", "unexpected NAME (F32 [n])". */
typedef void (*shoal_k3schema_problem_fn)(const char *line, void *ctx);

/* Checks every schema entry against st and reports every problem through
 * problem (may be NULL). err receives a summary ("N missing, N mismatched, N
 * unexpected; first: ..."). Returns 0 when the inventory is complete, else
 * SHOAL_EMODEL. rep may be NULL. */
int shoal_k3schema_check(const shoal_k3cfg *c, const shoal_st *st, shoal_k3schema_report *rep,
                         shoal_k3schema_problem_fn problem, void *pctx, char *err, size_t errlen);

/* 1 for a name the text engine skips (vision tower, multimodal projector). */
int shoal_k3schema_is_vision(const char *name);

#endif
