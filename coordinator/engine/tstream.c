/* Trunk weight streaming (tstream.h). */
#include "coordinator/engine/tstream.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"

#define A ((uint64_t)SHOAL_TSTREAM_ALIGN)
#define NEED_RING 64

enum { SLOT_EMPTY, SLOT_FILLING, SLOT_READY, SLOT_ERROR };

typedef struct {
    void *mem;
    int state;
    uint64_t cycle; /* which (cycle, unit) the slot holds */
    int idx;
    int code;
    char msg[512];
} slot;

typedef struct {
    const char *path;
    int fd_direct; /* -1 when the filesystem refused O_DIRECT (or no_direct) */
    int fd;        /* buffered */
    atomic_int direct_ok;
} tfile;

struct shoal_tstream {
    tfile *files;
    int nfiles;
    shoal_tstream_opts o;

    /* started stream */
    shoal_tstream_unit *units;
    int n;
    size_t buf_bytes;
    slot slots[2];
    pthread_t th;
    int running;
    pthread_mutex_t mu;
    pthread_cond_t prod_cv, cons_cv;
    atomic_int stop;
    /* producer position: cycle pc, unit pi, reads done pk */
    uint64_t pc, pk;
    int pi;
    /* consumer position */
    uint64_t began, cc, ck;
    uint64_t need_bits[NEED_RING];

    /* stats (under mu once started) */
    uint64_t bytes_read, units_read, skipped;
    double read_s, stall_s;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t up(uint64_t x)
{
    return (x + A - 1) & ~(A - 1);
}

size_t shoal_tstream_layout(shoal_tstream_unit *u)
{
    uint64_t cur = 0;
    for (int i = 0; i < u->n_ext; i++) {
        shoal_tstream_ext *e = &u->ext[i];
        uint64_t a0 = e->off & ~(A - 1), a1 = up(e->off + e->len);
        e->at = (size_t)(cur + (e->off - a0));
        cur += a1 - a0;
    }
    u->bytes = (size_t)cur;
    return u->bytes;
}

int shoal_tstream_open(shoal_tstream **out, const char *const *paths, int nfiles, const shoal_tstream_opts *o,
                       char *err, size_t errlen)
{
    *out = NULL;
    shoal_tstream *ts = shoal_xcalloc(1, sizeof *ts);
    pthread_mutex_init(&ts->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&ts->prod_cv, &ca);
    pthread_cond_init(&ts->cons_cv, &ca);
    pthread_condattr_destroy(&ca);
    if (o)
        ts->o = *o;
    if (!ts->o.timeout_ms)
        ts->o.timeout_ms = 300000;
    if (!ts->o.chunk_bytes)
        ts->o.chunk_bytes = 8u << 20;
    ts->o.chunk_bytes = (size_t)up(ts->o.chunk_bytes);
    ts->files = shoal_xcalloc((size_t)(nfiles > 0 ? nfiles : 1), sizeof *ts->files);
    ts->nfiles = nfiles;
    for (int i = 0; i < nfiles; i++) {
        tfile *f = &ts->files[i];
        f->path = paths[i];
        f->fd_direct = -1;
        f->fd = -1;
    }
    for (int i = 0; i < nfiles; i++) {
        tfile *f = &ts->files[i];
        /* the same regular-file check as every model file (a FIFO put in a
         * shard's place must not block the load) */
        f->fd = shoal_open_regular(f->path, O_RDONLY);
        if (f->fd < 0) {
            int orc = f->fd;
            int rc = orc == SHOAL_EFORMAT
                         ? shoal_err_set(err, errlen, SHOAL_EFORMAT, "trunk stream: %s: not a regular file", f->path)
                         : shoal_err_set(err, errlen, orc, "trunk stream: %s: %s", f->path, strerror(-orc));
            shoal_tstream_close(ts);
            return rc;
        }
        if (!ts->o.no_direct)
            f->fd_direct = shoal_open_regular(f->path, O_RDONLY | O_DIRECT);
        int derr = f->fd_direct < 0 ? -f->fd_direct : 0;
        if (f->fd_direct < 0)
            f->fd_direct = -1;
        atomic_store(&f->direct_ok, f->fd_direct >= 0);
        if (f->fd_direct < 0 && !ts->o.no_direct)
            SHOAL_WARN("trunk stream: %s: O_DIRECT refused (%s): buffered reads", f->path,
                       derr == -SHOAL_EFORMAT ? "not a regular file" : strerror(derr));
    }
    *out = ts;
    return 0;
}

static void stop_thread(shoal_tstream *ts)
{
    if (!ts->running)
        return;
    pthread_mutex_lock(&ts->mu);
    atomic_store(&ts->stop, 1);
    pthread_cond_broadcast(&ts->prod_cv);
    pthread_cond_broadcast(&ts->cons_cv);
    pthread_mutex_unlock(&ts->mu);
    pthread_join(ts->th, NULL);
    ts->running = 0;
}

void shoal_tstream_close(shoal_tstream *ts)
{
    if (!ts)
        return;
    stop_thread(ts);
    for (int s = 0; s < 2; s++)
        free(ts->slots[s].mem);
    for (int i = 0; i < ts->nfiles; i++) {
        if (ts->files[i].fd >= 0)
            close(ts->files[i].fd);
        if (ts->files[i].fd_direct >= 0)
            close(ts->files[i].fd_direct);
    }
    pthread_mutex_destroy(&ts->mu);
    pthread_cond_destroy(&ts->prod_cv);
    pthread_cond_destroy(&ts->cons_cv);
    free(ts->files);
    free(ts);
}

/* Read [lo, hi) of f (fd) into dst, in chunks, stopping early (ECANCELED)
 * when *stop. Bytes past EOF are allowed only beyond need_end. */
static int read_range(shoal_tstream *ts, tfile *f, int fd, uint64_t lo, uint64_t hi, uint64_t need_end, char *dst,
                      const atomic_int *stop, const char *name, uint64_t *nread, char *err, size_t errlen)
{
    uint64_t pos = lo;
    while (pos < hi) {
        if (stop && atomic_load(stop))
            return SHOAL_ECANCELED;
        size_t want = hi - pos < ts->o.chunk_bytes ? (size_t)(hi - pos) : ts->o.chunk_bytes;
        ssize_t r = pread(fd, dst + (pos - lo), want, (off_t)pos);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return shoal_err_set(err, errlen, -errno, "trunk stream: %s: tensor %s: pread of %zu bytes at %llu: %s",
                                 f->path, name, want, (unsigned long long)pos, strerror(errno));
        }
        *nread += (uint64_t)r;
        if (r == 0) {
            if (pos >= need_end)
                return 0;
            return shoal_err_set(err, errlen, SHOAL_EIO,
                                 "trunk stream: %s: tensor %s: end of file at byte %llu, data ends at %llu "
                                 "(file truncated?)",
                                 f->path, name, (unsigned long long)pos, (unsigned long long)need_end);
        }
        pos += (uint64_t)r;
        /* a short read of a regular file is its end: past the data, that is
         * the O_DIRECT span's tail beyond EOF (reading again at the unaligned
         * EOF offset would fail with EINVAL) */
        if ((size_t)r < want && pos >= need_end)
            return 0;
    }
    return 0;
}

