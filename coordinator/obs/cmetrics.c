/* cmetrics: coordinator counters, their exposition and the run report.
 * Names and meanings: docs/METRICS.md. */
#include "coordinator/obs/cmetrics.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/k3cfg.h"

#define ID_MAX 64
#define EP_MAX 256

typedef struct {
    char id[ID_MAX + 1], endpoint[EP_MAX + 1];
    uint64_t owned, expert_bytes, mem_total;
    int described;
    shoal_metrics_gauge up;
    shoal_metrics_counter requests, tokens, pairs, experts, bytes_out, bytes_in;
    shoal_metrics_counter queue_us, compute_us, network_ns, rtt_ns;
    shoal_metrics_counter timeouts, errors, stale, slowest;
    shoal_metrics_counter restarts; /* of a local worker (--workers N) by its supervisor */
    shoal_metrics_counter hangs;    /* ... killed by it for not answering while it had work */
    shoal_metrics_gauge backoff_ms; /* ... until its next restart while crash-looping (0: none) */
    shoal_metrics_counter failovers, lost_pairs, takeover_pairs, replica_picks; /* failover (replicas) */
    shoal_metrics_counter t_lost_rows, t_takeover_rows;                       /* ... of trunk rows */
    shoal_metrics_counter *took_from; /* [max_workers] pairs taken over from each worker (NULL past 1024 workers) */
    shoal_metrics_counter t_requests, t_rows, t_weight, t_out, t_in, t_queue_us, t_compute_us, t_network_ns;
    shoal_metrics_hist rtt, net;
    shoal_metrics_hist *layer_rtt;      /* [num_layers] */
    shoal_metrics_counter *layer_pairs; /* [num_layers] */
} worker;

struct shoal_cmetrics {
    int num_layers, num_experts, max_workers, nworkers;
    uint8_t is_moe[SHOAL_MAX_LAYERS];
    uint64_t expert_bytes;
    uint64_t start_ns;
    worker *w;
    shoal_metrics_counter phase_ns[SHOAL_PHASE_COUNT];
    shoal_metrics_counter tokens, chunks;
    shoal_metrics_counter spec_fed, spec_passes, spec_drafted, spec_accepted;
    shoal_metrics_hist *layer_wait; /* [num_layers] */
    shoal_metrics_counter failovers, resent_pairs, trunk_failovers, resent_trunk_rows;
    shoal_metrics_hist failover_time;
    /* the scheduler's steps and per-request latencies */
    shoal_metrics_counter steps, decode_steps, decode_seqs, step_prompt;
    shoal_metrics_gauge last_batch, max_batch;
    shoal_metrics_hist req_queue, req_ttft, req_itl;
    shoal_metrics_counter cmasks, cmask_ns, cmask_wait_ns, cmask_overlapped, cmask_verify; /* structured output */
};

static const char *const phase_names[SHOAL_PHASE_COUNT] = {
    "attention", "routing", "experts", "shared", "combine", "dense", "head", "sampling",
};

const char *shoal_cmetrics_phase_name(int phase)
{
    return phase >= 0 && phase < SHOAL_PHASE_COUNT ? phase_names[phase] : "?";
}

int shoal_cmetrics_open(shoal_cmetrics **out, const shoal_cmetrics_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (o->num_layers < 1 || o->num_layers > SHOAL_MAX_LAYERS || !o->is_moe)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "cmetrics: num_layers %d outside 1..%d (or no is_moe)",
                             o->num_layers, SHOAL_MAX_LAYERS);
    if (o->num_experts < 1 || o->max_workers < 0 || o->max_workers > 65536)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "cmetrics: num_experts %d / max_workers %d out of range",
                             o->num_experts, o->max_workers);
    shoal_cmetrics *cm = shoal_xcalloc(1, sizeof *cm);
    cm->num_layers = o->num_layers;
    cm->num_experts = o->num_experts;
    cm->max_workers = o->max_workers;
    cm->expert_bytes = o->expert_bytes;
    memcpy(cm->is_moe, o->is_moe, (size_t)o->num_layers);
    cm->start_ns = shoal_metrics_now_ns();
    cm->layer_wait = shoal_xcalloc((size_t)o->num_layers, sizeof *cm->layer_wait);
    if (o->max_workers) {
        cm->w = shoal_xcalloc((size_t)o->max_workers, sizeof *cm->w);
        for (int i = 0; i < o->max_workers; i++) {
            cm->w[i].layer_rtt = shoal_xcalloc((size_t)o->num_layers, sizeof *cm->w[i].layer_rtt);
            cm->w[i].layer_pairs = shoal_xcalloc((size_t)o->num_layers, sizeof *cm->w[i].layer_pairs);
            if (o->max_workers <= 1024)
                cm->w[i].took_from = shoal_xcalloc((size_t)o->max_workers, sizeof *cm->w[i].took_from);
        }
    }
    *out = cm;
    return 0;
}

void shoal_cmetrics_close(shoal_cmetrics *cm)
{
    if (!cm)
        return;
    for (int i = 0; i < cm->max_workers; i++) {
        free(cm->w[i].layer_rtt);
        free(cm->w[i].layer_pairs);
        free(cm->w[i].took_from);
    }
    free(cm->w);
    free(cm->layer_wait);
    free(cm);
}

