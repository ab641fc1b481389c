/* sched: the scheduler (sched.h) -- open/close and its model thread, which
 * runs the step loop (sched.h): admits jobs into slots (render the prompt,
 * check it against the context, admit its state against the budget,
 * continue from a kept sequence), then per step decodes one token for every
 * decoding slot in one batch and prefills prompt chunks within the step's
 * token budget, turning ids into events (text per channel, tool calls)
 * through the detokenizer or the chat output parser and the stop-string
 * filter. The jobs, the queue, the memo and the kept states it
 * works on are jobs.c's (sched_int.h). Everything here runs on the model
 * thread except open/close, cancel_running and the render threads' part
 * (render_job, render_main): queued jobs are rendered there, in the queue's
 * fair order, and only rendered jobs are admitted, so rendering a
 * large request never holds up the steps of the running ones. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "common/sbuf.h"
#include "common/log.h"
#include "coordinator/text/text.h"
#include "coordinator/obs/obs.h"
#include "coordinator/engine/engine.h"
#include "coordinator/pcache/pcache.h"
#include "coordinator/api/sched_int.h"
#include "coordinator/api/toolcons.h"

/* A slot's life: FREE -> WAIT (popped, rendered; waits while its state does
 * not fit the budget) -> PREFILL (prompt chunks, one per step at most) ->
 * DECODE (one token per step) -> FREE. */
enum { SLOT_FREE = 0, SLOT_WAIT, SLOT_PREFILL, SLOT_DECODE };

static void verify_hook(void *ctx, const int32_t *drafts, int k);

struct shoal_slot {
    shoal_sched *s;
    shoal_sched_job *job; /* NULL: free */
    int state;
    shoal_seq *seq;       /* capacity prompt + max_new, created at admission */
    size_t state_bytes;   /* of seq, charged against opts.state_bytes */
    int fed;              /* prompt ids in seq (prefill progress) */
    uint64_t order;       /* admission order: prompts are prefilled oldest first */
    uint64_t vacated_step; /* the cancel_step of the job a cancel took out of it (0: none) */
    uint64_t vacated_ns;   /* and its cancel_ns */
    uint64_t t_last;      /* the last generated token's time (ns) */
    int counted_wait;     /* this job's wait for state was counted */
    float *logits;        /* [vocab]: the last fed token's */
    int32_t *ids;         /* [max_context]: every fed id (prompt, then generated) */
    int n_ids, n_prompt, reused;
    int32_t *out;         /* [max_context]: every sampled id */
    /* prefix cache: capture positions in (reused, n_prompt), ascending, and
     * the next one; a slot waiting for another's capture (lead's job still
     * lead_job, until lead->fed reaches lead_pos) is not prefilled */
    int *caps, ncaps, capi;
    shoal_slot *lead;
    shoal_sched_job *lead_job;
    int lead_pos;
    uint64_t lead_order;
    int n_out, max_new;
    shoal_sampler *sampler;
    /* structured output (issue 36): the compiled constraint, its run and the
     * mask buffer ([vocab], kept for the slot's next constrained job) */
    shoal_cons *cons;
    shoal_cons_run *crun;
    shoal_toolcons *tcons;     /* tool calls the model opens itself (tool_choice auto) */
    uint8_t *cmask;
    /* the mask for the next sample, computed during the forward (overlap):
     * cmask_ready set by the mask thread with the mask's result (n allowed,
     * or -1 free; cmask_ban) and the time it took */
    int cmask_ready, cmask_n, cmask_verify; /* cmask_verify: from a verify row */
    int32_t cmask_ban;
    uint64_t cmask_ns;
    /* the masks of the verify rows of the slot's last drafted chunk (the
     * drafts' ids vids[1..vk], computed on the mask thread during the verify
     * forward): vmask[r] is the mask after the fed id and drafts 1..r, used
     * while the sampled ids follow the draft (vr: the next row) */
    shoal_cons_run *vrun;      /* look-ahead copy of crun (mask thread) */
    shoal_toolcons *vtcons;    /* look-ahead copy of tcons (mask thread) */
    uint8_t *vmask[SHOAL_DRAFT_MAX_K + 1];
    int32_t vids[SHOAL_DRAFT_MAX_K + 1];
    int vn[SHOAL_DRAFT_MAX_K + 1];
    int32_t vban[SHOAL_DRAFT_MAX_K + 1]; /* a tool constraint's free row: the id it bans */
    uint64_t vns[SHOAL_DRAFT_MAX_K + 1];
    int vk, vr, vwant;
    shoal_spec *spec;          /* the decode path of seq (speculative when drafting is on) */
    shoal_detok *detok;        /* completions */
    shoal_chatparse *parser;   /* chat */
    int answer_started;        /* chat: content or a tool call seen */
    int stop_hit;              /* a stop string matched: drop further text */
    int stop_which;            /* which one (index into the job's stop[]) */
    int reasoning_tokens;
    int ntools;
    /* stop-string filter: text held back per channel, and the last channel */
    shoal_sbuf held[2];
    int last_ch;
    /* memo recording */
    shoal_ev *rec, **rec_tail;
    size_t rec_bytes;
    int recording;
};


static int slots_init(shoal_sched *s, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    s->nslots = s->o.slots;
    s->slots = shoal_xcalloc((size_t)s->nslots, sizeof *s->slots);
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *sl = &s->slots[i];
        sl->s = s;
        sl->logits = shoal_xmalloc((size_t)s->vocab * sizeof *sl->logits);
        sl->ids = shoal_xmalloc((size_t)s->max_context * sizeof *sl->ids);
        sl->out = shoal_xmalloc((size_t)s->max_context * sizeof *sl->out);
        sl->caps = shoal_xmalloc((size_t)s->max_context * sizeof *sl->caps);
    }
    s->blogits = shoal_xmalloc((size_t)s->nslots * (size_t)s->vocab * sizeof *s->blogits);
    s->bseqs = shoal_xcalloc((size_t)s->max_batch, sizeof *s->bseqs);
    s->bids = shoal_xcalloc((size_t)s->max_batch, sizeof *s->bids);
    s->brows = shoal_xcalloc((size_t)s->nslots, sizeof *s->brows);
    s->bslots = shoal_xcalloc((size_t)s->nslots, sizeof *s->bslots);
    s->pslots = shoal_xcalloc((size_t)s->nslots, sizeof *s->pslots);
    s->pn = shoal_xcalloc((size_t)s->nslots, sizeof *s->pn);
    s->mslots = shoal_xcalloc((size_t)s->nslots, sizeof *s->mslots);
    return 0;
}

static void slots_free(shoal_sched *s)
{
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *sl = &s->slots[i];
        shoal_spec_free(sl->spec);
        shoal_seq_free(sl->seq);
        free(sl->logits);
        free(sl->ids);
        free(sl->out);
        free(sl->caps);
        shoal_sampler_free(sl->sampler);
        shoal_cons_run_free(sl->crun);
        shoal_toolcons_close(sl->tcons);
        shoal_cons_free(sl->cons);
        free(sl->cmask);
        shoal_cons_run_free(sl->vrun);
        shoal_toolcons_close(sl->vtcons);
        for (int r = 0; r <= SHOAL_DRAFT_MAX_K; r++)
            free(sl->vmask[r]);
        shoal_detok_close(sl->detok);
        shoal_chatparse_close(sl->parser);
        free(sl->held[0].p);
        free(sl->held[1].p);
        shoal_ev_free_list(sl->rec);
    }
    free(s->slots);
    free(s->blogits);
    free(s->bseqs);
    free(s->bids);
    free(s->bslots);
    free(s->brows);
    free(s->pslots);
    free(s->pn);
    free(s->mslots);
    s->slots = NULL;
    s->nslots = 0;
}

static void cancel_running(shoal_sched *s)
{
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < s->nslots; i++)
        if (s->slots[i].job)
            atomic_store(&s->slots[i].job->cancel, 1);
    pthread_mutex_unlock(&s->mu);
}

/* ---- events out ----------------------------------------------------------- */

static void emit(shoal_sched *s, shoal_slot *sl, shoal_ev *e)
{
    if (sl->recording) {
        size_t b = shoal__sched_ev_bytes(e);
        if (sl->rec_bytes + b > s->o.memo_bytes) { /* too large to keep: stop recording */
            shoal_ev_free_list(sl->rec);
            sl->rec = NULL;
            sl->rec_tail = &sl->rec;
            sl->recording = 0;
        } else {
            *sl->rec_tail = shoal__sched_ev_clone(e);
            sl->rec_tail = &(*sl->rec_tail)->next;
            sl->rec_bytes += b;
        }
    }
    shoal__sched_emit(sl->job, e);
}

static void emit_text(shoal_sched *s, shoal_slot *sl, shoal_channel ch, const char *t, size_t n)
{
    if (n == 0)
        return;
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_TEXT);
    e->channel = ch;
    e->text = shoal_xmalloc(n + 1);
    memcpy(e->text, t, n);
    e->text[n] = '\0';
    e->len = n;
    emit(s, sl, e);
}

static void emit_error(shoal_sched *s, shoal_slot *sl, int status, const char *code, const char *param,
                       const char *msg)
{
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_ERROR);
    e->status = status;
    snprintf(e->code, sizeof e->code, "%s", code);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    size_t n = strlen(msg); /* longer messages are cut, deliberately */
    if (n >= sizeof e->message)
        n = sizeof e->message - 1;
    memcpy(e->message, msg, n);
    e->message[n] = 0;
    sl->recording = 0;
    emit(s, sl, e);
}

static void flush_held(shoal_sched *s, shoal_slot *sl, int ch)
{
    emit_text(s, sl, (shoal_channel)ch, sl->held[ch].p, sl->held[ch].n);
    sl->held[ch].n = 0;
}

/* Text of one channel through the stop strings: emits what can no longer be
 * part of a match, holds back a suffix that might still become one. Returns
 * 1 when a stop string matched (the text before it was emitted, the rest
 * dropped). Held text is complete UTF-8: a suffix equal to a prefix of a
 * valid UTF-8 stop string starts on a lead byte. */
