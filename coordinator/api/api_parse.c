/* API request validation (shoal_api_parse): the body of /v1/chat/completions
 * or /v1/completions becomes a shoal_api_req, or an OpenAI error naming the
 * offending field. Pure: no I/O, no globals, so the fuzz target drives it
 * directly. Messages are normalised here (content parts joined, "developer"
 * read as "system") so the chat encoder sees one shape. */
#include <math.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"
#include "coordinator/api/api_int.h"
#include "coordinator/text/text.h"

#define fail shoal__api_fail
int shoal__api_fail(shoal_api_error *e, int status, const char *code, const char *param, const char *fmt, ...)
{
    e->status = status;
    snprintf(e->type, sizeof e->type, "%s", status == 401 ? "authentication_error" : "invalid_request_error");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    /* the param and the message may carry the client's text: both go
     * through the clean copy, so they are valid UTF-8 (JSON) whatever was
     * sent and wherever the buffer cuts them */
    shoal_utf8_clip(e->param, sizeof e->param, param ? param : "", 0);
    char msg[sizeof e->message * 2];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    shoal_utf8_clean(e->message, sizeof e->message, msg, strlen(msg), 0, NULL);
    return -1;
}

/* A field path ("messages[2].content"); cut rather than overflow. */
static void pname(char *dst, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void pname(char *dst, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}

#define BAD(param, ...) fail(err, 400, "invalid_request_error", param, __VA_ARGS__)
#define BADTYPE(param, want) fail(err, 400, "invalid_type", param, "'%s' must be %s", param, want)
#define UNSUPPORTED(param, ...) fail(err, 400, "unsupported_value", param, __VA_ARGS__)

void shoal_gen_params_free(shoal_gen_params *p)
{
    json_decref(p->messages);
    json_decref(p->tools);
    json_decref(p->tool_choice);
    json_decref(p->response_format);
    json_decref(p->constraint);
    free(p->prompt);
    free(p->prompt_ids);
    free(p->bias);
    for (int i = 0; i < p->nstop; i++)
        free(p->stop[i]);
    memset(p, 0, sizeof *p);
}

int shoal_gen_params_copy(shoal_gen_params *d, const shoal_gen_params *p)
{
    *d = *p;
    json_incref(d->messages);
    json_incref(d->tools);
    json_incref(d->tool_choice);
    json_incref(d->response_format);
    json_incref(d->constraint);
    if (p->prompt) {
        d->prompt = shoal_xmalloc(p->prompt_len + 1);
        memcpy(d->prompt, p->prompt, p->prompt_len + 1);
    }
    if (p->prompt_ids) {
        d->prompt_ids = shoal_xmalloc((size_t)p->n_prompt_ids * sizeof *d->prompt_ids);
        memcpy(d->prompt_ids, p->prompt_ids, (size_t)p->n_prompt_ids * sizeof *d->prompt_ids);
    }
    if (p->bias) {
        d->bias = shoal_xmalloc((size_t)(p->nbias + 1) * sizeof *d->bias);
        memcpy(d->bias, p->bias, (size_t)p->nbias * sizeof *d->bias);
    }
    for (int i = 0; i < p->nstop; i++)
        d->stop[i] = shoal_xstrdup(p->stop[i]);
    return 0;
}

void shoal_api_req_free(shoal_api_req *r)
{
    shoal_gen_params_free(&r->gen);
    free(r->memo_key);
    memset(r, 0, sizeof *r);
}

/* ---- field helpers ------------------------------------------------------ */

static int is_null_or_absent(const json_t *v)
{
    return !v || json_is_null(v);
}

static int get_bool(const json_t *root, const char *key, int *out, shoal_api_error *err)
{
    json_t *v = json_object_get(root, key);
    if (is_null_or_absent(v))
        return 0;
    if (!json_is_boolean(v))
        return BADTYPE(key, "a boolean");
    *out = json_is_true(v);
    return 0;
}

/* An integer field in [lo, hi]; absent/null leaves *out. */
static int get_int(const json_t *root, const char *key, long long lo, long long hi, long long *out, int *present,
                   shoal_api_error *err)
{
    json_t *v = json_object_get(root, key);
    if (present)
        *present = 0;
    if (is_null_or_absent(v))
        return 0;
    if (!json_is_integer(v))
        return BADTYPE(key, "an integer");
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return BAD(key, "'%s' is %lld; it must be between %lld and %lld", key, x, lo, hi);
    *out = x;
    if (present)
        *present = 1;
    return 0;
}

/* The shortest %g spelling that reads back as exactly x (as Python's repr):
 * an error names the value the client sent, never a rounding of it
 * ("'top_p' is 1.0000001", not "is 1"). */
static const char *exact_g(char *buf, size_t n, double x)
{
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    return buf;
}

static int get_number(const json_t *root, const char *key, double lo, double hi, double *out, int *present,
                      shoal_api_error *err)
{
    json_t *v = json_object_get(root, key);
    if (present)
        *present = 0;
    if (is_null_or_absent(v))
        return 0;
    if (!json_is_number(v))
        return BADTYPE(key, "a number");
    double x = json_number_value(v);
    char xs[32];
    if (!isfinite(x) || x < lo || x > hi)
        return BAD(key, "'%s' is %s; it must be between %g and %g", key, exact_g(xs, sizeof xs, x), lo, hi);
    *out = x;
    if (present)
        *present = 1;
    return 0;
}

/* ---- the unknown-field policy (api.h) ----------------------------------- */

/* What each endpoint implements, per object. */
static const char *const chat_fields[] = {
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "n", "tools", "tool_choice", "reasoning_effort", "thinking",
    "thinking_effort", "chat_template_kwargs", "user", "logprobs", "top_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "response_format", "modalities", "return_token_ids",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar", "parallel_tool_calls", NULL};
static const char *const completion_fields[] = {
    "model", "prompt", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "n", "best_of", "echo", "suffix", "logprobs", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "user", "return_token_ids", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "grammar", NULL};
static const char *const message_fields[] = {"role", "content", "name", "tool_calls", "tool_call_id",
                                             "reasoning_content", "reasoning", "partial", "prefix", NULL};
static const char *const part_fields[] = {"type", "text", NULL};
static const char *const stream_options_fields[] = {"include_usage", NULL};
static const char *const tool_fields[] = {"type", "function", NULL};
static const char *const function_fields[] = {"name", "description", "parameters", "strict", NULL};
static const char *const thinking_fields[] = {"type", NULL};
static const char *const kwargs_fields[] = {"thinking", "thinking_effort", "reasoning_effort", NULL};

/* Fields of the known vocabularies that change the output and are not
 * implemented, with the value that changes nothing (accepted then, as
 * ignored). */
enum { NEUTRAL_NONE, NEUTRAL_FALSE, NEUTRAL_TRUE, NEUTRAL_ZERO, NEUTRAL_ONE, NEUTRAL_EMPTY };
static const struct {
    const char *name;
    int neutral; /* besides null, which is always neutral */
} refused_fields[] = {
    /* vLLM / SGLang structured output and sampling */
 {"guided_decoding_backend", NEUTRAL_EMPTY},
    {"guided_whitespace_pattern", NEUTRAL_EMPTY}, {"structured_outputs", NEUTRAL_EMPTY},
    {"structural_tag", NEUTRAL_EMPTY}, {"regex", NEUTRAL_EMPTY}, {"ebnf", NEUTRAL_EMPTY},
    {"json_schema", NEUTRAL_EMPTY}, {"logits_processors", NEUTRAL_EMPTY},
    {"bad_words", NEUTRAL_EMPTY}, {"allowed_token_ids", NEUTRAL_EMPTY}, {"stop_token_ids", NEUTRAL_EMPTY},
    {"min_tokens", NEUTRAL_ZERO}, {"ignore_eos", NEUTRAL_FALSE}, {"include_stop_str_in_output", NEUTRAL_FALSE},
    {"skip_special_tokens", NEUTRAL_TRUE}, {"spaces_between_special_tokens", NEUTRAL_TRUE},
    {"truncate_prompt_tokens", NEUTRAL_EMPTY}, {"prompt_logprobs", NEUTRAL_EMPTY},
    {"use_beam_search", NEUTRAL_FALSE}, {"length_penalty", NEUTRAL_ONE}, {"early_stopping", NEUTRAL_FALSE},
    {"continue_final_message", NEUTRAL_FALSE}, {"add_generation_prompt", NEUTRAL_TRUE},
    {"chat_template", NEUTRAL_EMPTY}, {"documents", NEUTRAL_EMPTY}, {"add_special_tokens", NEUTRAL_FALSE},
    {"return_tokens_as_token_ids", NEUTRAL_FALSE}, {"echo", NEUTRAL_FALSE},
    /* llama-server */
    {"n_probs", NEUTRAL_ZERO}, {"mirostat", NEUTRAL_ZERO}, {"mirostat_tau", NEUTRAL_NONE},
    {"mirostat_eta", NEUTRAL_NONE}, {"typical_p", NEUTRAL_ONE}, {"tfs_z", NEUTRAL_ONE},
    {"dynatemp_range", NEUTRAL_ZERO}, {"dynatemp_exponent", NEUTRAL_ONE}, {"dry_multiplier", NEUTRAL_ZERO},
    {"dry_base", NEUTRAL_NONE}, {"dry_allowed_length", NEUTRAL_NONE}, {"dry_penalty_last_n", NEUTRAL_NONE},
    {"dry_sequence_breakers", NEUTRAL_NONE}, {"xtc_probability", NEUTRAL_ZERO}, {"xtc_threshold", NEUTRAL_NONE},
    {"repeat_penalty", NEUTRAL_ONE}, {"repeat_last_n", NEUTRAL_NONE}, {"penalty_last_n", NEUTRAL_NONE},
    {"samplers", NEUTRAL_EMPTY}, {"n_predict", NEUTRAL_NONE}, {"n_keep", NEUTRAL_NONE},
    {"post_sampling_probs", NEUTRAL_FALSE},
    /* OpenAI fields that change the output */
    {"functions", NEUTRAL_EMPTY}, {"function_call", NEUTRAL_EMPTY}, {"audio", NEUTRAL_EMPTY},
    {"web_search_options", NEUTRAL_EMPTY}, {"verbosity", NEUTRAL_EMPTY},
};

/* Known fields that do not change the output: ignored, counted by name. */
static const char *const known_ignored[] = {
    /* OpenAI */
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
    "prediction", "user", "refusal", "annotations", "include_obfuscation",
    /* vLLM / SGLang */
    "priority", "request_id", "cache_salt", "kv_transfer_params", "vllm_xargs", "continuous_usage_stats",
    "return_hidden_states", "lora_path", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "separate_reasoning", "stream_reasoning", "custom_logit_processor", "mm_processor_kwargs",
    /* llama-server */
    "cache_prompt", "id_slot", "t_max_predict_ms", "timings_per_token", "return_progress", "n_indent",
    "n_discard", "n_cmpl", "lora", "reasoning_format", "parse_tool_calls",
    /* Anthropic (through proxies) */
    "cache_control", "anthropic_version", "anthropic_beta", "container", "citations", "budget_tokens",
    /* OpenAI-compatible proxies (LiteLLM, OpenRouter) */
    "provider", "transforms", "route", "models", "usage", "extra_body", "extra_headers", "num_retries",
    "mock_response", "caching", "tags", "reasoning", "fallbacks", "context_window_fallback_dict",
    NULL};

static int known(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (!strcmp(*list, k))
            return 1;
    return 0;
}

static int is_neutral(const json_t *v, int kind)
{
    if (json_is_null(v))
        return 1;
    switch (kind) {
    case NEUTRAL_FALSE:
        return json_is_false(v);
    case NEUTRAL_TRUE:
        return json_is_true(v);
    case NEUTRAL_ZERO:
        return json_is_number(v) && json_number_value(v) == 0;
    case NEUTRAL_ONE:
        return json_is_number(v) && json_number_value(v) == 1;
    case NEUTRAL_EMPTY:
        return (json_is_string(v) && !json_string_length(v)) || (json_is_array(v) && !json_array_size(v)) ||
               (json_is_object(v) && !json_object_size(v)) || json_is_false(v);
    default:
        return 0;
    }
}

static void ignore(shoal_api_ignored *ign, const char *path, int is_known)
{
    char clean[64];
    size_t i = 0;
    for (; path[i] && i < sizeof clean - 1; i++) {
        char c = path[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
                 c == '.' || c == '[' || c == ']' || c == '-';
        clean[i] = ok ? c : '?';
    }
    clean[i] = '\0';
    for (int k = 0; k < ign->n; k++)
        if (!strcmp(ign->name[k], clean))
            return;
    if (ign->n == SHOAL_API_MAX_IGNORED) {
        ign->dropped++;
        return;
    }
    memcpy(ign->name[ign->n], clean, i + 1);
    ign->known[ign->n++] = is_known;
}

int shoal_api_check_fields(const json_t *obj, const char *where, const char *const *used, shoal_api_ignored *ign,
                           shoal_api_error *err)
{
    if (!json_is_object(obj))
        return 0;
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)obj, key, val) {
        if (known(used, key))
            continue;
        char path[160], q[68];
        pname(path, sizeof path, "%s%s%s", where, where[0] ? "." : "", QUOTE(q, key));
        int refused = 0, listed = 0;
        for (size_t i = 0; i < sizeof refused_fields / sizeof refused_fields[0]; i++)
            if (!strcmp(refused_fields[i].name, key)) {
                listed = 1;
                refused = !is_neutral(val, refused_fields[i].neutral);
                break;
            }
        if (refused)
            return fail(err, 400, "unsupported_parameter", path,
                        "'%s' is not supported by this server and would change the output; leave it out "
                        "(docs/API.md lists the fields)",
                        path);
        if (ign)
            ignore(ign, path, listed || known(known_ignored, key));
    }
    return 0;
}

