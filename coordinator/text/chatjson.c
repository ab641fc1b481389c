/* chatjson: Python-json-compatible parsing and writing for the chat modules
 * (see chatjson.h for why). */
#include "coordinator/text/chatjson.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/strmap.h"

#define MAX_DEPTH 256

void shoal_chatjson_put(shoal_chatjson_buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 64;
        while (c < b->n + n + 1)
            c *= 2;
        b->p = shoal_xrealloc(b->p, c);
        b->cap = c;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void shoal_chatjson_puts(shoal_chatjson_buf *b, const char *s) { shoal_chatjson_put(b, s, strlen(s)); }

void shoal_chatjson_put_string(shoal_chatjson_buf *b, const char *s, size_t n)
{
    shoal_chatjson_put(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc)
            continue;
        shoal_chatjson_put(b, s + run, i - run);
        shoal_chatjson_puts(b, esc);
        run = i + 1;
    }
    shoal_chatjson_put(b, s + run, n - run);
    shoal_chatjson_put(b, "\"", 1);
}

/* Python repr(float): the shortest digits that round-trip, fixed notation for
 * decimal exponents -4..15, else d.ddde+XX. */
static void put_py_float(shoal_chatjson_buf *b, double x)
{
    if (isnan(x)) {
        shoal_chatjson_puts(b, "NaN");
        return;
    }
    if (isinf(x)) {
        shoal_chatjson_puts(b, x < 0 ? "-Infinity" : "Infinity");
        return;
    }
    char tmp[64];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, x);
        if (strtod(tmp, NULL) == x)
            break;
    }
    /* tmp: [-]d[.ddd]e[+-]XX */
    char digits[32];
    int nd = 0, neg = tmp[0] == '-';
    const char *p = tmp + neg;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9')
            digits[nd++] = *p;
    int e = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char out[64];
    int k = 0;
    if (neg)
        out[k++] = '-';
    if (e >= -4 && e < 16) {
        if (e < 0) {
            out[k++] = '0';
            out[k++] = '.';
            for (int i = 0; i < -e - 1; i++)
                out[k++] = '0';
            for (int i = 0; i < nd; i++)
                out[k++] = digits[i];
        } else {
            for (int i = 0; i <= e; i++)
                out[k++] = i < nd ? digits[i] : '0';
            out[k++] = '.';
            if (nd > e + 1)
                for (int i = e + 1; i < nd; i++)
                    out[k++] = digits[i];
            else
                out[k++] = '0';
        }
        out[k] = 0;
    } else {
        out[k++] = digits[0];
        if (nd > 1) {
            out[k++] = '.';
            for (int i = 1; i < nd; i++)
                out[k++] = digits[i];
        }
        k += snprintf(out + k, sizeof out - (size_t)k, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
    shoal_chatjson_puts(b, out);
}

static int cmp_keys(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

void shoal_chatjson_dump(shoal_chatjson_buf *b, const json_t *v, int sort_keys)
{
    char num[32];
    switch (json_typeof(v)) {
    case JSON_NULL: shoal_chatjson_puts(b, "null"); break;
    case JSON_TRUE: shoal_chatjson_puts(b, "true"); break;
    case JSON_FALSE: shoal_chatjson_puts(b, "false"); break;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v));
        shoal_chatjson_puts(b, num);
        break;
    case JSON_REAL: put_py_float(b, json_real_value(v)); break;
    case JSON_STRING: shoal_chatjson_put_string(b, json_string_value(v), json_string_length(v)); break;
    case JSON_ARRAY:
        shoal_chatjson_put(b, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i)
                shoal_chatjson_put(b, ",", 1);
            shoal_chatjson_dump(b, json_array_get(v, i), sort_keys);
        }
        shoal_chatjson_put(b, "]", 1);
        break;
    case JSON_OBJECT: {
        size_t n = json_object_size(v), i = 0;
        const char **keys = shoal_xmalloc((n ? n : 1) * sizeof *keys);
        const char *k;
        json_t *x;
        json_object_foreach((json_t *)v, k, x) keys[i++] = k;
        if (sort_keys)
            qsort(keys, n, sizeof *keys, cmp_keys);
        shoal_chatjson_put(b, "{", 1);
        for (i = 0; i < n; i++) {
            if (i)
                shoal_chatjson_put(b, ",", 1);
            shoal_chatjson_put_string(b, keys[i], strlen(keys[i]));
            shoal_chatjson_put(b, ":", 1);
            shoal_chatjson_dump(b, json_object_get(v, keys[i]), sort_keys);
        }
        shoal_chatjson_put(b, "}", 1);
        free(keys);
        break;
    }
    }
}

