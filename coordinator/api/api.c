/* API routing, authentication and response formats (see api.h). Runs on the
 * HTTP loop thread. One `areq` per generation request links the exchange to
 * its scheduler job; it is reference counted because three parties hold it:
 * the open exchange, the scheduler's notify (one reference per posted drain),
 * and nobody else -- whichever drops the last reference frees it, on any
 * thread, and it owns no loop resource by then. */
#include <math.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "common/sbuf.h"
#include "common/utf8.h"
#include "common/log.h"
#include "coordinator/api/api_int.h"


/* A JSON string from bytes that should be UTF-8; invalid bytes become U+FFFD
 * rather than an invalid response. */
json_t *shoal__api_jstr(const char *s, size_t n)
{
    json_t *j = json_stringn(s ? s : "", s ? n : 0);
    if (j)
        return j;
    char *clean;
    size_t cn;
    shoal_utf8_sanitize(s, n, &clean, &cn);
    j = json_stringn(clean, cn);
    free(clean);
    return j ? j : json_string("");
}

/* ---- counters ------------------------------------------------------------ */

const char *const shoal__api_ep_names[EP_N] = {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                                "/v1/messages/count_tokens", "/v1/responses", "/v1/models",
                                                "/health", "/metrics", "other"};
#define ep_names shoal__api_ep_names
#define jstr shoal__api_jstr
#define respond_json shoal__api_respond_json
#define respond_error shoal__api_respond_error
#define error_json(e) shoal__api_error_json(r->ep, e)
#define random_hex shoal__api_random_hex
#define extra_headers shoal__api_extra_headers
#define call_at shoal__api_call_at

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* The access log: one line per request, never its body. Method and path are
 * the client's bytes: clean-copied (no control characters, cut on a
 * character boundary). 5xx at warn so they show at any level. */
static void access_log(const char *peer, const char *method, const char *path, int status, int ptok, int ctok,
                       double t0, const char *rid)
{
    char m[20], pth[136];
    shoal_utf8_clip(m, sizeof m, method, SHOAL_UTF8_NOCTRL | SHOAL_UTF8_MARK);
    shoal_utf8_clip(pth, sizeof pth, path, SHOAL_UTF8_NOCTRL | SHOAL_UTF8_MARK);
    shoal_log(status >= 500 ? SHOAL_LOG_WARN : SHOAL_LOG_INFO,
              "access: %s %s %s %d %.1f ms prompt_tokens=%d completion_tokens=%d id=%s", peer, m, pth, status,
              now_ms() - t0, ptok, ctok, rid && rid[0] ? rid : "-");
}

void shoal__api_count(shoal_api *a, int ep, int status)
{
    a->last_status = status;
    for (int i = 0; i < MAX_STATUS_SLOTS; i++) {
        if (a->st[i].status == status || a->st[i].status == 0) {
            a->st[i].status = status;
            a->st[i].count[ep]++;
            return;
        }
    }
}

/* ---- plain responses ------------------------------------------------------ */

/* Answered when a response cannot be built (json_pack or json_dumps failed):
 * the request gets a 500, the server carries on. */
static const char internal_error_body[] =
    "{\"error\":{\"message\":\"the server could not build its response\",\"type\":\"server_error\","
    "\"param\":null,\"code\":\"internal_error\"}}";

void shoal__api_respond_json(shoal_api *a, shoal_http_ex *ex, int ep, int status, json_t *body, const char *extra)
{
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (!s) {
        SHOAL_WARN("api: could not build the %d response for %s; answered 500", status, ep_names[ep]);
        shoal__api_count(a, ep, 500);
        shoal_http_respond(ex, 500, "application/json", extra, internal_error_body, sizeof internal_error_body - 1);
        return;
    }
    shoal__api_count(a, ep, status);
    shoal_http_respond(ex, status, "application/json", extra, s, strlen(s));
    free(s);
}

/* Anthropic's error types by status (docs: "Errors"). */
static const char *anthropic_error_type(int status)
{
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: case 529: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
    }
}

/* Every field through jstr: the message may quote the client. The Anthropic
 * endpoints answer {"type":"error","error":{"type","message"}}. */
json_t *shoal__api_error_json(int ep, const shoal_api_error *e)
{
    if (ep == EP_MESSAGES || ep == EP_COUNT_TOKENS) {
        char msg[sizeof e->message + sizeof e->param + 8];
        /* Anthropic has no "param": the message names the field, as theirs do */
        if (e->param[0] && !strstr(e->message, e->param))
            snprintf(msg, sizeof msg, "%s: %s", e->param, e->message);
        else
            snprintf(msg, sizeof msg, "%s", e->message);
        return json_pack("{s:s,s:{s:s,s:o}}", "type", "error", "error", "type", anthropic_error_type(e->status),
                         "message", jstr(msg, strlen(msg)));
    }
    return json_pack("{s:{s:o,s:o,s:o,s:o}}", "error", "message", jstr(e->message, strlen(e->message)), "type",
                     jstr(e->type, strlen(e->type)), "param",
                     e->param[0] ? jstr(e->param, strlen(e->param)) : json_null(), "code",
                     e->code[0] ? jstr(e->code, strlen(e->code)) : json_null());
}

void shoal__api_respond_error(shoal_api *a, shoal_http_ex *ex, int ep, const shoal_api_error *e, const char *extra)
{
    respond_json(a, ex, ep, e->status, shoal__api_error_json(ep, e), extra);
}

static void respond_simple_error(shoal_api *a, shoal_http_ex *ex, int ep, int status, const char *type,
                                 const char *code, const char *param, const char *extra, const char *fmt, ...)
    __attribute__((format(printf, 9, 10)));
static void respond_simple_error(shoal_api *a, shoal_http_ex *ex, int ep, int status, const char *type,
                                 const char *code, const char *param, const char *extra, const char *fmt, ...)
{
    shoal_api_error e = {.status = status};
    snprintf(e.type, sizeof e.type, "%s", type);
    snprintf(e.code, sizeof e.code, "%s", code ? code : "");
    snprintf(e.param, sizeof e.param, "%s", param ? param : "");
    char msg[sizeof e.message * 2];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    shoal_utf8_clean(e.message, sizeof e.message, msg, strlen(msg), 0, NULL);
    respond_error(a, ex, ep, &e, extra);
}

/* ---- per-request state ---------------------------------------------------- */

static void areq_unref(areq *r)
{
    if (atomic_fetch_sub(&r->refs, 1) != 1)
        return;
    for (int k = 0; k < r->n; k++) {
        achoice *c = &r->ch[k];
        shoal_sched_job_unref(c->job);
        free(c->content.p);
        free(c->reasoning.p);
        for (int i = 0; i < c->ncalls; i++) {
            free(c->calls[i].name);
            free(c->calls[i].args.p);
        }
        free(c->calls);
        shoal_ev_free_list(c->done_ev);
        json_decref(c->lp);
    }
    free(r->ch);
    for (int i = 0; i < r->nstop; i++)
        free(r->stops[i]);
    free(r->item_text.p);
    json_decref(r->echo);
    json_decref(r->conv);
    json_decref(r->items);
    free(r);
}

