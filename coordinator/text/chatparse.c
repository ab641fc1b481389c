/* chatparse: K3 XTML output parser on token ids (see chatparse.h). A small
 * element stack drives where text goes; tags are collected between the
 * <|open|>/<|close|> id and the next <|sep|> id. */
#include "coordinator/text/chatparse.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"
#include "coordinator/text/chatjson.h"

#define MAX_DEPTH 16
#define MAX_TAG 4096      /* bytes of one tag header; longer is malformed */
#define MAX_ISSUES 64     /* kept; more are counted in the last one */

typedef enum { E_MESSAGE, E_THINK, E_RESPONSE, E_TOOLS, E_CALL, E_ARGUMENT, E_JSON, E_UNKNOWN } elem;

static const char *elem_name[] = {"message", "think", "response", "tools",
                                  "call",    "argument", "json",   "?"};

typedef enum { M_TEXT, M_OPEN, M_CLOSE, M_DONE } mode;

typedef struct {
    char *name;
    char *id;
    char *args;
} call;

struct shoal_chatparse {
    const shoal_tok *t;
    int32_t id_open, id_close, id_sep, id_eom, id_eos;
    shoal_chatparse_cb cb;
    void *ud;
    char *id_prefix;

    mode mode;
    elem stack[MAX_DEPTH];
    int depth;
    shoal_chatjson_buf tag;   /* header or closer being collected */
    int tag_overflow;

    shoal_detok *dt_reason, *dt_content;
    shoal_chatjson_buf reasoning, content;
    shoal_chatjson_buf stray; /* text between elements */

    /* the call being read */
    int in_call;
    char *call_name;
    shoal_chatjson_buf call_args; /* "{...members" */
    int call_nargs;
    shoal_chatjson_buf call_json; /* a json element's raw text */
    int call_has_json;
    char *arg_key;
    char *arg_type;
    shoal_chatjson_buf arg_raw;

    call *calls;
    size_t ncalls, capcalls;
    char **issues;
    size_t nissues, dropped_issues;
    int ended, finished, truncated, after_end_reported;
};

/* ------------------------------------------------------------- helpers -- */

static elem top(const shoal_chatparse *p)
{
    return p->depth > 0 && p->depth <= MAX_DEPTH ? p->stack[p->depth - 1] : E_UNKNOWN;
}

static void emit(shoal_chatparse *p, const shoal_chatparse_event *ev)
{
    if (p->cb)
        p->cb(p->ud, ev);
}

static void issue(shoal_chatparse *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void issue(shoal_chatparse *p, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    /* the message may quote model text cut at a byte limit: keep it UTF-8 */
    char *clean;
    size_t n;
    shoal_utf8_sanitize(buf, strlen(buf), &clean, &n);
    if (p->nissues < MAX_ISSUES) {
        p->issues = shoal_xrealloc(p->issues, (p->nissues + 1) * sizeof *p->issues);
        p->issues[p->nissues++] = clean;
    } else {
        p->dropped_issues++;
        free(clean);
        clean = NULL;
    }
    shoal_chatparse_event ev = {.kind = SHOAL_CHATPARSE_ISSUE, .text = clean ? clean : buf,
                                .len = clean ? n : strlen(buf)};
    emit(p, &ev);
}

static void channel_text(shoal_chatparse *p, int reasoning, const char *s, size_t n)
{
    if (!n)
        return;
    shoal_chatjson_put(reasoning ? &p->reasoning : &p->content, s, n);
    shoal_chatparse_event ev = {.kind = reasoning ? SHOAL_CHATPARSE_REASONING : SHOAL_CHATPARSE_CONTENT,
                                .text = s, .len = n};
    emit(p, &ev);
}

static void channel_bytes(shoal_chatparse *p, int reasoning, const uint8_t *b, size_t n)
{
    const char *s;
    size_t l;
    shoal_detok_feed_bytes(reasoning ? p->dt_reason : p->dt_content, b, n, &s, &l);
    channel_text(p, reasoning, s, l);
}

static void channel_flush(shoal_chatparse *p, int reasoning)
{
    const char *s;
    size_t l;
    shoal_detok_flush(reasoning ? p->dt_reason : p->dt_content, &s, &l);
    channel_text(p, reasoning, s, l);
}

static int is_blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\n' && s[i] != '\r' && s[i] != '\t')
            return 0;
    return 1;
}

