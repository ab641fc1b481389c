/* tstream: the coordinator's trunk weight reader for a RAM budget smaller
 * than the trunk (`--trunk-gb`, docs/ARCHITECTURE.md "Trunk budget"). Owns
 * one descriptor per model file (O_DIRECT where the filesystem takes it, plus
 * a buffered one for small or unaligned reads), the two streaming buffers and
 * the background thread that fills them.
 *
 * A "unit" is a list of extents (byte ranges of the model files, one per
 * tensor or tensor slice) that is read as a whole into one buffer. The engine
 * makes one unit per layer (its matrices) and a few per lm_head (row slices),
 * loads the units that fit the budget once at open (shoal_tstream_read), and
 * streams the others: shoal_tstream_start takes them in consumption order
 * and a background thread reads unit i+1 into one buffer while the forward
 * computes from unit i in the other, cycling through the list once per
 * forward ("cycle"). Units marked optional (lm_head slices) are read in a
 * cycle only if shoal_tstream_begin said that cycle needs them.
 *
 * Thread-safety: one consumer thread (the forward's) calls begin/acquire/
 * release/reset; the reader thread is internal. Buffer contents are published
 * under the mutex (the consumer never sees a buffer before its read
 * completed). Every wait of the consumer has a deadline; a read error is
 * reported by the acquire that needed the unit, naming the file and tensor. */
#ifndef SHOAL_TSTREAM_H
#define SHOAL_TSTREAM_H

#include <stddef.h>
#include <stdint.h>

/* Alignment of O_DIRECT reads: offsets, lengths and buffer addresses. */
#define SHOAL_TSTREAM_ALIGN 4096u

typedef struct {
    const char *name; /* borrowed (the tensor's name in the store): for errors */
    int file;         /* index into the paths given at open */
    uint64_t off;     /* byte offset of the data in that file */
    uint64_t len;     /* bytes */
    size_t at;        /* out (shoal_tstream_layout): where the data lands in the unit's buffer */
} shoal_tstream_ext;

typedef struct {
    shoal_tstream_ext *ext; /* borrowed; lives as long as the stream */
    int n_ext;
    int optional; /* read only in cycles that asked for it (shoal_tstream_begin) */
    size_t bytes; /* out (shoal_tstream_layout): buffer bytes the unit needs */
} shoal_tstream_unit;

typedef struct {
    int no_direct;      /* 1: buffered reads only */
    int timeout_ms;     /* a consumer's wait for one unit; 0 = 300000 */
    size_t chunk_bytes; /* one pread at most this many bytes; 0 = 8 MiB */
} shoal_tstream_opts;

typedef struct {
    uint64_t bytes_read;  /* bytes returned by pread (incl. O_DIRECT alignment) */
    uint64_t units_read;  /* units read by the thread or shoal_tstream_read */
    uint64_t skipped;     /* optional units skipped */
    double read_s;        /* seconds spent in pread */
    double stall_s;       /* seconds the consumer waited in acquire */
    int direct;           /* 1 if every file took O_DIRECT so far */
} shoal_tstream_stats;

typedef struct shoal_tstream shoal_tstream;

/* Lay the unit out for O_DIRECT: every extent gets its own 4096-aligned span
 * covering its aligned file range, data at span + (off % 4096). Fills
 * ext[].at and bytes (a multiple of 4096). Pure. */
size_t shoal_tstream_layout(shoal_tstream_unit *u);

/* Open every file (paths borrowed until close). Returns 0 or -errno naming
 * the file. Allocates nothing large. */
int shoal_tstream_open(shoal_tstream **out, const char *const *paths, int nfiles, const shoal_tstream_opts *o,
                       char *err, size_t errlen);
/* Stops the thread (if started), frees the buffers, closes the files. NULL ok. */
void shoal_tstream_close(shoal_tstream *ts);

/* Synchronous: read unit u into dst (u->bytes, 4096-aligned). For the
 * resident units at open. 0 or SHOAL_EIO / -errno naming file and tensor. */
int shoal_tstream_read(shoal_tstream *ts, const shoal_tstream_unit *u, void *dst, char *err, size_t errlen);

/* Synchronous small read through the buffered descriptor (embedding rows):
 * len bytes at off of file into dst. No alignment needed. */
int shoal_tstream_pread(shoal_tstream *ts, int file, uint64_t off, size_t len, void *dst, const char *name,
                        char *err, size_t errlen);

/* Allocate the two buffers (max unit bytes each, touched so they are
 * resident now) and start the reader thread on units[0..n) (borrowed, laid
 * out), in consumption order. n >= 1. 0, or SHOAL_EINVAL. */
int shoal_tstream_start(shoal_tstream *ts, shoal_tstream_unit *units, int n, char *err, size_t errlen);

/* Buffer bytes allocated by start (2 x the largest unit). */
size_t shoal_tstream_buffer_bytes(const shoal_tstream *ts);

/* Consumer protocol, once per forward:
 *   begin(need_optional); then for i = 0..n-1 in order, skipping the optional
 *   units when need_optional is 0: acquire(i) ... release(); and nothing else
 *   between. acquire returns the unit's buffer (valid until release), or a
 *   negative code (read error or deadline; err names it). After any failure,
 *   or a forward abandoned part-way, call reset before the next begin. No
 *   allocation in begin/acquire/release. */
void shoal_tstream_begin(shoal_tstream *ts, int need_optional);
int shoal_tstream_acquire(shoal_tstream *ts, int i, const void **buf, char *err, size_t errlen);
void shoal_tstream_release(shoal_tstream *ts);
/* Stop the reader and drop both buffers' contents (joins the thread). */
void shoal_tstream_reset(shoal_tstream *ts);
/* After a reset: start the reader again at the first unit of a fresh cycle
 * (creates a thread: call it before the allocation-free part of a forward).
 * No-op while it runs. 0 or -errno. A reader that stops on a read error
 * keeps the error for the acquire that needs the unit; resetting and
 * resuming retries the reads, so a transient error costs one forward. */
int shoal_tstream_resume(shoal_tstream *ts, char *err, size_t errlen);

void shoal_tstream_get_stats(const shoal_tstream *ts, shoal_tstream_stats *out);

#endif