void shoal__api_random_hex(char *out, size_t nbytes)
{
    unsigned char b[32];
    randombytes_buf(b, nbytes);
    sodium_bin2hex(out, 2 * nbytes + 1, b, nbytes);
}

/* The exchange is over (answered or aborted): drop its reference. */
static void end_exchange(areq *r)
{
    access_log(r->peer, "POST", ep_names[r->ep], r->status ? r->status : 499, r->prompt_tokens,
               r->completion_tokens, r->t0, r->id);
    r->ex = NULL;
    r->api->live--;
    areq_unref(r);
}

void shoal__api_extra_headers(areq *r, char *buf, size_t cap)
{
    int n = snprintf(buf, cap, "x-request-id: %s\r\n", r->id);
    if (r->memo)
        n += snprintf(buf + n, cap - (size_t)n, "x-shoal-memo: %s\r\n", r->memo == 2 ? "hit" : "miss");
    if (r->memo != 2)
        n += snprintf(buf + n, cap - (size_t)n, "x-shoal-reused-tokens: %d\r\n", r->reused_tokens);
    if (r->ignored[0] && (size_t)n < cap)
        snprintf(buf + n, cap - (size_t)n, "x-shoal-ignored: %s\r\n", r->ignored);
}

static json_t *usage_json(const areq *r)
{
    int ctok = 0, rtok = 0;
    for (int i = 0; i < r->n; i++)
        if (r->ch[i].done_ev) {
            ctok += r->ch[i].done_ev->completion_tokens;
            rtok += r->ch[i].done_ev->reasoning_tokens;
        }
    return json_pack("{s:i,s:i,s:i,s:{s:i},s:{s:i}}", "prompt_tokens", r->prompt_tokens, "completion_tokens", ctok,
                     "total_tokens", r->prompt_tokens + ctok, "prompt_tokens_details", "cached_tokens",
                     r->memo == 2 ? 0 : r->reused_tokens, "completion_tokens_details", "reasoning_tokens", rtok);
}

static json_t *ids_json(const int32_t *v, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(v[i]));
    return a;
}

/* The skeleton shared by every chunk and full response. */
static json_t *envelope(const areq *r, const char *object)
{
    return json_pack("{s:s,s:s,s:I,s:s}", "id", r->id, "object", object, "created", (json_int_t)r->created,
                     "model", r->api->model_name);
}

/* A DONE event kept for the full response (the scheduler's list is freed). */
static shoal_ev *done_copy(const shoal_ev *e)
{
    shoal_ev *c = shoal_xmalloc(sizeof *c);
    *c = *e;
    c->next = NULL;
    c->text = c->name = NULL;
    c->len = 0;
    c->prompt_ids = c->output_ids = NULL;
    if (e->prompt_ids && e->n_prompt_ids > 0) {
        c->prompt_ids = shoal_xmalloc((size_t)e->n_prompt_ids * sizeof *c->prompt_ids);
        memcpy(c->prompt_ids, e->prompt_ids, (size_t)e->n_prompt_ids * sizeof *c->prompt_ids);
    }
    if (e->output_ids && e->n_output_ids > 0) {
        c->output_ids = shoal_xmalloc((size_t)e->n_output_ids * sizeof *c->output_ids);
        memcpy(c->output_ids, e->output_ids, (size_t)e->n_output_ids * sizeof *c->output_ids);
    }
    return c;
}

/* ---- log-probabilities ---------------------------------------------------- */

/* JSON has no infinity: an id the model gives no mass is reported as -9999
 * (OpenAI's convention for "practically impossible"). */
static json_t *lp_num(double x)
{
    return json_real(isfinite(x) && x > -9999.0 ? x : -9999.0);
}

static json_t *bytes_json(const char *b, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

/* One LOGPROB event as the endpoint's entry: chat {token, logprob, bytes,
 * top_logprobs}; completions [token, logprob, {token: logprob}, offset]. */
static void lp_add(areq *r, achoice *c, const shoal_ev *e)
{
    if (!c->lp)
        c->lp = json_array();
    const char *t = e->text ? e->text : "";
    if (r->kind == SHOAL_GEN_CHAT) {
        json_t *top = json_array();
        size_t off = (size_t)e->tok_len;
        for (int i = 0; i < e->ntop; i++) {
            json_array_append_new(top, json_pack("{s:o,s:o,s:o}", "token", jstr(t + off, (size_t)e->top_len[i]),
                                                 "logprob", lp_num(e->top_lp[i]), "bytes",
                                                 bytes_json(t + off, e->top_len[i])));
            off += (size_t)e->top_len[i];
        }
        json_array_append_new(c->lp, json_pack("{s:o,s:o,s:o,s:o}", "token", jstr(t, (size_t)e->tok_len), "logprob",
                                               lp_num(e->logprob), "bytes", bytes_json(t, e->tok_len),
                                               "top_logprobs", top));
    } else {
        json_t *top = json_object();
        size_t off = (size_t)e->tok_len;
        for (int i = 0; i < e->ntop; i++) {
            json_t *k = jstr(t + off, (size_t)e->top_len[i]);
            json_object_set_new(top, json_string_value(k), lp_num(e->top_lp[i]));
            json_decref(k);
            off += (size_t)e->top_len[i];
        }
        json_array_append_new(c->lp, json_pack("[o,o,o,I]", jstr(t, (size_t)e->tok_len), lp_num(e->logprob), top,
                                               (json_int_t)c->text_off));
        c->text_off += (size_t)e->tok_len;
    }
}

/* The entries held so far as the choice's "logprobs" value (they are
 * handed over: the next call starts empty); json null without logprobs. */
static json_t *lp_take(areq *r, achoice *c)
{
    if (!r->logprobs)
        return json_null();
    json_t *entries = c->lp ? c->lp : json_array();
    c->lp = NULL;
    if (r->kind == SHOAL_GEN_CHAT)
        return json_pack("{s:o,s:n}", "content", entries, "refusal");
    json_t *o = json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
    size_t i;
    json_t *x;
    json_array_foreach(entries, i, x) {
        json_array_append(json_object_get(o, "tokens"), json_array_get(x, 0));
        json_array_append(json_object_get(o, "token_logprobs"), json_array_get(x, 1));
        json_array_append(json_object_get(o, "top_logprobs"), json_array_get(x, 2));
        json_array_append(json_object_get(o, "text_offset"), json_array_get(x, 3));
    }
    json_decref(entries);
    return o;
}

/* ---- streaming ------------------------------------------------------------ */

void shoal__api_sse(areq *r, const char *name, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!s) { /* an error event instead: the stream goes on to its end */
        SHOAL_WARN("api: %s: could not build a stream event", r->id);
        s = shoal_xstrdup(internal_error_body);
    }
    shoal_sbuf f = {0};
    if (name) {
        shoal_sbuf_add(&f, "event: ", 7);
        shoal_sbuf_add(&f, name, strlen(name));
        shoal_sbuf_add(&f, "\n", 1);
    }
    shoal_sbuf_add(&f, "data: ", 6);
    shoal_sbuf_add(&f, s, strlen(s));
    shoal_sbuf_add(&f, "\n\n", 2);
    shoal_http_stream_write(r->ex, f.p, f.n);
    free(f.p);
    free(s);
}

