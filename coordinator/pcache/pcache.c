/* pcache: the prefix cache (pcache.h) -- state file format, prefix index,
 * memory and disk tiers. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/err.h"
#include "common/log.h"
#include "common/memplan.h"
#include "common/metrics.h"
#include "coordinator/pcache/pcache.h"

static const uint8_t MAGIC[8] = {'S', 'H', 'O', 'A', 'L', 'S', 'T', 0x1a};
#define MAX_LOGITS (1u << 24)

/* ---- checksums and hashes ------------------------------------------------- */

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull

static uint64_t rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static uint64_t rd64(const uint8_t *p)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8); /* one load: the checksum runs over whole captures (0.7 GB on K3) */
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void wr64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void wr32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t round64(uint64_t acc, uint64_t w)
{
    return rotl(acc + w * P2, 31) * P1;
}

uint64_t shoal_pcache_sum(uint64_t seed, const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t a[4] = {seed + P1 + P2, seed + P2, seed, seed - P1};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            a[k] = round64(a[k], rd64(b + i + 8 * k));
    uint64_t h = rotl(a[0], 1) + rotl(a[1], 7) + rotl(a[2], 12) + rotl(a[3], 18) + (uint64_t)n;
    for (; i + 8 <= n; i += 8)
        h = rotl(h ^ round64(0, rd64(b + i)), 27) * P1 + P3;
    for (; i < n; i++)
        h = rotl(h ^ (b[i] * P3), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

#define HASH_M 0x100000001B3ull

uint64_t shoal_pcache_ids_hash(const int32_t *ids, int n)
{
    uint64_t h = 0;
    for (int i = 0; i < n; i++)
        h = h * HASH_M + (uint64_t)(uint32_t)ids[i] + 1;
    return h;
}

/* ---- the file format ---------------------------------------------------------- */

/* The payload checksum: chained over the three parts, so a writer need not
 * join them into one buffer. */
static uint64_t payload_sum(const void *ids, size_t ni, const void *state, size_t ns, const void *logits, size_t nl)
{
    uint64_t h = shoal_pcache_sum(0, ids, ni);
    h = shoal_pcache_sum(h, state, ns);
    return shoal_pcache_sum(h, logits, nl);
}

uint64_t shoal_pcache_file_size(const shoal_pcache_hdr *h)
{
    if (h->n_ids > SHOAL_PCACHE_MAX_IDS || h->n_logits > MAX_LOGITS || h->state_bytes > (UINT64_C(1) << 50))
        return 0;
    return SHOAL_PCACHE_HDR_BYTES + 4ull * h->n_ids + h->state_bytes + 4ull * h->n_logits;
}

void shoal_pcache_hdr_encode(uint8_t out[SHOAL_PCACHE_HDR_BYTES], const shoal_pcache_hdr *h)
{
    memset(out, 0, SHOAL_PCACHE_HDR_BYTES);
    memcpy(out, MAGIC, 8);
    wr32(out + 8, h->version);
    wr32(out + 12, SHOAL_PCACHE_HDR_BYTES);
    memcpy(out + 16, h->fingerprint, SHOAL_PCACHE_FP_BYTES);
    wr32(out + 48, h->n_ids);
    wr32(out + 52, h->n_logits);
    wr64(out + 56, h->state_bytes);
    wr64(out + 64, h->ids_hash);
    wr64(out + 72, h->payload_sum);
    wr64(out + 80, shoal_pcache_sum(0, out, 80));
}

int shoal_pcache_hdr_decode(shoal_pcache_hdr *h, const uint8_t *buf, size_t n, char *err, size_t errlen)
{
    memset(h, 0, sizeof *h);
    if (n < SHOAL_PCACHE_HDR_BYTES)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "truncated header (%zu of %d bytes)", n,
                             SHOAL_PCACHE_HDR_BYTES);
    if (memcmp(buf, MAGIC, 8))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "not a shoal state file (magic)");
    h->version = rd32(buf + 8);
    if (h->version != SHOAL_PCACHE_VERSION)
        return shoal_err_set(err, errlen, SHOAL_EVERSION, "state file version %u, this build reads %d", h->version,
                             SHOAL_PCACHE_VERSION);
    if (rd32(buf + 12) != SHOAL_PCACHE_HDR_BYTES)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "header size %u, expected %d", rd32(buf + 12),
                             SHOAL_PCACHE_HDR_BYTES);
    if (rd64(buf + 80) != shoal_pcache_sum(0, buf, 80))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "header checksum mismatch");
    if (rd64(buf + 88) != 0)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "reserved header field not 0");
    memcpy(h->fingerprint, buf + 16, SHOAL_PCACHE_FP_BYTES);
    h->n_ids = rd32(buf + 48);
    h->n_logits = rd32(buf + 52);
    h->state_bytes = rd64(buf + 56);
    h->ids_hash = rd64(buf + 64);
    h->payload_sum = rd64(buf + 72);
    if (h->n_ids < 1 || h->n_ids > SHOAL_PCACHE_MAX_IDS)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "n_ids %u outside [1, %d]", h->n_ids, SHOAL_PCACHE_MAX_IDS);
    if (h->n_logits > MAX_LOGITS)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "n_logits %u above %u", h->n_logits, MAX_LOGITS);
    if (!shoal_pcache_file_size(h))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "state_bytes %llu out of range",
                             (unsigned long long)h->state_bytes);
    return 0;
}

int shoal_pcache_verify(shoal_pcache_hdr *h, const uint8_t *buf, size_t n, char *err, size_t errlen)
{
    int rc = shoal_pcache_hdr_decode(h, buf, n, err, errlen);
    if (rc)
        return rc;
    uint64_t want = shoal_pcache_file_size(h);
    if ((uint64_t)n != want)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "file is %zu bytes, its header says %llu%s", n,
                             (unsigned long long)want, (uint64_t)n < want ? " (truncated)" : "");
    const uint8_t *ids = buf + SHOAL_PCACHE_HDR_BYTES;
    uint64_t hh = 0;
    for (uint32_t i = 0; i < h->n_ids; i++)
        hh = hh * HASH_M + (uint64_t)rd32(ids + 4ull * i) + 1;
    if (hh != h->ids_hash)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "token ids hash mismatch");
    const uint8_t *state = ids + 4ull * h->n_ids;
    if (payload_sum(ids, 4ull * h->n_ids, state, (size_t)h->state_bytes, state + h->state_bytes,
                    4ull * h->n_logits) != h->payload_sum)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "payload checksum mismatch");
    return 0;
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n > (1u << 30) ? (1u << 30) : n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

