/* constrain (constrain.h): JSON schema compiler, the byte-level pushdown
 * matcher, the vocabulary trie and the mask walk.
 *
 * The matcher. A state is a small set (<= SHOAL_CONS_ALTS) of stacks; a stack
 * is an array of frames, each frame one open syntactic element (the document,
 * an object, a key, an array, a string, a number, a literal, a value not yet
 * begun). Feeding a byte to a stack gives zero stacks (the byte leaves the
 * language), one, or several (a value of an anyOf schema forks into one stack
 * per alternative; the alternatives that do not fit die on the next byte).
 * Every transition keeps only stacks from which an accepting state is still
 * reachable, so a mask never offers a dead end (constrain.h).
 *
 * The mask. The vocabulary's ordinary tokens are laid out as a byte trie in
 * preorder (node i: its byte, its depth, the token ending there, the index
 * past its subtree). The walk keeps one matcher state per depth; a node whose
 * state is empty skips its subtree. Inside a JSON string at a character
 * boundary (the common case: long string values) the tokens made only of
 * plain string bytes are all allowed at once from a precomputed bitmap, and
 * only the trie of the other tokens is walked. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/text/constrain.h"
#include "coordinator/text/constrain_int.h"

/* ---- compiled constraint ------------------------------------------------- */

enum { K_NEVER, K_ANY, K_OBJ, K_ARR, K_STR, K_NUM, K_INT, K_LIT, K_ANYOF, K_REF };

#define NONE UINT32_MAX
#define UNLIMITED UINT32_MAX

typedef struct {
    uint8_t kind;
    int32_t ref;       /* K_REF: the target node */
    int nprops, prop0; /* K_OBJ: props[prop0 .. prop0+nprops) */
    int32_t addl;      /* K_OBJ: node of additional properties, -1 none */
    int32_t ktrie;     /* K_OBJ: key trie root; K_LIT: literal trie root */
    uint64_t req;      /* K_OBJ: required properties (bit j = prop j) */
    int32_t items;     /* K_ARR: node of items past prefixItems, -1 none */
    int nprefix, prefix0; /* K_ARR: idx[prefix0 ..) */
    uint32_t minc, maxc;  /* K_ARR items; K_STR code points */
    int32_t re;           /* K_STR: DFA start, -1 none */
    int nalts, alts0;     /* K_ANYOF: idx[alts0 ..) */
} cnode;

typedef struct {
    int32_t child, sib; /* first child, next sibling; -1 none */
    uint8_t byte;
    int32_t term; /* K_LIT: 0 terminal; key tries: the property index; -1 not terminal */
    uint64_t sub; /* key tries: properties below */
} tnode;

enum { MODE_JSON, MODE_REGEX, MODE_RAW };

struct shoal_cons {
    int mode;
    cnode *n;
    int nn, capn;
    int32_t *idx; /* props' value nodes, prefixItems, anyOf alternatives */
    int nidx, capidx;
    tnode *t;
    int nt, capt;
    shoal__cons_dfa dfa;
    int32_t root;
    int32_t any_obj, any_arr, any_str, any_num, any_tfn; /* K_ANY's dispatch */
    int32_t re_start;                                     /* MODE_REGEX */
};

/* ---- matcher state ------------------------------------------------------- */

enum {
    PH_VALUE,                                                    /* a value of node begins with the next byte */
    PH_DOC_BEFORE, PH_DOC_VAL, PH_DOC_AFTER, PH_DOC_RE,          /* bottom frame */
    PH_O_OPEN, PH_O_KEYREQ, PH_O_COLON, PH_O_VALWS, PH_O_VAL, PH_O_AFTER,
    PH_KEY,
    PH_A_OPEN, PH_A_NEED, PH_A_VAL, PH_A_AFTER,
    PH_STR,
    PH_N_MINUS, PH_N_ZERO, PH_N_INT, PH_N_DOT, PH_N_FRAC, PH_N_E, PH_N_ESIGN, PH_N_EXP,
    PH_LIT,
};

typedef struct {
    uint16_t node;
    uint8_t ph, ws;
    uint32_t a, b, c;
} frame;

typedef struct {
    uint8_t d;
    frame f[SHOAL_CONS_DEPTH];
} stack;

typedef struct {
    uint8_t n;
    stack s[SHOAL_CONS_ALTS];
} mstate;

#define END 256
/* digits of a number's integer part or fraction, and of its exponent: JSON
 * sets no bound, but parsers do: 18 digits keep every integer inside int64
 * (jansson, which the server's own Anthropic path parses arguments with,
 * refuses larger ones), 2 exponent digits keep 18-digit mantissas inside a
 * double; docs/API.md */
#define NUM_DIGITS 18
#define NUM_EXP_DIGITS 2
#define ADDL_KEY 0xffffu

/* string sub-state in frame.c: esc (bits 0-3: 0 none, 1 after '\', 2-5 hex
 * digits read + 2), need (bits 4-7: continuation bytes left), first
 * continuation range (bits 8-11: 0 any, 1 A0-BF, 2 80-9F, 3 90-BF, 4 80-8F),
 * hex high byte (bits 16-23). */
#define SUB_ESC(c) ((c) & 15u)
#define SUB_NEED(c) (((c) >> 4) & 15u)
#define SUB_RANGE(c) (((c) >> 8) & 15u)

static int is_ws(int b)
{
    return b == ' ' || b == '\n' || b == '\t';
}

static int hexval(int b)
{
    return b >= '0' && b <= '9' ? b - '0' : b >= 'a' && b <= 'f' ? b - 'a' + 10 : b >= 'A' && b <= 'F' ? b - 'A' + 10 : -1;
}

/* One byte of a JSON string body. *c is the sub-state; *chars += 1 when a
 * character starts. Returns -1 (invalid), 0 (inside), 1 (the closing quote).
 * strict: no '\/' and no '\u' (additional keys: the encoding is canonical so
 * it can be compared with the declared names); noesc: no escape at all
 * (pattern strings: bytes are characters). */
static int str_byte(uint32_t *c, int b, uint32_t *chars, int strict, int noesc)
{
    uint32_t s = *c, esc = SUB_ESC(s), need = SUB_NEED(s);
    if (b == END)
        return -1;
    if (need) {
        int lo = 0x80, hi = 0xbf;
        switch (SUB_RANGE(s)) {
        case 1: lo = 0xa0; break;
        case 2: hi = 0x9f; break;
        case 3: lo = 0x90; break;
        case 4: hi = 0x8f; break;
        default: break;
        }
        if (b < lo || b > hi)
            return -1;
        *c = (need - 1) << 4; /* range applies to the first continuation only */
        return 0;
    }
    if (esc == 1) {
        switch (b) {
        case '"': case '\\': case 'b': case 'f': case 'n': case 'r': case 't':
            *c = 0;
            return 0;
        case '/':
            if (strict)
                return -1;
            *c = 0;
            return 0;
        case 'u':
            if (strict)
                return -1;
            *c = 2;
            return 0;
        default:
            return -1;
        }
    }
    if (esc >= 2) {
        int v = hexval(b);
        if (v < 0)
            return -1;
        uint32_t hi = (s >> 16) & 0xffu;
        if (esc == 2 || esc == 3)
            hi = hi * 16 + (uint32_t)v;
        if (esc == 3 && hi >= 0xd8 && hi <= 0xdf)
            return -1; /* no surrogate escapes: one \u, one character */
        *c = esc == 5 ? 0 : ((esc + 1) | (hi << 16));
        return 0;
    }
    if (b == '"')
        return 1;
    if (b == '\\') {
        if (noesc)
            return -1;
        (*chars)++;
        *c = 1;
        return 0;
    }
    if (b < 0x20)
        return -1;
    if (b < 0x80) {
        (*chars)++;
        return 0;
    }
    uint32_t n, r = 0;
    if (b >= 0xc2 && b <= 0xdf)
        n = 1;
    else if (b == 0xe0)
        n = 2, r = 1;
    else if (b == 0xed)
        n = 2, r = 2;
    else if (b >= 0xe1 && b <= 0xef)
        n = 2;
    else if (b == 0xf0)
        n = 3, r = 3;
    else if (b >= 0xf1 && b <= 0xf3)
        n = 3;
    else if (b == 0xf4)
        n = 3, r = 4;
    else
        return -1;
    (*chars)++;
    *c = (n << 4) | (r << 8);
    return 0;
}

