/* The worker's expert store under a RAM budget (see store.h).
 *
 * Layout: each owned expert's 3 (BF16/F32) or 6 (MXFP4) tensors are grouped
 * into runs of nearby bytes in one file; a run is read as one aligned span
 * [offset rounded down, end rounded up to ALIGN], so O_DIRECT's alignment
 * rules hold, and the tensor views point into the span at the tensor's own
 * offset -- the same address modulo ALIGN as the read-only mapping the bank
 * would use. A slot is the largest expert's spans, rounded to ALIGN. */

#include "worker/store.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "common/utf8.h"

#define ALIGN 4096u
#define NT SHOAL_K3SCHEMA_EXPERT_MAX

typedef struct {
    int file;
    uint64_t off, len; /* aligned span in the file */
    uint64_t need;     /* bytes of the span that must be read (the rest is padding past EOF) */
    uint64_t pos;      /* where the span goes in the slot */
} run;

typedef struct {
    int nt, nruns;
    shoal_expert_kind kind;
    uint64_t tpos[NT]; /* tensor data offset in the slot (views order: w1, w1s, w3, w3s, w2, w2s / w1, w3, w2) */
    run runs[NT];
} emeta;

typedef struct {
    int fd_direct, fd_plain;
    char path[4096];
} sfile;

typedef struct {
    const run *r;
    uint8_t *dst;
    int slot; /* the slot it fills */
} job;

/* A ring of jobs; at most one fill per slot is outstanding (a slot being
 * filled is never a victim), so nslots * NT entries always suffice. */
typedef struct {
    job *j;
    uint32_t cap, head, count;
} ring;

struct shoal_store {
    int num_layers, num_experts, d, f;
    float b1, b2;
    uint64_t bytes, expert_bytes, slot_bytes;
    int32_t *meta_of; /* [num_layers * num_experts]: index into meta, -1 not owned */
    emeta *meta;
    uint32_t nmeta, nslots, min_slots;
    sfile *files;
    int nfiles;
    uint8_t *mem;     /* [nslots * slot_bytes], ALIGN-aligned */
    shoal_cachepol *pol;
    uint8_t *pinned;  /* [nslots] */
    int32_t *pass_slot; /* [nslots] slots pinned by the current pass */
    int32_t *pass_key;  /* [nslots] */
    uint8_t *pass_miss; /* [nslots] */
    int pass_failed;    /* a read of the current pass failed: its misses were dropped */
    int npass;
    uint8_t *block;     /* [nslots] scratch: slots no victim may come from */
    int32_t *skey;      /* [nslots] key last placed in each slot */
    uint8_t *pf;        /* [nslots] 1: holds a prefetched expert not used yet */
    shoal_expert_w *views; /* [nslots] */
    shoal_store_stats st;
    shoal_wmetrics *wm;
    /* I/O pool; everything below under mu */
    pthread_t *th;
    int nth;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    ring demand, ahead;   /* demand reads go first; prefetch reads when none wait */
    int *busy;            /* [nslots] reads outstanding into each slot */
    int *slot_err;        /* [nslots] the error of a failed read into the slot (0: none) */
    uint32_t demand_left; /* demand reads not finished */
    uint32_t ahead_left;  /* prefetch reads not finished */
    int quit;
    char io_msg[512];     /* the last failed read */
};

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static int dtype_ok(const shoal_k3schema_entry *s, const shoal_tensor *t)
{
    if (t->dtype != s->dtype && (s->alt_dtype < 0 || t->dtype != (shoal_dtype)s->alt_dtype))
        return 0;
    if (t->ndim != s->ndim)
        return 0;
    for (int i = 0; i < s->ndim; i++)
        if (t->shape[i] != s->shape[i])
            return 0;
    return 1;
}

