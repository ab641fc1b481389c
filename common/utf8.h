/* utf8: UTF-8 helpers for every module that handles text from outside --
 * tokenizer, chat format, API error messages, logs. Valid means RFC 3629: no
 * surrogates, no overlongs, nothing above U+10FFFF. */
#ifndef SHOAL_UTF8_H
#define SHOAL_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* Decodes one UTF-8 sequence at p[0..n): > 0 its length (code point in *cp);
 * < 0 minus the length of the maximal invalid subpart; 0 when p[0..n) is a
 * proper prefix of a valid sequence (needs more bytes). n >= 1. */
int shoal_utf8_step(const uint8_t *p, size_t n, uint32_t *cp);

/* 1 if src[0..n) is valid UTF-8. */
int shoal_utf8_valid(const char *src, size_t n);

/* Writes src[0..n) with invalid sequences replaced (U+FFFD per maximal
 * subpart) into a new malloc'd NUL-terminated string, *outlen its length;
 * returns the number of replacements made. */
size_t shoal_utf8_sanitize(const char *src, size_t n, char **out, size_t *outlen);

/* Bounded clean copy, for every piece of outside text (a client's, a peer's, a
 * file's) that goes into JSON, an error message, a log line or a metric
 * label. Copies src[0..n) into dst (cap >= 1 bytes; always NUL-terminated):
 * each invalid sequence and each NUL becomes U+FFFD; with SHOAL_UTF8_NOCTRL
 * each control character (C0, DEL, C1) becomes "\\xNN" so a log line stays
 * one line; with SHOAL_UTF8_MARK a cut copy ends in "..." (within cap).
 * A character that does not fit whole is left out, never cut: the result is
 * valid UTF-8 whatever cap and src are. Returns the bytes written; *cut (may
 * be NULL) is set to 1 when some of src was left out. src may be NULL (n 0). */
enum { SHOAL_UTF8_NOCTRL = 1, SHOAL_UTF8_MARK = 2 };
size_t shoal_utf8_clean(char *dst, size_t cap, const char *src, size_t n, unsigned flags, int *cut);
/* The same for a NUL-terminated src; returns dst (for format arguments). */
const char *shoal_utf8_clip(char *dst, size_t cap, const char *src, unsigned flags);

#endif
