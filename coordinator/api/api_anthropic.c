/* Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) as a
 * translation onto the chat pipeline: the body becomes an OpenAI chat body
 * (system -> a system message, content blocks -> messages, tool_use ->
 * tool_calls, tool_result -> tool messages, thinking blocks ->
 * reasoning_content), which the one chat validator (shoal_api_parse) turns
 * into shoal_gen_params; the job's events are then written as Anthropic
 * content blocks and events. So batching, reuse, the memo, cancellation and
 * metrics are the chat path's. Fields and their mapping: docs/API.md. Runs on
 * the HTTP loop thread (api_int.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/utf8.h"
#include "coordinator/api/api_int.h"

/* Anthropic's error object has no code: the one it maps to is 404's
 * not_found, every other status's invalid_request_error */
#define fail(e, status, param, ...)                                                                       \
    shoal__api_fail(e, status, (status) == 404 ? "not_found" : "invalid_request_error", param, __VA_ARGS__)


/* Fields of the Messages API this server implements; every other key goes
 * through the one unknown-field policy (shoal_api_check_fields: a known
 * field that would change the output is refused, anything else is accepted,
 * ignored and named in x-shoal-ignored -- service_tier, container,
 * cache_control, ...). */
static const char *const implemented[] = {"model", "messages", "max_tokens", "system", "stop_sequences",
                                          "stream", "temperature", "top_p", "top_k", "tools", "tool_choice",
                                          "thinking", "metadata", "output_config", "mcp_servers",
                                          "logit_bias", "seed", NULL}; /* logit_bias, seed: shoal extensions, as on chat */
static const char *const thinking_used[] = {"type", NULL}; /* budget_tokens, display: ignored (no budget in K3) */
static const char *const tool_choice_used[] = {"type", "name", "disable_parallel_tool_use", NULL};

/* The text of a string or an array of text blocks ("where" names it); other
 * block types are refused (a text-only engine). Appends to *out. */
static int text_of(json_t *v, const char *where, shoal_sbuf *out, shoal_api_error *err)
{
    if (json_is_string(v)) {
        shoal_sbuf_add(out, json_string_value(v), json_string_length(v));
        return 0;
    }
    if (!json_is_array(v))
        return fail(err, 400, where, "'%s' must be a string or an array of text blocks", where);
    size_t i;
    json_t *b;
    json_array_foreach(v, i, b) {
        char p[160];
        snprintf(p, sizeof p, "%s[%zu]", where, i);
        json_t *t = json_is_object(b) ? json_object_get(b, "type") : NULL;
        if (!json_is_string(t))
            return fail(err, 400, p, "'%s.type' must be a string", p);
        if (strcmp(json_string_value(t), "text")) {
            char q[40];
            return fail(err, 400, p, "'%s' is a '%s' block; only text is supported here (a text-only model)", p,
                        QUOTE(q, json_string_value(t)));
        }
        json_t *x = json_object_get(b, "text");
        if (!json_is_string(x))
            return fail(err, 400, p, "'%s.text' must be a string", p);
        if (i)
            shoal_sbuf_add(out, "\n", 1);
        shoal_sbuf_add(out, json_string_value(x), json_string_length(x));
    }
    return 0;
}

/* One Anthropic message -> chat messages appended to out. A user message's
 * tool_result blocks become tool messages (before its text, as Anthropic
 * requires them first); an assistant message's thinking -> reasoning_content,
 * tool_use -> tool_calls (input as JSON text). */
