/* probe: `shoal doctor`'s measurements over an open expert client's real
 * links (CURVE included): PROBE / PROBE_REPLY (PROTOCOL.md §3.8) to one
 * worker, a number of exchanges with a payload each way and a window of
 * exchanges in flight. Only while nothing else uses the client (no forward
 * running): it holds the client's socket lock for the whole measurement,
 * which also keeps its keeper off the sockets. */
#ifndef SHOAL_PROBE_H
#define SHOAL_PROBE_H

#include <stddef.h>
#include <stdint.h>

#include "coordinator/cluster/expert_client.h"
#include "proto/proto.h"

typedef struct {
    size_t out_bytes;   /* payload of each PROBE's x (rounded up to a multiple of 4, at least 4) */
    uint32_t in_bytes;  /* payload of each reply's y (idem) */
    int count;          /* exchanges (>= 1) */
    int window;         /* at most this many in flight (1: one after the other) */
    int facts;          /* 1: the first exchange asks for the host facts (count it out of the timings) */
    int timeout_ms;     /* for the whole measurement */
} shoal_probe_opts;

typedef struct {
    double *rtt_us;        /* [count], caller's (or NULL): send to reply of each exchange */
    double total_s;        /* first send to last reply (the facts exchange excluded) */
    shoal_proto_facts facts;
} shoal_probe_result;

/* 0, or an error naming the worker (a refusal -- a worker older than 1.5
 * answers UNKNOWN_TYPE --, a malformed reply, the deadline, a send failure). */
int shoal_probe_run(shoal_expert_client *c, int w, const shoal_probe_opts *o, shoal_probe_result *r, char *err,
                    size_t errlen);

/* The host facts of every worker measured at the same time (PROBE with
 * facts sent to all, then the replies collected): on hosts that share a
 * memory bus or a disk (VMs on one machine, a noisy neighbour) the figures
 * come out lower than each measured alone. f[i] (has = 0 when worker i did
 * not answer; ok[i] 1 when it did). 0, or the first error (the others still
 * measured). */
int shoal_probe_facts_together(shoal_expert_client *c, shoal_proto_facts *f, int *ok, int timeout_ms, char *err,
                               size_t errlen);

#endif
