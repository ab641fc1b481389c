/* chat: K3 XTML rendering into segments and their encoding (see chat.h). The
 * structure follows the official encoder segment for segment; where it is
 * surprising the comment says so rather than repairing it, because a prompt
 * that differs from the trained one is wrong in ways no test here can see. */
#include "coordinator/text/chat.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/strmap.h"
#include "common/utf8.h"
#include "coordinator/text/chatjson.h"
#include "coordinator/text/tokenizer_int.h"

#define OPEN "<|open|>"
#define CLOSE "<|close|>"
#define SEP "<|sep|>"
#define EOM "<|end_of_msg|>"

static const char tool_declare_head[] = "# Tools\n"
                                        "Here are the available tools, described in JSONSchema.\n\n"
                                        "```json\n";
static const char tool_declare_dynamic_head[] =
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n";
static const char effort_body[] =
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=";
static const char choice_required[] = "The system is invoked with `tool_choice=required`.\n"
                                      "You MUST call tools in the next message.";
static const char choice_none[] = "The system is invoked with `tool_choice=none`.\n"
                                  "You MUST NOT call any tools in the next message.";
static const char format_object[] =
    "The system is invoked with `response_format=json_object`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any "
    "additional formatting.";
static const char format_schema[] =
    "The system is invoked with `response_format=json_schema`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any "
    "additional formatting.\n"
    "The JSON data must match the following schema:\n"
    "```json\n";

struct shoal_chat_segs {
    shoal_chat_seg *v;
    size_t *off; /* text offsets into arena while building */
    size_t n, cap;
    shoal_chatjson_buf arena;
};

typedef struct {
    shoal_chat_segs *s;
    const shoal_chat_opts *o;
    int thinking;
    char *err;
    size_t errlen;
} ctx;

/* ------------------------------------------------------------ segments -- */

static void seg(ctx *c, const char *text, size_t len, int special)
{
    if (!len)
        return; /* the encoder drops empty segments */
    shoal_chat_segs *s = c->s;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 64;
        s->v = shoal_xrealloc(s->v, s->cap * sizeof *s->v);
        s->off = shoal_xrealloc(s->off, s->cap * sizeof *s->off);
    }
    s->off[s->n] = s->arena.n;
    s->v[s->n] = (shoal_chat_seg){.text = NULL, .len = len, .special = special};
    s->n++;
    shoal_chatjson_put(&s->arena, text, len);
    shoal_chatjson_put(&s->arena, "", 1); /* keep a NUL after each text */
}

static void text(ctx *c, const char *t) { seg(c, t, strlen(t), 0); }
static void textn(ctx *c, const char *t, size_t n) { seg(c, t, n, 0); }
static void mark(ctx *c, const char *t) { seg(c, t, strlen(t), 1); }

typedef struct {
    const char *key;
    const char *val;
    size_t val_len;
} attr;

/* ` key` `="` escaped-value `"`: four segments, as the encoder writes them */
static void put_attr(ctx *c, const attr *a)
{
    char k[64];
    snprintf(k, sizeof k, " %s", a->key);
    text(c, k);
    text(c, "=\"");
    shoal_chatjson_buf b = {0};
    size_t run = 0;
    for (size_t i = 0; i < a->val_len; i++) {
        /* & first, then ": the order that does not re-escape &quot; */
        const char *e = a->val[i] == '&' ? "&amp;" : a->val[i] == '"' ? "&quot;" : NULL;
        if (!e)
            continue;
        shoal_chatjson_put(&b, a->val + run, i - run);
        shoal_chatjson_puts(&b, e);
        run = i + 1;
    }
    shoal_chatjson_put(&b, a->val + run, a->val_len - run);
    textn(c, b.p, b.n);
    free(b.p);
    text(c, "\"");
}

static void open_tag(ctx *c, const char *tag, const attr *attrs, size_t nattrs)
{
    mark(c, OPEN);
    text(c, tag);
    for (size_t i = 0; i < nattrs; i++)
        put_attr(c, &attrs[i]);
    mark(c, SEP);
}

static void close_tag(ctx *c, const char *tag)
{
    mark(c, CLOSE);
    text(c, tag);
    mark(c, SEP);
}

static attr A(const char *key, const char *val) { return (attr){key, val, strlen(val)}; }

