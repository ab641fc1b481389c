/* trace: routing trace writer, reader, statistics and plans (the command,
 * `shoal trace`, is coordinator/cmd/trace_cmd.c). Format and plan.json:
 * docs/METRICS.md ("Routing traces"). */
#include "coordinator/obs/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/planfile.h"
#include "proto/proto.h"
#include "proto/shard.h"

#define WBUF_BYTES (1u << 20)

static void put16(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    put16(p, v);
    put16(p + 2, v >> 16);
}
static uint32_t get16(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8;
}
static uint32_t get32(const uint8_t *p)
{
    return get16(p) | get16(p + 2) << 16;
}

/* ---- writer ------------------------------------------------------------- */

struct shoal_trace {
    int fd;
    char *path;
    shoal_trace_hdr h;
    size_t rbytes;
    uint8_t *buf;
    size_t len;
    uint64_t count;
    uint64_t token_base;  /* ordinal of the current chunk's first token */
    int last_layer, last_T; /* previous record call; -1 before the first */
    int err;              /* sticky: 0, -errno, or SHOAL_EINVAL */
    char errmsg[256];
};

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int check_hdr(const shoal_trace_hdr *h, char *err, size_t errlen)
{
    if (h->num_layers < 1 || h->num_layers > 65535)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trace: num_layers %u outside 1..65535", h->num_layers);
    if (h->num_experts < 1 || h->num_experts > 65535)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trace: num_experts %u outside 1..65535", h->num_experts);
    if (h->k < 1 || h->k > SHOAL_TRACE_MAX_K || h->k > h->num_experts)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "trace: k %u outside 1..min(%d, num_experts %u)", h->k,
                             SHOAL_TRACE_MAX_K, h->num_experts);
    return 0;
}

int shoal_trace_create(shoal_trace **out, const char *path, const shoal_trace_hdr *h, char *err, size_t errlen)
{
    *out = NULL;
    int rc = check_hdr(h, err, errlen);
    if (rc)
        return rc;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "trace: %s: %s", path, strerror(errno));
    uint8_t hdr[SHOAL_TRACE_HDR_BYTES] = {0};
    memcpy(hdr, SHOAL_TRACE_MAGIC, 8);
    put16(hdr + 8, SHOAL_TRACE_MAJOR);
    put16(hdr + 10, SHOAL_TRACE_MINOR);
    put32(hdr + 12, SHOAL_TRACE_HDR_BYTES);
    put32(hdr + 16, h->num_layers);
    put32(hdr + 20, h->num_experts);
    put32(hdr + 24, h->k);
    put32(hdr + 28, (uint32_t)shoal_trace_record_bytes(h->k));
    memcpy(hdr + 32, h->fingerprint, 32);
    if ((rc = write_all(fd, hdr, sizeof hdr))) {
        close(fd);
        return shoal_err_set(err, errlen, rc, "trace: %s: %s", path, strerror(-rc));
    }
    shoal_trace *t = shoal_xcalloc(1, sizeof *t);
    t->fd = fd;
    t->path = shoal_xstrdup(path);
    t->h = *h;
    t->rbytes = shoal_trace_record_bytes(h->k);
    t->buf = shoal_xmalloc(WBUF_BYTES);
    t->last_layer = -1;
    *out = t;
    return 0;
}

static void fail(shoal_trace *t, int code, const char *what)
{
    if (t->err)
        return;
    t->err = code;
    snprintf(t->errmsg, sizeof t->errmsg, "%s", what);
}

static void flush_buf(shoal_trace *t)
{
    if (t->len && !t->err) {
        int rc = write_all(t->fd, t->buf, t->len);
        if (rc)
            fail(t, rc, strerror(-rc));
    }
    t->len = 0;
}

void shoal_trace_record(shoal_trace *t, int layer, int T, int k, const int32_t *ids)
{
    if (!t || t->err)
        return;
    if (layer < 0 || (uint32_t)layer >= t->h.num_layers || k != (int)t->h.k || T < 0) {
        fail(t, SHOAL_EINVAL, "record with a layer, k or T outside the header's range");
        return;
    }
    if (t->last_layer >= 0 && layer <= t->last_layer)
        t->token_base += (uint64_t)t->last_T;
    t->last_layer = layer;
    t->last_T = T;
    for (int i = 0; i < T; i++) {
        if (t->len + t->rbytes > WBUF_BYTES)
            flush_buf(t);
        uint64_t tok = t->token_base + (uint64_t)i;
        if (tok > UINT32_MAX) {
            fail(t, SHOAL_ERANGE, "more than 2^32 tokens in one trace");
            return;
        }
        uint8_t *r = t->buf + t->len;
        put32(r, (uint32_t)tok);
        put16(r + 4, (uint32_t)layer);
        put16(r + 6, (uint32_t)k);
        for (int j = 0; j < k; j++) {
            int32_t e = ids[(size_t)i * k + j];
            if (e < 0 || (uint32_t)e >= t->h.num_experts) {
                fail(t, SHOAL_EINVAL, "record with an expert id outside the header's range");
                return;
            }
            put16(r + 8 + 2 * j, (uint32_t)e);
        }
        t->len += t->rbytes;
        t->count++;
    }
}

