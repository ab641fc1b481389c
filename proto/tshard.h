/* tshard: trunk row shards (PROTOCOL.md §7.1) -- which trunk matrices may be
 * placed on workers as row shards, the ROWSPEC grammar of `shoal expert
 * --trunk`, the check of a worker's announced rows against a model, and the
 * coordinator's side of the announcements: the row cells of each remote
 * matrix with their owners (several when rows are replicated) and the
 * per-request choice of one live owner per cell (every row computed exactly
 * once per request, chosen deterministically). Pure: no I/O. Callers: the worker (its --trunk), the
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

/* The ROWSPEC of part i of n of an even spread (what `shoal plan --trunk
 * spread` gives each of n workers, and `shoal run|serve --workers n --trunk
 * remote` its local workers): "*:i/n", plus ",*.f_a_proj.weight:all" when the
 * model has KDA f_a matrices (each worker holds them whole, so f_b(f_a(x))
 * rides as one chain, PROTOCOL.md §3.7). 0; SHOAL_ERANGE when a matrix has
 * fewer rows than n (err names it and its rows); SHOAL_EINVAL for a bad i/n
 * or a buffer too small. */
int shoal_tshard_spread_spec(const shoal_tshard_mat *mats, int nmats, int i, int n, char *buf, size_t cap, char *err,
                             size_t errlen);

/* Check announced rows against mats: names exist, hi < rows. 0 or
 * SHOAL_ERANGE naming the first bad entry. */
int shoal_tshard_check(const shoal_proto_trows *t, size_t n, const shoal_tshard_mat *mats, int nmats, char *err,
                       size_t errlen);

/* The row cells of a set of announcements (owners and failover,
 * PROTOCOL.md §7.1): every remote matrix is cut at the boundaries of every
 * announced range of it, and adjacent pieces with the same owners holding
 * them in the same ranges are joined again, so that each cell lies inside one
 * announced range of each of its owners -- the one that reaches farthest
 * (ties: the one starting lowest, then the first listed), so that a worker's
 * consecutive cells of one range can travel as one segment. Owners of a cell:
 * own[off .. off + n), ascending worker index; a row owned by several workers
 * is a replica, any of which may compute it (the same bits). */
typedef struct {
    int mat;         /* index into mats */
    uint32_t lo, hi; /* inclusive rows */
    uint32_t off, n; /* its owners in own[] */
} shoal_tshard_cell;

typedef struct {
    int32_t w;     /* the worker */
    int32_t range; /* the index, in t[w], of its range holding the cell */
} shoal_tshard_owner;

/* Cells over nw workers' announcements (t[w][0..nt[w]-1], each checked), for
 * every matrix some worker announces ("remote"; remote[i] = 1), ordered by
 * matrix then row, covering each of its rows exactly once. Rows of a remote
 * matrix that no worker owns are refused: SHOAL_ECONFIG with err listing the
 * gaps ("name rows a-b", up to errlen); rows outside the model: SHOAL_ERANGE.
 * *cells and *own are allocated (free()). */
int shoal_tshard_cells(const shoal_tshard_mat *mats, int nmats, int nw, const shoal_proto_trows *const *t,
                       const size_t *nt, uint8_t *remote, shoal_tshard_cell **cells, size_t *ncells,
                       shoal_tshard_owner **own, size_t *nown, char *err, size_t errlen);

/* One owner for each of n consecutive cells (cells of one matrix, in row
 * order): for cell i with want == NULL or want[i] != 0, pick[i] = the index
 * in own of the owner, among those with live[w] != 0 (live NULL: all), with
 * the fewest rows picked so far in this call, ties to the lower worker
 * index -- so the rows of a matrix are spread evenly over its live owners and
 * a plan's near-equal parts each go to their first holder; -1 when no owner
 * is live. Other entries of pick are left as they are. load[nw] is scratch
 * (set here). Deterministic; allocates nothing. */
void shoal_tshard_pick(const shoal_tshard_cell *cells, int n, const shoal_tshard_owner *own, int nw,
                       const uint8_t *live, const uint8_t *want, uint64_t *load, int32_t *pick);

#endif
