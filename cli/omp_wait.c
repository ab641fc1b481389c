/* How the OpenMP threads of every shoal process wait: passive (sleep on a
 * futex at once) unless the user's environment says otherwise.
 *
 * Why: libgomp's default (OMP_WAIT_POLICY unset) spins about 3 ms
 * (GOMP_SPINCOUNT 300000) at every barrier before sleeping. On a shared box
 * (any other runnable process: a build, a noisy neighbour, or shoal's own
 * coordinator and local expert servers on the same cores) a spinning thread
 * burns the time slice that the thread it waits for needs: decode at 2
 * threads slows by two orders of magnitude with one CPU hog
 * (docs/PERFORMANCE.md, "Waiting"). Passive costs a futex wake per parallel
 * region (microseconds) when the box is idle.
 *
 * How: libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, in its own ELF
 * constructor, and has no API to change them later. A shared library's
 * constructors run before the executable's, so setenv in main() or in a
 * constructor is too late; setenv from the executable's .preinit_array is
 * too early (glibc's own initialiser then re-points environ at the original
 * block, and libgomp reads that: measured with OMP_DISPLAY_ENV=verbose,
 * GOMP_SPINCOUNT stays 300000). So main() sets the variable and re-executes
 * /proc/self/exe once (about a millisecond); the marker SHOAL_OMP_WAIT tells
 * the new image, and the `shoal expert` processes it spawns (which inherit
 * both), that shoal chose it. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is
 * left alone. If the re-exec fails, shoal runs on with libgomp's default and
 * says so in `shoal version`. Verified with OMP_DISPLAY_ENV
 * (tests/e2e/test_omp_wait.py). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/omp_wait.h"

#define SHOAL_WAIT_DEFAULT "passive"

static const char *origin = "libgomp's default";
static const char *policy = "default";

void shoal_omp_wait_apply(char **argv)
{
    const char *p = getenv("OMP_WAIT_POLICY"), *s = getenv("GOMP_SPINCOUNT"), *m = getenv("SHOAL_OMP_WAIT");
    if (p && *p) {
        policy = p;
        origin = m && !strcmp(m, "default") && !strcmp(p, SHOAL_WAIT_DEFAULT) ? "shoal's default"
                                                                               : "from the environment";
        return;
    }
    if (s && *s) {
        policy = "GOMP_SPINCOUNT";
        origin = "from the environment";
        return;
    }
    if (m && !strcmp(m, "exec-failed")) { /* a re-exec already failed once: do not loop */
        origin = "libgomp's default (re-exec failed)";
        return;
    }
    if (setenv("OMP_WAIT_POLICY", SHOAL_WAIT_DEFAULT, 1) || setenv("SHOAL_OMP_WAIT", "default", 1))
        return;
    execv("/proc/self/exe", argv);
    /* still here: run on with what libgomp already read */
    unsetenv("OMP_WAIT_POLICY");
    setenv("SHOAL_OMP_WAIT", "exec-failed", 1);
    origin = "libgomp's default (re-exec failed)";
}

const char *shoal_omp_wait_policy(void)
{
    return policy;
}

const char *shoal_omp_wait_origin(void)
{
    return origin;
}
