/* Local expert-server children (see spawn.h). */
#include "coordinator/cluster/spawn.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
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
#include "kernels/kernels.h"
#include "proto/shard.h"
#include "proto/tshard.h"

/* Restarts allowed per worker within RESTART_WINDOW_S before the next ones
 * wait: 1 s, doubled at each further exit within the window, at most
 * BACKOFF_MAX_S; a worker that stayed up RESTART_WINDOW_S is restarted at
 * once again. It is never given up on. */
#define RESTART_MAX 5
#define RESTART_WINDOW_S 60
#define BACKOFF_MAX_S 60
/* A worker that has had a request outstanding for HANG_MS, is neither
 * running nor in disk I/O, and has used no CPU in that time is hung (e.g.
 * SIGSTOPped): it is killed (SIGKILL) and restarted like one that died. */
#define HANG_MS 3000

typedef struct {
    pid_t pid;
    int reaped, status;
    char endpoint[128];
    char id[16];
    char *ranges;
    char trunk[96];                /* its --trunk ROWSPEC, "" for none */
    int restarts;                  /* total, under s->mu */
    struct timespec at[RESTART_MAX]; /* the last RESTART_MAX restarts, a ring */
    /* backoff: exited and reaped, restart due at next_try */
    int waiting, backoff_s;
    struct timespec next_try;
    char how[64]; /* how it last exited */
    /* hang detection: CPU time (ticks) and when it last changed */
    unsigned long long cpu;
    struct timespec cpu_at, started;
    int hangs;
} child;

struct shoal_spawn {
    int n;
    child *c;
    const char **eps;
    pid_t pgid, parent;
    char dir[96]; /* the 0700 directory of the workers' ipc sockets ("" before mkdtemp) */
    char exe[4096], threads_s[16], maxtok_s[16];
    char numerics[16]; /* this process's numerics class: every local worker computes the same */
    char *model;
    char *relay; /* --relay-peers of every child: all endpoints, comma-separated (NULL: none) */
    /* supervision (shoal_spawn_supervise): one thread, woken every 200 ms or by stop */
    pthread_t th;
    int running, stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    void (*on_restart)(void *ctx, int worker);
    void *on_restart_ctx;
    void (*on_hang)(void *ctx, int worker);
    void *hang_ctx;
    _Atomic unsigned long long *busy; /* [2 * n]: the clients' records (shoal_spawn_busy_slots) */
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

/* fork + exec `shoal expert` for child c (its first start or a restart, with
 * the same arguments and endpoint). */
static int launch(shoal_spawn *s, child *c, char *err, size_t errlen)
{
    char *argv[] = {s->exe,         "expert",       "--model",   s->model, "--experts", c->ranges,
                    "--listen",     c->endpoint,    "--id",      c->id,    "--threads", s->threads_s,
                    "--max-tokens", s->maxtok_s,    "--refuse-shutdown", "--numerics", s->numerics,
                    NULL, NULL, NULL, NULL, NULL};
    int a = 17;
    if (c->trunk[0]) { /* the trunk rows of a generated even spread */
        argv[a++] = "--trunk";
        argv[a++] = c->trunk;
    }
    if (s->relay) { /* the same list for every child: one index names the same worker everywhere */
        argv[a++] = "--relay-peers";
        argv[a++] = s->relay;
    }
    int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
    pid_t parent = s->parent, pgid = s->pgid;
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        if (devnull >= 0)
            close(devnull);
        return shoal_err_set(err, errlen, -e, "fork: %s", strerror(e));
    }
    if (pid == 0) {
        /* async-signal-safe calls only until exec */
        if (setpgid(0, pgid) && pgid) /* a restart after every member of the group has gone */
            setpgid(0, 0);
        prctl(PR_SET_PDEATHSIG, SIGTERM); /* fires when the forking thread ends: a restart forked by the
                                             supervisor is signalled when supervision stops, i.e. at stop */
        if (getppid() != parent) /* the coordinator died before prctl */
            _exit(1);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1); /* stdout stays the coordinator's (e.g. --json); logs go to stderr */
        }
        execv(s->exe, argv);
        _exit(127);
    }
    if (devnull >= 0)
        close(devnull);
    c->pid = pid;
    c->reaped = 0;
    c->cpu = 0;
    clock_gettime(CLOCK_MONOTONIC, &c->cpu_at);
    c->started = c->cpu_at;
    if (!s->pgid)
        s->pgid = pid;
    setpgid(pid, s->pgid); /* also from the parent: no window where the child is outside the group */
    return 0;
}