/* ------------------------------------------------------------- helpers -- */

static int fail(ctx *c, int code, const char *fmt, const char *path, const char *what)
{
    char msg[512];
    snprintf(msg, sizeof msg, fmt, path, what);
    return shoal_err_set(c->err, c->errlen, code, "%s", msg);
}

/* Python str.strip() would leave something */
static int has_non_space(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int l = shoal_utf8_step((const uint8_t *)s + i, n - i, &cp);
        if (l <= 0)
            return 1;
        if (!shoal__tok_py_isspace(cp))
            return 1;
        i += (size_t)l;
    }
    return 0;
}

/* Python's dict.get(a, dict.get(b)): the value of a if the key is present
 * (even null), else of b. */
static json_t *get2(const json_t *o, const char *a, const char *b)
{
    json_t *v = json_object_get(o, a);
    return v ? v : json_object_get(o, b);
}

static void internal_system(ctx *c, const char *type, const char *body, size_t body_len)
{
    attr at[] = {A("role", "system"), A("type", type)};
    open_tag(c, "message", at, 2);
    /* the encoder strips the body; every body here is already stripped */
    textn(c, body, body_len);
    close_tag(c, "message");
    mark(c, EOM);
}

static void tool_declare(ctx *c, const json_t *tools, int dynamic)
{
    shoal_chatjson_buf b = {0};
    shoal_chatjson_puts(&b, dynamic ? tool_declare_dynamic_head : tool_declare_head);
    shoal_chatjson_dump(&b, tools, 1);
    shoal_chatjson_puts(&b, "\n```");
    attr at[] = {A("role", "system"), A("type", "tool-declare")};
    open_tag(c, "message", at, 2);
    textn(c, b.p, b.n);
    close_tag(c, "message");
    mark(c, EOM);
    free(b.p);
}

/* content: a string, null/absent, or a list of parts with "text" */
static int content(ctx *c, const json_t *v, const char *path)
{
    if (!v || json_is_null(v))
        return 0;
    if (json_is_string(v)) {
        textn(c, json_string_value(v), json_string_length(v));
        return 0;
    }
    if (!json_is_array(v))
        return fail(c, SHOAL_EINVAL, "%s.content: %s", path,
                    "must be a string, null or an array of text parts");
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *part = json_array_get(v, i);
        char p[128];
        snprintf(p, sizeof p, "%s.content[%zu]", path, i);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (type && (!strcmp(type, "image") || !strcmp(type, "image_url")))
            return fail(c, SHOAL_EUNSUPPORTED, "%s: %s", p, "image parts are not supported (text-only engine)");
        const json_t *t = json_object_get(part, "text");
        if (!json_is_string(t))
            return fail(c, SHOAL_EINVAL, "%s: %s", p, "a part needs a \"text\" string");
        textn(c, json_string_value(t), json_string_length(t));
    }
    return 0;
}

/* The optional name="…" attribute: present when "name" is a non-empty string. */
static int name_attr(ctx *c, const json_t *msg, const char *path, attr *at, size_t *n)
{
    const json_t *nm = json_object_get(msg, "name");
    if (!nm || json_is_null(nm))
        return 0;
    if (!json_is_string(nm))
        return fail(c, SHOAL_EINVAL, "%s.name: %s", path, "must be a string");
    if (json_string_length(nm))
        at[(*n)++] = (attr){"name", json_string_value(nm), json_string_length(nm)};
    return 0;
}

static int is_blank_string(const json_t *v)
{
    return json_is_string(v) && !has_non_space(json_string_value(v), json_string_length(v));
}

/* One typed argument element per member of an arguments object. */
static void argument(ctx *c, const char *key, size_t key_len, const char *type, const char *val,
                     size_t val_len)
{
    attr at[] = {{"key", key, key_len}, A("type", type)};
    open_tag(c, "argument", at, 2);
    textn(c, val, val_len);
    close_tag(c, "argument");
}

static const char *jansson_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_TRUE:
    case JSON_FALSE: return "boolean";
    case JSON_NULL: return "null";
    case JSON_INTEGER:
    case JSON_REAL: return "number";
    case JSON_STRING: return "string";
    case JSON_OBJECT: return "object";
    default: return "array";
    }
}