static void emit(mstate *out, const stack *s)
{
    if (out->n >= SHOAL_CONS_ALTS)
        return; /* more live alternatives than tracked: the rest are dropped (a subset) */
    stack *d = &out->s[out->n++];
    d->d = s->d;
    memcpy(d->f, s->f, sizeof(frame) * s->d);
}

static const tnode *tchild(const shoal_cons *c, int32_t t, int b)
{
    for (int32_t k = c->t[t].child; k >= 0; k = c->t[k].sib)
        if (c->t[k].byte == b)
            return &c->t[k];
    return NULL;
}

/* properties a key may name next when the object is at pi: [pi, first
 * required at or after pi] */
static uint64_t key_range(const cnode *o, uint32_t pi)
{
    if (pi >= (uint32_t)o->nprops)
        return 0;
    uint64_t from = ~0ull << pi;
    uint64_t reqs = o->req & from;
    uint64_t upto = reqs ? ((reqs & -reqs) << 1) - 1 : ~0ull; /* through the lowest required bit */
    if (reqs && (reqs & -reqs) == (1ull << 63))
        upto = ~0ull;
    uint64_t all = o->nprops >= 64 ? ~0ull : (1ull << o->nprops) - 1;
    return from & upto & all;
}

static int obj_can_close(const cnode *o, uint32_t pi)
{
    return pi >= 64 || (o->req >> pi) == 0;
}

static int obj_addl_ok(const cnode *o, uint32_t pi)
{
    return o->addl >= 0 && obj_can_close(o, pi);
}

static int obj_next_key(const cnode *o, uint32_t pi)
{
    return key_range(o, pi) != 0 || obj_addl_ok(o, pi);
}

static int32_t arr_item(const shoal_cons *c, const cnode *a, uint32_t i)
{
    if (i < (uint32_t)a->nprefix)
        return c->idx[a->prefix0 + (int)i];
    return a->items;
}

static int arr_more(const shoal_cons *c, const cnode *a, uint32_t count)
{
    return count < a->maxc && arr_item(c, a, count) >= 0;
}

/* a string frame with its DFA: can it still end within maxLength? */
static int str_live(const shoal_cons *c, const cnode *n, const frame *f)
{
    if (n->re < 0 || f->b == NONE)
        return 1;
    int32_t dist = c->dfa.dist[f->b];
    return n->maxc == UNLIMITED || (uint64_t)f->a + (uint64_t)dist <= n->maxc;
}

/* the frame under the top finished a value */
static void child_done(stack *s)
{
    frame *p = &s->f[s->d - 1];
    p->ws = 0;
    if (p->ph == PH_O_VAL)
        p->ph = PH_O_AFTER;
    else if (p->ph == PH_A_VAL) {
        p->ph = PH_A_AFTER;
        p->a++;
    } else if (p->ph == PH_DOC_VAL)
        p->ph = PH_DOC_AFTER;
}

static int push_value(stack *s, int32_t node)
{
    if (s->d >= SHOAL_CONS_DEPTH)
        return -1;
    s->f[s->d++] = (frame){.node = (uint16_t)node, .ph = PH_VALUE};
    return 0;
}

/* Whitespace between JSON tokens: when b is one, the frame counts it (at
 * most SHOAL_CONS_WS_MAX in a row) and the state goes out; returns 1 when b
 * was whitespace (handled, whether or not it fitted). */
static int ws_step(stack *w, frame *f, int b, mstate *out)
{
    if (!is_ws(b))
        return 0;
    if (f->ws < SHOAL_CONS_WS_MAX) {
        f->ws++;
        emit(out, w);
    }
    return 1;
}

/* The top value is complete: pop it, advance its parent, emit. */
static void pop_emit(stack *w, mstate *out)
{
    w->d--;
    child_done(w);
    emit(out, w);
}

/* A key (property j, or ADDL_KEY with a = nprops) is complete: pop the key
 * frame, the object waits for its colon. */
static void key_emit(stack *w, uint32_t j, uint32_t a, mstate *out)
{
    w->d--;
    frame *o = &w->f[w->d - 1];
    o->ph = PH_O_COLON;
    o->b = j;
    o->a = a;
    o->ws = 0;
    emit(out, w);
}

/* The first digit of a number's integer part (after an optional '-'):
 * returns 0 and the state goes out, or -1 when b is no digit. */
static int int_first(stack *w, frame *f, int b, mstate *out)
{
    if (b == '0')
        f->ph = PH_N_ZERO;
    else if (b >= '1' && b <= '9')
        f->ph = PH_N_INT;
    else
        return -1;
    f->a = 1;
    emit(out, w);
    return 0;
}

/* Enter phase ph at the top of a value that opens with byte want. */
static void open_emit(stack *w, frame *f, int b, int want, int ph, mstate *out)
{
    if (b != want)
        return;
    *f = (frame){.node = f->node, .ph = (uint8_t)ph};
    emit(out, w);
}

static void feed_stack(const shoal_cons *c, stack *w, int b, mstate *out, int guard);

/* feed b to a copy of in */
static void feed(const shoal_cons *c, const stack *in, int b, mstate *out)
{
    stack w;
    w.d = in->d;
    memcpy(w.f, in->f, sizeof(frame) * in->d);
    feed_stack(c, &w, b, out, 0);
}

