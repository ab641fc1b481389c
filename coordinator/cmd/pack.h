/* pack: the layout of one worker's pack (docs/DEPLOY.md, "Packs"), shared by
 * `shoal pack` (pack.c, copies from a model directory) and `shoal pull`
 * (pull.c, downloads from a Hugging Face-style hub), so that both write the
 * same files with the same headers, index and manifest. Private to cmd/.
 *
 * shoal_pack_build opens the model in j->model (config.json, the safetensors
 * headers: a header-only copy of the shards is enough), selects the worker's
 * tensors as the plan says and, per pack layer file, builds its safetensors
 * header and calls j->layer, which must make the file exist (path) with that
 * header followed by the listed source ranges back to back and return its
 * BLAKE2b-256. Then (unless j->dry) it writes config.json, the index, the
 * tokenizer files (--trunk) and the manifest shoal-pack.json, last. */
#ifndef SHOAL_CMD_PACK_H
#define SHOAL_CMD_PACK_H

#include <stddef.h>
#include <stdint.h>

/* One source range of a pack layer file: bytes [off, off + nbytes) of the
 * model's file path (index file in the store), holding tensor name (the
 * original tensor; for trunk rows, the rows of it). */
typedef struct {
    int file;
    const char *path;
    const char *name;
    uint64_t off, nbytes;
} shoal_pack_src;

typedef int (*shoal_pack_layer_fn)(void *ctx, const char *path, const char *hdr, size_t hlen, uint64_t size,
                                   const shoal_pack_src *src, int n, uint8_t hash[32], char *err, size_t errlen);

typedef struct {
    const char *model, *plan, *worker, *out;
    int trunk; /* everything but the routed experts (plan optional, worker NULL) */
    int dry;   /* only list the layer files (j->layer is called), write nothing else */
    shoal_pack_layer_fn layer;
    void *ctx;
} shoal_pack_job;

typedef struct {
    size_t nexperts;
    int nfiles;          /* layer files */
    uint64_t total_size; /* tensor bytes in the pack */
    char trunk[256];     /* the worker's trunk ROWSPEC, "" when none */
} shoal_pack_sum;

/* The tokenizer files a --trunk pack carries when the model has them. */
#define SHOAL_PACK_NTOK 4
extern const char *const shoal_pack_tokfiles[SHOAL_PACK_NTOK];

/* 0, or an exit code (3 invalid model or plan, 4 I/O) with err set. */
int shoal_pack_build(const shoal_pack_job *j, shoal_pack_sum *sum, char *err, size_t errlen);

/* Is path already the layer file we would write (same header and size, bytes
 * still hashing to path.blake2b)? 1 and hash filled when it is. */
int shoal_pack_layer_done(const char *path, const char *hdr, size_t hlen, uint64_t size, uint8_t *hash);
/* Write path atomically (tmp, fsync, rename). */
int shoal_pack_write_small(const char *path, const void *b, size_t n, char *err, size_t errlen);
/* Store hash as path.blake2b (the checksum beside a finished layer file). */
int shoal_pack_write_sum(const char *path, const uint8_t hash[32], char *err, size_t errlen);

/* Whole-buffer I/O that retries EINTR and short counts (pack and pull):
 * 0, -errno, or SHOAL_EIO when pread meets the end of the file. */
int shoal_pack_write_all(int fd, const void *b, size_t n);
int shoal_pack_pread_all(int fd, void *b, size_t n, uint64_t off);

#endif
