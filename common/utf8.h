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

#endif