static void feed_stack(const shoal_cons *c, stack *w, int b, mstate *out, int guard)
{
    for (;;) {
        if (++guard > 96 || w->d == 0)
            return; /* references without progress: dead (bounded, never a hang) */
        frame *f = &w->f[w->d - 1];
        const cnode *n = &c->n[f->node];
        switch (f->ph) {
        case PH_VALUE:
            if (b == END)
                return;
            switch (n->kind) {
            case K_REF:
                f->node = (uint16_t)n->ref;
                continue;
            case K_ANYOF:
                for (int i = 0; i < n->nalts && out->n < SHOAL_CONS_ALTS; i++) {
                    stack w2;
                    w2.d = w->d;
                    memcpy(w2.f, w->f, sizeof(frame) * w->d);
                    w2.f[w2.d - 1].node = (uint16_t)c->idx[n->alts0 + i];
                    feed_stack(c, &w2, b, out, guard);
                }
                return;
            case K_ANY:
                f->node = (uint16_t)(b == '{' ? c->any_obj : b == '[' ? c->any_arr : b == '"' ? c->any_str
                                     : (b == '-' || (b >= '0' && b <= '9')) ? c->any_num : c->any_tfn);
                continue;
            case K_OBJ:
                open_emit(w, f, b, '{', PH_O_OPEN, out);
                return;
            case K_ARR:
                open_emit(w, f, b, '[', PH_A_OPEN, out);
                return;
            case K_STR:
                if (b != '"')
                    return;
                *f = (frame){.node = f->node, .ph = PH_STR, .b = n->re >= 0 ? (uint32_t)n->re : NONE};
                if (!str_live(c, n, f))
                    return;
                emit(out, w);
                return;
            case K_NUM:
            case K_INT:
                if (b == '-') {
                    f->ph = PH_N_MINUS;
                    f->a = 1;
                    emit(out, w);
                } else
                    int_first(w, f, b, out);
                return;
            case K_LIT: {
                const tnode *t = tchild(c, n->ktrie, b);
                if (!t)
                    return;
                f->ph = PH_LIT;
                f->a = (uint32_t)(t - c->t);
                emit(out, w);
                return;
            }
            default:
                return;
            }
        case PH_DOC_BEFORE:
            if (c->mode == MODE_JSON && ws_step(w, f, b, out))
                return;
            if (b == END)
                return;
            f->ph = PH_DOC_VAL;
            f->ws = 0;
            if (push_value(w, c->root))
                return;
            continue;
        case PH_DOC_AFTER:
            if (b == END) {
                emit(out, w);
                return;
            }
            if (c->mode == MODE_JSON)
                ws_step(w, f, b, out);
            return;
        case PH_DOC_RE: {
            if (b == END) {
                if (c->dfa.acc[f->a])
                    emit(out, w);
                return;
            }
            int32_t nx = c->dfa.next[(size_t)f->a * 256 + (size_t)b];
            if (nx < 0)
                return;
            f->a = (uint32_t)nx;
            emit(out, w);
            return;
        }
        case PH_O_OPEN:
        case PH_O_KEYREQ:
        case PH_O_AFTER:
            if (ws_step(w, f, b, out))
                return;
            if (b == '}' && f->ph != PH_O_KEYREQ && obj_can_close(n, f->a)) {
                pop_emit(w, out);
                return;
            }
            if (b == ',' && f->ph == PH_O_AFTER && obj_next_key(n, f->a)) {
                f->ph = PH_O_KEYREQ;
                f->ws = 0;
                emit(out, w);
                return;
            }
            if (b == '"' && f->ph != PH_O_AFTER && obj_next_key(n, f->a)) {
                if (w->d >= SHOAL_CONS_DEPTH)
                    return;
                f->ws = 0;
                w->f[w->d++] = (frame){.node = f->node, .ph = PH_KEY, .a = (uint32_t)n->ktrie,
                                       .b = (uint32_t)obj_addl_ok(n, f->a)};
                emit(out, w);
            }
            return;
        case PH_O_COLON:
            if (ws_step(w, f, b, out))
                return;
            if (b == ':') {
                f->ph = PH_O_VALWS;
                f->ws = 0;
                emit(out, w);
            }
            return;
        case PH_O_VALWS:
            if (ws_step(w, f, b, out))
                return;
            if (b == END)
                return;
            f->ph = PH_O_VAL;
            f->ws = 0;
            if (push_value(w, f->b == ADDL_KEY ? n->addl : c->idx[n->prop0 + (int)f->b]))
                return;
            continue;
        case PH_KEY: {
            const frame *of = &w->f[w->d - 2];
            uint64_t range = key_range(n, of->a);
            const tnode *t = f->a != NONE ? tchild(c, (int32_t)f->a, b) : NULL;
            if (t && t->term >= 0) { /* a declared name, closing quote included */
                uint32_t j = (uint32_t)t->term;
                if (!((range >> j) & 1))
                    return; /* used already, or past a required one; not additional either */
                key_emit(w, j, j + 1, out);
                return;
            }
            int addl = (int)(f->b & 1);
            int end = 0;
            if (addl) {
                uint32_t chars = 0;
                end = str_byte(&f->c, b, &chars, 1, 0);
                if (end < 0)
                    addl = 0;
            }
            if (addl && end == 1) {
                key_emit(w, ADDL_KEY, (uint32_t)n->nprops, out);
                return;
            }
            int decl = t && (t->sub & range);
            if (!decl && !addl)
                return;
            f->a = t ? (uint32_t)(t - c->t) : NONE;
            f->b = (uint32_t)addl;
            emit(out, w);
            return;
        }
        case PH_A_OPEN:
        case PH_A_NEED:
        case PH_A_AFTER:
            if (ws_step(w, f, b, out))
                return;
            if (b == ']' && f->ph != PH_A_NEED && f->a >= n->minc) {
                pop_emit(w, out);
                return;
            }
            if (f->ph == PH_A_AFTER) {
                if (b == ',' && arr_more(c, n, f->a)) {
                    f->ph = PH_A_NEED;
                    f->ws = 0;
                    emit(out, w);
                }
                return;
            }
            if (b == END || !arr_more(c, n, f->a))
                return;
            f->ph = PH_A_VAL;
            f->ws = 0;
            if (push_value(w, arr_item(c, n, f->a)))
                return;
            continue;
        case PH_STR: {
            uint32_t chars = f->a;
            int noesc = n->re >= 0;
            int r = str_byte(&f->c, b, &chars, 0, noesc);
            if (r < 0)
                return;
            if (r == 1) {
                if (f->a < n->minc)
                    return;
                if (f->b != NONE && !c->dfa.acc[f->b])
                    return;
                pop_emit(w, out);
                return;
            }
            if (chars > n->maxc)
                return;
            f->a = chars;
            if (f->b != NONE) {
                int32_t nx = c->dfa.next[(size_t)f->b * 256 + (size_t)b];
                if (nx < 0)
                    return;
                f->b = (uint32_t)nx;
                if (!str_live(c, n, f))
                    return;
            }
            emit(out, w);
            return;
        }
        case PH_N_MINUS:
            int_first(w, f, b, out);
            return;
        case PH_N_ZERO:
        case PH_N_INT:
        case PH_N_FRAC:
        case PH_N_EXP:
            if (b >= '0' && b <= '9' && f->ph != PH_N_ZERO) {
                if (++f->a > (f->ph == PH_N_EXP ? NUM_EXP_DIGITS : NUM_DIGITS))
                    return;
                emit(out, w);
                return;
            }
            if (n->kind == K_NUM && b == '.' && (f->ph == PH_N_ZERO || f->ph == PH_N_INT)) {
                f->ph = PH_N_DOT;
                emit(out, w);
                return;
            }
            if (n->kind == K_NUM && (b == 'e' || b == 'E') && f->ph != PH_N_EXP) {
                f->ph = PH_N_E;
                emit(out, w);
                return;
            }
            w->d--; /* the number ended before b */
            child_done(w);
            continue;
        case PH_N_DOT:
        case PH_N_E:
        case PH_N_ESIGN:
            if (b >= '0' && b <= '9') {
                f->ph = f->ph == PH_N_DOT ? PH_N_FRAC : PH_N_EXP;
                f->a = 1;
            } else if (f->ph == PH_N_E && (b == '+' || b == '-'))
                f->ph = PH_N_ESIGN;
            else
                return;
            emit(out, w);
            return;
        case PH_LIT: {
            const tnode *t = b == END ? NULL : tchild(c, (int32_t)f->a, b);
            if (t) {
                f->a = (uint32_t)(t - c->t);
                emit(out, w);
                return;
            }
            if (c->t[f->a].term < 0)
                return;
            w->d--;
            child_done(w);
            continue;
        }
        default:
            return; /* PH_DOC_VAL, PH_O_VAL, PH_A_VAL are never on top */
        }
    }
}

static void step(const shoal_cons *c, const mstate *in, int b, mstate *out)
{
    out->n = 0;
    for (int i = 0; i < in->n; i++)
        feed(c, &in->s[i], b, out);
}

static int complete(const shoal_cons *c, const mstate *st)
{
    mstate tmp;
    for (int i = 0; i < st->n; i++) {
        tmp.n = 0;
        feed(c, &st->s[i], END, &tmp);
        if (tmp.n)
            return 1;
    }
    return 0;
}

static void initial(const shoal_cons *c, mstate *st)
{
    st->n = 1;
    st->s[0].d = 1;
    st->s[0].f[0] = (frame){.node = (uint16_t)c->root, .ph = c->mode == MODE_REGEX ? PH_DOC_RE : PH_DOC_BEFORE,
                            .a = c->mode == MODE_REGEX ? (uint32_t)c->re_start : 0};
}

/* ---- compiling ----------------------------------------------------------- */

static shoal_cons *cons_new(int mode)
{
    shoal_cons *c = shoal_xcalloc(1, sizeof *c);
    c->mode = mode;
    c->root = c->any_obj = c->any_arr = c->any_str = c->any_num = c->any_tfn = -1;
    return c;
}

void shoal_cons_free(shoal_cons *c)
{
    if (!c)
        return;
    free(c->n);
    free(c->idx);
    free(c->t);
    shoal__cons_dfa_free(&c->dfa);
    free(c);
}

static int new_node(shoal_cons *c, int kind)
{
    if (c->nn >= SHOAL_CONS_MAX_NODES)
        return -1;
    if (c->nn == c->capn) {
        c->capn = c->capn ? c->capn * 2 : 64;
        c->n = shoal_xrealloc(c->n, sizeof *c->n * (size_t)c->capn);
    }
    c->n[c->nn] = (cnode){.kind = (uint8_t)kind, .addl = -1, .ktrie = -1, .items = -1, .re = -1, .ref = -1,
                          .maxc = UNLIMITED};
    return c->nn++;
}

static int new_idx(shoal_cons *c, int count)
{
    if (c->nidx + count > c->capidx) {
        while (c->nidx + count > c->capidx)
            c->capidx = c->capidx ? c->capidx * 2 : 64;
        c->idx = shoal_xrealloc(c->idx, sizeof *c->idx * (size_t)c->capidx);
    }
    int at = c->nidx;
    c->nidx += count;
    return at;
}

static int32_t new_tnode(shoal_cons *c, int byte)
{
    if (c->nt == c->capt) {
        c->capt = c->capt ? c->capt * 2 : 256;
        c->t = shoal_xrealloc(c->t, sizeof *c->t * (size_t)c->capt);
    }
    c->t[c->nt] = (tnode){.child = -1, .sib = -1, .byte = (uint8_t)byte, .term = -1};
    return c->nt++;
}