void shoal_api_ignored_add(shoal_api_ignored *ign, const char *path, int is_known)
{
    ignore(ign, path, is_known);
}

void shoal_api_ignored_list(const shoal_api_ignored *ign, char *buf, size_t cap)
{
    size_t o = 0;
    if (cap)
        buf[0] = '\0';
    for (int i = 0; i < ign->n && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%s", i ? "," : "", ign->name[i]);
    if (ign->dropped && o < cap)
        snprintf(buf + o, cap - o, ",+%d more", ign->dropped);
}

/* Text of a message's content: a string, or an array of {"type":"text"}
 * parts joined with "\n". NULL content is allowed where null_ok. Returns a
 * new json string (or json null) through *out. */
static int norm_content(json_t *content, const char *where, int null_ok, json_t **out, shoal_api_ignored *ign,
                        shoal_api_error *err)
{
    char param[160];
    pname(param, sizeof param, "%s.content", where);
    if (is_null_or_absent(content)) {
        if (!null_ok)
            return BAD(param, "'%s' is required", param);
        *out = json_null();
        return 0;
    }
    if (json_is_string(content)) {
        *out = json_incref(content);
        return 0;
    }
    if (!json_is_array(content))
        return BADTYPE(param, "a string or an array of content parts");
    size_t total = 0, i;
    json_t *part;
    json_array_foreach(content, i, part) {
        char pp[160];
        pname(pp, sizeof pp, "%s[%zu]", param, i);
        if (!json_is_object(part))
            return BADTYPE(pp, "an object");
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type)) {
            pname(pp, sizeof pp, "%s[%zu].type", param, i);
            return BADTYPE(pp, "a string");
        }
        if (strcmp(json_string_value(type), "text")) {
            pname(pp, sizeof pp, "%s[%zu].type", param, i);
            char q[44];
            return UNSUPPORTED(pp, "content parts of type '%s' are not supported (text only)",
                               QUOTE(q, json_string_value(type)));
        }
        json_t *text = json_object_get(part, "text");
        if (!json_is_string(text)) {
            pname(pp, sizeof pp, "%s[%zu].text", param, i);
            return BADTYPE(pp, "a string");
        }
        if (shoal_api_check_fields(part, "messages[].content[]", part_fields, ign, err))
            return -1;
        total += json_string_length(text) + 1;
    }
    char *buf = malloc(total + 1);
    if (!buf)
        SHOAL_PANIC("out of memory");
    size_t o = 0;
    json_array_foreach(content, i, part) {
        json_t *text = json_object_get(part, "text");
        if (i)
            buf[o++] = '\n';
        memcpy(buf + o, json_string_value(text), json_string_length(text));
        o += json_string_length(text);
    }
    *out = json_stringn(buf, o);
    free(buf);
    if (!*out)
        return BAD(param, "'%s' is not valid UTF-8", param);
    return 0;
}