/* ------------------------------------------------------------- parsing -- */

typedef struct node node;
struct node {
    shoal_chatjson_type type;
    const char *raw; /* number or literal spelling */
    size_t raw_len;
    char *str;       /* decoded string */
    size_t str_len;
    node **kids;
    char **keys;
    size_t *key_lens;
    size_t nkids, cap;
    shoal_strmap *index; /* key -> kid, once an object has INDEX_FROM members */
};

/* Below this many members a linear scan for a repeated key is cheaper than a
 * map; above it the scan would make a many-key object quadratic. */
#define INDEX_FROM 16

typedef struct {
    const char *s;
    size_t n, i;
    char *err;
    size_t errlen;
    int failed;
} parser;

static void node_free(node *x)
{
    if (!x)
        return;
    for (size_t i = 0; i < x->nkids; i++) {
        node_free(x->kids[i]);
        if (x->keys)
            free(x->keys[i]);
    }
    shoal_strmap_free(x->index);
    free(x->kids);
    free(x->keys);
    free(x->key_lens);
    free(x->str);
    free(x);
}

static node *fail(parser *p, const char *what)
{
    if (!p->failed)
        shoal_err_set(p->err, p->errlen, SHOAL_EFORMAT, "%s at offset %zu", what, p->i);
    p->failed = 1;
    return NULL;
}

static void skip_ws(parser *p)
{
    while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' ||
                           p->s[p->i] == '\r'))
        p->i++;
}

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

static void put_cp(shoal_chatjson_buf *b, unsigned c)
{
    char u[4];
    int k;
    if (c < 0x80) {
        u[0] = (char)c;
        k = 1;
    } else if (c < 0x800) {
        u[0] = (char)(0xC0 | c >> 6);
        u[1] = (char)(0x80 | (c & 63));
        k = 2;
    } else if (c < 0x10000) {
        u[0] = (char)(0xE0 | c >> 12);
        u[1] = (char)(0x80 | ((c >> 6) & 63));
        u[2] = (char)(0x80 | (c & 63));
        k = 3;
    } else {
        u[0] = (char)(0xF0 | c >> 18);
        u[1] = (char)(0x80 | ((c >> 12) & 63));
        u[2] = (char)(0x80 | ((c >> 6) & 63));
        u[3] = (char)(0x80 | (c & 63));
        k = 4;
    }
    shoal_chatjson_put(b, u, (size_t)k);
}

