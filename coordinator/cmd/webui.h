/* webui: the live cluster page (docs/METRICS.md, "The cluster page"), served
 * by `shoal serve` (through the API's extra routes) and by `shoal top --web
 * PORT` against any coordinator. Three routes:
 *   GET /  (and /ui)        the page: HTML + JS + SVG embedded in the binary
 *                           (webui.html, no build step, no external resource);
 *                           it holds no data, so it answers without the key and
 *                           asks for it (kept in the browser tab);
 *   GET /v1/cluster         one JSON snapshot, built from the coordinator's
 *                           exposition (shoal_webui_cluster_json) -- key required;
 *   GET /v1/cluster/events  the same snapshot as server-sent events, every
 *                           period -- key required.
 * Cumulative counters and histograms go to the browser, which keeps the
 * history and computes rates and windowed quantiles itself.
 *
 * Threads: everything on the HTTP loop thread except the ticker, a thread of
 * its own that posts a tick to the loop every period (shoal_http_post). */
#ifndef SHOAL_WEBUI_H
#define SHOAL_WEBUI_H

#include <jansson.h>
#include <stddef.h>

#include "coordinator/api/api.h" /* the http server and exchange types (api/http.h) */

typedef struct shoal_webui shoal_webui;

/* The snapshot JSON (malloc'd, NUL-terminated), or NULL when it cannot be
 * had now (answered 503). Called on the loop thread. */
typedef char *(*shoal_webui_source)(void *ud);

/* Starts the ticker (period_ms between events). api_key: for the standalone
 * handler (shoal_webui_on_request); NULL: none. */
int shoal_webui_open(shoal_webui **out, shoal_http *http, const char *api_key, shoal_webui_source src, void *ud,
                     int period_ms, char *err, size_t errlen);
/* The routes above: 1 answered, 0 not ours (or not authorised: the caller
 * answers 401). ud = the shoal_webui. */
int shoal_webui_route(void *ud, shoal_http_ex *ex, const shoal_http_request *req, int authorised);
/* An on_request for a server that serves only the page (`shoal top --web`):
 * the routes, 401 without the key, 404 else. ud = the shoal_webui. */
void shoal_webui_on_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req);
/* Stops the ticker; after the HTTP loop ended. Accepts NULL. */
void shoal_webui_close(shoal_webui *w);

/* The snapshot from a Prometheus exposition of a coordinator: {"time",
 * "status", "coordinator": {every unlabelled shoal_ sample by name without
 * "shoal_", "build": shoal_build_info's labels, histograms as {"le":[..],
 * "count":[..]}}, "workers": [{"id", "endpoint", every shoal_worker_ sample
 * by name, "rtt_seconds": histogram, "layer_pairs": {layer: n}, "taken_by":
 * {to: pairs}, "health": {"up","state"}}], "layers": {layer: imbalance}}.
 * health: the /health object ("status", "workers" [{endpoint, up, state}]),
 * borrowed, may be NULL. Every string comes out valid UTF-8 (other bytes
 * become '?'). NULL and err when the exposition is malformed. */
char *shoal_webui_cluster_json(const char *metrics, size_t len, const json_t *health, char *err, size_t errlen);

#endif
