/* toolcons: the state machine of toolcons.h. */
#include "coordinator/api/toolcons.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"

enum { P_REASON, P_CONTENT, P_AFTER_RESP, P_TOOLS, P_HEADER, P_ARGS, P_DONE };

#define FORCE_CAP 64

struct shoal_toolcons {
    const shoal_tok *tok;
    const shoal_cons_vocab *voc;
    const json_t *tools;
    int required, max_calls, ncalls, phase, after;
    int32_t open_id, close_id, sep_id, eom_id, n_vocab;
    int32_t force[FORCE_CAP];
    int nf, fi;
    shoal_cons *cons;    /* the header choice, then the arguments' schema */
    shoal_cons_run *run;
    char hdr[512];       /* bytes of the call header so far */
    size_t nhdr;
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

/* Queue pieces to be forced one id at a time, then enter phase `after`. */
static void force(shoal_toolcons *tc, const char *const *pieces, int n, int after)
{
    char err[160];
    int got = shoal_toolcons_ids(tc->tok, pieces, n, tc->force + tc->nf, FORCE_CAP - tc->nf, err, sizeof err);
    if (got < 0) { /* the markers were checked at open: a vocabulary without these names */
        tc->phase = P_DONE; /* free from here on */
        return;
    }
    tc->nf += got;
    tc->after = after;
}

static void run_drop(shoal_toolcons *tc)
{
    shoal_cons_run_free(tc->run);
    tc->run = NULL;
    shoal_cons_free(tc->cons);
    tc->cons = NULL;
}

static const char *tool_name(const json_t *t)
{
    const json_t *fn = json_object_get(t, "function");
    return json_string_value(json_object_get(fn ? fn : t, "name"));
}

int shoal_toolcons_open(shoal_toolcons **out, const shoal_tok *t, const shoal_cons_vocab *v,
                        const shoal_toolcons_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    shoal_toolcons *tc = shoal_xcalloc(1, sizeof *tc);
    tc->tok = t;
    tc->voc = v;
    tc->tools = o->tools;
    tc->required = o->required;
    tc->max_calls = o->max_calls;
    tc->n_vocab = shoal_cons_vocab_size(v);
    tc->open_id = shoal_tok_special_id(t, "<|open|>");
    tc->close_id = shoal_tok_special_id(t, "<|close|>");
    tc->sep_id = shoal_tok_special_id(t, "<|sep|>");
    tc->eom_id = shoal_tok_special_id(t, "<|end_of_msg|>");
    if (tc->open_id < 0 || tc->close_id < 0 || tc->sep_id < 0 || tc->eom_id < 0) {
        free(tc);
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "constrained tool calls need K3's chat markers");
    }
    tc->phase = o->thinking ? P_REASON : P_CONTENT;
    if (o->required && !o->thinking) {
        /* a call is required: the content is empty, the section opens */
        static const char *const p[] = {"<|close|>", "response", "<|sep|>"};
        force(tc, p, 3, P_AFTER_RESP);
    }
    *out = tc;
    return 0;
}

void shoal_toolcons_close(shoal_toolcons *tc)
{
    if (!tc)
        return;
    run_drop(tc);
    free(tc);
}

int shoal_toolcons_calls(const shoal_toolcons *tc)
{
    return tc->ncalls;
}

static int allow(shoal_toolcons *tc, uint8_t *mask, int open, int close)
{
    memset(mask, 0, (size_t)tc->n_vocab);
    mask[tc->open_id] = (uint8_t)open;
    mask[tc->close_id] = (uint8_t)close;
    return open + close;
}

int shoal_toolcons_mask(shoal_toolcons *tc, uint8_t *mask, int32_t *ban)
{
    *ban = -1;
    if (tc->fi < tc->nf) {
        memset(mask, 0, (size_t)tc->n_vocab);
        mask[tc->force[tc->fi]] = 1;
        return 1;
    }
    switch (tc->phase) {
    case P_AFTER_RESP:
        return allow(tc, mask, 1, !tc->required);
    case P_TOOLS:
        return allow(tc, mask, !tc->max_calls || tc->ncalls < tc->max_calls, tc->ncalls > 0);
    case P_HEADER:
    case P_ARGS:
        return shoal_cons_run_mask(tc->run, mask);
    case P_REASON:
    case P_CONTENT:
        *ban = tc->open_id;
        return -1;
    default:
        return -1;
    }
}

/* The header run: `call tool="NAME" index="K"` for every declared NAME, K
 * the call's 1-based place in the section, then <|sep|>. */