/* add bytes to the trie at root; returns the final node, or -1 when the trie is full */
static int32_t trie_add(shoal_cons *c, int32_t root, const char *s, size_t n, uint64_t sub)
{
    int32_t t = root;
    c->t[t].sub |= sub;
    for (size_t i = 0; i < n; i++) {
        if (c->nt > 1 << 22)
            return -1;
        int32_t k;
        for (k = c->t[t].child; k >= 0; k = c->t[k].sib)
            if (c->t[k].byte == (uint8_t)s[i])
                break;
        if (k < 0) {
            k = new_tnode(c, (uint8_t)s[i]);
            c->t[k].sib = c->t[t].child;
            c->t[t].child = k;
        }
        t = k;
        c->t[t].sub |= sub;
    }
    return t;
}

typedef struct {
    shoal_cons *c;
    const json_t *doc;
    json_t *refs; /* "$ref string" -> node id */
    char *err;
    size_t errlen;
    int depth;
} comp;

#define CERR(code, path, ...) cerr(cc, code, path, __VA_ARGS__)

static int cerr(comp *cc, int code, const char *path, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int cerr(comp *cc, int code, const char *path, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    shoal_err_set(cc->err, cc->errlen, code, "%s: %s", path[0] ? path : "/", msg);
    return code;
}

static int compile_schema(comp *cc, const json_t *s, const char *path, int32_t *out);

static int nonneg(comp *cc, const json_t *v, const char *path, const char *kw, uint32_t *out)
{
    if (!v)
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1000000)
        return CERR(SHOAL_EINVAL, path, "'%s' must be an integer in [0, 1000000]", kw);
    *out = (uint32_t)json_integer_value(v);
    return 0;
}

static int32_t nodes_full(comp *cc, const char *path)
{
    CERR(SHOAL_ERANGE, path, "the schema needs more than %d nodes", SHOAL_CONS_MAX_NODES);
    return -1;
}

static int lit_node(comp *cc, const char *const *lits, int n, const char *path, int32_t *out)
{
    shoal_cons *c = cc->c;
    int id = new_node(c, K_LIT);
    if (id < 0)
        return nodes_full(cc, path), SHOAL_ERANGE;
    int32_t root = new_tnode(c, 0);
    c->n[id].ktrie = root;
    for (int i = 0; i < n; i++) {
        int32_t t = trie_add(c, root, lits[i], strlen(lits[i]), 0);
        if (t < 0)
            return CERR(SHOAL_ERANGE, path, "the literals are too large");
        c->t[t].term = 0;
    }
    *out = id;
    return 0;
}

