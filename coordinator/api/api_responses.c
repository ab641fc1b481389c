/* OpenAI Responses API (POST /v1/responses), the part Codex and the Agents
 * SDK use, as a translation onto the chat pipeline: `instructions` and the
 * `input` items (messages, function_call, function_call_output, reasoning)
 * become chat messages, which the one chat validator (shoal_api_parse) turns
 * into shoal_gen_params; the job's events are written as output items
 * (reasoning, message, function_call) and Responses' typed stream events.
 *
 * previous_response_id / store: a stored response keeps its conversation
 * (the chat messages it was generated from plus its output) in a bounded
 * store (its own lock: a request is translated on the HTTP layer's thread
 * pool, and a finished response's conversation is stored there too, since
 * both are linear in a body of up to the 4 MiB limit and would stall every
 * other connection on the loop thread); a request naming it continues that
 * conversation,
 * so its prompt extends the stored one and the scheduler's conversation reuse
 * (kept sequence states, matched by token prefix) serves the shared part
 * without prefill while the state is still kept. A response no longer in the
 * store (evicted, or the server restarted) is a 400
 * previous_response_not_found. Fields: docs/API.md. The output side (events
 * to items) runs on the loop thread. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/utf8.h"
#include "coordinator/api/api_int.h"

#if !JSON_HAVE_ATOMIC_BUILTINS && !JSON_HAVE_SYNC_BUILTINS
#error "the stored conversations are read from several threads: jansson must count references atomically"
#endif

/* ---- the store ---------------------------------------------------------------- */

#define STORE_ENTRIES 256
#define STORE_BYTES ((size_t)64 << 20)

typedef struct {
    char id[48];
    json_t *conv; /* chat messages, without the instructions */
    size_t bytes;
    uint64_t age;
} stored;

/* Every entry's tree is handed over whole and never changed after: readers
 * take a reference under mu and copy it outside (store_get). */
struct shoal__resp_store {
    pthread_mutex_t mu;
    stored e[STORE_ENTRIES];
    size_t bytes;
    uint64_t clock;
};

static shoal__resp_store *store_of(shoal_api *a)
{
    /* created on the loop thread before the first piece of work that uses it
     * is queued (shoal__api_resp_create), so every pool thread sees it */
    if (!a->responses) {
        a->responses = shoal_xcalloc(1, sizeof *a->responses);
        pthread_mutex_init(&a->responses->mu, NULL);
    }
    return a->responses;
}

void shoal__api_resp_store_free(shoal__resp_store *st)
{
    if (!st)
        return;
    for (int i = 0; i < STORE_ENTRIES; i++)
        json_decref(st->e[i].conv);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

/* A copy of the conversation stored under id (the caller's), or NULL. Any
 * thread. A stored tree is never changed, and jansson's reference counts are
 * atomic (JSON_HAVE_ATOMIC_BUILTINS), so it is copied outside the lock: the
 * loop thread's store_put never waits for a large copy. */
static json_t *store_get(shoal__resp_store *st, const char *id)
{
    json_t *held = NULL;
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < STORE_ENTRIES; i++)
        if (st->e[i].conv && !strcmp(st->e[i].id, id)) {
            held = json_incref(st->e[i].conv); /* an eviction meanwhile leaves it to us */
            break;
        }
    pthread_mutex_unlock(&st->mu);
    json_t *r = held ? json_deep_copy(held) : NULL;
    json_decref(held);
    return r;
}

/* Keeps conv (taken: a tree no other thread holds) under id, counted as
 * bytes (its JSON size, or more); the oldest entries leave first when the
 * entry count or the byte bound is reached. Returns the evicted trees (an
 * array, or NULL) for the caller to free: O(1) here, under the lock, so the
 * loop thread can store a 4 MiB conversation without touching it. */
static json_t *store_put(shoal__resp_store *st, const char *id, json_t *own, size_t bytes)
{
    if (bytes > STORE_BYTES) {
        json_t *gone = json_array();
        json_array_append_new(gone, own);
        return gone;
    }
    json_t *gone = NULL;
    pthread_mutex_lock(&st->mu);
    for (;;) {
        int free_slot = -1, oldest = -1;
        for (int i = 0; i < STORE_ENTRIES; i++) {
            if (!st->e[i].conv) {
                if (free_slot < 0)
                    free_slot = i;
            } else if (oldest < 0 || st->e[i].age < st->e[oldest].age) {
                oldest = i;
            }
        }
        if (free_slot >= 0 && st->bytes + bytes <= STORE_BYTES) {
            stored *e = &st->e[free_slot];
            snprintf(e->id, sizeof e->id, "%s", id);
            e->conv = own;
            e->bytes = bytes;
            e->age = ++st->clock;
            st->bytes += bytes;
            break;
        }
        st->bytes -= st->e[oldest].bytes;
        if (!gone)
            gone = json_array();
        json_array_append_new(gone, st->e[oldest].conv);
        memset(&st->e[oldest], 0, sizeof st->e[oldest]);
    }
    pthread_mutex_unlock(&st->mu);
    return gone;
}

