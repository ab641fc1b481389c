/* bench_draft_replay: the prompt-lookup drafter (coordinator/engine/draft.h)
 * replayed alone over real token sequences (docs/PERFORMANCE.md, issue 21).
 * For each case {name, kind, prompt: [ids], output: [ids]} of the input JSON,
 * the output is taken to be what the model decodes, and the replay does
 * exactly what shoal_spec_decode does while a caller feeds output[0..n-2]
 * back one by one: when no drafted token is pending it asks the drafter for
 * up to min(K, tokens left) drafts continuing prompt + output so far, counts
 * one pass of T = drafts + 1 tokens, and every following output token equal
 * to the next pending draft costs no pass; a token that differs ends the
 * chunk (the drafter is told how many were accepted). With the measured cost
 * of a verify pass of T tokens relative to T = 1 (COSTS: cost[0] = 1 for
 * T = 1, cost[k] for T = k + 1; from bench_spec), the estimated decode time
 * is sum over passes of cost[T - 1], against n - 1 plain passes.
 *
 * Usage: bench_draft_replay CASES.json COSTS(comma-separated) [--max K]
 *        [--ngram-min N] [--cost A] [--cost0 B] [--fixed]  (the drafter's cost model, draft.h)
 * Prints one JSON object per case and one per kind (totals). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/engine/engine.h"

typedef struct {
    double tokens, passes, drafted, accepted, cost, shadowed;
} tot;

static void add(tot *a, const tot *b)
{
    a->tokens += b->tokens;
    a->passes += b->passes;
    a->drafted += b->drafted;
    a->accepted += b->accepted;
    a->cost += b->cost;
    a->shadowed += b->shadowed;
}

static void print(const char *what, const char *name, const char *kind, const tot *t)
{
    printf("{\"%s\":\"%s\",\"kind\":\"%s\",\"fed_tokens\":%.0f,\"passes\":%.0f,\"drafted\":%.0f,\"accepted\":%.0f,"
           "\"acceptance\":%.4f,\"passes_per_token\":%.4f,\"cost_per_token\":%.4f,\"speedup\":%.3f,"
           "\"shadowed\":%.0f}\n",
           what, name, kind, t->tokens, t->passes, t->drafted, t->accepted, t->drafted ? t->accepted / t->drafted : 0,
           t->passes / t->tokens, t->cost / t->tokens, t->tokens / t->cost, t->shadowed);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_draft_replay CASES.json COSTS [--max K] [--ngram-min N] [--fixed]\n");
        return 2;
    }
    double cost[SHOAL_DRAFT_MAX_K + 1];
    int ncost = 0;
    for (char *p = argv[2]; *p && ncost <= SHOAL_DRAFT_MAX_K;) {
        cost[ncost++] = strtod(p, &p);
        if (*p == ',')
            p++;
    }
    shoal_draft_opts o = {.mode = SHOAL_DRAFT_NGRAM, .max = 8};
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--max") && i + 1 < argc)
            o.max = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ngram-min") && i + 1 < argc)
            o.ngram_min = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cost") && i + 1 < argc)
            o.cost = atof(argv[++i]);
        else if (!strcmp(argv[i], "--cost0") && i + 1 < argc)
            o.cost0 = atof(argv[++i]);
        else if (!strcmp(argv[i], "--fixed"))
            o.fixed = 1;
    }
    if (o.max + 1 > ncost) {
        fprintf(stderr, "bench_draft_replay: %d costs given, --max %d needs %d\n", ncost, o.max, o.max + 1);
        return 2;
    }
    json_error_t je;
    json_t *cases = json_load_file(argv[1], 0, &je);
    if (!json_is_array(cases)) {
        fprintf(stderr, "bench_draft_replay: %s: %s\n", argv[1], je.text);
        return 2;
    }
    char err[256];
    shoal_drafter *d;
    if (shoal_drafter_create(&d, &o, err, sizeof err)) {
        fprintf(stderr, "bench_draft_replay: %s\n", err);
        return 2;
    }
    const char *kinds[8];
    tot ktot[8];
    int nk = 0;
    size_t ci;
    json_t *c;
    json_array_foreach(cases, ci, c)
    {
        json_t *pj = json_object_get(c, "prompt"), *oj = json_object_get(c, "output");
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *kind = json_string_value(json_object_get(c, "kind"));
        int np = (int)json_array_size(pj), no = (int)json_array_size(oj);
        if (no < 2 || !name || !kind)
            continue;
        int32_t *h = malloc(sizeof(int32_t) * (size_t)(np + no));
        for (int i = 0; i < np; i++)
            h[i] = (int32_t)json_integer_value(json_array_get(pj, (size_t)i));
        for (int i = 0; i < no; i++)
            h[np + i] = (int32_t)json_integer_value(json_array_get(oj, (size_t)i));
        const int32_t *out = h + np;
        shoal_drafter_reset(d);
        tot t = {0};
        int32_t draft[SHOAL_DRAFT_MAX_K];
        int nd = 0, used = 0; /* pending drafts draft[used..nd) */
        int32_t shadow = -1;
        for (int j = 0; j + 1 < no; j++) { /* feed out[j] */
            t.tokens++;
            if (shadow >= 0) {
                shoal_drafter_update(d, 1, shadow == out[j]);
                shadow = -1;
            }
            if (used < nd) {
                if (draft[used] == out[j]) {
                    used++;
                    t.accepted++;
                    if (used == nd)
                        shoal_drafter_update(d, nd, nd);
                    continue;
                }
                shoal_drafter_update(d, nd, used);
            }
            int limit = no - j - 2, K = shoal_drafter_k(d);
            nd = shoal_drafter_propose(d, h, np + j + 1, limit < K ? limit : K, draft);
            used = 0;
            if (nd == 0 && K == 0 && limit > 0 && shoal_drafter_propose(d, h, np + j + 1, 1, draft) == 1) {
                shadow = draft[0];
                t.shadowed++;
            }
            t.passes++;
            t.drafted += nd;
            t.cost += cost[nd];
        }
        print("case", name, kind, &t);
        int k = 0;
        while (k < nk && strcmp(kinds[k], kind))
            k++;
        if (k == nk && nk < 8) {
            kinds[nk] = kind;
            memset(&ktot[nk], 0, sizeof ktot[nk]);
            nk++;
        }
        if (k < nk)
            add(&ktot[k], &t);
        free(h);
    }
    for (int k = 0; k < nk; k++)
        print("total", kinds[k], kinds[k], &ktot[k]);
    shoal_drafter_free(d);
    json_decref(cases);
    return 0;
}