/* Text that arrived between elements: reported; kept in content when it is
 * inside the message itself (so nothing the model said is lost). */
static void flush_stray(shoal_chatparse *p)
{
    if (!p->stray.n)
        return;
    if (!is_blank(p->stray.p, p->stray.n)) {
        char *clean;
        size_t n;
        shoal_utf8_sanitize(p->stray.p, p->stray.n, &clean, &n);
        elem where = top(p);
        issue(p, "text outside an element (in %s): \"%.80s\"%s", elem_name[where], clean,
              n > 80 ? "..." : "");
        if (where == E_MESSAGE) {
            channel_flush(p, 0);
            channel_text(p, 0, clean, n);
        }
        free(clean);
    }
    p->stray.n = 0;
}

static void free_call_state(shoal_chatparse *p)
{
    free(p->call_name);
    p->call_name = NULL;
    free(p->arg_key);
    p->arg_key = NULL;
    free(p->arg_type);
    p->arg_type = NULL;
    p->call_args.n = p->call_json.n = p->arg_raw.n = 0;
    p->call_nargs = 0;
    p->call_has_json = 0;
    p->in_call = 0;
}

/* ------------------------------------------------------------ elements -- */

/* Parses `name key="v" key2="v2"`; fills *name and up to 4 attributes
 * (unescaped &quot; &amp;). Returns 0, or -1 when malformed. */
typedef struct {
    char *key, *val;
} kv;

static char *unescape(const char *s, size_t n)
{
    shoal_chatjson_buf b = {0};
    shoal_chatjson_put(&b, "", 0);
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '&' && n - i >= 6 && !memcmp(s + i, "&quot;", 6)) {
            shoal_chatjson_put(&b, "\"", 1);
            i += 5;
        } else if (s[i] == '&' && n - i >= 5 && !memcmp(s + i, "&amp;", 5)) {
            shoal_chatjson_put(&b, "&", 1);
            i += 4;
        } else {
            shoal_chatjson_put(&b, s + i, 1);
        }
    }
    return b.p;
}

static int parse_tag(const char *s, size_t n, char **name, kv *attrs, int *nattrs)
{
    size_t i = 0;
    while (i < n && s[i] != ' ')
        i++;
    if (i == 0)
        return -1;
    *name = shoal_xmalloc(i + 1);
    memcpy(*name, s, i);
    (*name)[i] = 0;
    *nattrs = 0;
    while (i < n) {
        if (s[i] != ' ')
            return -1;
        i++;
        size_t k = i;
        while (i < n && s[i] != '=' && s[i] != ' ')
            i++;
        if (i == k || i + 1 >= n || s[i] != '=' || s[i + 1] != '"')
            return -1;
        size_t ke = i;
        i += 2;
        size_t v = i;
        while (i < n && s[i] != '"')
            i++;
        if (i >= n)
            return -1;
        if (*nattrs < 4) {
            attrs[*nattrs].key = shoal_xmalloc(ke - k + 1);
            memcpy(attrs[*nattrs].key, s + k, ke - k);
            attrs[*nattrs].key[ke - k] = 0;
            attrs[*nattrs].val = unescape(s + v, i - v);
            (*nattrs)++;
        }
        i++;
    }
    return 0;
}

static const char *attr_get(kv *a, int n, const char *key)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(a[i].key, key))
            return a[i].val;
    return NULL;
}

static elem elem_of(const char *name)
{
    for (int e = E_MESSAGE; e < E_UNKNOWN; e++)
        if (!strcmp(name, elem_name[e]))
            return (elem)e;
    return E_UNKNOWN;
}

/* whether child may open inside parent */
static int allowed(elem parent, elem child)
{
    switch (child) {
    case E_THINK:
    case E_RESPONSE:
    case E_TOOLS: return parent == E_MESSAGE;
    case E_CALL: return parent == E_TOOLS;
    case E_ARGUMENT:
    case E_JSON: return parent == E_CALL;
    default: return 0;
    }
}

