/* Strict JSON scanner (common/jscan.h): the entry points, and the helpers they
 * use per character (static, so that they stay inlined). */
#include "common/jscan.h"

#include <stdint.h>
#include <string.h>

#include "common/err.h"

int shoal__jfail(shoal__jscan *j, const char *what)
{
    if (j->rc)
        return j->rc;
    if (j->tensor)
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT,
                              "%s: malformed JSON at byte %zu (tensor '%.*s'): %s", j->file,
                              (size_t)(j->p - j->base), j->tensor_n, j->tensor, what);
    else
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: malformed JSON at byte %zu: %s",
                              j->file, (size_t)(j->p - j->base), what);
    return j->rc;
}

/* Valid JSON that is not a valid header/index (wrong types, keys, counts). */
int shoal__jinvalid(shoal__jscan *j, const char *what)
{
    if (j->rc)
        return j->rc;
    if (j->tensor)
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: tensor '%.*s': %s", j->file, j->tensor_n,
                              j->tensor, what);
    else
        j->rc = shoal_err_set(j->err, j->errlen, SHOAL_EFORMAT, "%s: %s (at byte %zu)", j->file, what,
                              (size_t)(j->p - j->base));
    return j->rc;
}

static void sbuf_put(shoal__jscan *j, size_t *n, const char *s, size_t k)
{
    if (*n + k + 1 > j->scap) {
        size_t cap = j->scap ? j->scap : 256;
        while (cap < *n + k + 1)
            cap *= 2;
        j->sbuf = shoal_xrealloc(j->sbuf, cap);
        j->scap = cap;
    }
    memcpy(j->sbuf + *n, s, k);
    *n += k;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int read_u4(shoal__jscan *j, unsigned *out)
{
    if (j->end - j->p < 4)
        return shoal__jfail(j, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(j->p[i]);
        if (h < 0)
            return shoal__jfail(j, "bad \\u escape");
        v = v << 4 | (unsigned)h;
    }
    j->p += 4;
    *out = v;
    return 0;
}

/* Length of a valid UTF-8 sequence at s (s < end, *s >= 0x80), or 0. */
static size_t utf8_len(const unsigned char *s, const unsigned char *end)
{
    unsigned c = s[0];
    size_t n;
    unsigned min;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef)
        n = 3, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4)
        n = 4, min = 0x10000;
    else
        return 0;
    if ((size_t)(end - s) < n)
        return 0;
    unsigned v = c & (0xff >> (n + 1));
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        v = v << 6 | (s[i] & 0x3f);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff))
        return 0;
    return n;
}

/* Plain string bytes: printable ASCII other than '"' and '\\' (one unsigned
 * compare covers both controls and non-ASCII). */
static inline int str_plain(unsigned char c)
{
    return (unsigned char)(c - 0x20) < 0x60 && c != '"' && c != '\\';
}

/* For the 8 bytes at p (little-endian), a mask with the high bit set in each
 * byte that is not plain (see str_plain): a quote, a backslash, a control
 * byte (< 0x20) or a non-ASCII byte. The has-zero / has-less-than word tricks
 * may also flag bytes above the first special one (borrows), never below it,
 * so the lowest set bit locates the first special byte exactly. */
static inline uint64_t swar_special(const char *p)
{
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    uint64_t w;
    memcpy(&w, p, 8);
    uint64_t q = w ^ (ones * '"'), b = w ^ (ones * '\\');
    uint64_t zq = (q - ones) & ~q, zb = (b - ones) & ~b, lt = (w - ones * 0x20) & ~w;
    return (zq | zb | lt | w) & highs;
}

/* Reads a string. *out points at its *len bytes: into the input when the
 * string has no escapes (not NUL-terminated there), else into j->sbuf (decoded,
 * NUL-terminated, valid until the next string). A string never contains a
 * NUL byte (\u0000 is refused: names are C strings), so (ptr, len) is exact. */
