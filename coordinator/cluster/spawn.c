/* Local expert-server children (see spawn.h). */
#include "coordinator/cluster/spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "proto/shard.h"

typedef struct {
    pid_t pid;
    int reaped, status;
    char endpoint[128];
    char id[16];
    char *ranges;
} child;

struct shoal_spawn {
    int n;
    child *c;
    const char **eps;
    pid_t pgid;
    char dir[96]; /* the 0700 directory of the workers' ipc sockets ("" before mkdtemp) */
};

/* The private directory of the local workers' sockets: $XDG_RUNTIME_DIR (a
 * per-user 0700 tmpfs) or /tmp, then mkdtemp, which creates it 0700. Path
 * sockets in it are reachable only by this user (and root); abstract sockets
 * (ipc://@name) have no permissions at all and are never used. */
static int make_socket_dir(char *dir, size_t cap, char *err, size_t errlen)
{
    const char *base = getenv("XDG_RUNTIME_DIR");
    struct stat sb;
    /* the base must be a directory we own, and short enough for sun_path (108) */
    if (!base || base[0] != '/' || strlen(base) > 48 || stat(base, &sb) || !S_ISDIR(sb.st_mode) ||
        sb.st_uid != geteuid())
        base = "/tmp";
    snprintf(dir, cap, "%s/shoal-XXXXXX", base);
    if (!mkdtemp(dir)) {
        int e = errno;
        dir[0] = 0;
        return shoal_err_set(err, errlen, -e, "cannot create the local workers' socket directory under %s: %s", base,
                             strerror(e));
    }
    if (chmod(dir, 0700)) { /* mkdtemp makes it 0700; say so whatever the umask */
        int e = errno;
        rmdir(dir);
        dir[0] = 0;
        return shoal_err_set(err, errlen, -e, "chmod 0700 %s: %s", dir, strerror(e));
    }
    return 0;
}

static void reap(child *c, int block)
{
    if (c->reaped || c->pid <= 0)
        return;
    int st;
    pid_t r;
    do
        r = waitpid(c->pid, &st, block ? 0 : WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == c->pid) {
        c->reaped = 1;
        c->status = st;
    }
}

static void describe(const child *c, char *buf, size_t n)
{
    if (WIFEXITED(c->status))
        snprintf(buf, n, "exit status %d", WEXITSTATUS(c->status));
    else if (WIFSIGNALED(c->status))
        snprintf(buf, n, "signal %d", WTERMSIG(c->status));
    else
        snprintf(buf, n, "status %d", c->status);
}