int shoal_pcache_file_write(const char *path, const uint8_t fp[SHOAL_PCACHE_FP_BYTES], const int32_t *ids, int n,
                            const void *state, size_t state_bytes, const float *logits, int n_logits, char *err,
                            size_t errlen)
{
    if (n < 1 || n > SHOAL_PCACHE_MAX_IDS || n_logits < 0 || (unsigned)n_logits > MAX_LOGITS || (n_logits && !logits))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s: %d ids / %d logits out of range", path, n, n_logits);
    shoal_pcache_hdr h = {.version = SHOAL_PCACHE_VERSION,
                          .n_ids = (uint32_t)n,
                          .n_logits = (uint32_t)n_logits,
                          .state_bytes = state_bytes,
                          .ids_hash = shoal_pcache_ids_hash(ids, n)};
    memcpy(h.fingerprint, fp, SHOAL_PCACHE_FP_BYTES);
    /* ids as little-endian bytes; state and logits as they are in memory
     * (little-endian hosts: the only ones built for) */
    uint8_t *idb = shoal_xmalloc(4 * (size_t)n);
    for (int i = 0; i < n; i++)
        wr32(idb + 4 * (size_t)i, (uint32_t)ids[i]);
    h.payload_sum = payload_sum(idb, 4 * (size_t)n, state, state_bytes, logits, 4 * (size_t)n_logits);
    uint8_t hb[SHOAL_PCACHE_HDR_BYTES];
    shoal_pcache_hdr_encode(hb, &h);
    size_t pl = strlen(path);
    char *tmp = shoal_xmalloc(pl + 8);
    snprintf(tmp, pl + 8, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    int rc = fd < 0 ? -errno : 0;
    if (!rc)
        rc = write_all(fd, hb, sizeof hb);
    if (!rc)
        rc = write_all(fd, idb, 4 * (size_t)n);
    if (!rc)
        rc = write_all(fd, state, state_bytes);
    if (!rc && n_logits)
        rc = write_all(fd, logits, 4 * (size_t)n_logits);
    if (fd >= 0 && close(fd) && !rc)
        rc = -errno;
    if (!rc && rename(tmp, path))
        rc = -errno;
    if (rc) {
        unlink(tmp);
        shoal_err_set(err, errlen, rc, "%s: cannot write: %s", path, strerror(-rc));
    }
    free(tmp);
    free(idb);
    return rc;
}

static int read_all(int fd, void *p, size_t n, uint64_t off)
{
    char *c = p;
    while (n) {
        ssize_t r = pread(fd, c, n > (1u << 30) ? (1u << 30) : n, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return SHOAL_EFORMAT; /* shorter than its size said: truncated meanwhile */
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

/* A file's header and ids (the index needs no more). */
static int read_head(const char *path, shoal_pcache_hdr *h, int32_t **ids, uint64_t *fsize, char *err, size_t errlen)
{
    *ids = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "cannot open: %s", strerror(errno));
    struct stat st;
    uint8_t hb[SHOAL_PCACHE_HDR_BYTES];
    int rc = fstat(fd, &st) ? -errno : 0;
    if (!rc && (uint64_t)st.st_size < SHOAL_PCACHE_HDR_BYTES)
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "truncated header (%lld bytes)", (long long)st.st_size);
    else if (!rc && (rc = read_all(fd, hb, sizeof hb, 0)))
        shoal_err_set(err, errlen, rc, "cannot read the header");
    else if (!rc)
        rc = shoal_pcache_hdr_decode(h, hb, sizeof hb, err, errlen);
    if (!rc && (uint64_t)st.st_size != shoal_pcache_file_size(h))
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "file is %lld bytes, its header says %llu%s",
                           (long long)st.st_size, (unsigned long long)shoal_pcache_file_size(h),
                           (uint64_t)st.st_size < shoal_pcache_file_size(h) ? " (truncated)" : "");
    if (!rc) {
        uint8_t *b = shoal_xmalloc(4 * (size_t)h->n_ids);
        if ((rc = read_all(fd, b, 4 * (size_t)h->n_ids, SHOAL_PCACHE_HDR_BYTES))) {
            shoal_err_set(err, errlen, rc, "cannot read the ids");
        } else {
            *ids = shoal_xmalloc(4 * (size_t)h->n_ids);
            for (uint32_t i = 0; i < h->n_ids; i++)
                (*ids)[i] = (int32_t)rd32(b + 4 * (size_t)i);
            if (shoal_pcache_ids_hash(*ids, (int)h->n_ids) != h->ids_hash) {
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "token ids hash mismatch");
                free(*ids);
                *ids = NULL;
            }
        }
        free(b);
    }
    *fsize = (uint64_t)st.st_size;
    close(fd);
    return rc;
}

/* Reads the whole file at path into a fresh buffer of exactly size bytes
 * (free() releases it). With O_DIRECT where the file system takes it: a
 * capture is large (~0.7 GB on K3), read once, and verified and copied right
 * after, so the page cache gains nothing from it, and a cold read measured
 * 0.40x the time of a buffered one (docs/PERFORMANCE.md "Prefix cache":
 * reading a capture back); it also leaves the cached model pages alone.
 * Nothing is mapped: a file truncated meanwhile ends the read early
 * (SHOAL_EFORMAT), it cannot fault. */
