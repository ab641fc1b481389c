/* Encode throughput of the tokenizer (issue 6): REPS timed runs of
 * shoal_tok_encode over a whole file, single thread, one line per run:
 *   bench_tokenizer MODEL_DIR FILE REPS [ALLOW_SPECIAL]
 * Output rows: "run=<i> bytes=<n> ids=<n> seconds=<wall> cpu_seconds=<user+sys> mb_per_s=<bytes/wall/1e6>".
 * Loading the vocabulary is not timed (it is once per process). Driven by
 * tests/bench/tok_bench.py, which times tiktoken on the same file. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "coordinator/text/tokenizer.h"

static double clk(clockid_t id)
{
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL_DIR FILE REPS [ALLOW_SPECIAL]\n", argv[0]);
        return 2;
    }
    int reps = atoi(argv[3]), allow = argc > 4 ? atoi(argv[4]) : 0;
    char err[512];
    shoal_tok *t;
    if (shoal_tok_open(&t, argv[1], NULL, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    if (!text || fread(text, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "%s: read failed\n", argv[2]);
        return 1;
    }
    fclose(f);
    for (int i = 0; i < reps; i++) {
        shoal_tok_ids ids = {0};
        double t0 = clk(CLOCK_MONOTONIC), c0 = clk(CLOCK_PROCESS_CPUTIME_ID);
        int rc = shoal_tok_encode(t, text, (size_t)n, allow, &ids, err, sizeof err);
        double t1 = clk(CLOCK_MONOTONIC), c1 = clk(CLOCK_PROCESS_CPUTIME_ID);
        if (rc) {
            fprintf(stderr, "encode: %s\n", err);
            return 1;
        }
        printf("run=%d bytes=%ld ids=%zu seconds=%.4f cpu_seconds=%.4f mb_per_s=%.2f\n", i, n, ids.n, t1 - t0,
               c1 - c0, (double)n / (t1 - t0) / 1e6);
        fflush(stdout);
        shoal_tok_ids_free(&ids);
    }
    free(text);
    shoal_tok_close(t);
    return 0;
}
