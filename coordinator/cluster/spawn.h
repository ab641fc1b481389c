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
#include <sys/types.h>

#include "common/k3cfg.h"

typedef struct {
    const char *model;   /* model directory, passed to every child */
    int n;               /* workers, 1 <= n <= num_experts */
    int threads;         /* OpenMP threads per worker; 0: max(1, cores / n) */
    int max_tokens;      /* --max-tokens of every child */
    int trunk;           /* 1: child i also owns part i of n of every row-shardable trunk matrix
                            (--trunk, shoal_tshard_spread_spec: `--workers N --trunk remote`) */
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
 * and marks it up after re-checking its HELLO. At most 5 restarts per worker
 * within 60 s; after that it is left down and logged. */
int shoal_spawn_supervise(shoal_spawn *s, char *err, size_t errlen);
/* Called (from the supervisor thread) after child `worker` was restarted. */
void shoal_spawn_on_restart(shoal_spawn *s, void (*fn)(void *ctx, int worker), void *ctx);
/* Supervision stops first; then SIGTERM to every child, up to 5 s for them to exit, then SIGKILL; reaps all.
 * Accepts NULL. */
void shoal_spawn_stop(shoal_spawn *s);

#endif