static int one_message(json_t *m, size_t idx, json_t *out, shoal_api_error *err)
{
    char where[48], p[96];
    snprintf(where, sizeof where, "messages[%zu]", idx);
    if (!json_is_object(m))
        return fail(err, 400, where, "'%s' must be an object", where);
    json_t *role = json_object_get(m, "role");
    snprintf(p, sizeof p, "%s.role", where);
    if (!json_is_string(role))
        return fail(err, 400, p, "'%s' must be a string", p);
    const char *r = json_string_value(role);
    int user = !strcmp(r, "user"), asst = !strcmp(r, "assistant");
    if (!user && !asst) {
        char q[36];
        return fail(err, 400, p, "'%s' is '%s'; it must be 'user' or 'assistant' (the system prompt goes in 'system')",
                    p, QUOTE(q, r));
    }
    json_t *content = json_object_get(m, "content");
    snprintf(p, sizeof p, "%s.content", where);
    if (json_is_string(content)) {
        json_array_append_new(out, json_pack("{s:s,s:O}", "role", r, "content", content));
        return 0;
    }
    if (!json_is_array(content))
        return fail(err, 400, p, "'%s' must be a string or an array of content blocks", p);
    shoal_sbuf text = {0}, think = {0};
    json_t *calls = json_array();
    json_t *tools = json_array();
    int ntext = 0, rc = 0;
    size_t i;
    json_t *b;
    json_array_foreach(content, i, b) {
        char bp[160];
        snprintf(bp, sizeof bp, "%s[%zu]", p, i);
        json_t *t = json_is_object(b) ? json_object_get(b, "type") : NULL;
        if (!json_is_string(t)) {
            rc = fail(err, 400, bp, "'%s' must be a content block with a string 'type'", bp);
            break;
        }
        const char *ty = json_string_value(t);
        if (!strcmp(ty, "text")) {
            json_t *x = json_object_get(b, "text");
            if (!json_is_string(x)) {
                rc = fail(err, 400, bp, "'%s.text' must be a string", bp);
                break;
            }
            if (ntext++)
                shoal_sbuf_add(&text, "\n", 1);
            shoal_sbuf_add(&text, json_string_value(x), json_string_length(x));
        } else if (asst && !strcmp(ty, "thinking")) {
            json_t *x = json_object_get(b, "thinking");
            if (!json_is_string(x)) {
                rc = fail(err, 400, bp, "'%s.thinking' must be a string", bp);
                break;
            }
            shoal_sbuf_add(&think, json_string_value(x), json_string_length(x));
        } else if (asst && !strcmp(ty, "redacted_thinking")) {
            /* opaque to this server (it never issues one): nothing to render */
        } else if (asst && !strcmp(ty, "tool_use")) {
            json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name"),
                   *input = json_object_get(b, "input");
            if (!json_is_string(id) || !json_is_string(name) || !json_is_object(input)) {
                rc = fail(err, 400, bp, "'%s' must have a string 'id', a string 'name' and an object 'input'", bp);
                break;
            }
            char *args = json_dumps(input, JSON_COMPACT);
            if (!args) {
                rc = fail(err, 400, bp, "'%s.input' could not be serialised", bp);
                break;
            }
            json_array_append_new(calls, json_pack("{s:O,s:s,s:{s:O,s:s}}", "id", id, "type", "function",
                                                   "function", "name", name, "arguments", args));
            free(args);
        } else if (user && !strcmp(ty, "tool_result")) {
            json_t *id = json_object_get(b, "tool_use_id"), *c = json_object_get(b, "content"),
                   *ie = json_object_get(b, "is_error");
            if (!json_is_string(id)) {
                rc = fail(err, 400, bp, "'%s.tool_use_id' must be a string", bp);
                break;
            }
            if (!shoal__api_absent(ie) && !json_is_boolean(ie)) {
                rc = fail(err, 400, bp, "'%s.is_error' must be a boolean", bp);
                break;
            }
            shoal_sbuf res = {0};
            /* K3's tool message has no error flag: a failed call's result
             * says so in its text (docs/API.md) */
            if (json_is_true(ie))
                shoal_sbuf_add(&res, "Error: ", 7);
            char cp[200];
            snprintf(cp, sizeof cp, "%s.content", bp);
            if (!shoal__api_absent(c) && text_of(c, cp, &res, err)) {
                free(res.p);
                rc = -1;
                break;
            }
            json_array_append_new(tools, json_pack("{s:s,s:O,s:o}", "role", "tool", "tool_call_id", id, "content",
                                                   shoal__api_sbuf_json(&res)));
            free(res.p);
        } else {
            char q[40];
            rc = fail(err, 400, bp, "'%s' is a '%s' block, which %s messages cannot carry here%s", bp,
                      QUOTE(q, ty), r,
                      !strcmp(ty, "image") || !strcmp(ty, "document") ? " (a text-only model)" : "");
            break;
        }
    }
    if (rc == 0) {
        if (user) {
            json_array_extend(out, tools);
            if (ntext || json_array_size(tools) == 0)
                json_array_append_new(out,
                                      json_pack("{s:s,s:o}", "role", "user", "content", shoal__api_sbuf_json(&text)));
        } else {
            json_t *am = json_pack("{s:s}", "role", "assistant");
            json_object_set_new(am, "content",
                                ntext || !json_array_size(calls) ? shoal__api_sbuf_json(&text) : json_null());
            if (think.n)
                json_object_set_new(am, "reasoning_content", shoal__api_sbuf_json(&think));
            if (json_array_size(calls))
                json_object_set(am, "tool_calls", calls);
            json_array_append_new(out, am);
        }
    }
    json_decref(calls);
    json_decref(tools);
    free(text.p);
    free(think.p);
    return rc;
}