/* ---- request -> chat body --------------------------------------------------- */

#define fail shoal__api_fail /* api_int.h */
#define BAD(param, ...) fail(err, 400, "invalid_request_error", param, __VA_ARGS__)
#define UNSUPPORTED(param, ...) fail(err, 400, "unsupported_value", param, __VA_ARGS__)

/* Fields this server implements; every other key goes through the one
 * unknown-field policy (shoal_api_check_fields: a known field that would
 * change the output is refused, anything else -- service_tier, truncation,
 * include, prompt_cache_key, ... -- is accepted, ignored and named in
 * x-shoal-ignored). */
static const char *const implemented[] = {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p",
    "stream", "previous_response_id", "store", "reasoning", "text", "metadata", "user", "parallel_tool_calls",
    "top_logprobs", "background", "seed", "top_k", "conversation", "prompt", "logit_bias", NULL};
/* seed, top_k, logit_bias: shoal extensions, as on chat */
static const char *const reasoning_used[] = {"effort", NULL}; /* summary: the full reasoning text is returned */
static const char *const text_used[] = {"format", "verbosity", NULL};

/* Text of a string or an array of text parts (input_text, output_text, text,
 * summary_text, reasoning_text), joined with "\n". */
static int parts_text(json_t *v, const char *where, shoal_sbuf *out, shoal_api_error *err)
{
    if (json_is_string(v)) {
        shoal_sbuf_add(out, json_string_value(v), json_string_length(v));
        return 0;
    }
    if (!json_is_array(v))
        return BAD(where, "'%s' must be a string or an array of content parts", where);
    size_t i;
    json_t *p;
    json_array_foreach(v, i, p) {
        char pp[160];
        snprintf(pp, sizeof pp, "%s[%zu]", where, i);
        json_t *t = json_is_object(p) ? json_object_get(p, "type") : NULL;
        const char *ty = json_is_string(t) ? json_string_value(t) : "";
        if (strcmp(ty, "input_text") && strcmp(ty, "output_text") && strcmp(ty, "text") &&
            strcmp(ty, "summary_text") && strcmp(ty, "reasoning_text") && strcmp(ty, "refusal")) {
            char q[40];
            return UNSUPPORTED(pp, "content parts of type '%s' are not supported (text only)", QUOTE(q, ty));
        }
        json_t *x = json_object_get(p, !strcmp(ty, "refusal") ? "refusal" : "text");
        if (!json_is_string(x))
            return BAD(pp, "'%s.text' must be a string", pp);
        if (i)
            shoal_sbuf_add(out, "\n", 1);
        shoal_sbuf_add(out, json_string_value(x), json_string_length(x));
    }
    return 0;
}

/* The assistant message input items are appended to: the last one of out
 * when it is an assistant message without tool calls after... any assistant
 * message last in out takes further function calls. */
static json_t *assistant_at_end(json_t *out, shoal_sbuf *pending_reasoning)
{
    json_t *last = json_array_get(out, json_array_size(out) - 1);
    if (last && !strcmp(json_string_value(json_object_get(last, "role")), "assistant") && !pending_reasoning->n)
        return last;
    json_t *m = json_pack("{s:s,s:n}", "role", "assistant", "content");
    if (pending_reasoning->n) {
        json_object_set_new(m, "reasoning_content", shoal__api_sbuf_json(pending_reasoning));
        pending_reasoning->n = 0;
    }
    json_array_append_new(out, m);
    return m;
}

