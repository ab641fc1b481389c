/* In-process routed-expert backend (coordinator/engine/experts.h): every expert of
 * every MoE layer bound as a borrowed view of the model's tensor store and run
 * with kernels' shoal_expert_ffn. Tokens are grouped by expert, so each
 * selected expert's weights are read once per submitted chunk for all the
 * tokens routed to it. Up to 64 (token, slot) rows (decode) the selected
 * experts go to kernels' shoal_expert_ffn_many in one call, threads taking
 * whole experts; larger chunks run expert by expert in ascending id order,
 * each in parallel over its output rows. The bits are the same either way.
 * gather() computes everything and copies out. The engine opens it when remote_experts is 0; tests and
 * the distributed issue may open one to compare against.
 * Thread-safety: one outstanding request per object, one caller at a time. */
#ifndef SHOAL_EXPERTS_LOCAL_H
#define SHOAL_EXPERTS_LOCAL_H

#include <stddef.h>

#include "common/k3cfg.h"
#include "common/st.h"
#include "coordinator/engine/experts.h"
#include "kernels/kernels.h"

/* Binds experts.E.w{1,3,2}.{weight_packed,weight_scale} (MXFP4) or
 * experts.E.w{1,3,2}.weight (BF16/F32) under prefix (e.g.
 * "language_model.model.layers.") for every MoE layer of cfg, checking shapes
 * and dtypes; refuses naming every missing or mis-shaped tensor (up to errlen).
 * st must be opened with map=1 and outlive the backend. max_tokens bounds T
 * in submit(); scratch is allocated here, never in submit/gather.
 * On success *out holds the backend (close it with out->vt->close(out->self)). */
int shoal_experts_local_open(shoal_experts *out, const shoal_st *st, const shoal_k3cfg *cfg, const char *prefix,
                             int max_tokens, char *err, size_t errlen);

/* Bytes of one routed expert's three matrices as stored (incl. scales). */
size_t shoal_experts_local_expert_bytes(const shoal_k3cfg *cfg, shoal_expert_kind kind);

#endif
