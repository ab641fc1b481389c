"""Writes deploy/grafana-shoal.json, the Grafana dashboard for shoal's
metrics (docs/METRICS.md). Run: python3 tools/grafana_dashboard.py > deploy/grafana-shoal.json
Import it in Grafana (Dashboards > Import) and pick the Prometheus data
source that scrapes the coordinator (`shoal serve` /metrics) and the expert
servers (`shoal expert --metrics-port`)."""
import json

DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
panels = []
y = 0


def panel(title, exprs, kind="timeseries", unit="short", w=12, h=8, desc="", stack=False, legend=None):
    global y
    x = 0 if not panels or panels[-1]["gridPos"]["x"] + panels[-1]["gridPos"]["w"] + w > 24 else \
        panels[-1]["gridPos"]["x"] + panels[-1]["gridPos"]["w"]
    if x == 0 and panels:
        y = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    targets = []
    for i, e in enumerate(exprs):
        expr, leg = e if isinstance(e, tuple) else (e, legend)
        t = {"datasource": DS, "expr": expr, "refId": chr(65 + i)}
        if leg:
            t["legendFormat"] = leg
        targets.append(t)
    p = {"id": len(panels) + 1, "type": kind, "title": title, "description": desc, "datasource": DS,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"stacking": {"mode": "normal" if stack else "none"},
                                                  "fillOpacity": 30 if stack else 0}
    panels.append(p)


def row(title):
    global y
    if panels:
        y = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False,
                   "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
    y += 1


R = "[$__rate_interval]"

row("Coordinator: throughput and per-token time")
panel("Tokens per second", [(f"rate(shoal_forward_tokens_total{R})", "forward tokens/s"),
                            (f"rate(shoal_completion_tokens_total{R})", "generated tokens/s")], unit="short")
panel("Time per token by phase", [(f"rate(shoal_phase_seconds_total{R}) / ignoring(phase) group_left "
                                   f"rate(shoal_forward_tokens_total{R})", "{{phase}}")],
      unit="s", stack=True, desc="attention, routing, experts (backend submit+gather), shared experts, combine, "
                                 "dense MLP, head, sampling; seconds per forward token")
panel("Requests queued / running", [("shoal_sched_queued", "queued"), ("shoal_sched_running", "running")], w=8)
panel("HTTP responses per second", [(f"sum by (endpoint, status) (rate(shoal_http_responses_total{R}))",
                                     "{{endpoint}} {{status}}")], w=8)
panel("Expert wait per layer (p99)", [('shoal_layer_wait_seconds{quantile="0.99"}', "layer {{layer}}")], w=8,
      unit="s", desc="time the coordinator blocked waiting for the last expert reply, per MoE layer")

row("Requests: latency, queue, failover, drafting")
panel("Time to first token", [(f"histogram_quantile(0.5, sum by (le) (rate(shoal_request_ttft_seconds_bucket{R})))",
                               "p50"),
                              (f"histogram_quantile(0.99, sum by (le) (rate(shoal_request_ttft_seconds_bucket{R})))",
                               "p99")], unit="s", w=8, desc="from submit to the first generated token")
panel("Inter-token time", [(f"histogram_quantile(0.5, sum by (le) "
                            f"(rate(shoal_request_inter_token_seconds_bucket{R})))", "p50"),
                           (f"histogram_quantile(0.99, sum by (le) "
                            f"(rate(shoal_request_inter_token_seconds_bucket{R})))", "p99")], unit="s", w=8)
panel("Queue wait and depth", [(f"histogram_quantile(0.99, sum by (le) (rate(shoal_request_queue_seconds_bucket{R})))",
                                "wait p99 (s)"),
                               ("shoal_sched_queued / shoal_sched_queue_capacity", "queue used (fraction)"),
                               (f"rate(shoal_sched_refused_total{R})", "refused (429) per s")], w=8)
panel("Failovers and restarts", [(f"rate(shoal_failovers_total{R})", "failovers/s"),
                                 (f"rate(shoal_trunk_failovers_total{R})", "of which in trunk steps/s"),
                                 (f"rate(shoal_failover_resent_pairs_total{R})", "pairs resent/s"),
                                 (f"sum by (worker) (increase(shoal_worker_restarts_total{R}))",
                                  "{{worker}} restarts")], w=8,
      desc="failovers to replicas (docs/CLUSTER.md) and supervisor restarts of local workers")
