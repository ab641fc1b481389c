/* Strict JSON scanner for the safetensors store (common/st.c), not for other
 * modules. It reads the two large shapes the store parses, a shard header and
 * model.safetensors.index.json (several MB each in the real K3 layout),
 * without building a tree: the caller walks the structure it expects and asks
 * for one token at a time, skipping whatever it does not need. It was written
 * instead of jansson, whose DOM of the K3 layout takes ~3 s to build and walk
 * (docs/DEPENDENCIES.md).
 *
 * Guarantees: it accepts exactly RFC 8259 JSON (no trailing commas, no
 * comments, no leading zeros, valid UTF-8 only, escapes and surrogate pairs
 * decoded, \u0000 refused so that strings are C strings, skipped values nested
 * at most SHOAL_JSCAN_MAX_DEPTH deep). Strings without escapes are handed out
 * in place; the only allocation is the decode scratch (sbuf), grown on demand
 * and kept for the scanner's life. The first failure is kept in rc and err
 * (later ones do not overwrite it), as "<file>: malformed JSON at byte N: ..."
 * for bad syntax and "<file>: ..." for valid JSON of the wrong shape, naming
 * the tensor being read when one is set. Fuzzed through tests/fuzz/fuzz_st.c.
 *
 * The per-character helpers are static inline here or static in jscan.c, so
 * the hot loops stay inlined. Thread-safety: a scanner belongs to one thread;
 * distinct scanners share nothing. */
#ifndef SHOAL_JSCAN_H
#define SHOAL_JSCAN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Deepest nesting shoal__jskip accepts. */
#define SHOAL_JSCAN_MAX_DEPTH 64

/* The caller sets p, end and base (the text; base is where byte offsets in
 * messages count from), file, err and errlen, and clears tensor and rc; it
 * frees sbuf (and hbuf) when done. */
typedef struct {
    const char *p, *end, *base;
    const char *file;   /* for messages */
    const char *tensor; /* tensor being read, for messages (may be NULL) */
    int tensor_n;       /* its length (not always NUL-terminated) */
    char *err;
    size_t errlen;
    int rc;
    char *sbuf; /* decoded string (escapes) scratch */
    size_t scap;
    char *hbuf; /* the caller's: header buffer, reused across the shards of one open */
    size_t hcap;
} shoal__jscan;

/* Records malformed JSON at j->p (unless a failure is already recorded);
 * returns j->rc. */
int shoal__jfail(shoal__jscan *j, const char *what);

/* Valid JSON that is not a valid header/index (wrong types, keys, counts):
 * records what (unless a failure is already recorded); returns j->rc. */
int shoal__jinvalid(shoal__jscan *j, const char *what);

/* Reads a string. *out points at its *len bytes: into the input when the
 * string has no escapes (not NUL-terminated there), else into j->sbuf (decoded,
 * NUL-terminated, valid until the next string). A string never contains a
 * NUL byte (\u0000 is refused: names are C strings), so (ptr, len) is exact. */
int shoal__jstring(shoal__jscan *j, const char **out, size_t *len);

/* Validates one JSON number; if it is a non-negative integer that fits,
 * *u receives it and *is_uint = 1. */
int shoal__jnumber(shoal__jscan *j, uint64_t *u, int *is_uint);

/* Validates and skips any JSON value (depth: the nesting it starts at). */
int shoal__jskip(shoal__jscan *j, int depth);

static inline __attribute__((always_inline)) void shoal__jws(shoal__jscan *j)
{
    while (j->p < j->end && (unsigned char)*j->p <= ' ' &&
           (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static inline int shoal__jexpect(shoal__jscan *j, char c, const char *what)
{
    shoal__jws(j);
    if (j->p >= j->end || *j->p != c)
        return shoal__jfail(j, what);
    j->p++;
    return 0;
}

/* Peeks the next non-blank byte (0 at end). */
static inline char shoal__jpeek(shoal__jscan *j)
{
    shoal__jws(j);
    return j->p < j->end ? *j->p : 0;
}

/* The string s[0..n) (from shoal__jstring) equals the literal lit. */
static inline int shoal__jeq(const char *s, size_t n, const char *lit)
{
    return strlen(lit) == n && !memcmp(s, lit, n);
}

/* After a member or element: *more = 1 when another follows (','), 0 when
 * close ('}' or ']') ends the object or array. */
static inline int shoal__jnext(shoal__jscan *j, char close, int *more)
{
    char c = shoal__jpeek(j);
    if (c == ',') {
        j->p++;
        *more = 1;
        return 0;
    }
    if (c == close) {
        j->p++;
        *more = 0;
        return 0;
    }
    return shoal__jfail(j, close == '}' ? "expected ',' or '}'" : "expected ',' or ']'");
}

/* Only blanks are left after the top-level value. */
static inline int shoal__jend(shoal__jscan *j)
{
    shoal__jws(j);
    if (j->p != j->end)
        return shoal__jfail(j, "trailing bytes after the JSON object");
    return 0;
}

#endif
