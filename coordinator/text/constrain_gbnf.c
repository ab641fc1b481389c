/* constrain: GBNF grammars (llama.cpp's syntax, docs/API.md "Grammars") as a
 * regular subset: rules are inlined into one regex with recursion bounded
 * (a rule expanded GBNF_DEPTH times along one path is not offered again, so a
 * recursive grammar is cut to the strings of bounded nesting: a subset of its
 * language), then compiled by constrain_re.c. Classes keep their ASCII
 * members ('[^...]' is the ASCII complement): a subset again. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/text/constrain.h"
#include "coordinator/text/constrain_int.h"

#define GBNF_DEPTH 3
#define GBNF_MAX_OUT (256 * 1024)
#define GBNF_MAX_TOK 8192
#define GBNF_MAX_RULES 256

enum { T_LIT, T_CLASS, T_DOT, T_REF, T_LP, T_RP, T_BAR, T_STAR, T_PLUS, T_Q, T_REP, T_DEF };

typedef struct {
    int kind;
    char *s; /* LIT: regex text of the literal; CLASS: regex class; REF / DEF: the name */
    int m, n; /* REP */
} tok;

typedef struct {
    tok *t;
    int nt;
    struct {
        char *name;
        int from, to; /* tokens of the body */
    } r[GBNF_MAX_RULES];
    int nr;
    int onpath[GBNF_MAX_RULES]; /* expansions of each rule on the current path */
    char *err;
    size_t errlen;
    int rc;
    size_t produced;
} gram;

typedef struct {
    char *p;
    size_t n, cap;
} sbuf;