static void push(shoal_chatparse *p, elem e)
{
    if (p->depth < MAX_DEPTH)
        p->stack[p->depth] = e;
    p->depth++;
}

static void open_element(shoal_chatparse *p)
{
    char *name = NULL;
    kv a[4];
    int na = 0;
    elem parent = top(p);
    char *tag;
    size_t tag_len;
    /* tag bytes come from the model: make them UTF-8 before they reach names,
     * keys and JSON */
    shoal_utf8_sanitize(p->tag.p ? p->tag.p : "", p->tag.n, &tag, &tag_len);
    if (p->tag_overflow || parse_tag(tag, tag_len, &name, a, &na)) {
        issue(p, "malformed tag \"%.80s\"", tag);
        push(p, E_UNKNOWN);
        goto out;
    }
    elem e = elem_of(name);
    if (e == E_UNKNOWN || !allowed(parent, e)) {
        issue(p, "element <%s> not expected inside <%s>", name, elem_name[parent]);
        push(p, E_UNKNOWN);
        goto out;
    }
    if (e == E_CALL) {
        free_call_state(p);
        p->in_call = 1;
        const char *tool = attr_get(a, na, "tool");
        p->call_name = tool && *tool ? shoal_xstrdup(tool) : NULL;
        shoal_chatjson_put(&p->call_args, "", 0);
    } else if (e == E_ARGUMENT) {
        const char *key = attr_get(a, na, "key"), *type = attr_get(a, na, "type");
        free(p->arg_key);
        free(p->arg_type);
        p->arg_key = key ? shoal_xstrdup(key) : NULL;
        p->arg_type = shoal_xstrdup(type ? type : "string");
        p->arg_raw.n = 0;
        shoal_chatjson_put(&p->arg_raw, "", 0);
    } else if (e == E_JSON) {
        p->call_json.n = 0;
        shoal_chatjson_put(&p->call_json, "", 0);
    }
    push(p, e);
out:
    free(tag);
    free(name);
    for (int i = 0; i < na; i++) {
        free(a[i].key);
        free(a[i].val);
    }
}

static void finish_argument(shoal_chatparse *p)
{
    if (!p->arg_key) {
        issue(p, "argument without a key in call \"%s\" (dropped)", p->call_name ? p->call_name : "?");
        return;
    }
    char *raw;
    size_t n;
    shoal_utf8_sanitize(p->arg_raw.p ? p->arg_raw.p : "", p->arg_raw.n, &raw, &n);
    if (p->call_nargs++)
        shoal_chatjson_put(&p->call_args, ",", 1);
    shoal_chatjson_put_string(&p->call_args, p->arg_key, strlen(p->arg_key));
    shoal_chatjson_put(&p->call_args, ":", 1);
    static const struct {
        const char *name;
        shoal_chatjson_type type;
    } types[] = {{"number", SHOAL_CHATJSON_NUMBER}, {"boolean", SHOAL_CHATJSON_BOOLEAN},
                 {"null", SHOAL_CHATJSON_NULL},     {"object", SHOAL_CHATJSON_OBJECT},
                 {"array", SHOAL_CHATJSON_ARRAY}};
    int done = 0;
    if (strcmp(p->arg_type, "string")) {
        size_t i;
        for (i = 0; i < sizeof types / sizeof types[0]; i++)
            if (!strcmp(types[i].name, p->arg_type))
                break;
        if (i == sizeof types / sizeof types[0])
            issue(p, "argument \"%s\" has unknown type \"%s\" (sent as a string)", p->arg_key, p->arg_type);
        else if (!shoal_chatjson_is_type(raw, n, types[i].type))
            issue(p, "argument \"%s\" is not a JSON %s: \"%.60s\" (sent as a string)", p->arg_key,
                  p->arg_type, raw);
        else if (types[i].type == SHOAL_CHATJSON_NUMBER && (strstr(raw, "NaN") || strstr(raw, "Infinity")))
            issue(p, "argument \"%s\" is %s, not valid JSON (sent as a string)", p->arg_key, raw);
        else {
            shoal_chatjson_put(&p->call_args, raw, n);
            done = 1;
        }
    }
    if (!done)
        shoal_chatjson_put_string(&p->call_args, raw, n);
    free(raw);
}