static int valid_tool_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static int norm_tool_calls(json_t *calls, const char *where, json_t *out_msg, shoal_api_error *err)
{
    char param[160];
    pname(param, sizeof param, "%s.tool_calls", where);
    if (!json_is_array(calls))
        return BADTYPE(param, "an array");
    json_t *arr = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(calls, i, c) {
        char p[160];
        pname(p, sizeof p, "%s[%zu]", param, i);
        if (!json_is_object(c)) {
            json_decref(arr);
            return BADTYPE(p, "an object");
        }
        json_t *id = json_object_get(c, "id"), *type = json_object_get(c, "type"),
               *fn = json_object_get(c, "function");
        int bad = 0;
        if (!json_is_string(id)) {
            pname(p, sizeof p, "%s[%zu].id", param, i);
            bad = BADTYPE(p, "a string");
        } else if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "function"))) {
            pname(p, sizeof p, "%s[%zu].type", param, i);
            bad = UNSUPPORTED(p, "'%s' must be \"function\"", p);
        } else if (!json_is_object(fn)) {
            pname(p, sizeof p, "%s[%zu].function", param, i);
            bad = BADTYPE(p, "an object");
        } else if (!json_is_string(json_object_get(fn, "name"))) {
            pname(p, sizeof p, "%s[%zu].function.name", param, i);
            bad = BADTYPE(p, "a string");
        } else if (!json_is_string(json_object_get(fn, "arguments"))) {
            pname(p, sizeof p, "%s[%zu].function.arguments", param, i);
            bad = BADTYPE(p, "a string (JSON text)");
        }
        if (bad) {
            json_decref(arr);
            return bad;
        }
        json_array_append_new(arr, json_pack("{s:O,s:s,s:{s:O,s:O}}", "id", id, "type", "function", "function",
                                             "name", json_object_get(fn, "name"), "arguments",
                                             json_object_get(fn, "arguments")));
    }
    json_object_set_new(out_msg, "tool_calls", arr);
    return 0;
}

static int norm_messages(json_t *msgs, json_t **out, int *partial, shoal_api_ignored *ign, shoal_api_error *err)
{
    if (!msgs)
        return BAD("messages", "'messages' is required");
    if (!json_is_array(msgs))
        return BADTYPE("messages", "an array");
    if (json_array_size(msgs) == 0)
        return BAD("messages", "'messages' must contain at least one message");
    json_t *res = json_array();
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m) {
        char where[48], p[80];
        pname(where, sizeof where, "messages[%zu]", i);
        if (!json_is_object(m)) {
            json_decref(res);
            return BADTYPE(where, "an object");
        }
        json_t *role = json_object_get(m, "role");
        pname(p, sizeof p, "%s.role", where);
        if (!json_is_string(role)) {
            json_decref(res);
            return BADTYPE(p, "a string");
        }
        const char *r = json_string_value(role);
        int is_sys = !strcmp(r, "system") || !strcmp(r, "developer");
        int is_user = !strcmp(r, "user"), is_asst = !strcmp(r, "assistant"), is_tool = !strcmp(r, "tool");
        if (!is_sys && !is_user && !is_asst && !is_tool) {
            json_decref(res);
            char q[36];
            return UNSUPPORTED(p, "'%s' is '%s'; it must be system, developer, user, assistant or tool", p,
                               QUOTE(q, r));
        }
        json_t *nm = json_object();
        json_object_set_new(nm, "role", json_string(is_sys ? "system" : r));
        json_t *content = NULL;
        int has_calls = is_asst && !is_null_or_absent(json_object_get(m, "tool_calls"));
        if (shoal_api_check_fields(m, "messages[]", message_fields, ign, err) ||
            norm_content(json_object_get(m, "content"), where, is_asst, &content, ign, err)) {
            json_decref(nm);
            json_decref(res);
            return -1;
        }
        json_object_set_new(nm, "content", content);
        json_t *name = json_object_get(m, "name");
        if (!is_null_or_absent(name)) {
            pname(p, sizeof p, "%s.name", where);
            if (!json_is_string(name)) {
                json_decref(nm);
                json_decref(res);
                return BADTYPE(p, "a string");
            }
            json_object_set(nm, "name", name);
        }
        /* Moonshot's partial mode ("partial": true; DeepSeek's "prefix": true):
         * the last message, an assistant one, is continued */
        static const char *const pkeys[] = {"partial", "prefix"};
        for (int k = 0; k < 2; k++) {
            json_t *pv = json_object_get(m, pkeys[k]);
            if (is_null_or_absent(pv))
                continue;
            pname(p, sizeof p, "%s.%s", where, pkeys[k]);
            const char *why = !json_is_boolean(pv)                  ? "must be a boolean"
                              : !json_is_true(pv)                    ? NULL
                              : !is_asst                             ? "is only allowed on an assistant message"
                              : i + 1 != json_array_size(msgs)       ? "is only allowed on the last message"
                              : has_calls                            ? "is not allowed with tool_calls"
                                                                     : NULL;
            if (why) {
                json_decref(nm);
                json_decref(res);
                return json_is_boolean(pv) ? BAD(p, "'%s' %s", p, why) : BADTYPE(p, "a boolean");
            }
            if (json_is_true(pv))
                *partial = 1;
        }
        if (is_asst) {
            json_t *rc = json_object_get(m, "reasoning_content");
            if (is_null_or_absent(rc) || (json_is_string(rc) && !json_string_length(rc)))
                rc = json_object_get(m, "reasoning"); /* vLLM's name; the renderer's synonym */
            if (!is_null_or_absent(rc)) {
                pname(p, sizeof p, "%s.reasoning_content", where);
                if (!json_is_string(rc)) {
                    json_decref(nm);
                    json_decref(res);
                    return BADTYPE(p, "a string");
                }
                json_object_set(nm, "reasoning_content", rc);
            }
            if (has_calls && norm_tool_calls(json_object_get(m, "tool_calls"), where, nm, err)) {
                json_decref(nm);
                json_decref(res);
                return -1;
            }
        }
        if (is_tool) {
            json_t *tid = json_object_get(m, "tool_call_id");
            pname(p, sizeof p, "%s.tool_call_id", where);
            if (!json_is_string(tid)) {
                json_decref(nm);
                json_decref(res);
                return is_null_or_absent(tid) ? BAD(p, "'%s' is required for tool messages", p)
                                              : BADTYPE(p, "a string");
            }
            json_object_set(nm, "tool_call_id", tid);
        }
        json_array_append_new(res, nm);
    }
    if (*partial) /* the renderer reads the flag on the message */
        json_object_set_new(json_array_get(res, json_array_size(res) - 1), "partial", json_true());
    *out = res;
    return 0;
}