static int tool_call(ctx *c, const json_t *tc, size_t index, const char *path)
{
    if (!json_is_object(tc))
        return fail(c, SHOAL_EINVAL, "%s: %s", path, "a tool call must be an object");
    /* tool_call.get("function", tool_call) */
    const json_t *fn = json_object_get(tc, "function") ? json_object_get(tc, "function") : tc;
    const json_t *name = json_object_get(fn, "name");
    if (!json_is_object(fn) || !json_is_string(name) || !json_string_length(name))
        return fail(c, SHOAL_EINVAL, "%s.function.name: %s", path, "a non-empty string is required");
    char idx[24];
    snprintf(idx, sizeof idx, "%zu", index);
    attr at[] = {{"tool", json_string_value(name), json_string_length(name)}, A("index", idx)};
    open_tag(c, "call", at, 2);
    const json_t *args = json_object_get(fn, "arguments");
    int rc = 0;
    if (json_is_string(args) && has_non_space(json_string_value(args), json_string_length(args))) {
        shoal_chatjson_members m;
        shoal_chatjson_type ty;
        char jerr[128];
        int prc = shoal_chatjson_parse_object(json_string_value(args), json_string_length(args), &m,
                                              &ty, jerr, sizeof jerr);
        if (prc == SHOAL_EFORMAT) {
            /* not JSON: the model sees back exactly what it emitted */
            attr jt[] = {A("type", "object")};
            open_tag(c, "json", jt, 1);
            textn(c, json_string_value(args), json_string_length(args));
            close_tag(c, "json");
        } else if (prc) {
            rc = fail(c, SHOAL_EINVAL, "%s.function.arguments: %s", path,
                      "must be a JSON object (or text that is not JSON)");
        } else {
            for (size_t i = 0; i < m.n; i++)
                argument(c, m.m[i].key, m.m[i].key_len, shoal_chatjson_type_name(m.m[i].type),
                         m.m[i].text, m.m[i].text_len);
            shoal_chatjson_members_free(&m);
        }
    } else if (json_is_object(args)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)args, k, v)
        {
            if (json_is_string(v)) {
                argument(c, k, strlen(k), "string", json_string_value(v), json_string_length(v));
            } else {
                shoal_chatjson_buf b = {0};
                shoal_chatjson_dump(&b, v, 0);
                argument(c, k, strlen(k), jansson_type_name(v), b.p, b.n);
                free(b.p);
            }
        }
    } else if (args && !json_is_null(args) && !json_is_string(args)) {
        rc = fail(c, SHOAL_EINVAL, "%s.function.arguments: %s", path,
                  "must be a JSON object or a string");
    }
    if (rc)
        return rc;
    close_tag(c, "call");
    return 0;
}

static int assistant(ctx *c, const json_t *msg, const char *path, int partial)
{
    if (c->thinking) {
        /* reasoning_content or reasoning (Python `or`: the first non-empty) */
        const json_t *r = json_object_get(msg, "reasoning_content");
        if (!json_is_string(r) || !json_string_length(r)) {
            if (r && !json_is_null(r) && !json_is_string(r))
                return fail(c, SHOAL_EINVAL, "%s.reasoning_content: %s", path, "must be a string");
            r = json_object_get(msg, "reasoning");
        }
        if (r && !json_is_null(r) && !json_is_string(r))
            return fail(c, SHOAL_EINVAL, "%s.reasoning: %s", path, "must be a string");
        open_tag(c, "think", NULL, 0);
        /* present on every assistant turn; its text only when not blank (but
         * then unstripped) */
        if (r && json_is_string(r) && !is_blank_string(r))
            textn(c, json_string_value(r), json_string_length(r));
        close_tag(c, "think");
    }
    open_tag(c, "response", NULL, 0);
    int rc = content(c, json_object_get(msg, "content"), path);
    if (rc || partial) /* partial: the response element stays open, to be continued */
        return rc;
    close_tag(c, "response");
    const json_t *calls = json_object_get(msg, "tool_calls");
    if (calls && !json_is_null(calls) && !json_is_array(calls))
        return fail(c, SHOAL_EINVAL, "%s.tool_calls: %s", path, "must be an array");
    if (json_array_size(calls)) {
        open_tag(c, "tools", NULL, 0);
        for (size_t i = 0; i < json_array_size(calls); i++) {
            char p[160];
            snprintf(p, sizeof p, "%s.tool_calls[%zu]", path, i);
            rc = tool_call(c, json_array_get(calls, i), i + 1, p);
            if (rc)
                return rc;
        }
        close_tag(c, "tools");
    }
    return 0;
}