static void put(sbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        while (b->n + n + 1 > b->cap)
            b->cap = b->cap ? b->cap * 2 : 64;
        b->p = shoal_xrealloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void puts_(sbuf *b, const char *s)
{
    put(b, s, strlen(s));
}

static int gfail(gram *g, int code, const char *msg, size_t at)
{
    if (!g->rc)
        g->rc = shoal_err_set(g->err, g->errlen, code, "grammar: %s (at byte %zu)", msg, at);
    return -1;
}

static int hexv(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* one (possibly escaped) character at s[*i] of a literal or class; its code
 * point, or -1 */
static long gchar(const char *s, size_t n, size_t *i)
{
    unsigned char c = (unsigned char)s[*i];
    if (c != '\\') {
        /* UTF-8 */
        int len = c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
        if (!len || *i + (size_t)len > n)
            return -1;
        long cp = len == 1 ? c : c & (0x3f >> (len - 1));
        for (int k = 1; k < len; k++)
            cp = (cp << 6) | ((unsigned char)s[*i + (size_t)k] & 0x3f);
        *i += (size_t)len;
        return cp;
    }
    if (*i + 1 >= n)
        return -1;
    char e = s[*i + 1];
    *i += 2;
    switch (e) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case '\\': return '\\';
    case '"': return '"';
    case '[': return '[';
    case ']': return ']';
    case '-': return '-';
    case '^': return '^';
    case 'x': case 'u': case 'U': {
        int d = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        long v = 0;
        for (int k = 0; k < d; k++) {
            if (*i >= n || hexv((unsigned char)s[*i]) < 0)
                return -1;
            v = v * 16 + hexv((unsigned char)s[(*i)++]);
        }
        return v;
    }
    default:
        return -1;
    }
}

/* a code point as regex text: ASCII escaped as \xHH, others as UTF-8 */
static void put_cp(sbuf *b, long cp)
{
    char t[8];
    if (cp < 0x80) {
        snprintf(t, sizeof t, "\\x%02x", (unsigned)cp);
        puts_(b, t);
        return;
    }
    int n = cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    unsigned char u[4];
    for (int k = n - 1; k > 0; k--) {
        u[k] = (unsigned char)(0x80 | (cp & 0x3f));
        cp >>= 6;
    }
    u[0] = (unsigned char)((n == 2 ? 0xc0 : n == 3 ? 0xe0 : 0xf0) | cp);
    put(b, (const char *)u, (size_t)n);
}

static int add_tok(gram *g, int kind, char *s, int m, int n)
{
    if (g->nt >= GBNF_MAX_TOK)
        return gfail(g, SHOAL_ERANGE, "too long", 0);
    g->t[g->nt++] = (tok){kind, s, m, n};
    return 0;
}

static int lex(gram *g, const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            i++;
        } else if (c == '#') {
            while (i < n && s[i] != '\n')
                i++;
        } else if (c == '"') {
            sbuf b = {0};
            i++;
            puts_(&b, "(?:");
            while (i < n && s[i] != '"') {
                long cp = gchar(s, n, &i);
                if (cp < 0) {
                    free(b.p);
                    return gfail(g, SHOAL_EINVAL, "a bad character or escape in a literal", i);
                }
                put_cp(&b, cp);
            }
            if (i >= n) {
                free(b.p);
                return gfail(g, SHOAL_EINVAL, "an unterminated literal", i);
            }
            i++;
            puts_(&b, ")");
            if (add_tok(g, T_LIT, b.p, 0, 0))
                return free(b.p), -1;
        } else if (c == '[') {
            i++;
            int neg = i < n && s[i] == '^';
            if (neg)
                i++;
            uint8_t in[128] = {0};
            while (i < n && s[i] != ']') {
                long lo = gchar(s, n, &i), hi = lo;
                if (lo >= 0 && i + 1 < n && s[i] == '-' && s[i + 1] != ']') {
                    i++;
                    hi = gchar(s, n, &i);
                }
                if (lo < 0 || hi < lo)
                    return gfail(g, SHOAL_EINVAL, "a bad character class", i);
                for (long x = lo; x <= hi && x < 128; x++)
                    in[x] = 1; /* non-ASCII members are not offered (a subset) */
            }
            if (i >= n)
                return gfail(g, SHOAL_EINVAL, "an unterminated character class", i);
            i++;
            sbuf b = {0};
            int any = 0;
            puts_(&b, "[");
            for (int x = 1; x < 128; x++) {
                int want = neg ? !in[x] && (x >= 0x20 || x == '\t' || x == '\n' || x == '\r') && x != 0x7f : in[x];
                if (want) {
                    char t[8];
                    snprintf(t, sizeof t, "\\x%02x", x);
                    puts_(&b, t);
                    any = 1;
                }
            }
            puts_(&b, "]");
            if (add_tok(g, any ? T_CLASS : T_REF, any ? b.p : NULL, 0, 0)) /* an empty class: never (a NULL ref) */
                return free(b.p), -1;
            if (!any)
                free(b.p);
        } else if (c == '.') {
            i++;
            if (add_tok(g, T_DOT, NULL, 0, 0))
                return -1;
        } else if (c == '(' || c == ')' || c == '|' || c == '*' || c == '+' || c == '?') {
            i++;
            if (add_tok(g, c == '(' ? T_LP : c == ')' ? T_RP : c == '|' ? T_BAR : c == '*' ? T_STAR : c == '+' ? T_PLUS : T_Q,
                        NULL, 0, 0))
                return -1;
        } else if (c == '{') {
            int m = 0, k = -1;
            i++;
            while (i < n && s[i] >= '0' && s[i] <= '9' && m <= 256)
                m = m * 10 + (s[i++] - '0');
            if (i < n && s[i] == ',') {
                i++;
                if (i < n && s[i] >= '0' && s[i] <= '9') {
                    k = 0;
                    while (i < n && s[i] >= '0' && s[i] <= '9' && k <= 256)
                        k = k * 10 + (s[i++] - '0');
                }
            } else {
                k = m;
            }
            if (i >= n || s[i] != '}' || m > 256 || k > 256 || (k >= 0 && k < m))
                return gfail(g, SHOAL_EINVAL, "a bad {m,n} (at most 256)", i);
            i++;
            if (add_tok(g, T_REP, NULL, m, k))
                return -1;
        } else if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                   c == '_') {
            size_t st = i;
            while (i < n && ((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
                             (s[i] >= '0' && s[i] <= '9') || s[i] == '-' || s[i] == '_'))
                i++;
            char *name = shoal_xmalloc(i - st + 1);
            memcpy(name, s + st, i - st);
            name[i - st] = '\0';
            size_t j = i;
            while (j < n && (s[j] == ' ' || s[j] == '\t'))
                j++;
            int def = j + 2 < n && s[j] == ':' && s[j + 1] == ':' && s[j + 2] == '=';
            if (def)
                i = j + 3;
            if (add_tok(g, def ? T_DEF : T_REF, name, 0, 0))
                return free(name), -1;
        } else {
            return gfail(g, SHOAL_EINVAL, "an unexpected character", i);
        }
    }
    /* rules */
    for (int k = 0; k < g->nt; k++) {
        if (g->t[k].kind != T_DEF)
            continue;
        if (g->nr >= GBNF_MAX_RULES)
            return gfail(g, SHOAL_ERANGE, "more than 256 rules", 0);
        for (int q = 0; q < g->nr; q++)
            if (!strcmp(g->r[q].name, g->t[k].s))
                return gfail(g, SHOAL_EINVAL, "a rule defined twice", 0);
        g->r[g->nr].name = g->t[k].s;
        g->r[g->nr].from = k + 1;
        int e = k + 1;
        while (e < g->nt && g->t[e].kind != T_DEF)
            e++;
        g->r[g->nr++].to = e;
    }
    if (g->nt && g->t[0].kind != T_DEF)
        return gfail(g, SHOAL_EINVAL, "text before the first rule", 0);
    return 0;
}

static int find_rule(const gram *g, const char *name)
{
    for (int q = 0; q < g->nr; q++)
        if (!strcmp(g->r[q].name, name))
            return q;
    return -1;
}