uint64_t shoal_trace_count(const shoal_trace *t)
{
    return t ? t->count : 0;
}

int shoal_trace_close(shoal_trace *t, char *err, size_t errlen)
{
    if (!t)
        return 0;
    flush_buf(t);
    if (close(t->fd) && !t->err)
        fail(t, -errno, strerror(errno));
    int rc = t->err;
    if (rc)
        shoal_err_set(err, errlen, rc, "trace: %s: %s", t->path, t->errmsg);
    free(t->buf);
    free(t->path);
    free(t);
    return rc;
}

/* ---- reader ------------------------------------------------------------- */

struct shoal_trace_file {
    const uint8_t *map;
    size_t size;
    shoal_trace_hdr h;
    size_t hbytes, rbytes;
    uint64_t count, trailing;
};

static int validate_records(const shoal_trace_file *f, const char *path, char *err, size_t errlen)
{
    for (uint64_t i = 0; i < f->count; i++) {
        const uint8_t *r = f->map + f->hbytes + i * f->rbytes;
        uint32_t layer = get16(r + 4), n = get16(r + 6);
        if (layer >= f->h.num_layers)
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: record %llu: layer %u >= num_layers %u", path,
                                 (unsigned long long)i, layer, f->h.num_layers);
        if (n > f->h.k)
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: record %llu: %u experts > k %u", path,
                                 (unsigned long long)i, n, f->h.k);
        for (uint32_t j = 0; j < f->h.k; j++) {
            uint32_t e = get16(r + 8 + 2 * j);
            if (j >= n) {
                if (e != SHOAL_TRACE_NO_EXPERT)
                    return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                         "trace %s: record %llu: unused slot %u is %u, not 65535", path,
                                         (unsigned long long)i, j, e);
                continue;
            }
            if (e >= f->h.num_experts)
                return shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: record %llu: expert %u >= num_experts %u",
                                     path, (unsigned long long)i, e, f->h.num_experts);
            if (j && e <= get16(r + 8 + 2 * (j - 1)))
                return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                     "trace %s: record %llu: experts not strictly ascending at slot %u", path,
                                     (unsigned long long)i, j);
        }
    }
    return 0;
}

int shoal_trace_open(shoal_trace_file **out, const char *path, char *err, size_t errlen)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "trace %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return shoal_err_set(err, errlen, -e, "trace %s: %s", path, strerror(e));
    }
    size_t size = (size_t)st.st_size;
    if (size < SHOAL_TRACE_HDR_BYTES) {
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: %zu bytes, shorter than the %d-byte header", path,
                             size, SHOAL_TRACE_HDR_BYTES);
    }
    const uint8_t *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return shoal_err_set(err, errlen, -e, "trace %s: mmap: %s", path, strerror(e));
    shoal_trace_file *f = shoal_xcalloc(1, sizeof *f);
    f->map = map;
    f->size = size;
    int rc = 0;
    if (memcmp(map, SHOAL_TRACE_MAGIC, 8)) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: bad magic (not a shoal routing trace)", path);
        goto out;
    }
    uint32_t major = get16(map + 8), minor = get16(map + 10);
    if (major != SHOAL_TRACE_MAJOR) {
        rc = shoal_err_set(err, errlen, SHOAL_EVERSION, "trace %s: format version %u.%u, this build reads %d.x", path,
                           major, minor, SHOAL_TRACE_MAJOR);
        goto out;
    }
    f->hbytes = get32(map + 12);
    f->h.num_layers = get32(map + 16);
    f->h.num_experts = get32(map + 20);
    f->h.k = get32(map + 24);
    f->rbytes = get32(map + 28);
    memcpy(f->h.fingerprint, map + 32, 32);
    char why[200];
    if (check_hdr(&f->h, why, sizeof why)) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: header: %s", path, why);
        goto out;
    }
    if (f->hbytes < SHOAL_TRACE_HDR_BYTES || f->hbytes > size) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: header bytes %zu outside %d..file size %zu", path,
                           f->hbytes, SHOAL_TRACE_HDR_BYTES, size);
        goto out;
    }
    /* a minor version may grow records at the end; never shrink them */
    if (f->rbytes < shoal_trace_record_bytes(f->h.k) || f->rbytes > 65536) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "trace %s: record bytes %zu, need %zu..65536 for k %u", path,
                           f->rbytes, shoal_trace_record_bytes(f->h.k), f->h.k);
        goto out;
    }
    f->count = (size - f->hbytes) / f->rbytes;
    f->trailing = (size - f->hbytes) % f->rbytes;
    rc = validate_records(f, path, err, errlen);
