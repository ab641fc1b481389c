/* `shoal pull`: write one worker's pack (or the trunk pack) straight from a
 * Hugging Face-style hub, downloading only the bytes that pack holds
 * (docs/DEPLOY.md, "Pull").
 *
 * 1. config.json, the index and (--trunk) the tokenizer files are fetched
 *    whole and checked against --pin; every shard's safetensors header is
 *    read with two Range requests. They make a header-only copy of the model
 *    in DIR/.shoal-pull: the shards as sparse files holding just their
 *    headers, so common/st.h validates every tensor's dtype, shape and byte
 *    count and proto/fprint.h computes the model fingerprint as for a full
 *    copy.
 * 2. shoal_pack_build (cmd/pack.h) lays the pack out from that copy, exactly
 *    as `shoal pack` does; each layer file is NAME.part with its header
 *    written and its ranges fetched into place (coalesced where adjacent in
 *    the shard, split into --chunk pieces, several in flight).
 * 3. Each piece, once all its bytes are on disk (fdatasync), is logged in
 *    NAME.part.log with its BLAKE2b-256; a rerun re-hashes the logged pieces
 *    from disk and fetches only the rest. A finished file is hashed whole,
 *    renamed and its sum stored in NAME.blake2b, as pack does; then the
 *    second shoal_pack_build pass writes config.json, the index, the
 *    tokenizer files and the manifest. */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/suggest.h"
#include "cli/commands.h"
#include "common/err.h"
#include "common/packfile.h"
#include "coordinator/cmd/pack.h"
#include "coordinator/hub/hub.h"

#define MAX_SMALL (256u << 20)
#define MAX_HEADER (100u << 20)

typedef struct {
    char *file; /* repo file */
    uint64_t off, nbytes;
} srange;

typedef struct {
    char path[4200];
    char *hdr;
    size_t hlen;
    uint64_t size;
    srange *src;
    int nsrc;
    uint8_t hash[32];
    int done, fd, logfd;
    uint64_t have; /* bytes verified present from a previous run */
    char *pend;    /* log lines of pieces written but not yet synced */
    size_t npend, cpend;
} lfile;

typedef struct {
    char file[256];
    uint64_t total;
    char etag[128];
} shard;

typedef struct {
    lfile *f;
    int nf;
    shard *sh;
    int nsh;
    /* progress */
    uint64_t total, kept, got;
    double t0, last, synced;
    int quiet, tty;
    int quiet_retries; /* --quiet (--json keeps the retry lines on stderr) */
} puller;

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

/* A bar redrawn in place on a terminal; elsewhere one plain line every 2 s. */
static void progress(puller *p, int final)
{
    double t = now_s();
    if (p->quiet || (!final && t - p->last < (p->tty ? 0.25 : 2.0)))
        return;
    p->last = t;
    uint64_t have = p->kept + p->got, all = p->kept + p->total;
    double rate = t > p->t0 ? (double)p->got / (t - p->t0) : 0;
    double frac = all ? (double)have / (double)all : 1.0;
    char eta[32];
    fmt_dur(final ? 0 : rate > 0 ? (double)(all - have) / rate : -1, eta, sizeof eta);
    if (p->tty) {
        char bar[31];
        int k = (int)(frac * 30);
        for (int i = 0; i < 30; i++)
            bar[i] = i < k ? '#' : '-';
        bar[30] = 0;
        fprintf(stderr, "\rpull [%s] %.2f / %.2f GiB %.1f MiB/s ETA %s   %s", bar, (double)have / 1073741824.0,
                (double)all / 1073741824.0, rate / 1048576.0, eta, final ? "\n" : "");
    } else {
        fprintf(stderr, "pull: %.2f / %.2f GiB (%.1f%%), %.1f MiB/s, ETA %s%s\n", (double)have / 1073741824.0,
                (double)all / 1073741824.0, 100.0 * frac, rate / 1048576.0, eta,
                p->kept ? " (resumed: verified bytes kept)" : "");
    }
}

/* One line per retry (the hub's reason), so a long backoff is never silent. */
static void on_retry(void *ctx, const char *why, double wait_s, int attempt, int attempts)
{
    puller *p = ctx;
    if (p->quiet_retries)
        return;
    fprintf(stderr, "%spull: retry %d of %d in %.1f s: %s\n", p->tty && !p->quiet ? "\n" : "", attempt - 1, attempts - 1, wait_s,
            why);
}

static void on_progress(void *ctx, int64_t delta)
{
    puller *p = ctx;
    p->got = (uint64_t)((int64_t)p->got + delta);
    progress(p, 0);
}

/* ---- pins ---------------------------------------------------------------- */

typedef struct {
    json_t *files; /* name -> {bytes, sha256} */
} pins;

