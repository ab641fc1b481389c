/* toolcons: the state machine of toolcons.h. */
#include "coordinator/api/toolcons.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"

enum { P_REASON, P_CONTENT, P_AFTER_RESP, P_TOOLS, P_HEADER, P_ARGS, P_DONE };

/* The id runs K3's format fixes (each piece encoded on its own, as chat.c
 * writes its segments), encoded once at open: forcing one never tokenizes. */
enum { F_REQUIRED, F_THINK, F_THINK_REQUIRED, F_RESPONSE, F_TOOLS, F_MESSAGE, F_SECTION, F_ARGS_PRE, F_ARGS_POST,
       F_N };
static const char *const f_pieces[F_N][8] = {
    [F_REQUIRED] = {"<|close|>", "response", "<|sep|>"},
    [F_THINK] = {"think", "<|sep|>", "<|open|>", "response", "<|sep|>"},
    [F_THINK_REQUIRED] = {"think", "<|sep|>", "<|open|>", "response", "<|sep|>", "<|close|>", "response", "<|sep|>"},
    [F_RESPONSE] = {"response", "<|sep|>"},
    [F_TOOLS] = {"tools", "<|sep|>"},
    [F_MESSAGE] = {"message", "<|sep|>", "<|end_of_msg|>"},
    [F_SECTION] = {"tools", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"},
    [F_ARGS_PRE] = {"<|open|>", "json", " type", "=\"", "object", "\"", "<|sep|>"},
    [F_ARGS_POST] = {"<|close|>", "json", "<|sep|>", "<|close|>", "call", "<|sep|>"},
};
static const int f_count[F_N] = {3, 5, 8, 2, 2, 3, 6, 7, 6};

#define FORCE_CAP 64

typedef struct {
    const char *name;     /* borrowed from the tools array; NULL: none */
    int in_header;        /* a name K3's call header can carry */
    const json_t *params; /* an object, or NULL: any JSON object */
    shoal_cons *args;     /* compiled on first need (NULL: not yet); may be the shared any-object */
} tool;

/* What a toolcons and its look-ahead clones share, read-only but for the
 * caches, which only the original fills (on the caller's thread, never while
 * a clone runs on another: toolcons.h). */
typedef struct {
    const shoal_tok *tok;
    const shoal_cons_vocab *voc;
    int required, max_calls;
    int32_t open_id, close_id, sep_id, n_vocab;
    int32_t seq[F_N][FORCE_CAP];
    int nseq[F_N];   /* -1: not encodable on this vocabulary */
    shoal_cons *any; /* any JSON object: a refused schema's stand-in, and the run's first constraint */
    tool *tools;
    int ntools;
    shoal_cons **hdr;  /* [nhdr]: the header choice of call k at [k - 1] */
    signed char *hst;  /* [nhdr]: 1 compiled, -1 refused (no declared name fits a header), 0 not yet */
    int nhdr;
} compiled;

struct shoal_toolcons {
    compiled *c;   /* owned by the original, borrowed by a clone */
    int lookahead; /* a clone: never compiles (SHOAL_EBUSY instead) */
    int ncalls, phase, after;
    const int32_t *fp; /* ids being forced (into c->seq), fp[fi..nf) left */
    int nf, fi;
    shoal_cons_run *run; /* its own scratch: the header's constraint, then the arguments' */
    size_t nhdr;
    char hdr[512]; /* bytes of the call header so far */
};

int shoal_toolcons_ids(const shoal_tok *t, const char *const *pieces, int n, int32_t *out, int cap, char *err,
                       size_t errlen)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (pieces[i][0] == '<' && pieces[i][1] == '|') {
            int32_t id = shoal_tok_special_id(t, pieces[i]);
            if (id < 0 || k >= cap)
                return -1;
            out[k++] = id;
            continue;
        }
        shoal_tok_ids ids = {0};
        if (shoal_tok_encode(t, pieces[i], strlen(pieces[i]), 0, &ids, err, errlen) || k + (int)ids.n > cap) {
            shoal_tok_ids_free(&ids);
            return -1;
        }
        for (size_t j = 0; j < ids.n; j++)
            out[k++] = ids.v[j];
        shoal_tok_ids_free(&ids);
    }
    return k;
}