/* The Anthropic body -> an OpenAI chat body (a trailing assistant message
 * becomes a partial one, continued); fields accepted and ignored go to *ign.
 * counting: count_tokens (max_tokens optional). */
static int translate(shoal_api *a, json_t *root, int counting, json_t **chat_out, shoal_api_ignored *ign,
                     shoal_api_error *err)
{
    *chat_out = NULL;
    if (!json_is_object(root))
        return fail(err, 400, "body", "the body must be a JSON object");
    json_t *mcp = json_object_get(root, "mcp_servers");
    if (!(shoal__api_absent(mcp) || (json_is_array(mcp) && json_array_size(mcp) == 0))) /* remote tools: not run here */
        return fail(err, 400, "mcp_servers", "mcp_servers: MCP connectors are not supported by this server");
    if (shoal_api_check_fields(root, "", implemented, ign, err))
        return -1;
    json_t *model = json_object_get(root, "model");
    if (!json_is_string(model))
        return fail(err, 400, "model", "'model' is required (a string)");
    if (strcmp(json_string_value(model), a->model_name)) {
        char q[68];
        return fail(err, 404, "model", "model: %s (this server serves '%s')", QUOTE(q, json_string_value(model)),
                    a->model_name);
    }
    json_t *mt = json_object_get(root, "max_tokens");
    if (!counting && shoal__api_absent(mt))
        return fail(err, 400, "max_tokens", "max_tokens: Field required");
    if (!shoal__api_absent(mt) && (!json_is_integer(mt) || json_integer_value(mt) < 1))
        return fail(err, 400, "max_tokens", "max_tokens: must be an integer of at least 1");
    json_t *chat = json_pack("{s:O}", "model", model);
    if (!counting)
        json_object_set(chat, "max_tokens", mt);
    const char *copy[] = {"temperature", "top_p", "top_k", "stream", "logit_bias", "seed"};
    for (size_t i = 0; i < sizeof copy / sizeof copy[0]; i++)
        if (!shoal__api_absent(json_object_get(root, copy[i])) && !(counting && !strcmp(copy[i], "stream")))
            json_object_set(chat, copy[i], json_object_get(root, copy[i]));
    json_t *ss = json_object_get(root, "stop_sequences");
    if (!shoal__api_absent(ss)) {
        if (!json_is_array(ss)) {
            json_decref(chat);
            return fail(err, 400, "stop_sequences", "'stop_sequences' must be an array of strings");
        }
        if (json_array_size(ss) > SHOAL_MAX_STOP) {
            json_decref(chat);
            return fail(err, 400, "stop_sequences", "'stop_sequences' accepts at most %d strings on this server",
                        SHOAL_MAX_STOP);
        }
        if (json_array_size(ss))
            json_object_set(chat, "stop", ss);
    }
    json_t *md = json_object_get(root, "metadata");
    if (!shoal__api_absent(md)) {
        json_t *uid = json_is_object(md) ? json_object_get(md, "user_id") : NULL;
        if (!json_is_object(md) || (!shoal__api_absent(uid) && !json_is_string(uid))) {
            json_decref(chat);
            return fail(err, 400, "metadata", "'metadata' must be an object with an optional string 'user_id'");
        }
        if (json_is_string(uid))
            json_object_set(chat, "user", uid);
    }
    /* messages */
    json_t *msgs = json_array();
    json_object_set_new(chat, "messages", msgs);
    json_t *sys = json_object_get(root, "system");
    if (!shoal__api_absent(sys)) {
        shoal_sbuf t = {0};
        if (text_of(sys, "system", &t, err)) {
            free(t.p);
            json_decref(chat);
            return -1;
        }
        if (t.n)
            json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "system", "content", shoal__api_sbuf_json(&t)));
        free(t.p);
    }
    json_t *in = json_object_get(root, "messages");
    if (!json_is_array(in) || json_array_size(in) == 0) {
        json_decref(chat);
        return fail(err, 400, "messages", "'messages' is required: a non-empty array");
    }
    size_t n = json_array_size(in);
    json_t *last = json_array_get(in, n - 1);
    int prefilled = json_is_object(last) && json_is_string(json_object_get(last, "role")) &&
                    !strcmp(json_string_value(json_object_get(last, "role")), "assistant");
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(in, i);
        if (prefilled && i == n - 1) {
            /* prefill: the answer starts with this text and continues it
             * (the chat path's partial mode: the response element is left
             * open, no generation prompt) */
            shoal_sbuf t = {0};
            char p[48];
            snprintf(p, sizeof p, "messages[%zu].content", i);
            if (text_of(json_object_get(m, "content"), p, &t, err)) {
                free(t.p);
                json_decref(chat);
                return -1;
            }
            json_array_append_new(msgs, json_pack("{s:s,s:o,s:b}", "role", "assistant", "content",
                                                  shoal__api_sbuf_json(&t), "partial", 1));
            free(t.p);
            continue;
        }
        if (one_message(m, i, msgs, err)) {
            json_decref(chat);
            return -1;
        }
    }
    if (json_array_size(msgs) == 0 || (prefilled && n == 1)) {
        json_decref(chat);
        return fail(err, 400, "messages", "'messages' must hold a user message first");
    }
    /* tools */
    json_t *tools = json_object_get(root, "tools");
    if (!shoal__api_absent(tools)) {
        if (!json_is_array(tools)) {
            json_decref(chat);
            return fail(err, 400, "tools", "'tools' must be an array");
        }
        json_t *ct = json_array();
        json_object_set_new(chat, "tools", ct);
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            char p[48];
            snprintf(p, sizeof p, "tools[%zu]", i);
            json_t *ty = json_is_object(t) ? json_object_get(t, "type") : NULL;
            json_t *name = json_is_object(t) ? json_object_get(t, "name") : NULL;
            json_t *schema = json_is_object(t) ? json_object_get(t, "input_schema") : NULL;
            json_t *desc = json_is_object(t) ? json_object_get(t, "description") : NULL;
            int bad = 0;
            if (!json_is_object(t))
                bad = fail(err, 400, p, "'%s' must be an object", p);
            else if (!shoal__api_absent(ty) && !(json_is_string(ty) && !strcmp(json_string_value(ty), "custom"))) {
                char q[48];
                bad = fail(err, 400, p,
                           "'%s' is a server tool ('%s'); this server runs client tools only (no 'type', or 'custom')",
                           p, json_is_string(ty) ? QUOTE(q, json_string_value(ty)) : "?");
            } else if (!json_is_string(name))
                bad = fail(err, 400, p, "'%s.name' must be a string", p);
            else if (!json_is_object(schema))
                bad = fail(err, 400, p, "'%s.input_schema' must be an object (JSON Schema)", p);
            else if (!shoal__api_absent(desc) && !json_is_string(desc))
                bad = fail(err, 400, p, "'%s.description' must be a string", p);
            if (bad) {
                json_decref(chat);
                return -1;
            }
            json_t *fn = json_pack("{s:O,s:O}", "name", name, "parameters", schema);
            if (json_is_string(desc))
                json_object_set(fn, "description", desc);
            json_array_append_new(ct, json_pack("{s:s,s:o}", "type", "function", "function", fn));
        }
    }
    json_t *tc = json_object_get(root, "tool_choice");
    if (!shoal__api_absent(tc)) {
        json_t *ty = json_is_object(tc) ? json_object_get(tc, "type") : NULL;
        const char *s = json_is_string(ty) ? json_string_value(ty) : "";
        if (shoal_api_check_fields(tc, "tool_choice", tool_choice_used, ign, err)) {
            json_decref(chat);
            return -1;
        }
        json_t *dp = json_object_get(tc, "disable_parallel_tool_use");
        if (!shoal__api_absent(dp) && !json_is_boolean(dp)) {
            json_decref(chat);
            return fail(err, 400, "tool_choice.disable_parallel_tool_use",
                        "'tool_choice.disable_parallel_tool_use' must be a boolean");
        }
        if (json_is_true(dp))
            json_object_set_new(chat, "parallel_tool_calls", json_false());
        if (!strcmp(s, "auto"))
            json_object_set_new(chat, "tool_choice", json_string("auto"));
        else if (!strcmp(s, "any"))
            json_object_set_new(chat, "tool_choice", json_string("required"));
        else if (!strcmp(s, "none"))
            json_object_set_new(chat, "tool_choice", json_string("none"));
        else if (!strcmp(s, "tool") && json_is_string(json_object_get(tc, "name")))
            json_object_set_new(chat, "tool_choice", json_pack("{s:s,s:{s:O}}", "type", "function", "function", "name",
                                                               json_object_get(tc, "name")));
        else {
            json_decref(chat);
            return fail(err, 400, "tool_choice",
                        "'tool_choice' must be {type: auto | any | none} or {type: tool, name}");
        }
    }
    /* output_config: effort -> K3's thinking effort, format -> K3's
     * response-format message (as response_format on the chat path) */
    json_t *oc = json_object_get(root, "output_config");
    if (!shoal__api_absent(oc)) {
        json_t *ef = json_is_object(oc) ? json_object_get(oc, "effort") : NULL;
        json_t *fm = json_is_object(oc) ? json_object_get(oc, "format") : NULL;
        int bad = !json_is_object(oc) || (!shoal__api_absent(ef) && !json_is_string(ef));
        if (!bad && !shoal__api_absent(fm)) {
            json_t *ft = json_is_object(fm) ? json_object_get(fm, "type") : NULL;
            bad = !json_is_string(ft) || strcmp(json_string_value(ft), "json_schema") ||
                  !json_is_object(json_object_get(fm, "schema"));
            if (!bad)
                json_object_set_new(chat, "response_format",
                                    json_pack("{s:s,s:{s:s,s:O}}", "type", "json_schema", "json_schema", "name",
                                              "output", "schema", json_object_get(fm, "schema")));
        }
        if (bad) {
            json_decref(chat);
            return fail(err, 400, "output_config",
                        "output_config must be {effort?: low|medium|high|xhigh|max, format?: {type: json_schema, "
                        "schema}}");
        }
        if (!shoal__api_absent(ef))
            json_object_set(chat, "reasoning_effort", ef);
    }
    /* thinking: K3's switch (enabled / adaptive / between_tools: on;
     * disabled: off). Absent: K3's default (on), except with a prefill,
     * which continues the answer itself (thinking off). */
    json_t *th = json_object_get(root, "thinking");
    int thinking = !prefilled;
    if (!shoal__api_absent(th)) {
        json_t *ty = json_is_object(th) ? json_object_get(th, "type") : NULL;
        const char *s = json_is_string(ty) ? json_string_value(ty) : "";
        json_t *bt = json_object_get(th, "budget_tokens");
        int on = !strcmp(s, "enabled") || !strcmp(s, "adaptive") || !strcmp(s, "between_tools");
        if (shoal_api_check_fields(th, "thinking", thinking_used, ign, err)) {
            json_decref(chat);
            return -1;
        }
        if (!strcmp(s, "disabled")) {
            thinking = 0;
        } else if (on) {
            if (!strcmp(s, "enabled") && (!json_is_integer(bt) || json_integer_value(bt) < 1)) {
                json_decref(chat);
                return fail(err, 400, "thinking.budget_tokens",
                            "thinking.budget_tokens: an integer is required when thinking is enabled");
            }
            if (prefilled) {
                json_decref(chat);
                return fail(err, 400, "thinking",
                            "thinking cannot be enabled with a final assistant message (a prefill continues the "
                            "answer itself)");
            }
            /* K3 has no thinking budget (its reasoning ends when it ends):
             * budget_tokens is listed as ignored above */
            thinking = 1;
        } else {
            json_decref(chat);
            return fail(err, 400, "thinking.type",
                        "thinking.type must be 'enabled', 'adaptive', 'between_tools' or 'disabled'");
        }
    }
    if (!thinking && json_object_get(chat, "reasoning_effort"))
        json_object_del(chat, "reasoning_effort"); /* K3's effort only matters when it thinks */
    json_object_set_new(chat, "thinking", json_pack("{s:s}", "type", thinking ? "enabled" : "disabled"));
    *chat_out = chat;
    return 0;
}

