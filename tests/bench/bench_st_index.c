/* Times shoal_st_open on a model (a directory, index or file): REPS runs each
 * with map=0 (headers only) and map=1 (read-only mappings), one line per run:
 *   bench_st_index MODEL [REPS]
 * Output rows: "map=<0|1> run=<i> tensors=<n> files=<n> seconds=<wall> cpu_seconds=<user+sys>".
 * The page cache is warm after the first run; run 0 is reported like the rest. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "common/st.h"

static double clk(clockid_t id)
{
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL [REPS]\n", argv[0]);
        return 2;
    }
    int reps = argc > 2 ? atoi(argv[2]) : 5;
    for (int map = 0; map <= 1; map++)
        for (int i = 0; i < reps; i++) {
            shoal_st_opts o = {.map = map};
            shoal_st *st = NULL;
            char err[1024];
            double t0 = clk(CLOCK_MONOTONIC), c0 = clk(CLOCK_PROCESS_CPUTIME_ID);
            int rc = shoal_st_open(&st, argv[1], &o, err, sizeof err);
            double t1 = clk(CLOCK_MONOTONIC), c1 = clk(CLOCK_PROCESS_CPUTIME_ID);
            if (rc) {
                fprintf(stderr, "open failed: %s\n", err);
                return 1;
            }
            printf("map=%d run=%d tensors=%zu files=%d seconds=%.4f cpu_seconds=%.4f\n", map, i,
                   shoal_st_count(st), shoal_st_nfiles(st), t1 - t0, c1 - c0);
            fflush(stdout);
            shoal_st_close(st);
        }
    return 0;
}