int shoal_cmetrics_set_worker(shoal_cmetrics *cm, int w, const char *id, const char *endpoint, uint64_t owned,
                              uint64_t expert_bytes, uint64_t mem_total)
{
    if (!cm || w < 0 || w >= cm->max_workers)
        return SHOAL_EINVAL;
    worker *k = &cm->w[w];
    snprintf(k->id, sizeof k->id, "%s", id && *id ? id : "?");
    /* the id labels every series: keep the labels unique */
    for (int i = 0; i < cm->max_workers; i++)
        if (i != w && cm->w[i].described && !strcmp(cm->w[i].id, k->id)) {
            char tail[16];
            snprintf(tail, sizeof tail, "~%d", w);
            size_t n = strlen(k->id), t = strlen(tail);
            if (n + t > ID_MAX)
                n = ID_MAX - t;
            memcpy(k->id + n, tail, t + 1);
            break;
        }
    snprintf(k->endpoint, sizeof k->endpoint, "%s", endpoint ? endpoint : "");
    k->owned = owned;
    k->expert_bytes = expert_bytes;
    k->mem_total = mem_total;
    k->described = 1;
    if (w + 1 > cm->nworkers)
        cm->nworkers = w + 1;
    return 0;
}

static worker *get_w(shoal_cmetrics *cm, int w)
{
    return cm && w >= 0 && w < cm->max_workers ? &cm->w[w] : NULL;
}

void shoal_cmetrics_worker_up(shoal_cmetrics *cm, int w, int up)
{
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_gauge_set(&k->up, up ? 1 : 0);
}

void shoal_cmetrics_worker_restarted(shoal_cmetrics *cm, int w)
{
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_add(&k->restarts, 1);
}

void shoal_cmetrics_worker_hung(shoal_cmetrics *cm, int w)
{
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_add(&k->hangs, 1);
}

void shoal_cmetrics_worker_backoff(shoal_cmetrics *cm, int w, double seconds)
{
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_gauge_set(&k->backoff_ms, (int64_t)(seconds * 1000.0 + 0.5));
}

void shoal_cmetrics_failover(shoal_cmetrics *cm, int w, uint32_t pairs)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->failovers, 1);
    shoal_metrics_add(&cm->resent_pairs, pairs);
    worker *k = get_w(cm, w);
    if (k) {
        shoal_metrics_add(&k->failovers, 1);
        shoal_metrics_add(&k->lost_pairs, pairs);
    }
}

void shoal_cmetrics_takeover(shoal_cmetrics *cm, int from, int w, uint32_t pairs)
{
    worker *k = get_w(cm, w);
    if (!k)
        return;
    shoal_metrics_add(&k->takeover_pairs, pairs);
    if (k->took_from && from >= 0 && from < cm->max_workers)
        shoal_metrics_add(&k->took_from[from], pairs);
}

void shoal_cmetrics_trunk_failover(shoal_cmetrics *cm, int w, uint64_t rows)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->failovers, 1);
    shoal_metrics_add(&cm->trunk_failovers, 1);
    shoal_metrics_add(&cm->resent_trunk_rows, rows);
    worker *k = get_w(cm, w);
    if (k) {
        shoal_metrics_add(&k->failovers, 1);
        shoal_metrics_add(&k->t_lost_rows, rows);
    }
}

void shoal_cmetrics_trunk_takeover(shoal_cmetrics *cm, int from, int w, uint64_t rows)
{
    (void)from;
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_add(&k->t_takeover_rows, rows);
}

void shoal_cmetrics_replica_pick(shoal_cmetrics *cm, int w, uint32_t pairs)
{
    worker *k = get_w(cm, w);
    if (k)
        shoal_metrics_add(&k->replica_picks, pairs);
}

void shoal_cmetrics_failover_time(shoal_cmetrics *cm, uint64_t ns)
{
    if (cm)
        shoal_metrics_observe(&cm->failover_time, ns);
}

void shoal_cmetrics_add_phase(shoal_cmetrics *cm, shoal_cmetrics_phase ph, uint64_t ns)
{
    if (cm && (int)ph >= 0 && ph < SHOAL_PHASE_COUNT)
        shoal_metrics_add(&cm->phase_ns[ph], ns);
}

void shoal_cmetrics_forward(shoal_cmetrics *cm, uint32_t T)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->tokens, T);
    shoal_metrics_add(&cm->chunks, 1);
}

void shoal_cmetrics_spec(shoal_cmetrics *cm, uint64_t fed, uint64_t passes, uint64_t drafted, uint64_t accepted)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->spec_fed, fed);
    shoal_metrics_add(&cm->spec_passes, passes);
    shoal_metrics_add(&cm->spec_drafted, drafted);
    shoal_metrics_add(&cm->spec_accepted, accepted);
}

void shoal_cmetrics_step(shoal_cmetrics *cm, uint32_t decode, uint32_t prompt)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->steps, 1);
    shoal_metrics_add(&cm->step_prompt, prompt);
    if (decode) {
        shoal_metrics_add(&cm->decode_steps, 1);
        shoal_metrics_add(&cm->decode_seqs, decode);
        if ((int64_t)decode > shoal_metrics_gauge_get(&cm->max_batch))
            shoal_metrics_gauge_set(&cm->max_batch, decode); /* one writer: the model thread */
    }
    shoal_metrics_gauge_set(&cm->last_batch, decode);
}

void shoal_cmetrics_request_queue(shoal_cmetrics *cm, uint64_t ns)
{
    if (cm)
        shoal_metrics_observe(&cm->req_queue, ns);
}

void shoal_cmetrics_request_ttft(shoal_cmetrics *cm, uint64_t ns)
{
    if (cm)
        shoal_metrics_observe(&cm->req_ttft, ns);
}

void shoal_cmetrics_request_itl(shoal_cmetrics *cm, uint64_t ns)
{
    if (cm)
        shoal_metrics_observe(&cm->req_itl, ns);
}

void shoal_cmetrics_constrain_mask(shoal_cmetrics *cm, uint64_t masks, uint64_t overlapped, uint64_t verify,
                                   uint64_t compute_ns, uint64_t wait_ns)
{
    if (!cm)
        return;
    shoal_metrics_add(&cm->cmasks, masks);
    shoal_metrics_add(&cm->cmask_overlapped, overlapped);
    shoal_metrics_add(&cm->cmask_verify, verify);
    shoal_metrics_add(&cm->cmask_ns, compute_ns);
    shoal_metrics_add(&cm->cmask_wait_ns, wait_ns);
}