/* Force run f one id at a time, then enter phase `after`. */
static void force(shoal_toolcons *tc, int f, int after)
{
    if (tc->c->nseq[f] <= 0) { /* a vocabulary without these names */
        tc->phase = P_DONE;     /* free from here on */
        return;
    }
    tc->fp = tc->c->seq[f];
    tc->nf = tc->c->nseq[f];
    tc->fi = 0;
    tc->after = after;
}

static void compiled_free(compiled *c)
{
    if (!c)
        return;
    for (int i = 0; i < c->ntools; i++)
        if (c->tools[i].args != c->any)
            shoal_cons_free(c->tools[i].args);
    for (int k = 0; k < c->nhdr; k++)
        shoal_cons_free(c->hdr[k]);
    shoal_cons_free(c->any);
    free(c->tools);
    free(c->hdr);
    free(c->hst);
    free(c);
}

int shoal_toolcons_open(shoal_toolcons **out, const shoal_tok *t, const shoal_cons_vocab *v,
                        const shoal_toolcons_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    int32_t open_id = shoal_tok_special_id(t, "<|open|>"), close_id = shoal_tok_special_id(t, "<|close|>");
    int32_t sep_id = shoal_tok_special_id(t, "<|sep|>"), eom_id = shoal_tok_special_id(t, "<|end_of_msg|>");
    if (open_id < 0 || close_id < 0 || sep_id < 0 || eom_id < 0)
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "constrained tool calls need K3's chat markers");
    compiled *c = shoal_xcalloc(1, sizeof *c);
    c->tok = t;
    c->voc = v;
    c->required = o->required;
    c->max_calls = o->max_calls;
    c->n_vocab = shoal_cons_vocab_size(v);
    c->open_id = open_id;
    c->close_id = close_id;
    c->sep_id = sep_id;
    char e2[200];
    for (int f = 0; f < F_N; f++)
        c->nseq[f] = shoal_toolcons_ids(t, f_pieces[f], f_count[f], c->seq[f], FORCE_CAP, e2, sizeof e2);
    c->ntools = (int)json_array_size(o->tools);
    c->tools = shoal_xcalloc((size_t)(c->ntools ? c->ntools : 1), sizeof *c->tools);
    for (int i = 0; i < c->ntools; i++) {
        const json_t *tj = json_array_get(o->tools, (size_t)i), *fn = json_object_get(tj, "function");
        const char *name = json_string_value(json_object_get(fn ? fn : tj, "name"));
        const json_t *params = json_object_get(fn ? fn : tj, "parameters");
        c->tools[i].name = name;
        c->tools[i].in_header = name && name[0] && !strchr(name, '"') && strlen(name) <= 256;
        c->tools[i].params = json_is_object(params) ? params : NULL;
    }
    int rc;
    shoal_toolcons *tc = shoal_xcalloc(1, sizeof *tc);
    tc->c = c;
    if ((rc = shoal_cons_compile_json(&c->any, NULL, err, errlen)) ||
        (rc = shoal_cons_run_create(&tc->run, c->any, v, &c->sep_id, 1, err, errlen))) {
        shoal_toolcons_close(tc);
        return rc;
    }
    tc->phase = o->thinking ? P_REASON : P_CONTENT;
    if (o->required && !o->thinking)
        force(tc, F_REQUIRED, P_AFTER_RESP); /* a call is required: the content is empty, the section opens */
    *out = tc;
    return 0;
}

void shoal_toolcons_close(shoal_toolcons *tc)
{
    if (!tc)
        return;
    shoal_cons_run_free(tc->run);
    if (!tc->lookahead)
        compiled_free(tc->c);
    free(tc);
}

shoal_toolcons *shoal_toolcons_clone(const shoal_toolcons *src)
{
    shoal_toolcons *tc = shoal_xmalloc(sizeof *tc);
    *tc = *src;
    tc->lookahead = 1;
    tc->run = shoal_cons_run_clone(src->run);
    return tc;
}

void shoal_toolcons_copy(shoal_toolcons *dst, const shoal_toolcons *src)
{
    if (dst->c != src->c || !dst->lookahead)
        SHOAL_PANIC("toolcons: copy into a toolcons that is not a clone of the same original");
    shoal_cons_run *run = dst->run;
    memcpy(dst, src, offsetof(shoal_toolcons, hdr));
    memcpy(dst->hdr, src->hdr, src->nhdr < sizeof dst->hdr ? src->nhdr : sizeof dst->hdr);
    dst->run = run;
    dst->lookahead = 1;
    shoal_cons_run_copy(run, src->run);
}