/* input (a string or items) -> chat messages appended to out. */
static int input_items(json_t *input, json_t *out, shoal_api_error *err)
{
    if (json_is_string(input)) {
        json_array_append_new(out, json_pack("{s:s,s:O}", "role", "user", "content", input));
        return 0;
    }
    if (!json_is_array(input))
        return BAD("input", "'input' must be a string or an array of items");
    shoal_sbuf reasoning = {0};
    size_t i;
    json_t *it;
    int rc = 0;
    json_array_foreach(input, i, it) {
        char w[48], p[96];
        snprintf(w, sizeof w, "input[%zu]", i);
        if (!json_is_object(it)) {
            rc = BAD(w, "'%s' must be an object", w);
            break;
        }
        json_t *t = json_object_get(it, "type");
        const char *ty = json_is_string(t) ? json_string_value(t) : shoal__api_absent(t) ? "message" : "";
        if (!strcmp(ty, "message")) {
            json_t *role = json_object_get(it, "role");
            const char *r = json_is_string(role) ? json_string_value(role) : "";
            snprintf(p, sizeof p, "%s.role", w);
            if (strcmp(r, "user") && strcmp(r, "system") && strcmp(r, "developer") && strcmp(r, "assistant")) {
                char q[36];
                rc = UNSUPPORTED(p, "'%s' is '%s'; it must be user, system, developer or assistant", p, QUOTE(q, r));
                break;
            }
            shoal_sbuf text = {0};
            snprintf(p, sizeof p, "%s.content", w);
            if (parts_text(json_object_get(it, "content"), p, &text, err)) {
                free(text.p);
                rc = -1;
                break;
            }
            json_t *m = json_pack("{s:s,s:o}", "role", !strcmp(r, "developer") ? "system" : r, "content",
                                  shoal__api_sbuf_json(&text));
            free(text.p);
            if (!strcmp(r, "assistant") && reasoning.n) {
                json_object_set_new(m, "reasoning_content", shoal__api_sbuf_json(&reasoning));
                reasoning.n = 0;
            }
            json_array_append_new(out, m);
        } else if (!strcmp(ty, "function_call")) {
            json_t *cid = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
                   *args = json_object_get(it, "arguments");
            if (!json_is_string(cid) || !json_is_string(name) || !json_is_string(args)) {
                rc = BAD(w, "'%s' (function_call) needs string 'call_id', 'name' and 'arguments'", w);
                break;
            }
            json_t *m = assistant_at_end(out, &reasoning);
            json_t *calls = json_object_get(m, "tool_calls");
            if (!calls) {
                calls = json_array();
                json_object_set_new(m, "tool_calls", calls);
            }
            json_array_append_new(calls, json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", cid, "type", "function",
                                                   "function", "name", name, "arguments", args));
        } else if (!strcmp(ty, "function_call_output")) {
            json_t *cid = json_object_get(it, "call_id");
            if (!json_is_string(cid)) {
                rc = BAD(w, "'%s.call_id' must be a string", w);
                break;
            }
            shoal_sbuf text = {0};
            snprintf(p, sizeof p, "%s.output", w);
            if (parts_text(json_object_get(it, "output"), p, &text, err)) {
                free(text.p);
                rc = -1;
                break;
            }
            json_array_append_new(out, json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", cid, "content",
                                                 shoal__api_sbuf_json(&text)));
            free(text.p);
        } else if (!strcmp(ty, "reasoning")) {
            /* K3's reasoning for the next assistant turn: its full text when
             * given (this server's own items carry it), else the summary */
            json_t *c = json_object_get(it, "content");
            if (shoal__api_absent(c) || (json_is_array(c) && json_array_size(c) == 0))
                c = json_object_get(it, "summary");
            snprintf(p, sizeof p, "%s.content", w);
            if (!shoal__api_absent(c) && parts_text(c, p, &reasoning, err)) {
                rc = -1;
                break;
            }
        } else {
            char q[40];
            rc = UNSUPPORTED(w, "input items of type '%s' are not supported (message, function_call, "
                                "function_call_output and reasoning are)", QUOTE(q, ty));
            break;
        }
    }
    free(reasoning.p);
    return rc;
}

static int tools_of(json_t *tools, json_t *chat, shoal_api_error *err)
{
    if (shoal__api_absent(tools))
        return 0;
    if (!json_is_array(tools))
        return BAD("tools", "'tools' must be an array");
    json_t *ct = json_array();
    json_object_set_new(chat, "tools", ct);
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char p[48];
        snprintf(p, sizeof p, "tools[%zu]", i);
        json_t *ty = json_is_object(t) ? json_object_get(t, "type") : NULL;
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "function")) {
            char q[40];
            return UNSUPPORTED(p, "tools of type '%s' are not supported (function tools are)",
                               json_is_string(ty) ? QUOTE(q, json_string_value(ty)) : "?");
        }
        json_t *fn = json_object();
        const char *keys[] = {"name", "description", "parameters", "strict"};
        for (size_t k = 0; k < 4; k++)
            if (!shoal__api_absent(json_object_get(t, keys[k])))
                json_object_set(fn, keys[k], json_object_get(t, keys[k]));
        json_array_append_new(ct, json_pack("{s:s,s:o}", "type", "function", "function", fn));
    }
    return 0;
}

/* The Responses body -> an OpenAI chat body, *conv (the conversation without
 * the instructions) and *echo (fields the response object repeats). */
