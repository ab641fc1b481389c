/* Safetensors store (common/st.h).
 *
 * The headers are read with the strict, streaming JSON scanner of
 * common/jscan.h, written for the two shapes this module reads (a shard header
 * and model.safetensors.index.json) instead of jansson: jansson 2.14 needs
 * ~3 s to build and walk the DOM of the real K3 layout (96 shard headers,
 * 497,220 tensors, plus a 497,220-entry index; measured in
 * docs/DEPENDENCIES.md), above the 2 s budget. This file walks the structure
 * it expects with that scanner and is fuzzed by tests/fuzz/fuzz_st.c.
 * Everything in a header is checked before a view is handed out; the first
 * problem found is reported naming the file and, where one is concerned, the
 * tensor. */
#include "common/st.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/jscan.h"

/* safetensors' own reader refuses headers over 100,000,000 bytes; so do we. */
#define ST_MAX_HEADER 100000000ull
#define ST_MAX_FILES 65536
#define ST_MAX_THREADS 8

/* ---- dtypes ---------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t size;
} dtypes[SHOAL_DT_COUNT] = {
    [SHOAL_DT_BF16] = {"BF16", 2},    [SHOAL_DT_F16] = {"F16", 2},
    [SHOAL_DT_F32] = {"F32", 4},      [SHOAL_DT_F64] = {"F64", 8},
    [SHOAL_DT_U8] = {"U8", 1},        [SHOAL_DT_I8] = {"I8", 1},
    [SHOAL_DT_I16] = {"I16", 2},      [SHOAL_DT_I32] = {"I32", 4},
    [SHOAL_DT_I64] = {"I64", 8},      [SHOAL_DT_BOOL] = {"BOOL", 1},
    [SHOAL_DT_F8_E4M3] = {"F8_E4M3", 1}, [SHOAL_DT_F8_E5M2] = {"F8_E5M2", 1},
};

size_t shoal_dtype_size(shoal_dtype dt)
{
    return (unsigned)dt < SHOAL_DT_COUNT ? dtypes[dt].size : 0;
}

const char *shoal_dtype_name(shoal_dtype dt)
{
    return (unsigned)dt < SHOAL_DT_COUNT ? dtypes[dt].name : "?";
}

int shoal_dtype_parse(const char *s, shoal_dtype *out)
{
    for (int i = 0; i < SHOAL_DT_COUNT; i++)
        if (!strcmp(s, dtypes[i].name)) {
            *out = (shoal_dtype)i;
            return 0;
        }
    return SHOAL_EFORMAT;
}

/* ---- string arena: stable pointers for tensor names ------------------------ */

typedef struct arena_chunk {
    struct arena_chunk *next;
    size_t used, cap;
    char data[];
} arena_chunk;

static char *arena_strdup(arena_chunk **head, const char *s, size_t n)
{
    arena_chunk *c = *head;
    if (!c || c->cap - c->used < n + 1) {
        size_t cap = n + 1 > (1u << 20) ? n + 1 : (1u << 20);
        c = shoal_xmalloc(sizeof *c + cap);
        c->next = *head;
        c->used = 0;
        c->cap = cap;
        *head = c;
    }
    char *p = c->data + c->used;
    memcpy(p, s, n);
    p[n] = 0;
    c->used += n + 1;
    return p;
}

static void arena_free(arena_chunk *c)
{
    while (c) {
        arena_chunk *n = c->next;
        free(c);
        c = n;
    }
}

/* ---- string hash set: open addressing over indices into a caller's array ---- */

/* 8 bytes at a time; multiply-xorshift mixing (names differ mostly in their
 * middle digits, which every round mixes into all 64 bits). */
static uint64_t hash_str(const char *s, size_t n)
{
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xc4ceb9fe1a85ec53ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 32;
    return h;
}

typedef struct {
    uint32_t idx; /* index + 1, 0 = empty */
    uint32_t tag; /* high bits of the hash, to skip most string compares */
} strslot;

typedef struct {
    strslot *s;
    size_t cap, n; /* cap is a power of two, load kept <= 1/2 */
} strset;

typedef const char *(*strset_key_fn)(const void *ctx, uint32_t idx);

static void strset_free(strset *h)
{
    free(h->s);
    memset(h, 0, sizeof *h);
}

/* Sizes the table for `want` keys (rehashing what it holds). */
static void strset_reserve(strset *h, size_t want, strset_key_fn key, const void *ctx)
{
    size_t cap = 64;
    while (cap < 2 * want)
        cap <<= 1;
    if (cap <= h->cap)
        return;
    strslot *s = shoal_xcalloc(cap, sizeof *s);
    for (size_t i = 0; i < h->cap; i++) {
        if (!h->s[i].idx)
            continue;
        const char *k = key(ctx, h->s[i].idx - 1);
        uint64_t hv = hash_str(k, strlen(k));
        size_t j = (size_t)hv & (cap - 1);
        while (s[j].idx)
            j = (j + 1) & (cap - 1);
        s[j] = h->s[i];
    }
    free(h->s);
    h->s = s;
    h->cap = cap;
}