/* at the opening quote; decoded string into *b */
static int parse_string(parser *p, shoal_chatjson_buf *b)
{
    p->i++;
    size_t run = p->i;
    shoal_chatjson_put(b, "", 0);
    for (;;) {
        if (p->i >= p->n) {
            fail(p, "unterminated string");
            return -1;
        }
        unsigned char c = (unsigned char)p->s[p->i];
        if (c == '"') {
            shoal_chatjson_put(b, p->s + run, p->i - run);
            p->i++;
            return 0;
        }
        if (c < 0x20) {
            fail(p, "control character in string");
            return -1;
        }
        if (c != '\\') {
            p->i++;
            continue;
        }
        shoal_chatjson_put(b, p->s + run, p->i - run);
        if (p->i + 1 >= p->n) {
            fail(p, "unterminated escape");
            return -1;
        }
        char e = p->s[p->i + 1];
        p->i += 2;
        switch (e) {
        case '"': shoal_chatjson_put(b, "\"", 1); break;
        case '\\': shoal_chatjson_put(b, "\\", 1); break;
        case '/': shoal_chatjson_put(b, "/", 1); break;
        case 'b': shoal_chatjson_put(b, "\b", 1); break;
        case 'f': shoal_chatjson_put(b, "\f", 1); break;
        case 'n': shoal_chatjson_put(b, "\n", 1); break;
        case 'r': shoal_chatjson_put(b, "\r", 1); break;
        case 't': shoal_chatjson_put(b, "\t", 1); break;
        case 'u': {
            unsigned u;
            if (p->i + 4 > p->n || hex4(p->s + p->i, &u)) {
                fail(p, "invalid \\u escape");
                return -1;
            }
            p->i += 4;
            if (u >= 0xD800 && u <= 0xDBFF && p->i + 6 <= p->n && p->s[p->i] == '\\' &&
                p->s[p->i + 1] == 'u') {
                unsigned u2;
                if (hex4(p->s + p->i + 2, &u2)) {
                    p->i += 2;
                    fail(p, "invalid \\u escape");
                    return -1;
                }
                if (u2 >= 0xDC00 && u2 <= 0xDFFF) {
                    u = 0x10000 + ((u - 0xD800) << 10) + (u2 - 0xDC00);
                    p->i += 6;
                }
            }
            if (u >= 0xD800 && u <= 0xDFFF)
                u = 0xFFFD; /* a lone surrogate: tiktoken would replace it */
            put_cp(b, u);
            break;
        }
        default:
            p->i -= 1;
            fail(p, "invalid escape");
            return -1;
        }
        run = p->i;
    }
}

static node *new_node(shoal_chatjson_type t)
{
    node *x = shoal_xcalloc(1, sizeof *x);
    x->type = t;
    return x;
}

static int lit(parser *p, const char *w)
{
    size_t l = strlen(w);
    if (p->n - p->i >= l && !memcmp(p->s + p->i, w, l)) {
        p->i += l;
        return 1;
    }
    return 0;
}

static node *parse_value(parser *p, int depth);

static void add_kid(node *x, node *kid, char *key, size_t key_len)
{
    if (key) {
        /* json.loads builds a dict: a repeated key keeps its first position
         * and takes the last value */
        size_t at = x->nkids;
        if (x->index) {
            shoal_strmap_get(x->index, key, key_len, &at);
        } else {
            for (size_t i = 0; i < x->nkids; i++)
                if (x->key_lens[i] == key_len && !memcmp(x->keys[i], key, key_len)) {
                    at = i;
                    break;
                }
        }
        if (at < x->nkids) {
            node_free(x->kids[at]);
            x->kids[at] = kid;
            free(key);
            return;
        }
    }
    if (x->nkids == x->cap) {
        x->cap = x->cap ? 2 * x->cap : 4;
        x->kids = shoal_xrealloc(x->kids, x->cap * sizeof *x->kids);
        if (key || x->keys) {
            x->keys = shoal_xrealloc(x->keys, x->cap * sizeof *x->keys);
            x->key_lens = shoal_xrealloc(x->key_lens, x->cap * sizeof *x->key_lens);
        }
    }
    if (key) {
        x->keys[x->nkids] = key;
        x->key_lens[x->nkids] = key_len;
        if (!x->index && x->nkids + 1 >= INDEX_FROM) {
            x->index = shoal_strmap_new();
            for (size_t i = 0; i < x->nkids; i++)
                shoal_strmap_put(x->index, x->keys[i], x->key_lens[i], i, NULL);
        }
        if (x->index)
            shoal_strmap_put(x->index, key, key_len, x->nkids, NULL);
    }
    x->kids[x->nkids++] = kid;
}