/* expansion of tokens [*k, to) as an alternation; returns regex text or NULL
 * (an empty language: only references past the depth bound) */
static char *alt(gram *g, int *k, int to, int depth);

static char *atom(gram *g, int *k, int to, int depth)
{
    tok *t = &g->t[*k];
    (*k)++;
    switch (t->kind) {
    case T_LIT:
    case T_CLASS:
        return shoal_xstrdup(t->s);
    case T_DOT:
        return shoal_xstrdup(".");
    case T_LP: {
        char *a = alt(g, k, to, depth);
        if (*k >= to || g->t[*k].kind != T_RP) {
            free(a);
            gfail(g, SHOAL_EINVAL, "an unbalanced '('", 0);
            return NULL;
        }
        (*k)++;
        return a;
    }
    case T_REF: {
        if (!t->s)
            return NULL; /* an empty class */
        int r = find_rule(g, t->s);
        if (r < 0) {
            char m[120];
            snprintf(m, sizeof m, "rule '%.60s' is not defined", t->s);
            gfail(g, SHOAL_EINVAL, m, 0);
            return NULL;
        }
        if (g->onpath[r] >= GBNF_DEPTH || depth > 64)
            return NULL; /* recursion past the bound: not offered */
        g->onpath[r]++;
        int q = g->r[r].from;
        char *a = alt(g, &q, g->r[r].to, depth + 1);
        g->onpath[r]--;
        if (q != g->r[r].to && !g->rc)
            gfail(g, SHOAL_EINVAL, "an unbalanced ')'", 0);
        return a;
    }
    default:
        gfail(g, SHOAL_EINVAL, "a quantifier or '|' where an item was expected", 0);
        return NULL;
    }
}

static char *seq(gram *g, int *k, int to, int depth)
{
    sbuf b = {0};
    puts_(&b, "");
    int dead = 0;
    while (*k < to && g->t[*k].kind != T_BAR && g->t[*k].kind != T_RP && !g->rc) {
        char *a = atom(g, k, to, depth);
        int q = *k < to ? g->t[*k].kind : -1;
        char post[48] = "";
        int min = 1;
        if (q == T_STAR || q == T_PLUS || q == T_Q || q == T_REP) {
            tok *t = &g->t[*k];
            (*k)++;
            if (q == T_STAR)
                strcpy(post, "*"), min = 0;
            else if (q == T_PLUS)
                strcpy(post, "+");
            else if (q == T_Q)
                strcpy(post, "?"), min = 0;
            else if (t->n < 0)
                snprintf(post, sizeof post, "{%d,}", t->m), min = t->m;
            else
                snprintf(post, sizeof post, "{%d,%d}", t->m, t->n), min = t->m;
        }
        if (!a) {
            if (min > 0)
                dead = 1; /* a required item that cannot be written */
            continue;
        }
        g->produced += strlen(a);
        if (g->produced > GBNF_MAX_OUT) {
            free(a);
            gfail(g, SHOAL_ERANGE, "the grammar expands to too large an automaton", 0);
            break;
        }
        puts_(&b, "(?:");
        puts_(&b, a);
        puts_(&b, ")");
        puts_(&b, post);
        free(a);
    }
    if (dead || g->rc) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

static char *alt(gram *g, int *k, int to, int depth)
{
    sbuf b = {0};
    int any = 0;
    for (;;) {
        char *s = seq(g, k, to, depth);
        if (s) {
            if (any)
                puts_(&b, "|");
            puts_(&b, s);
            any = 1;
            free(s);
        }
        if (*k < to && g->t[*k].kind == T_BAR && !g->rc) {
            (*k)++;
            continue;
        }
        break;
    }
    if (!any || g->rc) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

int shoal__cons_gbnf_to_regex(const char *text, size_t len, char **out, char *err, size_t errlen)
{
    *out = NULL;
    gram *g = shoal_xcalloc(1, sizeof *g);
    g->t = shoal_xcalloc(GBNF_MAX_TOK, sizeof *g->t);
    g->err = err;
    g->errlen = errlen;
    int rc = 0;
    if (lex(g, text, len) == 0) {
        int r = find_rule(g, "root");
        if (r < 0) {
            rc = gfail(g, SHOAL_EINVAL, "no 'root' rule", 0);
        } else {
            int q = g->r[r].from;
            char *a = alt(g, &q, g->r[r].to, 0);
            if (!g->rc && q != g->r[r].to)
                gfail(g, SHOAL_EINVAL, "an unbalanced ')'", 0);
            if (!a && !g->rc)
                gfail(g, SHOAL_EINVAL, "root matches nothing within the recursion bound", 0);
            if (g->rc)
                free(a);
            else
                *out = a;
        }
    }
    rc = g->rc;
    for (int k = 0; k < g->nt; k++)
        free(g->t[k].s);
    free(g->t);
    free(g);
    return rc;
}