/* Stored key k (NUL-terminated) equals s[0..n) (s holds no NUL byte). */
static int key_eq(const char *k, const char *s, size_t n)
{
    return !strncmp(k, s, n) && k[n] == 0;
}

/* Returns the index already stored under s (n bytes), or stores idx and returns -1. */
static int64_t strset_insert(strset *h, const char *s, size_t n, uint32_t idx, strset_key_fn key,
                             const void *ctx)
{
    if (2 * (h->n + 1) > h->cap)
        strset_reserve(h, 2 * (h->n + 1), key, ctx);
    uint64_t hv = hash_str(s, n);
    uint32_t tg = (uint32_t)(hv >> 32);
    size_t j = (size_t)hv & (h->cap - 1);
    while (h->s[j].idx) {
        if (h->s[j].tag == tg && key_eq(key(ctx, h->s[j].idx - 1), s, n))
            return h->s[j].idx - 1;
        j = (j + 1) & (h->cap - 1);
    }
    h->s[j].idx = idx + 1;
    h->s[j].tag = tg;
    h->n++;
    return -1;
}

static int64_t strset_find(const strset *h, const char *s, size_t n, strset_key_fn key, const void *ctx)
{
    if (!h->cap)
        return -1;
    uint64_t hv = hash_str(s, n);
    uint32_t tg = (uint32_t)(hv >> 32);
    size_t j = (size_t)hv & (h->cap - 1);
    while (h->s[j].idx) {
        if (h->s[j].tag == tg && key_eq(key(ctx, h->s[j].idx - 1), s, n))
            return h->s[j].idx - 1;
        j = (j + 1) & (h->cap - 1);
    }
    return -1;
}

/* ---- the store --------------------------------------------------------------- */

typedef struct {
    char *path;
    int fd;
    uint64_t size;      /* file size */
    uint64_t data_off;  /* 8 + header length */
    void *map;          /* whole file, read-only; NULL when map=0 */
} st_file;

struct shoal_st {
    st_file *files;
    int nfiles;
    shoal_tensor *t;
    size_t n, cap;
    strset names;
    arena_chunk *arena;
};

static const char *tensor_key(const void *ctx, uint32_t idx)
{
    return ((const shoal_st *)ctx)->t[idx].name;
}

/* ---- one shard header ------------------------------------------------------- */

static int read_uint_array(shoal__jscan *j, uint64_t *v, int max, int *n, const char *field)
{
    char msg[96];
    if (shoal__jpeek(j) != '[')
        return shoal__jinvalid(j, field[0] == 's' ? "shape must be an array" : "data_offsets must be an array");
    j->p++;
    *n = 0;
    if (shoal__jpeek(j) == ']') {
        j->p++;
        return 0;
    }
    for (;;) {
        uint64_t u;
        int isu;
        char c = shoal__jpeek(j);
        if (c != '-' && (c < '0' || c > '9')) {
            snprintf(msg, sizeof msg, "%s entries must be non-negative integers below 2^63", field);
            return shoal__jinvalid(j, msg);
        }
        if (shoal__jnumber(j, &u, &isu))
            return j->rc;
        if (!isu || u > (uint64_t)INT64_MAX) {
            snprintf(msg, sizeof msg, "%s entries must be non-negative integers below 2^63", field);
            return shoal__jinvalid(j, msg);
        }
        if (*n >= max) {
            snprintf(msg, sizeof msg, "%s has more than %d entries", field, max);
            return shoal__jinvalid(j, msg);
        }
        v[(*n)++] = u;
        int more = 0;
        if (shoal__jnext(j, ']', &more))
            return j->rc;
        if (!more)
            return 0;
    }
}

/* One file's tensors as parsed (by any thread), before they join the store. */
typedef struct {
    shoal_tensor *t;
    size_t n, cap;
    arena_chunk *arena; /* their names */
    int rc;
    char err[1024];
} tlist;

static shoal_tensor *push_tensor(tlist *l)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 1024;
        l->t = shoal_xrealloc(l->t, l->cap * sizeof *l->t);
    }
    shoal_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    return t;
}

/* Parses one tensor entry {"dtype":..,"shape":[..],"data_offsets":[b,e]} for
 * the tensor just pushed (t->name set). begin/end are relative to the data section. */