/* The chat validator's errors name chat fields; most Anthropic fields were
 * checked under their own names before, so what reaches here is rare (a tool
 * name, a range). */
static int parse(shoal_api *a, const shoal_http_request *req, int counting, shoal_api_req *q, shoal_api_error *err)
{
    memset(err, 0, sizeof *err);
    memset(q, 0, sizeof *q);
    json_error_t je;
    json_t *root = json_loadb(req->body, req->body_len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        char qt[124];
        return fail(err, 400, "", "the body is not valid JSON: %s (line %d, column %d)", QUOTE(qt, je.text),
                    je.line, je.column);
    }
    json_t *chat;
    shoal_api_ignored ign = {0};
    int rc = translate(a, root, counting, &chat, &ign, err);
    json_decref(root);
    if (rc)
        return -1;
    char *body = json_dumps(chat, JSON_COMPACT);
    json_decref(chat);
    if (!body)
        return fail(err, 500, "", "the request could not be translated");
    rc = shoal_api_parse(SHOAL_GEN_CHAT, body, strlen(body), &a->o.limits, q, err);
    free(body);
    if (rc)
        return -1;
    for (int i = 0; i < ign.n; i++) /* the Anthropic fields ignored, with the chat body's (none) */
        shoal_api_ignored_add(&q->ignored, ign.name[i], ign.known[i]);
    q->ignored.dropped += ign.dropped;
    return 0;
}