void shoal_cmetrics_exchange(shoal_cmetrics *cm, int w, int layer, const shoal_cmetrics_xchg *x)
{
    worker *k = get_w(cm, w);
    if (!k)
        return;
    shoal_metrics_add(&k->requests, 1);
    shoal_metrics_add(&k->tokens, x->tokens);
    shoal_metrics_add(&k->pairs, x->pairs);
    shoal_metrics_add(&k->experts, x->experts);
    shoal_metrics_add(&k->bytes_out, x->bytes_out);
    shoal_metrics_add(&k->bytes_in, x->bytes_in);
    shoal_metrics_add(&k->queue_us, x->queue_us);
    shoal_metrics_add(&k->compute_us, x->compute_us);
    shoal_metrics_add(&k->rtt_ns, x->rtt_ns);
    /* what the worker did not account for is the network (both ways, incl.
     * ZeroMQ and the kernel's socket buffers); clamped: the two clocks tick
     * at the same rate, but rounding to µs can exceed a tiny rtt */
    uint64_t worker_ns = (x->queue_us + x->compute_us) * 1000u;
    uint64_t net = x->rtt_ns > worker_ns ? x->rtt_ns - worker_ns : 0;
    shoal_metrics_add(&k->network_ns, net);
    shoal_metrics_observe(&k->rtt, x->rtt_ns);
    shoal_metrics_observe(&k->net, net);
    if (layer >= 0 && layer < cm->num_layers) {
        shoal_metrics_observe(&k->layer_rtt[layer], x->rtt_ns);
        shoal_metrics_add(&k->layer_pairs[layer], x->pairs);
    }
}

void shoal_cmetrics_trunk(shoal_cmetrics *cm, int w, const shoal_cmetrics_txchg *x)
{
    worker *k = get_w(cm, w);
    if (!k)
        return;
    shoal_metrics_add(&k->t_requests, 1);
    shoal_metrics_add(&k->t_rows, x->rows);
    shoal_metrics_add(&k->t_weight, x->weight_bytes);
    shoal_metrics_add(&k->t_out, x->bytes_out);
    shoal_metrics_add(&k->t_in, x->bytes_in);
    shoal_metrics_add(&k->t_queue_us, x->queue_us);
    shoal_metrics_add(&k->t_compute_us, x->compute_us);
    uint64_t worker_ns = (x->queue_us + x->compute_us) * 1000u; /* as for the experts: clamped */
    shoal_metrics_add(&k->t_network_ns, x->rtt_ns > worker_ns ? x->rtt_ns - worker_ns : 0);
}

void shoal_cmetrics_layer_wait(shoal_cmetrics *cm, int layer, uint64_t wait_ns, int slowest)
{
    if (!cm || layer < 0 || layer >= cm->num_layers)
        return;
    shoal_metrics_observe(&cm->layer_wait[layer], wait_ns);
    worker *k = get_w(cm, slowest);
    if (k)
        shoal_metrics_add(&k->slowest, 1);
}

void shoal_cmetrics_failure_add(shoal_cmetrics *cm, int w, shoal_cmetrics_failure f)
{
    worker *k = get_w(cm, w);
    if (!k)
        return;
    if (f == SHOAL_CMETRICS_TIMEOUT)
        shoal_metrics_add(&k->timeouts, 1);
    else if (f == SHOAL_CMETRICS_STALE)
        shoal_metrics_add(&k->stale, 1);
    else
        shoal_metrics_add(&k->errors, 1);
}

/* ---- reading ------------------------------------------------------------ */

void shoal_cmetrics_get_totals(shoal_cmetrics *cm, shoal_cmetrics_totals *out)
{
    memset(out, 0, sizeof *out);
    out->tokens = shoal_metrics_get(&cm->tokens);
    out->chunks = shoal_metrics_get(&cm->chunks);
    out->spec_fed = shoal_metrics_get(&cm->spec_fed);
    out->spec_passes = shoal_metrics_get(&cm->spec_passes);
    out->spec_drafted = shoal_metrics_get(&cm->spec_drafted);
    out->spec_accepted = shoal_metrics_get(&cm->spec_accepted);
    for (int p = 0; p < SHOAL_PHASE_COUNT; p++)
        out->phase_s[p] = (double)shoal_metrics_get(&cm->phase_ns[p]) / 1e9;
}

int shoal_cmetrics_workers(shoal_cmetrics *cm)
{
    return cm ? cm->nworkers : 0;
}

static uint64_t all_pairs(shoal_cmetrics *cm)
{
    uint64_t s = 0;
    for (int i = 0; i < cm->nworkers; i++)
        s += shoal_metrics_get(&cm->w[i].pairs);
    return s;
}