static int parse_entry(shoal__jscan *j, shoal_tensor *t, uint64_t *begin, uint64_t *end)
{
    int have_dt = 0, have_shape = 0, have_off = 0;
    if (shoal__jpeek(j) != '{')
        return shoal__jinvalid(j, "tensor entry must be an object");
    j->p++;
    if (shoal__jpeek(j) == '}')
        return shoal__jinvalid(j, "tensor entry is empty (needs dtype, shape, data_offsets)");
    for (;;) {
        const char *k;
        size_t len;
        if (shoal__jstring(j, &k, &len))
            return j->rc;
        if (shoal__jexpect(j, ':', "expected ':'"))
            return j->rc;
        if (shoal__jeq(k, len, "dtype")) {
            if (have_dt++)
                return shoal__jinvalid(j, "duplicate key 'dtype' in tensor entry");
            if (shoal__jpeek(j) != '"')
                return shoal__jinvalid(j, "dtype must be a string");
            const char *v;
            if (shoal__jstring(j, &v, &len))
                return j->rc;
            char dts[16];
            shoal_dtype dt;
            if (len < sizeof dts) {
                memcpy(dts, v, len);
                dts[len] = 0;
            }
            if (len >= sizeof dts || shoal_dtype_parse(dts, &dt)) {
                j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: tensor '%s': unknown dtype '%.*s'",
                                      j->file, t->name, (int)(len < 64 ? len : 64), v);
                return j->rc;
            }
            t->dtype = dt;
        } else if (shoal__jeq(k, len, "shape")) {
            if (have_shape++)
                return shoal__jinvalid(j, "duplicate key 'shape' in tensor entry");
            uint64_t v[SHOAL_ST_MAX_DIMS];
            int n;
            if (read_uint_array(j, v, SHOAL_ST_MAX_DIMS, &n, "shape"))
                return j->rc;
            t->ndim = n;
            for (int i = 0; i < n; i++)
                t->shape[i] = (int64_t)v[i];
        } else if (shoal__jeq(k, len, "data_offsets")) {
            if (have_off++)
                return shoal__jinvalid(j, "duplicate key 'data_offsets' in tensor entry");
            uint64_t v[2];
            int n;
            if (read_uint_array(j, v, 2, &n, "data_offsets"))
                return j->rc;
            if (n != 2)
                return shoal__jinvalid(j, "data_offsets must have exactly 2 entries");
            *begin = v[0];
            *end = v[1];
        } else {
            char msg[128];
            snprintf(msg, sizeof msg, "unknown key '%.*s' in tensor entry", (int)(len < 64 ? len : 64), k);
            return shoal__jinvalid(j, msg);
        }
        int more = 0;
        if (shoal__jnext(j, '}', &more))
            return j->rc;
        if (!more)
            break;
    }
    if (!have_dt || !have_shape || !have_off)
        return shoal__jinvalid(j, !have_dt ? "tensor entry lacks 'dtype'"
                        : !have_shape ? "tensor entry lacks 'shape'" : "tensor entry lacks 'data_offsets'");
    return 0;
}