/* Group one expert's tensors into aligned runs; returns its slot bytes. */
static int build_meta(const shoal_st *st, const shoal_k3cfg *cfg, int l, int e, emeta *m, uint64_t *wbytes,
                      char *err, size_t errlen)
{
    shoal_k3schema_entry ent[NT];
    int n = shoal_k3schema_expert(cfg, l, e, ent);
    if (n < 0)
        return shoal_err_set(err, errlen, SHOAL_EMODEL, "layer %d expert %d is not a routed expert", l, e);
    const shoal_tensor *t[NT];
    *wbytes = 0;
    for (int i = 0; i < n; i++) {
        t[i] = shoal_st_find(st, ent[i].name);
        if (!t[i] || !dtype_ok(&ent[i], t[i]))
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "%s %s (want %s [%lld, %lld])",
                                 t[i] ? "mis-shaped" : "missing", ent[i].name, shoal_dtype_name(ent[i].dtype),
                                 (long long)ent[i].shape[0], (long long)ent[i].shape[1]);
        *wbytes += t[i]->nbytes;
    }
    memset(m, 0, sizeof *m);
    m->nt = n;
    if (n == 6) {
        m->kind = SHOAL_EXPERT_MXFP4;
    } else {
        m->kind = t[0]->dtype == SHOAL_DT_BF16 ? SHOAL_EXPERT_BF16 : SHOAL_EXPERT_F32;
        if (t[1]->dtype != t[0]->dtype || t[2]->dtype != t[0]->dtype)
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "layer %d expert %d: w1/w3/w2 dtypes differ", l, e);
    }
    /* tensors by (file, offset): merge those whose aligned spans touch */
    int ord[NT];
    for (int i = 0; i < n; i++) {
        int j = i;
        for (; j > 0 && (t[ord[j - 1]]->file > t[i]->file ||
                         (t[ord[j - 1]]->file == t[i]->file && t[ord[j - 1]]->file_offset > t[i]->file_offset));
             j--)
            ord[j] = ord[j - 1];
        ord[j] = i;
    }
    uint64_t pos = 0;
    run *cur = NULL;
    for (int oi = 0; oi < n; oi++) {
        const shoal_tensor *x = t[ord[oi]];
        uint64_t a = x->file_offset & ~(uint64_t)(ALIGN - 1), end = x->file_offset + x->nbytes;
        uint64_t ae = (end + ALIGN - 1) & ~(uint64_t)(ALIGN - 1);
        if (cur && cur->file == x->file && a <= cur->off + cur->len) {
            if (ae > cur->off + cur->len) {
                pos += ae - (cur->off + cur->len);
                cur->len = ae - cur->off;
            }
            if (end - cur->off > cur->need)
                cur->need = end - cur->off;
        } else {
            cur = &m->runs[m->nruns++];
            *cur = (run){.file = x->file, .off = a, .len = ae - a, .need = end - a, .pos = pos};
            pos += ae - a;
        }
        m->tpos[ord[oi]] = cur->pos + (x->file_offset - cur->off);
    }
    return 0;
}

static int owned_layout(const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own, emeta *meta,
                        uint64_t *slot_bytes, uint64_t *expert_bytes, uint32_t *nowned, uint32_t *min_slots,
                        char *err, size_t errlen)
{
    emeta tmp;
    uint32_t n = 0, maxl = 0;
    *slot_bytes = *expert_bytes = 0;
    for (int l = 0; l < cfg->num_layers; l++) {
        uint32_t nl = 0;
        for (int e = 0; e < cfg->num_experts; e++) {
            if (!shoal_shard_owns(own, l, e))
                continue;
            emeta *m = meta ? &meta[n] : &tmp;
            uint64_t wb = 0;
            int rc = build_meta(st, cfg, l, e, m, &wb, err, errlen);
            if (rc)
                return rc;
            uint64_t sb = 0;
            for (int r = 0; r < m->nruns; r++)
                sb += m->runs[r].len;
            if (sb > *slot_bytes)
                *slot_bytes = sb;
            if (wb > *expert_bytes)
                *expert_bytes = wb;
            n++, nl++;
        }
        if (nl > maxl)
            maxl = nl;
    }
    *nowned = n;
    *min_slots = (uint32_t)cfg->experts_per_token < maxl ? (uint32_t)cfg->experts_per_token : maxl;
    return 0;
}