static void sse_send(areq *r, json_t *obj)
{
    shoal__api_sse(r, NULL, obj);
}

/* A chunk of choice c; carries the log-probabilities held since its last chunk. */
static json_t *chunk(areq *r, achoice *c, json_t *delta_or_text, const char *finish)
{
    json_t *o = envelope(r, r->kind == SHOAL_GEN_CHAT ? "chat.completion.chunk" : "text_completion");
    json_t *choice = json_pack("{s:i,s:o,s:o}", "index", c->index, "logprobs",
                               c->lp || finish ? lp_take(r, c) : json_null(), "finish_reason",
                               finish ? json_string(finish) : json_null());
    if (r->kind == SHOAL_GEN_CHAT)
        json_object_set_new(choice, "delta", delta_or_text);
    else
        json_object_set_new(choice, "text", delta_or_text);
    json_object_set_new(o, "choices", json_pack("[o]", choice));
    if (r->include_usage)
        json_object_set_new(o, "usage", json_null());
    return o;
}

static void stream_head(areq *r)
{
    char extra[1024];
    extra_headers(r, extra, sizeof extra);
    r->head_sent = 1;
    r->status = 200;
    shoal__api_count(r->api, r->ep, 200);
    r->api->streams++;
    shoal_http_stream_begin(r->ex, 200, "text/event-stream", extra);
    if (r->fmt == FMT_ANTHROPIC)
        shoal__api_anth_head(r);
    else if (r->fmt == FMT_RESPONSES)
        shoal__api_resp_head(r);
    else if (r->kind == SHOAL_GEN_CHAT)
        for (int i = 0; i < r->n; i++)
            sse_send(r, chunk(r, &r->ch[i], json_pack("{s:s,s:s}", "role", "assistant", "content", ""), NULL));
}

static void stream_text(areq *r, achoice *c, shoal_channel ch, const char *text, size_t len)
{
    if (len == 0)
        return;
    if (r->fmt == FMT_ANTHROPIC) {
        shoal__api_anth_text(r, ch, text, len);
        return;
    }
    if (r->fmt == FMT_RESPONSES) {
        shoal__api_resp_text(r, ch, text, len);
        return;
    }
    json_t *t = jstr(text, len);
    if (r->kind == SHOAL_GEN_CHAT)
        sse_send(r, chunk(r, c, json_pack("{s:o}", ch == SHOAL_CH_REASONING ? "reasoning_content" : "content", t),
                          NULL));
    else
        sse_send(r, chunk(r, c, t, NULL));
}

tcall *shoal__api_call_at(achoice *c, int index)
{
    if (index < 0 || index > 1024)
        SHOAL_PANIC("api: tool call index %d out of range", index);
    if (index >= c->ncalls) {
        c->calls = shoal_xrealloc(c->calls, (size_t)(index + 1) * sizeof *c->calls);
        memset(c->calls + c->ncalls, 0, (size_t)(index + 1 - c->ncalls) * sizeof *c->calls);
        for (int i = c->ncalls; i <= index; i++) {
            const char *pre = c->r->fmt == FMT_ANTHROPIC ? "toolu_" : "call_";
            memcpy(c->calls[i].id, pre, strlen(pre));
            random_hex(c->calls[i].id + strlen(pre), 12);
        }
        c->ncalls = index + 1;
    }
    return &c->calls[index];
}

static void stream_tool(areq *r, achoice *ch, const shoal_ev *e)
{
    if (r->fmt == FMT_ANTHROPIC) {
        shoal__api_anth_tool(r, e);
        return;
    }
    if (r->fmt == FMT_RESPONSES) {
        shoal__api_resp_tool(r, e);
        return;
    }
    tcall *c = call_at(ch, e->tool_index);
    json_t *fn = json_object();
    json_t *tc = json_pack("{s:i}", "index", e->tool_index);
    if (e->name) {
        json_object_set_new(tc, "id", json_string(c->id));
        json_object_set_new(tc, "type", json_string("function"));
        json_object_set_new(fn, "name", jstr(e->name, strlen(e->name)));
    }
    json_object_set_new(fn, "arguments", jstr(e->text, e->len));
    json_object_set_new(tc, "function", fn);
    sse_send(r, chunk(r, ch, json_pack("{s:[o]}", "tool_calls", tc), NULL));
}

/* Choice c is done: its last chunk. */
static void stream_choice_done(areq *r, achoice *c, const shoal_ev *e)
{
    json_t *last = chunk(r, c, r->kind == SHOAL_GEN_CHAT ? json_object() : json_string(""), e->finish);
    if (r->return_ids && e->output_ids) {
        json_t *ch = json_array_get(json_object_get(last, "choices"), 0);
        json_object_set_new(ch, "token_ids", ids_json(e->output_ids, e->n_output_ids));
        json_object_set_new(ch, "prompt_token_ids", ids_json(e->prompt_ids, e->n_prompt_ids));
    }
    sse_send(r, last);
}

/* Every choice is done: usage, [DONE], the end. */
static void stream_done(areq *r)
{
    if (r->include_usage) {
        json_t *u = envelope(r, r->kind == SHOAL_GEN_CHAT ? "chat.completion.chunk" : "text_completion");
        json_object_set_new(u, "choices", json_array());
        json_object_set_new(u, "usage", usage_json(r));
        sse_send(r, u);
    }
    static const char done[] = "data: [DONE]\n\n";
    shoal_http_stream_write(r->ex, done, sizeof done - 1);
    shoal_http_stream_end(r->ex);
}

/* ---- full responses ------------------------------------------------------- */

static json_t *full_choice(areq *r, achoice *c)
{
    const shoal_ev *e = c->done_ev;
    json_t *choice = json_pack("{s:i,s:o,s:s}", "index", c->index, "logprobs", lp_take(r, c), "finish_reason",
                               e->finish);
    if (r->kind == SHOAL_GEN_CHAT) {
        json_t *msg = json_pack("{s:s}", "role", "assistant");
        if (c->ncalls && c->content.n == 0)
            json_object_set_new(msg, "content", json_null());
        else
            json_object_set_new(msg, "content", jstr(c->content.p, c->content.n));
        if (c->reasoning.n)
            json_object_set_new(msg, "reasoning_content", jstr(c->reasoning.p, c->reasoning.n));
        if (c->ncalls) {
            json_t *calls = json_array();
            for (int i = 0; i < c->ncalls; i++)
                json_array_append_new(
                    calls, json_pack("{s:s,s:s,s:{s:o,s:o}}", "id", c->calls[i].id, "type", "function", "function",
                                     "name", jstr(c->calls[i].name, c->calls[i].name ? strlen(c->calls[i].name) : 0),
                                     "arguments", jstr(c->calls[i].args.p, c->calls[i].args.n)));
            json_object_set_new(msg, "tool_calls", calls);
        }
        json_object_set_new(choice, "message", msg);
    } else {
        json_object_set_new(choice, "text", jstr(c->content.p, c->content.n));
    }
    if (r->return_ids && e->output_ids) {
        json_object_set_new(choice, "token_ids", ids_json(e->output_ids, e->n_output_ids));
        json_object_set_new(choice, "prompt_token_ids", ids_json(e->prompt_ids, e->n_prompt_ids));
    }
    return choice;
}