typedef struct {
    uint64_t begin, end;
    uint32_t idx;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Opens, maps (optionally) and validates one .safetensors file as file number
 * fi, its tensors into out in offset order. Touches nothing shared: several
 * files are loaded concurrently (one scanner per thread). */
static int load_file(st_file *f, int fi, int map, tlist *out, shoal__jscan *j)
{
    const char *path = f->path;
    char *err = j->err;
    size_t errlen = j->errlen;
    f->fd = shoal_open_regular(path, O_RDONLY); /* never blocks on a FIFO */
    if (f->fd == SHOAL_EFORMAT) {
        f->fd = -1;
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: not a regular file", path);
    }
    if (f->fd < 0) {
        int e = -f->fd;
        f->fd = -1;
        return shoal_err_set(err, errlen, -e, "%s: cannot open: %s", path, strerror(e));
    }
    struct stat sb;
    if (fstat(f->fd, &sb) < 0)
        return shoal_err_set(err, errlen, -errno, "%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: not a regular file", path);
    f->size = (uint64_t)sb.st_size;
    if (f->size < 8)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: %llu bytes, too short for a safetensors header",
                             path, (unsigned long long)f->size);
    unsigned char lenb[8];
    ssize_t r = pread(f->fd, lenb, 8, 0);
    if (r != 8)
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: cannot read the header length", path);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | lenb[i];
    if (hlen > ST_MAX_HEADER)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                             "%s: header length %llu is absurd (limit %llu bytes)", path,
                             (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    if (hlen > f->size - 8)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                             "%s: header length %llu runs past the end of the file (%llu bytes)", path,
                             (unsigned long long)hlen, (unsigned long long)f->size);
    if (hlen < 2)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: header length %llu is too short for a JSON object",
                             path, (unsigned long long)hlen);
    f->data_off = 8 + hlen;
    uint64_t data_len = f->size - f->data_off;

    if (hlen > j->hcap) {
        free(j->hbuf);
        j->hcap = (size_t)hlen + (size_t)hlen / 2;
        j->hbuf = shoal_xmalloc(j->hcap);
    }
    char *hdr = j->hbuf;
    size_t got = 0;
    while (got < hlen) {
        r = pread(f->fd, hdr + got, (size_t)hlen - got, (off_t)(8 + got));
        if (r <= 0)
            return shoal_err_set(err, errlen, SHOAL_EIO, "%s: cannot read the header", path);
        got += (size_t)r;
    }
    if (map) {
        f->map = mmap(NULL, (size_t)f->size, PROT_READ, MAP_SHARED, f->fd, 0);
        if (f->map == MAP_FAILED) {
            f->map = NULL;
            return shoal_err_set(err, errlen, -errno, "%s: mmap failed: %s", path, strerror(errno));
        }
    }

    j->p = j->base = hdr;
    j->end = hdr + hlen;
    j->file = path;
    j->tensor = NULL;
    j->rc = 0;
    span *sp = NULL;
    size_t nsp = 0, capsp = 0;
    int rc = 0;
    if (shoal__jpeek(j) != '{') {
        rc = shoal__jinvalid(j, "the header must be a JSON object");
        goto out;
    }
    j->p++;
    if (shoal__jpeek(j) == '}') {
        j->p++;
    } else {
        for (;;) {
            const char *k;
            size_t len;
            if (shoal__jstring(j, &k, &len) || shoal__jexpect(j, ':', "expected ':'")) {
                rc = j->rc;
                goto out;
            }
            if (shoal__jeq(k, len, "__metadata__")) {
                /* free-form string map; validated as JSON, otherwise ignored */
                if (shoal__jpeek(j) != '{') {
                    rc = shoal__jinvalid(j, "__metadata__ must be an object");
                    goto out;
                }
                if (shoal__jskip(j, 0)) {
                    rc = j->rc;
                    goto out;
                }
            } else {
                if (len == 0) {
                    rc = shoal__jinvalid(j, "empty tensor name");
                    goto out;
                }
                shoal_tensor *t = push_tensor(out);
                t->name = arena_strdup(&out->arena, k, len);
                t->file = fi;
                j->tensor = t->name;
                j->tensor_n = (int)len;
                uint64_t b = 0, e = 0;
                if (parse_entry(j, t, &b, &e)) {
                    rc = j->rc;
                    goto out;
                }
                if (b > e) {
                    rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                       "%s: tensor '%s': data_offsets begin %llu > end %llu", path, t->name,
                                       (unsigned long long)b, (unsigned long long)e);
                    goto out;
                }
                if (e > data_len) {
                    rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                       "%s: tensor '%s': data_offsets end %llu is past the data section (%llu bytes)",
                                       path, t->name, (unsigned long long)e, (unsigned long long)data_len);
                    goto out;
                }
                uint64_t nb = shoal_dtype_size(t->dtype);
                int ovf = 0;
                for (int i = 0; i < t->ndim; i++)
                    ovf |= __builtin_mul_overflow(nb, (uint64_t)t->shape[i], &nb);
                if (ovf) {
                    rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                       "%s: tensor '%s': byte size of shape x %s overflows 64 bits", path,
                                       t->name, shoal_dtype_name(t->dtype));
                    goto out;
                }
                if (nb != e - b) {
                    char shp[160];
                    size_t o = 0;
                    shp[0] = 0;
                    for (int i = 0; i < t->ndim && o < sizeof shp - 24; i++)
                        o += (size_t)snprintf(shp + o, sizeof shp - o, "%s%lld", i ? "," : "",
                                              (long long)t->shape[i]);
                    rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                       "%s: tensor '%s': data_offsets span %llu bytes but shape [%s] x %s "
                                       "needs %llu",
                                       path, t->name, (unsigned long long)(e - b), shp,
                                       shoal_dtype_name(t->dtype), (unsigned long long)nb);
                    goto out;
                }
                t->nbytes = nb;
                t->file_offset = f->data_off + b;
                if (nsp == capsp) {
                    capsp = capsp ? 2 * capsp : 256;
                    sp = shoal_xrealloc(sp, capsp * sizeof *sp);
                }
                sp[nsp++] = (span){b, e, (uint32_t)(out->n - 1)};
                j->tensor = NULL;
            }
            int more = 0;
            if (shoal__jnext(j, '}', &more)) {
                rc = j->rc;
                goto out;
            }
            if (!more)
                break;
        }
    }
    if (shoal__jend(j)) {
        rc = j->rc;
        goto out;
    }

    /* overlaps: sort this file's tensors by offset; zero-size tensors never overlap */
    int sorted = 1;
    for (size_t i = 1; i < nsp && sorted; i++)
        sorted = cmp_span(&sp[i - 1], &sp[i]) <= 0;
    if (!sorted)
        qsort(sp, nsp, sizeof *sp, cmp_span);
    {
        uint64_t reach = 0;
        size_t owner = SIZE_MAX;
        for (size_t i = 0; i < nsp; i++) {
            if (sp[i].begin == sp[i].end)
                continue;
            if (owner != SIZE_MAX && sp[i].begin < reach) {
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                   "%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path,
                                   out->t[sp[owner].idx].name, (unsigned long long)sp[owner].begin,
                                   (unsigned long long)sp[owner].end, out->t[sp[i].idx].name,
                                   (unsigned long long)sp[i].begin, (unsigned long long)sp[i].end);
                goto out;
            }
            reach = sp[i].end;
            owner = i;
        }
    }
    /* reorder this file's slice into offset order ("file order") */
    if (nsp > 1 && !sorted) {
        shoal_tensor *tmp = shoal_xmalloc(nsp * sizeof *tmp);
        for (size_t i = 0; i < nsp; i++)
            tmp[i] = out->t[sp[i].idx];
        memcpy(out->t, tmp, nsp * sizeof *tmp);
        free(tmp);
    }
    if (f->map)
        for (size_t i = 0; i < out->n; i++)
            out->t[i].data = (const char *)f->map + out->t[i].file_offset;
out:
    free(sp);
    j->tensor = NULL;
    return rc;
}