static void finish_call(shoal_chatparse *p)
{
    if (!p->call_name) {
        issue(p, "tool call without a tool name (dropped)");
        free_call_state(p);
        return;
    }
    shoal_chatjson_buf args = {0};
    if (p->call_has_json) {
        char *raw;
        size_t n;
        shoal_utf8_sanitize(p->call_json.p ? p->call_json.p : "", p->call_json.n, &raw, &n);
        if (p->call_nargs)
            issue(p, "call \"%s\" has both argument and json elements (json kept)", p->call_name);
        if (!shoal_chatjson_is_type(raw, n, SHOAL_CHATJSON_OBJECT))
            issue(p, "call \"%s\": json arguments are not a JSON object (passed as written)", p->call_name);
        shoal_chatjson_put(&args, raw, n);
        free(raw);
    } else {
        shoal_chatjson_put(&args, "{", 1);
        shoal_chatjson_put(&args, p->call_args.p ? p->call_args.p : "", p->call_args.n);
        shoal_chatjson_put(&args, "}", 1);
    }
    if (p->ncalls == p->capcalls) {
        p->capcalls = p->capcalls ? 2 * p->capcalls : 4;
        p->calls = shoal_xrealloc(p->calls, p->capcalls * sizeof *p->calls);
    }
    char id[160];
    snprintf(id, sizeof id, "%s%zu", p->id_prefix, p->ncalls);
    call *c = &p->calls[p->ncalls++];
    c->name = p->call_name;
    p->call_name = NULL;
    c->id = shoal_xstrdup(id);
    c->args = args.p;
    shoal_chatparse_event ev = {.kind = SHOAL_CHATPARSE_TOOL_CALL, .index = (int)(p->ncalls - 1),
                                .id = c->id, .name = c->name, .arguments = c->args};
    emit(p, &ev);
    free_call_state(p);
}

/* Pops the top element, finishing what it built. */
static void pop(shoal_chatparse *p, int implicit)
{
    elem e = top(p);
    p->depth--;
    if (implicit && e != E_MESSAGE && e != E_UNKNOWN)
        issue(p, "<%s> was not closed", elem_name[e]);
    switch (e) {
    case E_THINK: channel_flush(p, 1); break;
    case E_RESPONSE: channel_flush(p, 0); break;
    case E_ARGUMENT:
        if (!implicit || !p->truncated)
            finish_argument(p);
        break;
    case E_JSON:
        p->call_has_json = 1;
        break;
    case E_CALL:
        if (implicit && p->truncated) {
            issue(p, "tool call \"%s\" cut off (not returned): \"%.120s\"",
                  p->call_name ? p->call_name : "?", p->call_args.p ? p->call_args.p : "");
            free_call_state(p);
        } else {
            finish_call(p);
        }
        break;
    default: break;
    }
}

static void close_element(shoal_chatparse *p)
{
    char name[64];
    size_t n = p->tag.n < sizeof name - 1 ? p->tag.n : sizeof name - 1;
    memcpy(name, p->tag.p ? p->tag.p : "", n);
    name[n] = 0;
    elem e = p->tag_overflow ? E_UNKNOWN : elem_of(name);
    /* the innermost open element of that name */
    int at = -1;
    for (int i = (p->depth < MAX_DEPTH ? p->depth : MAX_DEPTH) - 1; i >= 0 && e != E_UNKNOWN; i--)
        if (p->stack[i] == e) {
            at = i;
            break;
        }
    if (at < 0) {
        if (p->depth && top(p) == E_UNKNOWN) {
            p->depth--; /* closes the unknown element it matches, whatever its name */
            return;
        }
        issue(p, "closer </%s> matches no open element", name);
        return;
    }
    while (p->depth - 1 > at)
        pop(p, 1);
    pop(p, 0);
}