static node *parse_value(parser *p, int depth)
{
    if (depth > MAX_DEPTH)
        return fail(p, "nesting too deep");
    skip_ws(p);
    if (p->i >= p->n)
        return fail(p, "expecting value");
    char c = p->s[p->i];
    size_t start = p->i;
    if (c == '{' || c == '[') {
        int obj = c == '{';
        node *x = new_node(obj ? SHOAL_CHATJSON_OBJECT : SHOAL_CHATJSON_ARRAY);
        p->i++;
        skip_ws(p);
        if (p->i < p->n && p->s[p->i] == (obj ? '}' : ']')) {
            p->i++;
            return x;
        }
        for (;;) {
            char *key = NULL;
            size_t key_len = 0;
            if (obj) {
                skip_ws(p);
                if (p->i >= p->n || p->s[p->i] != '"') {
                    node_free(x);
                    return fail(p, "expecting property name");
                }
                shoal_chatjson_buf kb = {0};
                if (parse_string(p, &kb)) {
                    free(kb.p);
                    node_free(x);
                    return NULL;
                }
                key = kb.p;
                key_len = kb.n;
                skip_ws(p);
                if (p->i >= p->n || p->s[p->i] != ':') {
                    free(key);
                    node_free(x);
                    return fail(p, "expecting ':'");
                }
                p->i++;
            }
            node *v = parse_value(p, depth + 1);
            if (!v) {
                free(key);
                node_free(x);
                return NULL;
            }
            add_kid(x, v, key, key_len);
            skip_ws(p);
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                continue;
            }
            if (p->i < p->n && p->s[p->i] == (obj ? '}' : ']')) {
                p->i++;
                return x;
            }
            node_free(x);
            return fail(p, obj ? "expecting ',' or '}'" : "expecting ',' or ']'");
        }
    }
    if (c == '"') {
        node *x = new_node(SHOAL_CHATJSON_STRING);
        shoal_chatjson_buf sb = {0};
        if (parse_string(p, &sb)) {
            free(sb.p);
            node_free(x);
            return NULL;
        }
        x->str = sb.p;
        x->str_len = sb.n;
        return x;
    }
    shoal_chatjson_type t;
    if (lit(p, "null"))
        t = SHOAL_CHATJSON_NULL;
    else if (lit(p, "true") || lit(p, "false"))
        t = SHOAL_CHATJSON_BOOLEAN;
    else if (lit(p, "NaN") || lit(p, "Infinity") || lit(p, "-Infinity"))
        t = SHOAL_CHATJSON_NUMBER;
    else {
        /* -?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)? ; a fraction or exponent
         * without digits ends the number before it (json.loads then fails on
         * the extra data) */
        size_t i = p->i;
        if (i < p->n && p->s[i] == '-')
            i++;
        if (i < p->n && p->s[i] == '0')
            i++;
        else if (i < p->n && p->s[i] >= '1' && p->s[i] <= '9')
            while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9')
                i++;
        else
            return fail(p, "expecting value");
        if (i + 1 < p->n && p->s[i] == '.' && p->s[i + 1] >= '0' && p->s[i + 1] <= '9') {
            i++;
            while (i < p->n && p->s[i] >= '0' && p->s[i] <= '9')
                i++;
        }
        if (i < p->n && (p->s[i] == 'e' || p->s[i] == 'E')) {
            size_t j = i + 1;
            if (j < p->n && (p->s[j] == '+' || p->s[j] == '-'))
                j++;
            if (j < p->n && p->s[j] >= '0' && p->s[j] <= '9') {
                while (j < p->n && p->s[j] >= '0' && p->s[j] <= '9')
                    j++;
                i = j;
            }
        }
        p->i = i;
        t = SHOAL_CHATJSON_NUMBER;
    }
    node *x = new_node(t);
    x->raw = p->s + start;
    x->raw_len = p->i - start;
    return x;
}

