/* constrain: the regex subset (constrain_int.h, docs/API.md "Regex subset"):
 * parse to a syntax tree, Thompson NFA, subset construction into the
 * constraint's DFA pool, dead states pruned. Every stage is bounded (tree
 * nodes, repetition counts, NFA states, DFA states) so a hostile pattern is
 * refused with SHOAL_ERANGE instead of blowing up. Matching is over bytes;
 * '.', \W \D \S and negated classes match ASCII only (a subset of Python's
 * re, so whatever matches here matches there). */
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/text/constrain.h"
#include "coordinator/text/constrain_int.h"

#define MAX_AST 8192
#define MAX_REP 256
#define MAX_NFA 40000

enum { A_SET, A_CAT, A_ALT, A_REP, A_EMPTY };

typedef struct {
    uint8_t bits[32];
} byteset;

typedef struct {
    int kind, a, b, min, max; /* REP: a, min, max (-1: unbounded); SET: a = set index */
} ast;

typedef struct {
    const unsigned char *s;
    size_t n, i;
    int json_str;
    ast *t;
    int nt;
    byteset *sets;
    int nsets;
    char *err;
    size_t errlen;
    int rc;
} parser;

static void set_add(byteset *s, int c)
{
    s->bits[c >> 3] |= (uint8_t)(1u << (c & 7));
}

static int set_has(const byteset *s, int c)
{
    return (s->bits[c >> 3] >> (c & 7)) & 1;
}

static int fail(parser *p, int code, const char *msg)
{
    if (!p->rc)
        p->rc = shoal_err_set(p->err, p->errlen, code, "regex: %s at offset %zu", msg, p->i);
    return -1;
}

static int node(parser *p, int kind, int a, int b)
{
    if (p->nt >= MAX_AST)
        return fail(p, SHOAL_ERANGE, "the pattern is too long");
    p->t[p->nt] = (ast){.kind = kind, .a = a, .b = b};
    return p->nt++;
}

static void universe(parser *p, byteset *s)
{
    for (int c = 0x20; c < 0x7f; c++)
        set_add(s, c);
    if (!p->json_str) {
        set_add(s, '\t');
        set_add(s, '\n');
        set_add(s, '\r');
    }
}

/* a finished set: strip what a JSON string cannot hold raw */
static int set_node(parser *p, byteset s)
{
    if (p->json_str) {
        for (int c = 0; c < 0x20; c++)
            s.bits[c >> 3] &= (uint8_t)~(1u << (c & 7));
        s.bits['"' >> 3] &= (uint8_t)~(1u << ('"' & 7));
        s.bits['\\' >> 3] &= (uint8_t)~(1u << ('\\' & 7));
    }
    if (p->nsets >= MAX_AST)
        return fail(p, SHOAL_ERANGE, "the pattern is too long");
    p->sets[p->nsets] = s;
    return node(p, A_SET, p->nsets++, 0);
}

static void complement(parser *p, byteset *s)
{
    byteset u = {0};
    universe(p, &u);
    for (int i = 0; i < 32; i++)
        s->bits[i] = u.bits[i] & (uint8_t)~s->bits[i];
}

/* \d \w \s and their negations into s; returns 1 if c was a class letter */
static int class_escape(parser *p, int c, byteset *s)
{
    byteset t = {0};
    int neg = 0;
    switch (c) {
    case 'D': neg = 1; /* fall through */
    case 'd':
        for (int x = '0'; x <= '9'; x++)
            set_add(&t, x);
        break;
    case 'W': neg = 1; /* fall through */
    case 'w':
        for (int x = '0'; x <= '9'; x++)
            set_add(&t, x);
        for (int x = 'a'; x <= 'z'; x++) {
            set_add(&t, x);
            set_add(&t, x - 32);
        }
        set_add(&t, '_');
        break;
    case 'S': neg = 1; /* fall through */
    case 's':
        set_add(&t, ' ');
        set_add(&t, '\t');
        set_add(&t, '\n');
        set_add(&t, '\r');
        set_add(&t, '\f');
        set_add(&t, '\v');
        break;
    default:
        return 0;
    }
    if (neg)
        complement(p, &t);
    for (int i = 0; i < 32; i++)
        s->bits[i] |= t.bits[i];
    return 1;
}

