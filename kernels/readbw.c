/* The read-bandwidth pass (declared in kernels.h). */
#include "kernels/kernels.h"

#include <omp.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double shoal_read_bw_pass(const uint64_t *buf, size_t nwords, int threads, uint64_t *sink)
{
    uint64_t total = 0;
    size_t words = 0;
    int nth = threads > 0 ? threads : omp_get_max_threads();
    double t0 = now_s();
#pragma omp parallel num_threads(nth) reduction(+ : total, words)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        size_t per = nwords / (size_t)nt, a = per * (size_t)id;
        size_t q = per / 4 / 8 * 8; /* words per stream, multiple of 8 */
        const uint64_t *p0 = buf + a, *p1 = p0 + q, *p2 = p1 + q, *p3 = p2 + q;
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i < q; i += 8) {
            __builtin_prefetch(p0 + i + 128);
            __builtin_prefetch(p1 + i + 128);
            __builtin_prefetch(p2 + i + 128);
            __builtin_prefetch(p3 + i + 128);
            for (int j = 0; j < 8; j++) {
                s0 += p0[i + j];
                s1 += p1[i + j];
                s2 += p2[i + j];
                s3 += p3[i + j];
            }
        }
        total += s0 + s1 + s2 + s3;
        words += 4 * q;
    }
    double dt = now_s() - t0;
    *sink += total;
    return dt > 0 ? (double)words * 8 / dt / 1e9 : 0;
}