int shoal_store_plan(const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own, uint64_t *slot_bytes,
                     uint32_t *min_slots, char *err, size_t errlen)
{
    uint64_t eb;
    uint32_t n;
    return owned_layout(st, cfg, own, NULL, slot_bytes, &eb, &n, min_slots, err, errlen);
}

/* ---- I/O ------------------------------------------------------------------ */

/* Read one aligned span; falls back to the buffered descriptor when O_DIRECT
 * refuses (EINVAL: alignment or filesystem). 0 or -errno / SHOAL_EIO. */
static int read_run(shoal_store *s, const run *r, uint8_t *dst, char *msg, size_t msglen)
{
    sfile *f = &s->files[r->file];
    int fd = f->fd_direct >= 0 ? f->fd_direct : f->fd_plain;
    uint64_t got = 0;
    while (got < r->len) {
        ssize_t k = pread(fd, dst + got, r->len - got, (off_t)(r->off + got));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EINVAL && fd != f->fd_plain) {
                fd = f->fd_plain;
                continue;
            }
            int e = errno;
            char p[301]; /* a path is outside text: cut on a character, cleaned */
            snprintf(msg, msglen, "read %s at %llu: %s", shoal_utf8_clip(p, sizeof p, f->path, SHOAL_UTF8_NOCTRL),
                     (unsigned long long)(r->off + got), strerror(e));
            return -e;
        }
        if (k == 0)
            break;
        got += (uint64_t)k;
    }
    if (got < r->need) {
        char p[301];
        snprintf(msg, msglen, "read %s at %llu: file ends %llu bytes early",
                 shoal_utf8_clip(p, sizeof p, f->path, SHOAL_UTF8_NOCTRL), (unsigned long long)r->off,
                 (unsigned long long)(r->need - got));
        return SHOAL_EIO;
    }
    return 0;
}

static void ring_put(ring *q, job j)
{
    if (q->count >= q->cap)
        SHOAL_PANIC("expert store: job ring overflow"); /* one fill per slot: cannot happen */
    q->j[(q->head + q->count++) % q->cap] = j;
}