out:
    if (rc) {
        shoal_trace_file_close(f);
        return rc;
    }
    *out = f;
    return 0;
}

void shoal_trace_file_close(shoal_trace_file *f)
{
    if (!f)
        return;
    munmap((void *)f->map, f->size);
    free(f);
}

const shoal_trace_hdr *shoal_trace_file_hdr(const shoal_trace_file *f)
{
    return &f->h;
}
uint64_t shoal_trace_file_count(const shoal_trace_file *f)
{
    return f->count;
}
uint64_t shoal_trace_file_trailing(const shoal_trace_file *f)
{
    return f->trailing;
}

void shoal_trace_file_get(const shoal_trace_file *f, uint64_t i, shoal_trace_rec *out)
{
    const uint8_t *r = f->map + f->hbytes + i * f->rbytes;
    out->token = get32(r);
    out->layer = get16(r + 4);
    out->n = get16(r + 6);
    for (uint32_t j = 0; j < out->n; j++)
        out->experts[j] = (uint16_t)get16(r + 8 + 2 * j);
}

/* ---- statistics --------------------------------------------------------- */

void shoal_trace_stats_compute(const shoal_trace_file *f, shoal_trace_stats *s)
{
    memset(s, 0, sizeof *s);
    s->num_layers = f->h.num_layers;
    s->num_experts = f->h.num_experts;
    s->k = f->h.k;
    s->hits = shoal_xcalloc((size_t)s->num_layers * s->num_experts, sizeof *s->hits);
    s->layer_pairs = shoal_xcalloc(s->num_layers, sizeof *s->layer_pairs);
    s->layer_records = shoal_xcalloc(s->num_layers, sizeof *s->layer_records);
    uint32_t lo = UINT32_MAX, hi = 0;
    shoal_trace_rec r;
    for (uint64_t i = 0; i < f->count; i++) {
        shoal_trace_file_get(f, i, &r);
        if (r.token < lo)
            lo = r.token;
        if (r.token > hi)
            hi = r.token;
        s->records++;
        s->layer_records[r.layer]++;
        s->layer_pairs[r.layer] += r.n;
        s->pairs += r.n;
        for (uint32_t j = 0; j < r.n; j++)
            s->hits[(size_t)r.layer * s->num_experts + r.experts[j]]++;
    }
    s->tokens = f->count ? (uint64_t)hi - lo + 1 : 0;
}

void shoal_trace_stats_free(shoal_trace_stats *s)
{
    free(s->hits);
    free(s->layer_pairs);
    free(s->layer_records);
    memset(s, 0, sizeof *s);
}

static int cmp_u64_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

int shoal_trace_layer_conc(const shoal_trace_stats *s, uint32_t l, shoal_trace_conc *out)
{
    if (l >= s->num_layers || s->layer_pairs[l] == 0)
        return 0;
    uint32_t E = s->num_experts;
    const uint64_t *h = s->hits + (size_t)l * E;
    double P = (double)s->layer_pairs[l], mean = P / E;
    uint64_t *sorted = shoal_xmalloc(sizeof *sorted * E);
    memcpy(sorted, h, sizeof *sorted * E);
    qsort(sorted, E, sizeof *sorted, cmp_u64_desc);
    uint32_t top = (E + 9) / 10;
    double topsum = 0, H = 0;
    for (uint32_t i = 0; i < top; i++)
        topsum += (double)sorted[i];
    out->cold = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (!h[e]) {
            out->cold++;
            continue;
        }
        double p = (double)h[e] / P;
        H -= p * log(p);
    }
    out->max_over_mean = (double)sorted[0] / mean;
    out->top10_share = topsum / P;
    out->entropy = E > 1 ? H / log((double)E) : 1.0;
    free(sorted);
    return 1;
}

/* ---- plans -------------------------------------------------------------- */

_Static_assert(SHOAL_TRACE_MAX_NAME >= SHOAL_PLANFILE_MAX_NAME, "plan worker names must fit");