panel("Time lost per failover (since start)", [('shoal_failover_seconds{quantile="0.5"}', "p50"),
                                                ('shoal_failover_seconds{quantile="0.99"}', "p99")], unit="s", w=8)
panel("Speculative decoding", [(f"rate(shoal_draft_accepted_total{R}) / rate(shoal_draft_tokens_total{R})",
                                "drafts accepted (fraction)"),
                               (f"rate(shoal_decode_fed_tokens_total{R}) / rate(shoal_decode_passes_total{R})",
                                "tokens per decode pass")], w=8,
      desc="--draft ngram: the share of drafted tokens the verify pass kept, and tokens fed per pass")

panel("Prefix cache: hits and saved prefill", [(f"rate(shoal_prefix_cache_hits_total{R}) / "
                                                f"rate(shoal_prefix_cache_lookups_total{R})", "hit rate"),
                                               (f"rate(shoal_prefix_cache_saved_tokens_total{R}) / "
                                                f"rate(shoal_prompt_tokens_total{R})", "prompt tokens not prefilled"),
                                               (f"rate(shoal_prefix_cache_waits_total{R})", "waits for a capture/s")],
      w=12, desc="--prefix-cache-gb / --prefix-cache-dir (docs/CONFIG.md)")
panel("Prefix cache: memory and disk", [("shoal_prefix_cache_bytes", "held"),
                                        ("shoal_prefix_cache_budget_bytes", "budget"),
                                        (f"rate(shoal_prefix_cache_disk_read_bytes_total{R})", "disk reads/s")],
      unit="bytes", w=12)

row("Shards (as the coordinator sees them)")
panel("Shard up", [("shoal_worker_up", "{{worker}}")], kind="stat", w=8, unit="none")
panel("Load share vs fair share", [("shoal_worker_load_share", "{{worker}} share"),
                                   ("shoal_worker_fair_share", "{{worker}} fair")], w=8, unit="percentunit")
panel("Imbalance per MoE layer (max/mean pairs)", [("shoal_layer_imbalance", "layer {{layer}}")], kind="bargauge",
      w=8, unit="none")
panel("Round trip p50", [(f"histogram_quantile(0.5, sum by (worker, le) (rate(shoal_worker_rtt_seconds_bucket{R})))",
                          "{{worker}}")], unit="s", w=8)
panel("Round trip p99", [(f"histogram_quantile(0.99, sum by (worker, le) (rate(shoal_worker_rtt_seconds_bucket{R})))",
                          "{{worker}}")], unit="s", w=8)
panel("Round trip split: network / queue / compute (per exchange)",
      [(f"rate(shoal_worker_network_seconds_total{R}) / rate(shoal_worker_requests_total{R})", "{{worker}} network"),
       (f"rate(shoal_worker_queue_seconds_total{R}) / rate(shoal_worker_requests_total{R})", "{{worker}} queue"),
       (f"rate(shoal_worker_compute_seconds_total{R}) / rate(shoal_worker_requests_total{R})", "{{worker}} compute")],
      unit="s", w=8, stack=True)
panel("Weight GB/s while computing", [(f"rate(shoal_worker_weight_bytes_total{R}) / "
                                       f"rate(shoal_worker_compute_seconds_total{R})", "{{worker}}")],
      unit="Bps", w=8)
panel("Wire bytes per second", [(f"rate(shoal_worker_sent_bytes_total{R})", "{{worker}} sent"),
                                (f"rate(shoal_worker_received_bytes_total{R})", "{{worker}} received")],
      unit="Bps", w=8)
panel("Last to reply (share of layer exchanges)", [(f"rate(shoal_worker_slowest_total{R}) / ignoring(worker) "
                                                    f"group_left sum(rate(shoal_worker_slowest_total{R}))",
                                                    "{{worker}}")], unit="percentunit", w=8)