static void *io_main(void *arg)
{
    shoal_store *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->quit && !s->demand.count && !s->ahead.count)
            pthread_cond_wait(&s->work, &s->mu);
        if (s->quit)
            break;
        int is_demand = s->demand.count > 0;
        ring *q = is_demand ? &s->demand : &s->ahead;
        job j = q->j[q->head];
        q->head = (q->head + 1) % q->cap;
        q->count--;
        pthread_mutex_unlock(&s->mu);
        char msg[512];
        int rc = read_run(s, j.r, j.dst, msg, sizeof msg);
        pthread_mutex_lock(&s->mu);
        if (rc) {
            s->slot_err[j.slot] = rc;
            snprintf(s->io_msg, sizeof s->io_msg, "%s", msg);
        }
        s->busy[j.slot]--;
        if (is_demand)
            s->demand_left--;
        else
            s->ahead_left--;
        pthread_cond_broadcast(&s->done); /* the handler waits for one slot, or for all */
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Probe O_DIRECT on a file: open and read one aligned block. */
static int open_direct(const char *path, uint8_t *probe)
{
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t k = pread(fd, probe, ALIGN, 0);
    if (k < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- open / close --------------------------------------------------------- */

int shoal_store_open(shoal_store **out, const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own,
                     const shoal_store_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    shoal_store *s = shoal_xcalloc(1, sizeof *s);
    s->num_layers = cfg->num_layers;
    s->num_experts = cfg->num_experts;
    s->d = cfg->latent_size;
    s->f = cfg->moe_intermediate_size;
    s->b1 = cfg->situ_beta;
    s->b2 = cfg->situ_linear_beta;
    s->nfiles = 0;
    size_t nkeys = (size_t)cfg->num_layers * (size_t)cfg->num_experts;
    s->meta_of = shoal_xmalloc(nkeys * sizeof *s->meta_of);
    s->meta = shoal_xcalloc(shoal_shard_count(own) ? shoal_shard_count(own) : 1, sizeof *s->meta);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work, NULL);
    pthread_cond_init(&s->done, NULL);
    int rc = owned_layout(st, cfg, own, s->meta, &s->slot_bytes, &s->expert_bytes, &s->nmeta, &s->min_slots, err,
                          errlen);
    if (rc)
        goto fail;
    if (s->nmeta == 0) {
        rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "the expert store owns no expert");
        goto fail;
    }
    for (size_t i = 0, m = 0; i < nkeys; i++)
        s->meta_of[i] = shoal_shard_owns(own, (int)(i / (size_t)cfg->num_experts), (int)(i % (size_t)cfg->num_experts))
                            ? (int32_t)m++
                            : -1;
    s->bytes = (uint64_t)s->nmeta * s->expert_bytes;
    uint64_t want = o->slots ? o->slots : o->cache_bytes / s->slot_bytes;
    if (want < s->min_slots) {
        rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                           "expert cache budget too small: %llu bytes hold %llu slots of %llu bytes; the minimum is "
                           "%u slots (%llu bytes, %.4f GiB): one token's experts",
                           (unsigned long long)(o->slots ? o->slots * s->slot_bytes : o->cache_bytes),
                           (unsigned long long)want, (unsigned long long)s->slot_bytes, s->min_slots,
                           (unsigned long long)s->min_slots * s->slot_bytes,
                           (double)s->min_slots * (double)s->slot_bytes / 1073741824.0);
        goto fail;
    }
    s->nslots = want > s->nmeta ? s->nmeta : (uint32_t)want;
    shoal_cachepol_opts po = {.kind = o->policy, .nslots = s->nslots, .nkeys = (uint32_t)nkeys};
    if (po.kind == SHOAL_CACHEPOL_OPT) {
        rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "the opt policy needs the future: replay only");
        goto fail;
    }
    if ((rc = shoal_cachepol_open(&s->pol, &po, err, errlen)))
        goto fail;
    /* files: a buffered descriptor always, an O_DIRECT one where it works */
    s->nfiles = shoal_st_nfiles(st);
    s->files = shoal_xcalloc((size_t)s->nfiles, sizeof *s->files);
    for (int i = 0; i < s->nfiles; i++)
        s->files[i].fd_direct = s->files[i].fd_plain = -1;
    uint8_t *probe = aligned_alloc(ALIGN, ALIGN);
    if (!probe)
        SHOAL_PANIC("out of memory");
    s->st.direct = 1;
    for (int i = 0; i < s->nfiles; i++) {
        sfile *f = &s->files[i];
        snprintf(f->path, sizeof f->path, "%s", shoal_st_file_path(st, i));
        f->fd_plain = open(f->path, O_RDONLY | O_CLOEXEC);
        if (f->fd_plain < 0) {
            rc = shoal_err_set(err, errlen, -errno, "cannot open %s: %s", f->path, strerror(errno));
            free(probe);
            goto fail;
        }
        f->fd_direct = o->no_direct ? -1 : open_direct(f->path, probe);
        if (f->fd_direct < 0)
            s->st.direct = 0;
    }
    free(probe);
    if (s->slot_bytes > UINT64_MAX / s->nslots) {
        rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "expert cache size overflows");
        goto fail;
    }
    s->mem = aligned_alloc(ALIGN, (size_t)(s->nslots * s->slot_bytes));
    if (!s->mem) {
        rc = shoal_err_set(err, errlen, SHOAL_ENOMEM, "cannot allocate the %llu-byte expert cache",
                           (unsigned long long)(s->nslots * s->slot_bytes));
        goto fail;
    }
    s->pinned = shoal_xcalloc(s->nslots, 1);
    s->pass_slot = shoal_xmalloc(s->nslots * sizeof *s->pass_slot);
    s->pass_key = shoal_xmalloc(s->nslots * sizeof *s->pass_key);
    s->pass_miss = shoal_xmalloc(s->nslots);
    s->block = shoal_xcalloc(s->nslots, 1);
    s->skey = shoal_xmalloc(s->nslots * sizeof *s->skey);
    for (uint32_t i = 0; i < s->nslots; i++)
        s->skey[i] = -1;
    s->pf = shoal_xcalloc(s->nslots, 1);
    s->busy = shoal_xcalloc(s->nslots, sizeof *s->busy);
    s->slot_err = shoal_xcalloc(s->nslots, sizeof *s->slot_err);
    s->views = shoal_xcalloc(s->nslots, sizeof *s->views);
    s->demand.cap = s->ahead.cap = s->nslots * NT;
    s->demand.j = shoal_xmalloc((size_t)s->demand.cap * sizeof *s->demand.j);
    s->ahead.j = shoal_xmalloc((size_t)s->ahead.cap * sizeof *s->ahead.j);
    s->nth = o->io_threads > 0 ? o->io_threads : 8;
    s->th = shoal_xcalloc((size_t)s->nth, sizeof *s->th);
    for (int i = 0; i < s->nth; i++)
        if (pthread_create(&s->th[i], NULL, io_main, s)) {
            s->nth = i;
            rc = shoal_err_set(err, errlen, SHOAL_ENOMEM, "cannot start the expert store's I/O threads");
            goto fail;
        }
    s->st.slots = s->nslots;
    s->st.min_slots = s->min_slots;
    s->st.slot_bytes = s->slot_bytes;
    s->st.expert_bytes = s->expert_bytes;
    s->st.owned = s->nmeta;
    *out = s;
    return 0;
