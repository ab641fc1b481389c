/* tshard: trunk row shards (PROTOCOL.md §7.1) -- which trunk matrices may be
 * placed on workers as row shards, the ROWSPEC grammar of `shoal expert
 * --trunk`, the check of a worker's announced rows against a model, and the
 * coordinator's placement: which worker computes which rows of each remote
 * matrix (every row exactly once per request, chosen deterministically from the
 * announcements). Pure: no I/O. Callers: the worker (its --trunk), the
 * coordinator's trunk client (HELLO replies), tests. Lists are plain arrays
 * owned by the caller (free()). */
#ifndef SHOAL_TSHARD_H
#define SHOAL_TSHARD_H

#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "proto/proto.h"

/* A trunk matrix that can be row-sharded: W[rows, cols] as the schema names
 * it. */
typedef struct {
    char name[SHOAL_PROTO_MAX_NAME + 1];
    int rows, cols;
    int layer; /* -1 for lm_head */
} shoal_tshard_mat;

/* Every row-shardable matrix of the model, in schema order: each 2-D trunk
 * matrix the forward applies with the matrix kernels (attention projections,
 * the dense MLP, the router, the latent down/up projections, the shared
 * experts, lm_head) -- not embed_tokens (a row lookup), kv_b_proj (applied per
 * head inside the absorbed attention) nor the [1, d] AttnRes projections
 * (vectors). *out is allocated (free()). 0 or SHOAL_EINVAL. */
int shoal_tshard_mats(const shoal_k3cfg *c, shoal_tshard_mat **out, int *n);

/* Index of name in mats, or -1. */
int shoal_tshard_find(const shoal_tshard_mat *mats, int n, const char *name);

/* Parse a ROWSPEC against mats: items "PATTERN:ROWS" separated by commas;
 * PATTERN a glob (`*`, `?`, fnmatch without flags) matched against each
 * matrix's name with or without its leading "language_model."; ROWS one of
 * "a" or "a-b" (inclusive rows), "all", or "i/n" (the i-th of n near-equal
 * contiguous parts, 0 <= i < n: rows floor(i*R/n) .. floor((i+1)*R/n)-1).
 * Every item must match at least one matrix and its rows must exist in each.
 * *out: one entry per (item, matched matrix), in item then schema order.
 * 0, or SHOAL_EINVAL (syntax) / SHOAL_ERANGE (no match, rows out of range),
 * err naming the item. */
int shoal_tshard_parse(const char *spec, const shoal_tshard_mat *mats, int nmats, shoal_proto_trows **out,
                       size_t *nout, char *err, size_t errlen);

/* Check announced rows against mats: names exist, hi < rows. 0 or
 * SHOAL_ERANGE naming the first bad entry. */
int shoal_tshard_check(const shoal_proto_trows *t, size_t n, const shoal_tshard_mat *mats, int nmats, char *err,
                       size_t errlen);

/* One piece of a placement: rows lo..hi of matrix `mat` computed by worker w. */
typedef struct {
    int mat, w;
    uint32_t lo, hi;
} shoal_tshard_piece;

/* The placement over nw workers' announcements (t[w][0..nt[w]-1], each
 * checked): for every matrix that some worker announces ("remote"), pieces
 * that cover each of its rows exactly once, ascending by row; a row owned by
 * several workers goes to the lowest worker index among those whose range
 * reaches farthest from it (fewer, longer pieces). remote[i] = 1 for the
 * remote matrices. Rows of a remote matrix that no worker owns are refused:
 * SHOAL_ECONFIG with err listing the gaps ("name rows a-b", up to errlen).
 * *pieces is allocated (free()), ordered by matrix then row. */
int shoal_tshard_place(const shoal_tshard_mat *mats, int nmats, int nw, const shoal_proto_trows *const *t,
                       const size_t *nt, uint8_t *remote, shoal_tshard_piece **pieces, size_t *npieces, char *err,
                       size_t errlen);

#endif