/* --------------------------------------------------- tool-result order -- */

typedef struct {
    const json_t *msg;
    size_t src;            /* index in the request */
    const json_t *tool;    /* resolved tool name (a string), or NULL */
} item;

/* str(call_id) for the string and integer ids clients send, pointing into v
 * or into num (>= 24 bytes); 0 if neither. */
static int id_text(const json_t *v, char *num, const char **text, size_t *len)
{
    if (json_is_string(v)) {
        *text = json_string_value(v);
        *len = json_string_length(v);
        return 1;
    }
    if (json_is_integer(v)) {
        int k = snprintf(num, 24, "%lld", (long long)json_integer_value(v));
        *text = num;
        *len = (size_t)k;
        return 1;
    }
    return 0;
}

/* The calls of one assistant message indexed by id: the 1-based position of
 * the first tool_calls entry with each id (every entry counts, id-less ones
 * too). Built once per assistant message that a tool run follows, so matching
 * N results to N calls is O(N), not O(N^2) (a request may carry tens of
 * thousands of calls: docs/CONFIG.md, "Resource bounds"). */
typedef struct {
    const json_t *calls; /* indexed array, or NULL */
    shoal_strmap *map;
    char *nums;          /* integer ids' text, 24 bytes per entry */
} call_index;

static void call_index_build(call_index *x, const json_t *calls)
{
    shoal_strmap_free(x->map);
    free(x->nums);
    size_t n = json_array_size(calls);
    x->calls = calls;
    x->map = shoal_strmap_new();
    x->nums = shoal_xmalloc(24 * (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        const json_t *tc = json_array_get(calls, i);
        const char *t;
        size_t len;
        if (json_is_object(tc) && id_text(json_object_get(tc, "id"), x->nums + 24 * i, &t, &len))
            shoal_strmap_put(x->map, t, len, i + 1, NULL); /* the first entry with an id wins */
    }
}

/* 1-based position of the first call with this id, its function name in
 * *name; 0 if none. */
static size_t find_call(const call_index *x, const char *id, size_t id_len, const json_t **name)
{
    size_t pos;
    if (!shoal_strmap_get(x->map, id, id_len, &pos))
        return 0;
    const json_t *tc = json_array_get(x->calls, pos - 1);
    const json_t *fn = json_object_get(tc, "function");
    *name = json_is_object(fn) ? json_object_get(fn, "name") : json_object_get(tc, "name");
    return pos;
}

static int cmp_pos(const void *a, const void *b)
{
    const size_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0] ? 1 : x[1] < y[1] ? -1 : x[1] > y[1];
}

/* Each run of consecutive tool messages is sorted into the order of the most
 * recent assistant's tool_calls when every one matches a call id; a run that
 * cannot be fully matched is left as it is. */