static int hexv(int c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* one escaped character (not a class): its byte, or -1 after fail */
static int escape_char(parser *p)
{
    if (p->i >= p->n)
        return fail(p, SHOAL_EUNSUPPORTED, "a trailing backslash");
    int c = p->s[p->i++];
    switch (c) {
    case 'n': return '\n';
    case 't': return '\t';
    case 'r': return '\r';
    case 'f': return '\f';
    case 'v': return '\v';
    case 'x': {
        if (p->i + 2 > p->n || hexv(p->s[p->i]) < 0 || hexv(p->s[p->i + 1]) < 0)
            return fail(p, SHOAL_EUNSUPPORTED, "\\x needs two hex digits");
        int v = hexv(p->s[p->i]) * 16 + hexv(p->s[p->i + 1]);
        p->i += 2;
        if (v >= 0x80)
            return fail(p, SHOAL_EUNSUPPORTED, "\\x above 7f");
        return v;
    }
    default:
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c >= 0x80) {
            p->i--;
            return fail(p, SHOAL_EUNSUPPORTED, "an unsupported escape (word boundaries, back references, \\u, ...)");
        }
        return c;
    }
}

static int parse_alt(parser *p, int depth);

static int parse_class(parser *p)
{
    byteset s = {0};
    int neg = 0, first = 1;
    if (p->i < p->n && p->s[p->i] == '^') {
        neg = 1;
        p->i++;
    }
    for (;;) {
        if (p->i >= p->n)
            return fail(p, SHOAL_EUNSUPPORTED, "an unterminated character class");
        int c = p->s[p->i];
        if (c == ']' && !first) {
            p->i++;
            break;
        }
        first = 0;
        if (c == '[' && p->i + 1 < p->n && (p->s[p->i + 1] == ':' || p->s[p->i + 1] == '=' || p->s[p->i + 1] == '.'))
            return fail(p, SHOAL_EUNSUPPORTED, "POSIX classes");
        int lo;
        p->i++;
        if (c >= 0x80)
            return fail(p, SHOAL_EUNSUPPORTED, "a non-ASCII character in a class");
        if (c == '\\') {
            if (p->i < p->n && class_escape(p, p->s[p->i], &s)) {
                p->i++;
                continue;
            }
            if ((lo = escape_char(p)) < 0)
                return -1;
        } else {
            lo = c;
        }
        int hi = lo;
        if (p->i + 1 < p->n && p->s[p->i] == '-' && p->s[p->i + 1] != ']') {
            p->i++;
            int d = p->s[p->i++];
            if (d >= 0x80)
                return fail(p, SHOAL_EUNSUPPORTED, "a non-ASCII character in a class");
            if (d == '\\') {
                if ((d = escape_char(p)) < 0)
                    return -1;
            }
            hi = d;
            if (hi < lo)
                return fail(p, SHOAL_EINVAL, "a reversed range in a class");
        }
        for (int x = lo; x <= hi; x++)
            set_add(&s, x);
    }
    if (neg)
        complement(p, &s);
    return set_node(p, s);
}