static void ignored_header(char *buf, size_t cap, const shoal_api_ignored *ign)
{
    char list[512];
    shoal_api_ignored_list(ign, list, sizeof list);
    buf[0] = '\0';
    if (list[0])
        snprintf(buf, cap, "x-shoal-ignored: %s\r\n", list);
}

/* /v1/messages and count_tokens: parsed (and, for count_tokens, rendered) on
 * the HTTP layer's thread pool (shoal__api_defer), answered on the loop. */
typedef struct {
    int counting, rc, ntok, trc;
    shoal_api_req q;
    shoal_api_error err;
    char msg[320];
} anth_job;

static void anth_work(shoal__api_deferred *d)
{
    anth_job *j = d->ctx;
    j->rc = parse(d->a, &d->req, j->counting, &j->q, &j->err);
    if (!j->rc && j->counting) /* the tokenizer only: any thread */
        j->trc = shoal_sched_prompt_tokens(d->a->o.sched, &j->q.gen, &j->ntok, j->msg, sizeof j->msg);
}

static void messages_done(shoal__api_deferred *d)
{
    anth_job *j = d->ctx;
    shoal_api *a = d->a;
    shoal_http_ex *ex = d->ex;
    int have_q = d->ran && !j->rc;
    if (ex && d->ran && j->rc) {
        shoal__api_respond_error(a, ex, EP_MESSAGES, &j->err, NULL);
    } else if (ex && have_q && !shoal__api_not_ready(a, ex, EP_MESSAGES)) {
        areq *r = shoal__api_areq_new(a, ex, EP_MESSAGES, FMT_ANTHROPIC, &j->q, "msg_");
        for (int i = 0; i < j->q.gen.nstop; i++)
            r->stops[r->nstop++] = shoal_xstrdup(j->q.gen.stop[i]);
        shoal__api_start(r, &j->q); /* takes q */
        have_q = 0;
    }
    if (have_q)
        shoal_api_req_free(&j->q);
    free(j);
}