fail:
    shoal_store_close(s);
    return rc;
}

static void drain_all(shoal_store *s);

void shoal_store_close(shoal_store *s)
{
    if (!s)
        return;
    if (s->busy)
        drain_all(s); /* no I/O thread writes into the slots after this */
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    pthread_cond_broadcast(&s->work);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->nth; i++)
        pthread_join(s->th[i], NULL);
    for (int i = 0; i < s->nfiles; i++) {
        if (s->files[i].fd_direct >= 0)
            close(s->files[i].fd_direct);
        if (s->files[i].fd_plain >= 0)
            close(s->files[i].fd_plain);
    }
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->work);
    pthread_cond_destroy(&s->done);
    shoal_cachepol_close(s->pol);
    free(s->th);
    free(s->demand.j);
    free(s->ahead.j);
    free(s->views);
    free(s->pass_miss);
    free(s->block);
    free(s->skey);
    free(s->pf);
    free(s->busy);
    free(s->slot_err);
    free(s->pass_key);
    free(s->pass_slot);
    free(s->pinned);
    free(s->mem);
    free(s->files);
    free(s->meta);
    free(s->meta_of);
    free(s);
}

/* ---- fetch ---------------------------------------------------------------- */

static void view_of(const shoal_store *s, const emeta *m, const uint8_t *slot, shoal_expert_w *w)
{
    w->kind = m->kind;
    w->d = s->d;
    w->f = s->f;
    if (m->nt == 6) {
        w->w1 = slot + m->tpos[0], w->w1_scale = slot + m->tpos[1];
        w->w3 = slot + m->tpos[2], w->w3_scale = slot + m->tpos[3];
        w->w2 = slot + m->tpos[4], w->w2_scale = slot + m->tpos[5];
    } else {
        w->w1 = slot + m->tpos[0], w->w3 = slot + m->tpos[1], w->w2 = slot + m->tpos[2];
        w->w1_scale = w->w3_scale = w->w2_scale = NULL;
    }
}