static int norm_tools(json_t *tools, json_t **out, shoal_api_ignored *ign, shoal_api_error *err)
{
    *out = NULL;
    if (is_null_or_absent(tools))
        return 0;
    if (!json_is_array(tools))
        return BADTYPE("tools", "an array");
    if (json_array_size(tools) > 128)
        return BAD("tools", "at most 128 tools are accepted");
    json_t *res = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        char p[160];
        pname(p, sizeof p, "tools[%zu]", i);
        int bad = 0;
        json_t *fn = json_is_object(t) ? json_object_get(t, "function") : NULL;
        json_t *type = json_is_object(t) ? json_object_get(t, "type") : NULL;
        if (!json_is_object(t)) {
            bad = BADTYPE(p, "an object");
        } else if (!json_is_string(type) || strcmp(json_string_value(type), "function")) {
            pname(p, sizeof p, "tools[%zu].type", i);
            bad = UNSUPPORTED(p, "'%s' must be \"function\"", p);
        } else if (!json_is_object(fn)) {
            pname(p, sizeof p, "tools[%zu].function", i);
            bad = BADTYPE(p, "an object");
        } else if (!json_is_string(json_object_get(fn, "name")) ||
                   !valid_tool_name(json_string_value(json_object_get(fn, "name")))) {
            pname(p, sizeof p, "tools[%zu].function.name", i);
            bad = BAD(p, "'%s' must be 1-64 characters of a-z, A-Z, 0-9, _ and -", p);
        } else if (!is_null_or_absent(json_object_get(fn, "description")) &&
                   !json_is_string(json_object_get(fn, "description"))) {
            pname(p, sizeof p, "tools[%zu].function.description", i);
            bad = BADTYPE(p, "a string");
        } else if (!is_null_or_absent(json_object_get(fn, "parameters")) &&
                   !json_is_object(json_object_get(fn, "parameters"))) {
            pname(p, sizeof p, "tools[%zu].function.parameters", i);
            bad = BADTYPE(p, "an object (JSON Schema)");
        } else if (!is_null_or_absent(json_object_get(fn, "strict")) &&
                   !json_is_boolean(json_object_get(fn, "strict"))) {
            pname(p, sizeof p, "tools[%zu].function.strict", i);
            bad = BADTYPE(p, "a boolean");
        }
        if (!bad && (shoal_api_check_fields(t, "tools[]", tool_fields, ign, err) ||
                     shoal_api_check_fields(fn, "tools[].function", function_fields, ign, err)))
            bad = -1;
        if (bad) {
            json_decref(res);
            return bad;
        }
        for (size_t k = 0; k < i; k++)
            if (!strcmp(json_string_value(json_object_get(json_object_get(json_array_get(res, k), "function"), "name")),
                        json_string_value(json_object_get(fn, "name")))) {
                pname(p, sizeof p, "tools[%zu].function.name", i);
                json_decref(res);
                return BAD(p, "duplicate tool name '%s'", json_string_value(json_object_get(fn, "name")));
            }
        /* the declaration as OpenAI documents it, without unknown keys */
        json_t *nf = json_object();
        json_object_set(nf, "name", json_object_get(fn, "name"));
        if (json_is_string(json_object_get(fn, "description")))
            json_object_set(nf, "description", json_object_get(fn, "description"));
        if (json_is_object(json_object_get(fn, "parameters")))
            json_object_set(nf, "parameters", json_object_get(fn, "parameters"));
        if (json_is_boolean(json_object_get(fn, "strict")))
            json_object_set(nf, "strict", json_object_get(fn, "strict"));
        json_array_append_new(res, json_pack("{s:s,s:o}", "type", "function", "function", nf));
    }
    *out = res;
    return 0;
}

static int norm_tool_choice(json_t *tc, const json_t *tools, json_t **out, shoal_api_error *err)
{
    *out = NULL;
    if (is_null_or_absent(tc))
        return 0;
    if (json_is_string(tc)) {
        const char *s = json_string_value(tc);
        if (strcmp(s, "none") && strcmp(s, "auto") && strcmp(s, "required"))
            return UNSUPPORTED("tool_choice", "'tool_choice' must be none, auto, required or a function");
        if (!strcmp(s, "required") && !tools)
            return BAD("tool_choice", "'tool_choice' is required but no 'tools' are declared");
        *out = json_incref(tc);
        return 0;
    }
    if (!json_is_object(tc))
        return BADTYPE("tool_choice", "a string or an object");
    json_t *type = json_object_get(tc, "type"), *fn = json_object_get(tc, "function");
    if (!json_is_string(type) || strcmp(json_string_value(type), "function"))
        return UNSUPPORTED("tool_choice.type", "'tool_choice.type' must be \"function\"");
    json_t *name = json_is_object(fn) ? json_object_get(fn, "name") : NULL;
    if (!json_is_string(name))
        return BADTYPE("tool_choice.function.name", "a string");
    size_t i;
    json_t *t;
    int found = 0;
    if (tools)
        json_array_foreach(tools, i, t) found |= !strcmp(
            json_string_value(json_object_get(json_object_get(t, "function"), "name")), json_string_value(name));
    if (!found) {
        char q[68];
        return BAD("tool_choice.function.name", "tool '%s' is not among the declared 'tools'",
                   QUOTE(q, json_string_value(name)));
    }
    *out = json_pack("{s:s,s:{s:O}}", "type", "function", "function", "name", name);
    return 0;
}