static int translate(shoal_api *a, json_t *root, json_t **chat_out, json_t **conv_out, json_t **echo_out,
                     int *store, shoal_api_ignored *ign, shoal_api_error *err)
{
    *chat_out = *conv_out = *echo_out = NULL;
    if (!json_is_object(root))
        return BAD("body", "the body must be a JSON object");
    if (shoal_api_check_fields(root, "", implemented, ign, err))
        return -1;
    const char *unsupported[] = {"conversation", "prompt"};
    for (size_t i = 0; i < 2; i++)
        if (!shoal__api_absent(json_object_get(root, unsupported[i])))
            return UNSUPPORTED(unsupported[i], "'%s' (server-side conversations and prompt templates) is not supported",
                               unsupported[i]);
    json_t *bg = json_object_get(root, "background");
    if (json_is_true(bg))
        return UNSUPPORTED("background", "'background' responses are not supported");
    json_t *tl = json_object_get(root, "top_logprobs");
    if (!shoal__api_absent(tl) && !(json_is_integer(tl) && json_integer_value(tl) == 0))
        return UNSUPPORTED("top_logprobs", "'top_logprobs' is not supported on /v1/responses");
    json_t *st = json_object_get(root, "store");
    if (!shoal__api_absent(st) && !json_is_boolean(st))
        return fail(err, 400, "invalid_type", "store", "'store' must be a boolean");
    *store = shoal__api_absent(st) || json_is_true(st);
    json_t *chat = json_object();
    json_t *conv = json_array();
    int rc = -1;
    const char *copy[][2] = {{"model", "model"},         {"max_output_tokens", "max_tokens"},
                             {"temperature", "temperature"}, {"top_p", "top_p"},
                             {"stream", "stream"},       {"user", "user"},
                             {"seed", "seed"},           {"top_k", "top_k"},
                             {"parallel_tool_calls", "parallel_tool_calls"}, {"logit_bias", "logit_bias"}};
    for (size_t i = 0; i < sizeof copy / sizeof copy[0]; i++)
        if (!shoal__api_absent(json_object_get(root, copy[i][0])))
            json_object_set(chat, copy[i][1], json_object_get(root, copy[i][0]));
    json_t *md = json_object_get(root, "metadata");
    if (!shoal__api_absent(md) && !json_is_object(md)) {
        fail(err, 400, "invalid_type", "metadata", "'metadata' must be an object");
        goto out;
    }
    /* the conversation so far */
    json_t *prev = json_object_get(root, "previous_response_id");
    if (!shoal__api_absent(prev)) {
        if (!json_is_string(prev)) {
            fail(err, 400, "invalid_type", "previous_response_id", "'previous_response_id' must be a string");
            goto out;
        }
        json_t *old = store_get(a->responses, json_string_value(prev)); /* a copy: input items may extend it */
        if (!old) {
            char q[68];
            fail(err, 400, "previous_response_not_found", "previous_response_id",
                 "Previous response with id '%s' not found (not stored, or no longer held by this server).",
                 QUOTE(q, json_string_value(prev)));
            goto out;
        }
        json_array_extend(conv, old);
        json_decref(old);
    }
    json_t *input = json_object_get(root, "input");
    if (shoal__api_absent(input)) {
        BAD("input", "'input' is required");
        goto out;
    }
    if (input_items(input, conv, err))
        goto out;
    json_t *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    json_t *ins = json_object_get(root, "instructions");
    if (!shoal__api_absent(ins)) {
        if (!json_is_string(ins)) {
            fail(err, 400, "invalid_type", "instructions", "'instructions' must be a string");
            goto out;
        }
        json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", ins));
    }
    json_array_extend(msgs, conv);
    if (tools_of(json_object_get(root, "tools"), chat, err))
        goto out;
    json_t *tc = json_object_get(root, "tool_choice");
    if (!shoal__api_absent(tc)) {
        if (json_is_string(tc)) {
            json_object_set(chat, "tool_choice", tc);
        } else if (json_is_object(tc) && json_is_string(json_object_get(tc, "type")) &&
                   !strcmp(json_string_value(json_object_get(tc, "type")), "function") &&
                   json_is_string(json_object_get(tc, "name"))) {
            json_object_set_new(chat, "tool_choice", json_pack("{s:s,s:{s:O}}", "type", "function", "function",
                                                               "name", json_object_get(tc, "name")));
        } else {
            UNSUPPORTED("tool_choice", "'tool_choice' must be none, auto, required or {type: function, name}");
            goto out;
        }
    }
    json_t *re = json_object_get(root, "reasoning");
    if (!shoal__api_absent(re)) {
        json_t *ef = json_is_object(re) ? json_object_get(re, "effort") : NULL;
        if (!json_is_object(re) || (!shoal__api_absent(ef) && !json_is_string(ef))) {
            fail(err, 400, "invalid_type", "reasoning", "'reasoning' must be an object with a string 'effort'");
            goto out;
        }
        if (!shoal__api_absent(ef))
            json_object_set(chat, "reasoning_effort", ef);
        if (shoal_api_check_fields(re, "reasoning", reasoning_used, ign, err))
            goto out;
    }
    json_t *tx = json_object_get(root, "text");
    if (!shoal__api_absent(tx)) {
        json_t *f = json_is_object(tx) ? json_object_get(tx, "format") : NULL;
        json_t *ft = json_is_object(f) ? json_object_get(f, "type") : NULL;
        if (!json_is_object(tx) || (!shoal__api_absent(f) && !json_is_string(ft))) {
            fail(err, 400, "invalid_type", "text", "'text.format' must be an object with a string 'type'");
            goto out;
        }
        if (shoal_api_check_fields(tx, "text", text_used, ign, err))
            goto out;
        /* a hint to the model's length; K3 has none (OpenAI's own `verbosity`
         * field is refused on chat, as it would change the output there) */
        if (!shoal__api_absent(json_object_get(tx, "verbosity")))
            shoal_api_ignored_add(ign, "text.verbosity", 1);
        const char *fs = json_is_string(ft) ? json_string_value(ft) : "text";
        if (!strcmp(fs, "json_schema")) {
            json_t *js = json_pack("{s:O}", "schema", json_object_get(f, "schema"));
            if (json_is_string(json_object_get(f, "name")))
                json_object_set(js, "name", json_object_get(f, "name"));
            if (json_is_boolean(json_object_get(f, "strict")))
                json_object_set(js, "strict", json_object_get(f, "strict"));
            json_object_set_new(chat, "response_format", json_pack("{s:s,s:o}", "type", "json_schema", "json_schema", js));
        } else if (!strcmp(fs, "json_object")) {
            json_object_set_new(chat, "response_format", json_pack("{s:s}", "type", "json_object"));
        } else if (strcmp(fs, "text")) {
            UNSUPPORTED("text.format.type", "'text.format.type' must be text, json_object or json_schema");
            goto out;
        }
    }
    /* what the response object repeats */
    json_t *echo = json_object();
    json_object_set_new(echo, "instructions", shoal__api_absent(ins) ? json_null() : json_incref(ins));
    json_object_set_new(echo, "previous_response_id", shoal__api_absent(prev) ? json_null() : json_incref(prev));
    json_object_set_new(echo, "metadata", shoal__api_absent(md) ? json_object() : json_incref(md));
    json_object_set_new(echo, "tools", shoal__api_absent(json_object_get(root, "tools")) ? json_array()
                                                                               : json_incref(json_object_get(root, "tools")));
    json_object_set_new(echo, "tool_choice", shoal__api_absent(tc) ? json_string("auto") : json_incref(tc));
    json_t *ptc = json_object_get(root, "parallel_tool_calls");
    json_object_set_new(echo, "parallel_tool_calls", shoal__api_absent(ptc) ? json_true() : json_incref(ptc));
    const char *nums[] = {"temperature", "top_p", "max_output_tokens"};
    for (size_t i = 0; i < 3; i++) {
        json_t *v = json_object_get(root, nums[i]);
        json_object_set_new(echo, nums[i],
                            shoal__api_absent(v) ? (i < 2 ? json_real(1.0) : json_null()) : json_incref(v));
    }
    json_object_set_new(echo, "store", json_boolean(*store));
    json_object_set_new(echo, "truncation", json_string("disabled"));
    json_object_set_new(echo, "text", json_pack("{s:{s:s}}", "format", "type", "text"));
    if (!shoal__api_absent(tx) && json_is_object(json_object_get(tx, "format")))
        json_object_set(json_object_get(echo, "text"), "format", json_object_get(tx, "format"));
    json_t *ef = json_is_object(re) ? json_object_get(re, "effort") : NULL;
    json_object_set_new(echo, "reasoning", json_pack("{s:O,s:n}", "effort", ef ? ef : json_null(), "summary"));
    *echo_out = echo;
    *chat_out = chat;
    *conv_out = conv;
    return 0;
out:
    json_decref(chat);
    json_decref(conv);
    return rc;
}