static int parse_atom(parser *p, int depth)
{
    int c = p->s[p->i];
    if (c == '(') {
        p->i++;
        if (p->i < p->n && p->s[p->i] == '?') {
            if (p->i + 1 < p->n && p->s[p->i + 1] == ':') {
                p->i += 2;
            } else if (p->i + 2 < p->n && p->s[p->i + 1] == 'P' && p->s[p->i + 2] == '<') {
                while (p->i < p->n && p->s[p->i] != '>')
                    p->i++;
                if (p->i >= p->n)
                    return fail(p, SHOAL_EINVAL, "an unterminated group name");
                p->i++;
            } else {
                return fail(p, SHOAL_EUNSUPPORTED, "lookaround and inline flags");
            }
        }
        int a = parse_alt(p, depth + 1);
        if (a < 0)
            return -1;
        if (p->i >= p->n || p->s[p->i] != ')')
            return fail(p, SHOAL_EINVAL, "an unbalanced '('");
        p->i++;
        return a;
    }
    if (c == '[') {
        p->i++;
        return parse_class(p);
    }
    if (c == '.') {
        p->i++;
        byteset s = {0};
        universe(p, &s);
        return set_node(p, s);
    }
    if (c == '^' || c == '$')
        return fail(p, SHOAL_EUNSUPPORTED, "'^' or '$' other than at the ends");
    if (c == '*' || c == '+' || c == '?' || c == '{')
        return fail(p, SHOAL_EINVAL, "a quantifier with nothing to repeat");
    if (c == ')')
        return fail(p, SHOAL_EINVAL, "an unbalanced ')'");
    p->i++;
    byteset s = {0};
    if (c == '\\') {
        if (p->i < p->n && class_escape(p, p->s[p->i], &s)) {
            p->i++;
            return set_node(p, s);
        }
        int v = escape_char(p);
        if (v < 0)
            return -1;
        set_add(&s, v);
        return set_node(p, s);
    }
    if (c < 0x80) {
        set_add(&s, c);
        return set_node(p, s);
    }
    /* a UTF-8 sequence is one atom (a quantifier repeats the character) */
    int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 0;
    if (!len || p->i - 1 + (size_t)len > p->n)
        return fail(p, SHOAL_EINVAL, "invalid UTF-8");
    set_add(&s, c);
    int a = set_node(p, s);
    for (int k = 1; k < len && a >= 0; k++) {
        byteset t = {0};
        int cc = p->s[p->i++];
        if ((cc & 0xc0) != 0x80)
            return fail(p, SHOAL_EINVAL, "invalid UTF-8");
        set_add(&t, cc);
        int b = set_node(p, t);
        if (b < 0)
            return -1;
        a = node(p, A_CAT, a, b);
    }
    return a;
}

static int parse_num(parser *p, int *v)
{
    int n = 0, any = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        n = n * 10 + (p->s[p->i++] - '0');
        any = 1;
        if (n > MAX_REP)
            return fail(p, SHOAL_ERANGE, "a repetition count above 256");
    }
    *v = any ? n : -2;
    return 0;
}

static int parse_rep(parser *p, int depth)
{
    int a = parse_atom(p, depth);
    while (a >= 0 && p->i < p->n) {
        int c = p->s[p->i], min, max;
        if (c == '*') {
            min = 0, max = -1;
            p->i++;
        } else if (c == '+') {
            min = 1, max = -1;
            p->i++;
        } else if (c == '?') {
            min = 0, max = 1;
            p->i++;
        } else if (c == '{') {
            size_t save = p->i++;
            if (parse_num(p, &min))
                return -1;
            if (min == -2) { /* a literal '{' as Python reads it */
                p->i = save;
                return a;
            }
            max = min;
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                if (parse_num(p, &max))
                    return -1;
                if (max == -2)
                    max = -1;
            }
            if (p->i >= p->n || p->s[p->i] != '}')
                return fail(p, SHOAL_EINVAL, "an unterminated {m,n}");
            p->i++;
            if (max >= 0 && max < min)
                return fail(p, SHOAL_EINVAL, "{m,n} with n < m");
        } else {
            break;
        }
        if (p->i < p->n && p->s[p->i] == '?')
            p->i++; /* lazy: the same language */
        else if (p->i < p->n && p->s[p->i] == '+')
            return fail(p, SHOAL_EUNSUPPORTED, "possessive quantifiers");
        int r = node(p, A_REP, a, 0);
        if (r < 0)
            return -1;
        p->t[r].min = min;
        p->t[r].max = max;
        a = r;
    }
    return a;
}

static int parse_cat(parser *p, int depth)
{
    int a = -1;
    while (p->i < p->n && p->s[p->i] != '|' && p->s[p->i] != ')') {
        int b = parse_rep(p, depth);
        if (b < 0)
            return -1;
        a = a < 0 ? b : node(p, A_CAT, a, b);
        if (a < 0)
            return -1;
    }
    return a < 0 ? node(p, A_EMPTY, 0, 0) : a;
}

static int parse_alt(parser *p, int depth)
{
    if (depth > 64)
        return fail(p, SHOAL_ERANGE, "groups nested deeper than 64");
    int a = parse_cat(p, depth);
    while (a >= 0 && p->i < p->n && p->s[p->i] == '|') {
        p->i++;
        int b = parse_cat(p, depth);
        if (b < 0)
            return -1;
        a = node(p, A_ALT, a, b);
    }
    return a;
}