int shoal_spawn_start(shoal_spawn **out, const shoal_spawn_opts *o, const shoal_k3cfg *cfg, char *err,
                      size_t errlen)
{
    *out = NULL;
    if (o->n < 1 || o->n > cfg->num_experts)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--workers %d: must be 1 to %d (experts per layer)", o->n,
                             cfg->num_experts);
    shoal_spawn *s = shoal_xcalloc(1, sizeof *s);
    ssize_t el = readlink("/proc/self/exe", s->exe, sizeof s->exe - 1);
    if (el <= 0) {
        int e = errno;
        free(s);
        return shoal_err_set(err, errlen, -e, "cannot find this executable (/proc/self/exe): %s", strerror(e));
    }
    s->exe[el] = 0;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = o->threads > 0 ? o->threads : (int)(cores / o->n > 1 ? cores / o->n : 1);
    snprintf(s->threads_s, sizeof s->threads_s, "%d", threads);
    snprintf(s->maxtok_s, sizeof s->maxtok_s, "%d", o->max_tokens > 0 ? o->max_tokens : 1024);
    snprintf(s->numerics, sizeof s->numerics, "%s", shoal_numerics_name(shoal_kernels_numerics()));
    s->model = shoal_xstrdup(o->model);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->n = o->n;
    s->c = shoal_xcalloc((size_t)o->n, sizeof *s->c);
    s->eps = shoal_xcalloc((size_t)o->n, sizeof *s->eps);
    s->busy = shoal_xcalloc(2 * (size_t)o->n, sizeof *s->busy);
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
        if (o->trunk) {
            shoal_tshard_mat *mats = NULL;
            int nm = 0;
            rc = shoal_tshard_mats(cfg, &mats, &nm);
            if (!rc)
                rc = shoal_tshard_spread_spec(mats, nm, i, o->n, c->trunk, sizeof c->trunk, err, errlen);
            else
                shoal_err_set(err, errlen, rc, "the model's trunk matrices do not list");
            free(mats);
            if (rc) {
                shoal_spawn_stop(s);
                return rc == SHOAL_ERANGE ? SHOAL_ECONFIG : rc;
            }
        }
        snprintf(c->endpoint, sizeof c->endpoint, "ipc://%s/w%d.sock", s->dir, i);
        snprintf(c->id, sizeof c->id, "w%d", i);
        s->eps[i] = c->endpoint;
    }
    if (o->relay) {
        size_t len = 1;
        for (int i = 0; i < o->n; i++)
            len += strlen(s->eps[i]) + 1;
        s->relay = shoal_xcalloc(len, 1);
        for (int i = 0; i < o->n; i++) {
            if (i)
                strcat(s->relay, ",");
            strcat(s->relay, s->eps[i]);
        }
    }
    s->parent = getpid();
    for (int i = 0; i < o->n; i++) {
        int rc = launch(s, &s->c[i], err, errlen);
        if (rc) {
            shoal_spawn_stop(s);
            return rc;
        }
    }
    SHOAL_INFO("started %d local expert workers (process group %d, %s threads each)%s", o->n, (int)s->pgid,
               s->threads_s, o->trunk ? (o->relay ? ", each with its part of the trunk rows, relay peers of each other"
                                                  : ", each with its part of the trunk rows")
                                      : "");
    *out = s;
    return 0;
}

const char *const *shoal_spawn_endpoints(const shoal_spawn *s)
{
    return s->eps;
}