/* The request, on the HTTP layer's thread pool: JSON, translation, the
 * stored conversation, the chat validator. Answered on the loop. */
typedef struct {
    int rc, store;
    shoal_api_req q;
    shoal_api_error err;
    json_t *conv, *echo;
    size_t conv_bytes; /* the chat body's size: the conversation's JSON is part of it */
} resp_job;

static void resp_work(shoal__api_deferred *d)
{
    resp_job *j = d->ctx;
    shoal_api *a = d->a;
    j->rc = -1;
    j->store = 1;
    json_error_t je;
    json_t *root = json_loadb(d->req.body, d->req.body_len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        char q[124];
        fail(&j->err, 400, "invalid_json", "", "We could not parse the JSON body of your request: %s (line %d, column %d)",
             QUOTE(q, je.text), je.line, je.column);
        return;
    }
    json_t *chat;
    shoal_api_ignored ign = {0};
    int rc = translate(a, root, &chat, &j->conv, &j->echo, &j->store, &ign, &j->err);
    json_decref(root);
    if (rc)
        return;
    char *body = json_dumps(chat, JSON_COMPACT);
    json_decref(chat);
    j->conv_bytes = body ? strlen(body) : 0;
    if (!j->store) { /* not kept: the conversation is not needed past here */
        json_decref(j->conv);
        j->conv = NULL;
    }
    if (!body || shoal_api_parse(SHOAL_GEN_CHAT, body, strlen(body), &a->o.limits, &j->q, &j->err)) {
        if (!body)
            fail(&j->err, 500, "internal_error", "", "the request could not be translated");
        free(body);
        return;
    }
    free(body);
    for (int i = 0; i < ign.n; i++) /* the Responses fields ignored, with the chat body's (none) */
        shoal_api_ignored_add(&j->q.ignored, ign.name[i], ign.known[i]);
    j->q.ignored.dropped += ign.dropped;
    j->rc = 0;
}