int shoal_spawn_start(shoal_spawn **out, const shoal_spawn_opts *o, const shoal_k3cfg *cfg, char *err,
                      size_t errlen)
{
    *out = NULL;
    if (o->n < 1 || o->n > cfg->num_experts)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--workers %d: must be 1 to %d (experts per layer)", o->n,
                             cfg->num_experts);
    char exe[4096];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0)
        return shoal_err_set(err, errlen, -errno, "cannot find this executable (/proc/self/exe): %s", strerror(errno));
    exe[el] = 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = o->threads > 0 ? o->threads : (int)(cores / o->n > 1 ? cores / o->n : 1);
    char threads_s[16], maxtok_s[16];
    snprintf(threads_s, sizeof threads_s, "%d", threads);
    snprintf(maxtok_s, sizeof maxtok_s, "%d", o->max_tokens > 0 ? o->max_tokens : 1024);

    shoal_spawn *s = shoal_xcalloc(1, sizeof *s);
    s->n = o->n;
    s->c = shoal_xcalloc((size_t)o->n, sizeof *s->c);
    s->eps = shoal_xcalloc((size_t)o->n, sizeof *s->eps);
    int drc = make_socket_dir(s->dir, sizeof s->dir, err, errlen);
    if (drc) {
        shoal_spawn_stop(s);
        return drc;
    }
    for (int i = 0; i < o->n; i++) {
        child *c = &s->c[i];
        shoal_proto_range *r;
        size_t nr;
        int rc = shoal_shard_split(i, o->n, cfg->num_layers, cfg->is_moe, cfg->num_experts, &r, &nr, err, errlen);
        if (rc) {
            shoal_spawn_stop(s);
            return rc;
        }
        size_t cap = nr * 48 + 1;
        c->ranges = shoal_xmalloc(cap);
        rc = shoal_shard_format(r, nr, c->ranges, cap);
        free(r);
        if (rc) {
            shoal_spawn_stop(s);
            return shoal_err_set(err, errlen, rc, "cannot format the ranges of worker %d", i);
        }
        snprintf(c->endpoint, sizeof c->endpoint, "ipc://%s/w%d.sock", s->dir, i);
        snprintf(c->id, sizeof c->id, "w%d", i);
        s->eps[i] = c->endpoint;
    }
    pid_t parent = getpid();
    for (int i = 0; i < o->n; i++) {
        child *c = &s->c[i];
        char *argv[] = {exe,         "expert",        "--model",  (char *)o->model, "--experts", c->ranges,
                        "--listen",  c->endpoint,     "--id",     c->id,            "--threads", threads_s,
                        "--max-tokens", maxtok_s, "--refuse-shutdown", NULL};
        int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
        pid_t pid = fork();
        if (pid < 0) {
            int e = errno;
            if (devnull >= 0)
                close(devnull);
            shoal_spawn_stop(s);
            return shoal_err_set(err, errlen, -e, "fork: %s", strerror(e));
        }
        if (pid == 0) {
            /* async-signal-safe calls only until exec */
            setpgid(0, s->pgid);
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            if (getppid() != parent) /* the coordinator died before prctl */
                _exit(1);
            if (devnull >= 0) {
                dup2(devnull, 0);
                dup2(devnull, 1); /* stdout stays the coordinator's (e.g. --json); logs go to stderr */
            }
            execv(exe, argv);
            _exit(127);
        }
        if (devnull >= 0)
            close(devnull);
        c->pid = pid;
        if (!s->pgid)
            s->pgid = pid;
        setpgid(pid, s->pgid); /* also from the parent: no window where the child is outside the group */
    }
    SHOAL_INFO("started %d local expert workers (process group %d, %s threads each)", o->n, (int)s->pgid, threads_s);
    *out = s;
    return 0;
}

const char *const *shoal_spawn_endpoints(const shoal_spawn *s)
{
    return s->eps;
}

pid_t shoal_spawn_pid(const shoal_spawn *s, int i)
{
    return i >= 0 && i < s->n ? s->c[i].pid : -1;
}

int shoal_spawn_check(void *ctx, char *err, size_t errlen)
{
    shoal_spawn *s = ctx;
    for (int i = 0; i < s->n; i++) {
        reap(&s->c[i], 0);
        if (s->c[i].reaped) {
            char how[64];
            describe(&s->c[i], how, sizeof how);
            return shoal_err_set(err, errlen, SHOAL_EPEER, "local expert worker %s (%s) exited (%s); see its log above",
                                 s->c[i].id, s->c[i].endpoint, how);
        }
    }
    return 0;
}

void shoal_spawn_stop(shoal_spawn *s)
{
    if (!s)
        return;
    for (int i = 0; i < s->n; i++)
        if (s->c[i].pid > 0 && !s->c[i].reaped)
            kill(s->c[i].pid, SIGTERM);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int left = 0;
        for (int i = 0; i < s->n; i++) {
            reap(&s->c[i], 0);
            left += s->c[i].pid > 0 && !s->c[i].reaped;
        }
        if (!left)
            break;
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        if ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 > 5000) {
            for (int i = 0; i < s->n; i++)
                if (s->c[i].pid > 0 && !s->c[i].reaped) {
                    SHOAL_WARN("local expert worker %s did not stop within 5 s; killing it", s->c[i].id);
                    kill(s->c[i].pid, SIGKILL);
                    reap(&s->c[i], 1);
                }
            break;
        }
        usleep(5000);
    }
    for (int i = 0; i < s->n; i++) {
        child *c = &s->c[i];
        if (c->reaped && !(WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0)) {
            char how[64];
            describe(c, how, sizeof how);
            SHOAL_WARN("local expert worker %s ended with %s", c->id, how);
        }
        if (s->dir[0] && !strncmp(c->endpoint, "ipc://", 6))
            unlink(c->endpoint + 6); /* the worker removes it on a clean exit; not after SIGKILL */
        free(c->ranges);
    }
    if (s->dir[0] && rmdir(s->dir))
        SHOAL_WARN("cannot remove the local workers' socket directory %s: %s", s->dir, strerror(errno));
    free(s->c);
    free(s->eps);
    free(s);
}