static void full_done(areq *r)
{
    r->status = 200;
    json_t *resp = envelope(r, r->kind == SHOAL_GEN_CHAT ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int i = 0; i < r->n; i++)
        json_array_append_new(choices, full_choice(r, &r->ch[i]));
    json_object_set_new(resp, "choices", choices);
    json_object_set_new(resp, "usage", usage_json(r));
    char extra[1024];
    extra_headers(r, extra, sizeof extra);
    respond_json(r->api, r->ex, r->ep, 200, resp, extra);
}

static void cancel_all(areq *r)
{
    for (int i = 0; i < r->n; i++)
        if (r->ch[i].job)
            shoal_sched_cancel(r->api->o.sched, r->ch[i].job);
}

static void finish_error(areq *r, const shoal_ev *e)
{
    if (!r->head_sent)
        r->status = e->status;
    cancel_all(r); /* the other choices' work is wasted now */
    shoal_api_error err = {.status = e->status};
    snprintf(err.type, sizeof err.type, "%s",
             e->status >= 500 ? "server_error" : e->status == 429 ? "rate_limit_error" : "invalid_request_error");
    snprintf(err.code, sizeof err.code, "%s", e->code);
    snprintf(err.param, sizeof err.param, "%s", e->param);
    snprintf(err.message, sizeof err.message, "%s", e->message);
    if (!r->head_sent) {
        char extra[1024];
        extra_headers(r, extra, sizeof extra);
        respond_error(r->api, r->ex, r->ep, &err, extra);
    } else {
        /* mid-stream: an error event, then the end (no [DONE]) */
        if (r->fmt == FMT_ANTHROPIC)
            shoal__api_anth_stream_error(r, &err);
        else if (r->fmt == FMT_RESPONSES)
            shoal__api_resp_stream_error(r, &err);
        else
            sse_send(r, error_json(&err));
        shoal_http_stream_end(r->ex);
    }
}

/* Applies choice c's events in order; merges adjacent text of one channel
 * first so a lagging loop sends fewer, larger chunks. Ends the exchange on
 * an ERROR, or on the DONE of the last choice. */
static void apply_events(areq *r, achoice *c, shoal_ev *evs)
{
    for (shoal_ev *e = evs; e && r->ex; e = e->next) {
        switch (e->type) {
        case SHOAL_EV_START:
            if (c->index == 0 || !r->started) {
                r->prompt_tokens = e->prompt_tokens;
                r->reused_tokens = e->reused_tokens;
            }
            if (!r->started && r->stream)
                stream_head(r);
            r->started = 1;
            break;
        case SHOAL_EV_LOGPROB:
            lp_add(r, c, e);
            break;
        case SHOAL_EV_TEXT: {
            shoal_sbuf merged = {0};
            shoal_ev *last = e;
            if (r->stream) {
                while (last->next && last->next->type == SHOAL_EV_TEXT && last->next->channel == e->channel)
                    last = last->next;
            }
            if (last != e) {
                for (shoal_ev *x = e; x != last->next; x = x->next)
                    shoal_sbuf_add(&merged, x->text, x->len);
            }
            const char *t = last != e ? merged.p : e->text;
            size_t len = last != e ? merged.n : e->len;
            if (r->stream)
                stream_text(r, c, e->channel, t, len);
            else
                shoal_sbuf_add(e->channel == SHOAL_CH_REASONING ? &c->reasoning : &c->content, t ? t : "", len);
            free(merged.p);
            e = last;
            break;
        }
        case SHOAL_EV_TOOL:
            if (r->stream) {
                stream_tool(r, c, e);
            } else {
                tcall *tc = call_at(c, e->tool_index);
                if (e->name && !tc->name)
                    tc->name = shoal_xstrdup(e->name);
                shoal_sbuf_add(&tc->args, e->text ? e->text : "", e->len);
            }
            break;
        case SHOAL_EV_DONE: {
            if (c->done)
                break;
            c->done = 1;
            c->done_ev = done_copy(e);
            r->ndone++;
            r->completion_tokens += e->completion_tokens;
            if (r->fmt != FMT_OPENAI) { /* one choice (the formats have no n) */
                r->status = 200;
                if (r->stream) {
                    if (!r->head_sent)
                        stream_head(r);
                    if (r->fmt == FMT_ANTHROPIC)
                        shoal__api_anth_done(r, e);
                    else
                        shoal__api_resp_done(r, e);
                    shoal_http_stream_end(r->ex);
                } else if (r->fmt == FMT_ANTHROPIC) {
                    shoal__api_anth_full(r, e);
                } else {
                    shoal__api_resp_full(r, e);
                }
                end_exchange(r);
                return;
            }
            if (r->stream) {
                if (!r->head_sent)
                    stream_head(r);
                stream_choice_done(r, c, e);
            }
            if (r->ndone < r->n)
                break;
            if (r->stream)
                stream_done(r);
            else
                full_done(r);
            end_exchange(r);
            return;
        }
        case SHOAL_EV_ERROR:
            finish_error(r, e);
            end_exchange(r);
            return;
        }
    }
}

static void drain(void *arg)
{
    achoice *c = arg;
    areq *r = c->r;
    if (r->ex && c->job) {
        shoal_ev *evs = shoal_sched_job_take(c->job);
        apply_events(r, c, evs);
        shoal_ev_free_list(evs);
    }
    areq_unref(r);
}

/* Model thread: events are waiting. */
static void on_job_events(void *arg)
{
    achoice *c = arg;
    atomic_fetch_add(&c->r->refs, 1);
    if (shoal_http_post(c->r->api->http, drain, c) != 0)
        areq_unref(c->r); /* stopping: the exchange is being aborted anyway */
}

static void on_abort(void *arg)
{
    areq *r = arg;
    cancel_all(r);
    shoal_http_stream_end(r->ex); /* frees the aborted exchange */
    end_exchange(r);
}

/* ---- endpoints ------------------------------------------------------------ */

/* The metric's row of a label; the table full: the "other" row (the last). */
static int ign_row(shoal_api *a, const char *name)
{
    for (int k = 0; k < a->nign; k++)
        if (!strcmp(a->ign[k].name, name))
            return k;
    if (a->nign == MAX_IGNORED_LABELS)
        return strcmp(name, "other") ? ign_row(a, "other") : MAX_IGNORED_LABELS - 1;
    if (a->nign == MAX_IGNORED_LABELS - 1 && strcmp(name, "other"))
        return ign_row(a, "other"); /* the last row is kept for "other" */
    snprintf(a->ign[a->nign].name, sizeof a->ign[0].name, "%s", name);
    return a->nign++;
}