panel("Timeouts, errors, stale replies", [(f"rate(shoal_worker_timeouts_total{R})", "{{worker}} timeouts"),
                                          (f"rate(shoal_worker_errors_total{R})", "{{worker}} errors"),
                                          (f"rate(shoal_worker_stale_replies_total{R})", "{{worker}} stale")], w=12)
panel("Per-layer round trip p99", [('shoal_worker_layer_rtt_seconds{quantile="0.99"}', "{{worker}} L{{layer}}")],
      unit="s", w=12)

row("Expert servers (their own /metrics)")
panel("Resident memory", [("shoal_expert_server_resident_bytes", "{{worker}}"),
                          ("shoal_expert_server_expert_bytes", "{{worker}} expert weights")], unit="bytes", w=8)
panel("Compute time per batch p99", [(f"histogram_quantile(0.99, sum by (worker, le) "
                                      f"(rate(shoal_expert_server_compute_time_seconds_bucket{R})))", "{{worker}}")],
      unit="s", w=8)
panel("Queue wait per batch p99", [(f"histogram_quantile(0.99, sum by (worker, le) "
                                    f"(rate(shoal_expert_server_queue_wait_seconds_bucket{R})))", "{{worker}}")],
      unit="s", w=8)
panel("Batches and pairs per second", [(f"rate(shoal_expert_server_batches_total{R})", "{{worker}} batches"),
                                       (f"rate(shoal_expert_server_pairs_total{R})", "{{worker}} pairs")], w=8)
panel("Errors by code", [(f"sum by (worker, code) (rate(shoal_expert_server_errors_total{R}))",
                          "{{worker}} {{code}}")], w=8)
panel("Uptime", [("shoal_expert_server_uptime_seconds", "{{worker}}")], kind="stat", unit="s", w=8)
panel("Hottest experts (pairs per second)", [(f"topk(20, rate(shoal_expert_server_expert_pairs_total{R}))",
                                              "{{worker}} L{{layer}} E{{expert}}")], kind="bargauge", w=24, h=10)

# the template variables: every coordinator series is filtered by $instance,
# every per-worker one by $worker too (expert servers are scraped as their own
# instances: only $worker applies to them)
import re  # noqa: E402


def scoped(expr):
    def one(m):
        name, inner = m.group(1), m.group(3)
        sel = []
        if not name.startswith("shoal_expert_server_"):
            sel.append('instance=~"$instance"')
        if name.startswith("shoal_worker_") or name.startswith("shoal_expert_server_"):
            sel.append('worker=~"$worker"')
        if inner:
            sel.append(inner)
        return name + "{" + ", ".join(sel) + "}"
    return re.sub(r"\b(shoal_[a-z0-9_]+)(\{([^}]*)\})?", one, expr)


for p in panels:
    for t in p.get("targets", []):
        t["expr"] = scoped(t["expr"])

templating = [
    {"name": "instance", "label": "coordinator", "type": "query", "datasource": DS, "refresh": 2,
     "query": {"query": "label_values(shoal_coordinator_uptime_seconds, instance)", "refId": "instance"},
     "definition": "label_values(shoal_coordinator_uptime_seconds, instance)", "includeAll": True, "multi": True,
     "current": {"text": "All", "value": "$__all"}, "allValue": ".*", "sort": 1},
    {"name": "worker", "label": "worker", "type": "query", "datasource": DS, "refresh": 2,
     "query": {"query": 'label_values(shoal_worker_up{instance=~"$instance"}, worker)', "refId": "worker"},
     "definition": 'label_values(shoal_worker_up{instance=~"$instance"}, worker)', "includeAll": True,
     "multi": True, "current": {"text": "All", "value": "$__all"}, "allValue": ".*", "sort": 1},
]

dash = {
    "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
                  "pluginName": "Prometheus"}],
    "title": "shoal: coordinator and expert shards",
    "uid": "shoal-shards",
    "description": "shoal's metrics (docs/METRICS.md): per-token time, per-shard load, latency split, memory.",
    "tags": ["shoal"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "refresh": "10s",
    "time": {"from": "now-30m", "to": "now"},
    "templating": {"list": templating},
    "annotations": {"list": []},
    "panels": panels,
}
print(json.dumps(dash, indent=1))
