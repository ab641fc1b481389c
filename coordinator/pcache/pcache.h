/* pcache: the prefix cache (issue 32) -- the one public header of the cache
 * room (coordinator/pcache/). Owns three things:
 *   1. the state file format: one sequence state captured after a token
 *      prefix (engine.h shoal_seq_export), with the model fingerprint, the
 *      capture position, the prefix's token ids, their hash and checksums;
 *      pure encode/verify over byte buffers (fuzzed: tests/fuzz/fuzz_pcache.c)
 *      and file read/write. `shoal run --save-state/--load-state` and the
 *      disk tier below use it;
 *   2. the prefix index: captured states keyed by their token prefix; a
 *      lookup finds the longest captured prefix of a new prompt in
 *      O(prompt + entries) (a rolling hash of every prefix of the prompt
 *      compared against each entry's, then the ids themselves);
 *   3. the tiers: captures held in memory under a byte budget (least
 *      recently used evicted first) and, optionally, written to a directory
 *      so they survive a restart (re-indexed at open: a file whose header,
 *      fingerprint, size or ids do not match is refused by name, counted and
 *      never used; the payload checksum is verified when it is loaded, and a
 *      mismatch drops the entry: the caller then prefills instead).
 * Why captures and not a per-token cache: K3's KDA state is recurrent -- the
 * state after token p cannot be recovered from a later state -- so it is
 * captured during a prefill at the positions where later prompts may
 * diverge (the scheduler picks them: message ends and a stride), each
 * capture holding the KDA states, conv windows and the MLA rows 0..p.
 * Callers: the scheduler (coordinator/api/sched.c, on its model thread),
 * `shoal run`, `shoal serve` (open/close), tests. May use: common/, engine/.
 * Thread-safety: every call on one cache comes from one thread, except
 * shoal_pcache_get_stats (any thread); with a directory the cache runs its
 * own writer thread. The file functions are thread-safe. */
#ifndef SHOAL_PCACHE_H
#define SHOAL_PCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "coordinator/engine/engine.h"

#define SHOAL_PCACHE_FP_BYTES 32
#define SHOAL_PCACHE_HDR_BYTES 96
#define SHOAL_PCACHE_VERSION 1
/* capture positions at most (the format refuses more: 2^24 tokens) */
#define SHOAL_PCACHE_MAX_IDS (1 << 24)

/* ---- the state file (docs/ARCHITECTURE.md "prefix cache" has the layout) --
 * All integers little-endian. Header, 96 bytes:
 *    0  magic "SHOALST\x1a"       8
 *    8  u32 version (1)            12  u32 header bytes (96)
 *   16  fingerprint[32]            48  u32 n_ids (capture position, >= 1)
 *   52  u32 n_logits (0 or vocab)  56  u64 state_bytes
 *   64  u64 ids_hash (shoal_pcache_ids_hash of the ids)
 *   72  u64 payload checksum: shoal_pcache_sum over the ids bytes, then
 *       over the state bytes and the logits bytes, each seeded with the last
 *   80  u64 header checksum (shoal_pcache_sum over bytes 0..80)
 *   88  u64 reserved (0)
 * then ids (i32)[n_ids], the state bytes, logits (f32)[n_logits]: the file
 * is exactly that long. The checksums detect corruption and truncation, not
 * tampering (not cryptographic). */
typedef struct {
    uint32_t version;
    uint8_t fingerprint[SHOAL_PCACHE_FP_BYTES];
    uint32_t n_ids, n_logits;
    uint64_t state_bytes;
    uint64_t ids_hash;
    uint64_t payload_sum;
} shoal_pcache_hdr;

/* 64-bit checksum of p[n] continuing from seed (0 to start): four-lane
 * multiply-rotate rounds over 8-byte words, a final avalanche. */
uint64_t shoal_pcache_sum(uint64_t seed, const void *p, size_t n);
/* The prefix hash of ids[0..n): h = h * M + id + 1 per id (mod 2^64) from 0,
 * so every prefix's hash of a prompt comes from one pass. */
uint64_t shoal_pcache_ids_hash(const int32_t *ids, int n);
/* The whole file's size for h (header + ids + state + logits); 0 when it
 * would overflow. */