static const char *annotations[] = {"title", "description", "$schema", "$id", "$comment", "default", "examples",
                                    "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "strict", NULL};
static const char *obj_kw[] = {"properties", "required", "additionalProperties", NULL};
static const char *arr_kw[] = {"items", "prefixItems", "minItems", "maxItems", NULL};
static const char *str_kw[] = {"minLength", "maxLength", "pattern", "format", NULL};

static int in_list(const char *const *l, const char *k)
{
    for (; *l; l++)
        if (!strcmp(*l, k))
            return 1;
    return 0;
}

static const char *format_re(const char *f)
{
    /* day 01-28 keeps every date valid in every month, years 1000-9999 (year
     * 0000 is no date to Python's datetime, jsonschema's checker): a subset */
#define DATE "[1-9][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"
#define TIME "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
    if (!strcmp(f, "date"))
        return "^" DATE "$";
    if (!strcmp(f, "time"))
        return "^" TIME "$";
    if (!strcmp(f, "date-time"))
        return "^" DATE "T" TIME "$";
    if (!strcmp(f, "uuid"))
        return "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$";
    if (!strcmp(f, "email"))
        return "^[a-zA-Z0-9._+-]{1,32}@[a-zA-Z0-9-]{1,32}(\\.[a-zA-Z0-9-]{1,16}){1,3}$";
    return NULL;
#undef DATE
#undef TIME
}

static int typed(comp *cc, const json_t *s, const char *ty, const char *path, int32_t *out)
{
    shoal_cons *c = cc->c;
    char p[512];
    int rc;
    if (!strcmp(ty, "object")) {
        const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"),
                     *ap = json_object_get(s, "additionalProperties");
        if (props && !json_is_object(props))
            return CERR(SHOAL_EINVAL, path, "'properties' must be an object");
        if (req && !json_is_array(req))
            return CERR(SHOAL_EINVAL, path, "'required' must be an array");
        size_t np = props ? json_object_size(props) : 0;
        if (np > 64)
            return CERR(SHOAL_EUNSUPPORTED, path, "more than 64 properties in one object");
        int id = new_node(c, K_OBJ);
        if (id < 0)
            return nodes_full(cc, path), SHOAL_ERANGE;
        int at = new_idx(c, (int)np);
        c->n[id].nprops = (int)np;
        c->n[id].prop0 = at;
        int32_t kroot = new_tnode(c, 0);
        c->n[id].ktrie = kroot;
        const char *key;
        json_t *val;
        int j = 0;
        json_object_foreach((json_t *)props, key, val) {
            snprintf(p, sizeof p, "%s/properties/%s", path, key);
            json_t *ks = json_string(key);
            char *enc = ks ? json_dumps(ks, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
            json_decref(ks);
            if (!enc)
                return CERR(SHOAL_EINVAL, p, "a property name that is not UTF-8");
            /* the key as written: the encoding minus the opening quote */
            int32_t t = trie_add(c, kroot, enc + 1, strlen(enc + 1), 1ull << j);
            free(enc);
            if (t < 0)
                return CERR(SHOAL_ERANGE, p, "property names too large");
            c->t[t].term = j;
            int32_t v;
            if ((rc = compile_schema(cc, val, p, &v)))
                return rc;
            c->idx[at + j] = v;
            j++;
        }
        if (req) {
            size_t i;
            json_t *r;
            json_array_foreach(req, i, r) {
                if (!json_is_string(r))
                    return CERR(SHOAL_EINVAL, path, "'required' must list strings");
                int k = 0, found = -1;
                json_object_foreach((json_t *)props, key, val) {
                    if (!strcmp(key, json_string_value(r)))
                        found = k;
                    k++;
                }
                if (found < 0)
                    return CERR(SHOAL_EUNSUPPORTED, path,
                                "required property '%s' is not in 'properties' (list it there with its schema)",
                                json_string_value(r));
                c->n[id].req |= 1ull << found;
            }
        }
        if (ap && !json_is_boolean(ap) && !json_is_object(ap))
            return CERR(SHOAL_EINVAL, path, "'additionalProperties' must be a boolean or a schema");
        if (ap && !json_is_false(ap)) {
            snprintf(p, sizeof p, "%s/additionalProperties", path);
            int32_t v;
            if ((rc = compile_schema(cc, ap, p, &v)))
                return rc;
            c->n[id].addl = v;
        }
        *out = id;
        return 0;
    }
    if (!strcmp(ty, "array")) {
        const json_t *items = json_object_get(s, "items"), *pre = json_object_get(s, "prefixItems");
        if (pre && !json_is_array(pre))
            return CERR(SHOAL_EINVAL, path, "'prefixItems' must be an array");
        int id = new_node(c, K_ARR);
        if (id < 0)
            return nodes_full(cc, path), SHOAL_ERANGE;
        if ((rc = nonneg(cc, json_object_get(s, "minItems"), path, "minItems", &c->n[id].minc)) ||
            (rc = nonneg(cc, json_object_get(s, "maxItems"), path, "maxItems", &c->n[id].maxc)))
            return rc;
        int np = pre ? (int)json_array_size(pre) : 0;
        int at = new_idx(c, np);
        c->n[id].nprefix = np;
        c->n[id].prefix0 = at;
        for (int i = 0; i < np; i++) {
            snprintf(p, sizeof p, "%s/prefixItems/%d", path, i);
            int32_t v;
            if ((rc = compile_schema(cc, json_array_get(pre, (size_t)i), p, &v)))
                return rc;
            c->idx[at + i] = v;
        }
        if (!items || !json_is_false(items)) {
            snprintf(p, sizeof p, "%s/items", path);
            int32_t v;
            if (items && json_is_array(items))
                return CERR(SHOAL_EUNSUPPORTED, p, "'items' as an array (use prefixItems)");
            if ((rc = compile_schema(cc, items, p, &v)))
                return rc;
            c->n[id].items = v;
        }
        cnode *a = &c->n[id];
        if (a->minc > a->maxc)
            return CERR(SHOAL_EINVAL, path, "minItems above maxItems");
        if (a->items < 0 && a->minc > (uint32_t)a->nprefix)
            return CERR(SHOAL_EINVAL, path, "minItems above what prefixItems and items: false allow");
        *out = id;
        return 0;
    }
    if (!strcmp(ty, "string")) {
        int id = new_node(c, K_STR);
        if (id < 0)
            return nodes_full(cc, path), SHOAL_ERANGE;
        if ((rc = nonneg(cc, json_object_get(s, "minLength"), path, "minLength", &c->n[id].minc)) ||
            (rc = nonneg(cc, json_object_get(s, "maxLength"), path, "maxLength", &c->n[id].maxc)))
            return rc;
        if (c->n[id].minc > c->n[id].maxc)
            return CERR(SHOAL_EINVAL, path, "minLength above maxLength");
        const json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
        if (pat && fmt)
            return CERR(SHOAL_EUNSUPPORTED, path, "'pattern' together with 'format'");
        const char *re = NULL;
        int search = 1;
        if (pat) {
            if (!json_is_string(pat))
                return CERR(SHOAL_EINVAL, path, "'pattern' must be a string");
            re = json_string_value(pat);
        } else if (fmt) {
            if (!json_is_string(fmt))
                return CERR(SHOAL_EINVAL, path, "'format' must be a string");
            if (!(re = format_re(json_string_value(fmt))))
                return CERR(SHOAL_EUNSUPPORTED, path,
                            "format '%s' is not supported (date-time, date, time, uuid, email are)",
                            json_string_value(fmt));
            search = 0;
        }
        if (re) {
            char e2[200];
            int st;
            if ((rc = shoal__cons_re_compile(&c->dfa, re, strlen(re), 1, search, &st, e2, sizeof e2)))
                return CERR(rc, path, "%s: %s", pat ? "pattern" : "format", e2);
            c->n[id].re = st;
            if (c->n[id].maxc != UNLIMITED && (uint32_t)c->dfa.dist[st] > c->n[id].maxc)
                return CERR(SHOAL_EINVAL, path, "the pattern needs more characters than maxLength");
        }
        *out = id;
        return 0;
    }
    if (!strcmp(ty, "number") || !strcmp(ty, "integer")) {
        int id = new_node(c, !strcmp(ty, "number") ? K_NUM : K_INT);
        if (id < 0)
            return nodes_full(cc, path), SHOAL_ERANGE;
        *out = id;
        return 0;
    }
    if (!strcmp(ty, "boolean")) {
        const char *l[] = {"true", "false"};
        return lit_node(cc, l, 2, path, out);
    }
    if (!strcmp(ty, "null")) {
        const char *l[] = {"null"};
        return lit_node(cc, l, 1, path, out);
    }
    return CERR(SHOAL_EINVAL, path, "unknown type '%s'", ty);
}

/* does the compiled node accept the text? (enum/const values against the
 * rest of their schema) */
static int accepts_text(shoal_cons *c, int32_t node, const char *s)
{
    int32_t save = c->root;
    int mode = c->mode;
    c->root = node;
    c->mode = MODE_JSON;
    mstate *a = shoal_xmalloc(sizeof *a), *b = shoal_xmalloc(sizeof *b);
    initial(c, a);
    for (const char *p = s; *p && a->n; p++) {
        step(c, a, (uint8_t)*p, b);
        mstate *t = a;
        a = b;
        b = t;
    }
    int ok = a->n && complete(c, a);
    free(a);
    free(b);
    c->root = save;
    c->mode = mode;
    return ok;
}

static int resolve_ref(comp *cc, const char *ref, const char *path, int32_t *out)
{
    shoal_cons *c = cc->c;
    json_t *m = json_object_get(cc->refs, ref);
    if (m) {
        *out = (int32_t)json_integer_value(m);
        return 0;
    }
    if (ref[0] != '#')
        return CERR(SHOAL_EUNSUPPORTED, path, "$ref '%s': only local references (#/$defs/NAME) are supported", ref);
    /* JSON pointer walk */
    const json_t *t = cc->doc;
    const char *p = ref + 1;
    while (*p == '/') {
        p++;
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        char key[256];
        size_t k = 0;
        for (size_t i = 0; i < n && k + 1 < sizeof key; i++) {
            if (p[i] == '~' && i + 1 < n && (p[i + 1] == '0' || p[i + 1] == '1')) {
                key[k++] = p[i + 1] == '0' ? '~' : '/';
                i++;
            } else {
                key[k++] = p[i];
            }
        }
        key[k] = '\0';
        if (json_is_object(t))
            t = json_object_get(t, key);
        else if (json_is_array(t)) {
            char *endp;
            long ix = strtol(key, &endp, 10);
            t = *endp || ix < 0 ? NULL : json_array_get(t, (size_t)ix);
        } else
            t = NULL;
        if (!t)
            return CERR(SHOAL_EINVAL, path, "$ref '%s' does not resolve", ref);
        p += n;
    }
    if (*p)
        return CERR(SHOAL_EINVAL, path, "$ref '%s' is not a JSON pointer", ref);
    int id = new_node(c, K_REF);
    if (id < 0)
        return nodes_full(cc, path), SHOAL_ERANGE;
    json_object_set_new(cc->refs, ref, json_integer(id));
    int32_t target;
    int rc = compile_schema(cc, t, ref + 1, &target);
    if (rc)
        return rc;
    c->n[id].ref = target;
    *out = id;
    return 0;
}

static int compile_schema(comp *cc, const json_t *s, const char *path, int32_t *out)
{
    shoal_cons *c = cc->c;
    int rc;
    if (++cc->depth > 64) {
        cc->depth--;
        return CERR(SHOAL_ERANGE, path, "the schema is nested deeper than 64");
    }
    if (!s || json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        int id = new_node(c, K_ANY);
        cc->depth--;
        if (id < 0)
            return nodes_full(cc, path), SHOAL_ERANGE;
        *out = id;
        return 0;
    }
    if (json_is_false(s)) {
        cc->depth--;
        return CERR(SHOAL_EUNSUPPORTED, path, "a false schema (nothing is valid)");
    }
    if (!json_is_object(s)) {
        cc->depth--;
        return CERR(SHOAL_EINVAL, path, "a schema must be an object or a boolean");
    }
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)s, key, val) {
        if (in_list(annotations, key) || in_list(obj_kw, key) || in_list(arr_kw, key) || in_list(str_kw, key) ||
            !strcmp(key, "type") || !strcmp(key, "enum") || !strcmp(key, "const") || !strcmp(key, "anyOf") ||
            !strcmp(key, "oneOf") || !strcmp(key, "$ref"))
            continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", path, key);
        cc->depth--;
        return CERR(SHOAL_EUNSUPPORTED, p, "unsupported keyword '%s' (docs/API.md lists the supported ones)", key);
    }
    const json_t *ref = json_object_get(s, "$ref"), *any = json_object_get(s, "anyOf"),
                 *one = json_object_get(s, "oneOf"), *en = json_object_get(s, "enum"),
                 *cn = json_object_get(s, "const"), *ty = json_object_get(s, "type");
    int structural = 0; /* keywords other than annotations, enum/const, $ref, anyOf */
    json_object_foreach((json_t *)s, key, val) {
        if (!in_list(annotations, key) && strcmp(key, "$ref") && strcmp(key, "anyOf") && strcmp(key, "oneOf") &&
            strcmp(key, "enum") && strcmp(key, "const"))
            structural = 1;
    }
    rc = 0;
    if (ref) {
        if (!json_is_string(ref))
            rc = CERR(SHOAL_EINVAL, path, "'$ref' must be a string");
        else if (structural || any || one || en || cn)
            rc = CERR(SHOAL_EUNSUPPORTED, path, "'$ref' with sibling keywords");
        else
            rc = resolve_ref(cc, json_string_value(ref), path, out);
        cc->depth--;
        return rc;
    }
    if (any || one) {
        const json_t *alts = any ? any : one;
        const char *kw = any ? "anyOf" : "oneOf";
        if ((any && one) || structural || en || cn) {
            cc->depth--;
            return CERR(SHOAL_EUNSUPPORTED, path, "'%s' with sibling keywords", kw);
        }
        if (!json_is_array(alts) || json_array_size(alts) == 0 || json_array_size(alts) > 64) {
            cc->depth--;
            return CERR(SHOAL_EINVAL, path, "'%s' must be a non-empty array (at most 64)", kw);
        }
        int n = (int)json_array_size(alts);
        int id = new_node(c, K_ANYOF);
        if (id < 0) {
            cc->depth--;
            return nodes_full(cc, path), SHOAL_ERANGE;
        }
        int at = new_idx(c, n);
        c->n[id].nalts = n;
        c->n[id].alts0 = at;
        for (int i = 0; i < n; i++) {
            char p[512];
            snprintf(p, sizeof p, "%s/%s/%d", path, kw, i);
            int32_t v;
            if ((rc = compile_schema(cc, json_array_get(alts, (size_t)i), p, &v))) {
                cc->depth--;
                return rc;
            }
            c->idx[at + i] = v;
        }
        *out = id;
        cc->depth--;
        return 0;
    }
    /* the typed part */
    int32_t base = -1;
    const char *types[8];
    int nt = 0;
    if (ty) {
        if (json_is_string(ty)) {
            types[nt++] = json_string_value(ty);
        } else if (json_is_array(ty) && json_array_size(ty) > 0 && json_array_size(ty) <= 7) {
            size_t i;
            json_t *t;
            json_array_foreach(ty, i, t) {
                if (!json_is_string(t)) {
                    cc->depth--;
                    return CERR(SHOAL_EINVAL, path, "'type' must list strings");
                }
                types[nt++] = json_string_value(t);
            }
        } else {
            cc->depth--;
            return CERR(SHOAL_EINVAL, path, "'type' must be a string or a list of 1-7 strings");
        }
    } else {
        int o = 0, a = 0, st = 0;
        json_object_foreach((json_t *)s, key, val) {
            o |= in_list(obj_kw, key);
            a |= in_list(arr_kw, key);
            st |= in_list(str_kw, key);
        }
        if (o + a + st > 1) {
            cc->depth--;
            return CERR(SHOAL_EUNSUPPORTED, path, "keywords of several types without 'type'");
        }
        if (o)
            types[nt++] = "object";
        else if (a)
            types[nt++] = "array";
        else if (st)
            types[nt++] = "string";
    }
    if (nt == 0) {
        if ((base = new_node(c, K_ANY)) < 0) {
            cc->depth--;
            return nodes_full(cc, path), SHOAL_ERANGE;
        }
    } else if (nt == 1) {
        if ((rc = typed(cc, s, types[0], path, &base))) {
            cc->depth--;
            return rc;
        }
    } else {
        int id = new_node(c, K_ANYOF);
        if (id < 0) {
            cc->depth--;
            return nodes_full(cc, path), SHOAL_ERANGE;
        }
        int at = new_idx(c, nt);
        c->n[id].nalts = nt;
        c->n[id].alts0 = at;
        for (int i = 0; i < nt; i++) {
            int32_t v;
            if ((rc = typed(cc, s, types[i], path, &v))) {
                cc->depth--;
                return rc;
            }
            c->idx[at + i] = v;
        }
        base = id;
    }
    if (en || cn) {
        if (en && cn) {
            cc->depth--;
            return CERR(SHOAL_EUNSUPPORTED, path, "'enum' together with 'const'");
        }
        if (en && (!json_is_array(en) || json_array_size(en) == 0 || json_array_size(en) > 4096)) {
            cc->depth--;
            return CERR(SHOAL_EINVAL, path, "'enum' must be a non-empty array (at most 4096)");
        }
        size_t n = en ? json_array_size(en) : 1;
        const char **lits = shoal_xcalloc(n, sizeof *lits);
        char **own = shoal_xcalloc(n, sizeof *own);
        int k = 0;
        for (size_t i = 0; i < n; i++) {
            const json_t *v = en ? json_array_get(en, i) : cn;
            own[i] = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            if (own[i] && accepts_text(c, base, own[i]))
                lits[k++] = own[i];
        }
        rc = k ? lit_node(cc, lits, k, path, out)
               : CERR(SHOAL_EINVAL, path, "no value of '%s' satisfies the rest of the schema", en ? "enum" : "const");
        for (size_t i = 0; i < n; i++)
            free(own[i]);
        free(own);
        free(lits);
        cc->depth--;
        return rc;
    }
    *out = base;
    cc->depth--;
    return 0;
}