/* The loop thread, after resp_work (or without it, stopping: d->ran 0). */
static void resp_done(shoal__api_deferred *d)
{
    resp_job *j = d->ctx;
    shoal_api *a = d->a;
    shoal_http_ex *ex = d->ex;
    int have_q = d->ran && !j->rc;
    if (ex && d->ran && j->rc) {
        shoal__api_respond_error(a, ex, EP_RESPONSES, &j->err, NULL);
    } else if (ex && have_q && !shoal__api_not_ready(a, ex, EP_RESPONSES)) {
        areq *r = shoal__api_areq_new(a, ex, EP_RESPONSES, FMT_RESPONSES, &j->q, "resp_");
        r->conv = j->conv;
        r->echo = j->echo;
        r->store = j->store;
        r->conv_bytes = j->conv_bytes;
        r->items = json_array();
        j->conv = j->echo = NULL;
        shoal__api_start(r, &j->q); /* takes q */
        have_q = 0;
    }
    if (have_q)
        shoal_api_req_free(&j->q);
    json_decref(j->conv); /* a request refused: its trees (the loop frees small ones only: 4 MiB body limit) */
    json_decref(j->echo);
    free(j);
}

void shoal__api_resp_create(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req)
{
    store_of(a); /* before any pool thread may look into it */
    resp_job *j = shoal_xcalloc(1, sizeof *j);
    shoal__api_defer(a, ex, req, EP_RESPONSES, resp_work, resp_done, j);
}

/* ---- output ------------------------------------------------------------------- */

static json_t *usage(const areq *r, const shoal_ev *e)
{
    int cached = r->memo == 2 ? 0 : r->reused_tokens;
    return json_pack("{s:i,s:{s:i},s:i,s:{s:i},s:i}", "input_tokens", r->prompt_tokens, "input_tokens_details",
                     "cached_tokens", cached, "output_tokens", e->completion_tokens, "output_tokens_details",
                     "reasoning_tokens", e->reasoning_tokens, "total_tokens", r->prompt_tokens + e->completion_tokens);
}

static void new_item_id(char *out, size_t cap, const char *prefix)
{
    snprintf(out, cap, "%s", prefix);
    shoal__api_random_hex(out + strlen(out), 12);
}

static json_t *reasoning_item(const char *id, const char *t, size_t n)
{
    return json_pack("{s:s,s:s,s:[],s:[{s:s,s:o}],s:s}", "id", id, "type", "reasoning", "summary", "content", "type",
                     "reasoning_text", "text", shoal__api_jstr(t, n), "status", "completed");
}

static json_t *message_item(const char *id, const char *t, size_t n, const char *status)
{
    return json_pack("{s:s,s:s,s:s,s:s,s:[{s:s,s:o,s:[],s:[]}]}", "id", id, "type", "message", "status", status,
                     "role", "assistant", "content", "type", "output_text", "text", shoal__api_jstr(t, n),
                     "annotations", "logprobs");
}

static json_t *call_item(const char *id, const tcall *c, const char *args, size_t n, const char *status)
{
    return json_pack("{s:s,s:s,s:s,s:o,s:o,s:s}", "id", id, "type", "function_call", "call_id", c->id, "name",
                     shoal__api_jstr(c->name, c->name ? strlen(c->name) : 0), "arguments", shoal__api_jstr(args, n),
                     "status", status);
}

/* The response object: the echoed request fields, status, output, usage. */
static json_t *response_obj(const areq *r, const char *status, json_t *output, const shoal_ev *e)
{
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:s,s:n,s:n}", "id", r->id, "object", "response", "created_at",
                          (json_int_t)r->created, "status", status, "model", r->api->model_name, "error",
                          "incomplete_details");
    json_object_update(o, r->echo);
    json_object_set_new(o, "output", output);
    if (e && !strcmp(e->finish, "length"))
        json_object_set_new(o, "incomplete_details", json_pack("{s:s}", "reason", "max_output_tokens"));
    json_object_set_new(o, "usage", e ? usage(r, e) : json_null());
    return o;
}

static void free_work(void *arg)
{
    json_decref(arg);
}

static void free_done(void *arg, int canceled)
{
    if (canceled)
        json_decref(arg);
}

/* The output items as one assistant chat message, appended to the stored
 * conversation under the response id. */