uint64_t shoal_pcache_file_size(const shoal_pcache_hdr *h);
/* Header bytes for h (checksum filled in). */
void shoal_pcache_hdr_encode(uint8_t out[SHOAL_PCACHE_HDR_BYTES], const shoal_pcache_hdr *h);
/* Parses and checks a header: magic, version, header size, header checksum,
 * n_ids in [1, SHOAL_PCACHE_MAX_IDS], n_logits <= 2^24, reserved 0, a size
 * that does not overflow. 0 or SHOAL_EFORMAT / SHOAL_EVERSION naming the
 * field. */
int shoal_pcache_hdr_decode(shoal_pcache_hdr *h, const uint8_t *buf, size_t n, char *err, size_t errlen);
/* A whole file in memory: header (decode), exact length, ids hash, payload
 * checksum. On success *h is the header and the parts start at buf +
 * SHOAL_PCACHE_HDR_BYTES (ids), + 4 n_ids (state), + state_bytes (logits).
 * 0 or SHOAL_EFORMAT / SHOAL_EVERSION naming the check that failed. */
int shoal_pcache_verify(shoal_pcache_hdr *h, const uint8_t *buf, size_t n, char *err, size_t errlen);

/* Writes a state file atomically (path.tmp, then rename): ids[n] (n >= 1),
 * state[state_bytes], logits[n_logits] (may be NULL with n_logits 0).
 * 0 or -errno / SHOAL_EINVAL naming the path. */
int shoal_pcache_file_write(const char *path, const uint8_t fp[SHOAL_PCACHE_FP_BYTES], const int32_t *ids, int n,
                            const void *state, size_t state_bytes, const float *logits, int n_logits, char *err,
                            size_t errlen);
/* A state file read whole and verified, for this model: fingerprint equal
 * to fp (else SHOAL_EFINGERPRINT) and state_bytes equal to
 * shoal_seq_state_size(n_ids) of the model the caller names through
 * state_fixed + n_ids * state_per_token (else SHOAL_EFORMAT). err names the
 * path and the reason. *out (free with shoal_pcache_file_free): */
typedef struct {
    shoal_pcache_hdr h;
    int32_t *ids;     /* [h.n_ids] */
    void *state;      /* [h.state_bytes] */
    float *logits;    /* [h.n_logits] or NULL */
    uint8_t *buf;     /* the file (ids, state and logits point into it) */
} shoal_pcache_file;
int shoal_pcache_file_read(shoal_pcache_file **out, const char *path, const uint8_t fp[SHOAL_PCACHE_FP_BYTES],
                           size_t state_fixed, size_t state_per_token, char *err, size_t errlen);
void shoal_pcache_file_free(shoal_pcache_file *f);

/* The model fingerprint a state is valid for: BLAKE2b-256 over a format
 * line, the sequence layout (seq_fixed_bytes, seq_bytes_per_token, vocab)
 * and, for every tensor of the model's store in file order, its name, dtype,
 * shape, byte size and first (up to) 64 data bytes -- so another model, a
 * different shape or another checkpoint of the same shape is told apart
 * without reading the weights. 0 or SHOAL_EIO naming the tensor. */
int shoal_pcache_fingerprint(uint8_t out[SHOAL_PCACHE_FP_BYTES], const shoal_model *m, char *err, size_t errlen);

/* ---- the cache ------------------------------------------------------------ */

typedef struct shoal_pcache shoal_pcache;

#define SHOAL_PCACHE_DISK_AUTO UINT64_MAX
#define SHOAL_PCACHE_DISK_AUTO_MAX (UINT64_C(64) << 30)

typedef struct {
    shoal_model *model;     /* borrowed; states are exported from / imported into its sequences */
    const uint8_t *fingerprint; /* SHOAL_PCACHE_FP_BYTES (copied) */
    uint64_t mem_bytes;     /* memory tier budget; 0: no memory tier (disk only, or off) */
    const char *dir;        /* disk tier directory (created if missing), or NULL */
    int max_entries;        /* captures indexed at most (0: 4096) */
    uint64_t disk_bytes;    /* disk tier budget: the files in dir hold at most this many bytes (least
                             * recently used removed first; 0: no cap; SHOAL_PCACHE_DISK_AUTO: half
                             * of the file system's free space plus what the cache's files hold at
                             * open, at most SHOAL_PCACHE_DISK_AUTO_MAX) */
} shoal_pcache_opts;