static item *reorder(const json_t *messages, size_t n)
{
    item *out = shoal_xcalloc(n ? n : 1, sizeof *out);
    const json_t *calls = NULL;
    call_index idx = {0};
    for (size_t i = 0; i < n;) {
        const json_t *m = json_array_get(messages, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (role && !strcmp(role, "assistant")) {
            calls = json_object_get(m, "tool_calls");
            if (!json_is_array(calls))
                calls = NULL;
        }
        if (!role || strcmp(role, "tool")) {
            out[i] = (item){m, i, NULL};
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && json_is_object(json_array_get(messages, j)) &&
               json_string_value(json_object_get(json_array_get(messages, j), "role")) &&
               !strcmp(json_string_value(json_object_get(json_array_get(messages, j), "role")), "tool"))
            j++;
        size_t run = j - i;
        size_t (*key)[3] = shoal_xmalloc(run * sizeof *key);
        const json_t **names = shoal_xmalloc(run * sizeof *names);
        int resolved = 1;
        for (size_t k = 0; k < run; k++) {
            const json_t *tm = json_array_get(messages, i + k);
            char num[24];
            const char *id;
            size_t id_len, pos = 0;
            names[k] = NULL;
            if (calls && id_text(get2(tm, "tool_call_id", "id"), num, &id, &id_len)) {
                if (idx.calls != calls || !idx.map)
                    call_index_build(&idx, calls);
                pos = find_call(&idx, id, id_len, &names[k]);
            }
            if (!pos)
                resolved = 0;
            key[k][0] = pos;
            key[k][1] = k;
            key[k][2] = 0;
        }
        if (resolved)
            qsort(key, run, sizeof *key, cmp_pos);
        for (size_t k = 0; k < run; k++) {
            size_t src = key[k][1];
            out[i + k] = (item){json_array_get(messages, i + src), i + src,
                                resolved && json_is_string(names[src]) ? names[src] : NULL};
        }
        free(key);
        free(names);
        i = j;
    }
    shoal_strmap_free(idx.map);
    free(idx.nums);
    return out;
}

/* ---------------------------------------------------------------- main -- */

static int effort(ctx *c)
{
    if (!c->thinking)
        return 0;
    const char *e = c->o->thinking_effort;
    int medium_ok = c->o->effort_rule == SHOAL_CHAT_EFFORT_TEMPLATE;
    if (!e && c->o->effort_rule == SHOAL_CHAT_EFFORT_TEMPLATE)
        e = "max";
    if (!e)
        return 0;
    if (strcmp(e, "low") && strcmp(e, "high") && strcmp(e, "max") && !(medium_ok && !strcmp(e, "medium")))
        return shoal_err_set(c->err, c->errlen, SHOAL_EINVAL,
                             "thinking_effort \"%s\": supported values are %s", e,
                             medium_ok ? "low, medium, high, max" : "low, high, max");
    shoal_chatjson_buf b = {0};
    shoal_chatjson_puts(&b, effort_body);
    shoal_chatjson_puts(&b, e);
    shoal_chatjson_puts(&b, "`.");
    internal_system(c, "thinking-effort", b.p, b.n);
    free(b.p);
    return 0;
}

static void response_format(ctx *c)
{
    const json_t *rf = c->o->response_format;
    const char *type = json_is_object(rf) ? json_string_value(json_object_get(rf, "type"))
                                          : json_string_value(rf);
    if (!type)
        return;
    if (!strcmp(type, "json_object")) {
        internal_system(c, "response-format", format_object, sizeof format_object - 1);
    } else if (!strcmp(type, "json_schema")) {
        /* the schema under json_schema.schema, json_schema.json_schema, or
         * json_schema itself; "null" when there is none */
        const json_t *js = json_is_object(rf) ? json_object_get(rf, "json_schema") : NULL;
        const json_t *schema = js;
        if (json_is_object(js)) {
            if (json_object_get(js, "schema"))
                schema = json_object_get(js, "schema");
            else if (json_object_get(js, "json_schema"))
                schema = json_object_get(js, "json_schema");
        }
        shoal_chatjson_buf b = {0};
        shoal_chatjson_puts(&b, format_schema);
        if (schema)
            shoal_chatjson_dump(&b, schema, 1);
        else
            shoal_chatjson_puts(&b, "null");
        shoal_chatjson_puts(&b, "\n```");
        internal_system(c, "response-format", b.p, b.n);
        free(b.p);
    }
}

/* The tool-choice and response-format messages that follow the conversation. */
static void tail_system(ctx *c)
{
    const char *choice = json_string_value(c->o->tool_choice);
    if (choice && !strcmp(choice, "required"))
        internal_system(c, "tool-choice", choice_required, sizeof choice_required - 1);
    else if (choice && !strcmp(choice, "none"))
        internal_system(c, "tool-choice", choice_none, sizeof choice_none - 1);
    response_format(c);
}

static int render(ctx *c, const json_t *messages)
{
    if (!json_is_array(messages))
        return shoal_err_set(c->err, c->errlen, SHOAL_EINVAL, "messages: must be an array");
    if (c->o->tools && !json_is_null(c->o->tools) && !json_is_array(c->o->tools))
        return shoal_err_set(c->err, c->errlen, SHOAL_EINVAL, "tools: must be an array");
    if (json_array_size(c->o->tools))
        tool_declare(c, c->o->tools, 0);
    int rc = effort(c);
    if (rc)
        return rc;
    size_t n = json_array_size(messages);
    for (size_t i = 0; i < n; i++) {
        const json_t *m = json_array_get(messages, i);
        char path[64];
        snprintf(path, sizeof path, "messages[%zu]", i);
        if (!json_is_object(m))
            return fail(c, SHOAL_EINVAL, "%s: %s", path, "must be an object");
        const json_t *role = json_object_get(m, "role");
        if (!json_is_string(role))
            return fail(c, SHOAL_EINVAL, "%s.role: %s", path, "a string is required");
        const char *r = json_string_value(role);
        if (strcmp(r, "user") && strcmp(r, "system") && strcmp(r, "assistant") && strcmp(r, "tool"))
            return fail(c, SHOAL_EINVAL, "%s.role: unknown role \"%s\" (user, system, assistant, tool)",
                        path, r);
    }
    item *items = reorder(messages, n);
    /* partial mode: the last message, an assistant one with "partial": true,
     * is left open (no generation prompt); the internal system messages that
     * would follow the conversation come before it */
    const json_t *last = n ? items[n - 1].msg : NULL;
    int partial = last && json_is_true(json_object_get(last, "partial")) &&
                  !strcmp(json_string_value(json_object_get(last, "role")), "assistant");
    if (partial && json_array_size(json_object_get(last, "tool_calls"))) {
        free(items);
        return fail(c, SHOAL_EINVAL, "%s: %s", "messages[last]", "a partial assistant message cannot carry tool_calls");
    }
    const json_t *calls = NULL;
    size_t tool_index = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const json_t *m = items[i].msg;
        char path[64];
        snprintf(path, sizeof path, "messages[%zu]", items[i].src);
        const char *r = json_string_value(json_object_get(m, "role"));
        attr at[3];
        size_t na = 0;
        if (!strcmp(r, "system") && json_array_size(json_object_get(m, "tools"))) {
            tool_declare(c, json_object_get(m, "tools"), 1);
        } else if (!strcmp(r, "user") || !strcmp(r, "system")) {
            at[na++] = A("role", r);
            rc = name_attr(c, m, path, at, &na);
            if (rc)
                break;
            open_tag(c, "message", at, na);
            rc = content(c, json_object_get(m, "content"), path);
            if (rc)
                break;
            close_tag(c, "message");
            mark(c, EOM);
        } else if (!strcmp(r, "assistant")) {
            calls = json_object_get(m, "tool_calls");
            tool_index = 0;
            at[na++] = A("role", "assistant");
            rc = name_attr(c, m, path, at, &na);
            if (rc)
                break;
            if (partial && i == n - 1)
                tail_system(c);
            open_tag(c, "message", at, na);
            rc = assistant(c, m, path, partial && i == n - 1);
            if (rc || (partial && i == n - 1))
                break;
            close_tag(c, "message");
            mark(c, EOM);
        } else { /* tool */
            tool_index++;
            const json_t *name = items[i].tool ? items[i].tool : get2(m, "tool", "name");
            if (name && !json_is_null(name) && !json_is_string(name)) {
                rc = fail(c, SHOAL_EINVAL, "%s.%s: must be a string", path,
                          json_object_get(m, "tool") ? "tool" : "name");
                break;
            }
            if ((!name || json_is_null(name)) && tool_index <= json_array_size(calls)) {
                /* fall back to the call at the same position */
                const json_t *tc = json_array_get(calls, tool_index - 1);
                const json_t *fn = json_object_get(tc, "function") ? json_object_get(tc, "function") : tc;
                name = json_object_get(fn, "name");
            }
            if (!json_is_string(name)) {
                rc = fail(c, SHOAL_EINVAL, "%s: %s", path,
                          "a tool message needs a resolvable tool name: carry \"tool\"/\"name\", or "
                          "match a preceding assistant tool_call by id or order");
                break;
            }
            char idx[24];
            snprintf(idx, sizeof idx, "%zu", tool_index);
            at[na++] = A("role", "tool");
            at[na++] = (attr){"tool", json_string_value(name), json_string_length(name)};
            at[na++] = A("index", idx);
            open_tag(c, "message", at, na);
            rc = content(c, json_object_get(m, "content"), path);
            if (rc)
                break;
            close_tag(c, "message");
            mark(c, EOM);
        }
    }
    free(items);
    if (rc || partial)
        return rc;
    tail_system(c);
    if (!c->o->no_generation_prompt) {
        attr at[] = {A("role", "assistant")};
        open_tag(c, "message", at, 1);
        open_tag(c, c->thinking ? "think" : "response", NULL, 0);
    }
    return 0;
}