static void keep_conversation(areq *r, json_t *items)
{
    if (!r->store || !r->conv)
        return;
    shoal_sbuf text = {0}, think = {0};
    json_t *calls = json_array();
    size_t i;
    json_t *it;
    json_array_foreach(items, i, it) {
        const char *ty = json_string_value(json_object_get(it, "type"));
        json_t *part = json_array_get(json_object_get(it, "content"), 0);
        json_t *t = json_object_get(part, "text");
        if (!strcmp(ty, "reasoning") && json_is_string(t))
            shoal_sbuf_add(&think, json_string_value(t), json_string_length(t));
        else if (!strcmp(ty, "message") && json_is_string(t))
            shoal_sbuf_add(&text, json_string_value(t), json_string_length(t));
        else if (!strcmp(ty, "function_call"))
            json_array_append_new(calls, json_pack("{s:o,s:s,s:{s:o,s:o}}", "id",
                                                   json_deep_copy(json_object_get(it, "call_id")), "type", "function",
                                                   "function", "name", json_deep_copy(json_object_get(it, "name")),
                                                   "arguments", json_deep_copy(json_object_get(it, "arguments"))));
    }
    json_t *m = json_pack("{s:s}", "role", "assistant");
    json_object_set_new(m, "content", text.n || !json_array_size(calls) ? shoal__api_sbuf_json(&text) : json_null());
    if (think.n)
        json_object_set_new(m, "reasoning_content", shoal__api_sbuf_json(&think));
    if (json_array_size(calls))
        json_object_set(m, "tool_calls", calls);
    json_decref(calls);
    free(text.p);
    free(think.p);
    char *ms = json_dumps(m, JSON_COMPACT); /* the output only: small */
    size_t out_bytes = ms ? strlen(ms) : 0;
    free(ms);
    /* the conversation leaves the request whole (nothing else holds it) for
     * the store: O(1) here; its size was measured on the pool (the request's
     * chat body, which holds it), and what eviction frees is freed there */
    json_t *conv = r->conv;
    r->conv = NULL;
    json_array_append_new(conv, m);
    json_t *gone = store_put(store_of(r->api), r->id, conv, r->conv_bytes + out_bytes + 64);
    if (gone && (!r->api->http || shoal_http_work(r->api->http, free_work, free_done, gone)))
        json_decref(gone); /* no pool (tests without a server), or stopping: here */
}

void shoal__api_resp_full(areq *r, const shoal_ev *e)
{
    achoice *c = &r->ch[0];
    json_t *out = json_array();
    char id[48];
    if (c->reasoning.n) {
        new_item_id(id, sizeof id, "rs_");
        json_array_append_new(out, reasoning_item(id, c->reasoning.p, c->reasoning.n));
    }
    if (c->content.n || !c->ncalls) {
        new_item_id(id, sizeof id, "msg_");
        json_array_append_new(out, message_item(id, c->content.p, c->content.n, "completed"));
    }
    for (int i = 0; i < c->ncalls; i++) {
        new_item_id(id, sizeof id, "fc_");
        json_array_append_new(out, call_item(id, &c->calls[i], c->calls[i].args.p, c->calls[i].args.n, "completed"));
    }
    keep_conversation(r, out);
    json_t *o = response_obj(r, strcmp(e->finish, "length") ? "completed" : "incomplete", out, e);
    char extra[1024];
    shoal__api_extra_headers(r, extra, sizeof extra);
    shoal__api_respond_json(r->api, r->ex, r->ep, 200, o, extra);
}

/* ---- streaming: the typed events ------------------------------------------------ */

static void ev(areq *r, const char *type, json_t *obj)
{
    json_object_set_new(obj, "type", json_string(type));
    json_object_set_new(obj, "sequence_number", json_integer(r->seq++));
    shoal__api_sse(r, type, obj);
}

static int out_index(const areq *r)
{
    return r->nblocks - 1;
}

static void close_item(areq *r)
{
    if (r->open_kind < 0)
        return;
    int oi = out_index(r);
    const char *t = r->item_text.p ? r->item_text.p : "";
    size_t n = r->item_text.n;
    json_t *item;
    if (r->open_kind == 0) {
        ev(r, "response.reasoning_text.done", json_pack("{s:s,s:i,s:i,s:o}", "item_id", r->item_id, "output_index", oi,
                                                        "content_index", 0, "text", shoal__api_jstr(t, n)));
        ev(r, "response.content_part.done",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:o}}", "item_id", r->item_id, "output_index", oi, "content_index", 0,
                     "part", "type", "reasoning_text", "text", shoal__api_jstr(t, n)));
        item = reasoning_item(r->item_id, t, n);
    } else if (r->open_kind == 1) {
        ev(r, "response.output_text.done", json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", r->item_id, "output_index",
                                                     oi, "content_index", 0, "text", shoal__api_jstr(t, n), "logprobs"));
        ev(r, "response.content_part.done",
           json_pack("{s:s,s:i,s:i,s:{s:s,s:o,s:[],s:[]}}", "item_id", r->item_id, "output_index", oi,
                     "content_index", 0, "part", "type", "output_text", "text", shoal__api_jstr(t, n), "annotations",
                     "logprobs"));
        item = message_item(r->item_id, t, n, "completed");
    } else {
        tcall *c = &r->ch[0].calls[r->ch[0].ncalls - 1];
        ev(r, "response.function_call_arguments.done",
           json_pack("{s:s,s:i,s:o,s:o}", "item_id", r->item_id, "output_index", oi, "arguments",
                     shoal__api_jstr(t, n), "name", shoal__api_jstr(c->name, c->name ? strlen(c->name) : 0)));
        item = call_item(r->item_id, c, t, n, "completed");
    }
    json_array_append(r->items, item);
    ev(r, "response.output_item.done", json_pack("{s:i,s:o}", "output_index", oi, "item", item));
    r->open_kind = -1;
    r->item_text.n = 0;
}