void shoal_cmetrics_get_worker(shoal_cmetrics *cm, int w, shoal_cmetrics_worker_totals *o)
{
    memset(o, 0, sizeof *o);
    worker *k = get_w(cm, w);
    if (!k)
        return;
    o->requests = shoal_metrics_get(&k->requests);
    o->tokens = shoal_metrics_get(&k->tokens);
    o->pairs = shoal_metrics_get(&k->pairs);
    o->experts = shoal_metrics_get(&k->experts);
    o->bytes_out = shoal_metrics_get(&k->bytes_out);
    o->bytes_in = shoal_metrics_get(&k->bytes_in);
    o->weight_bytes = o->experts * cm->expert_bytes;
    o->timeouts = shoal_metrics_get(&k->timeouts);
    o->errors = shoal_metrics_get(&k->errors);
    o->stale = shoal_metrics_get(&k->stale);
    o->slowest = shoal_metrics_get(&k->slowest);
    o->queue_s = (double)shoal_metrics_get(&k->queue_us) / 1e6;
    o->compute_s = (double)shoal_metrics_get(&k->compute_us) / 1e6;
    o->network_s = (double)shoal_metrics_get(&k->network_ns) / 1e9;
    o->rtt_s = (double)shoal_metrics_get(&k->rtt_ns) / 1e9;
    o->trunk_requests = shoal_metrics_get(&k->t_requests);
    o->trunk_rows = shoal_metrics_get(&k->t_rows);
    o->trunk_weight_bytes = shoal_metrics_get(&k->t_weight);
    o->trunk_bytes_out = shoal_metrics_get(&k->t_out);
    o->trunk_bytes_in = shoal_metrics_get(&k->t_in);
    o->trunk_queue_s = (double)shoal_metrics_get(&k->t_queue_us) / 1e6;
    o->trunk_compute_s = (double)shoal_metrics_get(&k->t_compute_us) / 1e6;
    o->trunk_network_s = (double)shoal_metrics_get(&k->t_network_ns) / 1e9;
    uint64_t tot = all_pairs(cm);
    o->share = tot ? (double)o->pairs / (double)tot : 0;
    o->fair = cm->nworkers ? 1.0 / cm->nworkers : 0;
    shoal_metrics_snap s;
    shoal_metrics_snapshot(&k->rtt, &s);
    o->rtt_p50 = shoal_metrics_quantile(&s, 0.5);
    o->rtt_p90 = shoal_metrics_quantile(&s, 0.9);
    o->rtt_p99 = shoal_metrics_quantile(&s, 0.99);
    o->up = (int)shoal_metrics_gauge_get(&k->up);
}

double shoal_cmetrics_layer_imbalance(shoal_cmetrics *cm, int layer)
{
    if (!cm || layer < 0 || layer >= cm->num_layers || cm->nworkers == 0)
        return 0;
    uint64_t mx = 0, sum = 0;
    for (int i = 0; i < cm->nworkers; i++) {
        uint64_t v = shoal_metrics_get(&cm->w[i].layer_pairs[layer]);
        sum += v;
        if (v > mx)
            mx = v;
    }
    return sum ? (double)mx * cm->nworkers / (double)sum : 0;
}

/* ---- exposition --------------------------------------------------------- */

static const double qs[3] = {0.5, 0.9, 0.99};

#define WL(i) shoal_metrics_label wl[1] = {{"worker", cm->w[i].id}}

/* value = counter * mul / div (division last: seconds from integer µs or ns
 * print exactly as the workers print them) */
static void worker_counter(shoal_cmetrics *cm, shoal_metrics_buf *b, const char *name, const char *help,
                           size_t off, double mul, double div)
{
    shoal_metrics_family(b, name, SHOAL_METRICS_COUNTER, help);
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        const shoal_metrics_counter *c = (const shoal_metrics_counter *)((const char *)&cm->w[i] + off);
        shoal_metrics_sample(b, name, wl, 1, (double)shoal_metrics_get(c) * mul / div);
    }
}