/* The ignored fields of a request into the metric's table. */
void shoal__api_count_ignored(shoal_api *a, const shoal_api_ignored *ign)
{
    for (int i = 0; i < ign->n; i++)
        a->ign[ign_row(a, ign->known[i] ? ign->name[i] : "other")].count++;
    if (ign->dropped)
        a->ign[ign_row(a, "other")].count += (uint64_t)ign->dropped;
}

int shoal__api_not_ready(shoal_api *a, shoal_http_ex *ex, int ep)
{
    if (atomic_load(&a->ready))
        return 0;
    respond_simple_error(a, ex, ep, 503, "server_error", "not_ready", NULL, "Retry-After: 1\r\n",
                         "the model is still loading");
    return 1;
}

areq *shoal__api_areq_new(shoal_api *a, shoal_http_ex *ex, int ep, shoal__api_fmt fmt, const shoal_api_req *q,
                          const char *id_prefix)
{
    shoal__api_count_ignored(a, &q->ignored);
    areq *r = shoal_xcalloc(1, sizeof *r);
    atomic_init(&r->refs, 1); /* the exchange's */
    r->api = a;
    r->ex = ex;
    r->ep = ep;
    r->fmt = fmt;
    r->kind = q->gen.kind;
    r->stream = q->stream;
    r->include_usage = q->include_usage;
    r->return_ids = q->gen.return_token_ids;
    r->logprobs = q->gen.logprobs;
    r->created = (long long)time(NULL);
    r->t0 = a->t0;
    r->open_kind = -1;
    r->n = q->n > 0 ? q->n : 1;
    r->ch = shoal_xcalloc((size_t)r->n, sizeof *r->ch);
    for (int i = 0; i < r->n; i++) {
        r->ch[i].r = r;
        r->ch[i].index = i;
    }
    shoal_api_ignored_list(&q->ignored, r->ignored, sizeof r->ignored);
    snprintf(r->peer, sizeof r->peer, "%s", shoal_http_ex_peer(ex));
    a->handed = 1;
    snprintf(r->id, sizeof r->id, "%s", id_prefix);
    random_hex(r->id + strlen(r->id), 12);
    a->live++;
    return r;
}

/* No admission check on the workers' states: a request that reaches a down
 * worker fails at once with 503 naming it (coordinator/api/sched.c), and one
 * that finds it back (restarted) is served. */
void shoal__api_start(areq *r, shoal_api_req *q)
{
    shoal_api *a = r->api;
    shoal_http_ex *ex = r->ex;
    if (q->memo_key) {
        shoal_ev *hit = shoal_sched_memo_get(a->o.sched, q->memo_key);
        if (hit) {
            r->memo = 2;
            a->memo_hits_served++;
            shoal_api_req_free(q);
            atomic_fetch_add(&r->refs, 1); /* apply_events may end the exchange */
            apply_events(r, &r->ch[0], hit);
            shoal_ev_free_list(hit);
            if (r->ex) { /* a stored list always ends with DONE; never leave an exchange open */
                shoal_ev bad = {.type = SHOAL_EV_ERROR, .status = 500};
                snprintf(bad.code, sizeof bad.code, "internal_error");
                snprintf(bad.message, sizeof bad.message, "the stored response was incomplete");
                finish_error(r, &bad);
                end_exchange(r);
            }
            areq_unref(r);
            return;
        }
        r->memo = 1;
    }
    char client[256];
    snprintf(client, sizeof client, "%s/%s", shoal_http_ex_peer(ex), q->user);
    /* n choices: choice i is the request with seed + i; choices 1.. copy the
     * prompt state of choice 0 once it is prefilled */
    for (int i = r->n - 1; i >= 1; i--) {
        shoal_gen_params g;
        if (shoal_gen_params_copy(&g, &q->gen))
            SHOAL_PANIC("api: out of memory copying a request");
        g.seed = q->gen.seed + (uint64_t)i;
        r->ch[i].job = shoal_sched_job_new(&g, client, NULL, on_job_events, &r->ch[i]);
    }
    r->ch[0].job = shoal_sched_job_new(&q->gen, client, q->memo_key, on_job_events, &r->ch[0]);
    shoal_api_req_free(q);
    for (int i = 1; i < r->n; i++)
        shoal_sched_job_fork_of(r->ch[i].job, r->ch[0].job);
    shoal_http_ex_on_abort(ex, on_abort, r);
    int rc = 0;
    for (int i = 0; i < r->n && !rc; i++)
        rc = shoal_sched_submit(a->o.sched, r->ch[i].job);
    if (rc) {
        cancel_all(r); /* the choices already queued leave the queue */
        char extra[128];
        snprintf(extra, sizeof extra, "x-request-id: %s\r\nRetry-After: 1\r\n", r->id);
        respond_simple_error(a, ex, r->ep, 429, "rate_limit_error", "queue_full", NULL, extra,
                             "the request queue is full; retry later");
        r->status = 429;
        end_exchange(r);
    }
}

/* A generation request is parsed (JSON, validation, normalisation, the memo
 * key) on the HTTP layer's thread pool (shoal__api_defer, below): linear in
 * the body, but a 4 MB body takes a good fraction of a second on a busy
 * machine, and on the loop thread that would stall every other connection
 * (their streams included). */
typedef struct {
    shoal_gen_kind kind;
    int rc;
    shoal_api_req q;
    shoal_api_error err;
} parsing;

static void parse_work(shoal__api_deferred *d)
{
    parsing *w = d->ctx;
    w->rc = shoal_api_parse(w->kind, d->req.body, d->req.body_len, &d->a->o.limits, &w->q, &w->err);
}

static void parse_done(shoal__api_deferred *d)
{
    parsing *w = d->ctx;
    shoal_api *a = d->a;
    int parsed = d->ran && !w->rc; /* w->q holds a request to free or hand on */
    if (d->ex && d->ran && w->rc) {
        respond_error(a, d->ex, d->ep, &w->err, NULL);
    } else if (d->ex && parsed && !shoal__api_not_ready(a, d->ex, d->ep)) {
        areq *r = shoal__api_areq_new(a, d->ex, d->ep, FMT_OPENAI, &w->q,
                                      w->kind == SHOAL_GEN_CHAT ? "chatcmpl-" : "cmpl-");
        shoal__api_start(r, &w->q); /* takes q */
        parsed = 0;
    }
    if (parsed)
        shoal_api_req_free(&w->q);
    free(w);
}

static void generate(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req, int ep, shoal_gen_kind kind)
{
    parsing *w = shoal_xcalloc(1, sizeof *w);
    w->kind = kind;
    shoal__api_defer(a, ex, req, ep, parse_work, parse_done, w);
}