static int header_begin(shoal_toolcons *tc)
{
    size_t n = json_array_size(tc->tools), k = 0, i;
    char **ch = shoal_xcalloc(n ? n : 1, sizeof *ch);
    const json_t *t;
    json_array_foreach(tc->tools, i, t) {
        const char *name = tool_name(t);
        if (!name || !name[0] || strchr(name, '"') || strlen(name) > 256)
            continue; /* not a name K3's header can carry */
        size_t len = strlen(name) + 48;
        ch[k] = shoal_xmalloc(len);
        snprintf(ch[k], len, "call tool=\"%s\" index=\"%d\"", name, tc->ncalls + 1);
        k++;
    }
    char err[200];
    int rc = k ? shoal_cons_compile_choice(&tc->cons, (const char *const *)ch, (int)k, err, sizeof err) : -1;
    for (size_t j = 0; j < k; j++)
        free(ch[j]);
    free(ch);
    if (!rc)
        rc = shoal_cons_run_create(&tc->run, tc->cons, tc->voc, &tc->sep_id, 1, err, sizeof err);
    if (rc) {
        run_drop(tc);
        return -1;
    }
    tc->nhdr = 0;
    return 0;
}

/* The header is complete: the arguments of the tool it names. */
static int args_begin(shoal_toolcons *tc)
{
    static const char *const pre[] = {"<|open|>", "json", " type", "=\"", "object", "\"", "<|sep|>"};
    static const char *const post[] = {"<|close|>", "json", "<|sep|>", "<|close|>", "call", "<|sep|>"};
    int32_t a[16], b[16];
    char err[300];
    int na = shoal_toolcons_ids(tc->tok, pre, 7, a, 16, err, sizeof err);
    int nb = shoal_toolcons_ids(tc->tok, post, 6, b, 16, err, sizeof err);
    run_drop(tc);
    if (na < 0 || nb < 0)
        return -1;
    tc->hdr[tc->nhdr < sizeof tc->hdr ? tc->nhdr : sizeof tc->hdr - 1] = '\0';
    const char *q = strstr(tc->hdr, "tool=\"");
    const json_t *params = NULL, *t;
    size_t i;
    if (q) {
        q += 6;
        const char *e = strchr(q, '"');
        json_array_foreach(tc->tools, i, t) {
            const char *name = tool_name(t);
            if (e && name && strlen(name) == (size_t)(e - q) && !memcmp(name, q, (size_t)(e - q))) {
                const json_t *fn = json_object_get(t, "function");
                params = json_object_get(fn ? fn : t, "parameters");
                break;
            }
        }
    }
    if (params && !json_is_object(params))
        params = NULL;
    if (shoal_cons_compile_json(&tc->cons, params, err, sizeof err)) {
        /* refused by the compiler: any JSON object (docs/API.md) */
        SHOAL_WARN("toolcons: a tool's parameters are read as any JSON object: %s", err);
        if (shoal_cons_compile_json(&tc->cons, NULL, err, sizeof err))
            return -1;
    }
    if (shoal_cons_run_create(&tc->run, tc->cons, tc->voc, b, nb, err, sizeof err) ||
        shoal_cons_run_set_prefix(tc->run, a, na)) {
        run_drop(tc);
        return -1;
    }
    return 0;
}

void shoal_toolcons_accept(shoal_toolcons *tc, int32_t id)
{
    if (tc->fi < tc->nf) {
        if (++tc->fi == tc->nf) {
            tc->fi = tc->nf = 0;
            tc->phase = tc->after;
        }
        return;
    }
    switch (tc->phase) {
    case P_REASON:
        if (id == tc->close_id) {
            static const char *const p[] = {"think", "<|sep|>", "<|open|>", "response", "<|sep|>",
                                            "<|close|>", "response", "<|sep|>"};
            force(tc, p, tc->required ? 8 : 5, tc->required ? P_AFTER_RESP : P_CONTENT);
        }
        break;
    case P_CONTENT:
        if (id == tc->close_id) {
            static const char *const p[] = {"response", "<|sep|>"};
            force(tc, p, 2, P_AFTER_RESP);
        }
        break;
    case P_AFTER_RESP:
        if (id == tc->open_id) {
            static const char *const p[] = {"tools", "<|sep|>"};
            force(tc, p, 2, P_TOOLS);
        } else {
            static const char *const p[] = {"message", "<|sep|>", "<|end_of_msg|>"};
            force(tc, p, 3, P_DONE);
        }
        break;
    case P_TOOLS:
        if (id == tc->open_id) {
            tc->phase = header_begin(tc) ? P_DONE : P_HEADER;
        } else {
            static const char *const p[] = {"tools", "<|sep|>", "<|close|>", "message", "<|sep|>", "<|end_of_msg|>"};
            force(tc, p, 6, P_DONE);
        }
        break;
    case P_HEADER: {
        if (shoal_cons_run_accept(tc->run, id))
            break;
        size_t n;
        const uint8_t *b = id != tc->sep_id ? shoal_tok_token_bytes(tc->tok, id, &n) : NULL;
        if (b && tc->nhdr + n < sizeof tc->hdr) {
            memcpy(tc->hdr + tc->nhdr, b, n);
            tc->nhdr += n;
        }
        if (shoal_cons_run_done(tc->run))
            tc->phase = args_begin(tc) ? P_DONE : P_ARGS;
        break;
    }
    case P_ARGS:
        if (shoal_cons_run_accept(tc->run, id))
            break;
        if (shoal_cons_run_done(tc->run)) {
            run_drop(tc);
            tc->ncalls++;
            tc->phase = P_TOOLS;
        }
        break;
    default:
        break;
    }
}
