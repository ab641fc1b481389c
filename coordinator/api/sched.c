/* sched: the scheduler (sched.h) -- open/close and its model thread, which
 * admits jobs into slots (render the prompt, check it against the context,
 * continue from a kept sequence or prefill), then decodes one token per
 * active slot per turn, turning ids into events (text per channel, tool
 * calls) through the detokenizer or the chat output parser and the
 * stop-string filter. The jobs, the queue, the memo and the kept states it
 * works on are jobs.c's (sched_int.h). Everything here runs on the model
 * thread except open/close and cancel_running. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/sbuf.h"
#include "common/log.h"
#include "coordinator/text/text.h"
#include "coordinator/obs/obs.h"
#include "coordinator/engine/engine.h"
#include "coordinator/api/sched_int.h"

struct shoal_slot {
    shoal_sched *s;
    shoal_sched_job *job; /* NULL: free */
    shoal_seq *seq;       /* capacity max_context, reused across jobs */
    float *logits;        /* [vocab]: the last fed token's */
    int32_t *ids;         /* [max_context]: every fed id (prompt, then generated) */
    int n_ids, n_prompt, reused;
    int32_t *out;         /* [max_context]: every sampled id */
    int n_out, max_new;
    shoal_sampler *sampler;
    shoal_spec *spec;          /* the decode path of seq (speculative when drafting is on) */
    shoal_detok *detok;        /* completions */
    shoal_chatparse *parser;   /* chat */
    int answer_started;        /* chat: content or a tool call seen */
    int stop_hit;              /* a stop string matched: drop further text */
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
    s->nslots = s->o.slots;
    s->slots = shoal_xcalloc((size_t)s->nslots, sizeof *s->slots);
    for (int i = 0; i < s->nslots; i++) {
        shoal_slot *sl = &s->slots[i];
        sl->s = s;
        int rc = shoal_seq_create(&sl->seq, s->o.model, s->max_context, err, errlen);
        if (rc)
            return rc;
        if ((rc = shoal_spec_create(&sl->spec, sl->seq, &s->o.draft, err, errlen)))
            return rc;
        sl->logits = shoal_xmalloc((size_t)s->vocab * sizeof *sl->logits);
        sl->ids = shoal_xmalloc((size_t)s->max_context * sizeof *sl->ids);
        sl->out = shoal_xmalloc((size_t)s->max_context * sizeof *sl->out);
    }
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
        shoal_sampler_free(sl->sampler);
        shoal_detok_close(sl->detok);
        shoal_chatparse_close(sl->parser);
        free(sl->held[0].p);
        free(sl->held[1].p);
        shoal_ev_free_list(sl->rec);
    }
    free(s->slots);
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
        if (m && (size_t)(m - h->p) < best)
            best = (size_t)(m - h->p);
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
    shoal_chatparse_opts po = {.thinking_off = !p->thinking, .on_event = on_parse_event, .ud = sl};
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
        int in_reasoning = sl->job->p.thinking && !sl->answer_started;
        int end = shoal_chatparse_feed(sl->parser, id);
        if (in_reasoning)
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
    shoal_ev_free_list(sl->rec);
    sl->rec = NULL;
    sl->rec_tail = &sl->rec;
    sl->recording = 0;
    sl->held[0].n = sl->held[1].n = 0;
    pthread_mutex_lock(&s->mu);
    sl->job = NULL;
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
                             .reused_tokens = (uint64_t)sl->reused};
    release(s, sl, &add);
}

/* A forward failed: map the engine's code to what the client sees. */
static void fail_forward(shoal_sched *s, shoal_slot *sl, int rc, const char *err)
{
    shoal_sched_stats add = {0};
    if (rc == SHOAL_ECANCELED || atomic_load(&sl->job->cancel)) {
        add.canceled = 1;
        release(s, sl, &add);
        return;
    }
    add.failed = 1;
    if (rc == SHOAL_EPEER || rc == SHOAL_ETIMEOUT || rc == SHOAL_EPROTO || rc == SHOAL_EVERSION) {
        /* the engine's message names the worker (endpoint) that failed */
        SHOAL_WARN("sched: %s", err);
        emit_error(s, sl, 503, "worker_unavailable", NULL, err);
    } else {
        SHOAL_ERROR("sched: forward failed: %s (%s)", err, shoal_err_name(rc));
        emit_error(s, sl, 500, "internal_error", NULL, "the model failed while generating; see the server log");
    }
    release(s, sl, &add);
}