static int text_out(shoal_sched *s, shoal_slot *sl, shoal_channel ch, const char *t, size_t n)
{
    const shoal_gen_params *p = &sl->job->p;
    if ((int)ch != sl->last_ch) { /* a stop string does not span channels */
        flush_held(s, sl, sl->last_ch);
        sl->last_ch = (int)ch;
    }
    if (p->nstop == 0) {
        emit_text(s, sl, ch, t, n);
        return 0;
    }
    shoal_sbuf *h = &sl->held[ch];
    shoal_sbuf_add(h, t, n);
    size_t best = (size_t)-1;
    for (int i = 0; i < p->nstop; i++) {
        const char *m = memmem(h->p, h->n, p->stop[i], strlen(p->stop[i]));
        if (m && (size_t)(m - h->p) < best) {
            best = (size_t)(m - h->p);
            sl->stop_which = i;
        }
    }
    if (best != (size_t)-1) {
        emit_text(s, sl, ch, h->p, best);
        h->n = 0;
        return 1;
    }
    size_t keep = 0;
    for (int i = 0; i < p->nstop; i++) {
        size_t L = strlen(p->stop[i]);
        for (size_t k = L - 1 < h->n ? L - 1 : h->n; k > keep; k--)
            if (!memcmp(h->p + h->n - k, p->stop[i], k)) {
                keep = k;
                break;
            }
    }
    emit_text(s, sl, ch, h->p, h->n - keep);
    memmove(h->p, h->p + h->n - keep, keep);
    h->n = keep;
    return 0;
}

static int is_eos(const shoal_sched *s, int32_t id)
{
    for (int i = 0; i < s->n_eos; i++)
        if (s->eos[i] == id)
            return 1;
    return 0;
}

/* The sampled id's log-probability and the top alternatives, from the raw
 * logits row it was sampled from (sched.h SHOAL_EV_LOGPROB). */
static void emit_logprob(shoal_sched *s, shoal_slot *sl, int32_t id)
{
    const shoal_gen_params *p = &sl->job->p;
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_LOGPROB);
    int k = p->top_logprobs > SHOAL_MAX_TOP_LOGPROBS ? SHOAL_MAX_TOP_LOGPROBS : p->top_logprobs;
    e->id = id;
    e->logprob = shoal_logprobs(sl->logits, s->vocab, id, k, e->top_ids, e->top_lp);
    e->ntop = 0;
    while (e->ntop < k && e->top_ids[e->ntop] >= 0)
        e->ntop++;
    shoal_sbuf b = {0};
    size_t n;
    const uint8_t *t = shoal_tok_token_bytes(s->o.tok, id, &n);
    shoal_sbuf_add(&b, (const char *)t, n);
    e->tok_len = (int)n;
    for (int i = 0; i < e->ntop; i++) {
        t = shoal_tok_token_bytes(s->o.tok, e->top_ids[i], &n);
        shoal_sbuf_add(&b, (const char *)t, n);
        e->top_len[i] = (int)n;
    }
    shoal_sbuf_add(&b, "", 1); /* NUL-terminated, like every event text */
    e->text = b.p;
    e->len = b.n - 1;
    emit(s, sl, e);
}

/* ---- output: ids to text and tool calls --------------------------------------- */

static void on_parse_event(void *ud, const shoal_chatparse_event *ev)
{
    shoal_slot *sl = ud;
    shoal_sched *s = sl->s;
    if (sl->stop_hit)
        return;
    switch (ev->kind) {
    case SHOAL_CHATPARSE_REASONING:
        sl->stop_hit = text_out(s, sl, SHOAL_CH_REASONING, ev->text, ev->len);
        break;
    case SHOAL_CHATPARSE_CONTENT:
        sl->answer_started = 1;
        sl->stop_hit = text_out(s, sl, SHOAL_CH_CONTENT, ev->text, ev->len);
        break;
    case SHOAL_CHATPARSE_TOOL_CALL: {
        sl->answer_started = 1;
        flush_held(s, sl, sl->last_ch); /* text before the call goes out first */
        shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_TOOL);
        e->tool_index = ev->index;
        e->name = shoal_xstrdup(ev->name ? ev->name : "");
        e->len = ev->arguments ? strlen(ev->arguments) : 0;
        e->text = shoal_xmalloc(e->len + 1);
        memcpy(e->text, ev->arguments ? ev->arguments : "", e->len + 1);
        sl->ntools++;
        emit(s, sl, e);
        break;
    }
    case SHOAL_CHATPARSE_ISSUE:
        SHOAL_DEBUG("sched: malformed model output: %.*s", (int)ev->len, ev->text);
        break;
    }
}

/* Prepares the output state for the slot's job. Returns 0 or -1. */
static int output_begin(shoal_sched *s, shoal_slot *sl)
{
    const shoal_gen_params *p = &sl->job->p;
    sl->answer_started = sl->stop_hit = 0;
    sl->stop_which = -1;
    shoal_chatparse_close(sl->parser);
    sl->parser = NULL;
    if (p->kind != SHOAL_GEN_CHAT) {
        const char *t;
        size_t n;
        if (!sl->detok) {
            shoal_detok_opts dopts = {.skip_special = 1};
            return shoal_detok_open(&sl->detok, s->o.tok, &dopts) ? -1 : 0;
        }
        shoal_detok_flush(sl->detok, &t, &n); /* reset: nothing is pending between jobs */
        return 0;
    }
    char err[256];
    /* partial mode: the prompt ends inside the response element */
    shoal_chatparse_opts po = {.thinking_off = !p->thinking || p->partial, .on_event = on_parse_event, .ud = sl};
    if (shoal_chatparse_open(&sl->parser, s->o.tok, &po, err, sizeof err)) {
        SHOAL_ERROR("sched: %s", err);
        return -1;
    }
    return 0;
}

/* One sampled id. Returns 2 when it ended the message (an end-of-sequence
 * id), 1 when a stop string matched, 0 to go on, -1 on an internal failure. */
static int output_token(shoal_sched *s, shoal_slot *sl, int32_t id)
{
    if (sl->parser) {
        int in_reasoning = sl->job->p.thinking && !sl->job->p.partial && !sl->answer_started;
        int end = shoal_chatparse_feed(sl->parser, id);
        if (in_reasoning && !sl->answer_started) /* the id that began the answer is not reasoning */
            sl->reasoning_tokens++;
        if (sl->stop_hit)
            return 1;
        return end || is_eos(s, id) ? 2 : 0;
    }
    if (is_eos(s, id))
        return 2;
    const char *t;
    size_t n;
    if (shoal_detok_feed(sl->detok, id, &t, &n))
        return -1;
    return text_out(s, sl, SHOAL_CH_CONTENT, t, n);
}

/* ---- one job's life --------------------------------------------------------- */

static void release(shoal_sched *s, shoal_slot *sl, const shoal_sched_stats *add)
{
    shoal_sched_job *j = sl->job;
    shoal__sched_count(s, add);
    shoal_sampler_free(sl->sampler);
    sl->sampler = NULL;
    shoal_cons_run_free(sl->crun);
    sl->crun = NULL;
    shoal_cons_run_free(sl->vrun);
    sl->vrun = NULL;
    sl->vk = sl->vwant = 0;
    shoal_toolcons_close(sl->vtcons); /* it borrows tcons's compiled constraints */
    sl->vtcons = NULL;
    shoal_toolcons_close(sl->tcons);
    sl->tcons = NULL;
    sl->cmask_ready = 0;
    shoal_cons_free(sl->cons);
    sl->cons = NULL;
    shoal_ev_free_list(sl->rec);
    sl->rec = NULL;
    sl->rec_tail = &sl->rec;
    sl->recording = 0;
    sl->held[0].n = sl->held[1].n = 0;
    shoal_spec_free(sl->spec);
    sl->spec = NULL;
    shoal_seq_free(sl->seq); /* the state goes back to the budget at once */
    sl->seq = NULL;
    uint64_t canceled_at = add->canceled ? atomic_load(&j->cancel_step) : 0;
    uint64_t canceled_ns = canceled_at ? atomic_load(&j->cancel_ns) : 0;
    pthread_mutex_lock(&s->mu);
    sl->vacated_step = canceled_at;
    sl->vacated_ns = canceled_ns;
    if (sl->state == SLOT_WAIT && s->waiting_state)
        s->waiting_state = 0;
    s->state_used -= sl->state_bytes;
    sl->state_bytes = 0;
    sl->state = SLOT_FREE;
    sl->job = NULL;
    sl->lead = NULL;
    sl->lead_job = NULL;
    sl->ncaps = sl->capi = 0;
    s->running--;
    pthread_mutex_unlock(&s->mu);
    shoal_sched_job_unref(j);
}