/* Appends one loaded file's tensors to the store (file order), checking
 * names against every tensor already there. Frees l's arrays, keeps its names. */
static int merge_file(shoal_st *st, int fi, tlist *l, char *err, size_t errlen)
{
    int rc = 0;
    if (st->n + l->n > st->cap) {
        st->cap = st->n + l->n > 2 * st->cap ? st->n + l->n : 2 * st->cap;
        st->t = shoal_xrealloc(st->t, st->cap * sizeof *st->t);
    }
    if (l->n)
        memcpy(&st->t[st->n], l->t, l->n * sizeof *l->t);
    size_t first = st->n;
    st->n += l->n;
    /* the names move to the store's arena */
    arena_chunk **tail = &l->arena;
    while (*tail)
        tail = &(*tail)->next;
    *tail = st->arena;
    st->arena = l->arena;
    l->arena = NULL;
    free(l->t);
    l->t = NULL;
    l->n = l->cap = 0;
    strset_reserve(&st->names, st->n, tensor_key, st);
    for (size_t i = first; i < st->n; i++) {
        const shoal_tensor *t = &st->t[i];
        int64_t prev = strset_insert(&st->names, t->name, strlen(t->name), (uint32_t)i, tensor_key, st);
        if (prev >= 0) {
            const shoal_tensor *o = &st->t[prev];
            if (o->file == fi)
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: duplicate tensor name '%s'",
                                   st->files[fi].path, t->name);
            else
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "tensor '%s' appears in both %s and %s", t->name,
                                   st->files[o->file].path, st->files[fi].path);
            break;
        }
    }
    return rc;
}

static void tlist_free(tlist *l)
{
    free(l->t);
    arena_free(l->arena);
    memset(l, 0, sizeof *l);
}

/* ---- loading the shards of an index: files parsed in parallel --------------- */

typedef struct {
    shoal_st *st;
    tlist *res;
    int map;
    atomic_int next; /* next file to take */
} load_job;

static void *load_worker(void *arg)
{
    load_job *lj = arg;
    shoal__jscan j = {0};
    for (;;) {
        int fi = atomic_fetch_add(&lj->next, 1);
        if (fi >= lj->st->nfiles)
            break;
        tlist *l = &lj->res[fi];
        j.err = l->err;
        j.errlen = sizeof l->err;
        l->rc = load_file(&lj->st->files[fi], fi, lj->map, l, &j);
    }
    free(j.sbuf);
    free(j.hbuf);
    return NULL;
}

/* Loads every file of st: parsing and per-file checks on up to ST_MAX_THREADS
 * threads (independent files), then the merge in file order on this thread,
 * so the store and the first error reported (lowest file) do not depend on
 * the thread count. */
static int load_files(shoal_st *st, int map, char *err, size_t errlen)
{
    load_job lj = {.st = st, .res = shoal_xcalloc((size_t)st->nfiles, sizeof(tlist)), .map = map};
    atomic_init(&lj.next, 0);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nth = (int)(ncpu < 1 ? 1 : ncpu > ST_MAX_THREADS ? ST_MAX_THREADS : ncpu);
    if (nth > st->nfiles)
        nth = st->nfiles;
    pthread_t th[ST_MAX_THREADS];
    int started = 0;
    for (int i = 1; i < nth; i++) {
        if (pthread_create(&th[started], NULL, load_worker, &lj) != 0)
            break; /* fewer threads: the others take the files */
        started++;
    }
    load_worker(&lj);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    int rc = 0;
    for (int fi = 0; fi < st->nfiles; fi++) {
        if (!rc && lj.res[fi].rc) {
            rc = lj.res[fi].rc;
            shoal_err_set(err, errlen, rc, "%s", lj.res[fi].err);
        }
        if (!rc)
            rc = merge_file(st, fi, &lj.res[fi], err, errlen);
        tlist_free(&lj.res[fi]);
    }
    free(lj.res);
    return rc;
}

/* ---- index ------------------------------------------------------------------ */

typedef struct {
    char **names; /* shard file names as written in the index */
    int n, cap;
    strset set;
} shard_list;

static const char *shard_key(const void *ctx, uint32_t idx)
{
    return ((const shard_list *)ctx)->names[idx];
}

typedef struct {
    const char *name; /* into the index text (not NUL-terminated), or the index arena */
    size_t len;
    int shard;
} index_entry;

static int is_safe_shard_name(const char *s, size_t n)
{
    /* a file beside the index: no directories, no hidden or parent names */
    return n && s[0] != '.' && !memchr(s, '/', n);
}

static char *path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = shoal_xmalloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

static int read_whole(const char *path, char **buf, size_t *len, char *err, size_t errlen)
{
    int fd = shoal_open_regular(path, O_RDONLY); /* never blocks on a FIFO */
    if (fd == SHOAL_EFORMAT)
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: not a readable regular file", path);
    if (fd < 0)
        return shoal_err_set(err, errlen, fd, "%s: cannot open: %s", path, strerror(-fd));
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: not a readable regular file", path);
    }
    if ((uint64_t)sb.st_size > (1ull << 32)) {
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: %lld bytes is absurd for an index", path,
                             (long long)sb.st_size);
    }
    size_t n = (size_t)sb.st_size, got = 0;
    char *b = shoal_xmalloc(n + 1);
    while (got < n) {
        ssize_t r = read(fd, b + got, n - got);
        if (r <= 0) {
            free(b);
            close(fd);
            return shoal_err_set(err, errlen, SHOAL_EIO, "%s: read failed", path);
        }
        got += (size_t)r;
    }
    close(fd);
    b[n] = 0;
    *buf = b;
    *len = n;
    return 0;
}

