/* allocguard: the engine's allocation guard, the one place shoal interposes
 * the C allocator.
 *
 * Why: the engine's forward must not allocate (STYLE habit 4) -- an allocation
 * on the decode path costs time per token and can fail under memory pressure
 * mid-token. To prove it, this file interposes the process's
 * malloc/calloc/realloc (glibc exports the real ones as __libc_*): while the
 * calling thread is inside a forward, any allocation on it is counted
 * (shoal_engine_alloc_count, and /metrics' shoal_forward_allocations_total)
 * and the first one logged; with the environment variable
 * SHOAL_ALLOC_GUARD=abort (the test suite sets it) it aborts with a message
 * instead. A served model never dies for a stray allocation: it costs time,
 * not correctness. The flag is per thread, so other threads of the process (an
 * HTTP loop, a worker) may allocate freely meanwhile; kernels running on
 * OpenMP threads are covered by their own no-allocation contract and tests.
 * Sanitizer builds supply their own allocator, so the guard is compiled out
 * there (and shoal_engine_alloc_count stays 0). The definitions are weak so
 * that a statically linked sanitizer runtime (clang's, in fuzz targets built
 * from uninstrumented libraries) wins instead of clashing.
 *
 * When it is armed: forward.c arms it (shoal__engine_guard_arm(1)) on the
 * calling thread for the length of every forward -- prefill chunk, decode,
 * batched decode -- and disarms it before returning, on success and on every
 * error path. Unarmed, the interposed functions only test a thread-local flag
 * and call glibc's. It stays linked because engine_int.h's
 * shoal__engine_guard_arm and engine.h's shoal_engine_alloc_count live here. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "coordinator/engine/engine_int.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define GUARD 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define GUARD 0
#endif
#endif
#ifndef GUARD
#if defined(__GLIBC__) || defined(__linux__)
#define GUARD 1
#else
#define GUARD 0
#endif
#endif

static atomic_ullong guard_hits;
static _Thread_local int guard_armed;
static _Thread_local int guard_strict; /* SHOAL_ALLOC_GUARD=abort when armed */
static _Thread_local int omp_warm_threads;

void shoal__engine_guard_arm(int on)
{
    /* libgomp builds a thread's pool and team on its first parallel region
     * (and again when the thread count changes): do that before arming, on
     * the thread that runs the forward */
    if (on && omp_warm_threads != omp_get_max_threads()) {
        omp_warm_threads = omp_get_max_threads();
        volatile int sink = 0;
#pragma omp parallel
        {
#pragma omp atomic
            sink++;
        }
        (void)sink;
    }
    if (on) {
        const char *g = getenv("SHOAL_ALLOC_GUARD"); /* getenv does not allocate */
        guard_strict = g && !strcmp(g, "abort");
    }
    guard_armed = on;
}

uint64_t shoal_engine_alloc_count(void)
{
    return atomic_load(&guard_hits);
}

#if GUARD
#include <errno.h>
#include <unistd.h>
extern void *__libc_malloc(size_t n);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t n);

static void guard_hit(const char *what)
{
    uint64_t n = atomic_fetch_add(&guard_hits, 1);
    /* no stdio here: it may allocate */
    static const char pre[] = "shoal: ";
    static const char post[] = " inside the engine's forward (the decode path must not allocate)\n";
    if (!guard_strict && n > 0)
        return; /* warned once; /metrics counts them all */
    ssize_t r = write(2, pre, sizeof pre - 1);
    r = write(2, guard_strict ? "fatal: " : "warning: ", guard_strict ? 7 : 9);
    r = write(2, what, strlen(what));
    r = write(2, post, sizeof post - 1);
    (void)r;
    if (guard_strict)
        abort();
}

__attribute__((weak)) void *malloc(size_t n)
{
    if (guard_armed)
        guard_hit("malloc");
    return __libc_malloc(n);
}

__attribute__((weak)) void *calloc(size_t n, size_t size)
{
    if (guard_armed)
        guard_hit("calloc");
    return __libc_calloc(n, size);
}

__attribute__((weak)) void *realloc(void *p, size_t n)
{
    if (guard_armed)
        guard_hit("realloc");
    return __libc_realloc(p, n);
}

/* Aligned allocations too: libzmq allocates its queue chunks this way. */
extern void *__libc_memalign(size_t align, size_t n);

__attribute__((weak)) int posix_memalign(void **p, size_t align, size_t n)
{
    if (guard_armed)
        guard_hit("posix_memalign");
    if (align < sizeof(void *) || (align & (align - 1)))
        return EINVAL;
    void *r = __libc_memalign(align, n);
    if (!r)
        return ENOMEM;
    *p = r;
    return 0;
}

__attribute__((weak)) void *aligned_alloc(size_t align, size_t n)
{
    if (guard_armed)
        guard_hit("aligned_alloc");
    return __libc_memalign(align, n);
}
#endif