static int get_stop(json_t *root, shoal_gen_params *g, shoal_api_error *err)
{
    json_t *v = json_object_get(root, "stop");
    if (is_null_or_absent(v))
        return 0;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    json_t *arr[SHOAL_MAX_STOP];
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > SHOAL_MAX_STOP)
            return BAD("stop", "'stop' accepts at most %d strings", SHOAL_MAX_STOP);
        for (size_t i = 0; i < n; i++)
            arr[i] = json_array_get(v, i);
        items = arr;
    } else if (!json_is_string(v)) {
        return BADTYPE("stop", "a string or an array of strings");
    }
    for (size_t i = 0; i < n; i++) {
        char p[160];
        pname(p, sizeof p, json_is_array(v) ? "stop[%zu]" : "stop", i);
        if (!json_is_string(items[i]))
            return BADTYPE(p, "a string");
        size_t len = json_string_length(items[i]);
        if (len == 0 || len > SHOAL_MAX_STOP_BYTES)
            return BAD(p, "'%s' must be 1 to %d bytes long", p, SHOAL_MAX_STOP_BYTES);
        if (memchr(json_string_value(items[i]), 0, len))
            return BAD(p, "'%s' must not contain NUL", p);
        g->stop[g->nstop++] = shoal_xstrdup(json_string_value(items[i]));
    }
    return 0;
}

static int get_prompt(json_t *root, const shoal_api_limits *lim, shoal_gen_params *g, shoal_api_error *err)
{
    json_t *v = json_object_get(root, "prompt");
    if (is_null_or_absent(v))
        return BAD("prompt", "'prompt' is required");
    /* one prompt: a string, a list of ids, or a list holding one of those */
    if (json_is_array(v) && json_array_size(v) == 1 &&
        (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        v = json_array_get(v, 0);
    else if (json_is_array(v) && json_array_size(v) > 1 &&
             (json_is_string(json_array_get(v, 0)) || json_is_array(json_array_get(v, 0))))
        return UNSUPPORTED("prompt", "only one prompt per request is supported (got %zu)", json_array_size(v));
    if (json_is_string(v)) {
        if (json_string_length(v) == 0)
            return BAD("prompt", "'prompt' must not be empty");
        g->prompt_len = json_string_length(v);
        g->prompt = shoal_xmalloc(g->prompt_len + 1);
        memcpy(g->prompt, json_string_value(v), g->prompt_len + 1);
        return 0;
    }
    if (!json_is_array(v))
        return BADTYPE("prompt", "a string or an array of token ids");
    size_t n = json_array_size(v);
    if (n == 0)
        return BAD("prompt", "'prompt' must not be empty");
    if (n > (size_t)lim->max_context)
        return fail(err, 400, "context_length_exceeded", "prompt",
                    "the prompt has %zu tokens; this model's context is %d tokens", n, lim->max_context);
    g->prompt_ids = shoal_xmalloc(n * sizeof *g->prompt_ids);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(v, i);
        char p[160];
        pname(p, sizeof p, "prompt[%zu]", i);
        if (!json_is_integer(x))
            return BADTYPE(p, "an integer token id");
        long long id = json_integer_value(x);
        if (id < 0 || id >= lim->vocab)
            return BAD(p, "token id %lld is outside the vocabulary [0, %d)", id, lim->vocab);
        g->prompt_ids[i] = (int32_t)id;
    }
    g->n_prompt_ids = (int)n;
    return 0;
}

static int get_penalties(json_t *root, shoal_gen_params *g, shoal_api_error *err)
{
    double x;
    int present;
    g->repetition_penalty = 1.0f;
    if (get_number(root, "presence_penalty", -2, 2, &x, &present, err))
        return -1;
    if (present)
        g->presence_penalty = (float)x;
    if (get_number(root, "frequency_penalty", -2, 2, &x, &present, err))
        return -1;
    if (present)
        g->frequency_penalty = (float)x;
    if (get_number(root, "repetition_penalty", 0, 10, &x, &present, err))
        return -1;
    if (present) {
        if (x <= 0)
            return BAD("repetition_penalty", "'repetition_penalty' must be greater than 0 (1 = off)");
        g->repetition_penalty = (float)x;
    }
    if (get_number(root, "min_p", 0, 1, &x, &present, err))
        return -1;
    if (present)
        g->min_p = (float)x;
    json_t *lb = json_object_get(root, "logit_bias");
    if (is_null_or_absent(lb))
        return 0;
    if (!json_is_object(lb))
        return BADTYPE("logit_bias", "an object (token id -> bias)");
    if (json_object_size(lb) > 1024)
        return BAD("logit_bias", "'logit_bias' accepts at most 1024 entries");
    g->bias = shoal_xcalloc(json_object_size(lb) + 1, sizeof *g->bias);
    const char *k;
    json_t *v;
    json_object_foreach(lb, k, v) {
        char p[160], q[40];
        pname(p, sizeof p, "logit_bias.%s", QUOTE(q, k));
        char *end;
        long id = strtol(k, &end, 10);
        if (!k[0] || *end || k[0] == '-' || k[0] == '+' || k[0] == ' ' || id < 0 || id >= INT32_MAX)
            return BAD(p, "'logit_bias' keys must be token ids (decimal integers)");
        if (!json_is_number(v))
            return BADTYPE(p, "a number");
        double b = json_number_value(v);
        if (!isfinite(b) || b < -100 || b > 100)
            return BAD(p, "'%s' is %g; it must be between -100 and 100", p, b);
        g->bias[g->nbias].id = (int32_t)id;
        g->bias[g->nbias++].bias = (float)b;
    }
    return 0;
}

static int check_bias_ids(const shoal_gen_params *g, const shoal_api_limits *lim, shoal_api_error *err)
{
    for (int i = 0; i < g->nbias; i++)
        if (g->bias[i].id >= lim->vocab) {
            char p[64];
            pname(p, sizeof p, "logit_bias.%d", (int)g->bias[i].id);
            return BAD(p, "token id %d is outside the vocabulary [0, %d)", (int)g->bias[i].id, lim->vocab);
        }
    return 0;
}

/* reasoning_effort / thinking_effort values -> K3's effort ("" = default) */
static int map_effort(const json_t *v, const char *param, shoal_gen_params *g, shoal_api_error *err)
{
    if (is_null_or_absent(v))
        return 0;
    if (!json_is_string(v))
        return BADTYPE(param, "a string");
    const char *e = json_string_value(v);
    static const char *const from[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
    /* K3's encoder takes low / high / max; "medium" is its default (no
     * effort message), so it maps to "" */
    static const char *const to[] = {"", "low", "low", "", "high", "max", "max"};
    size_t i;
    for (i = 0; i < sizeof from / sizeof from[0]; i++)
        if (!strcmp(e, from[i]))
            break;
    if (i == sizeof from / sizeof from[0])
        return UNSUPPORTED(param, "'%s' must be none, minimal, low, medium, high, xhigh or max", param);
    g->thinking = i != 0;
    snprintf(g->effort, sizeof g->effort, "%s", to[i]);
    return 0;
}

static char *memo_key(shoal_gen_kind kind, const shoal_api_limits *lim, const shoal_gen_params *g)
{
    int greedy = g->temperature <= 0 || g->top_k == 1;
    json_t *k = json_object();
    json_object_set_new(k, "v", json_integer(2));
    json_object_set_new(k, "model", json_string(lim->model_name));
    json_object_set_new(k, "kind", json_integer(kind));
    if (g->messages)
        json_object_set(k, "messages", g->messages);
    if (g->tools)
        json_object_set(k, "tools", g->tools);
    if (g->tool_choice)
        json_object_set(k, "tool_choice", g->tool_choice);
    if (g->max_tool_calls)
        json_object_set_new(k, "max_tool_calls", json_integer(g->max_tool_calls));
    if (g->response_format)
        json_object_set(k, "response_format", g->response_format);
    if (g->constraint)
        json_object_set(k, "constraint", g->constraint);
    json_object_set_new(k, "thinking", json_integer(g->thinking));
    json_object_set_new(k, "effort", json_string(g->effort));
    if (g->prompt)
        json_object_set_new(k, "prompt", json_stringn(g->prompt, g->prompt_len));
    if (g->prompt_ids) {
        json_t *ids = json_array();
        for (int i = 0; i < g->n_prompt_ids; i++)
            json_array_append_new(ids, json_integer(g->prompt_ids[i]));
        json_object_set_new(k, "prompt_ids", ids);
    }
    json_object_set_new(k, "max_tokens", json_integer(g->max_tokens));
    if (!greedy) {
        json_object_set_new(k, "temperature", json_real(g->temperature));
        json_object_set_new(k, "top_p", json_real(g->top_p));
        json_object_set_new(k, "top_k", json_integer(g->top_k));
        json_object_set_new(k, "seed", json_integer((json_int_t)g->seed));
    }
    json_t *st = json_array();
    for (int i = 0; i < g->nstop; i++)
        json_array_append_new(st, json_string(g->stop[i]));
    json_object_set_new(k, "stop", st);
    json_object_set_new(k, "ids", json_integer(g->return_token_ids));
    json_object_set_new(k, "partial", json_integer(g->partial));
    json_object_set_new(k, "logprobs", json_pack("[i,i]", g->logprobs, g->top_logprobs));
    json_object_set_new(k, "penalties", json_pack("[f,f,f]", (double)g->presence_penalty, (double)g->frequency_penalty,
                                                  (double)g->repetition_penalty));
    if (!greedy)
        json_object_set_new(k, "min_p", json_real(g->min_p));
    json_t *bias = json_array();
    for (int i = 0; i < g->nbias; i++)
        json_array_append_new(bias, json_pack("[i,f]", (int)g->bias[i].id, (double)g->bias[i].bias));
    json_object_set_new(k, "bias", bias);
    char *s = json_dumps(k, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENSURE_ASCII);
    json_decref(k);
    if (!s)
        return NULL;
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)s, strlen(s));
    free(s);
    char *hex = shoal_xmalloc(2 * sizeof h + 1);
    sodium_bin2hex(hex, 2 * sizeof h + 1, h, sizeof h);
    return hex;
}

