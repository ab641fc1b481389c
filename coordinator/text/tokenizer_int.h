/* tokenizer internals shared by tokenizer*.c and the unit test (not for other
 * modules). */
#ifndef SHOAL_TOKENIZER_INT_H
#define SHOAL_TOKENIZER_INT_H

#include <stddef.h>
#include <stdint.h>

#include "coordinator/text/tokenizer.h"

/* The K3 pre-tokenizer pattern in PCRE2 syntax (UTF + UCP), NUL-terminated;
 * returns its length or -1 when buf is too small. */
int shoal__tok_pattern(char *buf, size_t n);

/* One character class of the pattern, as the pattern writes it, for the
 * class-by-class check against the oracle's tables (tests/fixtures/tokenizer/
 * unicode_classes.tsv). name: Han UPPER LOWER PREFIX N PUNCT WS NOTWS CRLF.
 * Returns the length, or -1 for an unknown name or a short buffer. */
int shoal__tok_class_pattern(const char *name, char *buf, size_t n);

/* Python's str.isspace (the long-run splitter of tokenization_kimi.py). */
int shoal__tok_py_isspace(uint32_t cp);

/* BPE of one piece without the whole-piece shortcut, with the quadratic (small)
 * or heap (large) algorithm forced: 0 small, 1 heap. For the test that both
 * agree. */
void shoal__tok_bpe_forced(const shoal_tok *t, const uint8_t *p, size_t n, int heap,
                           shoal_tok_ids *out);

/* The rank of the ordinary token with bytes p[0..n), or -1 if none. For the
 * test that the lookup finds every token. */
int32_t shoal__tok_rank(const shoal_tok *t, const uint8_t *p, size_t n);

/* The fast path of the pre-tokenizer (tokenizer_ascii.c): the end of the
 * piece that starts at s[i] when the pattern's decision needs only characters
 * whose classes it knows (ASCII, and the Han, kana, Hangul and CJK and
 * full-width punctuation of CJK text), else 0 (let PCRE2 decide). */
size_t shoal__tok_ascii_piece(const uint8_t *s, size_t n, size_t i);

/* The fast path's view of the pattern's classes of a code point: a mask of 1
 * UPPER, 2 LOWER, 4 N, 8 WS, 16 CRLF, 32 PREFIX, 64 PUNCT, 128 Han, or -1
 * when it does not know them (it then asks PCRE2). For the test against the
 * oracle's tables. */
int shoal__tok_cp_class(uint32_t cp);

/* Pre-tokenizes s[0..n) (valid UTF-8, one subject) and appends each piece's
 * start and end byte offsets to *ends; fast = 0 uses PCRE2 only. For the test
 * and fuzz target that compare the two. */
int shoal__tok_split(const shoal_tok *t, const uint8_t *s, size_t n, int fast, shoal_tok_ids *ends);

#endif
