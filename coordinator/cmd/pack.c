/* `shoal pack`: write one worker's routed experts from a model directory into
 * a pack directory (docs/DEPLOY.md, "Packs"): one safetensors file per MoE
 * layer holding that worker's experts (each expert's tensors back to back, in
 * the schema order w1, w3, w2), the index, config.json, and the manifest
 * shoal-pack.json with every file's size and BLAKE2b-256 (common/packfile.h).
 *
 * Resumable: a layer file is written as NAME.part, hashed while written,
 * fsynced and renamed, then its checksum is stored beside it in NAME.blake2b.
 * A rerun keeps a file whose header is the one it would write and whose bytes
 * still hash to its NAME.blake2b, and rewrites anything else. The manifest is
 * written last, so a directory without it is an unfinished pack (the worker
 * refuses to serve it as a pack). */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/suggest.h"
#include "cli/commands.h"
#include "common/err.h"
#include "common/k3cfg.h"
#include "common/k3schema.h"
#include "common/packfile.h"
#include "common/planfile.h"
#include "common/st.h"
#include "coordinator/cmd/pack.h"
#include "proto/fprint.h"
#include "proto/shard.h"
#include "proto/tshard.h"

#define CHUNK (8u << 20)

typedef struct {
    int *fds; /* per source file, opened lazily */
    int nfds;
    unsigned char *buf;
    uint64_t total, done, skipped;
    double t0, last;
    int quiet;
} packer;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void fmt_dur(double s, char *out, size_t n)
{
    if (s < 0 || s > 1e7)
        snprintf(out, n, "?");
    else if (s >= 3600)
        snprintf(out, n, "%dh%02dm", (int)(s / 3600), (int)(s / 60) % 60);
    else if (s >= 60)
        snprintf(out, n, "%dm%02ds", (int)(s / 60), (int)s % 60);
    else
        snprintf(out, n, "%.0fs", s);
}

/* One line on stderr at most every second (and once at the end): bytes, rate
 * of the bytes copied in this run, ETA. */
static void progress(packer *p, int final)
{
    double t = now_s();
    if (p->quiet || (!final && t - p->last < 1.0))
        return;
    p->last = t;
    uint64_t have = p->done + p->skipped;
    double rate = t > p->t0 ? (double)p->done / (t - p->t0) : 0;
    char eta[32];
    fmt_dur(rate > 0 ? (double)(p->total - have) / rate : -1, eta, sizeof eta);
    fprintf(stderr, "pack: %.2f / %.2f GiB (%.1f%%), %.1f MiB/s, ETA %s%s\n", (double)have / 1073741824.0,
            (double)p->total / 1073741824.0, p->total ? 100.0 * (double)have / (double)p->total : 100.0,
            rate / 1048576.0, final ? "0s" : eta, p->skipped ? " (resumed: verified files kept)" : "");
}

