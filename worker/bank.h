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

/* Truncated shards. A mapped file that shrinks under the worker turns the next
 * read of a lost page into SIGBUS. shoal_bank_check fstat()s the files holding
 * experts[0..n) of layer (each distinct file once) and returns SHOAL_EIO, with
 * err naming the file, its size now and the size its tensors need, when one is
 * shorter: the request is refused and the worker serves the others. A bank from
 * views (no files) always passes, and so does every bank opened with the
 * debug switch SHOAL_DEBUG_SKIP_SIZE_CHECK=1 in the environment (read once, at
 * shoal_bank_open; for the test of the SIGBUS guard below). Thread-safe (reads only). */
int shoal_bank_check(const shoal_bank *b, int layer, const int32_t *experts, int n, char *err, size_t errlen);

/* The safety net for a file truncated between that check and the read: a
 * SIGBUS handler that writes one line naming the mapped file at the faulting
 * address and exits with status 4. It cannot let the process go on: the fault
 * is raised on whichever OpenMP thread was reading, in the middle of a kernel,
 * and unwinding (siglongjmp) out of a parallel region is undefined. One bank
 * is guarded at a time; NULL uninstalls. */
void shoal_bank_guard(const shoal_bank *b);
int shoal_bank_d(const shoal_bank *b);          /* latent width */
int shoal_bank_f(const shoal_bank *b);          /* expert intermediate width */
float shoal_bank_b1(const shoal_bank *b);
float shoal_bank_b2(const shoal_bank *b);

#endif
