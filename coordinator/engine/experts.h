/* Routed-expert execution for one MoE layer, behind one small interface so the
 * model forward does not know whether experts run in-process or on expert
 * servers (the distributed issue adds the ZeroMQ implementation).
 *
 * Call order per MoE layer (one outstanding request at a time per object):
 *   submit()  -- hands the latent activations and the routing to the backend;
 *                a remote backend sends to every involved worker and returns
 *                without waiting;
 *   ...       -- the caller computes the shared experts meanwhile;
 *   gather()  -- waits (with a deadline) and fills every expert output.
 * Either the whole y is filled or an error is returned naming what failed
 * (e.g. the worker endpoint); never a partial mixture.
 *
 * Shapes: z[T, latent] fp32; ids[T, k] expert ids (int32), ascending within each
 * token (the canonical order); y[T, k, latent] receives each selected expert's
 * output for that token as bf16 bits (the reference rounds y_e to bf16, SPEC
 * §3.6 step 4), in the same (t, slot) order as ids. The pointers passed to
 * submit() must stay valid until gather() returns. layer is the absolute
 * 0-indexed model layer. */
#ifndef SHOAL_EXPERTS_H
#define SHOAL_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int (*submit)(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err,
                  size_t errlen);
    int (*gather)(void *self, uint16_t *y, char *err, size_t errlen);
    void (*close)(void *self);
    /* Optional (NULL: not supported): a guess of the experts[n] (distinct,
     * ascending) a later submit for `layer` will use, so a backend that reads
     * experts from disk can start early (PROTOCOL.md PREFETCH). Called between
     * submit() and gather(); never blocks, never fails the request, never
     * changes any result; the backend may drop it. */
    void (*hint)(void *self, int layer, const int32_t *experts, int n);
} shoal_experts_vt;

typedef struct {
    const shoal_experts_vt *vt;
    void *self;
} shoal_experts;

#endif