static int read_unit(shoal_tstream *ts, const shoal_tstream_unit *u, char *dst, const atomic_int *stop,
                     uint64_t *nread, char *err, size_t errlen)
{
    for (int i = 0; i < u->n_ext; i++) {
        const shoal_tstream_ext *e = &u->ext[i];
        if (e->file < 0 || e->file >= ts->nfiles)
            return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "trunk stream: tensor %s: file %d of %d", e->name,
                                 e->file, ts->nfiles);
        tfile *f = &ts->files[e->file];
        int rc;
        if (atomic_load(&f->direct_ok)) {
            uint64_t a0 = e->off & ~(A - 1), a1 = up(e->off + e->len);
            rc = read_range(ts, f, f->fd_direct, a0, a1, e->off + e->len, dst + e->at - (e->off - a0), stop,
                            e->name, nread, err, errlen);
            if (rc != -EINVAL)
                goto next;
            /* the filesystem opened with O_DIRECT but refuses these reads */
            SHOAL_WARN("trunk stream: %s: O_DIRECT reads refused (EINVAL): buffered reads from now on", f->path);
            atomic_store(&f->direct_ok, 0);
        }
        rc = read_range(ts, f, f->fd, e->off, e->off + e->len, e->off + e->len, dst + e->at, stop, e->name, nread,
                        err, errlen);
    next:
        if (rc)
            return rc;
    }
    return 0;
}