int shoal_pack_write_all(int fd, const void *b, size_t n)
{
    const unsigned char *c = b;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

int shoal_pack_pread_all(int fd, void *b, size_t n, uint64_t off)
{
    unsigned char *c = b;
    while (n) {
        ssize_t r = pread(fd, c, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? -errno : SHOAL_EIO;
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* Write path atomically (tmp + rename). */
static int write_small(const char *path, const void *b, size_t n, char *err, size_t errlen)
{
    char tmp[4400];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "%s: %s", tmp, strerror(errno));
    int rc = shoal_pack_write_all(fd, b, n);
    if (!rc && fsync(fd))
        rc = -errno;
    close(fd);
    if (!rc && rename(tmp, path))
        rc = -errno;
    if (rc)
        return shoal_err_set(err, errlen, rc, "%s: %s", path, strerror(-rc));
    return 0;
}

static int read_small(const char *path, char *buf, size_t cap, size_t *n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    ssize_t r = read(fd, buf, cap);
    close(fd);
    if (r < 0)
        return -errno;
    *n = (size_t)r;
    return 0;
}

typedef struct {
    const shoal_tensor *t[SHOAL_K3SCHEMA_EXPERT_MAX * 4096];
    int n;
} tlist;

/* A slice of rows lo..hi of a 2-D tensor (trunk rows, issue 16); NULL for
 * whole tensors. */
typedef struct {
    uint32_t lo, hi;
} rowsel;

/* The pack tensor name of rows lo..hi of matrix name (PROTOCOL.md §7.1, the
 * manifest's trunk_rows[].tensor). */
static void slice_name(char *out, size_t n, const char *name, const rowsel *r)
{
    snprintf(out, n, "%s#rows=%u-%u", name, r->lo, r->hi);
}

/* Where tensor t (rows sel, or all) lies in its source file, and its size. */
static void item_geom(const shoal_tensor *t, const rowsel *sel, uint64_t *off, uint64_t *nb)
{
    if (!sel) {
        *off = t->file_offset;
        *nb = t->nbytes;
        return;
    }
    uint64_t row = (uint64_t)t->shape[1] * shoal_dtype_size(t->dtype);
    *off = t->file_offset + (uint64_t)sel->lo * row;
    *nb = (uint64_t)(sel->hi - sel->lo + 1) * row;
}

/* The safetensors header of a layer file: tensors in the given order, data
 * back to back; padded with spaces to a multiple of 8 bytes. sel: NULL, or
 * per tensor the rows stored (a [rows, cols] slice named by slice_name). */
static char *make_header(const shoal_tensor *const *t, const rowsel *sel, int n, size_t *hlen, uint64_t *data)
{
    json_t *h = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "format", json_string("pt"));
    json_object_set_new(meta, "shoal", json_string("pack 1"));
    json_object_set_new(h, "__metadata__", meta);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        json_t *o = json_object(), *sh = json_array(), *of = json_array();
        uint64_t src, nb;
        item_geom(t[i], sel ? &sel[i] : NULL, &src, &nb);
        json_object_set_new(o, "dtype", json_string(shoal_dtype_name(t[i]->dtype)));
        for (int d = 0; d < t[i]->ndim; d++)
            json_array_append_new(sh, json_integer(sel && d == 0 ? (json_int_t)(sel[i].hi - sel[i].lo + 1)
                                                                 : (json_int_t)t[i]->shape[d]));
        json_object_set_new(o, "shape", sh);
        json_array_append_new(of, json_integer((json_int_t)off));
        json_array_append_new(of, json_integer((json_int_t)(off + nb)));
        json_object_set_new(o, "data_offsets", of);
        char sn[SHOAL_PROTO_MAX_NAME + 64];
        if (sel)
            slice_name(sn, sizeof sn, t[i]->name, &sel[i]);
        json_object_set_new(h, sel ? sn : t[i]->name, o);
        off += nb;
    }
    char *s = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (!s)
        SHOAL_PANIC("json_dumps");
    size_t n0 = strlen(s), n8 = (n0 + 7) / 8 * 8;
    char *out = shoal_xmalloc(8 + n8);
    uint64_t le = n8;
    for (int i = 0; i < 8; i++)
        out[i] = (char)(le >> (8 * i));
    memcpy(out + 8, s, n0);
    memset(out + 8 + n0, ' ', n8 - n0);
    free(s);
    *hlen = 8 + n8;
    *data = off;
    return out;
}

int shoal_pack_layer_done(const char *path, const char *hdr, size_t hlen, uint64_t size, uint8_t *hash)
{
    char side[4400], hex[80];
    size_t n = 0;
    snprintf(side, sizeof side, "%s.blake2b", path);
    struct stat sb;
    if (stat(path, &sb) || (uint64_t)sb.st_size != size || read_small(side, hex, sizeof hex - 1, &n))
        return 0;
    hex[n] = 0;
    if (n && hex[n - 1] == '\n')
        hex[n - 1] = 0;
    uint8_t want[32], got[32];
    if (shoal_packfile_unhex(hex, want, 32))
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char *h = shoal_xmalloc(hlen);
    int same = shoal_pack_pread_all(fd, h, hlen, 0) == 0 && !memcmp(h, hdr, hlen);
    free(h);
    close(fd);
    if (!same || shoal_packfile_hash(path, got, NULL, NULL, 0) || memcmp(got, want, 32))
        return 0;
    memcpy(hash, got, 32);
    return 1;
}

int shoal_pack_write_sum(const char *path, const uint8_t hash[32], char *err, size_t errlen)
{
    char side[4400], hex[66];
    snprintf(side, sizeof side, "%s.blake2b", path);
    shoal_packfile_hex(hash, 32, hex);
    hex[64] = '\n';
    hex[65] = 0;
    return write_small(side, hex, 65, err, errlen);
}

int shoal_pack_write_small(const char *path, const void *b, size_t n, char *err, size_t errlen)
{
    return write_small(path, b, n, err, errlen);
}

/* `shoal pack`'s layer writer: copy the ranges from the model's files. */
static int write_layer(void *ctx, const char *path, const char *hdr, size_t hlen, uint64_t size,
                       const shoal_pack_src *s, int n, uint8_t *hash, char *err, size_t errlen)
{
    packer *p = ctx;
    if (shoal_pack_layer_done(path, hdr, hlen, size, hash)) {
        p->skipped += size - hlen;
        progress(p, 0);
        return 0;
    }
    char part[4400], side[4400];
    snprintf(part, sizeof part, "%s.part", path);
    snprintf(side, sizeof side, "%s.blake2b", path);
    unlink(side);
    int fd = open(part, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "%s: %s", part, strerror(errno));
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, 32);
    crypto_generichash_update(&hs, (const unsigned char *)hdr, hlen);
    int rc = shoal_pack_write_all(fd, hdr, hlen);
    for (int i = 0; i < n && !rc; i++) {
        int f = s[i].file;
        if (f >= p->nfds) {
            p->fds = shoal_xrealloc(p->fds, (size_t)(f + 1) * sizeof *p->fds);
            while (p->nfds <= f)
                p->fds[p->nfds++] = -1;
        }
        if (p->fds[f] < 0 && (p->fds[f] = open(s[i].path, O_RDONLY | O_CLOEXEC)) < 0) {
            rc = shoal_err_set(err, errlen, -errno, "%s: %s", s[i].path, strerror(errno));
            break;
        }
        for (uint64_t off = 0; off < s[i].nbytes && !rc;) {
            size_t k = s[i].nbytes - off < CHUNK ? (size_t)(s[i].nbytes - off) : CHUNK;
            if ((rc = shoal_pack_pread_all(p->fds[f], p->buf, k, s[i].off + off))) {
                rc = shoal_err_set(err, errlen, rc < 0 ? rc : SHOAL_EIO, "%s: reading %s failed", s[i].path,
                                   s[i].name);
                break;
            }
            crypto_generichash_update(&hs, p->buf, k);
            if ((rc = shoal_pack_write_all(fd, p->buf, k))) {
                rc = shoal_err_set(err, errlen, rc, "%s: %s", part, strerror(-rc));
                break;
            }
            off += k;
            p->done += k;
            progress(p, 0);
        }
    }
    if (!rc && fsync(fd))
        rc = shoal_err_set(err, errlen, -errno, "%s: fsync: %s", part, strerror(errno));
    close(fd);
    if (!rc && rename(part, path))
        rc = shoal_err_set(err, errlen, -errno, "%s: rename: %s", path, strerror(errno));
    if (rc)
        return rc;
    crypto_generichash_final(&hs, hash, 32);
    return shoal_pack_write_sum(path, hash, err, errlen);
}