static void finish(shoal_sched *s, shoal_slot *sl, const char *reason, int stopped_by_string)
{
    shoal_sched_job *j = sl->job;
    if (stopped_by_string)
        sl->stop_hit = 1; /* what the parser or detokenizer still holds is after the stop */
    if (sl->parser) {
        shoal_chatparse_finish(sl->parser, !strcmp(reason, "length"));
    } else if (!stopped_by_string) {
        const char *t;
        size_t n;
        shoal_detok_flush(sl->detok, &t, &n);
        if (n)
            sl->stop_hit = text_out(s, sl, SHOAL_CH_CONTENT, t, n);
    }
    if (sl->stop_hit && !stopped_by_string) /* the held-back tail completed a stop string */
        reason = "stop";
    if (!sl->stop_hit) {
        flush_held(s, sl, 0);
        flush_held(s, sl, 1);
    }
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_DONE);
    snprintf(e->finish, sizeof e->finish, "%s", sl->ntools && !strcmp(reason, "stop") ? "tool_calls" : reason);
    e->stop_index = sl->stop_hit ? sl->stop_which : -1;
    e->completion_tokens = sl->n_out;
    e->reasoning_tokens = sl->reasoning_tokens;
    if (j->p.return_token_ids) {
        e->prompt_ids = shoal_xmalloc((size_t)sl->n_prompt * sizeof(int32_t));
        memcpy(e->prompt_ids, sl->ids, (size_t)sl->n_prompt * sizeof(int32_t));
        e->n_prompt_ids = sl->n_prompt;
        if (sl->n_out) {
            e->output_ids = shoal_xmalloc((size_t)sl->n_out * sizeof(int32_t));
            memcpy(e->output_ids, sl->out, (size_t)sl->n_out * sizeof(int32_t));
        }
        e->n_output_ids = sl->n_out;
    }
    emit(s, sl, e);
    if (sl->recording && j->has_memo) {
        shoal__sched_memo_put(s, j->memo_key, sl->rec, sl->rec_bytes);
        sl->rec = NULL;
        sl->rec_tail = &sl->rec;
    }
    /* the state after every fed id, for a next turn that extends it (drafts
     * run ahead dropped first) */
    char serr[320];
    if (shoal_spec_settle(sl->spec, serr, sizeof serr) == 0)
        shoal__sched_kept_put(s, sl->ids, sl->n_ids, sl->seq, sl->logits);
    shoal_sched_stats add = {.completed = 1,
                             .prompt_tokens = (uint64_t)sl->n_prompt,
                             .completion_tokens = (uint64_t)sl->n_out,
                             .reused_tokens = (uint64_t)sl->reused,
                             .prefilled_tokens = (uint64_t)(sl->n_prompt - sl->reused)};
    release(s, sl, &add);
}

/* A forward failed: map the engine's code to what the client sees. */
/* The whole prompt is in the sequence: start drafting, tell the client, and
 * decode from the next step. */
static void start_decoding(shoal_sched *s, shoal_slot *sl)
{
    if (sl->spec)
        shoal_spec_begin(sl->spec);
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_START);
    e->prompt_tokens = sl->n_prompt;
    e->reused_tokens = sl->reused;
    emit(s, sl, e);
    sl->state = SLOT_DECODE;
}

/* One warning per distinct worker failure: the requests that meet a down
 * worker all fail with the same message, and a hundred of them in a second
 * would flood the log. A message equal to the last one within 10 s is
 * counted instead, and the count is logged with the next failure that
 * differs or comes 10 s or more later. Model thread only (one scheduler per
 * process logs). */
static void warn_worker_failure(const char *err)
{
    static char last[512];
    static uint64_t repeats;
    static struct timespec first;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double age = (double)(now.tv_sec - first.tv_sec) + (double)(now.tv_nsec - first.tv_nsec) / 1e9;
    if (last[0] && !strncmp(last, err, sizeof last - 1) && age < 10) {
        repeats++;
        return;
    }
    if (repeats)
        SHOAL_WARN("sched: the previous failure repeated %llu more times (requests answered 503)",
                   (unsigned long long)repeats);
    repeats = 0;
    first = now;
    snprintf(last, sizeof last, "%s", err);
    SHOAL_WARN("sched: %s", err);
}

static void fail_forward(shoal_sched *s, shoal_slot *sl, int rc, const char *err)
{
    shoal_sched_stats add = {0};
    if (rc == SHOAL_ECANCELED || atomic_load(&sl->job->cancel)) {
        add.canceled = 1;
        release(s, sl, &add);
        return;
    }
    add.failed = 1;
    if (rc == SHOAL_EIO) {
        /* a model file truncated under the mapping (the engine logged it once,
         * by name) or unreadable (a streamed trunk's read failed): a named
         * error, and the server serves on (/health names a truncated file) */
        if (!strstr(err, "truncated while mapped"))
            SHOAL_ERROR("sched: %s", err);
        emit_error(s, sl, 503, "model_unavailable", NULL,
                   "a model file could not be read (truncated under the server, or failing storage); see the "
                   "server log and /health");
    } else if (rc == SHOAL_EPEER || rc == SHOAL_ETIMEOUT || rc == SHOAL_EPROTO || rc == SHOAL_EVERSION) {
        /* the engine's message names the worker (endpoint) that failed */
        warn_worker_failure(err);
        emit_error(s, sl, 503, "worker_unavailable", NULL, err);
    } else {
        SHOAL_ERROR("sched: forward failed: %s (%s)", err, shoal_err_name(rc));
        emit_error(s, sl, 500, "internal_error", NULL, "the model failed while generating; see the server log");
    }
    release(s, sl, &add);
}


/* The prompt's ids (appended to *ids). Returns 0, or a negative code with
 * the message in err; *param names the field at fault. Uses only the
 * tokenizer: any thread. */
static int encode_prompt(const shoal_sched *s, const shoal_gen_params *p, shoal_tok_ids *ids, const char **param,
                         char *err, size_t errlen)
{
    *param = "prompt";
    if (p->kind != SHOAL_GEN_CHAT) {
        if (p->prompt)
            return shoal_tok_encode(s->o.tok, p->prompt, p->prompt_len, 1, ids, err, errlen);
        for (int i = 0; i < p->n_prompt_ids; i++)
            shoal_tok_ids_push(ids, p->prompt_ids[i]);
        return 0;
    }
    *param = "messages";
    shoal_chat_opts co = {
        .thinking_off = !p->thinking,
        .thinking_effort = p->effort[0] ? p->effort : NULL,
        .effort_rule = SHOAL_CHAT_EFFORT_ENCODER,
        .tools = p->tools,
        .tool_choice = p->tool_choice,
        .response_format = p->response_format,
    };
    return shoal_chat_encode(s->o.tok, p->messages, &co, ids, err, errlen);
}

int shoal_sched_prompt_tokens(shoal_sched *s, const shoal_gen_params *p, int *n, char *err, size_t errlen)
{
    shoal_tok_ids ids = {0};
    const char *param;
    int rc = encode_prompt(s, p, &ids, &param, err, errlen);
    *n = rc ? 0 : (int)ids.n;
    shoal_tok_ids_free(&ids);
    return rc;
}

/* Render thread: the job's prompt as ids (chat template + tokenizer, or the
 * completion's text or ids) into j->rids / j->rn, or its error into j->rrc /
 * j->rerr. Linear in the request's size (docs/CONFIG.md, "Resource bounds"),
 * and off the model thread, so a 4 MB request delays other requests' steps
 * by nothing and their admission by its own render time at most. */
static void render_job(shoal_sched *s, shoal_sched_job *j)
{
    shoal_tok_ids ids = {0};
    const char *param;
    j->rerr[0] = 0;
    int rc = encode_prompt(s, &j->p, &ids, &param, j->rerr, sizeof j->rerr);
    if (!rc && ids.n > (size_t)1 << 30) {
        rc = SHOAL_EINVAL; /* unreachable under the body limit; keeps rn an int */
        snprintf(j->rerr, sizeof j->rerr, "the prompt has more than 2^30 tokens");
    }
    j->rrc = rc;
    if (rc) {
        shoal_tok_ids_free(&ids);
        return;
    }
    j->rids = ids.v; /* the job owns them now */
    j->rn = (int)ids.n;
}

/* s->mu held: a fork child's ids copied from its parent's render, when the
 * parent has them (rendered, not yet admitted: admission frees them). 1 when
 * copied. The copy is a memcpy of the ids, far cheaper than a render. */
static int copy_parent_render(shoal_sched_job *j)
{
    const shoal_sched_job *p = j->fork_of;
    if (!p || p->rstate != SHOAL_RENDER_DONE || p->rrc || !p->rids)
        return 0;
    j->rids = shoal_xmalloc((size_t)(p->rn > 0 ? p->rn : 1) * sizeof *j->rids);
    memcpy(j->rids, p->rids, (size_t)p->rn * sizeof *j->rids);
    j->rn = p->rn;
    j->rrc = 0;
    return 1;
}

/* One turn of a render thread: pick (waiting when wait is set and nothing is
 * renderable), render or copy, mark done. 0 when nothing was picked. */
static int render_turn(shoal_sched *s, int wait)
{
    pthread_mutex_lock(&s->mu);
    shoal_sched_job *j;
    while (!(j = shoal__sched_pick_render(s)) && wait && !s->stopping)
        pthread_cond_wait(&s->rcv, &s->mu);
    int copied = j && copy_parent_render(j);
    pthread_mutex_unlock(&s->mu);
    if (!j)
        return 0;
    if (!copied && !atomic_load(&j->cancel))
        render_job(s, j);
    pthread_mutex_lock(&s->mu);
    shoal__sched_render_done(s, j);
    pthread_mutex_unlock(&s->mu);
    shoal_sched_job_unref(j); /* the renderer's reference */
    return 1;
}

int shoal__sched_render_next(shoal_sched *s)
{
    return render_turn(s, 0);
}

static void *render_main(void *arg)
{
    shoal_sched *s = arg;
    while (render_turn(s, 1))
        ;
    return NULL; /* stopping */
}

/* The rendered prompt into sl->ids (model thread). Returns 0, or emits the
 * error and returns -1. */