static void defer_work(void *arg)
{
    shoal__api_deferred *d = arg;
    d->work(d);
    d->ran = 1;
}

static void defer_abort(void *arg)
{
    shoal__api_deferred *d = arg;
    access_log(d->peer, "POST", ep_names[d->ep], 499, 0, 0, d->t0, NULL);
    shoal_http_stream_end(d->ex); /* frees the aborted exchange */
    d->ex = NULL;
}

static void defer_done(void *arg, int canceled)
{
    shoal__api_deferred *d = arg;
    shoal_api *a = d->a;
    if (d->ex) {
        shoal_http_ex_on_abort(d->ex, NULL, NULL);
        if (canceled) {
            respond_simple_error(a, d->ex, d->ep, 503, "server_error", "shutting_down", NULL, NULL,
                                 "the server is stopping");
            access_log(d->peer, "POST", ep_names[d->ep], 503, 0, 0, d->t0, NULL);
            d->ex = NULL;
        }
    }
    shoal_http_ex *ex = d->ex;
    a->t0 = d->t0; /* for an areq done() creates: its own request's start */
    a->handed = 0;
    a->last_status = 0;
    d->done(d);
    if (ex && !a->handed)
        access_log(d->peer, "POST", ep_names[d->ep], a->last_status ? a->last_status : 500, 0, 0, d->t0, NULL);
    free((char *)d->req.body);
    free(d);
}

void shoal__api_defer(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req, int ep,
                      void (*work)(shoal__api_deferred *d), void (*done)(shoal__api_deferred *d), void *ctx)
{
    shoal__api_deferred *d = shoal_xcalloc(1, sizeof *d);
    d->a = a;
    d->ex = ex;
    d->ep = ep;
    d->t0 = a->t0;
    snprintf(d->peer, sizeof d->peer, "%s", shoal_http_ex_peer(ex));
    char *body = shoal_xmalloc(req->body_len + 1); /* the connection's bytes go if it closes */
    memcpy(body, req->body, req->body_len);
    body[req->body_len] = 0;
    d->req.body = body;
    d->req.body_len = req->body_len;
    d->ctx = ctx;
    d->work = work;
    d->done = done;
    a->handed = 1; /* logged when answered */
    if (!a->http || shoal_http_work(a->http, defer_work, defer_done, d)) {
        defer_work(d); /* no pool (tests without a server): here */
        defer_done(d, 0);
        return;
    }
    shoal_http_ex_on_abort(ex, defer_abort, d);
}

static json_t *model_object(shoal_api *a)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:i}", "id", a->model_name, "object", "model", "created",
                     (json_int_t)a->started, "owned_by", "shoal", "max_model_len", a->o.limits.max_context);
}

/* With --api-key, a caller without the key sees the status only: the
 * workers' addresses and states are for authorised callers. */
static void health(shoal_api *a, shoal_http_ex *ex, int authorised)
{
    shoal_api_worker w[64];
    memset(w, 0, sizeof w);
    int n = a->o.workers ? a->o.workers(a->o.ud, w, 64) : 0;
    json_t *ws = json_array();
    int all_up = 1;
    for (int i = 0; i < n && i < 64; i++) {
        json_t *wj = json_pack("{s:o,s:b,s:o}", "endpoint", jstr(w[i].name, strlen(w[i].name)), "up", w[i].up,
                               "state", jstr(w[i].state, strlen(w[i].state)));
        if (w[i].local) { /* the supervisor's record of a local worker (docs/API.md) */
            json_object_set_new(wj, "restarts", json_integer(w[i].restarts));
            json_object_set_new(wj, "hangs", json_integer(w[i].hangs));
            json_object_set_new(wj, "backing_off", json_boolean(w[i].backing_off));
            if (w[i].backing_off) {
                json_object_set_new(wj, "backoff_s", json_integer(w[i].backoff_s));
                json_object_set_new(wj, "next_restart_in_s", json_real(w[i].next_try_s));
                json_object_set_new(wj, "next_restart_at", json_real(w[i].next_try_unix));
            }
        }
        json_array_append_new(ws, wj);
        all_up &= w[i].up != 0;
    }
    shoal_sched_stats ss;
    shoal_sched_get_stats(a->o.sched, &ss);
    /* a worker down is "degraded" (200) while replicas still cover every
     * expert and trunk row: requests are served; 503 only when something
     * has no owner up (those requests fail) */
    char why[512] = "";
    int loaded = atomic_load(&a->ready);
    int covered = all_up || (a->o.covered && a->o.covered(a->o.ud, why, sizeof why));
    /* a model file truncated under the mapping: every forward is refused */
    char files[512] = "";
    int files_ok = !loaded || !a->o.model || shoal_model_check_files(a->o.model, files, sizeof files) == 0;
    int ready = loaded && covered && files_ok;
    const char *status = !loaded ? "starting" : !files_ok ? "unavailable" : all_up ? "ok" : covered ? "degraded" : "unavailable";
    json_t *body;
    if (authorised) {
        body = json_pack("{s:s,s:b,s:s,s:o,s:{s:i,s:i}}", "status", status, "ready", ready, "model", a->model_name,
                         "workers", ws, "queue", "queued", ss.queued, "running", ss.running);
        if (loaded && !covered) {
            if (!why[0])
                snprintf(why, sizeof why, "a worker is down");
            json_object_set_new(body, "uncovered", jstr(why, strlen(why)));
        }
        if (!files_ok)
            json_object_set_new(body, "model_files", jstr(files, strlen(files)));
    } else {
        json_decref(ws);
        body = json_pack("{s:s,s:b}", "status", status, "ready", ready);
    }
    respond_json(a, ex, EP_HEALTH, ready ? 200 : 503, body, NULL);
}

static void metric(shoal_metrics_buf *b, const char *name, shoal_metrics_type type, const char *help, double v)
{
    shoal_metrics_family(b, name, type, help);
    shoal_metrics_sample(b, name, NULL, 0, v);
}

static void metrics(shoal_api *a, shoal_http_ex *ex)
{
    shoal__api_count(a, EP_METRICS, 200); /* counted before formatting, so it includes itself */
    shoal_metrics_buf b = {0};
    shoal_api_metrics_text(a, &b);
    shoal_http_respond(ex, 200, "text/plain; version=0.0.4", NULL, b.p, b.len);
    shoal_metrics_buf_free(&b);
}