/* The dry pass of `shoal pack`: the bytes to copy, for the progress line. */
static int count_layer(void *ctx, const char *path, const char *hdr, size_t hlen, uint64_t size,
                       const shoal_pack_src *s, int n, uint8_t *hash, char *err, size_t errlen)
{
    (void)path, (void)hdr, (void)s, (void)n, (void)err, (void)errlen;
    ((packer *)ctx)->total += size - hlen;
    memset(hash, 0, 32);
    return 0;
}

/* Build layer file path's header from tensors t (rows sel, or whole) and hand
 * it with its source ranges to j->layer. */
static int emit_layer(const shoal_pack_job *j, const shoal_st *st, const char *path, const shoal_tensor *const *t,
                      const rowsel *sel, int n, uint8_t *hash, uint64_t *bytes, char *err, size_t errlen)
{
    size_t hlen;
    uint64_t data;
    char *hdr = make_header(t, sel, n, &hlen, &data);
    *bytes = hlen + data;
    shoal_pack_src *s = shoal_xcalloc((size_t)n, sizeof *s);
    for (int i = 0; i < n; i++) {
        s[i].file = t[i]->file;
        s[i].path = shoal_st_file_path(st, t[i]->file);
        s[i].name = t[i]->name;
        item_geom(t[i], sel ? &sel[i] : NULL, &s[i].off, &s[i].nbytes);
    }
    int rc = j->layer(j->ctx, path, hdr, hlen, hlen + data, s, n, hash, err, errlen);
    free(s);
    free(hdr);
    return rc;
}