void shoal_cmetrics_write(shoal_cmetrics *cm, shoal_metrics_buf *b)
{
    shoal_metrics_family(b, "shoal_coordinator_uptime_seconds", SHOAL_METRICS_GAUGE,
                         "Seconds since the coordinator's metrics were opened.");
    shoal_metrics_sample(b, "shoal_coordinator_uptime_seconds", NULL, 0,
                         (double)(shoal_metrics_now_ns() - cm->start_ns) / 1e9);
    shoal_metrics_family(b, "shoal_forward_tokens_total", SHOAL_METRICS_COUNTER,
                         "Tokens run through the model forward (prompt and generated).");
    shoal_metrics_sample(b, "shoal_forward_tokens_total", NULL, 0, (double)shoal_metrics_get(&cm->tokens));
    shoal_metrics_family(b, "shoal_forward_chunks_total", SHOAL_METRICS_COUNTER,
                         "Forward chunks (a prefill chunk or a decode step).");
    shoal_metrics_sample(b, "shoal_forward_chunks_total", NULL, 0, (double)shoal_metrics_get(&cm->chunks));
    shoal_metrics_family(b, "shoal_decode_fed_tokens_total", SHOAL_METRICS_COUNTER,
                         "Generated tokens fed back through the decode path (plain or speculative).");
    shoal_metrics_sample(b, "shoal_decode_fed_tokens_total", NULL, 0, (double)shoal_metrics_get(&cm->spec_fed));
    shoal_metrics_family(b, "shoal_decode_passes_total", SHOAL_METRICS_COUNTER,
                         "Forward passes the decode path ran for them; passes per token = this / "
                         "shoal_decode_fed_tokens_total (1 without drafting).");
    shoal_metrics_sample(b, "shoal_decode_passes_total", NULL, 0, (double)shoal_metrics_get(&cm->spec_passes));
    shoal_metrics_family(b, "shoal_draft_tokens_total", SHOAL_METRICS_COUNTER,
                         "Tokens drafted (prompt lookup) into verify chunks.");
    shoal_metrics_sample(b, "shoal_draft_tokens_total", NULL, 0, (double)shoal_metrics_get(&cm->spec_drafted));
    shoal_metrics_family(b, "shoal_draft_accepted_total", SHOAL_METRICS_COUNTER,
                         "Drafted tokens that were the ones decoding chose; acceptance rate = this / "
                         "shoal_draft_tokens_total.");
    shoal_metrics_sample(b, "shoal_draft_accepted_total", NULL, 0, (double)shoal_metrics_get(&cm->spec_accepted));
    shoal_metrics_family(b, "shoal_phase_seconds_total", SHOAL_METRICS_COUNTER,
                         "Wall seconds of the forward by phase; divide by shoal_forward_tokens_total for per-token "
                         "time.");
    for (int p = 0; p < SHOAL_PHASE_COUNT; p++) {
        shoal_metrics_label l[1] = {{"phase", phase_names[p]}};
        shoal_metrics_sample(b, "shoal_phase_seconds_total", l, 1, (double)shoal_metrics_get(&cm->phase_ns[p]) / 1e9);
    }

    /* the scheduler's step loop (continuous batching) */
    shoal_metrics_family(b, "shoal_sched_steps_total", SHOAL_METRICS_COUNTER,
                         "Steps of the scheduler's loop (a decode batch and/or prompt chunks).");
    shoal_metrics_sample(b, "shoal_sched_steps_total", NULL, 0, (double)shoal_metrics_get(&cm->steps));
    shoal_metrics_family(b, "shoal_sched_decode_steps_total", SHOAL_METRICS_COUNTER,
                         "Steps that decoded at least one sequence.");
    shoal_metrics_sample(b, "shoal_sched_decode_steps_total", NULL, 0, (double)shoal_metrics_get(&cm->decode_steps));
    shoal_metrics_family(b, "shoal_sched_decode_sequences_total", SHOAL_METRICS_COUNTER,
                         "Sequences decoded, summed over steps; divided by shoal_sched_decode_steps_total: the mean "
                         "batch size.");
    shoal_metrics_sample(b, "shoal_sched_decode_sequences_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->decode_seqs));
    shoal_metrics_family(b, "shoal_sched_step_prompt_tokens_total", SHOAL_METRICS_COUNTER,
                         "Prompt tokens prefilled by the step loop (in chunks within --step-tokens).");
    shoal_metrics_sample(b, "shoal_sched_step_prompt_tokens_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->step_prompt));
    shoal_metrics_family(b, "shoal_sched_batch_size", SHOAL_METRICS_GAUGE,
                         "Sequences decoded together in the last step (0: none was decoding).");
    shoal_metrics_sample(b, "shoal_sched_batch_size", NULL, 0, (double)shoal_metrics_gauge_get(&cm->last_batch));
    shoal_metrics_family(b, "shoal_sched_batch_size_max", SHOAL_METRICS_GAUGE,
                         "Most sequences decoded together in one step since start.");
    shoal_metrics_sample(b, "shoal_sched_batch_size_max", NULL, 0, (double)shoal_metrics_gauge_get(&cm->max_batch));
    shoal_metrics_family(b, "shoal_constrain_masks_total", SHOAL_METRICS_COUNTER,
                         "Structured output: vocabulary masks computed for constrained sequences (one per sampled "
                         "token of such a sequence).");
    shoal_metrics_sample(b, "shoal_constrain_masks_total", NULL, 0, (double)shoal_metrics_get(&cm->cmasks));
    shoal_metrics_family(b, "shoal_constrain_mask_seconds_total", SHOAL_METRICS_COUNTER,
                         "Structured output: wall seconds computing those masks.");
    shoal_metrics_sample(b, "shoal_constrain_mask_seconds_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->cmask_ns) / 1e9);
    shoal_metrics_family(b, "shoal_constrain_masks_overlapped_total", SHOAL_METRICS_COUNTER,
                         "Structured output: of those masks, the ones computed on the mask thread during a forward.");
    shoal_metrics_sample(b, "shoal_constrain_masks_overlapped_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->cmask_overlapped));
    shoal_metrics_family(b, "shoal_constrain_masks_verify_total", SHOAL_METRICS_COUNTER,
                         "Structured output: of the overlapped masks, those of drafted verify rows (computed during "
                         "the verify forward from the drafted ids).");
    shoal_metrics_sample(b, "shoal_constrain_masks_verify_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->cmask_verify));
    shoal_metrics_family(b, "shoal_constrain_mask_wait_seconds_total", SHOAL_METRICS_COUNTER,
                         "Structured output: wall seconds the sampler waited for a mask (the part of the mask time "
                         "not hidden behind the forward).");
    shoal_metrics_sample(b, "shoal_constrain_mask_wait_seconds_total", NULL, 0,
                         (double)shoal_metrics_get(&cm->cmask_wait_ns) / 1e9);
    {
        /* histograms only: windowed quantiles come from their rates
         * (histogram_quantile, `shoal top`); docs/METRICS.md */
        static const struct {
            const char *hist, *help;
            size_t off;
        } lat[] = {
            {"shoal_request_queue_seconds", "Per request: from submit to admission into a slot.",
             offsetof(shoal_cmetrics, req_queue)},
            {"shoal_request_ttft_seconds",
             "Per request: from submit to its first generated token (time to first token).",
             offsetof(shoal_cmetrics, req_ttft)},
            {"shoal_request_inter_token_seconds",
             "Per generated token after a request's first: the time since its previous token.",
             offsetof(shoal_cmetrics, req_itl)},
        };
        for (size_t i = 0; i < sizeof lat / sizeof lat[0]; i++) {
            shoal_metrics_snap s;
            shoal_metrics_snapshot((const shoal_metrics_hist *)((const char *)cm + lat[i].off), &s);
            shoal_metrics_family(b, lat[i].hist, SHOAL_METRICS_HISTOGRAM, lat[i].help);
            shoal_metrics_hist_samples(b, lat[i].hist, NULL, 0, &s);
        }
    }

    /* per-layer wait: only MoE layers that saw an exchange */
    shoal_metrics_family(b, "shoal_layer_wait_seconds", SHOAL_METRICS_SUMMARY,
                         "Per MoE layer: time the coordinator blocked waiting for the last expert reply, after "
                         "computing the shared experts.");
    for (int l = 0; l < cm->num_layers; l++) {
        if (!cm->is_moe[l])
            continue;
        shoal_metrics_snap s;
        shoal_metrics_snapshot(&cm->layer_wait[l], &s);
        if (!s.count)
            continue;
        char ls[16];
        snprintf(ls, sizeof ls, "%d", l);
        shoal_metrics_label lab[1] = {{"layer", ls}};
        shoal_metrics_summary_samples(b, "shoal_layer_wait_seconds", lab, 1, &s, qs, 3);
    }
    if (cm->nworkers) {
        shoal_metrics_family(b, "shoal_failovers_total", SHOAL_METRICS_COUNTER,
                             "Workers given up in the middle of an expert exchange or a trunk step (timeout, error, "
                             "disconnect) whose part was resent to other owners of the same experts or trunk rows "
                             "(replicas).");
        shoal_metrics_sample(b, "shoal_failovers_total", NULL, 0, (double)shoal_metrics_get(&cm->failovers));
        shoal_metrics_family(b, "shoal_trunk_failovers_total", SHOAL_METRICS_COUNTER,
                             "Of shoal_failovers_total, those in a trunk step (TRUNK_BATCH, --trunk remote).");
        shoal_metrics_sample(b, "shoal_trunk_failovers_total", NULL, 0,
                             (double)shoal_metrics_get(&cm->trunk_failovers));
        shoal_metrics_family(b, "shoal_failover_resent_trunk_rows_total", SHOAL_METRICS_COUNTER,
                             "Trunk matrix rows resent to another owner after a failover (each for all the "
                             "step's tokens).");
        shoal_metrics_sample(b, "shoal_failover_resent_trunk_rows_total", NULL, 0,
                             (double)shoal_metrics_get(&cm->resent_trunk_rows));
        shoal_metrics_family(b, "shoal_failover_resent_pairs_total", SHOAL_METRICS_COUNTER,
                             "(token, expert) pairs resent to another owner after a failover.");
        shoal_metrics_sample(b, "shoal_failover_resent_pairs_total", NULL, 0,
                             (double)shoal_metrics_get(&cm->resent_pairs));
        shoal_metrics_snap s;
        shoal_metrics_snapshot(&cm->failover_time, &s);
        shoal_metrics_family(b, "shoal_failover_seconds", SHOAL_METRICS_SUMMARY,
                             "Per failover: seconds from the lost part's send to the end of the exchange that "
                             "resent it (the time the token lost to the failure, at most).");
        shoal_metrics_summary_samples(b, "shoal_failover_seconds", NULL, 0, &s, qs, 3);
    }
    if (!cm->nworkers)
        return;
    shoal_metrics_family(b, "shoal_layer_imbalance", SHOAL_METRICS_GAUGE,
                         "Per MoE layer: max over workers of the (token, expert) pairs sent to a worker divided by "
                         "the mean over workers (1 = perfectly even).");
    for (int l = 0; l < cm->num_layers; l++) {
        if (!cm->is_moe[l])
            continue;
        char ls[16];
        snprintf(ls, sizeof ls, "%d", l);
        shoal_metrics_label lab[1] = {{"layer", ls}};
        shoal_metrics_sample(b, "shoal_layer_imbalance", lab, 1, shoal_cmetrics_layer_imbalance(cm, l));
    }

    shoal_metrics_family(b, "shoal_worker_info", SHOAL_METRICS_GAUGE,
                         "Always 1; labels: the worker's id (from its HELLO) and endpoint.");
    for (int i = 0; i < cm->nworkers; i++) {
        shoal_metrics_label l[2] = {{"worker", cm->w[i].id}, {"endpoint", cm->w[i].endpoint}};
        shoal_metrics_sample(b, "shoal_worker_info", l, 2, 1);
    }
    shoal_metrics_family(b, "shoal_worker_up", SHOAL_METRICS_GAUGE,
                         "1 if the worker answered its HELLO and every request since, 0 after a failure.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_up", wl, 1, (double)shoal_metrics_gauge_get(&cm->w[i].up));
    }
    shoal_metrics_family(b, "shoal_worker_restarts_total", SHOAL_METRICS_COUNTER,
                         "Times a local worker (`--workers N`) that exited was restarted by the coordinator.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_restarts_total", wl, 1,
                             (double)shoal_metrics_get(&cm->w[i].restarts));
    }
    shoal_metrics_family(b, "shoal_worker_hangs_total", SHOAL_METRICS_COUNTER,
                         "Times a local worker (`--workers N`) that stopped answering while it had work (hung, e.g. "
                         "SIGSTOPped) was killed and restarted by the coordinator.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_hangs_total", wl, 1, (double)shoal_metrics_get(&cm->w[i].hangs));
    }
    shoal_metrics_family(b, "shoal_worker_restart_backoff_seconds", SHOAL_METRICS_GAUGE,
                         "Seconds until a crash-looping local worker (`--workers N`) is restarted again (0: not "
                         "backing off).");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_restart_backoff_seconds", wl, 1,
                             (double)shoal_metrics_gauge_get(&cm->w[i].backoff_ms) / 1000.0);
    }
    worker_counter(cm, b, "shoal_worker_failovers_total",
                   "Times the worker was given up mid-exchange and its part resent to other owners.",
                   offsetof(worker, failovers), 1, 1);
    worker_counter(cm, b, "shoal_worker_lost_pairs_total",
                   "(token, expert) pairs of the worker's lost parts, resent to other owners.",
                   offsetof(worker, lost_pairs), 1, 1);
    worker_counter(cm, b, "shoal_worker_takeover_pairs_total",
                   "(token, expert) pairs the worker took over from a lost worker (resent to it).",
                   offsetof(worker, takeover_pairs), 1, 1);
    worker_counter(cm, b, "shoal_worker_lost_trunk_rows_total",
                   "Trunk matrix rows of the worker's lost parts, resent to other owners.",
                   offsetof(worker, t_lost_rows), 1, 1);
    worker_counter(cm, b, "shoal_worker_takeover_trunk_rows_total",
                   "Trunk matrix rows the worker took over from a lost worker (resent to it).",
                   offsetof(worker, t_takeover_rows), 1, 1);
    worker_counter(cm, b, "shoal_worker_replica_picks_total",
                   "(token, expert) pairs of replicated experts (several owners) sent to the worker when the "
                   "exchange picked it.",
                   offsetof(worker, replica_picks), 1, 1);
    shoal_metrics_family(b, "shoal_failover_takeover_pairs_total", SHOAL_METRICS_COUNTER,
                         "(token, expert) pairs of worker `from`'s lost parts that worker `to` took over (only "
                         "the pairs of workers that did).");
    for (int i = 0; i < cm->nworkers; i++)
        for (int f = 0; cm->w[i].took_from && f < cm->nworkers; f++) {
            uint64_t v = shoal_metrics_get(&cm->w[i].took_from[f]);
            if (!v)
                continue;
            shoal_metrics_label l[2] = {{"from", cm->w[f].id}, {"to", cm->w[i].id}};
            shoal_metrics_sample(b, "shoal_failover_takeover_pairs_total", l, 2, (double)v);
        }
    shoal_metrics_family(b, "shoal_worker_experts_owned", SHOAL_METRICS_GAUGE,
                         "(layer, expert) pairs the worker owns (from its HELLO).");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_experts_owned", wl, 1, (double)cm->w[i].owned);
    }
    shoal_metrics_family(b, "shoal_worker_expert_bytes", SHOAL_METRICS_GAUGE,
                         "Bytes of the expert weights the worker serves (from its HELLO).");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_expert_bytes", wl, 1, (double)cm->w[i].expert_bytes);
    }
    shoal_metrics_family(b, "shoal_worker_memory_total_bytes", SHOAL_METRICS_GAUGE,
                         "Physical memory of the worker's host (from its HELLO).");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_memory_total_bytes", wl, 1, (double)cm->w[i].mem_total);
    }
    worker_counter(cm, b, "shoal_worker_requests_total", "EXPERT_BATCH exchanges completed with the worker.",
                   offsetof(worker, requests), 1, 1);
    worker_counter(cm, b, "shoal_worker_tokens_total", "Activation rows sent to the worker.",
                   offsetof(worker, tokens), 1, 1);
    worker_counter(cm, b, "shoal_worker_pairs_total", "(token, expert) pairs the worker computed.",
                   offsetof(worker, pairs), 1, 1);
    worker_counter(cm, b, "shoal_worker_weight_bytes_total",
                   "Expert weight bytes the worker read for us: each distinct expert of a request once.",
                   offsetof(worker, experts), (double)cm->expert_bytes, 1);
    worker_counter(cm, b, "shoal_worker_sent_bytes_total", "Bytes of all frames sent to the worker.",
                   offsetof(worker, bytes_out), 1, 1);
    worker_counter(cm, b, "shoal_worker_received_bytes_total", "Bytes of all frames received from the worker.",
                   offsetof(worker, bytes_in), 1, 1);
    worker_counter(cm, b, "shoal_worker_queue_seconds_total",
                   "Seconds requests waited in the worker's queue, as the worker reported them.",
                   offsetof(worker, queue_us), 1, 1e6);
    worker_counter(cm, b, "shoal_worker_compute_seconds_total",
                   "Seconds the worker computed our requests, as the worker reported them.",
                   offsetof(worker, compute_us), 1, 1e6);
    worker_counter(cm, b, "shoal_worker_network_seconds_total",
                   "Round-trip seconds not spent queued or computing on the worker: network, ZeroMQ, "
                   "(de)serialisation.",
                   offsetof(worker, network_ns), 1, 1e9);
    worker_counter(cm, b, "shoal_worker_timeouts_total", "Requests to the worker that passed their deadline.",
                   offsetof(worker, timeouts), 1, 1);
    worker_counter(cm, b, "shoal_worker_errors_total",
                   "ERROR replies, malformed replies and send failures from or to the worker.",
                   offsetof(worker, errors), 1, 1);
    worker_counter(cm, b, "shoal_worker_stale_replies_total",
                   "Late replies to requests already given up on, dropped.", offsetof(worker, stale), 1, 1);
    worker_counter(cm, b, "shoal_worker_slowest_total",
                   "MoE layer exchanges in which this worker's reply arrived last.", offsetof(worker, slowest), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_requests_total",
                   "TRUNK_BATCH exchanges completed with the worker (trunk rows, --trunk remote).",
                   offsetof(worker, t_requests), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_rows_total",
                   "Trunk matrix output rows the worker computed (per request, all tokens).",
                   offsetof(worker, t_rows), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_weight_bytes_total",
                   "Bytes of trunk matrix rows the worker read for our requests (each request reads its rows once).",
                   offsetof(worker, t_weight), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_sent_bytes_total", "Bytes of all TRUNK_BATCH frames sent to the worker.",
                   offsetof(worker, t_out), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_received_bytes_total",
                   "Bytes of all TRUNK_RESULT frames received from the worker.", offsetof(worker, t_in), 1, 1);
    worker_counter(cm, b, "shoal_worker_trunk_queue_seconds_total",
                   "Seconds trunk requests waited in the worker's queue, as the worker reported them.",
                   offsetof(worker, t_queue_us), 1, 1e6);
    worker_counter(cm, b, "shoal_worker_trunk_compute_seconds_total",
                   "Seconds the worker computed our trunk rows, as the worker reported them.",
                   offsetof(worker, t_compute_us), 1, 1e6);
    worker_counter(cm, b, "shoal_worker_trunk_network_seconds_total",
                   "Trunk round-trip seconds not spent queued or computing on the worker.",
                   offsetof(worker, t_network_ns), 1, 1e9);

    uint64_t tot = all_pairs(cm);
    shoal_metrics_family(b, "shoal_worker_load_share", SHOAL_METRICS_GAUGE,
                         "The worker's share of all (token, expert) pairs sent.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        double v = tot ? (double)shoal_metrics_get(&cm->w[i].pairs) / (double)tot : 0;
        shoal_metrics_sample(b, "shoal_worker_load_share", wl, 1, v);
    }
    shoal_metrics_family(b, "shoal_worker_fair_share", SHOAL_METRICS_GAUGE,
                         "The worker's fair share of the load: 1 / number of workers.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_sample(b, "shoal_worker_fair_share", wl, 1, 1.0 / cm->nworkers);
    }

    shoal_metrics_family(b, "shoal_worker_rtt_seconds", SHOAL_METRICS_HISTOGRAM,
                         "Round trip of one EXPERT_BATCH exchange with the worker, from the first byte sent to the "
                         "reply received.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_snap s;
        shoal_metrics_snapshot(&cm->w[i].rtt, &s);
        shoal_metrics_hist_samples(b, "shoal_worker_rtt_seconds", wl, 1, &s);
    }
    shoal_metrics_family(b, "shoal_worker_network_time_seconds", SHOAL_METRICS_HISTOGRAM,
                         "Per exchange: round trip minus the worker's reported queue and compute time.");
    for (int i = 0; i < cm->nworkers; i++) {
        WL(i);
        shoal_metrics_snap s;
        shoal_metrics_snapshot(&cm->w[i].net, &s);
        shoal_metrics_hist_samples(b, "shoal_worker_network_time_seconds", wl, 1, &s);
    }
    shoal_metrics_family(b, "shoal_worker_layer_rtt_seconds", SHOAL_METRICS_SUMMARY,
                         "Round trip with the worker per MoE layer: p50/p90/p99.");
    for (int i = 0; i < cm->nworkers; i++)
        for (int l = 0; l < cm->num_layers; l++) {
            shoal_metrics_snap s;
            shoal_metrics_snapshot(&cm->w[i].layer_rtt[l], &s);
            if (!s.count)
                continue;
            char ls[16];
            snprintf(ls, sizeof ls, "%d", l);
            shoal_metrics_label lab[2] = {{"worker", cm->w[i].id}, {"layer", ls}};
            shoal_metrics_summary_samples(b, "shoal_worker_layer_rtt_seconds", lab, 2, &s, qs, 3);
        }
    shoal_metrics_family(b, "shoal_worker_layer_pairs_total", SHOAL_METRICS_COUNTER,
                         "(token, expert) pairs sent to the worker per MoE layer.");
    for (int i = 0; i < cm->nworkers; i++)
        for (int l = 0; l < cm->num_layers; l++) {
            if (!cm->is_moe[l])
                continue;
            char ls[16];
            snprintf(ls, sizeof ls, "%d", l);
            shoal_metrics_label lab[2] = {{"worker", cm->w[i].id}, {"layer", ls}};
            shoal_metrics_sample(b, "shoal_worker_layer_pairs_total", lab, 2,
                                 (double)shoal_metrics_get(&cm->w[i].layer_pairs[l]));
        }
}