void shoal_api_metrics_text(shoal_api *a, shoal_metrics_buf *bp)
{
    shoal_metrics_buf b = *bp;
    const shoal_metrics_type C = SHOAL_METRICS_COUNTER, G = SHOAL_METRICS_GAUGE;
    shoal_metrics_family(&b, "shoal_http_responses_total", C, "HTTP responses of the API, by endpoint and status.");
    for (int i = 0; i < MAX_STATUS_SLOTS && a->st[i].status; i++)
        for (int e = 0; e < EP_N; e++)
            if (a->st[i].count[e]) {
                char status[16];
                snprintf(status, sizeof status, "%d", a->st[i].status);
                shoal_metrics_label l[2] = {{"endpoint", ep_names[e]}, {"status", status}};
                shoal_metrics_sample(&b, "shoal_http_responses_total", l, 2, (double)a->st[i].count[e]);
            }
    shoal_http_stats hs;
    shoal_http_get_stats(a->http, &hs);
    metric(&b, "shoal_http_connections_total", C, "TCP connections accepted.", (double)hs.connections);
    metric(&b, "shoal_http_refused_connections_total", C, "Connections over the limit, closed at once.",
           (double)hs.refused_connections);
    metric(&b, "shoal_http_evicted_connections_total", C, "Idle connections closed to make room for a new one.",
           (double)hs.evicted_connections);
    metric(&b, "shoal_http_open_connections", G, "Open client connections.", hs.open_connections);
    metric(&b, "shoal_http_requests_total", C, "Complete HTTP requests parsed.", (double)hs.requests);
    metric(&b, "shoal_http_bad_requests_total", C, "Requests refused by the HTTP parser.", (double)hs.bad_requests);
    metric(&b, "shoal_http_timeouts_total", C, "Slow or stalled clients timed out.", (double)hs.timeouts);
    metric(&b, "shoal_http_aborted_total", C, "Exchanges whose client went away first.", (double)hs.aborted);
    metric(&b, "shoal_http_received_bytes_total", C, "Bytes received.", (double)hs.bytes_in);
    metric(&b, "shoal_http_sent_bytes_total", C, "Bytes sent.", (double)hs.bytes_out);
    shoal_sched_stats ss;
    shoal_sched_get_stats(a->o.sched, &ss);
    metric(&b, "shoal_sched_queued", G, "Requests waiting in the queue.", ss.queued);
    metric(&b, "shoal_sched_running", G, "Requests generating.", ss.running);
    metric(&b, "shoal_sched_slots", G, "Sequences the step loop decodes together at most (--slots).", ss.slots);
    metric(&b, "shoal_sched_state_bytes", G, "Sequence state held by the slots now.", (double)ss.state_bytes);
    metric(&b, "shoal_sched_state_budget_bytes", G, "Sequence state the slots may hold (--state-gb; 0: no limit).",
           (double)ss.state_budget);
    metric(&b, "shoal_sched_state_waiting", G, "1 while the first request in line waits for sequence state.",
           ss.waiting_state);
    metric(&b, "shoal_sched_state_waits_total", C, "Requests that waited for sequence state to be freed.",
           (double)ss.state_waits);
    metric(&b, "shoal_sched_submitted_total", C, "Requests accepted into the queue.", (double)ss.submitted);
    metric(&b, "shoal_sched_refused_total", C, "Requests refused because the queue was full.",
           (double)ss.refused_full);
    metric(&b, "shoal_sched_completed_total", C, "Requests generated to the end.", (double)ss.completed);
    metric(&b, "shoal_sched_canceled_total", C, "Requests canceled by their client.", (double)ss.canceled);
    metric(&b, "shoal_sched_failed_total", C, "Requests ended by an error.", (double)ss.failed);
    metric(&b, "shoal_sched_handovers_total", C,
           "Requests admitted into a slot that a canceled request (its client gone) left.", (double)ss.handovers);
    metric(&b, "shoal_sched_handover_steps_max", G,
           "Most step boundaries such a request waited after the cancel (or after its render, if later); 1: the "
           "first boundary after it.",
           (double)ss.handover_steps_max);
    metric(&b, "shoal_sched_handover_seconds_last", G,
           "The last such request: seconds from the cancel (or its render, if later) to its admission.",
           (double)ss.handover_ns_last / 1e9);
    metric(&b, "shoal_prompt_tokens_total", C, "Prompt tokens of admitted requests.", (double)ss.prompt_tokens);
    metric(&b, "shoal_completion_tokens_total", C, "Tokens generated.", (double)ss.completion_tokens);
    metric(&b, "shoal_reused_tokens_total", C,
           "Prompt tokens not prefilled again (kept sequence, prefix cache, n choices).",
           (double)ss.reused_tokens);
    metric(&b, "shoal_memo_hits_total", C, "Requests answered from the response memo.", (double)ss.memo_hits);
    metric(&b, "shoal_memo_entries", G, "Responses in the memo.", (double)ss.memo_entries);
    metric(&b, "shoal_memo_bytes", G, "Bytes held by the memo.", (double)ss.memo_bytes);
    metric(&b, "shoal_kept_sequences", G, "Sequence states kept for conversation reuse.", (double)ss.kept_seqs);
    metric(&b, "shoal_kept_bytes", G, "Bytes of the kept sequence states.", (double)ss.kept_bytes);
    shoal_metrics_family(&b, "shoal_api_ignored_fields_total", C,
                         "Request fields accepted and ignored (docs/API.md: the field policy), by field; fields "
                         "in no known vocabulary count as field=\"other\".");
    for (int i = 0; i < a->nign; i++) {
        shoal_metrics_label l[1] = {{"field", a->ign[i].name}};
        shoal_metrics_sample(&b, "shoal_api_ignored_fields_total", l, 1, (double)a->ign[i].count);
    }
    metric(&b, "shoal_ready", G, "1 when the model and every worker answered.", atomic_load(&a->ready));
    if (a->o.metrics)
        a->o.metrics(a->o.ud, &b);
    *bp = b;
}

/* 1 when the request carries the key (or none is set). The client's key is
 * everything after "Bearer " exactly as sent (a key with a leading space is
 * a different key); digests are compared so the time taken does not depend
 * on the key. */