#define DIRECT_ALIGN 4096
static int read_file(const char *path, uint64_t size, uint8_t **out)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    int direct = fd >= 0;
    if (fd < 0 && errno == EINVAL) /* a file system without O_DIRECT (tmpfs) */
        fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = fstat(fd, &st) ? -errno : 0;
    if (!rc && (uint64_t)st.st_size != size)
        rc = SHOAL_EFORMAT;
    uint8_t *b = NULL;
    size_t al = ((size_t)size + DIRECT_ALIGN - 1) & ~(size_t)(DIRECT_ALIGN - 1);
    if (!rc && posix_memalign((void **)&b, DIRECT_ALIGN, al ? al : DIRECT_ALIGN))
        SHOAL_PANIC("out of memory allocating %zu bytes for a prefix cache file", al);
    if (!rc && direct) {
        /* whole aligned blocks from aligned offsets; the last read stops at
         * the end of the file */
        size_t off = 0;
        while (off < (size_t)size) {
            size_t want = al - off > (1u << 30) ? (1u << 30) : al - off;
            ssize_t r = pread(fd, b + off, want, (off_t)off);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0 && errno == EINVAL && off == 0) { /* the device refuses this alignment */
                direct = 0;
                int fl = fcntl(fd, F_GETFL);
                if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_DIRECT))
                    rc = -errno;
                break;
            }
            if (r < 0) {
                rc = -errno;
                break;
            }
            if (r == 0) {
                rc = SHOAL_EFORMAT; /* shorter than its size said: truncated meanwhile */
                break;
            }
            off += (size_t)r;
        }
        if (!rc && direct && off != (size_t)size)
            rc = SHOAL_EFORMAT; /* longer than its size said: grown meanwhile */
    }
    if (!rc && !direct)
        rc = read_all(fd, b, (size_t)size, 0);
    close(fd);
    if (rc) {
        free(b);
        return rc;
    }
    *out = b;
    return 0;
}

static int check_model(const shoal_pcache_hdr *h, const uint8_t *fp, size_t fixed, size_t per_token, char *err,
                       size_t errlen)
{
    if (memcmp(h->fingerprint, fp, SHOAL_PCACHE_FP_BYTES))
        return shoal_err_set(err, errlen, SHOAL_EFINGERPRINT, "written for another model (fingerprint differs)");
    uint64_t want = (uint64_t)fixed + (uint64_t)h->n_ids * per_token;
    if (h->state_bytes != want)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "state of %llu bytes, this model's at %u tokens is %llu",
                             (unsigned long long)h->state_bytes, h->n_ids, (unsigned long long)want);
    return 0;
}

int shoal_pcache_file_read(shoal_pcache_file **out, const char *path, const uint8_t fp[SHOAL_PCACHE_FP_BYTES],
                           size_t state_fixed, size_t state_per_token, char *err, size_t errlen)
{
    *out = NULL;
    char why[256];
    shoal_pcache_hdr h;
    int32_t *ids;
    uint64_t size;
    int rc = read_head(path, &h, &ids, &size, why, sizeof why);
    free(ids);
    if (!rc)
        rc = check_model(&h, fp, state_fixed, state_per_token, why, sizeof why);
    uint8_t *buf = NULL;
    if (!rc && (rc = read_file(path, size, &buf)))
        snprintf(why, sizeof why, "cannot read: %s", rc < 0 ? strerror(-rc) : "changed size");
    if (!rc)
        rc = shoal_pcache_verify(&h, buf, (size_t)size, why, sizeof why);
    if (rc) {
        free(buf);
        return shoal_err_set(err, errlen, rc, "state file %s refused: %s", path, why);
    }
    shoal_pcache_file *f = shoal_xcalloc(1, sizeof *f);
    f->h = h;
    f->buf = buf;
    f->ids = shoal_xmalloc(4 * (size_t)h.n_ids);
    for (uint32_t i = 0; i < h.n_ids; i++)
        f->ids[i] = (int32_t)rd32(buf + SHOAL_PCACHE_HDR_BYTES + 4 * (size_t)i);
    f->state = buf + SHOAL_PCACHE_HDR_BYTES + 4 * (size_t)h.n_ids;
    if (h.n_logits) {
        const uint8_t *lb = (const uint8_t *)f->state + h.state_bytes;
        f->logits = shoal_xmalloc(4 * (size_t)h.n_logits);
        for (uint32_t i = 0; i < h.n_logits; i++) {
            uint32_t u = rd32(lb + 4 * (size_t)i);
            memcpy(&f->logits[i], &u, 4);
        }
    }
    *out = f;
    return 0;
}

void shoal_pcache_file_free(shoal_pcache_file *f)
{
    if (!f)
        return;
    free(f->ids);
    free(f->logits);
    free(f->buf);
    free(f);
}

int shoal_pcache_fingerprint(uint8_t out[SHOAL_PCACHE_FP_BYTES], const shoal_model *m, char *err, size_t errlen)
{
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    const shoal_st *st = shoal_model_store(m);
    crypto_generichash_state h;
    crypto_generichash_init(&h, NULL, 0, SHOAL_PCACHE_FP_BYTES);
    char line[512];
    int n = snprintf(line, sizeof line, "shoal state fingerprint 1\nlayout %zu %zu %d\n", info.seq_fixed_bytes,
                     info.seq_bytes_per_token, info.vocab);
    crypto_generichash_update(&h, (const unsigned char *)line, (unsigned long long)n);
    size_t nt = shoal_st_count(st);
    for (size_t i = 0; i < nt; i++) {
        const shoal_tensor *t = shoal_st_at(st, i);
        n = snprintf(line, sizeof line, "tensor %s %s %d", t->name, shoal_dtype_name(t->dtype), t->ndim);
        for (int d = 0; d < t->ndim && n < (int)sizeof line - 24; d++)
            n += snprintf(line + n, sizeof line - (size_t)n, " %lld", (long long)t->shape[d]);
        if (n < (int)sizeof line - 24)
            n += snprintf(line + n, sizeof line - (size_t)n, " %llu\n", (unsigned long long)t->nbytes);
        if (n >= (int)sizeof line)
            n = (int)sizeof line - 1;
        crypto_generichash_update(&h, (const unsigned char *)line, (unsigned long long)n);
        uint8_t head[64];
        size_t k = t->nbytes < sizeof head ? (size_t)t->nbytes : sizeof head;
        if (k) {
            int rc = shoal_st_pread(st, t, 0, head, k, err, errlen);
            if (rc)
                return rc;
            crypto_generichash_update(&h, head, k);
        }
    }
    crypto_generichash_final(&h, out, SHOAL_PCACHE_FP_BYTES);
    return 0;
}

/* ---- the cache ------------------------------------------------------------------ */

typedef struct {
    int32_t *ids;
    int n;
    uint64_t hash;  /* shoal_pcache_ids_hash(ids, n) */
    void *blob;     /* memory tier: the exported state, or NULL */
    size_t bytes;   /* state bytes */
    int on_disk;    /* its file is in the directory (indexed at open, or written) */
    int pending;    /* its file is queued to the writer, not written yet */
    uint64_t last;  /* LRU tick */
} entry;