static int pins_load(pins *pn, const char *path, const char *repo, const char *rev, char *err, size_t errlen)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "--pin %s: line %d: %s", path, je.line, je.text);
    const char *fmt = json_string_value(json_object_get(j, "format"));
    json_t *files = json_object_get(j, "files");
    const char *pr = json_string_value(json_object_get(j, "repo"));
    const char *pv = json_string_value(json_object_get(j, "revision"));
    int rc = 0;
    if (!fmt || strcmp(fmt, "shoal-pin") || !json_is_object(files))
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "--pin %s: not a shoal-pin file (\"format\", \"files\")", path);
    else if ((pr && strcmp(pr, repo)) || (pv && strcmp(pv, rev)))
        rc = shoal_err_set(err, errlen, SHOAL_EINVAL, "--pin %s pins %s at %s, not --repo %s --revision %s", path,
                           pr ? pr : "?", pv ? pv : "?", repo, rev);
    const char *k;
    json_t *v;
    json_object_foreach(files, k, v)
    {
        const char *h = json_string_value(json_object_get(v, "sha256"));
        uint8_t tmp[32];
        if (!rc && (!h || strlen(h) != 64 || shoal_packfile_unhex(h, tmp, 32) ||
                    !json_is_integer(json_object_get(v, "bytes"))))
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "--pin %s: \"%s\" needs \"bytes\" and a 64-hex \"sha256\"",
                               path, k);
    }
    if (rc) {
        json_decref(j);
        return rc;
    }
    pn->files = json_incref(files);
    json_decref(j);
    return 0;
}

/* 1 if name is pinned; then 0 or SHOAL_EMODEL when b differs from the pin. */
static int pin_check(const pins *pn, const char *name, const char *b, size_t n, int *pinned, char *err,
                     size_t errlen)
{
    json_t *v = pn->files ? json_object_get(pn->files, name) : NULL;
    *pinned = v != NULL;
    if (!v)
        return 0;
    uint8_t got[32];
    char hex[65];
    crypto_hash_sha256(got, (const unsigned char *)b, n);
    shoal_packfile_hex(got, 32, hex);
    const char *want = json_string_value(json_object_get(v, "sha256"));
    json_int_t wb = json_integer_value(json_object_get(v, "bytes"));
    if ((json_int_t)n != wb || strcasecmp(hex, want))
        return shoal_err_set(err, errlen, SHOAL_EMODEL,
                             "%s from the hub is %zu bytes with sha256 %s; the pin says %lld bytes, %s: refused", name,
                             n, hex, (long long)wb, want);
    return 0;
}

/* ---- small files and headers ---------------------------------------------- */

static int write_file(const char *dir, const char *name, const void *b, size_t n, char *err, size_t errlen)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return shoal_pack_write_small(path, b, n, err, errlen);
}

/* Fetch file whole (optional: a 404 is fine, *got = 0), check its pin,
 * write it into dir. */
static int fetch_small(shoal_hub *h, const pins *pn, const char *dir, const char *file, int optional, int *got,
                       uint64_t *bytes, char *err, size_t errlen)
{
    char *b = NULL;
    size_t n = 0;
    int pinned = 0;
    *got = 0;
    int rc = shoal_hub_get(h, file, MAX_SMALL, &b, &n, NULL, 0, err, errlen);
    if (rc == SHOAL_ENOTFOUND && optional) {
        json_t *v = pn->files ? json_object_get(pn->files, file) : NULL;
        if (v)
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "%s is pinned (--pin) but the hub has no such file",
                                 file);
        return 0;
    }
    if (rc)
        return rc;
    *bytes += n;
    if (!(rc = pin_check(pn, file, b, n, &pinned, err, errlen)))
        rc = write_file(dir, file, b, n, err, errlen);
    free(b);
    *got = !rc;
    return rc;
}

static int plain_name(const char *s)
{
    size_t n = strlen(s);
    return n && n < 200 && s[0] != '.' && !strchr(s, '/') && !strchr(s, '\\') && n > 12 &&
           !strcmp(s + n - 12, ".safetensors");
}

/* The index (or a single model.safetensors) and every shard's header, into
 * the header-only copy in dir. */