int shoal_chat_render(const json_t *messages, const shoal_chat_opts *o, shoal_chat_segs **out,
                      char *err, size_t errlen)
{
    static const shoal_chat_opts defaults = {0};
    *out = NULL;
    shoal_chat_segs *s = shoal_xcalloc(1, sizeof *s);
    ctx c = {.s = s, .o = o ? o : &defaults, .err = err, .errlen = errlen};
    c.thinking = !c.o->thinking_off;
    int rc = render(&c, messages);
    if (rc) {
        shoal_chat_segs_free(s);
        return rc;
    }
    for (size_t i = 0; i < s->n; i++)
        s->v[i].text = s->arena.p + s->off[i];
    *out = s;
    return 0;
}

size_t shoal_chat_segs_count(const shoal_chat_segs *s) { return s->n; }

shoal_chat_seg shoal_chat_segs_get(const shoal_chat_segs *s, size_t i) { return s->v[i]; }

void shoal_chat_segs_free(shoal_chat_segs *s)
{
    if (!s)
        return;
    free(s->v);
    free(s->off);
    free(s->arena.p);
    free(s);
}

int shoal_chat_encode_segs(const shoal_tok *t, const shoal_chat_segs *s, shoal_tok_ids *out,
                           char *err, size_t errlen)
{
    for (size_t i = 0; i < s->n; i++) {
        const shoal_chat_seg *g = &s->v[i];
        if (g->special) {
            int32_t id = shoal_tok_special_id(t, g->text);
            if (id < 0)
                return shoal_err_set(err, errlen, SHOAL_EMODEL,
                                     "chat: the vocabulary has no special token \"%s\"", g->text);
            shoal_tok_ids_push(out, id);
            continue;
        }
        int rc = shoal_tok_encode(t, g->text, g->len, 0, out, err, errlen);
        if (rc)
            return rc;
    }
    return 0;
}