void shoal__api_anth_messages(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req)
{
    anth_job *j = shoal_xcalloc(1, sizeof *j);
    shoal__api_defer(a, ex, req, EP_MESSAGES, anth_work, messages_done, j);
}

static void count_done(shoal__api_deferred *d)
{
    anth_job *j = d->ctx;
    shoal_api *a = d->a;
    shoal_http_ex *ex = d->ex;
    if (ex && d->ran && j->rc) {
        shoal__api_respond_error(a, ex, EP_COUNT_TOKENS, &j->err, NULL);
    } else if (ex && d->ran) {
        char extra[600];
        ignored_header(extra, sizeof extra, &j->q.ignored);
        shoal__api_count_ignored(a, &j->q.ignored);
        if (j->trc) {
            fail(&j->err, j->trc == SHOAL_EINTERNAL ? 500 : 400, "messages", "%s", j->msg);
            shoal__api_respond_error(a, ex, EP_COUNT_TOKENS, &j->err, extra[0] ? extra : NULL);
        } else {
            shoal__api_respond_json(a, ex, EP_COUNT_TOKENS, 200, json_pack("{s:i}", "input_tokens", j->ntok),
                                    extra[0] ? extra : NULL);
        }
    }
    if (d->ran && !j->rc)
        shoal_api_req_free(&j->q);
    free(j);
}