static int fetch_headers(shoal_hub *h, const pins *pn, puller *pl, const char *dir, uint64_t *bytes, char *err,
                         size_t errlen)
{
    char *b = NULL;
    size_t n = 0;
    int rc = shoal_hub_get(h, "model.safetensors.index.json", MAX_SMALL, &b, &n, NULL, 0, err, errlen);
    json_t *idx = NULL;
    if (rc == SHOAL_ENOTFOUND) {
        pl->sh = shoal_xcalloc(1, sizeof *pl->sh);
        snprintf(pl->sh[0].file, sizeof pl->sh[0].file, "model.safetensors");
        pl->nsh = 1;
    } else if (rc) {
        return rc;
    } else {
        *bytes += n;
        int pinned;
        if ((rc = pin_check(pn, "model.safetensors.index.json", b, n, &pinned, err, errlen))) {
            free(b);
            return rc;
        }
        json_error_t je;
        idx = json_loadb(b, n, 0, &je);
        json_t *wm = idx ? json_object_get(idx, "weight_map") : NULL;
        if (!json_is_object(wm)) {
            free(b);
            json_decref(idx);
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "model.safetensors.index.json from the hub: no weight_map");
        }
        pl->sh = shoal_xcalloc(json_object_size(wm) + 1, sizeof *pl->sh);
        const char *k;
        json_t *v;
        json_object_foreach(wm, k, v)
        {
            const char *f = json_string_value(v);
            if (!f || !plain_name(f)) {
                rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                                   "model.safetensors.index.json: tensor %s is in '%s', not a plain *.safetensors name",
                                   k, f ? f : "(not a string)");
                break;
            }
            int seen = 0;
            for (int i = 0; i < pl->nsh && !seen; i++)
                seen = !strcmp(pl->sh[i].file, f);
            if (!seen)
                snprintf(pl->sh[pl->nsh++].file, sizeof pl->sh[0].file, "%s", f);
        }
        if (!rc)
            rc = write_file(dir, "model.safetensors.index.json", b, n, err, errlen);
        free(b);
        json_decref(idx);
        if (rc)
            return rc;
    }
    /* each header's length (8 bytes), then the header */
    int ns = pl->nsh;
    shoal_hub_piece *pc = shoal_xcalloc((size_t)ns, sizeof *pc);
    uint8_t(*len8)[8] = shoal_xcalloc((size_t)ns, 8);
    for (int i = 0; i < ns; i++)
        pc[i] = (shoal_hub_piece){.file = pl->sh[i].file, .off = 0, .len = 8, .fd = -1, .mem = len8[i]};
    rc = shoal_hub_fetch(h, pc, (size_t)ns, NULL, NULL, NULL, err, errlen);
    char **hb = shoal_xcalloc((size_t)ns, sizeof *hb);
    for (int i = 0; i < ns && !rc; i++) {
        uint64_t hl = 0;
        for (int k = 0; k < 8; k++)
            hl |= (uint64_t)len8[i][k] << (8 * k);
        pl->sh[i].total = pc[i].total;
        snprintf(pl->sh[i].etag, sizeof pl->sh[i].etag, "%s", pc[i].etag);
        if (hl < 2 || hl > MAX_HEADER || 8 + hl > pc[i].total) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                               "%s on the hub: header length %llu does not fit its %llu bytes (or exceeds %u MiB)",
                               pl->sh[i].file, (unsigned long long)hl, (unsigned long long)pc[i].total,
                               MAX_HEADER >> 20);
            break;
        }
        hb[i] = shoal_xmalloc(8 + hl);
        memcpy(hb[i], len8[i], 8);
        pc[i] = (shoal_hub_piece){.file = pl->sh[i].file, .off = 8, .len = hl, .fd = -1, .mem = hb[i] + 8};
        *bytes += 8 + hl;
    }
    if (!rc)
        rc = shoal_hub_fetch(h, pc, (size_t)ns, NULL, NULL, NULL, err, errlen);
    for (int i = 0; i < ns && !rc; i++) {
        if (pc[i].total != pl->sh[i].total || (pl->sh[i].etag[0] && strcmp(pc[i].etag, pl->sh[i].etag))) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s changed on the hub while its header was read", pc[i].file);
            break;
        }
        char path[4600];
        snprintf(path, sizeof path, "%s/%s", dir, pl->sh[i].file);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0 || shoal_pack_write_all(fd, hb[i], 8 + pc[i].len) || ftruncate(fd, (off_t)pl->sh[i].total)) {
            rc = shoal_err_set(err, errlen, -errno, "%s: %s", path, strerror(errno));
            if (fd >= 0)
                close(fd);
            break;
        }
        close(fd);
    }
    for (int i = 0; i < ns; i++)
        free(hb[i]);
    free(hb);
    free(len8);
    free(pc);
    return rc;
}

/* ---- the pack's layer files ------------------------------------------------ */

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* Dry pass: remember each layer file (the source paths point into the
 * header-only copy; the repository file is their base name). */
static int list_layer(void *ctx, const char *path, const char *hdr, size_t hlen, uint64_t size,
                      const shoal_pack_src *s, int n, uint8_t *hash, char *err, size_t errlen)
{
    (void)err, (void)errlen;
    puller *p = ctx;
    p->f = shoal_xrealloc(p->f, (size_t)(p->nf + 1) * sizeof *p->f);
    lfile *f = &p->f[p->nf++];
    memset(f, 0, sizeof *f);
    snprintf(f->path, sizeof f->path, "%s", path);
    f->hdr = shoal_xmalloc(hlen);
    memcpy(f->hdr, hdr, hlen);
    f->hlen = hlen;
    f->size = size;
    f->src = shoal_xcalloc((size_t)n + 1, sizeof *f->src);
    f->nsrc = n;
    f->fd = f->logfd = -1;
    for (int i = 0; i < n; i++)
        f->src[i] = (srange){shoal_xstrdup(base_name(s[i].path)), s[i].off, s[i].nbytes};
    memset(hash, 0, 32);
    return 0;
}

/* Final pass: the files are in place; hand back their sums. */
static int done_layer(void *ctx, const char *path, const char *hdr, size_t hlen, uint64_t size,
                      const shoal_pack_src *s, int n, uint8_t *hash, char *err, size_t errlen)
{
    (void)hdr, (void)hlen, (void)s, (void)n;
    puller *p = ctx;
    for (int i = 0; i < p->nf; i++)
        if (!strcmp(p->f[i].path, path) && p->f[i].done && p->f[i].size == size) {
            memcpy(hash, p->f[i].hash, 32);
            return 0;
        }
    return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "%s: not pulled", path);
}

typedef struct {
    int file; /* index into puller.f */
} pinfo;

/* Make the pieces written so far durable (fdatasync), then log them: a
 * logged piece is on disk. */