/* ---- NFA ---------------------------------------------------------------- */

enum { N_SET, N_SPLIT, N_MATCH };

typedef struct {
    int kind, set, o1, o2;
} nstate;

typedef struct {
    nstate *s;
    int n;
    parser *p;
} nfa;

static int nnew(nfa *f, int kind, int set, int o1, int o2)
{
    if (f->n >= MAX_NFA)
        return fail(f->p, SHOAL_ERANGE, "the pattern expands to too many states (repetitions)");
    f->s[f->n] = (nstate){kind, set, o1, o2};
    return f->n++;
}

/* states that match t then continue at next; returns the entry state */
static int build(nfa *f, int t, int next, int depth)
{
    if (t < 0 || next < 0)
        return -1;
    if (depth > 200)
        return fail(f->p, SHOAL_ERANGE, "the pattern is nested too deeply");
    const ast *a = &f->p->t[t];
    switch (a->kind) {
    case A_EMPTY:
        return next;
    case A_SET:
        return nnew(f, N_SET, a->a, next, -1);
    case A_CAT:
        return build(f, a->a, build(f, a->b, next, depth + 1), depth + 1);
    case A_ALT: {
        int x = build(f, a->a, next, depth + 1), y = build(f, a->b, next, depth + 1);
        if (x < 0 || y < 0)
            return -1;
        return nnew(f, N_SPLIT, -1, x, y);
    }
    default: { /* A_REP */
        int cur = next;
        if (a->max < 0) {
            int loop = nnew(f, N_SPLIT, -1, -1, next);
            if (loop < 0)
                return -1;
            int body = build(f, a->a, loop, depth + 1);
            if (body < 0)
                return -1;
            f->s[loop].o1 = body;
            cur = loop;
        } else {
            for (int k = 0; k < a->max - a->min; k++) {
                int body = build(f, a->a, cur, depth + 1);
                if (body < 0)
                    return -1;
                if ((cur = nnew(f, N_SPLIT, -1, body, next)) < 0)
                    return -1;
            }
        }
        for (int k = 0; k < a->min; k++)
            if ((cur = build(f, a->a, cur, depth + 1)) < 0)
                return -1;
        return cur;
    }
    }
}

/* ---- subset construction ------------------------------------------------ */

typedef struct {
    int *v;
    int n;
} iset;

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* epsilon closure of seeds[0..ns) into out (sorted); mark[] scratch, stamp */
static int closure(const nfa *f, const int *seeds, int ns, int *out, int *stack, int *mark, int stamp)
{
    int n = 0, sp = 0;
    for (int i = 0; i < ns; i++)
        if (mark[seeds[i]] != stamp) {
            mark[seeds[i]] = stamp;
            stack[sp++] = seeds[i];
        }
    while (sp) {
        int x = stack[--sp];
        const nstate *s = &f->s[x];
        if (s->kind == N_SPLIT) {
            int o[2] = {s->o1, s->o2};
            for (int k = 0; k < 2; k++)
                if (o[k] >= 0 && mark[o[k]] != stamp) {
                    mark[o[k]] = stamp;
                    stack[sp++] = o[k];
                }
        } else {
            out[n++] = x;
        }
    }
    qsort(out, (size_t)n, sizeof *out, cmp_int);
    return n;
}

static uint64_t hash_set(const int *v, int n)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++)
        h = (h ^ (uint64_t)v[i]) * 1099511628211ull;
    return h;
}

static void dfa_grow(shoal__cons_dfa *d, int need)
{
    if (need <= d->cap)
        return;
    int cap = d->cap ? d->cap : 64;
    while (cap < need)
        cap *= 2;
    d->next = shoal_xrealloc(d->next, sizeof *d->next * 256 * (size_t)cap);
    d->acc = shoal_xrealloc(d->acc, (size_t)cap);
    d->dist = shoal_xrealloc(d->dist, sizeof *d->dist * (size_t)cap);
    d->cap = cap;
}

void shoal__cons_dfa_free(shoal__cons_dfa *d)
{
    free(d->next);
    free(d->acc);
    free(d->dist);
    memset(d, 0, sizeof *d);
}