int shoal_trace_plan_read(shoal_trace_plan *p, const char *path, uint32_t num_layers, uint32_t num_experts,
                          char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    shoal_planfile pf;
    int rc = shoal_planfile_read(&pf, path, err, errlen); /* format, version, workers, names */
    if (rc)
        return rc;
    p->nworkers = pf.nworkers;
    p->num_layers = num_layers;
    p->num_experts = num_experts;
    size_t cells = (size_t)num_layers * num_experts;
    p->names = shoal_xcalloc((size_t)p->nworkers, sizeof *p->names);
    p->own = shoal_xcalloc((size_t)p->nworkers * cells, 1);
    for (int w = 0; w < p->nworkers && !rc; w++) {
        const char *nm = pf.workers[w].name;
        snprintf(p->names[w], sizeof p->names[w], "%s", nm);
        shoal_proto_range *r = NULL;
        size_t nr = 0;
        char why[256];
        if (shoal_shard_parse(pf.workers[w].experts, &r, &nr, why, sizeof why)) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: workers[%d] (%s).experts: %s", path, w, nm, why);
            break;
        }
        for (size_t i = 0; i < nr; i++) {
            if (r[i].l_hi >= num_layers || r[i].e_hi >= num_experts) {
                rc = shoal_err_set(err, errlen, SHOAL_ERANGE,
                                   "plan %s: workers[%d] (%s).experts: range %u-%u:%u-%u outside the model's %u layers "
                                   "x %u experts",
                                   path, w, nm, r[i].l_lo, r[i].l_hi, r[i].e_lo, r[i].e_hi, num_layers, num_experts);
                break;
            }
            for (uint32_t l = r[i].l_lo; l <= r[i].l_hi; l++)
                memset(p->own + (size_t)w * cells + (size_t)l * num_experts + r[i].e_lo, 1, r[i].e_hi - r[i].e_lo + 1);
        }
        free(r);
    }
    shoal_planfile_free(&pf);
    if (rc)
        shoal_trace_plan_free(p);
    return rc;
}

void shoal_trace_plan_free(shoal_trace_plan *p)
{
    free(p->names);
    free(p->own);
    memset(p, 0, sizeof *p);
}

int shoal_trace_plan_load(const shoal_trace_plan *p, const shoal_trace_stats *s, shoal_trace_load *out, char *err,
                          size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (p->num_layers != s->num_layers || p->num_experts != s->num_experts)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan read for %u x %u experts, trace has %u x %u",
                             p->num_layers, p->num_experts, s->num_layers, s->num_experts);
    int W = p->nworkers;
    uint32_t L = s->num_layers, E = s->num_experts;
    size_t cells = (size_t)L * E;
    out->load = shoal_xcalloc((size_t)W * L, sizeof *out->load);
    out->share = shoal_xcalloc((size_t)W, sizeof *out->share);
    out->fair = shoal_xcalloc((size_t)W, sizeof *out->fair);
    out->owned = shoal_xcalloc((size_t)W, sizeof *out->owned);
    out->layer_imb = shoal_xcalloc(L, sizeof *out->layer_imb);
    for (int w = 0; w < W; w++) {
        out->fair[w] = 1.0 / W;
        for (size_t c = 0; c < cells; c++)
            out->owned[w] += p->own[(size_t)w * cells + c];
    }
    double total = 0, sum_max = 0, sum_mean = 0;
    for (uint32_t l = 0; l < L; l++) {
        for (uint32_t e = 0; e < E; e++) {
            uint64_t h = s->hits[(size_t)l * E + e];
            if (!h)
                continue;
            int owners = 0;
            for (int w = 0; w < W; w++)
                owners += p->own[(size_t)w * cells + (size_t)l * E + e];
            if (!owners) {
                int rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                                       "plan: layer %u expert %u is routed to %llu times in the trace but owned by no "
                                       "worker",
                                       l, e, (unsigned long long)h);
                shoal_trace_load_free(out);
                return rc;
            }
            for (int w = 0; w < W; w++)
                if (p->own[(size_t)w * cells + (size_t)l * E + e])
                    out->load[(size_t)w * L + l] += (double)h / owners;
        }
        double mx = 0, sum = 0;
        for (int w = 0; w < W; w++) {
            double v = out->load[(size_t)w * L + l];
            sum += v;
            if (v > mx)
                mx = v;
        }
        if (sum > 0) {
            out->layer_imb[l] = mx / (sum / W);
            sum_max += mx;
            sum_mean += sum / W;
        }
        total += sum;
    }
    double mx = 0;
    for (int w = 0; w < W; w++) {
        double v = 0;
        for (uint32_t l = 0; l < L; l++)
            v += out->load[(size_t)w * L + l];
        out->share[w] = total > 0 ? v / total : 0;
        if (out->share[w] > mx)
            mx = out->share[w];
    }
    out->imbalance = total > 0 ? mx * W : 0;
    out->layer_weighted = sum_mean > 0 ? sum_max / sum_mean : 0;
    return 0;
}

void shoal_trace_load_free(shoal_trace_load *l)
{
    free(l->load);
    free(l->share);
    free(l->fair);
    free(l->owned);
    free(l->layer_imb);
    memset(l, 0, sizeof *l);
}