/* A capture on its way to the directory (the writer thread owns it). */
typedef struct wjob {
    struct wjob *next;
    char *path;
    int32_t *ids;
    int n;
    uint64_t hash;
    void *blob;
    size_t bytes;
    int ok;         /* done list: 1 when the file was written */
} wjob;

#define WRITER_QUEUE 2                /* captures queued at most (each holds a copy of its state) */
#define WRITER_WAIT_NS (600ull * 1000000000ull) /* longest wait for room in the queue or a flush */

struct shoal_pcache {
    shoal_pcache_opts o;
    uint8_t fp[SHOAL_PCACHE_FP_BYTES];
    char *dir;
    size_t fixed, per_token;
    entry *e;
    int ne, cap;
    uint64_t tick;
    uint64_t mem;
    uint64_t *ph; /* prefix hashes of the prompt being looked up (grown as needed) */
    int ph_cap;
    pthread_mutex_t mu; /* st, and the writer's queue and done list */
    shoal_pcache_stats st;
    /* the writer thread (with a directory): captures are written off the
     * model thread, so a prefill does not wait for the disk (a full-K3
     * capture is ~0.5-0.7 GB) */
    pthread_t writer;
    int has_writer, stopping;
    int dirfd;            /* the directory, flock'ed while the cache is open (-1: none) */
    uint64_t disk;        /* bytes of this cache's files: on disk, and queued to the writer */
    pthread_cond_t wcv;   /* queue non-empty or stopping (writer waits) */
    pthread_cond_t dcv;   /* a job finished (model thread waits) */
    wjob *qhead, *qtail, *done;
    int queued;           /* in the queue or being written */
};

static void entry_path(const shoal_pcache *pc, const entry *e, char *out, size_t n)
{
    snprintf(out, n, "%s/pc-%016llx-%d.shst", pc->dir, (unsigned long long)e->hash, e->n);
}

/* The size of entry e's file. */
static uint64_t file_bytes(const entry *e)
{
    return SHOAL_PCACHE_HDR_BYTES + 4ull * (uint64_t)e->n + e->bytes;
}

/* Entry e's file leaves the disk tier; removed from the directory when rm. */
static void forget_file(shoal_pcache *pc, entry *e, int rm)
{
    if (!e->on_disk)
        return;
    if (rm) {
        char path[4096];
        entry_path(pc, e, path, sizeof path);
        if (unlink(path) && errno != ENOENT)
            SHOAL_WARN("prefix cache: cannot remove %s: %s", path, strerror(errno));
    }
    pc->disk -= file_bytes(e);
    e->on_disk = 0;
}

/* A disk hit: the file's modification time is its age across restarts. */
static void touch_file(shoal_pcache *pc, const entry *e)
{
    if (!e->on_disk)
        return;
    char path[4096];
    entry_path(pc, e, path, sizeof path);
    (void)utimensat(AT_FDCWD, path, NULL, 0); /* best effort: an age, not data */
}

static void count(shoal_pcache *pc, void (*f)(shoal_pcache_stats *, const void *), const void *arg)
{
    pthread_mutex_lock(&pc->mu);
    f(&pc->st, arg);
    pc->st.mem_bytes = pc->mem;
    pthread_mutex_unlock(&pc->mu);
}

static void add_refused(shoal_pcache_stats *s, const void *a)
{
    (void)a;
    s->refused++;
}

static void add_removed(shoal_pcache_stats *s, const void *a)
{
    (void)a;
    s->refused++;
    s->removed++;
}

static void reap(shoal_pcache *pc);

static void recount(shoal_pcache *pc)
{
    pthread_mutex_lock(&pc->mu);
    pc->st.mem_bytes = pc->mem;
    pc->st.disk_bytes = pc->disk;
    pc->st.mem_entries = pc->st.disk_entries = 0;
    for (int k = 0; k < pc->ne; k++) {
        pc->st.mem_entries += pc->e[k].blob != NULL;
        pc->st.disk_entries += pc->e[k].on_disk;
    }
    pthread_mutex_unlock(&pc->mu);
}

/* Entry i leaves the index; its file (when on disk) is removed when rm, and
 * leaves the disk budget either way. A file still queued to the writer
 * comes back as an entry when it is written (reap). */
static void drop_entry(shoal_pcache *pc, int i, int rm)
{
    entry *e = &pc->e[i];
    forget_file(pc, e, rm);
    if (e->blob) {
        pc->mem -= e->bytes;
        free(e->blob);
    }
    free(e->ids);
    pc->e[i] = pc->e[--pc->ne];
    recount(pc);
}

/* Frees entry i's memory copy (it leaves the index unless it is on disk). */
static void evict(shoal_pcache *pc, int i)
{
    entry *e = &pc->e[i];
    pthread_mutex_lock(&pc->mu);
    pc->st.evictions++;
    pthread_mutex_unlock(&pc->mu);
    if (!e->on_disk && !e->pending) {
        drop_entry(pc, i, 0);
        return;
    }
    pc->mem -= e->bytes;
    free(e->blob);
    e->blob = NULL;
    recount(pc);
}

void shoal_pcache_shrink(shoal_pcache *pc, uint64_t bytes)
{
    if (!pc)
        return;
    reap(pc);
    while (pc->mem > bytes) {
        int lru = -1;
        for (int i = 0; i < pc->ne; i++)
            if (pc->e[i].blob && (lru < 0 || pc->e[i].last < pc->e[lru].last))
                lru = i;
        if (lru < 0)
            break;
        evict(pc, lru);
    }
}

uint64_t shoal_pcache_mem_bytes(const shoal_pcache *pc)
{
    return pc ? pc->mem : 0;
}

static entry *add_entry(shoal_pcache *pc, const int32_t *ids, int n, uint64_t hash)
{
    if (pc->ne == pc->cap) {
        /* full: the least recently used entry leaves the index */
        int lru = 0;
        for (int i = 1; i < pc->ne; i++)
            if (pc->e[i].last < pc->e[lru].last)
                lru = i;
        drop_entry(pc, lru, 1); /* its file too: an unindexed file would only come back at a restart */
    }
    entry *e = &pc->e[pc->ne++];
    memset(e, 0, sizeof *e);
    e->ids = shoal_xmalloc(4 * (size_t)n);
    memcpy(e->ids, ids, 4 * (size_t)n);
    e->n = n;
    e->hash = hash;
    e->bytes = pc->fixed + (size_t)n * pc->per_token;
    e->last = ++pc->tick;
    return e;
}