/* The first number whose magnitude is 2^63 or more (the body read with
 * integers as reals), its path written into path ("max_tokens",
 * "messages[0].x"). Depth-bounded like the parser. */
static int find_huge_at(json_t *v, char *path, size_t cap, size_t at, int depth)
{
    if (depth > 64)
        return 0;
    if (json_is_real(v))
        return fabs(json_real_value(v)) >= 9223372036854775808.0;
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) {
            char q[72];
            snprintf(path + at, cap - at, "%s%s", at ? "." : "", QUOTE(q, k));
            if (find_huge_at(x, path, cap, strlen(path), depth + 1))
                return 1;
        }
    } else if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            snprintf(path + at, cap - at, "[%zu]", i);
            if (find_huge_at(x, path, cap, strlen(path), depth + 1))
                return 1;
        }
    }
    path[at] = '\0';
    return 0;
}

static int find_huge(json_t *root, char *path, size_t cap)
{
    return find_huge_at(root, path, cap, 0, 0);
}

/* Structured output (issue 36): response_format json_object / json_schema
 * (chat), vLLM's guided_json / guided_regex / guided_choice (both
 * endpoints); at most one. Normalised into g->constraint and compiled once
 * here so a schema the compiler refuses is a 400 naming the keyword. */
static int parse_constraint(json_t *root, shoal_gen_kind kind, shoal_gen_params *g, shoal_api_error *err)
{
    const char *param = NULL;
    json_t *spec = NULL;
    int count = 0;
    if (kind == SHOAL_GEN_CHAT && g->response_format) {
        const char *rt = json_string_value(json_object_get(g->response_format, "type"));
        json_t *sc = NULL;
        param = "response_format";
        if (!strcmp(rt, "json_schema")) {
            json_t *js = json_object_get(g->response_format, "json_schema");
            sc = json_object_get(js, "schema");
            param = "response_format.json_schema.schema";
            if (sc && !json_is_object(sc) && !json_is_boolean(sc))
                return BADTYPE(param, "an object");
        }
        spec = json_pack("{s:s, s:O}", "kind", "json", "schema", sc ? sc : json_null());
        count++;
    }
    json_t *gj = json_object_get(root, "guided_json"), *gr = json_object_get(root, "guided_regex"),
           *gc = json_object_get(root, "guided_choice");
    if (!is_null_or_absent(gj)) {
        json_t *sc = json_incref(gj);
        if (json_is_string(gj)) { /* vLLM also takes the schema as a JSON text */
            json_decref(sc);
            sc = json_loads(json_string_value(gj), 0, NULL);
            if (!sc) {
                json_decref(spec);
                return BAD("guided_json", "'guided_json' is a string that is not a JSON schema");
            }
        } else if (!json_is_object(gj)) {
            json_decref(sc);
            json_decref(spec);
            return BADTYPE("guided_json", "an object (a JSON schema)");
        }
        json_decref(spec);
        spec = json_pack("{s:s, s:o}", "kind", "json", "schema", sc);
        param = "guided_json";
        count++;
    }
    if (!is_null_or_absent(gr)) {
        if (!json_is_string(gr)) {
            json_decref(spec);
            return BADTYPE("guided_regex", "a string");
        }
        json_decref(spec);
        spec = json_pack("{s:s, s:O}", "kind", "regex", "pattern", gr);
        param = "guided_regex";
        count++;
    }
    if (!is_null_or_absent(gc)) {
        size_t i;
        json_t *c;
        if (!json_is_array(gc) || !json_array_size(gc)) {
            json_decref(spec);
            return BADTYPE("guided_choice", "a non-empty array of strings");
        }
        json_array_foreach(gc, i, c) if (!json_is_string(c) || !json_string_length(c))
        {
            json_decref(spec);
            return BADTYPE("guided_choice", "a non-empty array of non-empty strings");
        }
        json_decref(spec);
        spec = json_pack("{s:s, s:O}", "kind", "choice", "choices", gc);
        param = "guided_choice";
        count++;
    }
    static const char *const gkeys[] = {"grammar", "guided_grammar"};
    for (int k = 0; k < 2; k++) {
        json_t *gg = json_object_get(root, gkeys[k]);
        if (is_null_or_absent(gg) || (json_is_string(gg) && !json_string_length(gg)))
            continue;
        if (!json_is_string(gg)) {
            json_decref(spec);
            return BADTYPE(gkeys[k], "a string (a GBNF grammar)");
        }
        json_decref(spec);
        spec = json_pack("{s:s, s:O}", "kind", "grammar", "gbnf", gg);
        param = gkeys[k];
        count++;
    }
    if (count > 1) {
        json_decref(spec);
        return UNSUPPORTED(param, "give at most one of response_format (json_object / json_schema), guided_json, "
                                  "guided_regex, guided_choice, grammar, guided_grammar");
    }
    /* a forced tool call: tool_choice names a function (or is "required"
     * with one tool declared): the reply is that call, its arguments
     * constrained by the function's parameters */
    const char *forced = NULL;
    if (!spec && kind == SHOAL_GEN_CHAT && g->tools && g->tool_choice) {
        if (json_is_object(g->tool_choice))
            forced = json_string_value(json_object_get(json_object_get(g->tool_choice, "function"), "name"));
        else if (!strcmp(json_string_value(g->tool_choice), "required") && json_array_size(g->tools) == 1)
            forced = json_string_value(json_object_get(json_object_get(json_array_get(g->tools, 0), "function"),
                                                       "name"));
    }
    if (forced) {
        size_t i;
        json_t *t, *params = NULL;
        json_array_foreach(g->tools, i, t) {
            json_t *fn = json_object_get(t, "function");
            if (!strcmp(json_string_value(json_object_get(fn, "name")), forced)) {
                params = json_object_get(fn, "parameters");
                break;
            }
        }
        if (params && !json_is_object(params))
            params = NULL;
        const char *pt = params ? json_string_value(json_object_get(params, "type")) : NULL;
        if (pt && strcmp(pt, "object"))
            return BAD("tools[].function.parameters", "the parameters of the forced tool '%s' must be an object schema",
                       forced);
        spec = json_pack("{s:s, s:O, s:s}", "kind", "json", "schema", params ? params : json_null(), "tool", forced);
        param = "tools[].function.parameters";
    }
    if (!spec)
        return 0;
    shoal_cons *c;
    char cerr[300];
    int rc = shoal_cons_compile_spec(&c, spec, cerr, sizeof cerr);
    if (rc) {
        json_decref(spec);
        if (rc == SHOAL_EUNSUPPORTED)
            return UNSUPPORTED(param, "'%s' %s", param, cerr);
        return BAD(param, "'%s' %s", param, cerr);
    }
    shoal_cons_free(c);
    g->constraint = spec;
    return 0;
}

