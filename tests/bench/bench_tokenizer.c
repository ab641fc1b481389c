/* Encode throughput of the tokenizer (issues 6, 24): REPS timed runs of
 * shoal_tok_encode over a whole file, single thread, one line per run:
 *   bench_tokenizer MODEL_DIR FILE REPS [ALLOW_SPECIAL]
 *   bench_tokenizer --chat MODEL_DIR BODY.json REPS
 * Output rows: "run=<i> bytes=<n> ids=<n> seconds=<wall> cpu_seconds=<user+sys> mb_per_s=<bytes/wall/1e6>";
 * first a "load seconds=<wall> cpu_seconds=<cpu> rss_kb=<growth of VmRSS>" row for
 * shoal_tok_open (the vocabulary load, once per process; not in the encode rows).
 * --chat: BODY.json is a /v1/chat/completions body; each run is shoal_chat_encode of
 * its messages (render + encode, the JSON parse not timed), "ids=" the prompt length.
 * Driven by tests/bench/tok_bench.py, which times tiktoken on the same input. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coordinator/text/chat.h"
#include "coordinator/text/tokenizer.h"

static double clk(clockid_t id)
{
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* the current resident set (VmRSS), kB: ru_maxrss would carry the parent's
 * peak across fork + exec */
static long maxrss_kb(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atol(line + 6);
    if (f)
        fclose(f);
    return kb;
}

int main(int argc, char **argv)
{
    int chat = argc > 1 && !strcmp(argv[1], "--chat");
    if (argc < 4 + chat) {
        fprintf(stderr, "usage: %s [--chat] MODEL_DIR FILE REPS [ALLOW_SPECIAL]\n", argv[0]);
        return 2;
    }
    argv += chat;
    argc -= chat;
    int reps = atoi(argv[3]), allow = argc > 4 ? atoi(argv[4]) : 0;
    char err[512];
    shoal_tok *t;
    long rss0 = maxrss_kb();
    double l0 = clk(CLOCK_MONOTONIC), lc0 = clk(CLOCK_PROCESS_CPUTIME_ID);
    if (shoal_tok_open(&t, argv[1], NULL, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    double l1 = clk(CLOCK_MONOTONIC), lc1 = clk(CLOCK_PROCESS_CPUTIME_ID);
    printf("load seconds=%.4f cpu_seconds=%.4f rss_kb=%ld ranks=%d\n", l1 - l0, lc1 - lc0, maxrss_kb() - rss0,
           (int)shoal_tok_n_ranks(t));
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
    json_t *body = NULL;
    shoal_chat_opts co = {0};
    if (chat) {
        json_error_t je;
        body = json_loadb(text, (size_t)n, 0, &je);
        if (!body || shoal_chat_opts_from_request(body, &co, err, sizeof err)) {
            fprintf(stderr, "%s: %s\n", argv[2], body ? err : je.text);
            return 1;
        }
    }
    for (int i = 0; i < reps; i++) {
        shoal_tok_ids ids = {0};
        double t0 = clk(CLOCK_MONOTONIC), c0 = clk(CLOCK_PROCESS_CPUTIME_ID);
        int rc = chat ? shoal_chat_encode(t, json_object_get(body, "messages"), &co, &ids, err, sizeof err)
                      : shoal_tok_encode(t, text, (size_t)n, allow, &ids, err, sizeof err);
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
    json_decref(body);
    free(text);
    shoal_tok_close(t);
    return 0;
}