/* Parses the index text into entries and shard names. */
static int parse_index(shoal__jscan *j, shard_list *sl, index_entry **out, size_t *nout, arena_chunk **arena)
{
    index_entry *e = NULL;
    size_t n = 0, cap = 0;
    int have_map = 0;
    int64_t last = -1;
    *out = NULL;
    *nout = 0;
    if (shoal__jpeek(j) != '{')
        return shoal__jinvalid(j, "the index must be a JSON object");
    j->p++;
    if (shoal__jpeek(j) != '}') {
        for (;;) {
            const char *k;
            size_t len;
            if (shoal__jstring(j, &k, &len) || shoal__jexpect(j, ':', "expected ':'"))
                goto fail;
            if (!shoal__jeq(k, len, "weight_map")) {
                if (shoal__jskip(j, 0))
                    goto fail;
            } else {
                if (have_map++) {
                    shoal__jinvalid(j, "duplicate key 'weight_map'");
                    goto fail;
                }
                if (shoal__jpeek(j) != '{') {
                    shoal__jinvalid(j, "weight_map must be an object");
                    goto fail;
                }
                j->p++;
                if (shoal__jpeek(j) == '}') {
                    j->p++;
                } else {
                    for (;;) {
                        const char *name, *sh;
                        size_t nlen;
                        if (shoal__jstring(j, &name, &nlen))
                            goto fail;
                        if (!nlen) {
                            shoal__jinvalid(j, "empty tensor name in weight_map");
                            goto fail;
                        }
                        /* unescaped names stay in the index text (alive until the checks end) */
                        if (name == j->sbuf)
                            name = arena_strdup(arena, name, nlen);
                        j->tensor = name;
                        j->tensor_n = (int)nlen;
                        if (shoal__jexpect(j, ':', "expected ':'"))
                            goto fail;
                        if (shoal__jpeek(j) != '"') {
                            shoal__jinvalid(j, "shard name must be a string");
                            goto fail;
                        }
                        if (shoal__jstring(j, &sh, &len))
                            goto fail;
                        if (!is_safe_shard_name(sh, len)) {
                            j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT,
                                                  "%s: tensor '%.*s': shard name '%.*s' is not a plain file "
                                                  "name beside the index",
                                                  j->file, (int)nlen, name, (int)(len < 200 ? len : 200), sh);
                            goto fail;
                        }
                        /* find or add the shard; consecutive entries mostly share one */
                        int64_t si = last >= 0 && key_eq(sl->names[last], sh, len)
                                         ? last
                                         : strset_find(&sl->set, sh, len, shard_key, sl);
                        if (si < 0) {
                            if (sl->n >= ST_MAX_FILES) {
                                shoal__jinvalid(j, "more than 65536 shard files");
                                goto fail;
                            }
                            if (sl->n == sl->cap) {
                                sl->cap = sl->cap ? 2 * sl->cap : 16;
                                sl->names = shoal_xrealloc(sl->names, (size_t)sl->cap * sizeof *sl->names);
                            }
                            sl->names[sl->n] = shoal_xmalloc(len + 1);
                            memcpy(sl->names[sl->n], sh, len);
                            sl->names[sl->n][len] = 0;
                            strset_insert(&sl->set, sh, len, (uint32_t)sl->n, shard_key, sl);
                            si = sl->n++;
                        }
                        if (n == cap) {
                            cap = cap ? 2 * cap : 4096;
                            e = shoal_xrealloc(e, cap * sizeof *e);
                        }
                        e[n++] = (index_entry){name, nlen, (int)si};
                        last = si;
                        j->tensor = NULL;
                        int more = 0;
                        if (shoal__jnext(j, '}', &more))
                            goto fail;
                        if (!more)
                            break;
                    }
                }
            }
            int more = 0;
            if (shoal__jnext(j, '}', &more))
                goto fail;
            if (!more)
                break;
        }
    } else {
        j->p++;
    }
    if (shoal__jend(j))
        goto fail;
    if (!have_map) {
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: no 'weight_map' object", j->file);
        goto fail;
    }
    if (!n) {
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: weight_map is empty", j->file);
        goto fail;
    }
    *out = e;
    *nout = n;
    return 0;
fail:
    free(e);
    j->tensor = NULL;
    return j->rc ? j->rc : SHOAL_EFORMAT;
}

static int cmp_str_idx(const void *a, const void *b, void *ctx)
{
    const shard_list *sl = ctx;
    return strcmp(sl->names[*(const int *)a], sl->names[*(const int *)b]);
}

