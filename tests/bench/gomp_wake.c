/* OpenMP parallel regions and their wake-up, measured from outside: an
 * LD_PRELOAD shim over libgomp's GOMP_parallel (docs/PERFORMANCE.md, "Engine
 * decode and waiting, re-measured"). Not built by CMake; a measuring aid:
 *
 *   gcc -O2 -shared -fPIC -fopenmp -o /tmp/gomp_wake.so tests/bench/gomp_wake.c -ldl
 *   LD_PRELOAD=/tmp/gomp_wake.so build/tests/bench_engine MODEL --threads 2 --steps N ...
 *
 * At exit it prints to stderr: top-level regions with more than one thread,
 * regions run on one thread (an `if` clause false), nested regions; for the
 * multi-threaded ones, wake = when thread 1 starts the region's body minus
 * when the master entered GOMP_parallel, and join = when the master leaves
 * GOMP_parallel minus when its own share ended (it waited for the others),
 * as sums, means and a histogram; and, where thread 1 ended its share after the
 * master, rejoin = when the master leaves GOMP_parallel minus when thread 1
 * ended its share (the master's own wake-up at the closing barrier). Per decode token: run --steps 0 and
 * --steps N and divide the difference by N (bench_engine also runs one sweep
 * region per step). Only GOMP_parallel (what GCC emits for `parallel` and
 * `parallel for` with a static schedule) is seen. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct {
    void (*fn)(void *);
    void *data;
    double t_entry, t_w1, t_master_end, t_w1_end;
} wrapped;

static void trampoline(void *p)
{
    wrapped *w = p;
    int id = omp_get_thread_num();
    if (id == 1)
        w->t_w1 = now();
    w->fn(w->data);
    if (id == 0)
        w->t_master_end = now();
    if (id == 1)
        w->t_w1_end = now();
}

static atomic_long n_serial, n_nested;
static long n_multi, hist[8];
static long n_rejoin;
static double wake_sum, wake_max, join_sum, rejoin_sum;

void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)
{
    static gomp_parallel_fn real;
    if (!real)
        real = (gomp_parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
    if (omp_get_level() > 0) {
        atomic_fetch_add(&n_nested, 1);
        real(fn, data, num_threads, flags);
        return;
    }
    if (num_threads == 1) {
        atomic_fetch_add(&n_serial, 1);
        real(fn, data, num_threads, flags);
        return;
    }
    wrapped w = {fn, data, now(), 0, 0, 0};
    real(trampoline, &w, num_threads, flags);
    double t_exit = now();
    if (w.t_w1 > 0) { /* a team of at least two (top level: one thread here at a time) */
        double wk = w.t_w1 - w.t_entry;
        n_multi++;
        wake_sum += wk;
        wake_max = wk > wake_max ? wk : wake_max;
        int b = 0;
        for (double lim = 1e-6; b < 7 && wk > lim; lim *= 4)
            b++;
        hist[b]++;
        join_sum += t_exit - w.t_master_end;
        if (w.t_w1_end > w.t_master_end) {
            n_rejoin++;
            rejoin_sum += t_exit - w.t_w1_end;
        }
    }
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr,
            "gomp_wake regions=%ld serial=%ld nested=%ld wake_sum_s=%.4f wake_mean_us=%.1f wake_max_us=%.1f "
            "join_sum_s=%.4f join_mean_us=%.1f rejoins=%ld rejoin_sum_s=%.4f rejoin_mean_us=%.1f "
            "wake_hist_us(<=1,4,16,64,256,1024,4096,more)=",
            n_multi, (long)n_serial, (long)n_nested, wake_sum, n_multi ? wake_sum / n_multi * 1e6 : 0.0,
            wake_max * 1e6, join_sum, n_multi ? join_sum / n_multi * 1e6 : 0.0, n_rejoin, rejoin_sum,
            n_rejoin ? rejoin_sum / n_rejoin * 1e6 : 0.0);
    for (int i = 0; i < 8; i++)
        fprintf(stderr, "%ld%c", hist[i], i < 7 ? ',' : '\n');
}
