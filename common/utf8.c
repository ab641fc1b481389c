/* utf8: UTF-8 validation, decoding and replacement (RFC 3629; U+FFFD per
 * maximal subpart, as Python's and WHATWG's decoders do). Leaf module of
 * common/: libc only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"

int shoal_utf8_step(const uint8_t *p, size_t n, uint32_t *cp)
{
    uint8_t b = p[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t c;
    if (b >= 0xC2 && b <= 0xDF) {
        need = 1;
        c = b & 0x1F;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        c = b & 0x0F;
        if (b == 0xE0)
            lo = 0xA0; /* no overlongs */
        else if (b == 0xED)
            hi = 0x9F; /* no surrogates */
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        c = b & 0x07;
        if (b == 0xF0)
            lo = 0x90;
        else if (b == 0xF4)
            hi = 0x8F; /* <= U+10FFFF */
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n)
            return 0;
        uint8_t x = p[i];
        if (x < lo || x > hi)
            return -i;
        lo = 0x80;
        hi = 0xBF;
        c = (c << 6) | (x & 0x3F);
    }
    *cp = c;
    return need + 1;
}

int shoal_utf8_valid(const char *src, size_t n)
{
    const uint8_t *p = (const uint8_t *)src;
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            if (!(w & 0x8080808080808080ull)) {
                i += 8;
                continue;
            }
        }
        uint32_t cp;
        int r = shoal_utf8_step(p + i, n - i, &cp);
        if (r <= 0)
            return 0;
        i += (size_t)r;
    }
    return 1;
}

size_t shoal_utf8_sanitize(const char *src, size_t n, char **out, size_t *outlen)
{
    const uint8_t *p = (const uint8_t *)src;
    /* worst case: every byte becomes U+FFFD (3 bytes) */
    uint8_t *o = shoal_xmalloc(n * 3 + 1);
    size_t i = 0, k = 0, nrep = 0;
    while (i < n) {
        uint32_t cp;
        int r = shoal_utf8_step(p + i, n - i, &cp);
        if (r > 0) {
            memcpy(o + k, p + i, (size_t)r);
            k += (size_t)r;
            i += (size_t)r;
            continue;
        }
        /* r == 0: a truncated but so far valid sequence at the end is one
         * maximal subpart */
        size_t bad = r < 0 ? (size_t)-r : n - i;
        o[k++] = 0xEF;
        o[k++] = 0xBF;
        o[k++] = 0xBD;
        i += bad;
        nrep++;
    }
    o[k] = 0;
    *out = (char *)o;
    *outlen = k;
    return nrep;
}

/* One pass of shoal_utf8_clean with room for `room` bytes (excluding the NUL). */
static size_t clean_into(char *dst, size_t room, const uint8_t *p, size_t n, unsigned flags, int *cut)
{
    size_t i = 0, k = 0;
    *cut = 0;
    while (i < n) {
        uint32_t cp = 0;
        int r = shoal_utf8_step(p + i, n - i, &cp);
        char unit[8];
        size_t ulen, adv;
        if (r > 0 && cp != 0) {
            adv = (size_t)r;
            if ((flags & SHOAL_UTF8_NOCTRL) && (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0))) {
                ulen = (size_t)snprintf(unit, sizeof unit, "\\x%02x", (unsigned)cp & 0xffu);
            } else {
                memcpy(unit, p + i, adv);
                ulen = adv;
            }
        } else {
            /* invalid, NUL, or a valid prefix cut by the end of src */
            adv = r < 0 ? (size_t)-r : r > 0 ? (size_t)r : n - i;
            memcpy(unit, "\xEF\xBF\xBD", 3);
            ulen = 3;
        }
        if (k + ulen > room) {
            *cut = 1;
            break;
        }
        memcpy(dst + k, unit, ulen);
        k += ulen;
        i += adv;
    }
    dst[k] = '\0';
    return k;
}

size_t shoal_utf8_clean(char *dst, size_t cap, const char *src, size_t n, unsigned flags, int *cut)
{
    int c = 0;
    size_t k = 0;
    if (cap == 0) {
        if (cut)
            *cut = n > 0;
        return 0;
    }
    if (!src)
        n = 0;
    k = clean_into(dst, cap - 1, (const uint8_t *)src, n, flags, &c);
    if (c && (flags & SHOAL_UTF8_MARK) && cap > 4) {
        k = clean_into(dst, cap - 4, (const uint8_t *)src, n, flags, &c);
        memcpy(dst + k, "...", 4);
        k += 3;
        c = 1;
    }
    if (cut)
        *cut = c;
    return k;
}

const char *shoal_utf8_clip(char *dst, size_t cap, const char *src, unsigned flags)
{
    shoal_utf8_clean(dst, cap, src, src ? strlen(src) : 0, flags, NULL);
    return dst;
}