static int sync_logs(puller *p, char *err, size_t errlen)
{
    for (int i = 0; i < p->nf; i++) {
        lfile *f = &p->f[i];
        if (!f->npend)
            continue;
        if (fdatasync(f->fd))
            return shoal_err_set(err, errlen, -errno, "%s.part: fdatasync: %s", f->path, strerror(errno));
        if (shoal_pack_write_all(f->logfd, f->pend, f->npend))
            return shoal_err_set(err, errlen, -errno, "%s.part.log: %s", f->path, strerror(errno));
        f->npend = 0;
    }
    p->synced = now_s();
    return 0;
}

/* A piece is in place: note it for the log (synced at most every second). */
static int piece_done(void *ctx, shoal_hub_piece *pc, char *err, size_t errlen)
{
    puller *p = ctx;
    lfile *f = &p->f[((pinfo *)pc->user)->file];
    for (int i = 0; i < p->nsh; i++)
        if (!strcmp(p->sh[i].file, pc->file) && p->sh[i].etag[0] && strcmp(p->sh[i].etag, pc->etag))
            return shoal_err_set(err, errlen, SHOAL_EMODEL,
                                 "%s changed on the hub during the pull (ETag %s, now %s): pull a commit hash "
                                 "--revision",
                                 pc->file, p->sh[i].etag, pc->etag);
    char hex[65];
    shoal_packfile_hex(pc->blake2b, 32, hex);
    if (f->npend + 128 > f->cpend) {
        f->cpend = (f->npend + 128) * 2;
        f->pend = shoal_xrealloc(f->pend, f->cpend);
    }
    f->npend += (size_t)snprintf(f->pend + f->npend, f->cpend - f->npend, "%llu %llu %s\n",
                                 (unsigned long long)pc->dst, (unsigned long long)pc->len, hex);
    return now_s() - p->synced >= 1.0 ? sync_logs(p, err, errlen) : 0;
}

/* The source identity the piece logs were written against: every shard's
 * name, size and ETag. */
static void source_id(const puller *p, char *out)
{
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, 16);
    for (int i = 0; i < p->nsh; i++) {
        char line[512];
        int k = snprintf(line, sizeof line, "%s %llu %s\n", p->sh[i].file, (unsigned long long)p->sh[i].total,
                         p->sh[i].etag);
        crypto_generichash_update(&hs, (const unsigned char *)line, (size_t)k);
    }
    uint8_t h[16];
    crypto_generichash_final(&hs, h, 16);
    shoal_packfile_hex(h, 16, out);
}

/* Is the logged piece (its runs sg[n], BLAKE2b hex) still on disk? */
static int piece_on_disk(int fd, const shoal_hub_seg *sg, int n, const char *hex, unsigned char *buf, size_t cap)
{
    crypto_generichash_state hs;
    crypto_generichash_init(&hs, NULL, 0, 32);
    for (int i = 0; i < n; i++)
        for (uint64_t o = 0; o < sg[i].len;) {
            size_t k = sg[i].len - o < cap ? (size_t)(sg[i].len - o) : cap;
            if (shoal_pack_pread_all(fd, buf, k, sg[i].dst + o))
                return 0;
            crypto_generichash_update(&hs, buf, k);
            o += k;
        }
    uint8_t h[32];
    char got[65];
    crypto_generichash_final(&hs, h, 32);
    shoal_packfile_hex(h, 32, got);
    return !strcmp(got, hex);
}

typedef struct {
    uint64_t dst, len;
    char hex[65];
} logent;

typedef struct {
    const char *file;
    uint64_t off, len, dst;
} item;

static int item_cmp(const void *a, const void *b)
{
    const item *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : x->off < y->off ? -1 : x->off > y->off;
}

