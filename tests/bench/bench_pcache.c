/* Prefix cache: the cost of one full-K3 capture on disk (issue 32,
 * docs/PERFORMANCE.md "Prefix cache"). Writes a state file of the size a
 * full K3 capture has after N tokens (KDA states 69 x 96 x 128 x 128 fp32 +
 * conv windows 69 x 3 x 3 x 12288 fp32 + N x 24 MLA layers x 576 fp32) with
 * shoal_pcache_file_write, then reads it back with shoal_pcache_file_read
 * (which verifies the header, size, ids hash and payload checksum), R times,
 * and times the checksum alone over the buffer. The reads come from the page
 * cache when the file is still there (printed: this does not drop caches);
 * the figure is the CPU side of a read (copy + verify), the device's read
 * rate adds to it. Usage: bench_pcache DIR [TOKENS=4096] [REPS=3]. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/pcache/pcache.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [TOKENS] [REPS]\n", argv[0]);
        return 2;
    }
    int n = argc > 2 ? atoi(argv[2]) : 4096, reps = argc > 3 ? atoi(argv[3]) : 3;
    size_t fixed = (size_t)69 * 96 * 128 * 128 * 4 + (size_t)69 * 3 * 3 * 12288 * 4;
    size_t per = (size_t)24 * 576 * 4;
    size_t sb = fixed + (size_t)n * per;
    uint8_t fp[SHOAL_PCACHE_FP_BYTES] = {1};
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        ids[i] = i * 7 % 163840;
    float *st = malloc(sb);
    for (size_t i = 0; i < sb / 4; i++)
        st[i] = (float)(i % 1000) * 0.001f;
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/bench.shst", argv[1]);
    printf("capture of %d tokens: %zu bytes (fixed %zu + %zu per token)\n", n, sb, fixed, per);
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        if (shoal_pcache_file_write(path, fp, ids, n, st, sb, NULL, 0, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        double t1 = now();
        shoal_pcache_file *f = NULL;
        if (shoal_pcache_file_read(&f, path, fp, fixed, per, err, sizeof err)) {
            fprintf(stderr, "%s\n", err);
            return 1;
        }
        double t2 = now();
        uint64_t s = shoal_pcache_sum(0, f->state, sb);
        double t3 = now();
        shoal_pcache_file_free(f);
        printf("rep %d: write %.3f s (%.2f GB/s), read+verify %.3f s (%.2f GB/s), checksum alone %.3f s "
               "(%.2f GB/s) [%016llx]\n",
               r, t1 - t0, sb / (t1 - t0) * 1e-9, t2 - t1, sb / (t2 - t1) * 1e-9, t3 - t2, sb / (t3 - t2) * 1e-9,
               (unsigned long long)s);
    }
    unlink(path);
    free(ids);
    free(st);
    return 0;
}
