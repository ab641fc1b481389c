/* packfile: a worker pack's manifest (docs/DEPLOY.md, "Packs"): the files of
 * a directory written by `shoal pack` -- config.json, the safetensors index and
 * shards holding one worker's routed experts -- with their sizes and BLAKE2b-256
 * checksums, the worker's name and RANGES, and the fingerprint of the full model
 * the pack was cut from (a pack holds only some experts, so the fingerprint
 * cannot be recomputed from it; PROTOCOL.md section 5). Read by the worker at
 * load (`shoal expert --model PACK [--verify]`), written by `shoal pack`.
 * In common/ because the worker reads it and the coordinator's tool writes it.
 * Objects are owned by the caller; not thread-safe to build. */
#ifndef SHOAL_PACKFILE_H
#define SHOAL_PACKFILE_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_PACKFILE_NAME "shoal-pack.json"
#define SHOAL_PACKFILE_HASH 32 /* BLAKE2b-256 */

typedef struct {
    char *name; /* a plain file name in the pack directory (no '/') */
    uint64_t bytes;
    uint8_t blake2b[SHOAL_PACKFILE_HASH];
} shoal_packfile_entry;

/* One slice of trunk rows in a worker pack (issue 16): rows lo..hi of the
 * full model's matrix `name`, stored as the pack tensor `tensor` of shape
 * [hi - lo + 1, shape[1]]; dtype, shape and nbytes are the FULL matrix's, as
 * in the model the pack was cut from, so the worker can announce the trunk
 * fingerprint (PROTOCOL.md §3.7) a worker on the full model would. */
typedef struct {
    char *name, *tensor;
    uint32_t lo, hi;
    char dtype[8]; /* "BF16" or "F32" */
    uint64_t shape[2];
    uint64_t nbytes;
} shoal_packfile_trows;

typedef struct {
    char *worker;  /* the plan's worker name */
    char *experts; /* its RANGES */
    uint8_t fingerprint[32];
    int nfiles;
    shoal_packfile_entry *files;
    char *trunk; /* the ROWSPEC the trunk rows were cut for; NULL when the pack holds none */
    int ntrows;
    shoal_packfile_trows *trows;
} shoal_packfile;

/* 1 if dir holds a pack manifest. */
int shoal_packfile_is_pack(const char *dir);
/* Read dir/shoal-pack.json; every key checked, refused naming it
 * (SHOAL_EFORMAT) or -errno. The optional "trunk" (a string) and "trunk_rows"
 * (an array of {name, tensor, lo, hi, dtype, shape [R, C], nbytes}, lo <= hi <
 * R, nbytes = R * C * size(dtype)) come together or not at all. */
int shoal_packfile_read(shoal_packfile *p, const char *dir, char *err, size_t errlen);
void shoal_packfile_free(shoal_packfile *p); /* accepts a zeroed or freed p */
/* Every listed file exists with its size; with verify, its BLAKE2b-256 too
 * (reads every byte). SHOAL_EMODEL naming the file and both values. */
int shoal_packfile_check(const shoal_packfile *p, const char *dir, int verify, char *err, size_t errlen);
/* BLAKE2b-256 of a whole file and its size. 0 or -errno naming it. */
int shoal_packfile_hash(const char *path, uint8_t out[SHOAL_PACKFILE_HASH], uint64_t *bytes, char *err,
                        size_t errlen);
void shoal_packfile_hex(const uint8_t *b, size_t n, char *out); /* 2n + 1 bytes */
int shoal_packfile_unhex(const char *s, uint8_t *out, size_t n);  /* 0 or SHOAL_EFORMAT */

#endif