static int render(shoal_sched *s, shoal_slot *sl)
{
    shoal_sched_job *j = sl->job;
    shoal_gen_params *p = &j->p;
    int rc = j->rrc;
    const char *param = p->kind == SHOAL_GEN_CHAT ? "messages" : "prompt";
    if (rc) {
        if (rc == SHOAL_EINTERNAL) {
            SHOAL_ERROR("sched: tokenizer failed: %s", j->rerr);
            emit_error(s, sl, 500, "internal_error", NULL, "the tokenizer failed; see the server log");
        } else {
            /* the encoder's message names the field ("messages[2].tool_calls[0]...") */
            emit_error(s, sl, 400, rc == SHOAL_EUNSUPPORTED ? "unsupported_value" : "invalid_request_error",
                       param, j->rerr);
        }
        return -1;
    }
    int n = j->rn;
    int limit = s->max_context;
    if (n == 0 || (p->max_tokens ? (long)n + p->max_tokens > limit : n >= limit)) {
        char msg[256];
        if (n == 0)
            snprintf(msg, sizeof msg, "the prompt is empty after tokenization");
        else if (p->max_tokens)
            snprintf(msg, sizeof msg,
                     "this model's maximum context length is %d tokens; the request needs %d "
                     "(%d in the prompt, %d for the completion)",
                     limit, n + p->max_tokens, n, p->max_tokens);
        else
            snprintf(msg, sizeof msg, "this model's maximum context length is %d tokens; the prompt has %d", limit,
                     n);
        emit_error(s, sl, 400, n ? "context_length_exceeded" : "invalid_request_error", param, msg);
        return -1;
    }
    memcpy(sl->ids, j->rids, (size_t)n * sizeof *sl->ids);
    /* copied: the job need not hold them while it runs (under mu: a fork
     * child's render may be copying them) */
    pthread_mutex_lock(&s->mu);
    free(j->rids);
    j->rids = NULL;
    pthread_mutex_unlock(&s->mu);
    sl->n_ids = sl->n_prompt = n;
    sl->max_new = p->max_tokens ? p->max_tokens : limit - n;
    return 0;
}

/* Structured output: compile the request's constraint, the vocabulary trie
 * once, and the run. What must follow the constrained text: in a chat, the
 * rest of K3's reply after the content (thinking is off, api_parse.c:
 * </response></message><|end_of_msg|> as K3 writes it, chatparse.h); for a
 * forced tool call, the call's opening is forced before the arguments (K3's
 * json element, raw JSON) and its closing after; in a completion, the first
 * stop id. */
static int constrain_begin(shoal_sched *s, shoal_slot *sl, char *err, size_t errlen)
{
    const shoal_gen_params *p = &sl->job->p;
    int rc = shoal_cons_compile_spec(&sl->cons, p->constraint, err, errlen);
    if (rc)
        return rc;
    if (!s->cvocab && (rc = shoal_cons_vocab_build(&s->cvocab, s->o.tok, err, errlen)))
        return rc;
    int32_t end[64], pre[64];
    int n_end = 0, n_pre = 0;
    const char *tool = json_string_value(json_object_get(p->constraint, "tool"));
    if (p->kind == SHOAL_GEN_CHAT) {
        static const char *const reply_end[] = {"<|close|>", "response", "<|sep|>", "<|close|>", "message",
                                                "<|sep|>", "<|end_of_msg|>"};
        static const char *const call_end[] = {"<|close|>", "json", "<|sep|>", "<|close|>", "call", "<|sep|>",
                                               "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>",
                                               "<|end_of_msg|>"};
        if (tool) {
            const char *call_pre[] = {"<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>",
                                      "<|open|>", "call", " tool", "=\"", tool, "\"", " index", "=\"", "1", "\"",
                                      "<|sep|>", "<|open|>", "json", " type", "=\"", "object", "\"", "<|sep|>"};
            n_pre = shoal_toolcons_ids(s->o.tok, call_pre, (int)(sizeof call_pre / sizeof call_pre[0]), pre, 64, err, errlen);
            n_end = shoal_toolcons_ids(s->o.tok, call_end, (int)(sizeof call_end / sizeof call_end[0]), end, 64, err, errlen);
        } else {
            n_end = shoal_toolcons_ids(s->o.tok, reply_end, (int)(sizeof reply_end / sizeof reply_end[0]), end, 64, err, errlen);
        }
        if (n_end < 0 || n_pre < 0) { /* not K3's format: the text alone, then the stop id */
            if (tool)
                return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED,
                                     "a forced tool call needs K3's chat markers in the vocabulary");
            n_end = n_pre = 0;
        }
    }
    if (!n_end)
        end[n_end++] = s->eos[0];
    if (!sl->cmask)
        sl->cmask = shoal_xmalloc((size_t)s->vocab);
    if ((rc = shoal_cons_run_create(&sl->crun, sl->cons, s->cvocab, end, n_end, err, errlen)))
        return rc;
    return n_pre ? shoal_cons_run_set_prefix(sl->crun, pre, n_pre) : 0;
}

/* Tool calls the model opens itself (tool_choice auto, absent, or required
 * with several tools): once it leaves the content, K3's structure is kept
 * and each call's arguments follow its function's parameters (toolcons.h).
 * Not in partial mode (the reply continues a client's text) nor on a
 * vocabulary without K3's markers (then nothing changes). */
static int tools_begin(shoal_sched *s, shoal_slot *sl, char *err, size_t errlen)
{
    const shoal_gen_params *p = &sl->job->p;
    const char *tc = json_string_value(p->tool_choice);
    if (p->kind != SHOAL_GEN_CHAT || !json_array_size(p->tools) || p->partial ||
        (p->tool_choice && (!tc || !strcmp(tc, "none"))))
        return 0;
    if (shoal_tok_special_id(s->o.tok, "<|open|>") < 0)
        return 0;
    int rc;
    if (!s->cvocab && (rc = shoal_cons_vocab_build(&s->cvocab, s->o.tok, err, errlen)))
        return rc;
    if (!sl->cmask)
        sl->cmask = shoal_xmalloc((size_t)s->vocab);
    shoal_toolcons_opts o = {.tools = p->tools,
                             .required = tc && !strcmp(tc, "required"),
                             .max_calls = p->max_tool_calls,
                             .thinking = p->thinking};
    return shoal_toolcons_open(&sl->tcons, s->o.tok, s->cvocab, &o, err, errlen);
}

/* ---- prefix cache (opts.pcache) ------------------------------------------------ */

/* Where the slot's prompt is captured while it is prefilled: after every
 * <|end_of_msg|> id (the renderer puts one at the end of each message and
 * nowhere else: a client's text cannot produce it) and every pcache_stride
 * tokens, below n_prompt (a resume must leave one token to prefill, whose
 * logits start the answer; the whole prompt is kept by kept_put). */
static void plan_captures(shoal_sched *s, shoal_slot *sl)
{
    sl->ncaps = sl->capi = 0;
    if (!s->o.pcache)
        return;
    int stride = s->o.pcache_stride;
    for (int i = 0; i + 1 < sl->n_prompt; i++) {
        int p = i + 1;
        if ((s->eom_id >= 0 && sl->ids[i] == s->eom_id) || (stride > 0 && p % stride == 0))
            sl->caps[sl->ncaps++] = p;
    }
}

static void skip_captures(shoal_slot *sl)
{
    while (sl->capi < sl->ncaps && sl->caps[sl->capi] <= sl->fed)
        sl->capi++;
}

/* The tokens the slot may prefill before its next capture position. */
static int until_capture(const shoal_slot *sl)
{
    return sl->capi < sl->ncaps ? sl->caps[sl->capi] - sl->fed : sl->n_prompt - sl->fed;
}

/* After a prompt chunk: capture the state when the slot stands on a capture
 * position. The memory tier only takes what the slots leave of the state
 * budget. A failed capture is logged; the request goes on. */
static void capture_due(shoal_sched *s, shoal_slot *sl)
{
    if (sl->capi >= sl->ncaps || sl->caps[sl->capi] != sl->fed)
        return;
    sl->capi++;
    if (s->o.state_bytes) {
        size_t bytes = shoal_seq_state_size(s->o.model, sl->fed);
        pthread_mutex_lock(&s->mu);
        size_t used = s->state_used;
        pthread_mutex_unlock(&s->mu);
        if (used + bytes > s->o.state_bytes)
            return;
        shoal_pcache_shrink(s->o.pcache, s->o.state_bytes - used - bytes);
    }
    char err[320];
    if (shoal_pcache_capture(s->o.pcache, sl->ids, sl->fed, sl->seq, err, sizeof err))
        SHOAL_WARN("sched: prefix capture at %d: %s", sl->fed, err);
}

/* A slot about to prefill from sl->fed: is another slot prefilling the same
 * prefix up to a capture position beyond what this one resumed from? Then
 * wait for that capture (sl->lead) rather than compute the prefix twice. */
static void find_lead(shoal_sched *s, shoal_slot *sl)
{
    sl->lead = NULL;
    if (!s->o.pcache)
        return;
    int best = sl->fed;
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *o = &s->slots[i];
        if (o == sl || !o->job || o->state != SLOT_PREFILL || o->lead)
            continue;
        int lim = (sl->n_prompt < o->n_prompt ? sl->n_prompt : o->n_prompt) - 1, c = 0;
        while (c < lim && sl->ids[c] == o->ids[c])
            c++;
        for (int k = o->capi; k < o->ncaps && o->caps[k] <= c; k++)
            if (o->caps[k] > best && o->caps[k] > o->fed) {
                best = o->caps[k];
                sl->lead = o;
                sl->lead_job = o->job;
                sl->lead_pos = best;
                sl->lead_order = o->order;
            }
    }
}

/* 1 while the slot waits for its lead's capture. When the wait ends (the
 * lead reached the position, or left), resume from the longest captured
 * prefix now (normally the lead's capture) and look for a lead again. */
static int lead_wait(shoal_sched *s, shoal_slot *sl)
{
    shoal_slot *o = sl->lead;
    if (!o)
        return 0;
    if (atomic_load(&sl->job->cancel)) { /* canceled while waiting: let next_prompt release it now */
        sl->lead = NULL;
        return 0;
    }
    if (o->job == sl->lead_job && o->order == sl->lead_order && o->state == SLOT_PREFILL &&
        o->fed < sl->lead_pos && !atomic_load(&o->job->cancel))
        return 1;
    sl->lead = NULL;
    sl->lead_job = NULL;
    if (shoal_pcache_lookup(s->o.pcache, sl->ids, sl->n_prompt, sl->n_prompt - 1) > sl->fed) {
        int got = shoal_pcache_resume(s->o.pcache, sl->ids, sl->n_prompt, sl->n_prompt - 1, sl->seq);
        if (got) /* the sequence now holds that prefix */
            sl->fed = sl->reused = got;
    }
    skip_captures(sl);
    find_lead(s, sl);
    return sl->lead != NULL;
}

/* Admission: render, sampler, output state, reuse or prefill, START. */