int shoal_chat_encode(const shoal_tok *t, const json_t *messages, const shoal_chat_opts *o,
                      shoal_tok_ids *out, char *err, size_t errlen)
{
    shoal_chat_segs *s;
    int rc = shoal_chat_render(messages, o, &s, err, errlen);
    if (rc)
        return rc;
    rc = shoal_chat_encode_segs(t, s, out, err, errlen);
    shoal_chat_segs_free(s);
    return rc;
}

/* ------------------------------------------------------------- request -- */

int shoal_chat_opts_from_request(const json_t *body, shoal_chat_opts *o, char *err, size_t errlen)
{
    if (!json_is_object(body))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "request: must be a JSON object");
    const json_t *v = json_object_get(body, "tools");
    if (v && !json_is_null(v) && !json_is_array(v))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "tools: must be an array");
    if (v)
        o->tools = v;
    if ((v = json_object_get(body, "tool_choice")))
        o->tool_choice = v;
    if ((v = json_object_get(body, "response_format")))
        o->response_format = v;
    const json_t *kw = json_object_get(body, "chat_template_kwargs");
    if (kw && !json_is_null(kw) && !json_is_object(kw))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "chat_template_kwargs: must be an object");
    if ((v = json_object_get(kw, "thinking")) && !json_is_null(v)) {
        if (!json_is_boolean(v))
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "chat_template_kwargs.thinking: must be a boolean");
        o->thinking_off = json_is_false(v);
    }
    /* later wins: body.reasoning_effort < body.thinking_effort <
     * chat_template_kwargs.reasoning_effort < chat_template_kwargs.thinking_effort */
    static const char *effort_keys[] = {"reasoning_effort", "thinking_effort"};
    const json_t *scopes[] = {body, kw};
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 2; k++) {
            v = json_object_get(scopes[s], effort_keys[k]);
            if (!v || json_is_null(v))
                continue;
            if (!json_is_string(v))
                return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s%s: must be a string",
                                     s ? "chat_template_kwargs." : "", effort_keys[k]);
            o->thinking_effort = json_string_value(v);
        }
    return 0;
}