/* Open (or resume) f's NAME.part and append its missing pieces to *pcs. */
static int prepare(puller *p, int fi, const char *sid, uint64_t chunk, int dry, shoal_hub_piece **pcs,
                   pinfo **infos, size_t *npc, size_t *cap, unsigned char *buf, size_t bufcap, char *err,
                   size_t errlen)
{
    lfile *f = &p->f[fi];
    char part[4400], logp[4400];
    snprintf(part, sizeof part, "%s.part", f->path);
    snprintf(logp, sizeof logp, "%s.part.log", f->path);
    logent *le = NULL;
    size_t nle = 0;
    int fresh = 1;
    int fd = dry ? -1 : open(part, O_RDWR | O_CLOEXEC);
    FILE *lf = fd >= 0 ? fopen(logp, "r") : NULL;
    struct stat sb;
    if (lf && !fstat(fd, &sb) && (uint64_t)sb.st_size == f->size) {
        char line[256];
        char *h = shoal_xmalloc(f->hlen);
        int same = !shoal_pack_pread_all(fd, h, f->hlen, 0) && !memcmp(h, f->hdr, f->hlen);
        free(h);
        if (same && fgets(line, sizeof line, lf) && !strncmp(line, "source ", 7) && !strncmp(line + 7, sid, 32)) {
            fresh = 0;
            unsigned long long d, l;
            char hex[80];
            while (fgets(line, sizeof line, lf))
                if (sscanf(line, "%llu %llu %79s", &d, &l, hex) == 3 && strlen(hex) == 64) {
                    le = shoal_xrealloc(le, (nle + 1) * sizeof *le);
                    le[nle].dst = d;
                    le[nle].len = l;
                    memcpy(le[nle].hex, hex, 65); /* strlen(hex) == 64 checked: 64 digits and the NUL */
                    nle++;
                }
        }
    }
    if (lf)
        fclose(lf);
    if (fresh && !dry) {
        if (fd >= 0)
            close(fd);
        fd = open(part, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0 || shoal_pack_write_all(fd, f->hdr, f->hlen) || ftruncate(fd, (off_t)f->size)) {
            int e = errno;
            if (fd >= 0)
                close(fd);
            free(le);
            return shoal_err_set(err, errlen, -e, "%s: %s", part, strerror(e));
        }
        int fe = posix_fallocate(fd, 0, (off_t)f->size);
        if (fe == ENOSPC) {
            close(fd);
            free(le);
            return shoal_err_set(err, errlen, -ENOSPC, "%s: no space left for its %llu bytes", part,
                                 (unsigned long long)f->size);
        }
    }
    f->fd = fd;
    f->logfd = dry ? -1 : open(logp, O_WRONLY | O_CREAT | O_APPEND | (fresh ? O_TRUNC : 0) | O_CLOEXEC, 0644);
    if (f->logfd < 0 && !dry) {
        free(le);
        return shoal_err_set(err, errlen, -errno, "%s: %s", logp, strerror(errno));
    }
    if (fresh && !dry) {
        char line[64];
        int k = snprintf(line, sizeof line, "source %s\n", sid);
        if (shoal_pack_write_all(f->logfd, line, (size_t)k)) {
            free(le);
            return shoal_err_set(err, errlen, -errno, "%s: %s", logp, strerror(errno));
        }
    }
    /* the source ranges in shard order: bytes adjacent in the shard are one
     * request (scattered into the file where the pack orders them
     * differently), cut into pieces of at most chunk bytes */
    item *it = shoal_xcalloc((size_t)f->nsrc + 1, sizeof *it);
    uint64_t dst = f->hlen;
    for (int i = 0; i < f->nsrc; i++) {
        it[i] = (item){f->src[i].file, f->src[i].off, f->src[i].nbytes, dst};
        dst += f->src[i].nbytes;
    }
    qsort(it, (size_t)f->nsrc, sizeof *it, item_cmp);
    for (int i = 0; i < f->nsrc;) {
        int j = i + 1;
        while (j < f->nsrc && !strcmp(it[j].file, it[i].file) && it[j].off == it[j - 1].off + it[j - 1].len)
            j++;
        /* items i..j-1 are one run of the shard; walk it in pieces */
        int k = i;
        uint64_t in = 0; /* bytes of item k already placed */
        while (k < j) {
            uint64_t start = it[k].off + in, len = 0;
            shoal_hub_seg *sg = NULL;
            int ns = 0;
            while (k < j && len < chunk) {
                uint64_t take = it[k].len - in < chunk - len ? it[k].len - in : chunk - len;
                if (ns && sg[ns - 1].dst + sg[ns - 1].len == it[k].dst + in) {
                    sg[ns - 1].len += take;
                } else {
                    sg = shoal_xrealloc(sg, (size_t)(ns + 1) * sizeof *sg);
                    sg[ns++] = (shoal_hub_seg){it[k].dst + in, take};
                }
                len += take;
                in += take;
                if (in == it[k].len) {
                    k++;
                    in = 0;
                }
            }
            int have = 0;
            for (size_t e = 0; e < nle && !have; e++)
                if (le[e].dst == sg[0].dst && le[e].len == len)
                    have = piece_on_disk(fd, sg, ns, le[e].hex, buf, bufcap);
            if (have) {
                f->have += len;
                p->kept += len;
                free(sg);
                continue; /* still logged, for a later interruption */
            }
            if (*npc == *cap) {
                *cap = *cap ? *cap * 2 : 256;
                *pcs = shoal_xrealloc(*pcs, *cap * sizeof **pcs);
                *infos = shoal_xrealloc(*infos, *cap * sizeof **infos);
            }
            (*infos)[*npc].file = fi;
            (*pcs)[*npc] = (shoal_hub_piece){.file = it[i].file, .off = start, .len = len, .fd = fd,
                                             .dst = sg[0].dst, .seg = sg, .nseg = ns};
            (*npc)++;
            p->total += len;
        }
        i = j;
    }
    free(it);
    free(le);
    return 0;
}

static uint64_t allocated(const char *path)
{
    struct stat sb;
    char part[4400];
    snprintf(part, sizeof part, "%s.part", path);
    return stat(part, &sb) ? 0 : (uint64_t)sb.st_blocks * 512u;
}