static int open_index(shoal_st *st, const char *index_path, int map, shoal__jscan *j)
{
    char *err = j->err;
    size_t errlen = j->errlen;
    char *buf = NULL;
    size_t len = 0;
    int rc = read_whole(index_path, &buf, &len, err, errlen);
    if (rc)
        return rc;
    /* directory of the index */
    char *dir = shoal_xstrdup(index_path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = 0;
    else
        strcpy(dir, ".");

    shard_list sl = {0};
    index_entry *ent = NULL;
    size_t nent = 0;
    arena_chunk *iarena = NULL;
    uint8_t *claimed = NULL;
    j->p = j->base = buf;
    j->end = buf + len;
    j->file = index_path;
    j->tensor = NULL;
    j->rc = 0;
    rc = parse_index(j, &sl, &ent, &nent, &iarena);
    if (rc)
        goto out;

    /* files in lexicographic order of their names: deterministic file numbers */
    int *order = shoal_xmalloc((size_t)sl.n * sizeof *order), *fileof = shoal_xmalloc((size_t)sl.n * sizeof *fileof);
    for (int i = 0; i < sl.n; i++)
        order[i] = i;
    qsort_r(order, (size_t)sl.n, sizeof *order, cmp_str_idx, &sl);
    st->files = shoal_xcalloc((size_t)sl.n, sizeof *st->files);
    for (int i = 0; i < sl.n; i++) {
        st->files[i].fd = -1;
        st->files[i].path = path_join(dir, sl.names[order[i]]);
        fileof[order[i]] = i;
    }
    st->nfiles = sl.n;
    free(order);
    strset_reserve(&st->names, nent, tensor_key, st);
    st->cap = nent;
    st->t = shoal_xmalloc(nent * sizeof *st->t);
    for (int i = 0; i < st->nfiles; i++) {
        if (access(st->files[i].path, F_OK) != 0) {
            /* name a tensor that points at the missing shard */
            const char *who = "?";
            int wn = 1;
            for (size_t k = 0; k < nent; k++)
                if (fileof[ent[k].shard] == i) {
                    who = ent[k].name;
                    wn = (int)ent[k].len;
                    break;
                }
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: tensor '%.*s' is in shard %s, which is missing",
                               index_path, wn, who, st->files[i].path);
            free(fileof);
            goto out;
        }
    }
    rc = load_files(st, map, err, errlen);
    if (rc) {
        free(fileof);
        goto out;
    }
    /* every index entry names a tensor of its shard, exactly once, and every
     * tensor of the shards is listed */
    claimed = shoal_xcalloc(st->n ? st->n : 1, 1);
    for (size_t k = 0; k < nent; k++) {
        int fi = fileof[ent[k].shard];
        int64_t ti = strset_find(&st->names, ent[k].name, ent[k].len, tensor_key, st);
        if (ti < 0) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: tensor '%.*s' is not in shard %s (nor any other)",
                               index_path, (int)ent[k].len, ent[k].name, st->files[fi].path);
            break;
        }
        if (st->t[ti].file != fi) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: tensor '%.*s' is listed in shard %s but is in %s",
                               index_path, (int)ent[k].len, ent[k].name, st->files[fi].path, st->files[st->t[ti].file].path);
            break;
        }
        if (claimed[ti]++) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: duplicate tensor name '%.*s' in weight_map",
                               index_path, (int)ent[k].len, ent[k].name);
            break;
        }
    }
    if (!rc)
        for (size_t i = 0; i < st->n; i++)
            if (!claimed[i]) {
                rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: tensor '%s' is not listed in %s",
                                   st->files[st->t[i].file].path, st->t[i].name, index_path);
                break;
            }
    free(fileof);
out:
    free(claimed);
    free(ent);
    arena_free(iarena);
    for (int i = 0; i < sl.n; i++)
        free(sl.names[i]);
    free(sl.names);
    strset_free(&sl.set);
    free(dir);
    free(buf);
    return rc;
}

/* ---- public API ------------------------------------------------------------- */

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

int shoal_st_open(shoal_st **out, const char *path, const shoal_st_opts *opts, char *err, size_t errlen)
{
    *out = NULL;
    int map = opts ? opts->map : 1;
    struct stat sb;
    if (stat(path, &sb) < 0)
        return shoal_err_set(err, errlen, -errno, "%s: %s", path, strerror(errno));
    shoal_st *st = shoal_xcalloc(1, sizeof *st);
    shoal__jscan j = {.err = err, .errlen = errlen};
    int rc;
    char *idx = NULL, *single = NULL;
    if (S_ISDIR(sb.st_mode)) {
        idx = path_join(path, "model.safetensors.index.json");
        if (access(idx, F_OK) != 0) {
            free(idx);
            idx = NULL;
            single = path_join(path, "model.safetensors");
            if (access(single, F_OK) != 0) {
                rc = shoal_err_set(err, errlen, SHOAL_ENOTFOUND,
                                   "%s: neither model.safetensors.index.json nor model.safetensors", path);
                goto done;
            }
        }
    } else if (ends_with(path, ".json")) {
        idx = shoal_xstrdup(path);
    } else {
        single = shoal_xstrdup(path);
    }
    if (idx) {
        rc = open_index(st, idx, map, &j);
    } else {
        st->files = shoal_xcalloc(1, sizeof *st->files);
        st->files[0].fd = -1;
        st->files[0].path = single;
        single = NULL;
        st->nfiles = 1;
        tlist l = {0};
        rc = load_file(&st->files[0], 0, map, &l, &j);
        if (!rc)
            rc = merge_file(st, 0, &l, err, errlen);
        tlist_free(&l);
    }
done:
    free(idx);
    free(single);
    free(j.sbuf);
    free(j.hbuf);
    if (rc) {
        shoal_st_close(st);
        return rc;
    }
    /* the mappings keep the data; descriptors stay open for pread users */
    *out = st;
    return 0;
}