/* ---------------------------------------------------------------- API -- */

int shoal_chatparse_open(shoal_chatparse **out, const shoal_tok *t, const shoal_chatparse_opts *o,
                         char *err, size_t errlen)
{
    *out = NULL;
    static const char *names[] = {"<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"};
    int32_t ids[4];
    for (int i = 0; i < 4; i++) {
        ids[i] = shoal_tok_special_id(t, names[i]);
        if (ids[i] < 0)
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "chatparse: the vocabulary has no %s",
                                 names[i]);
    }
    shoal_chatparse *p = shoal_xcalloc(1, sizeof *p);
    p->t = t;
    p->id_open = ids[0];
    p->id_close = ids[1];
    p->id_sep = ids[2];
    p->id_eom = ids[3];
    p->id_eos = shoal_tok_eos_id(t);
    p->cb = o ? o->on_event : NULL;
    p->ud = o ? o->ud : NULL;
    const char *pre = o && o->id_prefix ? o->id_prefix : "call_";
    size_t prelen;
    shoal_utf8_sanitize(pre, strlen(pre), &p->id_prefix, &prelen);
    shoal_detok_open(&p->dt_reason, t, NULL);
    shoal_detok_open(&p->dt_content, t, NULL);
    push(p, E_MESSAGE);
    push(p, o && o->thinking_off ? E_RESPONSE : E_THINK);
    p->mode = M_TEXT;
    *out = p;
    return 0;
}

void shoal_chatparse_close(shoal_chatparse *p)
{
    if (!p)
        return;
    shoal_detok_close(p->dt_reason);
    shoal_detok_close(p->dt_content);
    free(p->reasoning.p);
    free(p->content.p);
    free(p->stray.p);
    free(p->tag.p);
    free_call_state(p);
    free(p->call_args.p);
    free(p->call_json.p);
    free(p->arg_raw.p);
    for (size_t i = 0; i < p->ncalls; i++) {
        free(p->calls[i].name);
        free(p->calls[i].id);
        free(p->calls[i].args);
    }
    free(p->calls);
    for (size_t i = 0; i < p->nissues; i++)
        free(p->issues[i]);
    free(p->issues);
    free(p->id_prefix);
    free(p);
}

static void text_bytes(shoal_chatparse *p, const uint8_t *b, size_t n)
{
    switch (top(p)) {
    case E_THINK: channel_bytes(p, 1, b, n); break;
    case E_RESPONSE: channel_bytes(p, 0, b, n); break;
    case E_ARGUMENT: shoal_chatjson_put(&p->arg_raw, (const char *)b, n); break;
    case E_JSON: shoal_chatjson_put(&p->call_json, (const char *)b, n); break;
    case E_UNKNOWN:
        /* inside an element already reported: its text goes with it */
        shoal_chatjson_put(&p->stray, (const char *)b, n);
        break;
    default: shoal_chatjson_put(&p->stray, (const char *)b, n); break;
    }
}

static void end_message(shoal_chatparse *p)
{
    flush_stray(p);
    if (p->mode == M_OPEN || p->mode == M_CLOSE)
        issue(p, "tag \"%.40s\" left unfinished", p->tag.p ? p->tag.p : "");
    while (p->depth > 0)
        pop(p, 1);
    p->mode = M_DONE;
}