/* Remove the header-only copy (plain files in one directory). */
static void rm_stub(const char *dir, const puller *p)
{
    char path[4600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    unlink(path);
    for (int i = 0; i < SHOAL_PACK_NTOK; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, shoal_pack_tokfiles[i]);
        unlink(path);
    }
    for (int i = 0; i < p->nsh; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, p->sh[i].file);
        unlink(path);
    }
    rmdir(dir);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal pull --repo OWNER/NAME --revision REV --plan plan.json --worker NAME --to DIR [options]\n"
            "       shoal pull --repo OWNER/NAME --revision REV --trunk [--plan plan.json] --to DIR [options]\n"
            "       shoal pull --repo OWNER/NAME --revision REV --config-only --to DIR [options]\n"
            "\n"
            "Write worker NAME's pack (as `shoal pack` would, byte for byte) into DIR, downloading from a\n"
            "Hugging Face-style hub only the bytes the pack holds: config.json, the index and every shard's\n"
            "safetensors header, then the worker's experts (and its trunk rows, when the plan gives it some)\n"
            "with HTTP Range requests. --trunk: the coordinator's trunk pack (everything but the routed experts,\n"
            "with the tokenizer files). --config-only: config.json, the index, the tokenizer files and\n"
            "header-only (sparse) shards, enough for `shoal plan --model DIR`.\n"
            "Resumable: a rerun verifies what is on disk and fetches only the rest.\n"
            "\n"
            "  --endpoint URL    the hub (default $HF_ENDPOINT, else https://huggingface.co)\n"
            "  --token-file FILE bearer token (default $HF_TOKEN); never printed\n"
            "  --pin FILE        refuse config.json / tokenizer files whose sha256 differs (deploy/pins/)\n"
            "  --parallel N      ranges in flight (default 8)\n"
            "  --chunk MIB       largest single range request (default 32)\n"
            "  --retries N       retries per request on 408/429/5xx/transport errors (default 8; 0: none)\n"
            "  --backoff S       first retry wait in seconds, doubled each time (default 1)\n"
            "  --quiet           no progress; --json: one JSON summary line on stdout\n"
            "  --dry-run         read the headers, print (JSON) what the pull would download, write nothing\n"
            "\n"
            "exit codes: 0 ok, 2 usage error, 3 invalid model, plan or pin, 4 I/O, network or hub failure\n");
}

