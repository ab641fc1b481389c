/* obs: what the coordinator observes about itself --
 *   cmetrics.h  the coordinator's metrics registry: per-token time by phase,
 *               per expert server round trips, bytes, load share; Prometheus
 *               text for /metrics and the plain report of `shoal run`;
 *   trace.h     routing traces: the recorder the forward writes every routing
 *               decision to, the reader, heat statistics and a plan's
 *               expected balance.
 * May use: common/ and proto/ (for range strings and fingerprints). Written to
 * by the engine, the cluster client and the API; read by the commands. Other
 * rooms include this header. */
#ifndef SHOAL_OBS_H
#define SHOAL_OBS_H

#include "coordinator/obs/cmetrics.h"
#include "coordinator/obs/trace.h"

#endif