/* The missed experts of a pass whose read failed hold garbage: forget them. */
static void drop_misses(shoal_store *s)
{
    if (s->pass_failed)
        return;
    for (int i = 0; i < s->npass; i++)
        if (s->pass_miss[i])
            shoal_cachepol_drop(s->pol, (uint32_t)s->pass_key[i]);
    s->pass_failed = 1;
}

/* Wait until no demand read is in flight. Prefetch reads may go on: their
 * slots are busy, so nothing else is placed in them. */
static void drain_demand(shoal_store *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->demand_left)
        pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Wait until some slot that is not in this pass (pinned) has no read in
 * flight; returns the microseconds waited. */
static uint64_t wait_any_idle(shoal_store *s)
{
    uint64_t t0 = now_us();
    pthread_mutex_lock(&s->mu);
    for (;;) {
        int idle = 0;
        for (uint32_t i = 0; i < s->nslots && !idle; i++)
            idle = !s->pinned[i] && !s->busy[i];
        if (idle)
            break;
        pthread_cond_wait(&s->done, &s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return now_us() - t0;
}

static void drain_all(shoal_store *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->demand_left || s->ahead_left)
        pthread_cond_wait(&s->done, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Forget the experts of slots whose read failed and that no read still
 * fills (their bytes are garbage), and mark in block[] the slots still being
 * filled. Handler thread. */
static void sweep(shoal_store *s)
{
    pthread_mutex_lock(&s->mu);
    for (uint32_t i = 0; i < s->nslots; i++) {
        s->block[i] = s->busy[i] > 0;
        if (s->slot_err[i] && !s->busy[i]) {
            s->slot_err[i] = 0;
            if (s->skey[i] >= 0 && shoal_cachepol_lookup(s->pol, (uint32_t)s->skey[i]) == (int)i)
                shoal_cachepol_drop(s->pol, (uint32_t)s->skey[i]);
            s->pf[i] = 0;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

/* Queue the reads that fill slot with expert m (mu not held; the caller
 * broadcasts once). */
static uint64_t queue_fill(shoal_store *s, ring *q, const emeta *m, int slot, int demand)
{
    uint8_t *base = s->mem + (size_t)slot * s->slot_bytes;
    uint64_t bytes = 0;
    pthread_mutex_lock(&s->mu);
    for (int r = 0; r < m->nruns; r++) {
        ring_put(q, (job){.r = &m->runs[r], .dst = base + m->runs[r].pos, .slot = slot});
        s->busy[slot]++;
        bytes += m->runs[r].len;
    }
    if (demand)
        s->demand_left += (uint32_t)m->nruns;
    else
        s->ahead_left += (uint32_t)m->nruns;
    pthread_mutex_unlock(&s->mu);
    return bytes;
}

static void wake_io(shoal_store *s)
{
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->work);
    pthread_mutex_unlock(&s->mu);
}

int shoal_store_fetch(shoal_store *s, int layer, const int32_t *experts, int n, const shoal_expert_w **views,
                      char *err, size_t errlen)
{
    drain_demand(s);
    for (int i = 0; i < s->npass; i++)
        s->pinned[s->pass_slot[i]] = 0;
    s->npass = 0;
    s->pass_failed = 0;
    if (n < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "store fetch of no expert");
    /* all checked before any bookkeeping: a slot handed out must be filled */
    for (int i = 0; i < n; i++) {
        if (layer < 0 || layer >= s->num_layers || experts[i] < 0 || experts[i] >= s->num_experts)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "layer %d expert %d out of range", layer, experts[i]);
        if (s->meta_of[(size_t)layer * (size_t)s->num_experts + (size_t)experts[i]] < 0)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "layer %d expert %d is not owned", layer, experts[i]);
    }
    sweep(s); /* block[]: slots a prefetch read still fills */
    int m = n < (int)s->nslots ? n : (int)s->nslots;
    /* the pass's experts that are resident and were prefetched are kept from
     * being victims of the pass's own misses (without prefetching, pf is all
     * zero and this changes nothing) */
    for (int i = 0; i < m; i++) {
        int sl = shoal_cachepol_lookup(s->pol, (uint32_t)layer * (uint32_t)s->num_experts + (uint32_t)experts[i]);
        if (sl >= 0 && s->pf[sl])
            s->block[sl] = 1;
    }
    int issued = 0;
    uint64_t waited = 0;
    uint64_t hits0 = s->st.hits, misses0 = s->st.misses, bytes0 = s->st.bytes_read;
    uint64_t ph0 = s->st.prefetch_hits, pw0 = s->st.prefetch_wasted;
    for (int i = 0; i < m; i++) {
        uint32_t key = (uint32_t)layer * (uint32_t)s->num_experts + (uint32_t)experts[i];
        int32_t mi = s->meta_of[key];
        int hit;
        int64_t ev;
        int slot = shoal_cachepol_access(s->pol, key, s->block, &hit, &ev);
        if (slot < 0 && s->npass == 0) {
            /* every slot is being filled by prefetch reads: wait for the first
             * to land (the time counts as waiting for reads) */
            uint64_t w = wait_any_idle(s);
            s->st.read_us += w;
            waited += w;
            sweep(s);
            slot = shoal_cachepol_access(s->pol, key, s->block, &hit, &ev);
        }
        if (slot < 0)
            break; /* every slot pinned by this pass or still being filled */
        int entry = s->npass++;
        s->pinned[slot] = 1;
        s->block[slot] = 1;
        s->pass_slot[entry] = slot;
        s->pass_key[entry] = (int32_t)key;
        s->pass_miss[entry] = !hit;
        s->skey[slot] = (int32_t)key;
        const emeta *me = &s->meta[mi];
        if (hit && s->pf[slot]) {
            s->st.prefetch_hits++;
            s->pf[slot] = 0;
        } else if (hit) {
            s->st.hits++;
        } else {
            if (s->pf[slot])
                s->st.prefetch_wasted++; /* evicted a prefetched expert before its use */
            s->pf[slot] = 0;
            s->st.misses++;
            s->st.bytes_read += queue_fill(s, &s->demand, me, slot, 1);
            issued = 1;
        }
        view_of(s, me, s->mem + (size_t)slot * s->slot_bytes, &s->views[entry]);
        views[entry] = &s->views[entry];
    }
    if (issued) /* every read of the pass queued at once, in entry order */
        wake_io(s);
    shoal_wmetrics_cache(s->wm, s->st.hits - hits0, s->st.misses - misses0, s->st.bytes_read - bytes0, waited);
    if (s->st.prefetch_hits != ph0 || s->st.prefetch_wasted != pw0)
        shoal_wmetrics_prefetch(s->wm, 0, 0, s->st.prefetch_hits - ph0, s->st.prefetch_wasted - pw0);
    return s->npass;
}

int shoal_store_prefetch(shoal_store *s, int layer, const int32_t *experts, int n)
{
    if (layer < 0 || layer >= s->num_layers || n < 1)
        return 0;
    /* the last pass is finished (its views are not used any more): only
     * slots still being filled are kept */
    drain_demand(s);
    for (int i = 0; i < s->npass; i++)
        s->pinned[s->pass_slot[i]] = 0;
    s->npass = 0;
    sweep(s);
    /* the hint's own resident experts are not victims of its reads */
    for (int i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= s->num_experts)
            continue;
        int sl = shoal_cachepol_lookup(s->pol, (uint32_t)layer * (uint32_t)s->num_experts + (uint32_t)experts[i]);
        if (sl >= 0)
            s->block[sl] = 1;
    }
    int started = 0;
    uint64_t wasted0 = s->st.prefetch_wasted, bytes = 0;
    for (int i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= s->num_experts)
            continue;
        uint32_t key = (uint32_t)layer * (uint32_t)s->num_experts + (uint32_t)experts[i];
        int32_t mi = s->meta_of[key];
        if (mi < 0 || shoal_cachepol_lookup(s->pol, key) >= 0)
            continue; /* not owned, or resident already */
        int64_t ev;
        int slot = shoal_cachepol_insert(s->pol, key, s->block, &ev);
        if (slot < 0)
            break; /* every slot holds a hinted expert or is being filled */
        if (ev >= 0 && s->pf[slot])
            s->st.prefetch_wasted++;
        s->block[slot] = 1;
        s->pf[slot] = 1;
        s->skey[slot] = (int32_t)key;
        bytes += queue_fill(s, &s->ahead, &s->meta[mi], slot, 0);
        started++;
    }
    if (started)
        wake_io(s);
    s->st.prefetch_reads += (uint64_t)started;
    s->st.prefetch_bytes += bytes;
    shoal_wmetrics_prefetch(s->wm, (uint64_t)started, bytes, 0, s->st.prefetch_wasted - wasted0);
    return started;
}

void shoal_store_drain(shoal_store *s)
{
    drain_all(s);
}

int shoal_store_wait(shoal_store *s, int i, char *err, size_t errlen)
{
    if (i < 0 || i >= s->npass)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "store wait: entry %d of a %d-expert pass", i, s->npass);
    int slot = s->pass_slot[i];
    uint64_t waited = 0;
    char msg[512] = "";
    pthread_mutex_lock(&s->mu);
    if (s->busy[slot] > 0) {
        uint64_t t0 = now_us();
        while (s->busy[slot] > 0)
            pthread_cond_wait(&s->done, &s->mu);
        waited = now_us() - t0;
    }
    int failed = s->slot_err[slot];
    if (failed)
        snprintf(msg, sizeof msg, "%s", s->io_msg);
    pthread_mutex_unlock(&s->mu);
    if (waited) {
        s->st.read_us += waited;
        shoal_wmetrics_cache(s->wm, 0, 0, 0, waited);
    }
    if (failed && !s->pass_miss[i]) /* a prefetched expert whose read failed */
        shoal_cachepol_drop(s->pol, (uint32_t)s->pass_key[i]);
    if (failed || s->pass_failed) {
        drain_demand(s); /* nothing of the pass may still be writing into the slots */
        drop_misses(s);
        char m4[401];
        return shoal_err_set(err, errlen, failed ? failed : SHOAL_EIO, "expert store: %s",
                             msg[0] ? shoal_utf8_clip(m4, sizeof m4, msg, 0) : "a read of this pass failed");
    }
    return 0;
}

/* ---- accessors ------------------------------------------------------------ */

void shoal_store_set_metrics(shoal_store *s, shoal_wmetrics *wm)
{
    s->wm = wm;
}

int shoal_store_owns(const shoal_store *s, int layer, int expert)
{
    if (layer < 0 || layer >= s->num_layers || expert < 0 || expert >= s->num_experts)
        return 0;
    return s->meta_of[(size_t)layer * (size_t)s->num_experts + (size_t)expert] >= 0;
}
int shoal_store_d(const shoal_store *s)
{
    return s->d;
}
int shoal_store_f(const shoal_store *s)
{
    return s->f;
}
float shoal_store_b1(const shoal_store *s)
{
    return s->b1;
}
float shoal_store_b2(const shoal_store *s)
{
    return s->b2;
}
uint64_t shoal_store_bytes(const shoal_store *s)
{
    return s->bytes;
}
void shoal_store_stats_get(const shoal_store *s, shoal_store_stats *out)
{
    *out = s->st;
}
