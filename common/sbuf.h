/* sbuf: a growable NUL-terminated byte string (doubling, from 256 bytes),
 * for text assembled piece by piece off the hot paths (API response fields,
 * the scheduler's held-back output). Zero-initialise; free b->p. Aborts on
 * out-of-memory like shoal_xrealloc. */
#ifndef SHOAL_SBUF_H
#define SHOAL_SBUF_H

#include <stddef.h>
#include <string.h>

#include "common/err.h"

typedef struct {
    char *p;
    size_t n, cap;
} shoal_sbuf;

/* Append s[0..n) and keep b->p NUL-terminated. */
static inline void shoal_sbuf_add(shoal_sbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        b->p = shoal_xrealloc(b->p, cap);
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

#endif
