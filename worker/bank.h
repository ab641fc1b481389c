/* bank: a worker's routed experts -- the kernel views (kernels/kernels.h
 * shoal_expert_w) of exactly the (layer, expert) pairs it owns, bound by name
 * from the model's tensor store with dtype and shape checks. Only the owned
 * experts' bytes are ever touched (the store maps files read-only; the bank
 * asks the kernel to read ahead just the owned ranges). Callers: the worker's
 * request handler (worker/serve.h), tests, the fuzz target (which builds a bank
 * from in-memory views). Immutable after open; lookups are thread-safe. Views
 * borrow the store, which must outlive the bank. */
#ifndef SHOAL_BANK_H
#define SHOAL_BANK_H

#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "common/st.h"
#include "kernels/kernels.h"
#include "proto/shard.h"

typedef struct shoal_bank shoal_bank;

/* Binds every expert owned in own (num_layers × num_experts of cfg). Refuses a
 * missing or mis-shaped tensor naming it (SHOAL_EMODEL). st must be opened with
 * map=1. */
int shoal_bank_open(shoal_bank **out, const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own, char *err,
                    size_t errlen);

/* A bank over caller-provided views (tests, fuzzing): views[layer * num_experts
 * + e] for every owned pair (the array and the weights it points to are
 * borrowed and must outlive the bank). d, f from the views; b1, b2 the SiTU
 * constants. */
int shoal_bank_from_views(shoal_bank **out, int num_layers, int num_experts, const shoal_shard *own,
                          const shoal_expert_w *views, float b1, float b2, char *err, size_t errlen);

void shoal_bank_close(shoal_bank *b); /* accepts NULL */

/* The view of an owned expert, NULL if not owned or out of range. */
const shoal_expert_w *shoal_bank_get(const shoal_bank *b, int layer, int expert);
uint64_t shoal_bank_bytes(const shoal_bank *b); /* weight bytes of the owned experts */
int shoal_bank_d(const shoal_bank *b);          /* latent width */
int shoal_bank_f(const shoal_bank *b);          /* expert intermediate width */
float shoal_bank_b1(const shoal_bank *b);
float shoal_bank_b2(const shoal_bank *b);

#endif