/* Bytes of a sequence of capacity cap (shoal_seq_create allocates this). */
static size_t state_need(const shoal_sched *s, int cap)
{
    return s->seq_fixed + (size_t)cap * s->seq_per_token + s->spec_extra;
}

/* A popped job: output state, render, sampler. Returns 0, or emits the error,
 * frees the slot and returns -1. */
static int prepare(shoal_sched *s, shoal_slot *sl)
{
    shoal_sched_job *j = sl->job;
    shoal_gen_params *p = &j->p;
    sl->n_out = sl->reasoning_tokens = sl->ntools = sl->reused = sl->fed = 0;
    sl->counted_wait = 0;
    sl->last_ch = SHOAL_CH_CONTENT;
    sl->rec = NULL;
    sl->rec_tail = &sl->rec;
    sl->rec_bytes = 0;
    sl->recording = j->has_memo && s->o.memo_entries > 0;
    if (render(s, sl)) {
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return -1;
    }
    char err[320];
    shoal_sampler_opts so = {.temperature = p->temperature,
                             .top_p = p->top_p,
                             .top_k = p->top_k,
                             .seed = p->seed,
                             .min_p = p->min_p,
                             .presence_penalty = p->presence_penalty,
                             .frequency_penalty = p->frequency_penalty,
                             .repetition_penalty = p->repetition_penalty,
                             .bias = p->bias,
                             .nbias = p->nbias};
    if (shoal_sampler_create(&sl->sampler, &so, s->vocab, err, sizeof err)) {
        emit_error(s, sl, 400, "invalid_request_error", "temperature", err);
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return -1;
    }
    for (int i = 0; i < sl->n_prompt; i++) /* the repetition penalty covers the prompt */
        shoal_sampler_observe(sl->sampler, sl->ids[i], 0);
    if (p->constraint && constrain_begin(s, sl, err, sizeof err)) {
        emit_error(s, sl, 400, "invalid_request_error", "response_format", err);
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return -1;
    }
    if (!p->constraint && tools_begin(s, sl, err, sizeof err)) {
        emit_error(s, sl, 400, "invalid_request_error", "tools", err);
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return -1;
    }
    if (output_begin(s, sl)) {
        emit_error(s, sl, 500, "internal_error", NULL, "cannot start the output parser");
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return -1;
    }
    return 0;
}

/* A rendered job (SLOT_WAIT) takes its sequence state if it fits the budget:
 * create the sequence, continue from the longest kept prefix, then PREFILL
 * (or DECODE when the whole prompt was kept, START emitted). Returns 0 when
 * it must keep waiting, 1 otherwise (started, or failed and released). */
/* n choices (shoal_sched_job_fork_of): the slot of sl's parent job, or NULL
 * when it holds none (not admitted yet cannot happen: the parent is queued
 * first; ended, failed or canceled: the child prefills on its own). */
static shoal_slot *parent_slot(shoal_sched *s, const shoal_slot *sl)
{
    if (!sl->job->fork_of)
        return NULL;
    for (int i = 0; i < s->nslots; i++)
        if (s->slots[i].job == sl->job->fork_of)
            return &s->slots[i];
    return NULL;
}

/* The parent holds exactly the prompt's state (prefilled, nothing sampled
 * yet): the child's state can be a copy of it. */
static int can_fork(const shoal_slot *sl, const shoal_slot *ps)
{
    return ps && ps->state == SLOT_DECODE && ps->n_out == 0 && ps->n_prompt == sl->n_prompt &&
           shoal_seq_pos(ps->seq) == ps->n_prompt &&
           !memcmp(ps->ids, sl->ids, (size_t)sl->n_prompt * sizeof *sl->ids);
}

static int try_start(shoal_sched *s, shoal_slot *sl)
{
    shoal_slot *ps = parent_slot(s, sl);
    if (ps && (ps->state == SLOT_WAIT || ps->state == SLOT_PREFILL))
        return 0; /* the parent's prompt state is on its way: copy it then */
    int cap = sl->n_prompt + sl->max_new;
    if (cap > s->max_context)
        cap = s->max_context;
    size_t need = state_need(s, cap);
    if (s->o.pcache && s->o.state_bytes) { /* captures give way to requests */
        pthread_mutex_lock(&s->mu);
        size_t used = s->state_used;
        pthread_mutex_unlock(&s->mu);
        if (used + need + shoal_pcache_mem_bytes(s->o.pcache) > s->o.state_bytes)
            shoal_pcache_shrink(s->o.pcache, used + need < s->o.state_bytes ? s->o.state_bytes - used - need : 0);
    }
    pthread_mutex_lock(&s->mu);
    if (s->o.state_bytes && s->state_used + need > s->o.state_bytes) {
        s->waiting_state = 1;
        if (!sl->counted_wait) {
            sl->counted_wait = 1;
            s->st.state_waits++;
        }
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    s->waiting_state = 0;
    s->state_used += need;
    sl->state_bytes = need;
    pthread_mutex_unlock(&s->mu);
    char err[320];
    int rc = shoal_seq_create(&sl->seq, s->o.model, cap, err, sizeof err);
    if (rc) {
        SHOAL_ERROR("sched: cannot create a sequence of %d tokens: %s", cap, err);
        emit_error(s, sl, 500, "internal_error", NULL, "cannot allocate the sequence state; see the server log");
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return 1;
    }
    if (s->o.draft.mode != SHOAL_DRAFT_OFF &&
        (rc = shoal_spec_create(&sl->spec, sl->seq, &s->o.draft, err, sizeof err))) {
        SHOAL_ERROR("sched: cannot reserve the drafting room of a sequence: %s", err);
        emit_error(s, sl, 500, "internal_error", NULL, "cannot allocate the sequence state; see the server log");
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return 1;
    }
    if (sl->spec)
        shoal_spec_set_hook(sl->spec, verify_hook, sl);
    int k = -1;
    sl->reused = 0;
    if (can_fork(sl, ps) && shoal_seq_copy(sl->seq, ps->seq, err, sizeof err) == 0) {
        sl->reused = sl->n_prompt; /* prefilled once, for every choice */
        memcpy(sl->logits, ps->logits, (size_t)s->vocab * sizeof *sl->logits);
    } else {
        k = shoal__sched_kept_find(s, sl->ids, sl->n_prompt);
        /* the prefix cache when it holds more than the kept sequence (it
         * never holds the whole prompt: that one is the kept sequence's) */
        if (s->o.pcache &&
            shoal_pcache_lookup(s->o.pcache, sl->ids, sl->n_prompt, sl->n_prompt - 1) > (k >= 0 ? s->kept[k].n : 0))
            sl->reused = shoal_pcache_resume(s->o.pcache, sl->ids, sl->n_prompt, sl->n_prompt - 1, sl->seq);
        if (sl->reused) {
        } else if (k >= 0 && shoal_seq_copy(sl->seq, s->kept[k].seq, err, sizeof err) == 0) {
            sl->reused = s->kept[k].n;
            if (sl->reused == sl->n_prompt)
                memcpy(sl->logits, s->kept[k].logits, (size_t)s->vocab * sizeof *sl->logits);
        } else {
            shoal_seq_reset(sl->seq);
            sl->reused = 0;
        }
    }
    sl->fed = sl->reused;
    sl->order = ++s->admit_tick;
    if (sl->fed < sl->n_prompt) {
        plan_captures(s, sl);
        skip_captures(sl);
        find_lead(s, sl);
        if (sl->lead) {
            shoal_sched_stats add = {.cache_waits = 1};
            shoal__sched_count(s, &add);
        }
        sl->state = SLOT_PREFILL;
        return 1;
    }
    start_decoding(s, sl);
    return 1;
}

/* Releases every slot whose job was canceled (in any state: waiting for
 * state, prefilling, decoding). */
static void release_canceled(shoal_sched *s)
{
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *sl = &s->slots[i];
        if (sl->state != SLOT_FREE && sl->job && atomic_load(&sl->job->cancel)) {
            shoal_sched_stats add = {.canceled = 1};
            release(s, sl, &add);
        }
    }
}

/* Fills free slots from the fair queue. The first job whose state does not
 * fit waits in its slot (first in line) and no other job is taken meanwhile,
 * so a large request is not overtaken forever. */
static void admit_queued(shoal_sched *s)
{
    for (;;) {
        shoal_slot *w = NULL, *fr = NULL;
        for (int i = 0; i < s->nslots; i++) {
            if (s->slots[i].state == SLOT_WAIT && !w)
                w = &s->slots[i];
            if (s->slots[i].state == SLOT_FREE && !fr)
                fr = &s->slots[i];
        }
        if (w) {
            if (atomic_load(&w->job->cancel)) {
                shoal_sched_stats add = {.canceled = 1};
                release(s, w, &add);
                continue;
            }
            if (!try_start(s, w))
                return;
            continue;
        }
        if (!fr)
            return;
        pthread_mutex_lock(&s->mu);
        shoal_sched_job *j = s->stopping ? NULL : shoal__sched_pop_fair(s);
        if (j) {
            fr->job = j; /* the queue's reference moves to the slot */
            fr->state = SLOT_WAIT;
            s->running++;
            if (fr->vacated_step) {
                /* a client's cancel freed this slot: boundaries since the
                 * cancel, or since this job was ready if that came later */
                uint64_t from = fr->vacated_step > j->ready_step ? fr->vacated_step : j->ready_step;
                uint64_t now = atomic_load(&s->step_seq);
                uint64_t waited = now > from ? now - from : 0;
                s->st.handovers++;
                if (waited > s->st.handover_steps_max)
                    s->st.handover_steps_max = waited;
                uint64_t t_from = fr->vacated_ns > j->ready_ns ? fr->vacated_ns : j->ready_ns;
                uint64_t t_now = shoal_metrics_now_ns();
                s->st.handover_ns_last = t_now > t_from ? t_now - t_from : 0;
                fr->vacated_step = 0;
            }
        }
        pthread_mutex_unlock(&s->mu);
        if (!j)
            return;
        if (s->o.cm)
            shoal_cmetrics_request_queue(s->o.cm, shoal_metrics_now_ns() - j->t_submit);
        prepare(s, fr); /* on failure the slot is free again */
    }
}