static void open_item(areq *r, int kind, const char *prefix)
{
    close_item(r);
    new_item_id(r->item_id, sizeof r->item_id, prefix);
    r->nblocks++;
    r->open_kind = kind;
    r->item_text.n = 0;
}

void shoal__api_resp_head(areq *r)
{
    ev(r, "response.created", json_pack("{s:o}", "response", response_obj(r, "in_progress", json_array(), NULL)));
    ev(r, "response.in_progress", json_pack("{s:o}", "response", response_obj(r, "in_progress", json_array(), NULL)));
}

void shoal__api_resp_text(areq *r, shoal_channel ch, const char *t, size_t n)
{
    int kind = ch == SHOAL_CH_REASONING ? 0 : 1;
    if (r->open_kind != kind) {
        open_item(r, kind, kind == 0 ? "rs_" : "msg_");
        int oi = out_index(r);
        if (kind == 0) {
            ev(r, "response.output_item.added",
               json_pack("{s:i,s:{s:s,s:s,s:[],s:[],s:s}}", "output_index", oi, "item", "id", r->item_id, "type",
                         "reasoning", "summary", "content", "status", "in_progress"));
            ev(r, "response.content_part.added",
               json_pack("{s:s,s:i,s:i,s:{s:s,s:s}}", "item_id", r->item_id, "output_index", oi, "content_index", 0,
                         "part", "type", "reasoning_text", "text", ""));
        } else {
            ev(r, "response.output_item.added",
               json_pack("{s:i,s:{s:s,s:s,s:s,s:s,s:[]}}", "output_index", oi, "item", "id", r->item_id, "type",
                         "message", "status", "in_progress", "role", "assistant", "content"));
            ev(r, "response.content_part.added",
               json_pack("{s:s,s:i,s:i,s:{s:s,s:s,s:[],s:[]}}", "item_id", r->item_id, "output_index", oi,
                         "content_index", 0, "part", "type", "output_text", "text", "", "annotations", "logprobs"));
        }
    }
    shoal_sbuf_add(&r->item_text, t, n);
    if (kind == 0)
        ev(r, "response.reasoning_text.delta", json_pack("{s:s,s:i,s:i,s:o}", "item_id", r->item_id, "output_index",
                                                         out_index(r), "content_index", 0, "delta",
                                                         shoal__api_jstr(t, n)));
    else
        ev(r, "response.output_text.delta", json_pack("{s:s,s:i,s:i,s:o,s:[]}", "item_id", r->item_id, "output_index",
                                                      out_index(r), "content_index", 0, "delta", shoal__api_jstr(t, n),
                                                      "logprobs"));
}

void shoal__api_resp_tool(areq *r, const shoal_ev *e)
{
    tcall *c = shoal__api_call_at(&r->ch[0], e->tool_index);
    if (e->name) {
        if (!c->name)
            c->name = shoal_xstrdup(e->name);
        open_item(r, 2, "fc_");
        ev(r, "response.output_item.added",
           json_pack("{s:i,s:o}", "output_index", out_index(r), "item", call_item(r->item_id, c, "", 0, "in_progress")));
    }
    if (e->len) {
        shoal_sbuf_add(&r->item_text, e->text, e->len);
        ev(r, "response.function_call_arguments.delta",
           json_pack("{s:s,s:i,s:o}", "item_id", r->item_id, "output_index", out_index(r), "delta",
                     shoal__api_jstr(e->text, e->len)));
    }
}

void shoal__api_resp_done(areq *r, const shoal_ev *e)
{
    close_item(r);
    keep_conversation(r, r->items);
    int incomplete = !strcmp(e->finish, "length");
    json_t *o = response_obj(r, incomplete ? "incomplete" : "completed", json_incref(r->items), e);
    ev(r, incomplete ? "response.incomplete" : "response.completed", json_pack("{s:o}", "response", o));
}

void shoal__api_resp_stream_error(areq *r, const shoal_api_error *e)
{
    ev(r, "error", json_pack("{s:o,s:o,s:o}", "code", shoal__api_jstr(e->code, strlen(e->code)), "message",
                             shoal__api_jstr(e->message, strlen(e->message)), "param",
                             e->param[0] ? shoal__api_jstr(e->param, strlen(e->param)) : json_null()));
}