typedef struct {
    uint64_t lookups, hits;       /* resumes asked for, and found a prefix */
    uint64_t tokens_saved;        /* prompt tokens not prefilled thanks to a hit */
    uint64_t captures;            /* states captured (new entries) */
    uint64_t capture_bytes;       /* bytes copied by those captures */
    double capture_s;             /* seconds spent copying them (export) */
    uint64_t evictions;           /* memory entries evicted (budget) */
    uint64_t disk_reads, disk_read_bytes;   /* entries loaded from the directory */
    double disk_read_s;
    uint64_t disk_writes, disk_write_bytes; /* files written */
    double disk_write_s;
    uint64_t refused;             /* files refused (header, fingerprint, size, checksum) */
    uint64_t removed;             /* damaged files of this cache removed (refused for a bad header,
                                   * size, ids hash or checksum), and unfinished writes (.tmp) removed
                                   * at open */
    uint64_t disk_evictions;      /* files removed to keep the directory within opts.disk_bytes */
    uint64_t disk_bytes, disk_budget; /* bytes of this cache's files now (and queued), opts.disk_bytes */
    uint64_t mem_bytes, mem_entries, disk_entries; /* now */
    uint64_t mem_budget;          /* opts.mem_bytes */
} shoal_pcache_stats;

/* Opens the cache; with a directory: locks it (flock on the directory: one
 * process per directory, another one's open fails with SHOAL_EBUSY),
 * removes unfinished writes (`pc-*.shst.tmp`, left by a crash or a kill
 * during a write; each named in the log), indexes its state files (headers
 * and ids only; the payloads are read when used) and refuses the ones that do
 * not belong to this model, each named in the log: a damaged file of this
 * cache (its name `pc-*.shst`, a bad header, size or ids hash) is removed; a
 * file of another model, another format version or another name is left
 * where it is (not counted in the disk budget). The entries' ages come from
 * the files' modification times (a disk hit refreshes it), and the oldest
 * are removed until the files fit opts.disk_bytes. 0, SHOAL_EINVAL,
 * SHOAL_ECONFIG, SHOAL_EBUSY or -errno (the directory cannot be created or read). */
int shoal_pcache_open(shoal_pcache **out, const shoal_pcache_opts *o, char *err, size_t errlen);
void shoal_pcache_close(shoal_pcache *pc); /* accepts NULL */

/* The longest captured prefix of ids[0..n) no longer than max tokens: its
 * length, or 0. Does not touch the entry's age. */
int shoal_pcache_lookup(shoal_pcache *pc, const int32_t *ids, int n, int max);
/* 1 when ids[0..n) itself is captured. */
int shoal_pcache_has(shoal_pcache *pc, const int32_t *ids, int n);
/* Resume: seq (capacity >= the prefix) becomes the state after the longest
 * captured prefix of ids[0..n) of at most max tokens; returns its length
 * (0: none, seq untouched). A disk entry that fails its checksum or cannot
 * be read (truncated or changed since it was indexed) is refused by name,
 * dropped, its file removed when it is damaged, and the next longest is
 * tried.
 * Counts lookups, hits and tokens saved. */
int shoal_pcache_resume(shoal_pcache *pc, const int32_t *ids, int n, int max, shoal_seq *seq);
/* Capture: seq's state (at position n, which must equal shoal_seq_pos) as
 * the entry for ids[0..n), unless already captured (then only its age is
 * refreshed). Memory entries are evicted, least recently used first, to
 * fit the budget; the state is queued for the directory's writer when there
 * is one (a resume that needs it before it is written waits for it), after
 * the least recently used files are removed to keep the directory within
 * opts.disk_bytes (a file larger than that budget is not written).
 * A state larger than the whole memory budget goes to the directory only.
 * 0, or a code (the entry is then not kept). */
int shoal_pcache_capture(shoal_pcache *pc, const int32_t *ids, int n, const shoal_seq *seq, char *err,
                         size_t errlen);
/* The directory's writes are made by a writer thread (a capture is copied
 * and queued, at most 2 at a time; a capture finding the queue full waits
 * for room): flush waits (deadline 600 s) until every queued capture is
 * written and indexed as on disk. close flushes too. */
void shoal_pcache_flush(shoal_pcache *pc);
/* Evicts memory entries (least recently used first) until the memory tier
 * holds at most bytes; entries on disk stay indexed. For a state budget
 * shared with running sequences. */
void shoal_pcache_shrink(shoal_pcache *pc, uint64_t bytes);
/* Bytes the memory tier holds now (model thread). */
uint64_t shoal_pcache_mem_bytes(const shoal_pcache *pc);
void shoal_pcache_get_stats(shoal_pcache *pc, shoal_pcache_stats *out);

#endif
