/* Remote trunk matmuls (PROTOCOL.md §3.7): a backend that computes rows of
 * trunk matrices somewhere else (the trunk servers), behind one small
 * interface so the forward does not know where (the engine must not include
 * cluster/; coordinator/cluster/trunk_client.h implements it over ZeroMQ).
 *
 * Which matrices: at shoal_model_set_rmat the engine asks has() for each
 * matrix it applies with the matrix kernels; those answered 1 are "remote"
 * from then on, the others stay in-process.
 *
 * Call order (one outstanding request per object):
 *   submit() -- the jobs[n] all read the same input x[T, cols] (fp32,
 *               row-major, cols = every job's cols); a remote backend sends
 *               to every involved worker and returns without waiting;
 *   ...      -- the caller computes local matrices meanwhile;
 *   gather() -- waits (with a deadline) and fills every job's y[T, rows]
 *               = x · Wᵀ, bit for bit what shoal_gemm_bf16/f32 give
 *               in-process (each output element computed whole by one
 *               worker with the same kernel; kernels/README.md contract 1).
 * Either every y is filled or an error is returned naming what failed;
 * never a partial result. jobs, names, x and every y must stay valid until
 * gather() returns. layer: the absolute layer, num_layers for lm_head (for
 * the wire and the metrics). Thread: the forward's. */
#ifndef SHOAL_RMAT_H
#define SHOAL_RMAT_H

#include <stddef.h>

typedef struct {
    const char *name; /* the checkpoint tensor name */
    int rows, cols;   /* the whole matrix */
    float *y;         /* [T, rows] */
    /* A chained job (only where has_chain() said yes): y = (x · Aᵀ) · Wᵀ
     * with A = pre [pre_rows, pre_cols], every row of A applied first; cols
     * is then pre_rows and pre_cols the input's width. NULL: a plain job. */
    const char *pre;
    int pre_rows, pre_cols;
} shoal_rmat_job;

typedef struct {
    int (*has)(void *self, const char *name, int rows, int cols);
    /* 1 when a chained job pre -> name can be sent: both remote and every
     * worker computing rows of name holds all of pre (PROTOCOL.md §3.7,
     * 'chain'). NULL: never. */
    int (*has_chain)(void *self, const char *pre, int pre_rows, int pre_cols, const char *name, int rows, int cols);
    int (*submit)(void *self, int layer, const shoal_rmat_job *jobs, int n, const float *x, int T, char *err,
                  size_t errlen);
    int (*gather)(void *self, char *err, size_t errlen);
    void (*close)(void *self);
} shoal_rmat_vt;

typedef struct {
    const shoal_rmat_vt *vt;
    void *self;
} shoal_rmat;

#define SHOAL_RMAT_MAX_JOBS 8 /* matrices of one submit (the forward fuses at most 4) */

#endif