static int find_exact(shoal_pcache *pc, const int32_t *ids, int n, uint64_t hash)
{
    for (int i = 0; i < pc->ne; i++)
        if (pc->e[i].n == n && pc->e[i].hash == hash && !memcmp(pc->e[i].ids, ids, 4 * (size_t)n))
            return i;
    return -1;
}

typedef struct {
    uint64_t n;
} disk_evict_add;

static void add_disk_evictions(shoal_pcache_stats *s, const void *a)
{
    s->disk_evictions += ((const disk_evict_add *)a)->n;
}

/* Removes the least recently used files (not those queued to the writer)
 * until need more bytes fit the disk budget. 1 when they fit. */
static int disk_room(shoal_pcache *pc, uint64_t need)
{
    uint64_t cap = pc->o.disk_bytes;
    if (!cap)
        return 1;
    if (need > cap)
        return 0;
    disk_evict_add n = {0};
    int fit = 1;
    while (pc->disk + need > cap) {
        int lru = -1;
        for (int i = 0; i < pc->ne; i++)
            if (pc->e[i].on_disk && !pc->e[i].pending && (lru < 0 || pc->e[i].last < pc->e[lru].last))
                lru = i;
        if (lru < 0) {
            fit = 0; /* the rest is still being written */
            break;
        }
        n.n++;
        if (pc->e[lru].blob)
            forget_file(pc, &pc->e[lru], 1); /* stays in memory */
        else
            drop_entry(pc, lru, 1);
    }
    if (n.n)
        count(pc, add_disk_evictions, &n);
    recount(pc);
    return fit;
}

static void *writer_main(void *arg)
{
    shoal_pcache *pc = arg;
    pthread_mutex_lock(&pc->mu);
    for (;;) {
        while (!pc->qhead && !pc->stopping)
            pthread_cond_wait(&pc->wcv, &pc->mu);
        if (!pc->qhead)
            break; /* stopping, and everything queued is written */
        wjob *j = pc->qhead;
        pc->qhead = j->next;
        if (!pc->qhead)
            pc->qtail = NULL;
        pthread_mutex_unlock(&pc->mu);
        uint64_t t0 = shoal_metrics_now_ns();
        char why[320];
        j->ok = shoal_pcache_file_write(j->path, pc->fp, j->ids, j->n, j->blob, j->bytes, NULL, 0, why, sizeof why) == 0;
        if (!j->ok)
            SHOAL_WARN("prefix cache: %s", why);
        double secs = (double)(shoal_metrics_now_ns() - t0) * 1e-9;
        free(j->blob);
        j->blob = NULL;
        pthread_mutex_lock(&pc->mu);
        if (j->ok) {
            pc->st.disk_writes++;
            pc->st.disk_write_bytes += j->bytes;
        }
        pc->st.disk_write_s += secs;
        j->next = pc->done;
        pc->done = j;
        pc->queued--;
        pthread_cond_broadcast(&pc->dcv);
    }
    pthread_mutex_unlock(&pc->mu);
    return NULL;
}

/* Model thread: the writer's finished jobs update the index (the entry is
 * now on disk; one evicted meanwhile comes back as a disk entry; a failed
 * write leaves an entry without a copy out of the index). */
static void reap(shoal_pcache *pc)
{
    if (!pc->has_writer)
        return;
    pthread_mutex_lock(&pc->mu);
    wjob *d = pc->done;
    pc->done = NULL;
    pthread_mutex_unlock(&pc->mu);
    while (d) {
        wjob *j = d;
        d = d->next;
        int i = find_exact(pc, j->ids, j->n, j->hash);
        uint64_t fb = SHOAL_PCACHE_HDR_BYTES + 4ull * (uint64_t)j->n + j->bytes;
        /* the job reserved fb bytes of the disk budget when it was queued */
        if (!j->ok || (i >= 0 && pc->e[i].on_disk))
            pc->disk -= fb; /* not written, or a second write of a file already counted */
        if (i >= 0) {
            pc->e[i].pending = 0;
            if (j->ok)
                pc->e[i].on_disk = 1;
            if (!pc->e[i].on_disk && !pc->e[i].blob)
                drop_entry(pc, i, 0);
        } else if (j->ok) {
            add_entry(pc, j->ids, j->n, j->hash)->on_disk = 1;
        }
        free(j->path);
        free(j->ids);
        free(j);
    }
    recount(pc);
}

/* Waits until the writer has at most `room` jobs (deadline
 * WRITER_WAIT_NS); 0, or SHOAL_ETIMEOUT. */
static int wait_queue(shoal_pcache *pc, int room)
{
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)(WRITER_WAIT_NS / 1000000000ull);
    int rc = 0;
    pthread_mutex_lock(&pc->mu);
    while (pc->queued > room && rc == 0)
        rc = pthread_cond_timedwait(&pc->dcv, &pc->mu, &dl);
    int late = pc->queued > room;
    pthread_mutex_unlock(&pc->mu);
    reap(pc);
    return late ? SHOAL_ETIMEOUT : 0;
}

void shoal_pcache_flush(shoal_pcache *pc)
{
    if (pc && pc->has_writer && wait_queue(pc, 0))
        SHOAL_WARN("prefix cache: the directory's writes did not finish in %llu s",
                   (unsigned long long)(WRITER_WAIT_NS / 1000000000ull));
}

/* 1 when name is a file name this cache writes ("pc-<16 hex>-<n>.shst"),
 * with suffix after it ("" or ".tmp"). */
