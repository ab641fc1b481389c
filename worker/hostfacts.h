/* hostfacts: what `shoal doctor` asks a worker about its host (PROBE with
 * facts, PROTOCOL.md §3.8): CPU model, cores, memory total/available, the
 * disk under the model directory (free, total, a cold read rate), and the
 * memory read bandwidth with one and with `threads` threads (bench's read
 * pass, shoal_read_bw_pass in kernels/kernels.h). Reads /proc and the filesystem; allocates a
 * 256 MiB buffer for the memory pass (freed before returning). Takes about a
 * second. Callers: worker/serve.c, `shoal doctor` (this host; through
 * worker/expert_server.h, the room's public header). Any thread, one call at
 * a time. */
#ifndef SHOAL_HOSTFACTS_H
#define SHOAL_HOSTFACTS_H

#include "proto/proto.h"

/* Fills f (has = 1): isa, threads and held_bytes are the caller's; the rest
 * measured here. dir: the model directory or pack (NULL: disk figures 0). */
void shoal_hostfacts_measure(shoal_proto_facts *f, const char *dir, int threads);

#endif