pid_t shoal_spawn_pid(shoal_spawn *s, int i)
{
    if (i < 0 || i >= s->n)
        return -1;
    pthread_mutex_lock(&s->mu);
    pid_t p = s->c[i].pid;
    pthread_mutex_unlock(&s->mu);
    return p;
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

static double since_s(const struct timespec *a, const struct timespec *b)
{
    return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_nsec - a->tv_nsec) / 1e9;
}

/* State and CPU ticks (utime + stime) of pid from /proc/PID/stat; 0 or -1. */
static int proc_stat(pid_t pid, char *state, unsigned long long *ticks)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long ut, st;
    if (!p || sscanf(p + 2, "%c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", state, &ut, &st) != 3)
        return -1;
    *ticks = ut + st;
    return 0;
}

/* A live child with a request outstanding for HANG_MS that is not running,
 * not in disk I/O and has used no CPU since: SIGKILL, logged once; the next
 * pass reaps and restarts it (its requests fail over or fail at once when its
 * connection drops, instead of waiting out the expert timeout). */
static void hang_check(shoal_spawn *s, int i, child *c, const struct timespec *now)
{
    char state = '?';
    unsigned long long ticks;
    if (proc_stat(c->pid, &state, &ticks))
        return;
    if (ticks != c->cpu || state == 'R' || state == 'D') {
        c->cpu = ticks;
        c->cpu_at = *now;
        return;
    }
    /* the oldest unanswered request on either link, if sent to this process */
    uint64_t now_ns = (uint64_t)now->tv_sec * 1000000000u + (uint64_t)now->tv_nsec, busy = 0;
    uint64_t start_ns = (uint64_t)c->started.tv_sec * 1000000000u + (uint64_t)c->started.tv_nsec;
    for (int r = 0; r < 2; r++) {
        uint64_t t = atomic_load(&s->busy[r * s->n + i]);
        if (t && t >= start_ns && t < now_ns && (now_ns - t) / 1000000u > busy)
            busy = (now_ns - t) / 1000000u;
    }
    double idle_ms = since_s(&c->cpu_at, now) * 1000.0;
    if (busy < HANG_MS || idle_ms < HANG_MS)
        return;
    c->hangs++;
    SHOAL_ERROR("local expert worker %s (%s, pid %d) has not answered a request for %.1f s and used no CPU for %.1f s "
                "(state %c%s): killing it (SIGKILL) and restarting it (hang %d)",
                c->id, c->endpoint, (int)c->pid, (double)busy / 1000.0, idle_ms / 1000.0, state,
                state == 'T' || state == 't' ? ": stopped" : "", c->hangs);
    kill(c->pid, SIGKILL);
    c->cpu_at = *now; /* not again before it is reaped */
    if (s->on_hang)
        s->on_hang(s->hang_ctx, i);
}

/* Start child c again now (its socket file removed first); on failure back off. */
static void restart_now(shoal_spawn *s, int i, child *c, const struct timespec *now, int after_backoff)
{
    if (!strncmp(c->endpoint, "ipc://", 6))
        unlink(c->endpoint + 6); /* a killed worker leaves its socket file */
    char err[256];
    if (launch(s, c, err, sizeof err)) {
        c->backoff_s = c->backoff_s ? (c->backoff_s * 2 < BACKOFF_MAX_S ? c->backoff_s * 2 : BACKOFF_MAX_S) : 1;
        c->next_try = *now;
        c->next_try.tv_sec += c->backoff_s;
        c->waiting = 1;
        SHOAL_ERROR("local expert worker %s (%s) cannot be restarted: %s; trying again in %d s", c->id, c->endpoint,
                    err, c->backoff_s);
        return;
    }
    c->waiting = 0;
    c->at[c->restarts % RESTART_MAX] = *now;
    c->restarts++;
    if (s->on_restart)
        s->on_restart(s->on_restart_ctx, i);
    SHOAL_WARN("local expert worker %s (%s) exited (%s); restarted as pid %d with the same experts (restart %d%s)",
               c->id, c->endpoint, c->how, (int)c->pid, c->restarts, after_backoff ? ", after backing off" : "");
}