const char *const shoal_pack_tokfiles[SHOAL_PACK_NTOK] = {"tiktoken.model", "tokenizer_config.json",
                                                          "generation_config.json", "special_tokens_map.json"};

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal pack --model DIR --plan plan.json --worker NAME -o OUT [--quiet]\n"
               "       shoal pack --model DIR --trunk [--plan plan.json] -o OUT [--quiet]\n"
               "\n"
               "Write just worker NAME's routed experts (its RANGES in the plan) from the model in DIR\n"
               "into the directory OUT: one safetensors file per MoE layer, the index, config.json and\n"
               "the manifest shoal-pack.json with every file's size and BLAKE2b-256 (docs/DEPLOY.md).\n"
               "`shoal expert --model OUT` serves from the pack (--verify checks the checksums first).\n"
               "--trunk: everything but the routed experts (and the vision tower), with the tokenizer\n"
               "files: what the coordinator needs (`shoal run|serve --model OUT --plan ...`).\n"
               "Resumable: a rerun keeps every finished file whose bytes still match its checksum.\n"
               "Progress (bytes, rate, ETA) on stderr every second unless --quiet.\n"
               "\n"
               "exit codes: 0 ok, 2 usage error, 3 invalid model or plan, 4 I/O failure\n");
}

int shoal_pack_build(const shoal_pack_job *j, shoal_pack_sum *sum, char *err, size_t errlen)
{
    const char *model = j->model, *plan = j->plan, *worker = j->worker, *out = j->out;
    int trunk = j->trunk;
    char path[4096];
    int rc, ret = 3;
    shoal_k3cfg cfg;
    shoal_st *st = NULL;
    shoal_planfile pf = {0};
    shoal_proto_range *r = NULL;
    size_t nr = 0;
    shoal_shard *own = NULL;
    tlist *tl = NULL;
    json_t *files = NULL, *wmap = NULL;
    char *cfgbuf = NULL;
    shoal_tshard_mat *mats = NULL;
    int nmats = 0;
    shoal_proto_trows *trows = NULL;
    size_t ntrows = 0;
    rowsel *tsel = NULL;
    const shoal_tensor **tten = NULL;
    int *tlay = NULL;
    uint64_t tbytes = 0;
    json_t *jrows = NULL;
    snprintf(path, sizeof path, "%s/config.json", model);
    if ((rc = shoal_k3cfg_load(&cfg, path, err, errlen)))
        goto fail;
    shoal_st_opts so = {.map = 0};
    uint8_t fp[32];
    if ((rc = shoal_st_open(&st, model, &so, err, errlen)) ||
        (rc = shoal_fprint_model(fp, &cfg, st, err, errlen)) ||
        (plan && (rc = shoal_planfile_read(&pf, plan, err, errlen))))
        goto fail;
    if (pf.has_fingerprint && memcmp(pf.fingerprint, fp, 32)) {
        char a[65], b[65];
        shoal_packfile_hex(pf.fingerprint, 32, a);
        shoal_packfile_hex(fp, 32, b);
        snprintf(err, errlen, "plan %s was made for model %.16s..., %s is %.16s...", plan, a, model, b);
        goto fail;
    }
    const shoal_planfile_worker *pw = trunk ? NULL : shoal_planfile_find(&pf, worker);
    if (!trunk && !pw) {
        snprintf(err, errlen, "plan %s has no worker \"%s\"", plan, worker);
        goto fail;
    }
    if (!trunk && ((rc = shoal_shard_parse(pw->experts, &r, &nr, err, errlen)) ||
                   (rc = shoal_shard_open(&own, r, nr, cfg.num_layers, cfg.is_moe, cfg.num_experts, err,
                                          errlen))))
        goto fail;
    if (mkdir(out, 0755) && errno != EEXIST) {
        snprintf(err, errlen, "%s: %s", out, strerror(errno));
        ret = 4;
        goto fail;
    }
    /* what to copy, one file per layer (tl[l + 1]) and one for the globals
     * (tl[0], trunk only): the owned experts' tensors, or with --trunk every
     * tensor but the routed experts and the vision tower */
    tl = shoal_xcalloc((size_t)cfg.num_layers + 1, sizeof *tl);
    if (trunk) {
        for (size_t i = 0; i < shoal_st_count(st); i++) {
            const shoal_tensor *t = shoal_st_at(st, i);
            if (strstr(t->name, ".block_sparse_moe.experts.") || shoal_k3schema_is_vision(t->name))
                continue;
            const char *ls = strstr(t->name, "model.layers.");
            int l = ls ? atoi(ls + 13) : -1;
            tlist *d = &tl[l >= 0 && l < cfg.num_layers ? l + 1 : 0];
            if (d->n == (int)(sizeof d->t / sizeof d->t[0])) {
                snprintf(err, errlen, "too many tensors for one pack file");
                goto fail;
            }
            d->t[d->n++] = t;
        }
    }
    for (int l = 0; !trunk && l < cfg.num_layers; l++) {
        if (!cfg.is_moe[l])
            continue;
        for (int e = 0; e < cfg.num_experts; e++) {
            if (!shoal_shard_owns(own, l, e))
                continue;
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(&cfg, l, e, ent);
            for (int i = 0; i < n; i++) {
                const shoal_tensor *t = shoal_st_find(st, ent[i].name);
                if (!t) {
                    snprintf(err, errlen, "%s: missing routed-expert tensor %s", model, ent[i].name);
                    goto fail;
                }
                if (tl[l + 1].n == (int)(sizeof tl[l + 1].t / sizeof tl[l + 1].t[0])) {
                    snprintf(err, errlen, "layer %d: too many experts for one pack file", l);
                    goto fail;
                }
                tl[l + 1].t[tl[l + 1].n++] = t;
            }
        }
    }
    /* the worker's trunk rows (`shoal plan --trunk spread`): one slice per
     * ROWSPEC entry, grouped in one file per layer (lm_head in its own) */
    if (!trunk && pw->trunk) {
        if ((rc = shoal_tshard_mats(&cfg, &mats, &nmats))) {
            snprintf(err, errlen, "the model's trunk matrices do not list");
            goto fail;
        }
        if ((rc = shoal_tshard_parse(pw->trunk, mats, nmats, &trows, &ntrows, err, errlen)))
            goto fail;
        tsel = shoal_xcalloc(ntrows ? ntrows : 1, sizeof *tsel);
        tten = shoal_xcalloc(ntrows ? ntrows : 1, sizeof *tten);
        tlay = shoal_xcalloc(ntrows ? ntrows : 1, sizeof *tlay);
        for (size_t i = 0; i < ntrows; i++) {
            const shoal_tensor *t = shoal_st_find(st, trows[i].name);
            int k = shoal_tshard_find(mats, nmats, trows[i].name);
            if (!t || k < 0 || t->ndim != 2 || (t->dtype != SHOAL_DT_BF16 && t->dtype != SHOAL_DT_F32)) {
                snprintf(err, errlen, "%s: trunk matrix %s is missing or not a 2-D BF16/F32 tensor", model,
                         trows[i].name);
                goto fail;
            }
            tten[i] = t;
            tsel[i] = (rowsel){trows[i].lo, trows[i].hi};
            tlay[i] = mats[k].layer;
        }
    }
    files = json_array();
    wmap = json_object();
    uint64_t total_size = 0;
    int nlayerfiles = 0;
    for (int f = 0; f <= cfg.num_layers; f++) {
        const tlist *tf = &tl[f];
        if (!tf->n)
            continue;
        char name[64], fpath[4200];
        if (f == 0)
            snprintf(name, sizeof name, "trunk-globals.safetensors");
        else
            snprintf(name, sizeof name, "%s-L%03d.safetensors", trunk ? "trunk" : "experts", f - 1);
        snprintf(fpath, sizeof fpath, "%s/%s", out, name);
        uint8_t h[32];
        uint64_t bytes;
        if ((rc = emit_layer(j, st, fpath, tf->t, NULL, tf->n, h, &bytes, err, errlen))) {
            ret = 4;
            goto fail;
        }
        char hex[65];
        shoal_packfile_hex(h, 32, hex);
        json_array_append_new(files, json_pack("{s:s, s:I, s:s}", "name", name, "bytes", (json_int_t)bytes,
                                               "blake2b", hex));
        for (int i = 0; i < tf->n; i++) {
            json_object_set_new(wmap, tf->t[i]->name, json_string(name));
            total_size += tf->t[i]->nbytes;
        }
        nlayerfiles++;
    }
    jrows = ntrows ? json_array() : NULL;
    for (int l = -1; l < cfg.num_layers && ntrows; l++) {
        const shoal_tensor **ft = shoal_xcalloc(ntrows, sizeof *ft);
        rowsel *fs = shoal_xcalloc(ntrows, sizeof *fs);
        int n = 0;
        for (size_t i = 0; i < ntrows; i++)
            if (tlay[i] == l) {
                ft[n] = tten[i];
                fs[n++] = tsel[i];
            }
        char name[64], fpath[4200];
        if (l < 0)
            snprintf(name, sizeof name, "trunk-rows-head.safetensors");
        else
            snprintf(name, sizeof name, "trunk-rows-L%03d.safetensors", l);
        snprintf(fpath, sizeof fpath, "%s/%s", out, name);
        uint8_t h[32];
        uint64_t bytes;
        rc = n ? emit_layer(j, st, fpath, ft, fs, n, h, &bytes, err, errlen) : 0;
        for (int i = 0; i < n && !rc; i++) {
            char sn[SHOAL_PROTO_MAX_NAME + 64];
            uint64_t off, nb;
            slice_name(sn, sizeof sn, ft[i]->name, &fs[i]);
            item_geom(ft[i], &fs[i], &off, &nb);
            json_object_set_new(wmap, sn, json_string(name));
            total_size += nb;
            tbytes += nb;
            json_array_append_new(jrows, json_pack("{s:s, s:s, s:I, s:I, s:s, s:[I,I], s:I}", "name", ft[i]->name,
                                                   "tensor", sn, "lo", (json_int_t)fs[i].lo, "hi",
                                                   (json_int_t)fs[i].hi, "dtype", shoal_dtype_name(ft[i]->dtype),
                                                   "shape", (json_int_t)ft[i]->shape[0],
                                                   (json_int_t)ft[i]->shape[1], "nbytes", (json_int_t)ft[i]->nbytes));
        }
        free(ft);
        free(fs);
        if (rc) {
            ret = 4;
            goto fail;
        }
        if (!n)
            continue;
        char hex[65];
        shoal_packfile_hex(h, 32, hex);
        json_array_append_new(files, json_pack("{s:s, s:I, s:s}", "name", name, "bytes", (json_int_t)bytes,
                                               "blake2b", hex));
        nlayerfiles++;
    }
    sum->nexperts = own ? shoal_shard_count(own) : 0;
    sum->nfiles = nlayerfiles;
    sum->total_size = total_size;
    snprintf(sum->trunk, sizeof sum->trunk, "%s", ntrows ? pw->trunk : "");
    if (j->dry) {
        ret = 0;
        goto done;
    }
    /* config.json (copied byte for byte) and the index */
    size_t cfgn = 0;
    cfgbuf = shoal_xmalloc(1u << 24);
    if ((rc = read_small(path, cfgbuf, 1u << 24, &cfgn))) {
        snprintf(err, errlen, "%s: %s", path, strerror(-rc));
        goto fail;
    }
    json_t *idx = json_pack("{s:{s:I}, s:O}", "metadata", "total_size", (json_int_t)total_size, "weight_map", wmap);
    char *idxs = json_dumps(idx, JSON_INDENT(1) | JSON_PRESERVE_ORDER);
    json_decref(idx);
    struct {
        const char *name;
        const char *b;
        size_t n;
    } small[2 + 4] = {{"config.json", cfgbuf, cfgn}, {"model.safetensors.index.json", idxs, strlen(idxs)}};
    int nsmall = 2;
    char *extra[4] = {0};
    if (trunk) { /* the coordinator also needs the tokenizer files that exist */
        const char *const *tok = shoal_pack_tokfiles;
        for (int i = 0; i < SHOAL_PACK_NTOK; i++) {
            char tp[4200];
            size_t tn = 0;
            snprintf(tp, sizeof tp, "%s/%s", model, tok[i]);
            extra[i] = shoal_xmalloc(64u << 20);
            if (read_small(tp, extra[i], 64u << 20, &tn)) {
                free(extra[i]);
                extra[i] = NULL;
                continue;
            }
            small[nsmall].name = tok[i];
            small[nsmall].b = extra[i];
            small[nsmall++].n = tn;
        }
    }
    for (int i = 0; i < nsmall; i++) {
        char fpath[4200], hex[65];
        uint8_t h[32];
        snprintf(fpath, sizeof fpath, "%s/%s", out, small[i].name);
        if ((rc = write_small(fpath, small[i].b, small[i].n, err, errlen))) {
            free(idxs);
            for (int k = 0; k < 4; k++)
                free(extra[k]);
            ret = 4;
            goto fail;
        }
        crypto_generichash(h, 32, (const unsigned char *)small[i].b, small[i].n, NULL, 0);
        shoal_packfile_hex(h, 32, hex);
        json_array_append_new(files, json_pack("{s:s, s:I, s:s}", "name", small[i].name, "bytes",
                                               (json_int_t)small[i].n, "blake2b", hex));
    }
    free(idxs);
    for (int k = 0; k < 4; k++)
        free(extra[k]);
    char fph[65];
    shoal_packfile_hex(fp, 32, fph);
    json_t *man = json_pack("{s:s, s:i, s:s, s:s, s:s, s:I, s:O}", "format", "shoal-pack", "version", 1, "worker",
                            trunk ? "trunk" : worker, "experts", trunk ? "" : pw->experts, "model_fingerprint", fph, "expert_bytes",
                            (json_int_t)(total_size - tbytes), "files", files);
    if (jrows) { /* the trunk rows (issue 16): what the worker maps, and the full shapes it fingerprints */
        json_object_set_new(man, "trunk", json_string(pw->trunk));
        json_object_set_new(man, "trunk_rows", jrows);
        json_object_set_new(man, "trunk_bytes", json_integer((json_int_t)tbytes));
        jrows = NULL;
    }
    char *mans = json_dumps(man, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(man);
    snprintf(path, sizeof path, "%s/%s", out, SHOAL_PACKFILE_NAME);
    rc = write_small(path, mans, strlen(mans), err, errlen);
    free(mans);
    if (rc) {
        ret = 4;
        goto fail;
    }
    ret = 0;
    goto done;
fail:
done:
    free(cfgbuf);
    json_decref(files);
    json_decref(wmap);
    json_decref(jrows);
    free(tl);
    free(mats);
    free(trows);
    free(tsel);
    free(tten);
    free(tlay);
    shoal_shard_close(own);
    free(r);
    shoal_planfile_free(&pf);
    shoal_st_close(st);
    return ret;
}

int shoal_cmd_pack(int argc, char **argv)
{
    const char *model = NULL, *plan = NULL, *worker = NULL, *out = NULL;
    int quiet = 0, trunk = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet") || !strcmp(a, "--trunk")) {
            *(a[2] == 'q' ? &quiet : &trunk) = 1;
            continue;
        }
        const char **dst = !strcmp(a, "--model") ? &model : !strcmp(a, "--plan") ? &plan
                         : !strcmp(a, "--worker") ? &worker : (!strcmp(a, "-o") || !strcmp(a, "--out")) ? &out : NULL;
        if (!dst && a[0] == '-') {
            shoal_suggest_unknown_flag("shoal pack", a, usage);
            return 2;
        }
        if (!dst || !v) {
            fprintf(stderr, "shoal pack: %s '%s'\n", dst ? "missing value for" : "unexpected argument", a);
            usage(stderr);
            return 2;
        }
        *dst = v;
        i++;
    }
    if (!model || !out || (trunk ? worker != NULL : (!plan || !worker))) {
        usage(stderr);
        return 2;
    }
    char err[8192] = "";
    packer pk = {.quiet = quiet};
    shoal_pack_sum sum = {0};
    shoal_pack_job j = {.model = model, .plan = plan, .worker = worker, .out = out, .trunk = trunk, .dry = 1,
                        .layer = count_layer, .ctx = &pk};
    int ret = shoal_pack_build(&j, &sum, err, sizeof err);
    if (!ret) {
        pk.buf = shoal_xmalloc(CHUNK);
        pk.t0 = pk.last = now_s();
        j.dry = 0;
        j.layer = write_layer;
        ret = shoal_pack_build(&j, &sum, err, sizeof err);
        if (!ret) {
            progress(&pk, 1);
            printf("pack %s: %s %s, %zu experts%s%s in %d files, %.3f GiB (%.3f GiB copied, %.3f GiB kept from a "
                   "previous run)\n",
                   out, trunk ? "the trunk" : "worker", trunk ? "(no routed experts)" : worker, sum.nexperts,
                   sum.trunk[0] ? " and trunk rows " : "", sum.trunk, sum.nfiles,
                   (double)sum.total_size / 1073741824.0, (double)pk.done / 1073741824.0,
                   (double)pk.skipped / 1073741824.0);
        }
        for (int i = 0; i < pk.nfds; i++)
            if (pk.fds[i] >= 0)
                close(pk.fds[i]);
        free(pk.fds);
        free(pk.buf);
    }
    if (ret)
        fprintf(stderr, "shoal pack: %s\n", err);
    return ret;
}