int shoal_cmd_pull(int argc, char **argv)
{
    const char *repo = NULL, *rev = NULL, *endpoint = getenv("HF_ENDPOINT"), *plan = NULL, *worker = NULL,
               *to = NULL, *pinf = NULL, *tokf = NULL, *npar = NULL, *nchunk = NULL, *nretry = NULL,
               *nback = NULL;
    int quiet = 0, trunk = 0, config_only = 0, json = 0, dry = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        int *flag = !strcmp(a, "--quiet") ? &quiet : !strcmp(a, "--trunk") ? &trunk
                  : !strcmp(a, "--config-only") ? &config_only : !strcmp(a, "--json") ? &json
                  : !strcmp(a, "--dry-run") ? &dry : NULL;
        if (flag) {
            *flag = 1;
            continue;
        }
        const char **dst = !strcmp(a, "--repo") ? &repo : !strcmp(a, "--revision") ? &rev
                         : !strcmp(a, "--endpoint") ? &endpoint : !strcmp(a, "--plan") ? &plan
                         : !strcmp(a, "--worker") ? &worker : !strcmp(a, "--to") ? &to
                         : !strcmp(a, "--pin") ? &pinf : !strcmp(a, "--token-file") ? &tokf
                         : !strcmp(a, "--parallel") ? &npar : !strcmp(a, "--chunk") ? &nchunk
                         : !strcmp(a, "--retries") ? &nretry : !strcmp(a, "--backoff") ? &nback : NULL;
        if (!dst && a[0] == '-') {
            shoal_suggest_unknown_flag("shoal pull", a, usage);
            return 2;
        }
        if (!dst || !v) {
            fprintf(stderr, "shoal pull: %s '%s'\n", dst ? "missing value for" : "unexpected argument", a);
            usage(stderr);
            return 2;
        }
        *dst = v;
        i++;
    }
    if (!repo || !rev || !to || (config_only ? (trunk || worker) : trunk ? worker != NULL : (!plan || !worker))) {
        usage(stderr);
        return 2;
    }
    if (endpoint && *endpoint && strncmp(endpoint, "http://", 7) && strncmp(endpoint, "https://", 8)) {
        fprintf(stderr, "shoal pull: --endpoint '%s' is not an http:// or https:// URL\n", endpoint);
        return 2;
    }
    char *end;
    long par = npar ? strtol(npar, &end, 10) : 8;
    if (npar && (*end || par < 1 || par > 256)) {
        fprintf(stderr, "shoal pull: --parallel '%s' is not 1..256\n", npar);
        return 2;
    }
    long chunk_mib = nchunk ? strtol(nchunk, &end, 10) : 32;
    if (nchunk && (*end || chunk_mib < 1 || chunk_mib > 4096)) {
        fprintf(stderr, "shoal pull: --chunk '%s' is not 1..4096 (MiB)\n", nchunk);
        return 2;
    }
    long retries = nretry ? strtol(nretry, &end, 10) : 8;
    if (nretry && (*end || retries < 0 || retries > 100)) {
        fprintf(stderr, "shoal pull: --retries '%s' is not 0..100\n", nretry);
        return 2;
    }
    double back = nback ? strtod(nback, &end) : 1.0;
    if (nback && (*end || !(back > 0) || back > 600)) {
        fprintf(stderr, "shoal pull: --backoff '%s' is not a number of seconds in (0, 600]\n", nback);
        return 2;
    }
    char err[8192] = "";
    int ret = 3, rc;
    char *token = NULL;
    pins pn = {0};
    shoal_hub *h = NULL;
    puller pl = {.quiet = quiet || json, .tty = isatty(2), .quiet_retries = quiet};
    shoal_hub_piece *pcs = NULL;
    pinfo *infos = NULL;
    size_t npc = 0, cap = 0;
    unsigned char *buf = NULL;
    uint64_t small_bytes = 0;
    double t_start = now_s();
    if (tokf) {
        FILE *f = fopen(tokf, "r");
        char line[4096];
        if (!f || !fgets(line, sizeof line, f)) {
            snprintf(err, sizeof err, "--token-file %s: %s", tokf, f ? "empty" : strerror(errno));
            if (f)
                fclose(f);
            goto fail;
        }
        fclose(f);
        line[strcspn(line, "\r\n")] = 0;
        token = shoal_xstrdup(line);
        sodium_memzero(line, sizeof line);
    } else if (getenv("HF_TOKEN") && *getenv("HF_TOKEN")) {
        token = shoal_xstrdup(getenv("HF_TOKEN"));
    }
    if (pinf && (rc = pins_load(&pn, pinf, repo, rev, err, sizeof err)))
        goto fail;
    shoal_hub_opts ho = {.endpoint = endpoint, .repo = repo, .revision = rev, .token = token,
                         .user_agent = "shoal/" SHOAL_VERSION, .parallel = (int)par,
                         .retries = retries ? (int)retries : -1, .backoff_s = back, .on_retry = on_retry,
                         .retry_ctx = &pl};
    if ((rc = shoal_hub_open(&h, &ho, err, sizeof err)))
        goto fail;
    if (mkdir(to, 0755) && errno != EEXIST) {
        snprintf(err, sizeof err, "%s: %s", to, strerror(errno));
        ret = 4;
        goto fail;
    }
    char stub[4200];
    if (config_only)
        snprintf(stub, sizeof stub, "%s", to);
    else
        snprintf(stub, sizeof stub, "%s/.shoal-pull", to);
    if (mkdir(stub, 0755) && errno != EEXIST) {
        snprintf(err, sizeof err, "%s: %s", stub, strerror(errno));
        ret = 4;
        goto fail;
    }
    int got;
    ret = 4;
    if ((rc = fetch_small(h, &pn, stub, "config.json", 0, &got, &small_bytes, err, sizeof err)))
        goto fail_model;
    for (int i = 0; i < SHOAL_PACK_NTOK && (trunk || config_only); i++)
        if ((rc = fetch_small(h, &pn, stub, shoal_pack_tokfiles[i], 1, &got, &small_bytes, err, sizeof err)))
            goto fail_model;
    if ((rc = fetch_headers(h, &pn, &pl, stub, &small_bytes, err, sizeof err)))
        goto fail_model;
    if (config_only) {
        shoal_hub_stats hs;
        shoal_hub_get_stats(h, &hs);
        if (json)
            printf("{\"dir\": \"%s\", \"shards\": %d, \"downloaded\": %llu, \"requests\": %llu}\n", to, pl.nsh,
                   (unsigned long long)hs.bytes, (unsigned long long)hs.requests);
        else
            printf("pull %s: config.json, the index and %d shard headers (sparse, header-only) from %s@%s, %llu "
                   "bytes in %llu requests\n",
                   to, pl.nsh, repo, rev, (unsigned long long)hs.bytes, (unsigned long long)hs.requests);
        ret = 0;
        goto done;
    }
    /* lay the pack out from the header-only copy */
    shoal_pack_sum sum = {0};
    shoal_pack_job j = {.model = stub, .plan = plan, .worker = worker, .out = to, .trunk = trunk, .dry = 1,
                        .layer = list_layer, .ctx = &pl};
    if ((ret = shoal_pack_build(&j, &sum, err, sizeof err)))
        goto fail;
    ret = 4;
    /* what is already finished (as pack keeps it), and the disk it needs */
    uint64_t need = small_bytes, packbytes = small_bytes, there = 0;
    for (int i = 0; i < pl.nf; i++) {
        lfile *f = &pl.f[i];
        packbytes += f->size;
        if (shoal_pack_layer_done(f->path, f->hdr, f->hlen, f->size, f->hash)) {
            f->done = 1;
            pl.kept += f->size - f->hlen;
            there += f->size;
            continue;
        }
        uint64_t a = allocated(f->path);
        a = a > f->size ? f->size : a;
        need += f->size - a;
        there += a;
    }
    struct statvfs vf;
    if (!dry && !statvfs(to, &vf)) {
        uint64_t avail = (uint64_t)vf.f_bavail * (uint64_t)vf.f_frsize;
        if (avail < need) {
            snprintf(err, sizeof err,
                     "%s: the pack needs %.3f GiB more (%.3f GiB in all, %.3f GiB already there) but the "
                     "filesystem has %.3f GiB free: free space or pull to a larger disk",
                     to, (double)need / 1073741824.0, (double)packbytes / 1073741824.0,
                     (double)there / 1073741824.0, (double)avail / 1073741824.0);
            goto fail;
        }
    }
    char sid[33];
    source_id(&pl, sid);
    size_t bufcap = 8u << 20;
    buf = shoal_xmalloc(bufcap);
    uint64_t chunk = (uint64_t)chunk_mib << 20;
    for (int i = 0; i < pl.nf; i++)
        if (!pl.f[i].done &&
            (rc = prepare(&pl, i, sid, chunk, dry, &pcs, &infos, &npc, &cap, buf, bufcap, err, sizeof err)))
            goto fail;
    if (dry) { /* what a pull would download; nothing written but the header-only copy */
        shoal_hub_stats hs;
        shoal_hub_get_stats(h, &hs);
        printf("{\"dir\": \"%s\", \"worker\": \"%s\", \"experts\": %zu, \"files\": %d, \"pack_bytes\": %llu, "
               "\"meta_bytes\": %llu, \"range_bytes\": %llu, \"range_requests\": %zu, \"kept\": %llu, "
               "\"shards\": %d}\n",
               to, trunk ? "trunk" : worker, sum.nexperts, sum.nfiles, (unsigned long long)packbytes,
               (unsigned long long)hs.bytes, (unsigned long long)pl.total, npc, (unsigned long long)pl.kept, pl.nsh);
        rm_stub(stub, &pl);
        ret = 0;
        goto done;
    }
    for (size_t i = 0; i < npc; i++)
        pcs[i].user = &infos[i];
    pl.t0 = pl.last = pl.synced = now_s();
    rc = shoal_hub_fetch(h, pcs, npc, piece_done, on_progress, &pl, err, sizeof err);
    char serr[1024];
    int src2 = sync_logs(&pl, serr, sizeof serr); /* what did arrive stays, for the rerun */
    if (!rc && src2) {
        snprintf(err, sizeof err, "%s", serr);
        rc = src2;
    }
    if (rc)
        goto fail_model;
    progress(&pl, 1);
    /* finish each file: hash it whole, rename, store the sum (as pack does) */
    for (int i = 0; i < pl.nf; i++) {
        lfile *f = &pl.f[i];
        if (f->done)
            continue;
        char part[4400], logp[4400];
        snprintf(part, sizeof part, "%s.part", f->path);
        snprintf(logp, sizeof logp, "%s.part.log", f->path);
        if (fsync(f->fd)) {
            snprintf(err, sizeof err, "%s: fsync: %s", part, strerror(errno));
            goto fail;
        }
        close(f->fd);
        f->fd = -1;
        if ((rc = shoal_packfile_hash(part, f->hash, NULL, err, sizeof err)))
            goto fail;
        if (rename(part, f->path)) {
            snprintf(err, sizeof err, "%s: rename: %s", f->path, strerror(errno));
            goto fail;
        }
        if ((rc = shoal_pack_write_sum(f->path, f->hash, err, sizeof err)))
            goto fail;
        close(f->logfd);
        f->logfd = -1;
        unlink(logp);
        f->done = 1;
    }
    j.dry = 0;
    j.layer = done_layer;
    if ((ret = shoal_pack_build(&j, &sum, err, sizeof err)))
        goto fail;
    /* the header-only copy has served its purpose */
    rm_stub(stub, &pl);
    shoal_hub_stats hs;
    shoal_hub_get_stats(h, &hs);
    double secs = now_s() - t_start;
    if (json)
        printf("{\"dir\": \"%s\", \"worker\": \"%s\", \"experts\": %zu, \"files\": %d, \"pack_bytes\": %llu, "
               "\"downloaded\": %llu, \"discarded\": %llu, \"kept\": %llu, \"requests\": %llu, \"retried\": %llu, "
               "\"http2\": %s, \"seconds\": %.3f}\n",
               to, trunk ? "trunk" : worker, sum.nexperts, sum.nfiles, (unsigned long long)packbytes,
               (unsigned long long)hs.bytes, (unsigned long long)hs.discarded, (unsigned long long)pl.kept,
               (unsigned long long)hs.requests, (unsigned long long)hs.retried, hs.http2 ? "true" : "false", secs);
    else
        printf("pull %s: %s %s, %zu experts%s%s in %d files, %.3f GiB; downloaded %.3f GiB in %llu requests "
               "(%llu retried, %.3f GiB thrown away), %.3f GiB verified from a previous run, %.1f s\n",
               to, trunk ? "the trunk" : "worker", trunk ? "(no routed experts)" : worker, sum.nexperts,
               sum.trunk[0] ? " and trunk rows " : "", sum.trunk, sum.nfiles, (double)sum.total_size / 1073741824.0,
               (double)hs.bytes / 1073741824.0, (unsigned long long)hs.requests, (unsigned long long)hs.retried,
               (double)hs.discarded / 1073741824.0, (double)pl.kept / 1073741824.0, secs);
    ret = 0;
    goto done;
fail_model:
    if (rc == SHOAL_EMODEL || rc == SHOAL_EFORMAT)
        ret = 3;
fail:
    if (!pl.quiet && pl.tty)
        fputc('\n', stderr);
    fprintf(stderr, "shoal pull: %s\n", err);
done:
    for (int i = 0; i < pl.nf; i++) {
        lfile *f = &pl.f[i];
        if (f->fd >= 0)
            close(f->fd);
        if (f->logfd >= 0)
            close(f->logfd);
        for (int k = 0; k < f->nsrc; k++)
            free(f->src[k].file);
        free(f->src);
        free(f->hdr);
        free(f->pend);
    }
    free(pl.f);
    free(pl.sh);
    for (size_t i = 0; i < npc; i++)
        free((void *)pcs[i].seg);
    free(pcs);
    free(infos);
    free(buf);
    json_decref(pn.files);
    shoal_hub_close(h);
    if (token) {
        sodium_memzero(token, strlen(token));
        free(token);
    }
    return ret;
}