int shoal_toolcons_calls(const shoal_toolcons *tc)
{
    return tc->ncalls;
}

static int allow(shoal_toolcons *tc, uint8_t *mask, int open, int close)
{
    memset(mask, 0, (size_t)tc->c->n_vocab);
    mask[tc->c->open_id] = (uint8_t)open;
    mask[tc->c->close_id] = (uint8_t)close;
    return open + close;
}

int shoal_toolcons_mask(shoal_toolcons *tc, uint8_t *mask, int32_t *ban)
{
    *ban = -1;
    if (tc->fi < tc->nf) {
        memset(mask, 0, (size_t)tc->c->n_vocab);
        mask[tc->fp[tc->fi]] = 1;
        return 1;
    }
    switch (tc->phase) {
    case P_AFTER_RESP:
        return allow(tc, mask, 1, !tc->c->required);
    case P_TOOLS:
        return allow(tc, mask, !tc->c->max_calls || tc->ncalls < tc->c->max_calls, tc->ncalls > 0);
    case P_HEADER:
    case P_ARGS:
        return shoal_cons_run_mask(tc->run, mask);
    case P_REASON:
    case P_CONTENT:
        *ban = tc->c->open_id;
        return -1;
    default:
        return -1;
    }
}

/* The header choice of call k (1-based): `call tool="NAME" index="k"` for
 * every declared NAME a header can carry. 0 with *out; -1 when no name
 * fits (or the choice is refused); 1 when it is not compiled and compile
 * is 0 (a clone). */
static int header_cons(compiled *c, int k, int compile, const shoal_cons **out)
{
    if (k > c->nhdr) {
        if (!compile)
            return 1;
        int n = k + 4;
        c->hdr = shoal_xrealloc(c->hdr, sizeof *c->hdr * (size_t)n);
        c->hst = shoal_xrealloc(c->hst, sizeof *c->hst * (size_t)n);
        memset(c->hdr + c->nhdr, 0, sizeof *c->hdr * (size_t)(n - c->nhdr));
        memset(c->hst + c->nhdr, 0, sizeof *c->hst * (size_t)(n - c->nhdr));
        c->nhdr = n;
    }
    if (!c->hst[k - 1]) {
        if (!compile)
            return 1;
        char **ch = shoal_xcalloc((size_t)(c->ntools ? c->ntools : 1), sizeof *ch);
        int m = 0;
        for (int i = 0; i < c->ntools; i++) {
            if (!c->tools[i].in_header)
                continue;
            size_t len = strlen(c->tools[i].name) + 48;
            ch[m] = shoal_xmalloc(len);
            snprintf(ch[m], len, "call tool=\"%s\" index=\"%d\"", c->tools[i].name, k);
            m++;
        }
        char err[200];
        int rc = m ? shoal_cons_compile_choice(&c->hdr[k - 1], (const char *const *)ch, m, err, sizeof err) : -1;
        for (int j = 0; j < m; j++)
            free(ch[j]);
        free(ch);
        c->hst[k - 1] = rc ? -1 : 1;
    }
    if (c->hst[k - 1] < 0)
        return -1;
    *out = c->hdr[k - 1];
    return 0;
}

/* Tool i's arguments (i < 0: no declared tool matched, any JSON object):
 * 0 with *out, 1 when not compiled and compile is 0. A schema the compiler
 * refuses is read as any JSON object (docs/API.md). */
static int args_cons(compiled *c, int i, int compile, const shoal_cons **out)
{
    if (i < 0) {
        *out = c->any;
        return 0;
    }
    tool *t = &c->tools[i];
    if (!t->args) {
        if (!compile)
            return 1;
        char err[300];
        if (!t->params) {
            t->args = c->any;
        } else if (shoal_cons_compile_json(&t->args, t->params, err, sizeof err)) {
            SHOAL_WARN("toolcons: a tool's parameters are read as any JSON object: %s", err);
            t->args = c->any;
        }
    }
    *out = t->args;
    return 0;
}

/* The run takes call ncalls + 1's header: 0, -1 (no header: free from
 * here on), 1 (a clone meets a header not compiled yet). */