static int determinise(shoal__cons_dfa *d, const nfa *f, int entry, int match, int *start, parser *p)
{
    int budget = SHOAL_CONS_MAX_DFA - d->n;
    int base = d->n;
    int *mark = shoal_xcalloc((size_t)f->n, sizeof *mark);
    int *stack = shoal_xmalloc(sizeof *stack * (size_t)f->n);
    int *tmp = shoal_xmalloc(sizeof *tmp * (size_t)f->n);
    int *seeds = shoal_xmalloc(sizeof *seeds * (size_t)f->n);
    iset *sets = NULL;
    int nsets = 0, capsets = 0;
    size_t hcap = 1024;
    int *htab = shoal_xmalloc(sizeof *htab * hcap);
    for (size_t i = 0; i < hcap; i++)
        htab[i] = -1;
    int stamp = 1, rc = 0;
    int n0 = closure(f, &entry, 1, tmp, stack, mark, stamp++);
    /* intern: find or add the set tmp[0..n) */
#define INTERN(nn, outid)                                                                              \
    do {                                                                                               \
        uint64_t h_ = hash_set(tmp, nn);                                                               \
        size_t k_ = (size_t)h_ & (hcap - 1);                                                           \
        outid = -1;                                                                                    \
        while (htab[k_] >= 0) {                                                                        \
            iset *e_ = &sets[htab[k_]];                                                                \
            if (e_->n == nn && !memcmp(e_->v, tmp, sizeof(int) * (size_t)(nn))) {                      \
                outid = htab[k_];                                                                      \
                break;                                                                                 \
            }                                                                                          \
            k_ = (k_ + 1) & (hcap - 1);                                                                \
        }                                                                                              \
        if (outid < 0) {                                                                               \
            if (nsets >= budget) {                                                                     \
                rc = fail(p, SHOAL_ERANGE, "the pattern needs too many automaton states");             \
                goto out;                                                                              \
            }                                                                                          \
            if (nsets == capsets) {                                                                    \
                capsets = capsets ? capsets * 2 : 64;                                                  \
                sets = shoal_xrealloc(sets, sizeof *sets * (size_t)capsets);                           \
            }                                                                                          \
            sets[nsets].v = shoal_xmalloc(sizeof(int) * (size_t)((nn) ? (nn) : 1));                    \
            memcpy(sets[nsets].v, tmp, sizeof(int) * (size_t)(nn));                                    \
            sets[nsets].n = nn;                                                                        \
            outid = nsets++;                                                                           \
            htab[k_] = outid;                                                                          \
            if ((size_t)nsets * 2 > hcap) {                                                            \
                hcap *= 2;                                                                             \
                htab = shoal_xrealloc(htab, sizeof *htab * hcap);                                      \
                for (size_t q_ = 0; q_ < hcap; q_++)                                                   \
                    htab[q_] = -1;                                                                     \
                for (int q_ = 0; q_ < nsets; q_++) {                                                   \
                    size_t r_ = (size_t)hash_set(sets[q_].v, sets[q_].n) & (hcap - 1);                 \
                    while (htab[r_] >= 0)                                                              \
                        r_ = (r_ + 1) & (hcap - 1);                                                    \
                    htab[r_] = q_;                                                                     \
                }                                                                                      \
            }                                                                                          \
            dfa_grow(d, base + nsets);                                                                 \
        }                                                                                              \
    } while (0)
    int sid;
    INTERN(n0, sid);
    for (int cur = 0; cur < nsets; cur++) {
        int32_t *row = d->next + (size_t)(base + cur) * 256;
        int acc = 0;
        for (int i = 0; i < sets[cur].n; i++)
            acc |= sets[cur].v[i] == match;
        d->acc[base + cur] = (uint8_t)acc;
        for (int b = 0; b < 256; b++) {
            int ns = 0;
            const iset *cs = &sets[cur];
            for (int i = 0; i < cs->n; i++) {
                const nstate *s = &f->s[cs->v[i]];
                if (s->kind == N_SET && set_has(&p->sets[s->set], b))
                    seeds[ns++] = s->o1;
            }
            if (!ns) {
                row[b] = -1;
                continue;
            }
            int nn = closure(f, seeds, ns, tmp, stack, mark, stamp++);
            int id;
            INTERN(nn, id);
            row = d->next + (size_t)(base + cur) * 256; /* INTERN may move the pool */
            row[b] = base + id;
        }
    }
#undef INTERN
    /* fewest bytes to accept (reverse relaxation; small graphs) and pruning */
    for (int i = 0; i < nsets; i++)
        d->dist[base + i] = d->acc[base + i] ? 0 : INT32_MAX;
    for (int changed = 1; changed;) {
        changed = 0;
        for (int i = 0; i < nsets; i++) {
            const int32_t *row = d->next + (size_t)(base + i) * 256;
            for (int b = 0; b < 256; b++)
                if (row[b] >= 0 && d->dist[row[b]] != INT32_MAX && d->dist[row[b]] + 1 < d->dist[base + i]) {
                    d->dist[base + i] = d->dist[row[b]] + 1;
                    changed = 1;
                }
        }
    }
    for (int i = 0; i < nsets; i++) {
        int32_t *row = d->next + (size_t)(base + i) * 256;
        for (int b = 0; b < 256; b++)
            if (row[b] >= 0 && d->dist[row[b]] == INT32_MAX)
                row[b] = -1;
    }
    if (d->dist[base] == INT32_MAX) {
        rc = fail(p, SHOAL_EINVAL, "the pattern matches nothing that can be written here");
        goto out;
    }
    d->n = base + nsets;
    *start = base;
out:
    for (int i = 0; i < nsets; i++)
        free(sets[i].v);
    free(sets);
    free(htab);
    free(mark);
    free(stack);
    free(tmp);
    free(seeds);
    return rc;
}