int shoal_chatparse_feed(shoal_chatparse *p, int32_t id)
{
    if (p->finished || p->ended) {
        if (!p->after_end_reported) {
            issue(p, "ids after the end of the message (ignored)");
            p->after_end_reported = 1;
        }
        return 0;
    }
    if (id == p->id_eom || (id >= 0 && id == p->id_eos)) {
        end_message(p);
        p->ended = 1;
        return 1;
    }
    if (id == p->id_open || id == p->id_close) {
        if (p->mode != M_TEXT)
            issue(p, "tag \"%.40s\" interrupted by another tag", p->tag.p ? p->tag.p : "");
        flush_stray(p);
        p->mode = id == p->id_open ? M_OPEN : M_CLOSE;
        p->tag.n = 0;
        p->tag_overflow = 0;
        return 0;
    }
    if (id == p->id_sep) {
        if (p->mode == M_OPEN)
            open_element(p);
        else if (p->mode == M_CLOSE)
            close_element(p);
        else
            issue(p, "<|sep|> outside a tag (ignored)");
        p->mode = M_TEXT;
        return 0;
    }
    size_t n;
    const uint8_t *b = shoal_tok_token_bytes(p->t, id, &n);
    if (!b) {
        issue(p, "id %d is not in the vocabulary (ignored)", id);
        return 0;
    }
    if (shoal_tok_is_special(p->t, id)) {
        issue(p, "special token %.*s in the output (ignored)", (int)n, (const char *)b);
        return 0;
    }
    if (p->mode == M_OPEN || p->mode == M_CLOSE) {
        if (p->tag.n + n > MAX_TAG)
            p->tag_overflow = 1;
        else
            shoal_chatjson_put(&p->tag, (const char *)b, n);
        return 0;
    }
    text_bytes(p, b, n);
    return 0;
}

void shoal_chatparse_finish(shoal_chatparse *p, int truncated)
{
    if (p->finished)
        return;
    p->finished = 1;
    if (!p->ended) {
        p->truncated = truncated;
        if (!truncated)
            issue(p, "output ended without <|end_of_msg|>");
        end_message(p);
    }
    if (p->dropped_issues) {
        char b[64];
        snprintf(b, sizeof b, "... and %zu more issues", p->dropped_issues);
        p->issues[p->nissues - 1] = shoal_xrealloc(p->issues[p->nissues - 1], strlen(b) + 1);
        strcpy(p->issues[p->nissues - 1], b);
    }
}

const char *shoal_chatparse_reasoning(const shoal_chatparse *p, size_t *len)
{
    *len = p->reasoning.n;
    return p->reasoning.p ? p->reasoning.p : "";
}

const char *shoal_chatparse_content(const shoal_chatparse *p, size_t *len)
{
    *len = p->content.n;
    return p->content.p ? p->content.p : "";
}

size_t shoal_chatparse_n_tool_calls(const shoal_chatparse *p) { return p->ncalls; }

const char *shoal_chatparse_tool_call(const shoal_chatparse *p, size_t i, const char **id,
                                      const char **arguments)
{
    if (i >= p->ncalls)
        return NULL;
    if (id)
        *id = p->calls[i].id;
    if (arguments)
        *arguments = p->calls[i].args;
    return p->calls[i].name;
}

const char *shoal_chatparse_finish_reason(const shoal_chatparse *p)
{
    if (!p->finished && !p->ended)
        return NULL;
    if (p->truncated)
        return "length";
    return p->ncalls ? "tool_calls" : "stop";
}

size_t shoal_chatparse_n_issues(const shoal_chatparse *p) { return p->nissues; }

const char *shoal_chatparse_issue(const shoal_chatparse *p, size_t i)
{
    return i < p->nissues ? p->issues[i] : NULL;
}

json_t *shoal_chatparse_message(const shoal_chatparse *p)
{
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string("assistant"));
    if (p->content.n || !p->ncalls)
        json_object_set_new(m, "content", json_stringn(p->content.p ? p->content.p : "", p->content.n));
    else
        json_object_set_new(m, "content", json_null());
    if (p->reasoning.n)
        json_object_set_new(m, "reasoning_content", json_stringn(p->reasoning.p, p->reasoning.n));
    if (p->ncalls) {
        json_t *a = json_array();
        for (size_t i = 0; i < p->ncalls; i++) {
            json_t *fn = json_object();
            json_object_set_new(fn, "name", json_string(p->calls[i].name));
            json_object_set_new(fn, "arguments", json_string(p->calls[i].args));
            json_t *c = json_object();
            json_object_set_new(c, "id", json_string(p->calls[i].id));
            json_object_set_new(c, "type", json_string("function"));
            json_object_set_new(c, "function", fn);
            json_array_append_new(a, c);
        }
        json_object_set_new(m, "tool_calls", a);
    }
    return m;
}