/* A decoding slot's part of a step before the forward: sample the next id
 * from its logits, output it, check stop / length. Returns 1 with *id to
 * feed, 0 when the job left its slot. */
static int sample_one(shoal_sched *s, shoal_slot *sl, int32_t *id_out)
{
    shoal_sched_job *j = sl->job;
    if (atomic_load(&j->cancel)) {
        shoal_sched_stats add = {.canceled = 1};
        release(s, sl, &add);
        return 0;
    }
    uint64_t t0 = shoal_metrics_now_ns();
    int masked = 0;
    if (sl->crun || sl->tcons) {
        /* structured output: the disallowed ids leave the row, so sampling,
         * penalties and logprobs all see the masked distribution (a tool
         * constraint leaves the row alone while the model is free, -1).
         * The mask was computed during the last forward (mask_main) unless
         * this is the slot's first sample or the mask thread is off. */
        int32_t ban = -1;
        int n;
        if (sl->cmask_ready) {
            n = sl->cmask_n;
            ban = sl->cmask_ban;
            sl->cmask_ready = 0;
            if (n >= 0) {
                shoal_cmetrics_constrain_mask(s->o.cm, 1, 1, (uint64_t)sl->cmask_verify, sl->cmask_ns, 0);
            }
        } else {
            n = sl->crun ? shoal_cons_run_mask(sl->crun, sl->cmask) : shoal_toolcons_mask(sl->tcons, sl->cmask, &ban);
            uint64_t dt = shoal_metrics_now_ns() - t0;
            if (n >= 0)
                shoal_cmetrics_constrain_mask(s->o.cm, 1, 0, 0, dt, dt);
        }
        masked = n >= 0;
        if (ban >= 0 && ban < s->vocab)
            sl->logits[ban] = -INFINITY;
        if (n == 0) {
            shoal_sched_stats add = {.failed = 1};
            emit_error(s, sl, 500, "constraint_dead_end", NULL,
                       "the structured-output constraint admits no continuation (docs/API.md lists the corner "
                       "cases)");
            release(s, sl, &add);
            return 0;
        }
        if (masked)
            for (int i = 0; i < s->vocab; i++)
                if (!sl->cmask[i])
                    sl->logits[i] = -INFINITY;
    }
    int32_t id = shoal_sampler_sample(sl->sampler, sl->logits);
    if (masked && (id < 0 || id >= s->vocab || !sl->cmask[id]))
        id = shoal_argmax(sl->logits, s->vocab); /* a draw can only land on a masked id by rounding */
    if (sl->crun)
        shoal_cons_run_accept(sl->crun, id);
    else if (sl->tcons)
        shoal_toolcons_accept(sl->tcons, id);
    uint64_t t1 = shoal_metrics_now_ns();
    if (s->o.cm) {
        shoal_cmetrics_add_phase(s->o.cm, SHOAL_PHASE_SAMPLING, t1 - t0);
        if (sl->n_out == 0)
            shoal_cmetrics_request_ttft(s->o.cm, t1 - j->t_submit);
        else
            shoal_cmetrics_request_itl(s->o.cm, t1 - sl->t_last);
    }
    sl->t_last = t1;
    sl->out[sl->n_out++] = id;
    shoal_sampler_observe(sl->sampler, id, 1);
    if (j->p.logprobs)
        emit_logprob(s, sl, id);
    int stop = output_token(s, sl, id);
    if (stop == 2) {
        finish(s, sl, "stop", 0);
        return 0;
    }
    if (stop < 0) {
        shoal_sched_stats add = {.failed = 1};
        emit_error(s, sl, 500, "internal_error", NULL, "the output could not be decoded; see the server log");
        release(s, sl, &add);
        return 0;
    }
    if (stop) {
        finish(s, sl, "stop", 1);
        return 0;
    }
    if (sl->n_out >= sl->max_new || sl->n_ids >= shoal_seq_capacity(sl->seq)) {
        finish(s, sl, "length", 0);
        return 0;
    }
    *id_out = id;
    return 1;
}

/* A prompt fed to its end: keep it for reuse, then start decoding. */
static void prompt_done(shoal_sched *s, shoal_slot *sl)
{
    shoal__sched_kept_put(s, sl->ids, sl->n_prompt, sl->seq, sl->logits);
    start_decoding(s, sl);
}

/* The oldest prefilling slot not yet in this step (pslots[0..np)), with
 * canceled ones released on the way; NULL when none is left. */
static shoal_slot *next_prompt(shoal_sched *s, int np)
{
    for (;;) {
        shoal_slot *sl = NULL;
        for (int i = 0; i < s->nslots; i++) {
            shoal_slot *c = &s->slots[i];
            int taken = 0;
            for (int k = 0; k < np && !taken; k++)
                taken = s->pslots[k] == c;
            if (c->state == SLOT_PREFILL && !taken && (!sl || c->order < sl->order) && !lead_wait(s, c))
                sl = c;
        }
        if (!sl || !atomic_load(&sl->job->cancel))
            return sl;
        shoal_sched_stats add = {.canceled = 1};
        release(s, sl, &add);
    }
}

/* A slot drafting alone: its prompt chunks go as plain prefills (oldest
 * admission first, budget tokens in all), apart from the verify chunk.
 * Returns the tokens prefilled. */
static int prefill_alone(shoal_sched *s, int budget)
{
    int done = 0;
    while (budget > 0) {
        shoal_slot *sl = next_prompt(s, 0);
        if (!sl)
            break;
        int n = until_capture(sl);
        if (n > budget)
            n = budget;
        int last = sl->fed + n == sl->n_prompt;
        char err[320];
        shoal_model_set_cancel(s->o.model, &sl->job->cancel);
        int rc = shoal_seq_prefill(sl->seq, sl->ids + sl->fed, n, last ? SHOAL_LOGITS_LAST : SHOAL_LOGITS_NONE,
                                   sl->logits, err, sizeof err);
        if (rc) {
            fail_forward(s, sl, rc, err);
            continue;
        }
        sl->fed += n;
        budget -= n;
        done += n;
        if (!last) {
            capture_due(s, sl);
            if (budget > 0)
                continue; /* stopped at a capture position */
            break; /* the budget is spent */
        }
        prompt_done(s, sl);
    }
    return done;
}

/* ---- structured output: masks computed during the forward ------------------ */

/* The mask of every slot handed over (s->mslots), from its constraint's
 * state after the ids it has accepted: the same call sample_one would make,
 * so the mask is the same, bit for bit. */
static void masks_compute(shoal_sched *s)
{
    for (int i = 0; i < s->mn; i++) {
        shoal_slot *sl = s->mslots[i];
        uint64_t t0 = shoal_metrics_now_ns();
        sl->cmask_ban = -1;
        sl->cmask_n = sl->crun ? shoal_cons_run_mask(sl->crun, sl->cmask)
                               : shoal_toolcons_mask(sl->tcons, sl->cmask, &sl->cmask_ban);
        sl->cmask_ns = shoal_metrics_now_ns() - t0;
        sl->cmask_ready = 1;
        sl->cmask_verify = 0;
    }
}

/* The masks of the verify rows of s->vslot's drafted chunk (verify_hook):
 * row r's mask is its constraint's after the fed id and drafts 1..r, so a
 * look-ahead copy of the constraint (the run, or the tool constraint with
 * its inner run) takes the drafts one by one. It stops at the first draft
 * the previous row bans -- outside its mask, or a tool constraint's free
 * row's banned id (sample_one sets it to -inf) -- since the sampler cannot
 * take it, the rows after it are never sampled (a draft leaving the grammar
 * is rejected like any other), and where a tool constraint's copy would have
 * to compile (shoal_toolcons_accept: SHOAL_EBUSY; that row's mask is then
 * computed as usual). Row 0's mask (the fed id's) is the slot's ordinary
 * one, computed first (masks_compute): the same calls sample_one makes, so
 * each row's mask is the one sampling would compute, bit for bit. */
static void vmasks_compute(shoal_sched *s)
{
    shoal_slot *sl = s->vslot;
    sl->vk = 0;
    if ((!sl->crun && !sl->tcons) || !sl->cmask_ready || sl->cmask_n == 0)
        return;
    if (sl->crun)
        shoal_cons_run_copy(sl->vrun, sl->crun);
    else
        shoal_toolcons_copy(sl->vtcons, sl->tcons);
    const uint8_t *prev = sl->cmask;
    int prev_n = sl->cmask_n;
    int32_t prev_ban = sl->cmask_ban;
    int k = 0;
    for (int r = 1; r <= sl->vwant; r++) {
        int32_t d = sl->vids[r];
        if (d < 0 || d >= s->vocab || (prev_n >= 0 ? !prev[d] : d == prev_ban))
            break;
        if (sl->crun ? shoal_cons_run_accept(sl->vrun, d) : shoal_toolcons_accept(sl->vtcons, d))
            break;
        uint64_t t0 = shoal_metrics_now_ns();
        sl->vban[r] = -1;
        sl->vn[r] = sl->crun ? shoal_cons_run_mask(sl->vrun, sl->vmask[r])
                             : shoal_toolcons_mask(sl->vtcons, sl->vmask[r], &sl->vban[r]);
        sl->vns[r] = shoal_metrics_now_ns() - t0;
        k = r;
        if (sl->vn[r] == 0)
            break;
        prev = sl->vmask[r];
        prev_n = sl->vn[r];
        prev_ban = sl->vban[r];
    }
    sl->vk = k;
}