/* ---- report ------------------------------------------------------------- */

static double ms(double s)
{
    return s * 1e3;
}

void shoal_cmetrics_report(shoal_cmetrics *cm, FILE *f, const shoal_cmetrics_totals *since)
{
    shoal_cmetrics_totals t;
    shoal_cmetrics_get_totals(cm, &t);
    if (since) {
        t.tokens -= since->tokens;
        t.chunks -= since->chunks;
        for (int p = 0; p < SHOAL_PHASE_COUNT; p++)
            t.phase_s[p] -= since->phase_s[p];
    }
    double sum = 0;
    for (int p = 0; p < SHOAL_PHASE_COUNT; p++)
        sum += t.phase_s[p];
    fprintf(f, "time per token by phase (ms, over %llu forward tokens):\n", (unsigned long long)t.tokens);
    for (int p = 0; p < SHOAL_PHASE_COUNT; p++)
        fprintf(f, "  %-10s %10.4f  %5.1f%%\n", phase_names[p], t.tokens ? ms(t.phase_s[p]) / (double)t.tokens : 0,
                sum > 0 ? 100 * t.phase_s[p] / sum : 0);
    if (!cm->nworkers)
        return;
    fprintf(f, "expert servers (rtt = network + queue + compute, from the workers' own figures):\n");
    fprintf(f, "  %-16s %2s %8s %9s %6s %6s %8s %8s %8s %9s %9s %9s %10s %10s %5s %5s\n", "worker", "up", "requests",
            "pairs", "share", "fair", "rtt p50", "rtt p90", "rtt p99", "net ms", "queue ms", "comp ms", "sent B",
            "recv B", "tmo", "err");
    for (int i = 0; i < cm->nworkers; i++) {
        shoal_cmetrics_worker_totals w;
        shoal_cmetrics_get_worker(cm, i, &w);
        fprintf(f, "  %-16s %2d %8llu %9llu %6.3f %6.3f %8.3f %8.3f %8.3f %9.2f %9.2f %9.2f %10llu %10llu %5llu %5llu\n",
                cm->w[i].id, w.up, (unsigned long long)w.requests, (unsigned long long)w.pairs, w.share, w.fair,
                ms(w.rtt_p50), ms(w.rtt_p90), ms(w.rtt_p99), ms(w.network_s), ms(w.queue_s), ms(w.compute_s),
                (unsigned long long)w.bytes_out, (unsigned long long)w.bytes_in, (unsigned long long)w.timeouts,
                (unsigned long long)w.errors);
    }
    fprintf(f, "per MoE layer: imbalance (max/mean pairs over workers), wait for the last reply (ms):\n");
    fprintf(f, "  %5s %9s %9s %9s\n", "layer", "imbalance", "wait p50", "wait p99");
    for (int l = 0; l < cm->num_layers; l++) {
        if (!cm->is_moe[l])
            continue;
        shoal_metrics_snap s;
        shoal_metrics_snapshot(&cm->layer_wait[l], &s);
        fprintf(f, "  %5d %9.3f %9.3f %9.3f\n", l, shoal_cmetrics_layer_imbalance(cm, l),
                s.count ? ms(shoal_metrics_quantile(&s, 0.5)) : 0.0, s.count ? ms(shoal_metrics_quantile(&s, 0.99)) : 0.0);
    }
}
