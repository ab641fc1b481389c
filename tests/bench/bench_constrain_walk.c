/* The offline half of the structured-output property test (issue 36; driven
 * by tests/e2e/test_constrain_walk.py, which generates the schemas and is the
 * oracle with Python's jsonschema):
 *   bench_constrain_walk TOKENIZER_DIR WALKS MAX_STEPS SEED < schemas.jsonl
 * For each input line (a JSON schema) it compiles the schema and runs WALKS
 * random token walks over the vocabulary's mask: at every step the next id is
 * drawn from the allowed ones (half the time uniformly, half the time the
 * allowed single-byte token with the lowest id, so walks leave strings and
 * visit the structural states as a model does; the end id, once offered,
 * with probability 1/3). One output line per input line:
 *   {"compile": "ok" | "<error>", "walks": [{"hex": "<bytes>", "end": 0|1,
 *    "dead": 0|1}, ...]}
 * end: the walk took the end id (the text is complete and must validate);
 * otherwise it stopped at MAX_STEPS and the text must be a prefix of valid
 * JSON; dead: a mask came out empty (a liveness failure).
 * With a fifth argument MASKS (a file), the anchor bench
 * (tests/bench/constrain_anchor.py) also gets, per walk, "ids" (the walk's
 * ids) and "cpu_us" (this thread's CPU time of each mask), and every step's
 * mask is appended to MASKS as packed bits (V/8 bytes, bit i of byte i/8 =
 * id i allowed, LSB first). A sixth argument "nows" keeps the walk off
 * whitespace-only tokens where another id is allowed (llguidance refuses
 * whitespace around the document, so walks stay comparable longer). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/text/constrain.h"
#include "coordinator/text/tokenizer.h"

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 16);
}

static double cpu_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s TOKENIZER_DIR WALKS MAX_STEPS SEED < schemas.jsonl\n", argv[0]);
        return 2;
    }
    int walks = atoi(argv[2]), steps = atoi(argv[3]);
    rs ^= strtoull(argv[4], NULL, 10) * 0x2545F4914F6CDD1Dull;
    char err[300];
    shoal_tok *t;
    shoal_cons_vocab *v;
    if (shoal_tok_open(&t, argv[1], NULL, err, sizeof err) || shoal_cons_vocab_build(&v, t, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int V = shoal_cons_vocab_size(v);
    uint8_t *mask = malloc((size_t)V);
    int32_t *allowed = malloc(sizeof(int32_t) * (size_t)V);
    uint8_t *single = calloc((size_t)V, 1), *wsonly = calloc((size_t)V, 1);
    int nows = argc > 6 && !strcmp(argv[6], "nows");
    for (int32_t i = 0; i < V; i++) {
        size_t bl = 0;
        const uint8_t *b = shoal_tok_token_bytes(t, i, &bl);
        single[i] = b && bl == 1;
        int ws = b && bl > 0;
        for (size_t j = 0; b && j < bl; j++)
            ws &= b[j] == ' ' || b[j] == '\t' || b[j] == '\n' || b[j] == '\r';
        wsonly[i] = (uint8_t)(nows && ws);
        single[i] &= !wsonly[i];
    }
    int32_t eos = shoal_tok_eos_id(t);
    FILE *mf = argc > 5 ? fopen(argv[5], "wb") : NULL;
    if (argc > 5 && !mf) {
        perror(argv[5]);
        return 1;
    }
    uint8_t *bits = malloc((size_t)V / 8 + 1);
    char *extra = malloc((size_t)steps * 32 + 64);
    size_t cap = 1 << 20;
    char *line = malloc(cap), *hex = malloc((size_t)steps * 2 * 1100 + 1);
    while (fgets(line, (int)cap, stdin)) {
        json_error_t je;
        json_t *sc = json_loads(line, 0, &je);
        shoal_cons *c = NULL;
        if (!sc || shoal_cons_compile_json(&c, json_is_null(sc) ? NULL : sc, err, sizeof err)) {
            json_t *o = json_pack("{s:s,s:[]}", "compile", sc ? err : je.text, "walks");
            char *s = json_dumps(o, JSON_COMPACT);
            printf("%s\n", s);
            free(s);
            json_decref(o);
            json_decref(sc);
            continue;
        }
        printf("{\"compile\":\"ok\",\"walks\":[");
        for (int w = 0; w < walks; w++) {
            shoal_cons_run *r;
            if (shoal_cons_run_create(&r, c, v, &eos, 1, err, sizeof err)) {
                fprintf(stderr, "%s\n", err);
                return 1;
            }
            size_t nh = 0, ne = 0, nu = 0;
            int end = 0, dead = 0;
            char *us = extra + (size_t)steps * 16 + 32;
            for (int s = 0; s < steps && !end; s++) {
                double c0 = cpu_us();
                int na = shoal_cons_run_mask(r, mask);
                double c1 = cpu_us();
                if (mf) {
                    memset(bits, 0, (size_t)V / 8 + 1);
                    for (int32_t i = 0; i < V; i++)
                        if (mask[i])
                            bits[i >> 3] |= (uint8_t)(1u << (i & 7));
                    fwrite(bits, 1, (size_t)(V + 7) / 8, mf);
                    nu += (size_t)snprintf(us + nu, 16, "%s%.1f", s ? "," : "", c1 - c0);
                }
                if (na <= 0) {
                    dead = 1;
                    break;
                }
                int k = 0, one = -1;
                for (int32_t i = 0; i < V; i++)
                    if (mask[i]) {
                        allowed[k++] = i;
                        if (one < 0 && single[i])
                            one = i;
                    }
                int32_t id = (rnd() & 1) && one >= 0 ? one : allowed[rnd() % (uint32_t)k];
                for (int tries = 0; tries < 16 && wsonly[id]; tries++)
                    id = allowed[rnd() % (uint32_t)k];
                if (mask[eos] && rnd() % 3 == 0)
                    id = eos;
                if (mf)
                    ne += (size_t)snprintf(extra + ne, 16, "%s%d", s ? "," : "", id);
                if (shoal_cons_run_accept(r, id)) {
                    dead = 1;
                    break;
                }
                if (id == eos) {
                    end = 1;
                    break;
                }
                size_t bl = 0;
                const uint8_t *b = shoal_tok_token_bytes(t, id, &bl);
                for (size_t j = 0; j < bl; j++)
                    nh += (size_t)sprintf(hex + nh, "%02x", b[j]);
            }
            hex[nh] = '\0';
            printf("%s{\"hex\":\"%s\",\"end\":%d,\"dead\":%d", w ? "," : "", hex, end, dead);
            if (mf) {
                extra[ne] = '\0';
                us[nu] = '\0';
                printf(",\"ids\":[%s],\"cpu_us\":[%s]", extra, us);
            }
            printf("}");
            shoal_cons_run_free(r);
        }
        printf("]}\n");
        shoal_cons_free(c);
        json_decref(sc);
    }
    if (mf)
        fclose(mf);
    free(bits);
    free(extra);
    free(line);
    free(hex);
    free(mask);
    free(allowed);
    free(single);
    free(wsonly);
    shoal_cons_vocab_free(v);
    shoal_tok_close(t);
    return 0;
}