static int own_name(const char *name, const char *suffix)
{
    if (strncmp(name, "pc-", 3))
        return 0;
    const char *p = name + 3;
    for (int k = 0; k < 16; k++, p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f')))
            return 0;
    if (*p++ != '-' || *p < '0' || *p > '9')
        return 0;
    while (*p >= '0' && *p <= '9')
        p++;
    return !strncmp(p, ".shst", 5) && !strcmp(p + 5, suffix);
}

static int by_age(const void *a, const void *b)
{
    const entry *x = *(entry *const *)a, *y = *(entry *const *)b;
    return x->last < y->last ? -1 : x->last > y->last;
}

typedef struct {
    uint64_t removed, refused;
} open_add;

static void add_open(shoal_pcache_stats *s, const void *a)
{
    const open_add *o = a;
    s->removed += o->removed;
    s->refused += o->refused;
}

static void index_dir(shoal_pcache *pc)
{
    DIR *d = opendir(pc->dir);
    if (!d)
        return;
    struct dirent *de;
    size_t dl = strlen(pc->dir);
    open_add oa = {0};
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        char *path = shoal_xmalloc(dl + nl + 2);
        snprintf(path, dl + nl + 2, "%s/%s", pc->dir, de->d_name);
        if (own_name(de->d_name, ".tmp")) {
            /* a write that never reached its rename: the process stopped
             * during it (the directory is locked: no other writer) */
            if (unlink(path) == 0) {
                SHOAL_WARN("prefix cache: removed %s (an unfinished write: the process stopped during it)", path);
                oa.removed++;
            } else {
                SHOAL_WARN("prefix cache: cannot remove the unfinished write %s: %s", path, strerror(errno));
            }
            free(path);
            continue;
        }
        if (nl < 6 || strcmp(de->d_name + nl - 5, ".shst")) {
            free(path);
            continue;
        }
        int own = own_name(de->d_name, "");
        shoal_pcache_hdr h;
        int32_t *ids = NULL;
        uint64_t size;
        char why[256];
        struct stat st;
        int rc = read_head(path, &h, &ids, &size, why, sizeof why);
        /* damaged: this cache's file with a bad header, size or ids hash */
        int damaged = own && rc == SHOAL_EFORMAT;
        if (!rc) {
            rc = check_model(&h, pc->fp, pc->fixed, pc->per_token, why, sizeof why);
            damaged = own && rc == SHOAL_EFORMAT; /* this model's fingerprint, a wrong size */
        }
        if (!rc && h.n_logits)
            rc = shoal_err_set(why, sizeof why, SHOAL_EFORMAT, "carries logits (a `shoal run --save-state` file)");
        if (!rc && find_exact(pc, ids, (int)h.n_ids, h.ids_hash) >= 0)
            rc = shoal_err_set(why, sizeof why, SHOAL_EFORMAT, "a duplicate of another file's prefix");
        if (!rc) {
            char want[4096];
            entry tmp = {.hash = h.ids_hash, .n = (int)h.n_ids};
            entry_path(pc, &tmp, want, sizeof want);
            if (strcmp(want, path))
                rc = shoal_err_set(why, sizeof why, SHOAL_EFORMAT, "its name is not its prefix's (%s)",
                                   strrchr(want, '/') + 1);
        }
        if (!rc && stat(path, &st))
            rc = shoal_err_set(why, sizeof why, -errno, "cannot stat: %s", strerror(errno));
        if (rc && damaged && unlink(path) == 0) {
            SHOAL_WARN("prefix cache: %s refused: %s; removed (the prefix will be recomputed)", path, why);
            oa.removed++;
            oa.refused++;
        } else if (rc) {
            SHOAL_WARN("prefix cache: %s refused: %s (the prefix will be recomputed; the file is left in place)",
                       path, why);
            oa.refused++;
        } else {
            entry *e = add_entry(pc, ids, (int)h.n_ids, h.ids_hash);
            e->on_disk = 1;
            pc->disk += file_bytes(e);
            e->last = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
        }
        free(ids);
        free(path);
    }
    closedir(d);
    /* ages: the files' modification times, oldest first, as ticks */
    entry **o = shoal_xmalloc(sizeof *o * (size_t)(pc->ne ? pc->ne : 1));
    for (int i = 0; i < pc->ne; i++)
        o[i] = &pc->e[i];
    qsort(o, (size_t)pc->ne, sizeof *o, by_age);
    for (int i = 0; i < pc->ne; i++)
        o[i]->last = (uint64_t)i + 1;
    pc->tick = (uint64_t)pc->ne;
    free(o);
    count(pc, add_open, &oa);
    if (pc->o.disk_bytes == SHOAL_PCACHE_DISK_AUTO) {
        struct statvfs fs;
        uint64_t avail = statvfs(pc->dir, &fs) ? 0 : (uint64_t)fs.f_bavail * (uint64_t)fs.f_frsize;
        uint64_t cap = (avail + pc->disk) / 2;
        pc->o.disk_bytes = cap > SHOAL_PCACHE_DISK_AUTO_MAX ? SHOAL_PCACHE_DISK_AUTO_MAX : cap ? cap : 1;
        pthread_mutex_lock(&pc->mu);
        pc->st.disk_budget = pc->o.disk_bytes;
        pthread_mutex_unlock(&pc->mu);
    }
    /* a budget lowered since the files were written: the oldest go */
    uint64_t before = pc->disk;
    int ne = pc->ne;
    disk_room(pc, 0);
    if (pc->ne < ne) {
        char b1[32], b2[32];
        SHOAL_INFO("prefix cache: removed the %d least recently used files of %s (%s) to fit its budget of %s",
                   ne - pc->ne, pc->dir, shoal_memplan_fmt(before - pc->disk, b1, sizeof b1),
                   shoal_memplan_fmt(pc->o.disk_bytes, b2, sizeof b2));
    }
}

