/* readbw: the memory read-bandwidth pass (STREAM-like) of `shoal bench` and
 * of the worker's host facts (PROBE, PROTOCOL.md §3.8): each thread sums its
 * contiguous share of a buffer as 64-bit words, read as four concurrent
 * sequential streams with software prefetch -- the access pattern of the GEMV
 * kernels (four weight rows in flight), so kernel / read ratios compare like
 * with like. A sum, so the loads cannot be elided. No allocation; any thread. */
#ifndef SHOAL_READBW_H
#define SHOAL_READBW_H

#include <stddef.h>
#include <stdint.h>

/* One pass over buf[nwords] with `threads` OpenMP threads (0: the current
 * default); GB/s (1e9 bytes per second) of the words read. *sink absorbs the
 * sum (pass a global). */
double shoal_read_bw_pass(const uint64_t *buf, size_t nwords, int threads, uint64_t *sink);

#endif