int shoal_tstream_read(shoal_tstream *ts, const shoal_tstream_unit *u, void *dst, char *err, size_t errlen)
{
    uint64_t nr = 0;
    double t0 = now_s();
    int rc = read_unit(ts, u, dst, NULL, &nr, err, errlen);
    pthread_mutex_lock(&ts->mu);
    ts->bytes_read += nr;
    ts->units_read++;
    ts->read_s += now_s() - t0;
    pthread_mutex_unlock(&ts->mu);
    return rc;
}

int shoal_tstream_pread(shoal_tstream *ts, int file, uint64_t off, size_t len, void *dst, const char *name,
                        char *err, size_t errlen)
{
    if (file < 0 || file >= ts->nfiles)
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "trunk stream: tensor %s: file %d of %d", name, file,
                             ts->nfiles);
    uint64_t nr = 0;
    return read_range(ts, &ts->files[file], ts->files[file].fd, off, off + len, off + len, dst, NULL, name, &nr, err,
                      errlen);
}

/* ---- the reader thread ------------------------------------------------------ */

static void advance(shoal_tstream *ts)
{
    if (++ts->pi == ts->n) {
        ts->pi = 0;
        ts->pc++;
    }
}

static void *reader(void *arg)
{
    shoal_tstream *ts = arg;
    pthread_mutex_lock(&ts->mu);
    while (!atomic_load(&ts->stop)) {
        const shoal_tstream_unit *u = &ts->units[ts->pi];
        if (u->optional) {
            /* read it only if its cycle asked for it: wait for that cycle's begin */
            while (!atomic_load(&ts->stop) && ts->began <= ts->pc)
                pthread_cond_wait(&ts->prod_cv, &ts->mu);
            if (atomic_load(&ts->stop))
                break;
            if (!ts->need_bits[ts->pc % NEED_RING]) {
                ts->skipped++;
                advance(ts);
                pthread_cond_broadcast(&ts->cons_cv);
                continue;
            }
        }
        slot *s = &ts->slots[ts->pk % 2];
        while (!atomic_load(&ts->stop) && s->state != SLOT_EMPTY)
            pthread_cond_wait(&ts->prod_cv, &ts->mu);
        if (atomic_load(&ts->stop))
            break;
        s->state = SLOT_FILLING;
        s->cycle = ts->pc;
        s->idx = ts->pi;
        pthread_mutex_unlock(&ts->mu);
        uint64_t nr = 0;
        double t0 = now_s();
        char msg[512] = "";
        int rc = read_unit(ts, u, s->mem, &ts->stop, &nr, msg, sizeof msg);
        double dt = now_s() - t0;
        pthread_mutex_lock(&ts->mu);
        ts->bytes_read += nr;
        ts->read_s += dt;
        if (rc == SHOAL_ECANCELED && atomic_load(&ts->stop))
            break;
        ts->units_read++;
        s->code = rc;
        snprintf(s->msg, sizeof s->msg, "%s", msg);
        s->state = rc ? SLOT_ERROR : SLOT_READY;
        ts->pk++;
        advance(ts);
        pthread_cond_broadcast(&ts->cons_cv);
        if (rc) /* park until reset or close */
            while (!atomic_load(&ts->stop))
                pthread_cond_wait(&ts->prod_cv, &ts->mu);
    }
    pthread_mutex_unlock(&ts->mu);
    return NULL;
}

static int launch(shoal_tstream *ts, char *err, size_t errlen)
{
    for (int s = 0; s < 2; s++) {
        ts->slots[s].state = SLOT_EMPTY;
        ts->slots[s].cycle = UINT64_MAX;
        ts->slots[s].idx = -1;
    }
    ts->pc = ts->pk = 0;
    ts->pi = 0;
    ts->began = ts->cc = ts->ck = 0;
    memset(ts->need_bits, 0, sizeof ts->need_bits);
    atomic_store(&ts->stop, 0);
    int e = pthread_create(&ts->th, NULL, reader, ts);
    if (e)
        return shoal_err_set(err, errlen, -e, "trunk stream: cannot start the reader thread: %s", strerror(e));
    ts->running = 1;
    return 0;
}

int shoal_tstream_start(shoal_tstream *ts, shoal_tstream_unit *units, int n, char *err, size_t errlen)
{
    if (ts->running || n < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk stream: start with %d units%s", n,
                             ts->running ? " (already started)" : "");
    size_t mx = 0;
    for (int i = 0; i < n; i++)
        if (units[i].bytes > mx)
            mx = units[i].bytes;
    ts->units = units;
    ts->n = n;
    ts->buf_bytes = mx;
    for (int s = 0; s < 2; s++) {
        if (posix_memalign(&ts->slots[s].mem, A, mx ? mx : A))
            SHOAL_PANIC("out of memory: trunk streaming buffer of %zu bytes", mx);
        /* touch now: the budget is resident from the start, not at first use */
        memset(ts->slots[s].mem, 0, mx);
    }
    return launch(ts, err, errlen);
}