int shoal_pcache_open(shoal_pcache **out, const shoal_pcache_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (!o->model || !o->fingerprint)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "prefix cache: model and fingerprint are required");
    if (o->max_entries < 0 || o->max_entries > (1 << 20))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "prefix cache: max_entries %d outside [0, %d]",
                             o->max_entries, 1 << 20);
    int dfd = -1;
    if (o->dir) {
        if (mkdir(o->dir, 0755) && errno != EEXIST)
            return shoal_err_set(err, errlen, -errno, "--prefix-cache-dir %s: cannot create: %s", o->dir,
                                 strerror(errno));
        struct stat st;
        if (stat(o->dir, &st) || !S_ISDIR(st.st_mode) || access(o->dir, R_OK | W_OK | X_OK))
            return shoal_err_set(err, errlen, SHOAL_ECONFIG, "--prefix-cache-dir %s: not a writable directory",
                                 o->dir);
        /* one process per directory: its unfinished writes are then
         * certainly a stopped process's, and its budget is its own */
        dfd = open(o->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0)
            return shoal_err_set(err, errlen, -errno, "--prefix-cache-dir %s: cannot open: %s", o->dir,
                                 strerror(errno));
        if (flock(dfd, LOCK_EX | LOCK_NB)) {
            int e = errno;
            close(dfd);
            if (e == EWOULDBLOCK)
                return shoal_err_set(err, errlen, SHOAL_EBUSY,
                                     "--prefix-cache-dir %s is in use by another process (one server per "
                                     "directory)", o->dir);
            return shoal_err_set(err, errlen, -e, "--prefix-cache-dir %s: cannot lock: %s", o->dir, strerror(e));
        }
    }
    shoal_pcache *pc = shoal_xcalloc(1, sizeof *pc);
    pc->o = *o;
    memcpy(pc->fp, o->fingerprint, SHOAL_PCACHE_FP_BYTES);
    pc->dir = o->dir ? shoal_xstrdup(o->dir) : NULL;
    pc->dirfd = dfd;
    pc->o.dir = pc->dir;
    shoal_model_info info;
    shoal_model_get_info(o->model, &info);
    pc->fixed = info.seq_fixed_bytes;
    pc->per_token = info.seq_bytes_per_token;
    pc->cap = o->max_entries ? o->max_entries : 4096;
    pc->e = shoal_xcalloc((size_t)pc->cap, sizeof *pc->e);
    pthread_mutex_init(&pc->mu, NULL);
    pthread_cond_init(&pc->wcv, NULL);
    pthread_cond_init(&pc->dcv, NULL);
    pc->st.mem_budget = o->mem_bytes;
    pc->st.disk_budget = o->dir ? o->disk_bytes : 0;
    if (pc->dir) {
        index_dir(pc);
        int rc = pthread_create(&pc->writer, NULL, writer_main, pc);
        if (rc) {
            shoal_pcache_close(pc);
            return shoal_err_set(err, errlen, -rc, "prefix cache: cannot start the writer thread");
        }
        pc->has_writer = 1;
    }
    recount(pc);
    *out = pc;
    return 0;
}

void shoal_pcache_close(shoal_pcache *pc)
{
    if (!pc)
        return;
    if (pc->has_writer) { /* what is queued is written first: captures survive the restart */
        pthread_mutex_lock(&pc->mu);
        pc->stopping = 1;
        pthread_cond_broadcast(&pc->wcv);
        pthread_mutex_unlock(&pc->mu);
        pthread_join(pc->writer, NULL);
        reap(pc);
    }
    for (int i = 0; i < pc->ne; i++) {
        free(pc->e[i].ids);
        free(pc->e[i].blob);
    }
    free(pc->e);
    free(pc->ph);
    free(pc->dir);
    if (pc->dirfd >= 0)
        close(pc->dirfd); /* and the lock with it */
    pthread_cond_destroy(&pc->wcv);
    pthread_cond_destroy(&pc->dcv);
    pthread_mutex_destroy(&pc->mu);
    free(pc);
}

/* Indexes (into pc->e) of captured prefixes of ids[0..n) of length <= max,
 * longest first, into best[] (at most nbest). Returns how many. */
static int candidates(shoal_pcache *pc, const int32_t *ids, int n, int max, int *best, int nbest)
{
    if (max > n)
        max = n;
    if (max < 1 || !pc->ne)
        return 0;
    if (pc->ph_cap < max + 1) {
        pc->ph_cap = max + 1;
        pc->ph = shoal_xrealloc(pc->ph, sizeof *pc->ph * (size_t)pc->ph_cap);
    }
    uint64_t h = 0;
    pc->ph[0] = 0;
    for (int i = 0; i < max; i++)
        pc->ph[i + 1] = h = h * HASH_M + (uint64_t)(uint32_t)ids[i] + 1;
    int k = 0;
    for (int i = 0; i < pc->ne; i++) {
        const entry *e = &pc->e[i];
        if (e->n > max || pc->ph[e->n] != e->hash || memcmp(e->ids, ids, 4 * (size_t)e->n))
            continue;
        /* insert sorted by length, longest first */
        int j = k < nbest ? k++ : nbest;
        while (j > 0 && pc->e[best[j - 1]].n < e->n) {
            if (j < nbest)
                best[j] = best[j - 1];
            j--;
        }
        if (j < nbest)
            best[j] = i;
    }
    return k;
}

int shoal_pcache_lookup(shoal_pcache *pc, const int32_t *ids, int n, int max)
{
    int b;
    if (pc)
        reap(pc);
    if (!pc || !candidates(pc, ids, n, max, &b, 1))
        return 0;
    return pc->e[b].n;
}

int shoal_pcache_has(shoal_pcache *pc, const int32_t *ids, int n)
{
    return pc && n >= 1 && find_exact(pc, ids, n, shoal_pcache_ids_hash(ids, n)) >= 0;
}

typedef struct {
    uint64_t saved, reads, read_bytes;
    double read_s;
    int hit;
} resume_add;

static void add_resume(shoal_pcache_stats *s, const void *a)
{
    const resume_add *r = a;
    s->lookups++;
    s->hits += (uint64_t)r->hit;
    s->tokens_saved += r->saved;
    s->disk_reads += r->reads;
    s->disk_read_bytes += r->read_bytes;
    s->disk_read_s += r->read_s;
}