/* Renders the prompt into sl->ids. Returns 0, or emits the error and returns -1. */
static int render(shoal_sched *s, shoal_slot *sl)
{
    shoal_gen_params *p = &sl->job->p;
    shoal_tok_ids ids = {0};
    char err[320];
    int rc = 0;
    const char *param = "prompt";
    if (p->kind == SHOAL_GEN_CHAT) {
        param = "messages";
        shoal_chat_opts co = {
            .thinking_off = !p->thinking,
            .thinking_effort = p->effort[0] ? p->effort : NULL,
            .effort_rule = SHOAL_CHAT_EFFORT_ENCODER,
            .tools = p->tools,
            .tool_choice = p->tool_choice,
            .response_format = p->response_format,
        };
        rc = shoal_chat_encode(s->o.tok, p->messages, &co, &ids, err, sizeof err);
    } else if (p->prompt) {
        rc = shoal_tok_encode(s->o.tok, p->prompt, p->prompt_len, 1, &ids, err, sizeof err);
    } else {
        for (int i = 0; i < p->n_prompt_ids; i++)
            shoal_tok_ids_push(&ids, p->prompt_ids[i]);
    }
    if (rc) {
        shoal_tok_ids_free(&ids);
        if (rc == SHOAL_EINTERNAL) {
            SHOAL_ERROR("sched: tokenizer failed: %s", err);
            emit_error(s, sl, 500, "internal_error", NULL, "the tokenizer failed; see the server log");
        } else {
            /* the encoder's message names the field ("messages[2].tool_calls[0]...") */
            emit_error(s, sl, 400, rc == SHOAL_EUNSUPPORTED ? "unsupported_value" : "invalid_request_error",
                       param, err);
        }
        return -1;
    }
    int n = (int)ids.n;
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
        shoal_tok_ids_free(&ids);
        emit_error(s, sl, 400, n ? "context_length_exceeded" : "invalid_request_error", param, msg);
        return -1;
    }
    memcpy(sl->ids, ids.v, (size_t)n * sizeof *sl->ids);
    shoal_tok_ids_free(&ids);
    sl->n_ids = sl->n_prompt = n;
    sl->max_new = p->max_tokens ? p->max_tokens : limit - n;
    return 0;
}

/* Admission: render, sampler, output state, reuse or prefill, START. */
static void admit(shoal_sched *s, shoal_slot *sl)
{
    shoal_sched_job *j = sl->job;
    shoal_gen_params *p = &j->p;
    sl->n_out = sl->reasoning_tokens = sl->ntools = sl->reused = 0;
    sl->last_ch = SHOAL_CH_CONTENT;
    sl->rec = NULL;
    sl->rec_tail = &sl->rec;
    sl->rec_bytes = 0;
    sl->recording = j->has_memo && s->o.memo_entries > 0;
    if (render(s, sl)) {
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return;
    }
    char err[320];
    shoal_sampler_opts so = {.temperature = p->temperature, .top_p = p->top_p, .top_k = p->top_k, .seed = p->seed};
    if (shoal_sampler_create(&sl->sampler, &so, s->vocab, err, sizeof err)) {
        emit_error(s, sl, 400, "invalid_request_error", "temperature", err);
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return;
    }
    if (output_begin(s, sl)) {
        emit_error(s, sl, 500, "internal_error", NULL, "cannot start the output parser");
        shoal_sched_stats add = {.failed = 1};
        release(s, sl, &add);
        return;
    }
    /* continue from the longest kept prefix, if any */
    int rc = 0;
    int k = shoal__sched_kept_find(s, sl->ids, sl->n_prompt);
    shoal_model_set_cancel(s->o.model, &j->cancel);
    if (k >= 0) {
        rc = shoal_seq_copy(sl->seq, s->kept[k].seq, err, sizeof err);
        if (rc == 0) {
            sl->reused = s->kept[k].n;
            if (sl->reused == sl->n_prompt)
                memcpy(sl->logits, s->kept[k].logits, (size_t)s->vocab * sizeof *sl->logits);
        }
    } else {
        shoal_seq_reset(sl->seq);
    }
    if (rc == 0 && sl->reused < sl->n_prompt)
        rc = shoal_seq_prefill(sl->seq, sl->ids + sl->reused, sl->n_prompt - sl->reused, SHOAL_LOGITS_LAST,
                               sl->logits, err, sizeof err);
    if (rc) {
        fail_forward(s, sl, rc, err);
        return;
    }
    shoal__sched_kept_put(s, sl->ids, sl->n_prompt, sl->seq, sl->logits);
    shoal_spec_begin(sl->spec);
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_START);
    e->prompt_tokens = sl->n_prompt;
    e->reused_tokens = sl->reused;
    emit(s, sl, e);
}