int shoal__jstring(shoal__jscan *j, const char **out, size_t *len)
{
    if (shoal__jexpect(j, '"', "expected a string"))
        return j->rc;
    const char *start = j->p;
    int copying = 0;
    size_t n = 0;
    for (;;) {
        const char *s = j->p;
        for (;;) {
            if (j->end - j->p < 8) {
                while (j->p < j->end && str_plain((unsigned char)*j->p))
                    j->p++;
                break;
            }
            uint64_t m = swar_special(j->p);
            if (m) { /* the lowest flagged byte is exactly the first special one */
                j->p += __builtin_ctzll(m) >> 3;
                break;
            }
            j->p += 8;
        }
        if (copying && j->p > s)
            sbuf_put(j, &n, s, (size_t)(j->p - s));
        if (j->p >= j->end)
            return shoal__jfail(j, "unterminated string");
        unsigned char c = (unsigned char)*j->p;
        if (c == '"') {
            if (!copying) {
                *out = start;
                *len = (size_t)(j->p - start);
                j->p++;
                return 0;
            }
            j->p++;
            break;
        }
        if (c < 0x20)
            return shoal__jfail(j, "control character in string");
        if (c >= 0x80) {
            size_t k = utf8_len((const unsigned char *)j->p, (const unsigned char *)j->end);
            if (!k)
                return shoal__jfail(j, "invalid UTF-8 in string");
            if (copying)
                sbuf_put(j, &n, j->p, k);
            j->p += k;
            continue;
        }
        /* escape: from here on the string is decoded into sbuf */
        if (!copying) {
            copying = 1;
            sbuf_put(j, &n, start, (size_t)(j->p - start));
        }
        j->p++;
        if (j->p >= j->end)
            return shoal__jfail(j, "unterminated escape");
        char e = *j->p++;
        char ob[4];
        size_t k = 1;
        switch (e) {
        case '"': ob[0] = '"'; break;
        case '\\': ob[0] = '\\'; break;
        case '/': ob[0] = '/'; break;
        case 'b': ob[0] = '\b'; break;
        case 'f': ob[0] = '\f'; break;
        case 'n': ob[0] = '\n'; break;
        case 'r': ob[0] = '\r'; break;
        case 't': ob[0] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (read_u4(j, &cp))
                return j->rc;
            if (cp >= 0xdc00 && cp <= 0xdfff)
                return shoal__jfail(j, "lone low surrogate in \\u escape");
            if (cp >= 0xd800 && cp <= 0xdbff) {
                unsigned lo;
                if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                    return shoal__jfail(j, "lone high surrogate in \\u escape");
                j->p += 2;
                if (read_u4(j, &lo))
                    return j->rc;
                if (lo < 0xdc00 || lo > 0xdfff)
                    return shoal__jfail(j, "bad surrogate pair in \\u escape");
                cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
            }
            if (cp == 0)
                return shoal__jfail(j, "NUL character in string");
            if (cp < 0x80) {
                ob[0] = (char)cp;
            } else if (cp < 0x800) {
                ob[0] = (char)(0xc0 | cp >> 6);
                ob[1] = (char)(0x80 | (cp & 0x3f));
                k = 2;
            } else if (cp < 0x10000) {
                ob[0] = (char)(0xe0 | cp >> 12);
                ob[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
                ob[2] = (char)(0x80 | (cp & 0x3f));
                k = 3;
            } else {
                ob[0] = (char)(0xf0 | cp >> 18);
                ob[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
                ob[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
                ob[3] = (char)(0x80 | (cp & 0x3f));
                k = 4;
            }
            break;
        }
        default:
            return shoal__jfail(j, "bad escape in string");
        }
        sbuf_put(j, &n, ob, k);
    }
    sbuf_put(j, &n, "", 0);
    j->sbuf[n] = 0;
    *out = j->sbuf;
    *len = n;
    return 0;
}

/* Validates one JSON number; if it is a non-negative integer that fits,
 * *u receives it and *is_uint = 1. */
int shoal__jnumber(shoal__jscan *j, uint64_t *u, int *is_uint)
{
    shoal__jws(j);
    const char *s = j->p;
    int neg = 0, frac = 0, overflow = 0;
    uint64_t v = 0;
    if (j->p < j->end && *j->p == '-')
        neg = 1, j->p++;
    if (j->p >= j->end || *j->p < '0' || *j->p > '9')
        return shoal__jfail(j, "expected a number");
    if (*j->p == '0') {
        j->p++;
        if (j->p < j->end && *j->p >= '0' && *j->p <= '9')
            return shoal__jfail(j, "leading zero in number");
    } else {
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
            uint64_t d = (uint64_t)(*j->p++ - '0');
            if (__builtin_mul_overflow(v, 10, &v))
                overflow = 1;
            if (__builtin_add_overflow(v, d, &v))
                overflow = 1;
        }
    }
    if (j->p < j->end && *j->p == '.') {
        frac = 1;
        j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9')
            return shoal__jfail(j, "bad fraction in number");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
            j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        frac = 1;
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-'))
            j->p++;
        if (j->p >= j->end || *j->p < '0' || *j->p > '9')
            return shoal__jfail(j, "bad exponent in number");
        while (j->p < j->end && *j->p >= '0' && *j->p <= '9')
            j->p++;
    }
    (void)s;
    *is_uint = !neg && !frac && !overflow;
    *u = v;
    return 0;
}

static int jliteral(shoal__jscan *j, const char *lit)
{
    size_t n = strlen(lit);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, lit, n))
        return shoal__jfail(j, "bad literal");
    j->p += n;
    return 0;
}

/* Validates and skips any JSON value. */
int shoal__jskip(shoal__jscan *j, int depth)
{
    if (depth > SHOAL_JSCAN_MAX_DEPTH)
        return shoal__jfail(j, "nesting too deep");
    char c = shoal__jpeek(j);
    const char *str;
    size_t len;
    uint64_t u;
    int isu;
    switch (c) {
    case '"':
        return shoal__jstring(j, &str, &len);
    case '{':
        j->p++;
        if (shoal__jpeek(j) == '}') {
            j->p++;
            return 0;
        }
        for (;;) {
            if (shoal__jstring(j, &str, &len) || shoal__jexpect(j, ':', "expected ':'") || shoal__jskip(j, depth + 1))
                return j->rc;
            c = shoal__jpeek(j);
            j->p++;
            if (c == '}')
                return 0;
            if (c != ',') {
                j->p--;
                return shoal__jfail(j, "expected ',' or '}'");
            }
        }
    case '[':
        j->p++;
        if (shoal__jpeek(j) == ']') {
            j->p++;
            return 0;
        }
        for (;;) {
            if (shoal__jskip(j, depth + 1))
                return j->rc;
            c = shoal__jpeek(j);
            j->p++;
            if (c == ']')
                return 0;
            if (c != ',') {
                j->p--;
                return shoal__jfail(j, "expected ',' or ']'");
            }
        }
    case 't':
        return jliteral(j, "true");
    case 'f':
        return jliteral(j, "false");
    case 'n':
        return jliteral(j, "null");
    default:
        return shoal__jnumber(j, &u, &isu);
    }
}