static void any_nodes(shoal_cons *c)
{
    c->any_obj = new_node(c, K_OBJ);
    int32_t any = new_node(c, K_ANY);
    c->n[c->any_obj].addl = any;
    c->n[c->any_obj].ktrie = new_tnode(c, 0);
    c->any_arr = new_node(c, K_ARR);
    c->n[c->any_arr].items = any;
    c->any_str = new_node(c, K_STR);
    c->any_num = new_node(c, K_NUM);
    c->any_tfn = new_node(c, K_LIT);
    int32_t r = new_tnode(c, 0);
    c->n[c->any_tfn].ktrie = r;
    const char *l[] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++)
        c->t[trie_add(c, r, l[i], strlen(l[i]), 0)].term = 0;
}

int shoal_cons_compile_json(shoal_cons **out, const json_t *schema, char *err, size_t errlen)
{
    *out = NULL;
    shoal_cons *c = cons_new(MODE_JSON);
    any_nodes(c);
    if (!schema) {
        c->root = c->any_obj;
        *out = c;
        return 0;
    }
    comp cc = {.c = c, .doc = schema, .refs = json_object(), .err = err, .errlen = errlen};
    int32_t root;
    int rc = compile_schema(&cc, schema, "", &root);
    json_decref(cc.refs);
    if (rc) {
        shoal_cons_free(c);
        return rc;
    }
    c->root = root;
    *out = c;
    return 0;
}

int shoal_cons_compile_regex(shoal_cons **out, const char *re, size_t len, char *err, size_t errlen)
{
    *out = NULL;
    shoal_cons *c = cons_new(MODE_REGEX);
    any_nodes(c);
    int rc = shoal__cons_re_compile(&c->dfa, re, len, 0, 0, &c->re_start, err, errlen);
    if (rc) {
        shoal_cons_free(c);
        return rc;
    }
    c->root = c->any_obj; /* unused in MODE_REGEX */
    *out = c;
    return 0;
}

int shoal_cons_compile_gbnf(shoal_cons **out, const char *text, size_t len, char *err, size_t errlen)
{
    *out = NULL;
    char *re;
    int rc = shoal__cons_gbnf_to_regex(text, len, &re, err, errlen);
    if (rc)
        return rc;
    rc = shoal_cons_compile_regex(out, re, strlen(re), err, errlen);
    free(re);
    return rc;
}

int shoal_cons_compile_choice(shoal_cons **out, const char *const *choices, int n, char *err, size_t errlen)
{
    *out = NULL;
    if (n < 1 || n > 4096)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "choice: between 1 and 4096 choices");
    for (int i = 0; i < n; i++)
        if (!choices[i][0])
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "choice %d is empty", i);
    shoal_cons *c = cons_new(MODE_RAW);
    any_nodes(c);
    comp cc = {.c = c, .err = err, .errlen = errlen};
    int rc = lit_node(&cc, choices, n, "", &c->root);
    if (rc) {
        shoal_cons_free(c);
        return rc;
    }
    *out = c;
    return 0;
}

int shoal_cons_compile_spec(shoal_cons **out, const json_t *spec, char *err, size_t errlen)
{
    *out = NULL;
    const char *kind = json_string_value(json_object_get(spec, "kind"));
    if (!kind)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "constraint without a kind");
    if (!strcmp(kind, "json")) {
        const json_t *sc = json_object_get(spec, "schema");
        return shoal_cons_compile_json(out, json_is_null(sc) ? NULL : sc, err, errlen);
    }
    if (!strcmp(kind, "regex")) {
        const json_t *p = json_object_get(spec, "pattern");
        if (!json_is_string(p))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "regex: the pattern must be a string");
        return shoal_cons_compile_regex(out, json_string_value(p), json_string_length(p), err, errlen);
    }
    if (!strcmp(kind, "choice")) {
        const json_t *a = json_object_get(spec, "choices");
        if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > 4096)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "choice: a non-empty array of strings (at most 4096)");
        int n = (int)json_array_size(a);
        const char **v = shoal_xcalloc((size_t)n, sizeof *v);
        for (int i = 0; i < n; i++) {
            v[i] = json_string_value(json_array_get(a, (size_t)i));
            if (!v[i] || strlen(v[i]) != json_string_length(json_array_get(a, (size_t)i))) {
                free(v);
                return shoal_err_set(err, errlen, SHOAL_EINVAL, "choice %d: a string without NUL", i);
            }
        }
        int rc = shoal_cons_compile_choice(out, v, n, err, errlen);
        free(v);
        return rc;
    }
    if (!strcmp(kind, "grammar")) {
        const json_t *gr = json_object_get(spec, "gbnf");
        if (!json_is_string(gr))
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "grammar: a GBNF string");
        return shoal_cons_compile_gbnf(out, json_string_value(gr), json_string_length(gr), err, errlen);
    }
    return shoal_err_set(err, errlen, SHOAL_EINVAL, "constraint kind '%s'", kind);
}