/* One pass over the children (under s->mu): reap the dead and restart them
 * with the same ownership and endpoint -- at once, or, past RESTART_MAX
 * restarts within RESTART_WINDOW_S, after an exponential backoff; kill the
 * hung. The coordinator's keeper sees the endpoint answer again, re-checks
 * HELLO (fingerprint, ownership) and marks the worker up. */
static void supervise_pass(shoal_spawn *s)
{
    for (int i = 0; i < s->n && !s->stop; i++) {
        child *c = &s->c[i];
        if (c->pid <= 0)
            continue;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (c->waiting) {
            if (since_s(&c->next_try, &now) >= 0)
                restart_now(s, i, c, &now, 1);
            continue;
        }
        reap(c, 0);
        if (!c->reaped) {
            hang_check(s, i, c, &now);
            continue;
        }
        describe(c, c->how, sizeof c->how);
        int k = c->restarts % RESTART_MAX; /* the oldest of the last RESTART_MAX restarts */
        if (c->restarts >= RESTART_MAX && since_s(&c->at[k], &now) < RESTART_WINDOW_S) {
            c->backoff_s = c->backoff_s ? (c->backoff_s * 2 < BACKOFF_MAX_S ? c->backoff_s * 2 : BACKOFF_MAX_S) : 1;
            c->next_try = now;
            c->next_try.tv_sec += c->backoff_s;
            c->waiting = 1;
            SHOAL_ERROR("local expert worker %s (%s) exited (%s); it was restarted %d times within %d s: backing off, "
                        "next restart in %d s (requests that need it get a 503 naming it meanwhile)",
                        c->id, c->endpoint, c->how, RESTART_MAX, RESTART_WINDOW_S, c->backoff_s);
            continue;
        }
        c->backoff_s = 0; /* up long enough: the crash loop, if any, is over */
        restart_now(s, i, c, &now, 0);
    }
}

static void *supervise_main(void *arg)
{
    shoal_spawn *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stop) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 200 * 1000000L;
        if (t.tv_nsec >= 1000000000L) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &t); /* a sleeping wait: 5 wake-ups a second */
        if (!s->stop)
            supervise_pass(s);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int shoal_spawn_supervise(shoal_spawn *s, char *err, size_t errlen)
{
    if (!s || s->running)
        return 0;
    if (pthread_create(&s->th, NULL, supervise_main, s))
        return shoal_err_set(err, errlen, SHOAL_ENOMEM, "cannot start the local workers' supervisor thread");
    s->running = 1;
    return 0;
}

void shoal_spawn_on_restart(shoal_spawn *s, void (*fn)(void *ctx, int worker), void *ctx)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->on_restart = fn;
    s->on_restart_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

_Atomic unsigned long long *shoal_spawn_busy_slots(shoal_spawn *s, int role)
{
    return s ? s->busy + (role ? s->n : 0) : NULL;
}

void shoal_spawn_on_hang(shoal_spawn *s, void (*on_hang)(void *ctx, int worker), void *ctx)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->on_hang = on_hang;
    s->hang_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

int shoal_spawn_state_get(shoal_spawn *s, int i, shoal_spawn_state *out)
{
    memset(out, 0, sizeof *out);
    if (!s || i < 0 || i >= s->n)
        return -1;
    pthread_mutex_lock(&s->mu);
    child *c = &s->c[i];
    out->restarts = c->restarts;
    out->hangs = c->hangs;
    out->backing_off = c->waiting;
    out->backoff_s = c->waiting ? c->backoff_s : 0;
    if (c->waiting) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double left = -since_s(&c->next_try, &now);
        out->next_try_s = left > 0 ? left : 0;
        struct timespec rt;
        clock_gettime(CLOCK_REALTIME, &rt);
        out->next_try_unix = (double)rt.tv_sec + (double)rt.tv_nsec / 1e9 + out->next_try_s;
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void shoal_spawn_stop(shoal_spawn *s)
{
    if (!s)
        return;
    if (s->running) { /* supervision ends first: nothing is restarted while it is being stopped */
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->th, NULL);
        s->running = 0;
    }
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
    free((void *)s->busy);
    free(s->model);
    free(s->relay);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