int shoal_pcache_resume(shoal_pcache *pc, const int32_t *ids, int n, int max, shoal_seq *seq)
{
    if (!pc)
        return 0;
    resume_add ra = {0};
    int got = 0;
    reap(pc);
    for (int tries = 0; tries < 8 && !got; tries++) {
        int b;
        if (!candidates(pc, ids, n, max, &b, 1))
            break;
        entry *e = &pc->e[b];
        if (e->n > shoal_seq_capacity(seq))
            break;
        char why[320];
        if (!e->blob && e->pending) {
            /* only in the writer's queue (no memory copy): wait for its file */
            if (wait_queue(pc, 0)) {
                SHOAL_WARN("prefix cache: a capture's write did not finish in time; the prefix is recomputed");
                break;
            }
            continue;
        }
        if (e->blob) {
            if (shoal_seq_import(seq, e->n, e->blob, e->bytes, why, sizeof why) == 0) {
                e->last = ++pc->tick;
                touch_file(pc, e);
                got = e->n;
            } else {
                SHOAL_ERROR("prefix cache: %s", why); /* a broken invariant, not input: sizes are ours */
                drop_entry(pc, b, 0);
            }
            continue;
        }
        /* disk tier: read, verify, import; keep a memory copy when it fits */
        char path[4096];
        entry_path(pc, e, path, sizeof path);
        uint64_t t0 = shoal_metrics_now_ns();
        shoal_pcache_file *f = NULL;
        int rc = shoal_pcache_file_read(&f, path, pc->fp, pc->fixed, pc->per_token, why, sizeof why);
        if (!rc && (f->h.n_ids != (uint32_t)e->n || memcmp(f->ids, e->ids, 4 * (size_t)e->n)))
            rc = shoal_err_set(why, sizeof why, SHOAL_EFORMAT, "state file %s refused: its ids changed", path);
        if (!rc)
            rc = shoal_seq_import(seq, e->n, f->state, (size_t)f->h.state_bytes, why, sizeof why);
        ra.read_s += (double)(shoal_metrics_now_ns() - t0) * 1e-9;
        if (rc) {
            /* damaged since it was indexed (checksum, truncated, changed):
             * removed; another model's file put in its place is left */
            int rm = rc == SHOAL_EFORMAT;
            SHOAL_WARN("prefix cache: %s (the prefix will be recomputed%s)", why, rm ? "; the file is removed" : "");
            count(pc, rm ? add_removed : add_refused, NULL);
            shoal_pcache_file_free(f);
            drop_entry(pc, b, rm);
            continue;
        }
        ra.reads++;
        ra.read_bytes += f->h.state_bytes;
        e->last = ++pc->tick;
        touch_file(pc, e);
        got = e->n;
        if (e->bytes <= pc->o.mem_bytes) {
            shoal_pcache_shrink(pc, pc->o.mem_bytes - e->bytes);
            /* the shrink may have moved entries: find it again */
            int i = find_exact(pc, ids, got, shoal_pcache_ids_hash(ids, got));
            if (i >= 0 && !pc->e[i].blob) {
                pc->e[i].blob = shoal_xmalloc(pc->e[i].bytes);
                memcpy(pc->e[i].blob, f->state, pc->e[i].bytes);
                pc->mem += pc->e[i].bytes;
            }
        }
        shoal_pcache_file_free(f);
    }
    ra.hit = got > 0;
    ra.saved = (uint64_t)got;
    count(pc, add_resume, &ra);
    recount(pc);
    return got;
}

typedef struct {
    uint64_t captures, bytes;
    double capture_s;
} capture_add;

static void add_capture(shoal_pcache_stats *s, const void *a)
{
    const capture_add *c = a;
    s->captures += c->captures;
    s->capture_bytes += c->bytes;
    s->capture_s += c->capture_s;
}

int shoal_pcache_capture(shoal_pcache *pc, const int32_t *ids, int n, const shoal_seq *seq, char *err, size_t errlen)
{
    if (!pc)
        return 0;
    if (n < 1 || n != shoal_seq_pos(seq))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "prefix cache: capture of %d ids from a sequence at %d", n,
                             shoal_seq_pos(seq));
    reap(pc);
    uint64_t hash = shoal_pcache_ids_hash(ids, n);
    int i = find_exact(pc, ids, n, hash);
    if (i >= 0) {
        pc->e[i].last = ++pc->tick;
        touch_file(pc, &pc->e[i]);
        return 0;
    }
    size_t bytes = pc->fixed + (size_t)n * pc->per_token;
    int to_mem = bytes <= pc->o.mem_bytes;
    if (!to_mem && !pc->dir)
        return 0; /* larger than the whole budget, and no directory: nothing to keep */
    capture_add ca = {0};
    uint64_t t0 = shoal_metrics_now_ns();
    void *blob = shoal_xmalloc(bytes);
    int rc = shoal_seq_export(seq, blob, bytes, err, errlen);
    if (rc) {
        free(blob);
        return rc;
    }
    ca.captures = 1;
    ca.bytes = bytes;
    if (to_mem)
        shoal_pcache_shrink(pc, pc->o.mem_bytes - bytes);
    /* room in the writer's queue first (back-pressure: the queue holds at
     * most WRITER_QUEUE copies) */
    uint64_t tw = shoal_metrics_now_ns();
    uint64_t fb = SHOAL_PCACHE_HDR_BYTES + 4ull * (uint64_t)n + bytes;
    int to_disk = pc->has_writer && wait_queue(pc, WRITER_QUEUE - 1) == 0 && disk_room(pc, fb);
    double wait_s = (double)(shoal_metrics_now_ns() - tw) * 1e-9;
    if (!to_mem && !to_disk) {
        free(blob);
        SHOAL_WARN("prefix cache: a capture of %d tokens is not kept (the directory's writer is behind, or the "
                   "file would not fit its budget)", n);
        return 0;
    }
    entry *e = add_entry(pc, ids, n, hash);
    if (to_disk) {
        wjob *j = shoal_xcalloc(1, sizeof *j);
        char path[4096];
        entry_path(pc, e, path, sizeof path);
        j->path = shoal_xstrdup(path);
        j->ids = shoal_xmalloc(4 * (size_t)n);
        memcpy(j->ids, ids, 4 * (size_t)n);
        j->n = n;
        j->hash = hash;
        j->bytes = bytes;
        if (to_mem) { /* the memory tier keeps its own copy */
            j->blob = shoal_xmalloc(bytes);
            memcpy(j->blob, blob, bytes);
        } else {
            j->blob = blob;
            blob = NULL;
        }
        e->pending = 1;
        pc->disk += fb; /* reserved until the writer is done (reap) */
        pthread_mutex_lock(&pc->mu);
        if (pc->qtail)
            pc->qtail->next = j;
        else
            pc->qhead = j;
        pc->qtail = j;
        pc->queued++;
        pthread_cond_signal(&pc->wcv);
        pthread_mutex_unlock(&pc->mu);
    }
    if (to_mem) {
        e->blob = blob;
        pc->mem += bytes;
    }
    /* the model thread's time: the export and the writer's copy (not a wait
     * for room in the writer's queue, nor the shrink) */
    ca.capture_s = (double)(shoal_metrics_now_ns() - t0) * 1e-9 - wait_s;
    count(pc, add_capture, &ca);
    recount(pc);
    return 0;
}

void shoal_pcache_get_stats(shoal_pcache *pc, shoal_pcache_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!pc)
        return;
    pthread_mutex_lock(&pc->mu);
    *out = pc->st;
    pthread_mutex_unlock(&pc->mu);
}
