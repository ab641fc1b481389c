/* Structured-output costs (issue 36), single thread:
 *   bench_constrain TOKENIZER_DIR WALKS STEPS SEED
 * One "vocab" row (building the byte trie), then per constraint (json_object,
 * a 20-field schema, a recursive schema, a regex, llama.cpp's arithmetic GBNF): a "compile" row (REPS=200
 * compiles: p50 / max microseconds) and a "mask" row: WALKS random walks of up
 * to STEPS tokens each; at every step the mask is computed (timed) and the next
 * token drawn from the allowed ones: half the time uniformly, half the time
 * the allowed single-byte token with the lowest id when there is one (so the
 * walk leaves strings and exercises the structural states, as a model does).
 * Row: "mask kind=<k> steps=<n> cpu_p50_us= cpu_p90_us= cpu_p99_us= cpu_max_us=
 * wall_p50_us= wall_p99_us= wall_max_us= mean_allowed=" (cpu: the thread's CPU
 * time, which the other processes of a shared machine do not inflate).
 * Driven by hand (docs/PERFORMANCE.md "Structured outputs"); raw output in
 * docs/data/constrain_mask.txt. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/text/constrain.h"
#include "coordinator/text/tokenizer.h"

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

/* this thread's CPU time: on a shared machine the wall time of a step also
 * holds the time slices other processes took (4-8 ms quanta) */
static double cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double p)
{
    int i = (int)(p * (n - 1) + 0.5);
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 16);
}

