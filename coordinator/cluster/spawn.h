/* spawn: local expert servers for `shoal run --workers N` -- N child processes
 * of this executable (`shoal expert`), each owning an even share of every MoE
 * layer's experts, listening on abstract-namespace ipc:// endpoints (no socket
 * files to leave behind). Children are put in one process group and get
 * PR_SET_PDEATHSIG(SIGTERM), so they exit when the coordinator exits for any
 * reason, SIGKILL included; shoal_spawn_stop terminates and reaps them all.
 * With opts.trunk each child also serves its even part of the trunk rows
 * (the plan `shoal plan --trunk spread` would give N workers).
 * Callers: coordinator/cluster/dist.c. One owner; pid/restarts may be read
 * while the supervisor runs. */
#ifndef SHOAL_SPAWN_H
#define SHOAL_SPAWN_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/k3cfg.h"

typedef struct {
    const char *model;   /* model directory, passed to every child */
    int n;               /* workers, 1 <= n <= num_experts */
    int threads;         /* OpenMP threads per worker; 0: max(1, cores / n) */
    int max_tokens;      /* --max-tokens of every child */
    int trunk;           /* 1: child i also owns part i of n of every row-shardable trunk matrix
                            (--trunk, shoal_tshard_spread_spec: `--workers N --trunk remote`) */
    int relay;           /* 1: every child gets all n endpoints as --relay-peers (the relay tree,
                            PROTOCOL.md §3.9: `--relay-fanout F` with --trunk remote) */
} shoal_spawn_opts;

typedef struct shoal_spawn shoal_spawn;

int shoal_spawn_start(shoal_spawn **out, const shoal_spawn_opts *o, const shoal_k3cfg *cfg, char *err,
                      size_t errlen);
/* Endpoints of the children, in worker order (live as long as s). */
const char *const *shoal_spawn_endpoints(const shoal_spawn *s);
pid_t shoal_spawn_pid(shoal_spawn *s, int i);
/* 0 while every child runs; else SHOAL_EPEER naming the one that exited.
 * Signature of shoal_expert_client_opts.check (ctx: the shoal_spawn). */
int shoal_spawn_check(void *ctx, char *err, size_t errlen);
/* Supervision, once the coordinator is connected: a thread (a sleeping wait,
 * 5 wake-ups a second) reaps a child that exited (no zombie) and restarts it
 * with the same experts and endpoint, where the coordinator's keeper finds it
 * and marks it up after re-checking its HELLO. Up to 5 restarts per worker
 * within 60 s at once; past that each restart waits, 1 s doubled at every
 * further exit up to 60 s (logged, and in shoal_spawn_state_get), and a
 * worker that stayed up 60 s is restarted at once again: never given up on.
 * A child with a request outstanding for 3 s (shoal_spawn_busy_slots) that
 * is neither running nor in disk I/O and used no CPU meanwhile (e.g.
 * SIGSTOPped) is killed with SIGKILL, logged once, and restarted. */
int shoal_spawn_supervise(shoal_spawn *s, char *err, size_t errlen);
/* Called (from the supervisor thread) after child `worker` was restarted. */
void shoal_spawn_on_restart(shoal_spawn *s, void (*fn)(void *ctx, int worker), void *ctx);
/* n slots (one per worker) where a coordinator client records when the
 * oldest request that worker has not answered was sent (CLOCK_MONOTONIC ns;
 * 0: none): role 0 the expert link, 1 the trunk link. They live as long as s,
 * longer than the clients (shoal_expert_client_opts.busy). NULL for NULL s. */
_Atomic unsigned long long *shoal_spawn_busy_slots(shoal_spawn *s, int role);
/* on_hang(ctx, worker) is called (supervisor thread) after a hung child was killed. */
void shoal_spawn_on_hang(shoal_spawn *s, void (*on_hang)(void *ctx, int worker), void *ctx);
typedef struct {
    int restarts;         /* restarts since start */
    int hangs;            /* kills for not answering while it had work */
    int backing_off;      /* 1: it exited too often; restarted in next_try_s */
    int backoff_s;        /* the wait before that restart (0 when not backing off) */
    double next_try_s;    /* seconds until it (0 when not backing off) */
    double next_try_unix; /* its time, seconds since the epoch */
} shoal_spawn_state;
/* Child i's supervision state (any thread); -1 for a bad i. */
int shoal_spawn_state_get(shoal_spawn *s, int i, shoal_spawn_state *out);
/* Supervision stops first; then SIGTERM to every child, up to 5 s for them to exit, then SIGKILL; reaps all.
 * Accepts NULL. */
void shoal_spawn_stop(shoal_spawn *s);

#endif