int shoal_api_parse(shoal_gen_kind kind, const char *body, size_t len, const shoal_api_limits *lim,
                    shoal_api_req *out, shoal_api_error *err)
{
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    json_error_t je;
    json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
    if (!root && strstr(je.text, "too big")) {
        /* an integer beyond 64 bits: name the field rather than call the
         * body invalid JSON (it is valid JSON) */
        json_error_t je2;
        json_t *r2 = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_INT_AS_REAL, &je2);
        char path[160] = "";
        if (r2 && find_huge(r2, path, sizeof path)) {
            json_decref(r2);
            return fail(err, 400, "invalid_value", path, "'%s' is out of range (an integer beyond 64 bits)", path);
        }
        json_decref(r2);
    }
    if (!root) {
        char q[124];
        return fail(err, 400, "invalid_json", "",
                    "We could not parse the JSON body of your request: %s (line %d, column %d)", QUOTE(q, je.text),
                    je.line, je.column);
    }
    int rc = -1;
    shoal_gen_params *g = &out->gen;
    g->kind = kind;
    g->thinking = 1;
    g->temperature = 1.0f;
    g->top_p = 1.0f;
    if (!json_is_object(root)) {
        BADTYPE("body", "a JSON object");
        goto done;
    }
    if (shoal_api_check_fields(root, "", kind == SHOAL_GEN_CHAT ? chat_fields : completion_fields, &out->ignored,
                               err))
        goto done;
    /* model */
    json_t *model = json_object_get(root, "model");
    if (!model) {
        BAD("model", "'model' is required");
        goto done;
    }
    if (!json_is_string(model)) {
        BADTYPE("model", "a string");
        goto done;
    }
    if (strcmp(json_string_value(model), lim->model_name)) {
        char q[68];
        fail(err, 400, "model_not_found", "model", "The model '%s' does not exist; this server serves '%s'",
             QUOTE(q, json_string_value(model)), lim->model_name);
        goto done;
    }
    /* n and its relatives */
    long long n = 1;
    if (get_int(root, "n", 1, 128, &n, NULL, err))
        goto done;
    if (n > SHOAL_API_MAX_N) {
        UNSUPPORTED("n", "'n' is %lld; at most %d choices per request are supported", n, SHOAL_API_MAX_N);
        goto done;
    }
    out->n = (int)n;
    if (kind == SHOAL_GEN_COMPLETION) {
        long long best_of = n;
        int echo = 0;
        if (get_int(root, "best_of", 1, 128, &best_of, NULL, err))
            goto done;
        if (best_of != n) {
            UNSUPPORTED("best_of", "'best_of' must equal 'n' (no server-side selection among choices)");
            goto done;
        }
        if (get_bool(root, "echo", &echo, err))
            goto done;
        if (echo) {
            UNSUPPORTED("echo", "'echo' is not supported");
            goto done;
        }
        if (!is_null_or_absent(json_object_get(root, "suffix"))) {
            UNSUPPORTED("suffix", "'suffix' is not supported");
            goto done;
        }
        /* logprobs: an integer, the alternatives per token (vLLM's bound, 20) */
        long long lp = 0;
        int has_lp = 0;
        if (get_int(root, "logprobs", 0, SHOAL_API_MAX_TOP_LOGPROBS, &lp, &has_lp, err))
            goto done;
        g->logprobs = has_lp;
        g->top_logprobs = (int)lp;
    } else {
        int lp = 0;
        long long tlp = 0;
        int has_tlp = 0;
        if (get_bool(root, "logprobs", &lp, err) ||
            get_int(root, "top_logprobs", 0, SHOAL_API_MAX_TOP_LOGPROBS, &tlp, &has_tlp, err))
            goto done;
        if (has_tlp && !lp) {
            BAD("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
            goto done;
        }
        g->logprobs = lp;
        g->top_logprobs = (int)tlp;
        json_t *rf = json_object_get(root, "response_format");
        if (!is_null_or_absent(rf)) {
            json_t *t = json_is_object(rf) ? json_object_get(rf, "type") : NULL;
            if (!json_is_string(t)) {
                BADTYPE("response_format.type", "a string");
                goto done;
            }
            const char *rt = json_string_value(t);
            if (!strcmp(rt, "json_schema") && !json_is_object(json_object_get(rf, "json_schema"))) {
                BADTYPE("response_format.json_schema", "an object");
                goto done;
            }
            if (!strcmp(rt, "json_object") || !strcmp(rt, "json_schema")) {
                /* rendered as K3's response-format system message, and
                 * enforced while sampling (strict or not: docs/API.md) */
                g->response_format = json_incref(rf);
            } else if (strcmp(rt, "text")) {
                char q[36];
                UNSUPPORTED("response_format.type",
                            "'response_format.type' must be text, json_object or json_schema (got '%s')",
                            QUOTE(q, rt));
                goto done;
            }
        }
        json_t *mod = json_object_get(root, "modalities");
        if (!is_null_or_absent(mod)) {
            if (!json_is_array(mod)) {
                BADTYPE("modalities", "an array");
                goto done;
            }
            size_t i;
            json_t *m;
            json_array_foreach(mod, i, m) if (!json_is_string(m) || strcmp(json_string_value(m), "text"))
            {
                UNSUPPORTED("modalities", "only the \"text\" modality is supported");
                goto done;
            }
        }
        int ptc = 1;
        if (get_bool(root, "parallel_tool_calls", &ptc, err))
            goto done;
        g->max_tool_calls = ptc ? 0 : 1;
        if (get_bool(root, "store", &ptc, err))
            goto done;
        const char *strs[] = {"service_tier", "prompt_cache_key", "safety_identifier"};
        for (size_t i = 0; i < sizeof strs / sizeof strs[0]; i++) {
            json_t *s = json_object_get(root, strs[i]);
            if (!is_null_or_absent(s) && !json_is_string(s)) {
                BADTYPE(strs[i], "a string");
                goto done;
            }
        }
        json_t *md = json_object_get(root, "metadata");
        if (!is_null_or_absent(md) && !json_is_object(md)) {
            BADTYPE("metadata", "an object");
            goto done;
        }
    }
    if (get_penalties(root, g, err) || check_bias_ids(g, lim, err))
        goto done;
    /* stream */
    if (get_bool(root, "stream", &out->stream, err))
        goto done;
    json_t *so = json_object_get(root, "stream_options");
    if (!is_null_or_absent(so)) {
        if (!out->stream) {
            BAD("stream_options", "'stream_options' is only allowed when 'stream' is true");
            goto done;
        }
        if (!json_is_object(so)) {
            BADTYPE("stream_options", "an object");
            goto done;
        }
        if (shoal_api_check_fields(so, "stream_options", stream_options_fields, &out->ignored, err))
            goto done;
        json_t *iu = json_object_get(so, "include_usage");
        if (!is_null_or_absent(iu)) {
            if (!json_is_boolean(iu)) {
                BADTYPE("stream_options.include_usage", "a boolean");
                goto done;
            }
            out->include_usage = json_is_true(iu);
        }
    }
    /* lengths */
    long long mt = kind == SHOAL_GEN_COMPLETION ? 16 : 0, mct = 0;
    int has_mt = 0, has_mct = 0;
    if (get_int(root, "max_tokens", 1, lim->max_context, &mt, &has_mt, err))
        goto done;
    if (kind == SHOAL_GEN_CHAT && get_int(root, "max_completion_tokens", 1, lim->max_context, &mct, &has_mct, err))
        goto done;
    if (has_mt && has_mct && mt != mct) {
        BAD("max_tokens", "give 'max_tokens' or 'max_completion_tokens', not two different values");
        goto done;
    }
    g->max_tokens = (int)(has_mct ? mct : mt);
    /* sampling */
    double t = 1.0, tp = 1.0;
    long long tk = 0, seed = 0;
    int has_seed = 0;
    if (get_number(root, "temperature", 0, 2, &t, NULL, err) || get_number(root, "top_p", 0, 1, &tp, NULL, err) ||
        get_int(root, "top_k", -1, 1 << 30, &tk, NULL, err) ||
        get_int(root, "seed", INT64_MIN, INT64_MAX, &seed, &has_seed, err))
        goto done;
    if (tp <= 0) {
        BAD("top_p", "'top_p' must be greater than 0");
        goto done;
    }
    g->temperature = (float)t;
    g->top_p = (float)tp;
    g->top_k = tk < 0 ? 0 : (int)tk; /* -1: vLLM's "off" */
    int greedy = g->temperature <= 0 || g->top_k == 1;
    if (has_seed)
        g->seed = (uint64_t)seed;
    else if (!greedy)
        randombytes_buf(&g->seed, sizeof g->seed); /* a fresh stream per request */
    if (get_stop(root, g, err))
        goto done;
    if (get_bool(root, "return_token_ids", &g->return_token_ids, err))
        goto done;
    json_t *user = json_object_get(root, "user");
    if (!is_null_or_absent(user)) {
        if (!json_is_string(user)) {
            BADTYPE("user", "a string");
            goto done;
        }
        shoal_utf8_clip(out->user, sizeof out->user, json_string_value(user), SHOAL_UTF8_NOCTRL);
    }
    if (kind == SHOAL_GEN_COMPLETION) {
        if (get_prompt(root, lim, g, err))
            goto done;
    } else {
        if (norm_messages(json_object_get(root, "messages"), &g->messages, &g->partial, &out->ignored, err))
            goto done;
        if (norm_tools(json_object_get(root, "tools"), &g->tools, &out->ignored, err))
            goto done;
        if (norm_tool_choice(json_object_get(root, "tool_choice"), g->tools, &g->tool_choice, err))
            goto done;
        /* thinking: later wins, as the renderer reads a request body
         * (shoal_chat_opts_from_request): reasoning_effort < thinking_effort <
         * chat_template_kwargs.reasoning_effort < chat_template_kwargs.thinking_effort;
         * chat_template_kwargs.thinking (bool) and thinking.type then switch
         * thinking on or off ("none" efforts turn it off) */
        json_t *kw = json_object_get(root, "chat_template_kwargs");
        if (!is_null_or_absent(kw) && !json_is_object(kw)) {
            BADTYPE("chat_template_kwargs", "an object");
            goto done;
        }
        if (json_is_object(kw) && shoal_api_check_fields(kw, "chat_template_kwargs", kwargs_fields, &out->ignored, err))
            goto done;
        if (map_effort(json_object_get(root, "reasoning_effort"), "reasoning_effort", g, err) ||
            map_effort(json_object_get(root, "thinking_effort"), "thinking_effort", g, err) ||
            map_effort(json_object_get(kw, "reasoning_effort"), "chat_template_kwargs.reasoning_effort", g, err) ||
            map_effort(json_object_get(kw, "thinking_effort"), "chat_template_kwargs.thinking_effort", g, err))
            goto done;
        int effort_none = !g->thinking;
        json_t *kth = json_object_get(kw, "thinking");
        if (!is_null_or_absent(kth)) {
            if (!json_is_boolean(kth)) {
                BADTYPE("chat_template_kwargs.thinking", "a boolean");
                goto done;
            }
            if (json_is_true(kth) && effort_none) {
                BAD("chat_template_kwargs.thinking", "'chat_template_kwargs.thinking' is true but the effort is \"none\"");
                goto done;
            }
            g->thinking = json_is_true(kth);
        }
        json_t *th = json_object_get(root, "thinking");
        if (!is_null_or_absent(th)) {
            json_t *tt = json_is_object(th) ? json_object_get(th, "type") : NULL;
            if (!json_is_string(tt)) {
                BADTYPE("thinking.type", "a string (\"enabled\" or \"disabled\")");
                goto done;
            }
            if (shoal_api_check_fields(th, "thinking", thinking_fields, &out->ignored, err))
                goto done;
            const char *s = json_string_value(tt);
            if (!strcmp(s, "disabled")) {
                g->thinking = 0;
            } else if (!strcmp(s, "enabled")) {
                if (!g->thinking) {
                    BAD("thinking", "'thinking' is enabled but the effort is \"none\" or chat_template_kwargs.thinking is false");
                    goto done;
                }
            } else {
                UNSUPPORTED("thinking.type", "'thinking.type' must be \"enabled\" or \"disabled\"");
                goto done;
            }
        }
        if (!g->thinking)
            g->effort[0] = '\0';
    }
    if (parse_constraint(root, kind, g, err))
        goto done;
    if (g->constraint && kind == SHOAL_GEN_CHAT) {
        /* the constraint applies to the content: rendered with thinking off
         * so the reply starts in the content (docs/API.md) */
        g->thinking = 0;
        g->effort[0] = '\0';
    }
    if ((greedy || has_seed) && out->n == 1)
        out->memo_key = memo_key(kind, lim, g);
    rc = 0;
done:
    json_decref(root);
    if (rc)
        shoal_api_req_free(out);
    return rc;
}