int shoal_api_key_ok(const char *api_key, const shoal_http_request *req)
{
    if (!api_key)
        return 1;
    if (sodium_init() < 0) /* idempotent; before the API is open nobody else has called it */
        return 0;
    /* Authorization: Bearer KEY (OpenAI) or x-api-key: KEY (Anthropic) */
    const char *h = shoal_http_request_header(req, "authorization");
    const char *k;
    if (h && !strncasecmp(h, "Bearer ", 7))
        k = h + 7;
    else if ((k = shoal_http_request_header(req, "x-api-key")) == NULL)
        return 0;
    unsigned char want[crypto_hash_sha256_BYTES], got[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(want, (const unsigned char *)api_key, strlen(api_key));
    crypto_hash_sha256(got, (const unsigned char *)k, strlen(k));
    return sodium_memcmp(want, got, sizeof want) == 0;
}

static int authorized(shoal_api *a, const shoal_http_request *req)
{
    return shoal_api_key_ok(a->api_key, req);
}

/* Methods of RFC 9110 (and PATCH): known, so a route answers 405 for the
 * ones it does not take; any other is 501. */
static int known_method(const char *m)
{
    static const char *const ms[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"};
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++)
        if (!strcmp(m, ms[i]))
            return 1;
    return 0;
}

static void route(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req, int *ep_out)
{
    const char *p = req->path;
    int get = !strcmp(req->method, "GET") || !strcmp(req->method, "HEAD"), post = !strcmp(req->method, "POST");
    int ep = !strcmp(p, "/v1/chat/completions") ? EP_CHAT
             : !strcmp(p, "/v1/completions")    ? EP_COMPLETIONS
             : !strcmp(p, "/v1/messages")       ? EP_MESSAGES
             : !strcmp(p, "/v1/messages/count_tokens") ? EP_COUNT_TOKENS
             : !strcmp(p, "/v1/responses")      ? EP_RESPONSES
             : !strcmp(p, "/v1/models") || !strncmp(p, "/v1/models/", 11) ? EP_MODELS
             : !strcmp(p, "/health")            ? EP_HEALTH
             : !strcmp(p, "/metrics")           ? EP_METRICS
                                                : EP_OTHER;
    *ep_out = ep;
    char qm[20], qp[104];
    if (!known_method(req->method)) {
        respond_simple_error(a, ex, ep, 501, "invalid_request_error", "method_not_implemented", NULL, NULL,
                             "method '%s' is not implemented", shoal_utf8_clip(qm, sizeof qm, req->method, SHOAL_UTF8_MARK));
        return;
    }
    int auth = authorized(a, req);
    if (ep == EP_OTHER && a->o.route && a->o.route(a->o.ud, ex, req, auth)) {
        a->handed = 1; /* the route owns the exchange (and its log) */
        return;
    }
    /* the key is checked before anything else is said about the path; only
     * /health answers without it (its status, not the workers' addresses) */
    if (!auth && ep != EP_HEALTH) {
        respond_simple_error(a, ex, ep, 401, "invalid_request_error", "invalid_api_key", NULL,
                             "WWW-Authenticate: Bearer\r\n",
                             shoal_http_request_header(req, "authorization") ||
                                     shoal_http_request_header(req, "x-api-key")
                                 ? "Incorrect API key provided"
                                 : "You didn't provide an API key (Authorization: Bearer KEY or x-api-key: KEY)");
        return;
    }
    if (ep == EP_OTHER) {
        respond_simple_error(a, ex, ep, 404, "invalid_request_error", "not_found", NULL, NULL,
                             "no such endpoint: %s %s", shoal_utf8_clip(qm, sizeof qm, req->method, SHOAL_UTF8_MARK),
                             shoal_utf8_clip(qp, sizeof qp, p, SHOAL_UTF8_MARK));
        return;
    }
    int want_post = ep == EP_CHAT || ep == EP_COMPLETIONS || ep == EP_MESSAGES || ep == EP_COUNT_TOKENS ||
                    ep == EP_RESPONSES;
    if ((want_post && !post) || (!want_post && !get)) {
        respond_simple_error(a, ex, ep, 405, "invalid_request_error", "method_not_allowed", NULL,
                             want_post ? "Allow: POST\r\n" : "Allow: GET, HEAD\r\n", "%s requires %s",
                             shoal_utf8_clip(qp, sizeof qp, p, SHOAL_UTF8_MARK), want_post ? "POST" : "GET");
        return;
    }
    switch (ep) {
    case EP_HEALTH:
        health(a, ex, auth);
        return;
    case EP_METRICS:
        metrics(a, ex);
        return;
    case EP_MODELS:
        if (p[10] == '/') {
            if (strcmp(p + 11, a->model_name)) {
                char qi[68];
                respond_simple_error(a, ex, ep, 404, "invalid_request_error", "model_not_found", "model", NULL,
                                     "The model '%s' does not exist",
                                     shoal_utf8_clip(qi, sizeof qi, p + 11, SHOAL_UTF8_MARK));
                return;
            }
            respond_json(a, ex, ep, 200, model_object(a), NULL);
            return;
        }
        respond_json(a, ex, ep, 200, json_pack("{s:s,s:[o]}", "object", "list", "data", model_object(a)), NULL);
        return;
    case EP_CHAT:
        generate(a, ex, req, ep, SHOAL_GEN_CHAT);
        return;
    case EP_COMPLETIONS:
        generate(a, ex, req, ep, SHOAL_GEN_COMPLETION);
        return;
    case EP_MESSAGES:
        shoal__api_anth_messages(a, ex, req);
        return;
    case EP_COUNT_TOKENS:
        shoal__api_anth_count_tokens(a, ex, req);
        return;
    case EP_RESPONSES:
        shoal__api_resp_create(a, ex, req);
        return;
    default:
        SHOAL_PANIC("api: endpoint %d not routed", ep);
    }
}

void shoal_api_on_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req)
{
    shoal_api *a = ud;
    int ep;
    /* Captured before route: the exchange may end inside it, and an answer
     * given at once on a keep-alive connection resets the parser that owns
     * req's method and path (the log line then had neither). Longer than
     * access_log's clips, so a cut is still marked there. */
    char peer[64], method[32], path[256];
    snprintf(peer, sizeof peer, "%s", shoal_http_ex_peer(ex));
    snprintf(method, sizeof method, "%s", req->method ? req->method : "");
    snprintf(path, sizeof path, "%s", req->path ? req->path : "");
    a->t0 = now_ms();
    a->last_status = 0;
    a->handed = 0;
    route(a, ex, req, &ep);
    if (!a->handed)
        access_log(peer, method, path, a->last_status ? a->last_status : 500, 0, 0, a->t0, NULL);
}

int shoal_api_open(shoal_api **out, const shoal_api_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->limits.model_name || !o->limits.model_name[0] || strlen(o->limits.model_name) >= 128)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "api: model name must be 1-127 bytes");
    for (const char *c = o->limits.model_name; *c; c++)
        if ((unsigned char)*c < 0x21 || *c == '"' || *c == '\\' || *c == '/')
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "api: --model-name must not contain spaces, quotes, '/' or control bytes");
    if (o->limits.vocab <= 0 || o->limits.max_context <= 0 || !o->sched)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "api: vocab, max_context and sched are required");
    if (o->api_key && !o->api_key[0])
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "api: --api-key must not be empty");
    if (sodium_init() < 0)
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "api: libsodium failed to initialise");
    shoal_api *a = shoal_xcalloc(1, sizeof *a);
    a->o = *o;
    snprintf(a->model_name, sizeof a->model_name, "%s", o->limits.model_name);
    a->o.limits.model_name = a->model_name;
    a->api_key = o->api_key ? shoal_xstrdup(o->api_key) : NULL;
    a->o.api_key = a->api_key;
    a->started = (long long)time(NULL);
    *out = a;
    return 0;
}

void shoal_api_set_http(shoal_api *a, shoal_http *h)
{
    a->http = h;
}

void shoal_api_set_ready(shoal_api *a, int ready)
{
    atomic_store(&a->ready, ready);
}

void shoal_api_close(shoal_api *a)
{
    if (!a)
        return;
    if (a->live)
        SHOAL_WARN("api: closing with %d requests still open", a->live);
    shoal__api_resp_store_free(a->responses);
    if (a->api_key)
        sodium_memzero(a->api_key, strlen(a->api_key));
    free(a->api_key);
    free(a);
}