int shoal_st_pread(const shoal_st *st, const shoal_tensor *t, uint64_t off, void *dst, size_t len, char *err,
                   size_t errlen)
{
    if (t->file < 0 || t->file >= st->nfiles || off > t->nbytes || len > t->nbytes - off)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "%s: bytes %llu+%zu outside its %llu", t->name,
                             (unsigned long long)off, len, (unsigned long long)t->nbytes);
    const st_file *f = &st->files[t->file];
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(f->fd, (char *)dst + got, len - got, (off_t)(t->file_offset + off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return shoal_err_set(err, errlen, SHOAL_EIO, "%s: cannot read %s: %s", f->path, t->name,
                                 r < 0 ? strerror(errno) : "unexpected end of file");
        got += (size_t)r;
    }
    return 0;
}

int shoal_st_release(shoal_st *st, const shoal_tensor *t, uint64_t *released, char *err, size_t errlen)
{
    if (released)
        *released = 0;
    if (t->file < 0 || t->file >= st->nfiles)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "%s: file %d of %d", t->name, t->file, st->nfiles);
    st_file *f = &st->files[t->file];
    if (!f->map || !t->nbytes)
        return 0;
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t a = (t->file_offset + pg - 1) / pg * pg, b = (t->file_offset + t->nbytes) / pg * pg;
    if (b <= a)
        return 0;
    char *p = (char *)f->map + a;
    if (madvise(p, (size_t)(b - a), MADV_DONTNEED) || mprotect(p, (size_t)(b - a), PROT_NONE))
        return shoal_err_set(err, errlen, -errno, "%s: cannot release %s: %s", f->path, t->name, strerror(errno));
    if (released)
        *released = b - a;
    return 0;
}

void shoal_st_close(shoal_st *st)
{
    if (!st)
        return;
    for (int i = 0; i < st->nfiles; i++) {
        st_file *f = &st->files[i];
        if (f->map)
            munmap(f->map, (size_t)f->size);
        if (f->fd >= 0)
            close(f->fd);
        free(f->path);
    }
    free(st->files);
    free(st->t);
    strset_free(&st->names);
    arena_free(st->arena);
    free(st);
}

const shoal_tensor *shoal_st_find(const shoal_st *st, const char *name)
{
    int64_t i = strset_find(&st->names, name, strlen(name), tensor_key, st);
    return i < 0 ? NULL : &st->t[i];
}

size_t shoal_st_count(const shoal_st *st)
{
    return st->n;
}

const shoal_tensor *shoal_st_at(const shoal_st *st, size_t i)
{
    return i < st->n ? &st->t[i] : NULL;
}

int shoal_st_nfiles(const shoal_st *st)
{
    return st->nfiles;
}

const char *shoal_st_file_path(const shoal_st *st, int file)
{
    return file >= 0 && file < st->nfiles ? st->files[file].path : NULL;
}

int shoal_st_file_fd(const shoal_st *st, int file)
{
    return file >= 0 && file < st->nfiles ? st->files[file].fd : -1;
}

const void *shoal_st_file_map(const shoal_st *st, int file, uint64_t *len)
{
    int ok = file >= 0 && file < st->nfiles && st->files[file].map;
    if (len)
        *len = ok ? st->files[file].size : 0;
    return ok ? st->files[file].map : NULL;
}

static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ff;
            u = sign | exp << 23 | man << 13;
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | man << 13;
    } else {
        u = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    union { uint32_t u; float f; } v = {.u = u};
    return v.f;
}

int shoal_tensor_to_f32(const shoal_tensor *t, float *dst, size_t n)
{
    size_t es = shoal_dtype_size(t->dtype);
    if (!t->data || !es || t->nbytes / es != n)
        return SHOAL_EINVAL;
    const unsigned char *s = t->data;
    switch (t->dtype) {
    case SHOAL_DT_BF16:
        for (size_t i = 0; i < n; i++)
            dst[i] = shoal_bf16_to_f32((uint16_t)(s[2 * i] | s[2 * i + 1] << 8));
        return 0;
    case SHOAL_DT_F16:
        for (size_t i = 0; i < n; i++)
            dst[i] = f16_to_f32((uint16_t)(s[2 * i] | s[2 * i + 1] << 8));
        return 0;
    case SHOAL_DT_F32:
        memcpy(dst, s, n * 4); /* little-endian host (x86-64) */
        return 0;
    default:
        return SHOAL_EUNSUPPORTED;
    }
}