static void *mask_main(void *arg)
{
    shoal_sched *s = arg;
    pthread_mutex_lock(&s->mask_mu);
    for (;;) {
        while (!s->mask_work && !s->vmask_work && !s->mask_stop)
            pthread_cond_wait(&s->mask_cv, &s->mask_mu);
        if (s->mask_stop)
            break;
        if (s->mask_work) { /* first: row 0's masks, which the verify rows start from */
            pthread_mutex_unlock(&s->mask_mu);
            masks_compute(s);
            pthread_mutex_lock(&s->mask_mu);
            s->mask_work = 0;
        } else {
            pthread_mutex_unlock(&s->mask_mu);
            vmasks_compute(s);
            pthread_mutex_lock(&s->mask_mu);
            s->vmask_work = 0;
        }
        pthread_cond_signal(&s->mask_done_cv);
    }
    pthread_mutex_unlock(&s->mask_mu);
    return NULL;
}

/* Before the forward: the slots in mslots[0..mn) get their next mask on
 * the mask thread (without it, sample_one computes each at sampling time). */
/* A forward shorter than this (wall) cannot hide a mask behind it on a
 * shared machine: waking the mask thread and joining it may cost more
 * than the mask (k3-nano: ~30 µs waited for an 8 µs mask at load 12); the
 * masks are then computed at sampling time. Real K3 steps (and the
 * k3-slice's) are hundreds of ms. */
#define SHOAL_SCHED_MASK_FWD_NS 10000000ull

static void masks_start(shoal_sched *s)
{
    if (!s->mask_started || (!s->mask_always && s->fwd_ns_last < SHOAL_SCHED_MASK_FWD_NS))
        s->mn = 0;
    if (!s->mn)
        return;
    pthread_mutex_lock(&s->mask_mu);
    s->mask_work = 1;
    pthread_cond_signal(&s->mask_cv);
    pthread_mutex_unlock(&s->mask_mu);
}

/* shoal_spec_decode is about to verify k drafts after the fed id of slot
 * ctx (drafting alone in the step): when the fed id's mask is on the mask
 * thread now, the verify rows' masks follow it there (vmasks_compute), so
 * they too are ready when the forward ends. Allocates here, outside the
 * forward (the look-ahead copy, the row masks, a tool constraint's
 * compiled headers and arguments; kept for the slot). */
static void verify_hook(void *ctx, const int32_t *drafts, int k)
{
    shoal_slot *sl = ctx;
    shoal_sched *s = sl->s;
    sl->vk = 0;
    if ((!sl->crun && !sl->tcons) || s->mn != 1 || s->mslots[0] != sl || k < 1)
        return;
    if (k > SHOAL_DRAFT_MAX_K)
        k = SHOAL_DRAFT_MAX_K;
    if (sl->crun && !sl->vrun)
        sl->vrun = shoal_cons_run_clone(sl->crun);
    if (sl->tcons) {
        /* the mask thread may be in shoal_toolcons_mask on tcons now: prepare
         * touches only the compiled caches (toolcons.h) */
        if (!sl->vtcons)
            sl->vtcons = shoal_toolcons_clone(sl->tcons);
        shoal_toolcons_prepare(sl->tcons);
    }
    for (int r = 1; r <= k; r++) {
        if (!sl->vmask[r])
            sl->vmask[r] = shoal_xmalloc((size_t)s->vocab);
        sl->vids[r] = drafts[r - 1];
    }
    sl->vwant = k;
    sl->vr = 1;
    s->vslot = sl;
    pthread_mutex_lock(&s->mask_mu);
    s->vmask_work = 1;
    pthread_cond_signal(&s->mask_cv);
    pthread_mutex_unlock(&s->mask_mu);
}

/* The slot sampled id: when it is the next draft of its last verify chunk,
 * the next mask was computed during that chunk's forward (vmasks_compute):
 * it becomes the slot's ready mask (1). Otherwise the rows are dropped (0). */
static int vmask_take(shoal_slot *sl, int32_t id)
{
    if (sl->vr < 1 || sl->vr > sl->vk || sl->vids[sl->vr] != id) {
        sl->vk = 0;
        return 0;
    }
    int r = sl->vr++;
    uint8_t *t = sl->cmask;
    sl->cmask = sl->vmask[r];
    sl->vmask[r] = t;
    sl->cmask_n = sl->vn[r];
    sl->cmask_ban = sl->vban[r];
    sl->cmask_ns = sl->vns[r];
    sl->cmask_ready = 1;
    sl->cmask_verify = 1;
    return 1;
}

/* After the forward, before anything may release a slot: wait for the
 * mask thread (it has no more than a few masks to compute, each bounded by
 * the vocabulary walk: no deadline needed beyond that work); the time
 * waited is the mask cost the forward did not hide. */
static void masks_join(shoal_sched *s)
{
    if (!s->mn)
        return;
    uint64_t t0 = shoal_metrics_now_ns();
    pthread_mutex_lock(&s->mask_mu);
    while (s->mask_work || s->vmask_work)
        pthread_cond_wait(&s->mask_done_cv, &s->mask_mu);
    pthread_mutex_unlock(&s->mask_mu);
    shoal_cmetrics_constrain_mask(s->o.cm, 0, 0, 0, 0, shoal_metrics_now_ns() - t0);
    s->mn = 0;
}

/* One step of continuous batching: every decoding slot samples, and the
 * tokens of those that go on, then prompt chunks of prefilling slots
 * (oldest admission first) within the step's budget, are fed as ONE chunk
 * (shoal_model_step: the weights and each worker are visited once for all
 * of them). Logits are computed for each decode token and for the last
 * token of a prompt that ends in the chunk. Each sequence gets bit for bit
 * what feeding it alone gives (engine.h). Returns the decode tokens; *np_out
 * the prompt tokens.
 * Drafting (issue #21): a slot that decodes alone (nb == 1) goes through
 * shoal_spec_decode, which may verify K drafted ids in one chunk, and the
 * prompts then take their own prefill; with two or more, each slot's
 * pending drafts are settled first and all take the shared chunk (a verify
 * chunk per slot would multiply the step's tokens while the batch already
 * shares the weight reads). */
static int step(shoal_sched *s, int *np_out)
{
    int nb = 0;
    *np_out = 0;
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *sl = &s->slots[i];
        int32_t id;
        if (sl->state != SLOT_DECODE || !sample_one(s, sl, &id))
            continue;
        s->bseqs[nb] = sl->seq;
        s->bids[nb] = id;
        s->bslots[nb] = sl;
        s->brows[nb] = nb;
        nb++;
        if ((sl->crun || sl->tcons) && !vmask_take(sl, id))
            s->mslots[s->mn++] = sl;
    }
    /* the prompts' share: what the decode tokens leave, at least half */
    int budget = s->step_tokens - nb;
    if (budget < (s->step_tokens + 1) / 2)
        budget = (s->step_tokens + 1) / 2;
    char err[320];
    if (nb == 1 && s->o.draft.mode != SHOAL_DRAFT_OFF) {
        /* alone in the step: draft and verify (the same logits, bit for bit,
         * as the one-token path; fewer passes when the drafts hit) */
        shoal_slot *sl = s->bslots[0];
        shoal_model_set_cancel(s->o.model, &sl->job->cancel);
        sl->ids[sl->n_ids] = s->bids[0];
        masks_start(s);
        shoal_spec_stats st0, st1;
        shoal_spec_get_stats(sl->spec, &st0);
        uint64_t tf = shoal_metrics_now_ns();
        int rc = shoal_spec_decode(sl->spec, sl->ids, sl->n_ids + 1, sl->max_new - sl->n_out - 1, sl->logits, err,
                                   sizeof err);
        shoal_spec_get_stats(sl->spec, &st1);
        if (st1.passes != st0.passes) /* a step served from a verify chunk ran no forward */
            s->fwd_ns_last = shoal_metrics_now_ns() - tf;
        masks_join(s);
        if (rc)
            fail_forward(s, sl, rc, err);
        else
            sl->n_ids++;
        *np_out = prefill_alone(s, budget);
        return nb;
    }
    /* drafts run ahead are dropped first, so each sequence holds exactly
     * its fed ids before the chunk */
    int rc = 0;
    for (int b = 0; b < nb && !rc; b++)
        rc = shoal_spec_settle(s->bslots[b]->spec, err, sizeof err);
    /* prompt chunks, in the room the budget and max_batch leave */
    int n = nb, nrows = nb, np = 0;
    while (!rc && budget > 0 && n < s->max_batch) {
        shoal_slot *sl = next_prompt(s, np);
        if (!sl)
            break;
        int k = until_capture(sl);
        if (k > budget)
            k = budget;
        if (k > s->max_batch - n)
            k = s->max_batch - n;
        for (int j = 0; j < k; j++) {
            s->bseqs[n + j] = sl->seq;
            s->bids[n + j] = sl->ids[sl->fed + j];
        }
        int last = sl->fed + k == sl->n_prompt;
        if (last) {
            s->brows[nrows] = n + k - 1;
            s->bslots[nrows++] = sl;
        }
        s->pslots[np] = sl;
        s->pn[np++] = k;
        n += k;
        budget -= k;
        if (!last)
            break; /* the budget or the chunk is full */
    }
    if (!n && !rc)
        return 0;
    shoal_model_set_cancel(s->o.model, &s->abort);
    if (!rc) {
        masks_start(s);
        uint64_t tf = shoal_metrics_now_ns();
        rc = shoal_model_step(s->o.model, s->bseqs, s->bids, n, s->brows, nrows, nrows ? s->blogits : NULL, err,
                              sizeof err);
        s->fwd_ns_last = shoal_metrics_now_ns() - tf;
        masks_join(s);
    }
    s->mn = 0; /* a failed settle: the masks are computed at the next sample */
    if (!rc && s->o.cm && nb)
        shoal_cmetrics_spec(s->o.cm, (uint64_t)nb, (uint64_t)nb, 0, 0); /* a pass per sequence in the batch */
    if (rc) { /* the chunk failed: every sequence in it is broken */
        for (int b = 0; b < nb; b++)
            fail_forward(s, s->bslots[b], rc, err);
        for (int p = 0; p < np; p++)
            fail_forward(s, s->pslots[p], rc, err);
        return nb;
    }
    for (int b = 0; b < nb; b++) {
        shoal_slot *sl = s->bslots[b];
        memcpy(sl->logits, s->blogits + (size_t)b * (size_t)s->vocab, (size_t)s->vocab * sizeof *sl->logits);
        sl->ids[sl->n_ids++] = s->bids[b];
    }
    for (int p = 0, r = nb; p < np; p++) {
        shoal_slot *sl = s->pslots[p];
        sl->fed += s->pn[p];
        *np_out += s->pn[p];
        if (sl->fed < sl->n_prompt) {
            capture_due(s, sl);
            continue;
        }
        memcpy(sl->logits, s->blogits + (size_t)r++ * (size_t)s->vocab, (size_t)s->vocab * sizeof *sl->logits);
        prompt_done(s, sl);
    }
    return nb;
}