/* ---- vocabulary trie ---------------------------------------------------- */

typedef struct {
    int32_t *skip; /* index past the subtree */
    int32_t *tok;  /* token ending here, -1 none */
    uint8_t *byte;
    uint16_t *depth;
    int32_t n;
} vtrie;

struct shoal_cons_vocab {
    int32_t n_vocab, n_ranks;
    uint8_t *blob;
    uint32_t *off; /* [n_ranks + 1] */
    vtrie all, odd; /* every token; the tokens outside plain */
    uint8_t *plain; /* [n_vocab]: only plain JSON string bytes, valid UTF-8 (a trailing partial character allowed) */
    uint8_t *plain_chars; /* [n_vocab]: the characters a plain token starts (<= 254), 255 when not plain */
    int maxlen;
    int32_t n_plain;
};

static const shoal_cons_vocab *sort_v;
static int cmp_tok(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    const shoal_cons_vocab *v = sort_v;
    uint32_t lx = v->off[x + 1] - v->off[x], ly = v->off[y + 1] - v->off[y];
    int r = memcmp(v->blob + v->off[x], v->blob + v->off[y], lx < ly ? lx : ly);
    return r ? r : (lx > ly) - (lx < ly);
}

/* preorder trie of ids[0..n) sorted by bytes */
static void trie_build(const shoal_cons_vocab *v, const int32_t *ids, int32_t n, vtrie *t)
{
    size_t cap = 1024, cnt = 0;
    t->skip = shoal_xmalloc(sizeof *t->skip * cap);
    t->tok = shoal_xmalloc(sizeof *t->tok * cap);
    t->byte = shoal_xmalloc(cap);
    t->depth = shoal_xmalloc(sizeof *t->depth * cap);
    int32_t open[1024]; /* node index at each depth of the current path */
    int32_t prev = -1;
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *s = v->blob + v->off[ids[i]];
        uint32_t len = v->off[ids[i] + 1] - v->off[ids[i]];
        uint32_t common = 0;
        if (prev >= 0) {
            const uint8_t *q = v->blob + v->off[prev];
            uint32_t lq = v->off[prev + 1] - v->off[prev];
            while (common < len && common < lq && q[common] == s[common])
                common++;
            /* close the nodes of prev below the common prefix */
            for (uint32_t d = common; d < lq; d++)
                t->skip[open[d]] = (int32_t)cnt;
        }
        for (uint32_t d = common; d < len; d++) {
            if (cnt == cap) {
                cap *= 2;
                t->skip = shoal_xrealloc(t->skip, sizeof *t->skip * cap);
                t->tok = shoal_xrealloc(t->tok, sizeof *t->tok * cap);
                t->byte = shoal_xrealloc(t->byte, cap);
                t->depth = shoal_xrealloc(t->depth, sizeof *t->depth * cap);
            }
            t->byte[cnt] = s[d];
            t->depth[cnt] = (uint16_t)(d + 1);
            t->tok[cnt] = -1;
            open[d] = (int32_t)cnt++;
        }
        if (len)
            t->tok[open[len - 1]] = ids[i];
        prev = ids[i];
    }
    if (prev >= 0) {
        uint32_t lq = v->off[prev + 1] - v->off[prev];
        for (uint32_t d = 0; d < lq; d++)
            t->skip[open[d]] = (int32_t)cnt;
    }
    t->n = (int32_t)cnt;
}

static void trie_free(vtrie *t)
{
    free(t->skip);
    free(t->tok);
    free(t->byte);
    free(t->depth);
}

int shoal_cons_vocab_build(shoal_cons_vocab **out, const shoal_tok *t, char *err, size_t errlen)
{
    *out = NULL;
    shoal_cons_vocab *v = shoal_xcalloc(1, sizeof *v);
    v->n_vocab = shoal_tok_n_vocab(t);
    v->n_ranks = shoal_tok_n_ranks(t);
    v->off = shoal_xmalloc(sizeof *v->off * (size_t)(v->n_ranks + 1));
    size_t total = 0;
    for (int32_t i = 0; i < v->n_ranks; i++) {
        size_t n;
        shoal_tok_token_bytes(t, i, &n);
        total += n;
    }
    v->blob = shoal_xmalloc(total ? total : 1);
    size_t o = 0;
    int32_t *ids = shoal_xmalloc(sizeof *ids * (size_t)v->n_ranks);
    int32_t *odd = shoal_xmalloc(sizeof *odd * (size_t)v->n_ranks);
    v->plain = shoal_xcalloc((size_t)v->n_vocab, 1);
    v->plain_chars = shoal_xmalloc((size_t)v->n_vocab);
    memset(v->plain_chars, 255, (size_t)v->n_vocab);
    int32_t nodd = 0;
    for (int32_t i = 0; i < v->n_ranks; i++) {
        size_t n;
        const uint8_t *b = shoal_tok_token_bytes(t, i, &n);
        v->off[i] = (uint32_t)o;
        memcpy(v->blob + o, b, n);
        o += n;
        if ((int)n > v->maxlen)
            v->maxlen = (int)n;
        ids[i] = i;
        uint32_t sub = 0, chars = 0;
        int ok = n > 0;
        for (size_t k = 0; k < n && ok; k++)
            ok = b[k] != '"' && b[k] != '\\' && str_byte(&sub, b[k], &chars, 0, 0) == 0;
        v->plain[i] = (uint8_t)ok;
        v->n_plain += ok;
        if (ok)
            v->plain_chars[i] = (uint8_t)(chars > 254 ? 254 : chars);
        if (!ok)
            odd[nodd++] = i;
    }
    v->off[v->n_ranks] = (uint32_t)o;
    if (v->maxlen > 1000) {
        free(ids);
        free(odd);
        shoal_cons_vocab_free(v);
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "constrain: a token longer than 1000 bytes");
    }
    sort_v = v; /* qsort has no context argument in C11; build runs once, at startup */
    qsort(ids, (size_t)v->n_ranks, sizeof *ids, cmp_tok);
    qsort(odd, (size_t)nodd, sizeof *odd, cmp_tok);
    sort_v = NULL;
    trie_build(v, ids, v->n_ranks, &v->all);
    trie_build(v, odd, nodd, &v->odd);
    free(ids);
    free(odd);
    *out = v;
    return 0;
}

void shoal_cons_vocab_free(shoal_cons_vocab *v)
{
    if (!v)
        return;
    free(v->blob);
    free(v->off);
    free(v->plain);
    free(v->plain_chars);
    trie_free(&v->all);
    trie_free(&v->odd);
    free(v);
}

int32_t shoal_cons_vocab_size(const shoal_cons_vocab *v)
{
    return v->n_vocab;
}

/* ---- runs ---------------------------------------------------------------- */

#define MAX_END 64

struct shoal_cons_run {
    const shoal_cons *c;
    const shoal_cons_vocab *v;
    mstate cur;
    mstate *lvl; /* [maxlen + 1] walk states */
    int32_t *dlvl; /* [maxlen + 1] DFA states of the regex walk */
    int32_t end[MAX_END];
    int n_end, end_pos; /* end_pos: end ids taken; -1 while in the text */
    int32_t pre[MAX_END];
    int n_pre, pre_pos; /* forced ids before the text, and how many are taken */
};

int shoal_cons_run_set_prefix(shoal_cons_run *r, const int32_t *ids, int n)
{
    if (n < 0 || n > MAX_END || r->pre_pos || r->end_pos >= 0)
        return SHOAL_EINVAL;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= r->v->n_vocab)
            return SHOAL_EINVAL;
    memcpy(r->pre, ids, sizeof *ids * (size_t)n);
    r->n_pre = n;
    return 0;
}