void shoal__api_anth_count_tokens(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req)
{
    anth_job *j = shoal_xcalloc(1, sizeof *j);
    j->counting = 1;
    shoal__api_defer(a, ex, req, EP_COUNT_TOKENS, anth_work, count_done, j);
}

/* ---- responses -------------------------------------------------------------- */

static json_t *usage(const areq *r, int output_tokens)
{
    int cached = r->memo == 2 ? 0 : r->reused_tokens;
    return json_pack("{s:i,s:i,s:i,s:i}", "input_tokens", r->prompt_tokens - cached, "output_tokens", output_tokens,
                     "cache_read_input_tokens", cached, "cache_creation_input_tokens", 0);
}

static void stop_reason(const areq *r, const shoal_ev *e, json_t *obj)
{
    const char *why = "end_turn";
    json_t *seq = json_null();
    if (!strcmp(e->finish, "length"))
        why = "max_tokens";
    else if (!strcmp(e->finish, "tool_calls"))
        why = "tool_use";
    else if (e->stop_index >= 0 && e->stop_index < r->nstop) {
        why = "stop_sequence";
        seq = json_string(r->stops[e->stop_index]);
    }
    json_object_set_new(obj, "stop_reason", json_string(why));
    json_object_set_new(obj, "stop_sequence", seq);
}

/* A tool call's arguments as the object Anthropic's "input" is; text that is
 * not a JSON object (a malformed call) is kept under "_raw_arguments". */
static json_t *tool_input(const char *args, size_t n)
{
    json_t *v = n ? json_loadb(args, n, 0, NULL) : json_object();
    if (json_is_object(v))
        return v;
    json_decref(v);
    return json_pack("{s:o}", "_raw_arguments", shoal__api_jstr(args, n));
}