static void *model_main(void *arg)
{
    shoal_sched *s = arg;
    if (s->o.threads > 0)
        omp_set_num_threads(s->o.threads);
    /* the mask thread lives as long as this one; without it, masks are
     * computed at sampling time (the same masks, not overlapped).
     * --mask-thread off keeps it off, on uses it at every step however
     * short the forward: the before/after benchmark
     * (tests/bench/constrain_bench.py) and the identity test compare both */
    s->mask_always = s->o.mask_thread == SHOAL_MASK_THREAD_ON;
    if (s->o.mask_thread == SHOAL_MASK_THREAD_OFF)
        SHOAL_INFO("sched: --mask-thread off: structured-output masks are computed after the forward");
    else if (pthread_create(&s->mask_thread, NULL, mask_main, s))
        SHOAL_WARN("sched: cannot start the mask thread; structured-output masks are computed after the forward");
    else
        s->mask_started = 1;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        for (;;) {
            int busy = 0;
            for (int i = 0; i < s->nslots; i++)
                busy += s->slots[i].job != NULL;
            if (s->stopping || busy || s->nready)
                break;
            pthread_cond_wait(&s->cv, &s->mu);
        }
        if (s->stopping) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        pthread_mutex_unlock(&s->mu);
        /* a step boundary: the slots of jobs canceled meanwhile (a client
         * gone: FIN or RST, streamed or not) are released here, before the
         * admissions, so a waiting request takes such a slot at the first
         * boundary after the cancel, not after one more step of the others */
        atomic_fetch_add(&s->step_seq, 1);
        release_canceled(s);
        admit_queued(s);
        /* one step: a token for every decoding slot and prompt chunks with
         * what the step's budget leaves (at least half of it), one chunk */
        int np;
        int nb = step(s, &np);
        if (s->o.cm && (nb || np))
            shoal_cmetrics_step(s->o.cm, (uint32_t)nb, (uint32_t)np);
    }
    if (s->mask_started) {
        pthread_mutex_lock(&s->mask_mu);
        s->mask_stop = 1;
        pthread_cond_signal(&s->mask_cv);
        pthread_mutex_unlock(&s->mask_mu);
        pthread_join(s->mask_thread, NULL);
        s->mask_started = 0;
    }
    /* stopping: running jobs end without further events */
    for (int i = 0; i < s->nslots; i++) {
        if (s->slots[i].job) {
            shoal_sched_stats add = {.canceled = 1};
            release(s, &s->slots[i], &add);
        }
    }
    shoal_model_set_cancel(s->o.model, NULL);
    return NULL;
}

/* ---- open / close ----------------------------------------------------------- */

int shoal_sched_open(shoal_sched **out, const shoal_sched_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->model || !o->tok)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: model and tokenizer are required");
    if (o->queue_size <= 0 || o->queue_size > 1000000)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: --queue must be in 1..1000000 (got %d)",
                             o->queue_size);
    shoal_model_info info;
    shoal_model_get_info(o->model, &info);
    if (o->slots < 1 || o->slots > info.max_batch)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: --slots must be in 1..%d (the model's max batch; got %d)",
                             info.max_batch, o->slots);
    if (o->step_tokens < 0 || o->step_tokens > (1 << 20))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: --step-tokens must be in 1..%d (got %d)", 1 << 20,
                             o->step_tokens);
    size_t spec_extra = shoal_spec_bytes(o->model, &o->draft);
    size_t full = info.seq_fixed_bytes + (size_t)info.max_context * info.seq_bytes_per_token + spec_extra;
    if (o->state_bytes && o->state_bytes < full)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "sched: the sequence state budget (%zu bytes) is below one sequence of the whole context "
                             "(%d tokens: %zu bytes); raise --state-gb or lower --max-context",
                             o->state_bytes, info.max_context, full);
    if (o->keep_seqs < 0 || o->keep_seqs > SHOAL_SCHED_MAX_KEPT)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: keep_seqs must be in 0..%d", SHOAL_SCHED_MAX_KEPT);
    if (o->memo_entries < 0 || o->memo_entries > SHOAL_SCHED_MAX_MEMO)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: memo entries must be in 0..%d",
                             SHOAL_SCHED_MAX_MEMO);
    if (shoal_tok_n_vocab(o->tok) > info.vocab)
        return shoal_err_set(err, errlen, SHOAL_EMODEL,
                             "sched: the tokenizer has %d ids but the model only %d logits",
                             (int)shoal_tok_n_vocab(o->tok), info.vocab);
    shoal_sched *s = shoal_xcalloc(1, sizeof *s);
    s->o = *o;
    s->vocab = info.vocab;
    s->max_context = info.max_context;
    s->seq_fixed = info.seq_fixed_bytes;
    s->seq_per_token = info.seq_bytes_per_token;
    s->spec_extra = spec_extra;
    s->step_tokens = o->step_tokens ? o->step_tokens : info.max_batch;
    s->max_batch = info.max_batch;
    s->eom_id = shoal_tok_special_id(o->tok, "<|end_of_msg|>");
    if (s->eom_id < 0)
        s->eom_id = -1;
    if (o->pcache_stride < 0) {
        free(s);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: --prefix-cache-stride must be >= 0 (got %d)",
                             o->pcache_stride);
    }
    atomic_init(&s->abort, 0);
    atomic_init(&s->step_seq, 1); /* 1: a job's cancel_step is never 0 */
    s->n_eos = info.n_eos;
    memcpy(s->eos, info.eos, sizeof s->eos);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->memo_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->rcv, NULL);
    pthread_mutex_init(&s->mask_mu, NULL);
    pthread_cond_init(&s->mask_cv, NULL);
    pthread_cond_init(&s->mask_done_cv, NULL);
    int rc = slots_init(s, err, errlen);
    if (rc) {
        slots_free(s);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->memo_mu);
        free(s);
        return rc;
    }
    for (int i = 0; i < SHOAL_SCHED_RENDER_THREADS && !rc; i++) {
        rc = pthread_create(&s->render_threads[i], NULL, render_main, s);
        if (!rc)
            s->render_started++;
    }
    const char *what = "the render threads";
    if (!rc) {
        rc = pthread_create(&s->thread, NULL, model_main, s);
        what = "the model thread";
    }
    if (rc) {
        shoal__sched_queue_stop(s);
        for (int i = 0; i < s->render_started; i++)
            pthread_join(s->render_threads[i], NULL);
        slots_free(s);
        free(s);
        return shoal_err_set(err, errlen, -rc, "sched: cannot start %s", what);
    }
    *out = s;
    return 0;
}

void shoal_sched_close(shoal_sched *s)
{
    if (!s)
        return;
    shoal__sched_queue_stop(s);
    atomic_store(&s->abort, 1);
    cancel_running(s);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < s->render_started; i++)
        pthread_join(s->render_threads[i], NULL);
    slots_free(s);
    shoal_cons_vocab_free(s->cvocab);
    shoal__sched_store_free(s);
    pthread_cond_destroy(&s->cv);
    pthread_cond_destroy(&s->rcv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->memo_mu);
    pthread_cond_destroy(&s->mask_cv);
    pthread_cond_destroy(&s->mask_done_cv);
    pthread_mutex_destroy(&s->mask_mu);
    free(s);
}

int shoal__sched_replay(shoal_sched *s, shoal_sched_job *j, const int32_t *ids, int n)
{
    shoal_slot sl = {.s = s, .job = j, .last_ch = SHOAL_CH_CONTENT};
    char err[256];
    int rc = shoal_seq_create(&sl.seq, s->o.model, 16, err, sizeof err);
    if (rc)
        return rc;
    shoal_sched_job_ref(j); /* released by finish(), like the queue's reference */
    sl.logits = shoal_xcalloc((size_t)s->vocab, sizeof *sl.logits);
    sl.ids = shoal_xcalloc((size_t)s->max_context, sizeof *sl.ids);
    sl.out = shoal_xcalloc((size_t)s->max_context, sizeof *sl.out);
    sl.rec_tail = &sl.rec;
    sl.recording = j->has_memo && s->o.memo_entries > 0;
    sl.max_new = n;
    pthread_mutex_lock(&s->mu);
    s->running++;
    pthread_mutex_unlock(&s->mu);
    if (output_begin(s, &sl)) {
        shoal_sched_stats add = {.failed = 1};
        release(s, &sl, &add);
        rc = SHOAL_EINTERNAL;
    } else {
        emit(s, &sl, shoal__sched_ev_new(SHOAL_EV_START));
        int done = 0;
        for (int i = 0; i < n && !done; i++) {
            sl.out[sl.n_out++] = ids[i];
            int r = output_token(s, &sl, ids[i]);
            if (r < 0) {
                shoal_sched_stats add = {.failed = 1};
                release(s, &sl, &add);
                rc = SHOAL_EINTERNAL;
                done = 1;
            } else if (r > 0) {
                finish(s, &sl, "stop", r == 1);
                done = 1;
            }
        }
        if (!done)
            finish(s, &sl, "length", 0);
    }
    shoal_seq_free(sl.seq);
    free(sl.logits);
    free(sl.ids);
    free(sl.out);
    shoal_detok_close(sl.detok);
    shoal_chatparse_close(sl.parser);
    free(sl.held[0].p);
    free(sl.held[1].p);
    return rc;
}
