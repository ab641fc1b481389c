/* fprint: the model fingerprint exchanged in HELLO (PROTOCOL.md §5): BLAKE2b-256
 * over a canonical text of the config fields that define the routed-expert bank
 * and one line per routed-expert tensor (name, dtype, shape, bytes). Weight
 * bytes are not hashed. Callers: the worker and the coordinator at start-up,
 * tests. The incremental API is pure; shoal_fprint_model reads tensor headers
 * from an open store (no weight bytes), enumerating the experts with
 * common/k3schema.h. */
#ifndef SHOAL_FPRINT_H
#define SHOAL_FPRINT_H

#include <sodium.h>
#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "common/st.h"
#include "proto/proto.h"

typedef struct {
    crypto_generichash_state st;
} shoal_fprint;

/* Starts the hash with the header and config lines of cfg. */
void shoal_fprint_begin(shoal_fprint *f, const shoal_k3cfg *cfg);
/* One "tensor ..." line (dtype: the safetensors name, e.g. "U8"). */
void shoal_fprint_tensor(shoal_fprint *f, const char *name, const char *dtype, int ndim, const int64_t *shape,
                         uint64_t nbytes);
void shoal_fprint_end(shoal_fprint *f, uint8_t out[SHOAL_PROTO_FP_BYTES]);

/* The fingerprint of the model in st: every routed-expert tensor must exist
 * (refused with SHOAL_EMODEL naming the first missing one). */
int shoal_fprint_model(uint8_t out[SHOAL_PROTO_FP_BYTES], const shoal_k3cfg *cfg, const shoal_st *st, char *err,
                       size_t errlen);

/* The trunk fingerprint (PROTOCOL.md §5.1) of a worker's trunk rows t[n]:
 * BLAKE2b-256 over "shoal trunk fingerprint 1" and one "tensor ..." line (as
 * above) per distinct matrix named in t, in order of first appearance, read
 * from st's headers. A name missing from st: SHOAL_EMODEL. */
void shoal_fprint_trunk_begin(shoal_fprint *f); /* the header line; then shoal_fprint_tensor, _end */
int shoal_fprint_trunk(uint8_t out[SHOAL_PROTO_FP_BYTES], const shoal_st *st, const shoal_proto_trows *t, size_t n,
                       char *err, size_t errlen);

#endif