int shoal_cons_run_create(shoal_cons_run **out, const shoal_cons *c, const shoal_cons_vocab *v,
                          const int32_t *end_ids, int n_end, char *err, size_t errlen)
{
    *out = NULL;
    if (n_end < 1 || n_end > MAX_END)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "constrain: 1 to %d end ids", MAX_END);
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] < 0 || end_ids[i] >= v->n_vocab)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "constrain: end id %d outside the vocabulary",
                                 (int)end_ids[i]);
    shoal_cons_run *r = shoal_xcalloc(1, sizeof *r);
    r->c = c;
    r->v = v;
    r->lvl = shoal_xmalloc(sizeof *r->lvl * (size_t)(v->maxlen + 2));
    r->dlvl = shoal_xmalloc(sizeof *r->dlvl * (size_t)(v->maxlen + 2));
    memcpy(r->end, end_ids, sizeof *end_ids * (size_t)n_end);
    r->n_end = n_end;
    r->end_pos = -1;
    initial(c, &r->cur);
    *out = r;
    return 0;
}

int shoal_cons_run_reset(shoal_cons_run *r, const shoal_cons *c, const int32_t *end_ids, int n_end)
{
    if (n_end < 1 || n_end > MAX_END)
        return SHOAL_EINVAL;
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] < 0 || end_ids[i] >= r->v->n_vocab)
            return SHOAL_EINVAL;
    r->c = c;
    memcpy(r->end, end_ids, sizeof *end_ids * (size_t)n_end);
    r->n_end = n_end;
    r->end_pos = -1;
    r->n_pre = r->pre_pos = 0;
    initial(c, &r->cur);
    return 0;
}

shoal_cons_run *shoal_cons_run_clone(const shoal_cons_run *src)
{
    shoal_cons_run *r = shoal_xcalloc(1, sizeof *r);
    r->lvl = shoal_xmalloc(sizeof *r->lvl * (size_t)(src->v->maxlen + 2));
    r->dlvl = shoal_xmalloc(sizeof *r->dlvl * (size_t)(src->v->maxlen + 2));
    shoal_cons_run_copy(r, src);
    return r;
}

void shoal_cons_run_copy(shoal_cons_run *dst, const shoal_cons_run *src)
{
    mstate *lvl = dst->lvl;
    int32_t *dlvl = dst->dlvl;
    *dst = *src;
    dst->lvl = lvl;
    dst->dlvl = dlvl;
}

void shoal_cons_run_free(shoal_cons_run *r)
{
    if (!r)
        return;
    free(r->lvl);
    free(r->dlvl);
    free(r);
}

static int walk(shoal_cons_run *r, const vtrie *t, uint8_t *mask)
{
    const shoal_cons *c = r->c;
    int count = 0;
    r->lvl[0] = r->cur;
    for (int32_t i = 0; i < t->n;) {
        int d = t->depth[i];
        mstate *st = &r->lvl[d];
        step(c, &r->lvl[d - 1], t->byte[i], st);
        if (!st->n) {
            i = t->skip[i];
            continue;
        }
        if (t->tok[i] >= 0 && !mask[t->tok[i]]) {
            mask[t->tok[i]] = 1;
            count++;
        }
        i++;
    }
    return count;
}

/* A whole-text regex (guided_regex, a GBNF grammar) at DFA state s0: the
 * matcher state is that one integer, so the walk steps the DFA alone (an int
 * per depth instead of a matcher state; the DFA's dead states are pruned at
 * compile, so a surviving path can always reach an accepting state). */
static int walk_dfa(shoal_cons_run *r, const vtrie *t, int32_t s0, uint8_t *mask)
{
    const int32_t *next = r->c->dfa.next;
    int32_t *st = r->dlvl;
    int count = 0;
    st[0] = s0;
    for (int32_t i = 0; i < t->n;) {
        int d = t->depth[i];
        int32_t x = next[(size_t)st[d - 1] * 256 + t->byte[i]];
        if (x < 0) {
            i = t->skip[i];
            continue;
        }
        st[d] = x;
        if (t->tok[i] >= 0) {
            mask[t->tok[i]] = 1;
            count++;
        }
        i++;
    }
    return count;
}

/* The fast path's condition: one stack, at a character boundary, in a
 * string body without a pattern, or in a key that may be an additional one
 * (a plain token keeps its additional path alive whatever the declared
 * names). Returns the characters a plain token may add (UNLIMITED: any), or
 * -1 when the path does not apply. */
static int64_t plain_one(const shoal_cons *c, const stack *s)
{
    const frame *f = &s->f[s->d - 1];
    if (f->c != 0)
        return -1;
    if (f->ph == PH_STR) {
        const cnode *n = &c->n[f->node];
        if (n->re >= 0)
            return -1;
        return n->maxc == UNLIMITED ? (int64_t)UNLIMITED : (int64_t)n->maxc - (int64_t)f->a;
    }
    return f->ph == PH_KEY && (f->b & 1) ? (int64_t)UNLIMITED : -1;
}

/* Every live alternative inside a plain string (e.g. anyOf of two string
 * schemas): a plain token is allowed when one of them has room for it, so
 * the room is the largest (the union the byte walk would compute). */
static int64_t plain_string(const shoal_cons_run *r)
{
    int64_t room = -1;
    for (int i = 0; i < r->cur.n; i++) {
        int64_t one = plain_one(r->c, &r->cur.s[i]);
        if (one < 0)
            return -1;
        room = one > room ? one : room;
    }
    return room;
}

int shoal_cons_run_mask(shoal_cons_run *r, uint8_t *mask)
{
    const shoal_cons_vocab *v = r->v;
    memset(mask, 0, (size_t)v->n_vocab);
    if (r->pre_pos < r->n_pre) {
        mask[r->pre[r->pre_pos]] = 1;
        return 1;
    }
    if (r->end_pos >= 0) {
        if (r->end_pos >= r->n_end)
            return 0;
        mask[r->end[r->end_pos]] = 1;
        return 1;
    }
    int count;
    int64_t room = plain_string(r);
    const frame *top = &r->cur.s[0].f[r->cur.s[0].d - 1];
    if (r->cur.n == 1 && top->ph == PH_DOC_RE) {
        count = walk_dfa(r, &v->all, (int32_t)top->a, mask);
    } else if (room == (int64_t)UNLIMITED) {
        memcpy(mask, v->plain, (size_t)v->n_vocab);
        count = v->n_plain + walk(r, &v->odd, mask);
    } else if (room >= 0) {
        /* a maxLength: the plain tokens that fit, then the others walked */
        count = 0;
        for (int32_t i = 0; i < v->n_ranks; i++) {
            uint8_t ok = v->plain_chars[i] <= room;
            mask[i] = ok;
            count += ok;
        }
        count += walk(r, &v->odd, mask);
    } else {
        count = walk(r, &v->all, mask);
    }
    if (complete(r->c, &r->cur) && !mask[r->end[0]]) {
        mask[r->end[0]] = 1;
        count++;
    }
    return count;
}

int shoal_cons_run_feed(shoal_cons_run *r, const uint8_t *b, size_t n)
{
    if (r->end_pos >= 0)
        return n ? SHOAL_EINVAL : 0;
    mstate *a = &r->lvl[0], *x = &r->lvl[1];
    *a = r->cur;
    for (size_t i = 0; i < n; i++) {
        step(r->c, a, b[i], x);
        if (!x->n)
            return SHOAL_EINVAL;
        mstate *t = a;
        a = x;
        x = t;
    }
    r->cur = *a;
    return 0;
}

int shoal_cons_run_accept(shoal_cons_run *r, int32_t id)
{
    if (r->pre_pos < r->n_pre) {
        if (id != r->pre[r->pre_pos])
            return SHOAL_EINVAL;
        r->pre_pos++;
        return 0;
    }
    if (r->end_pos >= 0) {
        if (r->end_pos >= r->n_end || id != r->end[r->end_pos])
            return SHOAL_EINVAL;
        r->end_pos++;
        return 0;
    }
    if (id == r->end[0] && complete(r->c, &r->cur)) {
        r->end_pos = 1;
        return 0;
    }
    if (id < 0 || id >= r->v->n_ranks)
        return SHOAL_EINVAL;
    const shoal_cons_vocab *v = r->v;
    return shoal_cons_run_feed(r, v->blob + v->off[id], v->off[id + 1] - v->off[id]);
}

int shoal_cons_run_text_complete(const shoal_cons_run *r)
{
    return r->end_pos >= 0 || complete(r->c, &r->cur);
}

int shoal_cons_run_done(const shoal_cons_run *r)
{
    return r->end_pos >= r->n_end;
}
