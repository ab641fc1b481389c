/* cluster: the coordinator's side of the expert servers --
 *   dist.h           --worker / --workers / --plan options and wiring: spawn
 *                    local servers, connect, plug the client into the model;
 *   expert_client.h  the routed-expert backend over ZeroMQ (HELLO, EXPERT_BATCH
 *                    per MoE layer, keeper thread for down workers);
 *   owners.h         which replica of an expert each exchange asks;
 *   probe.h          `shoal doctor`'s PROBE measurements over a client's links;
 *   relaytree.h      the latency-aware relay schedule of a trunk step's input
 *                    (pure; the trunk client's and `shoal plan --measured`'s);
 *   spawn.h          local expert-server processes for --workers N;
 *   trunk_client.h   the remote trunk matmul backend (engine/rmat.h): an
 *                    expert client in the trunk role, TRUNK_BATCH per step.
 * May use: common/, proto/ (the wire contract, proto/PROTOCOL.md), kernels/,
 * obs/ and the engine's public header (it implements the engine's expert
 * backend interface, engine/experts.h). The engine never includes this room:
 * a backend is plugged in at run time. Other rooms include this header. */
#ifndef SHOAL_CLUSTER_H
#define SHOAL_CLUSTER_H

#include "coordinator/cluster/dist.h"
#include "coordinator/cluster/expert_client.h"
#include "coordinator/cluster/owners.h"
#include "coordinator/cluster/probe.h"
#include "coordinator/cluster/relaytree.h"
#include "coordinator/cluster/spawn.h"
#include "coordinator/cluster/trunk_client.h"

#endif