void shoal__api_anth_full(areq *r, const shoal_ev *e)
{
    const achoice *c = &r->ch[0];
    json_t *content = json_array();
    if (c->reasoning.n)
        json_array_append_new(content, json_pack("{s:s,s:o,s:s}", "type", "thinking", "thinking",
                                                 shoal__api_jstr(c->reasoning.p, c->reasoning.n), "signature", ""));
    if (c->content.n || (!c->reasoning.n && !c->ncalls))
        json_array_append_new(content,
                              json_pack("{s:s,s:o}", "type", "text", "text", shoal__api_jstr(c->content.p, c->content.n)));
    for (int i = 0; i < c->ncalls; i++)
        json_array_append_new(content, json_pack("{s:s,s:s,s:o,s:o}", "type", "tool_use", "id", c->calls[i].id, "name",
                                                 shoal__api_jstr(c->calls[i].name, c->calls[i].name ? strlen(c->calls[i].name) : 0),
                                                 "input", tool_input(c->calls[i].args.p, c->calls[i].args.n)));
    json_t *m = json_pack("{s:s,s:s,s:s,s:s,s:o}", "id", r->id, "type", "message", "role", "assistant", "model",
                          r->api->model_name, "content", content);
    stop_reason(r, e, m);
    json_object_set_new(m, "usage", usage(r, e->completion_tokens));
    char extra[1024];
    shoal__api_extra_headers(r, extra, sizeof extra);
    shoal__api_respond_json(r->api, r->ex, r->ep, 200, m, extra);
}

/* ---- streaming: Anthropic's event sequence ---------------------------------- */

static void ev(areq *r, const char *type, json_t *obj)
{
    json_object_set_new(obj, "type", json_string(type));
    shoal__api_sse(r, type, obj);
}

static void close_block(areq *r)
{
    if (r->open_kind < 0)
        return;
    ev(r, "content_block_stop", json_pack("{s:i}", "index", r->nblocks - 1));
    r->open_kind = -1;
}

static void open_block(areq *r, int kind, json_t *block)
{
    close_block(r);
    ev(r, "content_block_start", json_pack("{s:i,s:o}", "index", r->nblocks, "content_block", block));
    r->nblocks++;
    r->open_kind = kind;
}

void shoal__api_anth_head(areq *r)
{
    json_t *m = json_pack("{s:s,s:s,s:s,s:s,s:[],s:n,s:n}", "id", r->id, "type", "message", "role", "assistant",
                          "model", r->api->model_name, "content", "stop_reason", "stop_sequence");
    json_object_set_new(m, "usage", usage(r, 0));
    ev(r, "message_start", json_pack("{s:o}", "message", m));
    ev(r, "ping", json_object());
}

void shoal__api_anth_text(areq *r, shoal_channel ch, const char *t, size_t n)
{
    int kind = ch == SHOAL_CH_REASONING ? 0 : 1;
    if (r->open_kind != kind)
        open_block(r, kind,
                   kind == 0 ? json_pack("{s:s,s:s,s:s}", "type", "thinking", "thinking", "", "signature", "")
                             : json_pack("{s:s,s:s}", "type", "text", "text", ""));
    json_t *d = kind == 0 ? json_pack("{s:s,s:o}", "type", "thinking_delta", "thinking", shoal__api_jstr(t, n))
                          : json_pack("{s:s,s:o}", "type", "text_delta", "text", shoal__api_jstr(t, n));
    ev(r, "content_block_delta", json_pack("{s:i,s:o}", "index", r->nblocks - 1, "delta", d));
}

void shoal__api_anth_tool(areq *r, const shoal_ev *e)
{
    tcall *c = shoal__api_call_at(&r->ch[0], e->tool_index);
    if (e->name)
        open_block(r, 2, json_pack("{s:s,s:s,s:o,s:{}}", "type", "tool_use", "id", c->id, "name",
                                   shoal__api_jstr(e->name, strlen(e->name)), "input"));
    if (e->len)
        ev(r, "content_block_delta",
           json_pack("{s:i,s:{s:s,s:o}}", "index", r->nblocks - 1, "delta", "type", "input_json_delta", "partial_json",
                     shoal__api_jstr(e->text, e->len)));
}

void shoal__api_anth_done(areq *r, const shoal_ev *e)
{
    close_block(r);
    json_t *d = json_object();
    stop_reason(r, e, d);
    ev(r, "message_delta", json_pack("{s:o,s:o}", "delta", d, "usage", usage(r, e->completion_tokens)));
    ev(r, "message_stop", json_object());
}

void shoal__api_anth_stream_error(areq *r, const shoal_api_error *e)
{
    shoal__api_sse(r, "error", shoal__api_error_json(EP_MESSAGES, e));
}