size_t shoal_tstream_buffer_bytes(const shoal_tstream *ts)
{
    return 2 * ts->buf_bytes;
}

static void deadline_in(struct timespec *ts, int ms)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

void shoal_tstream_begin(shoal_tstream *ts, int need_optional)
{
    pthread_mutex_lock(&ts->mu);
    /* the need flags live in a ring: a consumer that runs many cycles of
     * skipped-only units ahead waits for the reader to pass them (bounded:
     * skipping takes no I/O) */
    struct timespec dl;
    deadline_in(&dl, ts->o.timeout_ms);
    while (ts->running && ts->began >= ts->pc + NEED_RING / 2 && !atomic_load(&ts->stop))
        if (pthread_cond_timedwait(&ts->cons_cv, &ts->mu, &dl) == ETIMEDOUT)
            break;
    ts->need_bits[ts->began % NEED_RING] = (uint64_t)(need_optional != 0);
    ts->cc = ts->began++;
    pthread_cond_broadcast(&ts->prod_cv);
    pthread_mutex_unlock(&ts->mu);
}

int shoal_tstream_acquire(shoal_tstream *ts, int i, const void **buf, char *err, size_t errlen)
{
    *buf = NULL;
    if (!ts->running)
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "trunk stream: acquire without a running reader");
    double t0 = now_s();
    struct timespec dl;
    deadline_in(&dl, ts->o.timeout_ms);
    pthread_mutex_lock(&ts->mu);
    slot *s = &ts->slots[ts->ck % 2];
    int rc = 0;
    while (s->state != SLOT_READY && s->state != SLOT_ERROR) {
        if (pthread_cond_timedwait(&ts->cons_cv, &ts->mu, &dl) == ETIMEDOUT) {
            const shoal_tstream_unit *u = &ts->units[i];
            rc = shoal_err_set(err, errlen, SHOAL_ETIMEOUT,
                               "trunk stream: unit %d (%d tensors from %s, %zu bytes) not read within %d ms", i,
                               u->n_ext, u->n_ext ? u->ext[0].name : "?", u->bytes, ts->o.timeout_ms);
            goto out;
        }
    }
    if (s->state == SLOT_ERROR) {
        rc = shoal_err_set(err, errlen, s->code, "%s", s->msg);
        goto out;
    }
    if (s->cycle != ts->cc || s->idx != i) {
        rc = shoal_err_set(err, errlen, SHOAL_EINTERNAL,
                           "trunk stream: expected unit %d of cycle %llu, the buffer holds unit %d of cycle %llu", i,
                           (unsigned long long)ts->cc, s->idx, (unsigned long long)s->cycle);
        goto out;
    }
    *buf = s->mem;
out:
    ts->stall_s += now_s() - t0;
    pthread_mutex_unlock(&ts->mu);
    return rc;
}

void shoal_tstream_release(shoal_tstream *ts)
{
    pthread_mutex_lock(&ts->mu);
    ts->slots[ts->ck % 2].state = SLOT_EMPTY;
    ts->ck++;
    pthread_cond_broadcast(&ts->prod_cv);
    pthread_mutex_unlock(&ts->mu);
}

void shoal_tstream_reset(shoal_tstream *ts)
{
    stop_thread(ts);
}

int shoal_tstream_resume(shoal_tstream *ts, char *err, size_t errlen)
{
    if (ts->running || !ts->units)
        return 0;
    return launch(ts, err, errlen);
}

void shoal_tstream_get_stats(const shoal_tstream *ts, shoal_tstream_stats *out)
{
    shoal_tstream *w = (shoal_tstream *)ts;
    pthread_mutex_lock(&w->mu);
    out->bytes_read = ts->bytes_read;
    out->units_read = ts->units_read;
    out->skipped = ts->skipped;
    out->read_s = ts->read_s;
    out->stall_s = ts->stall_s;
    int d = 1;
    for (int i = 0; i < ts->nfiles; i++)
        d &= atomic_load(&ts->files[i].direct_ok);
    out->direct = ts->nfiles > 0 && d;
    pthread_mutex_unlock(&w->mu);
}