static int compile(const char *kind, const char *src, shoal_cons **c, char *err, size_t el)
{
    if (!strcmp(kind, "regex"))
        return shoal_cons_compile_regex(c, src, strlen(src), err, el);
    if (!strcmp(kind, "gbnf"))
        return shoal_cons_compile_gbnf(c, src, strlen(src), err, el);
    json_t *s = src ? json_loads(src, 0, NULL) : NULL;
    int rc = shoal_cons_compile_json(c, s, err, el);
    json_decref(s);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s TOKENIZER_DIR WALKS STEPS SEED\n", argv[0]);
        return 2;
    }
    int walks = atoi(argv[2]), steps = atoi(argv[3]);
    rs ^= strtoull(argv[4], NULL, 10) * 0x2545F4914F6CDD1Dull;
    char err[300];
    shoal_tok *t;
    if (shoal_tok_open(&t, argv[1], NULL, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    double t0 = now_us();
    shoal_cons_vocab *v;
    if (shoal_cons_vocab_build(&v, t, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    printf("vocab n_vocab=%d build_ms=%.1f\n", shoal_cons_vocab_size(v), (now_us() - t0) / 1e3);
    /* a 20-field schema: strings, numbers, enums, a nested object, arrays */
    char f20[8192] = "{\"type\":\"object\",\"additionalProperties\":false,\"properties\":{";
    char req[2048] = "";
    const char *kinds[] = {"{\"type\":\"string\"}", "{\"type\":\"integer\"}", "{\"type\":\"number\"}",
                           "{\"type\":\"boolean\"}", "{\"enum\":[\"low\",\"mid\",\"high\"]}",
                           "{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":20},\"maxItems\":4}",
                           "{\"type\":\"string\",\"format\":\"date\"}",
                           "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},\"b\":{\"type\":[\"integer\",\"null\"]}},"
                           "\"required\":[\"a\",\"b\"],\"additionalProperties\":false}"};
    for (int i = 0; i < 20; i++) {
        char one[512];
        snprintf(one, sizeof one, "%s\"field_%02d\":%s", i ? "," : "", i, kinds[i % 8]);
        strcat(f20, one);
        snprintf(one, sizeof one, "%s\"field_%02d\"", i ? "," : "", i);
        strcat(req, one);
    }
    strcat(f20, "},\"required\":[");
    strcat(f20, req);
    strcat(f20, "]}");
    const char *rec = "{\"$ref\":\"#/$defs/n\",\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{"
                      "\"name\":{\"type\":\"string\"},\"value\":{\"anyOf\":[{\"type\":\"number\"},{\"type\":\"string\"},"
                      "{\"type\":\"null\"}]},\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/n\"}}},"
                      "\"required\":[\"name\",\"children\"],\"additionalProperties\":false}}}";
    struct {
        const char *name, *kind, *src;
    } cases[] = {
        {"json_object", "json", NULL},
        {"schema_20_fields", "json", f20},
        {"schema_recursive", "json", rec},
        {"regex", "regex", "[A-Z][a-z]{2,12}( [A-Z][a-z]{2,12}){0,3}, [0-9]{1,5} (Street|Road|Avenue)"},
        /* llama.cpp's grammars/arithmetic.gbnf */
        {"gbnf_arithmetic", "gbnf",
         "root  ::= (expr \"=\" ws term \"\\n\")+\nexpr  ::= term ([-+*/] term)*\n"
         "term  ::= ident | num | \"(\" ws expr \")\" ws\nident ::= [a-z] [a-z0-9_]* ws\n"
         "num   ::= [0-9]+ ws\nws    ::= [ \\t\\n]*\n"},
    };
    int V = shoal_cons_vocab_size(v);
    uint8_t *mask = malloc((size_t)V);
    int32_t *allowed = malloc(sizeof(int32_t) * (size_t)V);
    double *times = malloc(sizeof(double) * (size_t)(walks * steps + 1));
    double *ctimes = malloc(sizeof(double) * (size_t)(walks * steps + 1));
    int32_t eos = shoal_tok_eos_id(t);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        double ct[200];
        shoal_cons *c = NULL;
        for (int r = 0; r < 200; r++) {
            shoal_cons_free(c);
            double a = now_us();
            if (compile(cases[ci].kind, cases[ci].src, &c, err, sizeof err)) {
                fprintf(stderr, "%s: %s\n", cases[ci].name, err);
                return 1;
            }
            ct[r] = now_us() - a;
        }
        qsort(ct, 200, sizeof *ct, cmpd);
        printf("compile kind=%s reps=200 p50_us=%.1f max_us=%.1f\n", cases[ci].name, pct(ct, 200, 0.5), ct[199]);
        int n = 0;
        double allowed_sum = 0;
        for (int w = 0; w < walks; w++) {
            shoal_cons_run *r;
            shoal_cons_run_create(&r, c, v, &eos, 1, err, sizeof err);
            for (int s = 0; s < steps; s++) {
                double a = now_us(), ac = cpu_us();
                int na = shoal_cons_run_mask(r, mask);
                ctimes[n] = cpu_us() - ac;
                times[n++] = now_us() - a;
                allowed_sum += na;
                if (na <= 0)
                    break;
                int k = 0, single = -1;
                for (int32_t i = 0; i < V; i++)
                    if (mask[i]) {
                        allowed[k++] = i;
                        size_t bl;
                        shoal_tok_token_bytes(t, i, &bl);
                        if (bl == 1 && single < 0)
                            single = i;
                    }
                int32_t id = (rnd() & 1) && single >= 0 ? single : allowed[rnd() % (uint32_t)k];
                if (mask[eos] && (rnd() % 4 == 0))
                    id = eos;
                shoal_cons_run_accept(r, id);
                if (id == eos)
                    break;
            }
            shoal_cons_run_free(r);
        }
        qsort(times, (size_t)n, sizeof *times, cmpd);
        qsort(ctimes, (size_t)n, sizeof *ctimes, cmpd);
        printf("mask kind=%s steps=%d cpu_p50_us=%.1f cpu_p90_us=%.1f cpu_p99_us=%.1f cpu_max_us=%.1f "
               "wall_p50_us=%.1f wall_p99_us=%.1f wall_max_us=%.1f mean_allowed=%.0f\n",
               cases[ci].name, n, pct(ctimes, n, 0.5), pct(ctimes, n, 0.9), pct(ctimes, n, 0.99), ctimes[n - 1],
               pct(times, n, 0.5), pct(times, n, 0.99), times[n - 1], allowed_sum / n);
        shoal_cons_free(c);
    }
    free(mask);
    free(allowed);
    free(times);
    free(ctimes);
    shoal_cons_vocab_free(v);
    shoal_tok_close(t);
    return 0;
}
