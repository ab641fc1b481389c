/* Safetensors store: one .safetensors file, or a multi-shard model through
 * model.safetensors.index.json. Owns the read-only mappings of its files and
 * every tensor view; views (and their names) live until shoal_st_close.
 * Everything in a header is validated before any view is handed out; a bad
 * file is refused with a message naming the file and the tensor.
 * Thread-safety: immutable after open; lookups are safe from any thread. */
#ifndef SHOAL_ST_H
#define SHOAL_ST_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    SHOAL_DT_BF16,
    SHOAL_DT_F16,
    SHOAL_DT_F32,
    SHOAL_DT_F64,
    SHOAL_DT_U8,
    SHOAL_DT_I8,
    SHOAL_DT_I16,
    SHOAL_DT_I32,
    SHOAL_DT_I64,
    SHOAL_DT_BOOL,
    SHOAL_DT_F8_E4M3,
    SHOAL_DT_F8_E5M2,
    SHOAL_DT_COUNT
} shoal_dtype;

#define SHOAL_ST_MAX_DIMS 8

typedef struct {
    const char *name;  /* owned by the store */
    shoal_dtype dtype;
    int ndim;
    int64_t shape[SHOAL_ST_MAX_DIMS];
    uint64_t nbytes;      /* == product(shape) * dtype size, checked */
    const void *data;     /* read-only mapping; NULL when opened with map=0 */
    int file;             /* index into the store's files */
    uint64_t file_offset; /* absolute byte offset of the data in that file (for pread) */
} shoal_tensor;

typedef struct {
    int map; /* 1: mmap files read-only so tensor.data is valid; 0: headers only */
} shoal_st_opts;

typedef struct shoal_st shoal_st;

size_t shoal_dtype_size(shoal_dtype dt);
const char *shoal_dtype_name(shoal_dtype dt);            /* "BF16", ... */
int shoal_dtype_parse(const char *s, shoal_dtype *out);   /* 0 or SHOAL_EFORMAT */

/* path: a .safetensors file, a model.safetensors.index.json, or a directory
 * holding either (the index wins). opts may be NULL (map=1). */
int shoal_st_open(shoal_st **out, const char *path, const shoal_st_opts *opts, char *err, size_t errlen);
void shoal_st_close(shoal_st *st); /* accepts NULL */

/* O(1) average lookup; NULL if absent. */
const shoal_tensor *shoal_st_find(const shoal_st *st, const char *name);
size_t shoal_st_count(const shoal_st *st);
const shoal_tensor *shoal_st_at(const shoal_st *st, size_t i); /* file order */
int shoal_st_nfiles(const shoal_st *st);
const char *shoal_st_file_path(const shoal_st *st, int file);
/* The store's own open descriptor of file (for fstat: a file truncated while
 * mapped), or -1. Borrowed: closed by shoal_st_close. */
int shoal_st_file_fd(const shoal_st *st, int file);
/* The file's read-only mapping and its length (NULL and 0 when not mapped). */
const void *shoal_st_file_map(const shoal_st *st, int file, uint64_t *len);

/* Read len bytes of tensor t's data from byte off into dst, with pread on
 * the store's own descriptor (no mapping touched: nothing of t becomes
 * resident in this process). Thread-safe. 0, SHOAL_ERANGE (off + len past
 * t's data) or SHOAL_EIO naming the tensor. */
int shoal_st_pread(const shoal_st *st, const shoal_tensor *t, uint64_t off, void *dst, size_t len, char *err,
                   size_t errlen);

/* Give up tensor t's mapped data: the whole pages inside it are dropped from
 * this process (madvise DONTNEED) and made inaccessible (mprotect
 * PROT_NONE), so it holds none of them and a stray read faults instead of
 * silently making them resident again. The at most two pages it shares with
 * its neighbours stay. t->data must not be read afterwards (except those
 * edges); for data the caller has handed to someone else (the coordinator's
 * remote trunk matrices, an embedding table read with shoal_st_pread).
 * *released (may be NULL): bytes given up. 0 (also when not mapped), or
 * -errno. Not thread-safe against readers of t. */
int shoal_st_release(shoal_st *st, const shoal_tensor *t, uint64_t *released, char *err, size_t errlen);

/* Fill dst[n] with the tensor's elements widened to fp32 (BF16, F16, F32 only). */
int shoal_tensor_to_f32(const shoal_tensor *t, float *dst, size_t n);

/* Exact conversions. bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even
 * (NaN stays NaN, quiet). */
static inline float shoal_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}
static inline uint16_t shoal_f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x0040u);
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}
static inline float shoal_round_bf16(float f)
{
    return shoal_bf16_to_f32(shoal_f32_to_bf16(f));
}

#endif