/* One decode step: sample, output, stop checks, feed. */
static void step(shoal_sched *s, shoal_slot *sl)
{
    shoal_sched_job *j = sl->job;
    if (atomic_load(&j->cancel)) {
        shoal_sched_stats add = {.canceled = 1};
        release(s, sl, &add);
        return;
    }
    uint64_t t0 = s->o.cm ? shoal_metrics_now_ns() : 0;
    int32_t id = shoal_sampler_sample(sl->sampler, sl->logits);
    if (s->o.cm)
        shoal_cmetrics_add_phase(s->o.cm, SHOAL_PHASE_SAMPLING, shoal_metrics_now_ns() - t0);
    sl->out[sl->n_out++] = id;
    int stop = output_token(s, sl, id);
    if (stop == 2) {
        finish(s, sl, "stop", 0);
        return;
    }
    if (stop < 0) {
        shoal_sched_stats add = {.failed = 1};
        emit_error(s, sl, 500, "internal_error", NULL, "the output could not be decoded; see the server log");
        release(s, sl, &add);
        return;
    }
    if (stop) {
        finish(s, sl, "stop", 1);
        return;
    }
    if (sl->n_out >= sl->max_new || sl->n_ids >= s->max_context) {
        finish(s, sl, "length", 0);
        return;
    }
    char err[320];
    shoal_model_set_cancel(s->o.model, &j->cancel);
    sl->ids[sl->n_ids] = id; /* plain decoding's logits, drafted ahead when it pays */
    int rc = shoal_spec_decode(sl->spec, sl->ids, sl->n_ids + 1, sl->max_new - sl->n_out - 1, sl->logits, err,
                               sizeof err);
    if (rc) {
        fail_forward(s, sl, rc, err);
        return;
    }
    sl->ids[sl->n_ids++] = id;
}

static void *model_main(void *arg)
{
    shoal_sched *s = arg;
    if (s->o.threads > 0)
        omp_set_num_threads(s->o.threads);
    for (;;) {
        int admitted[64], nadm = 0, active = 0;
        pthread_mutex_lock(&s->mu);
        for (;;) {
            active = 0;
            for (int i = 0; i < s->nslots; i++)
                active += s->slots[i].job != NULL;
            if (s->stopping || active || s->nqueued)
                break;
            pthread_cond_wait(&s->cv, &s->mu);
        }
        if (s->stopping) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        for (int i = 0; i < s->nslots && nadm < 64; i++) {
            if (s->slots[i].job)
                continue;
            shoal_sched_job *j = shoal__sched_pop_fair(s);
            if (!j)
                break;
            s->slots[i].job = j; /* the queue's reference moves to the slot */
            s->running++;
            admitted[nadm++] = i;
        }
        pthread_mutex_unlock(&s->mu);
        for (int a = 0; a < nadm; a++)
            admit(s, &s->slots[admitted[a]]);
        /* one token for every active slot (decode_batch once slots > 1) */
        for (int i = 0; i < s->nslots; i++)
            if (s->slots[i].job)
                step(s, &s->slots[i]);
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
    if (o->slots != 1)
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "sched: only one sequence per step is supported");
    if (o->keep_seqs < 0 || o->keep_seqs > SHOAL_SCHED_MAX_KEPT)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: keep_seqs must be in 0..%d", SHOAL_SCHED_MAX_KEPT);
    if (o->memo_entries < 0 || o->memo_entries > SHOAL_SCHED_MAX_MEMO)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sched: memo entries must be in 0..%d",
                             SHOAL_SCHED_MAX_MEMO);
    shoal_model_info info;
    shoal_model_get_info(o->model, &info);
    if (shoal_tok_n_vocab(o->tok) > info.vocab)
        return shoal_err_set(err, errlen, SHOAL_EMODEL,
                             "sched: the tokenizer has %d ids but the model only %d logits",
                             (int)shoal_tok_n_vocab(o->tok), info.vocab);
    shoal_sched *s = shoal_xcalloc(1, sizeof *s);
    s->o = *o;
    s->vocab = info.vocab;
    s->max_context = info.max_context;
    s->n_eos = info.n_eos;
    memcpy(s->eos, info.eos, sizeof s->eos);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->memo_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    int rc = slots_init(s, err, errlen);
    if (rc) {
        slots_free(s);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        pthread_mutex_destroy(&s->memo_mu);
        free(s);
        return rc;
    }
    rc = pthread_create(&s->thread, NULL, model_main, s);
    if (rc) {
        slots_free(s);
        free(s);
        return shoal_err_set(err, errlen, -rc, "sched: cannot start the model thread");
    }
    *out = s;
    return 0;
}

void shoal_sched_close(shoal_sched *s)
{
    if (!s)
        return;
    shoal__sched_queue_stop(s);
    cancel_running(s);
    pthread_join(s->thread, NULL);
    slots_free(s);
    shoal__sched_store_free(s);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->memo_mu);
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