static int header_begin(shoal_toolcons *tc)
{
    const shoal_cons *h;
    int rc = header_cons(tc->c, tc->ncalls + 1, !tc->lookahead, &h);
    if (rc)
        return rc;
    if (shoal_cons_run_reset(tc->run, h, &tc->c->sep_id, 1))
        return -1;
    tc->nhdr = 0;
    return 0;
}

/* The header is complete: the run takes the arguments of the tool it
 * names, after the forced json opening, before the forced closers. */
static int args_begin(shoal_toolcons *tc)
{
    compiled *c = tc->c;
    if (c->nseq[F_ARGS_PRE] < 0 || c->nseq[F_ARGS_POST] < 0)
        return -1;
    tc->hdr[tc->nhdr < sizeof tc->hdr ? tc->nhdr : sizeof tc->hdr - 1] = '\0';
    const char *q = strstr(tc->hdr, "tool=\"");
    int which = -1;
    if (q) {
        q += 6;
        const char *e = strchr(q, '"');
        for (int i = 0; e && i < c->ntools; i++) {
            const char *name = c->tools[i].name;
            if (name && strlen(name) == (size_t)(e - q) && !memcmp(name, q, (size_t)(e - q))) {
                which = i;
                break;
            }
        }
    }
    const shoal_cons *a;
    int rc = args_cons(c, which, !tc->lookahead, &a);
    if (rc)
        return rc;
    if (shoal_cons_run_reset(tc->run, a, c->seq[F_ARGS_POST], c->nseq[F_ARGS_POST]) ||
        shoal_cons_run_set_prefix(tc->run, c->seq[F_ARGS_PRE], c->nseq[F_ARGS_PRE]))
        return -1;
    return 0;
}

void shoal_toolcons_prepare(shoal_toolcons *tc)
{
    compiled *c = tc->c;
    int next = tc->fi < tc->nf ? tc->after : tc->phase;
    const shoal_cons *x;
    if (tc->lookahead || next == P_REASON || next == P_DONE)
        return;
    header_cons(c, tc->ncalls + 1, 1, &x);
    header_cons(c, tc->ncalls + 2, 1, &x);
    if (next >= P_AFTER_RESP)
        for (int i = 0; i < c->ntools; i++)
            args_cons(c, i, 1, &x);
}

int shoal_toolcons_accept(shoal_toolcons *tc, int32_t id)
{
    compiled *c = tc->c;
    int rc;
    if (tc->fi < tc->nf) {
        if (++tc->fi == tc->nf) {
            tc->fi = tc->nf = 0;
            tc->phase = tc->after;
        }
        return 0;
    }
    switch (tc->phase) {
    case P_REASON:
        if (id == c->close_id)
            force(tc, c->required ? F_THINK_REQUIRED : F_THINK, c->required ? P_AFTER_RESP : P_CONTENT);
        break;
    case P_CONTENT:
        if (id == c->close_id)
            force(tc, F_RESPONSE, P_AFTER_RESP);
        break;
    case P_AFTER_RESP:
        if (id == c->open_id)
            force(tc, F_TOOLS, P_TOOLS);
        else
            force(tc, F_MESSAGE, P_DONE);
        break;
    case P_TOOLS:
        if (id == c->open_id) {
            if ((rc = header_begin(tc)) > 0)
                return SHOAL_EBUSY;
            tc->phase = rc ? P_DONE : P_HEADER;
        } else {
            force(tc, F_SECTION, P_DONE);
        }
        break;
    case P_HEADER: {
        if (shoal_cons_run_accept(tc->run, id))
            break;
        size_t n;
        const uint8_t *b = id != c->sep_id ? shoal_tok_token_bytes(c->tok, id, &n) : NULL;
        if (b && tc->nhdr + n < sizeof tc->hdr) {
            memcpy(tc->hdr + tc->nhdr, b, n);
            tc->nhdr += n;
        }
        if (shoal_cons_run_done(tc->run)) {
            if ((rc = args_begin(tc)) > 0)
                return SHOAL_EBUSY;
            tc->phase = rc ? P_DONE : P_ARGS;
        }
        break;
    }
    case P_ARGS:
        if (shoal_cons_run_accept(tc->run, id))
            break;
        if (shoal_cons_run_done(tc->run)) {
            tc->ncalls++;
            tc->phase = P_TOOLS;
        }
        break;
    default:
        break;
    }
    return 0;
}