static void dump_node(shoal_chatjson_buf *b, const node *x)
{
    switch (x->type) {
    case SHOAL_CHATJSON_STRING: shoal_chatjson_put_string(b, x->str, x->str_len); break;
    case SHOAL_CHATJSON_OBJECT:
    case SHOAL_CHATJSON_ARRAY: {
        int obj = x->type == SHOAL_CHATJSON_OBJECT;
        shoal_chatjson_put(b, obj ? "{" : "[", 1);
        for (size_t i = 0; i < x->nkids; i++) {
            if (i)
                shoal_chatjson_put(b, ",", 1);
            if (obj) {
                shoal_chatjson_put_string(b, x->keys[i], x->key_lens[i]);
                shoal_chatjson_put(b, ":", 1);
            }
            dump_node(b, x->kids[i]);
        }
        shoal_chatjson_put(b, obj ? "}" : "]", 1);
        break;
    }
    default: shoal_chatjson_put(b, x->raw, x->raw_len); break;
    }
}

static node *parse_all(const char *s, size_t n, char *err, size_t errlen)
{
    parser p = {.s = s, .n = n, .i = 0, .err = err, .errlen = errlen, .failed = 0};
    node *x = parse_value(&p, 0);
    if (!x)
        return NULL;
    skip_ws(&p);
    if (p.i != n) {
        node_free(x);
        return fail(&p, "extra data");
    }
    return x;
}

int shoal_chatjson_parse_object(const char *s, size_t n, shoal_chatjson_members *out,
                                shoal_chatjson_type *type_out, char *err, size_t errlen)
{
    out->m = NULL;
    out->n = 0;
    node *x = parse_all(s, n, err, errlen);
    if (!x)
        return SHOAL_EFORMAT;
    if (type_out)
        *type_out = x->type;
    if (x->type != SHOAL_CHATJSON_OBJECT) {
        node_free(x);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "a JSON %s, not an object",
                             shoal_chatjson_type_name(*type_out));
    }
    out->m = shoal_xcalloc(x->nkids ? x->nkids : 1, sizeof *out->m);
    out->n = x->nkids;
    for (size_t i = 0; i < x->nkids; i++) {
        shoal_chatjson_member *m = &out->m[i];
        node *v = x->kids[i];
        m->key = x->keys[i];
        m->key_len = x->key_lens[i];
        x->keys[i] = NULL;
        m->type = v->type;
        if (v->type == SHOAL_CHATJSON_STRING) {
            m->text = v->str;
            m->text_len = v->str_len;
            v->str = NULL;
        } else {
            shoal_chatjson_buf b = {0};
            dump_node(&b, v);
            m->text = b.p;
            m->text_len = b.n;
        }
    }
    node_free(x);
    return 0;
}

void shoal_chatjson_members_free(shoal_chatjson_members *m)
{
    for (size_t i = 0; i < m->n; i++) {
        free(m->m[i].key);
        free(m->m[i].text);
    }
    free(m->m);
    m->m = NULL;
    m->n = 0;
}

int shoal_chatjson_is_type(const char *s, size_t n, shoal_chatjson_type type)
{
    node *x = parse_all(s, n, NULL, 0);
    int ok = x && x->type == type;
    node_free(x);
    return ok;
}

const char *shoal_chatjson_type_name(shoal_chatjson_type t)
{
    switch (t) {
    case SHOAL_CHATJSON_NULL: return "null";
    case SHOAL_CHATJSON_BOOLEAN: return "boolean";
    case SHOAL_CHATJSON_NUMBER: return "number";
    case SHOAL_CHATJSON_STRING: return "string";
    case SHOAL_CHATJSON_OBJECT: return "object";
    case SHOAL_CHATJSON_ARRAY: return "array";
    }
    return "?";
}