int shoal__cons_re_compile(shoal__cons_dfa *d, const char *re, size_t len, int json_str, int search, int *start,
                           char *err, size_t errlen)
{
    parser p = {.s = (const unsigned char *)re, .n = len, .json_str = json_str, .err = err, .errlen = errlen};
    int lead = 0, trail = 0;
    if (p.n && p.s[0] == '^') {
        lead = 1;
        p.i = 1;
    }
    if (p.n > (size_t)lead && p.s[p.n - 1] == '$') {
        size_t bs = 0;
        for (size_t k = p.n - 1; k > 0 && p.s[k - 1] == '\\'; k--)
            bs++;
        if (!(bs & 1)) {
            trail = 1;
            p.n--;
        }
    }
    p.t = shoal_xmalloc(sizeof *p.t * MAX_AST);
    p.sets = shoal_xmalloc(sizeof *p.sets * MAX_AST);
    nfa f = {.s = shoal_xmalloc(sizeof *f.s * MAX_NFA), .p = &p};
    int root = parse_alt(&p, 0);
    if (root >= 0 && p.i < p.n)
        root = fail(&p, SHOAL_EINVAL, "an unbalanced ')'");
    if (root >= 0 && search) {
        byteset u = {0};
        universe(&p, &u);
        if (!lead) {
            int any = set_node(&p, u), rep = any >= 0 ? node(&p, A_REP, any, 0) : -1;
            if (rep >= 0) {
                p.t[rep].min = 0;
                p.t[rep].max = -1;
                root = node(&p, A_CAT, rep, root);
            } else {
                root = -1;
            }
        }
        if (root >= 0 && !trail) {
            int any = set_node(&p, u), rep = any >= 0 ? node(&p, A_REP, any, 0) : -1;
            if (rep >= 0) {
                p.t[rep].min = 0;
                p.t[rep].max = -1;
                root = node(&p, A_CAT, root, rep);
            } else {
                root = -1;
            }
        }
    }
    int rc = 0;
    if (root < 0) {
        rc = p.rc ? p.rc : SHOAL_EINVAL;
    } else {
        int match = nnew(&f, N_MATCH, -1, -1, -1);
        int entry = build(&f, root, match, 0);
        if (entry < 0)
            rc = p.rc ? p.rc : SHOAL_EINVAL;
        else
            rc = determinise(d, &f, entry, match, start, &p) ? (p.rc ? p.rc : SHOAL_EINVAL) : 0;
    }
    free(p.t);
    free(p.sets);
    free(f.s);
    return rc;
}
