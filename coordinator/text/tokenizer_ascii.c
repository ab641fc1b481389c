/* tokenizer: the ASCII fast path of the K3 pre-tokenizer. Most text is mostly
 * ASCII and its pieces are short, so PCRE2's per-match cost (~200 ns) was most
 * of the encoding time. This decides the next piece without PCRE2 when every
 * character the pattern would have to look at is ASCII, and answers 0 ("ask
 * PCRE2") as soon as one is not: a non-ASCII character could be a letter, a
 * digit, white space, punctuation, Han, or U+017F in a contraction. PCRE2
 * stays the definition: the unit test and fuzz_tokenizer compare the two
 * splits, and the oracle test compares the ids with tiktoken.
 *
 * The alternatives of SPEC §5.2 restricted to ASCII (classes: UPPER = A-Z,
 * LOWER = a-z, N = 0-9, WS = \t \n \v \f \r and space, PREFIX = not \r \n,
 * letter or digit, PUNCT = not WS, letter or digit), tried in order at i:
 *   1  Han: never ASCII.
 *   2  PREFIX? UPPER* LOWER+ C?   3  PREFIX? UPPER+ LOWER* C?
 *      UPPER and LOWER are disjoint on ASCII, so backtracking inside the runs
 *      never helps: with the prefix taken (c in PREFIX, then a letter), the
 *      uppercase run, then a lowercase run (2) or none (3). c in PREFIX but not
 *      followed by a letter: both fail (without the prefix c is no letter).
 *      C = (?i:'s|'t|'re|'ve|'m|'ll|'d), first letters distinct.
 *   4  N{1,3}.
 *   5  " "?PUNCT+[\r\n]*.
 *   6  WS*[\r\n]+: the WS run up to and including its last \r or \n.
 *   7  WS+(?!\S): the run less its last character (the whole run at the end
 *      of the subject), when that leaves at least one character.
 *   8  WS+: the one-character run.
 *
 * Then the same on code points, for the non-ASCII characters of CJK text
 * (PCRE2 was a third of the instructions of a Chinese text): cp_cls() knows
 * the classes of some ranges (Han, kana, Hangul, CJK and full-width
 * punctuation, full-width letters and digits, the ideographic space) and says
 * "unknown" (-1: ask PCRE2) for every other non-ASCII code point; the unit
 * test t_unicode_classes checks every class bit of every code point it knows
 * against the oracle's tables, so it cannot drift. Combining marks, which are
 * in PREFIX and in UPPER/LOWER at once, are not known. What changes:
 *   1  Han+: greedy with nothing after it, so the whole run of Han.
 *   2, 3  UPPER and LOWER overlap outside ASCII (Lo, Lm: kana, Hangul), so
 *      the backtracking is spelled out in letters().
 *   7  "the run less its last character" counts characters, not bytes.
 */
#include <stddef.h>
#include <stdint.h>

#include "coordinator/text/tokenizer_int.h"

enum { UP = 1, LO = 2, DG = 4, WS = 8, NL = 16, PF = 32, PU = 64, HN = 128 };

static const uint8_t cls[128] = {
    ['\t'] = WS, ['\n'] = WS | NL, ['\v'] = WS, ['\f'] = WS, ['\r'] = WS | NL, [' '] = WS,
    ['0'] = DG, ['1'] = DG, ['2'] = DG, ['3'] = DG, ['4'] = DG,
    ['5'] = DG, ['6'] = DG, ['7'] = DG, ['8'] = DG, ['9'] = DG,
    ['A'] = UP, ['B'] = UP, ['C'] = UP, ['D'] = UP, ['E'] = UP, ['F'] = UP, ['G'] = UP,
    ['H'] = UP, ['I'] = UP, ['J'] = UP, ['K'] = UP, ['L'] = UP, ['M'] = UP, ['N'] = UP,
    ['O'] = UP, ['P'] = UP, ['Q'] = UP, ['R'] = UP, ['S'] = UP, ['T'] = UP, ['U'] = UP,
    ['V'] = UP, ['W'] = UP, ['X'] = UP, ['Y'] = UP, ['Z'] = UP,
    ['a'] = LO, ['b'] = LO, ['c'] = LO, ['d'] = LO, ['e'] = LO, ['f'] = LO, ['g'] = LO,
    ['h'] = LO, ['i'] = LO, ['j'] = LO, ['k'] = LO, ['l'] = LO, ['m'] = LO, ['n'] = LO,
    ['o'] = LO, ['p'] = LO, ['q'] = LO, ['r'] = LO, ['s'] = LO, ['t'] = LO, ['u'] = LO,
    ['v'] = LO, ['w'] = LO, ['x'] = LO, ['y'] = LO, ['z'] = LO,
};

#define LETTER (UP | LO)

/* ASCII: PREFIX = not \r \n, letter or digit; PUNCT = not WS, letter or digit */
static inline int ascii_cls(uint8_t c)
{
    int b = cls[c];
    if (!(b & (NL | LETTER | DG)))
        b |= PF;
    if (!(b & (WS | LETTER | DG)))
        b |= PU;
    return b;
}

/* the pattern's classes of a non-ASCII code point, -1 if not known here */
static int uni_cls(uint32_t c)
{
    if (c < 0x3000)
        return -1;
    if ((c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF))
        return HN;
    if (c >= 0xAC00 && c <= 0xD7A3) /* Hangul syllables (Lo) */
        return UP | LO;
    if (c <= 0x30FF) {
        if (c == 0x3000)
            return WS | PF;
        if (c <= 0x3004 || (c >= 0x3008 && c <= 0x3020) || c == 0x309B || c == 0x309C || c == 0x30A0 ||
            c == 0x30FB)
            return PF | PU; /* CJK punctuation and symbols, kana marks (Sk), ゠ ・ */
        if ((c >= 0x3041 && c <= 0x3096) || (c >= 0x309D && c <= 0x309F) || (c >= 0x30A1 && c <= 0x30FA) ||
            c >= 0x30FC)
            return UP | LO; /* hiragana and katakana (Lo, Lm) */
        return -1;
    }
    if (c >= 0xFF01 && c <= 0xFF9F) { /* full-width ASCII, half-width katakana */
        if (c >= 0xFF10 && c <= 0xFF19)
            return DG;
        if (c >= 0xFF21 && c <= 0xFF3A)
            return UP;
        if (c >= 0xFF41 && c <= 0xFF5A)
            return LO;
        if (c >= 0xFF66)
            return UP | LO;
        return PF | PU;
    }
    return -1;
}

int shoal__tok_cp_class(uint32_t c)
{
    return c < 0x80 ? ascii_cls((uint8_t)c) : uni_cls(c);
}

/* the classes of the character at s[i] (valid UTF-8) and its length in *l;
 * -1 if not known here or cut by n */
static inline int cp_cls(const uint8_t *s, size_t n, size_t i, size_t *l)
{
    uint8_t c = s[i];
    if (c < 0x80) {
        *l = 1;
        return ascii_cls(c);
    }
    if (c < 0xE0)
        return -1; /* 2-byte characters: none known here */
    size_t k = c < 0xF0 ? 3 : 4;
    if (i + k > n)
        return -1;
    *l = k;
    uint32_t cp = k == 3 ? (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3F)
                         : (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 |
                               (uint32_t)(s[i + 2] & 0x3F) << 6 | (s[i + 3] & 0x3F);
    return uni_cls(cp);
}

/* the optional contraction at e: its end, or 0 to ask PCRE2 */
static inline size_t contraction(const uint8_t *s, size_t n, size_t e)
{
    if (e + 1 >= n || s[e] != '\'')
        return e;
    uint8_t b = s[e + 1];
    if (b >= 0x80)
        return 0; /* U+017F matches (?i:s) */
    b |= 0x20;
    if (b == 's' || b == 't' || b == 'm' || b == 'd')
        return e + 2;
    if (e + 2 >= n)
        return e;
    uint8_t b2 = s[e + 2] | 0x20; /* no non-ASCII character folds to e or l */
    if ((b == 'r' || b == 'v') && b2 == 'e')
        return e + 3;
    if (b == 'l' && b2 == 'l')
        return e + 3;
    return e;
}

/* alternatives 2 and 3 from j, a letter (the prefix, if any, taken): UPPER*
 * greedy to u, then LOWER+ at the first position, going back from u, whose
 * character is in LOWER: at u itself (then the LOWER run from there), or at
 * the last character before u that is in both (then that character alone:
 * the ones after it are UPPER only). None: alternative 3, UPPER+ to u. */
static size_t letters(const uint8_t *s, size_t n, size_t j)
{
    size_t u = j, l = 0, both_end = 0;
    int c = 0;
    while (u < n) {
        c = cp_cls(s, n, u, &l);
        if (c < 0)
            return 0;
        if (!(c & UP))
            break;
        if (c & LO)
            both_end = u + l;
        u += l;
    }
    size_t e = u;
    if (u < n && (c & LO)) {
        while (e < n) {
            c = cp_cls(s, n, e, &l);
            if (c < 0)
                return 0;
            if (!(c & LO))
                break;
            e += l;
        }
    } else if (both_end) {
        e = both_end;
    }
    return contraction(s, n, e);
}

size_t shoal__tok_ascii_piece(const uint8_t *s, size_t n, size_t i)
{
    size_t l0, l;
    int c = cp_cls(s, n, i, &l0);
    if (c < 0)
        return 0;
    /* 1 */
    if (c & HN) {
        size_t j = i + l0;
        while (j < n) {
            int h = cp_cls(s, n, j, &l);
            if (h < 0)
                return 0;
            if (!(h & HN))
                break;
            j += l;
        }
        return j;
    }
    /* 2, 3: letters, with one PREFIX character before them */
    size_t j = i;
    int cj = c;
    if (!(c & LETTER) && (c & PF) && i + l0 < n) {
        int c1 = cp_cls(s, n, i + l0, &l);
        if (c1 < 0)
            return 0;
        if (c1 & LETTER) {
            j = i + l0;
            cj = c1;
        }
    }
    if (cj & LETTER)
        return letters(s, n, j);
    /* 4 */
    if (c & DG) {
        size_t k = i;
        for (int d = 0; d < 3 && k < n; d++) {
            int ck = cp_cls(s, n, k, &l);
            if (ck < 0)
                return 0;
            if (!(ck & DG))
                break;
            k += l;
        }
        return k;
    }
    /* 5 */
    size_t p = n;
    if (s[i] == ' ' && i + 1 < n) {
        int c1 = cp_cls(s, n, i + 1, &l);
        if (c1 < 0)
            return 0;
        if (c1 & PU)
            p = i + 1;
    } else if (c & PU) {
        p = i;
    }
    if (p < n) {
        size_t q = p;
        int cq = 0;
        while (q < n) {
            cq = cp_cls(s, n, q, &l);
            if (cq < 0)
                return 0;
            if (!(cq & PU))
                break;
            q += l;
        }
        while (q < n && (s[q] == '\r' || s[q] == '\n'))
            q++;
        return q;
    }
    /* 6, 7, 8: c is white space */
    if (!(c & WS))
        return 0;
    size_t k = i, chars = 0, last = 0;
    while (k < n) {
        int ck = cp_cls(s, n, k, &l);
        if (ck < 0)
            return 0;
        if (!(ck & WS))
            break;
        k += l;
        last = l;
        chars++;
    }
    for (size_t x = k; x > i; x--)
        if (s[x - 1] == '\r' || s[x - 1] == '\n')
            return x;
    if (k == n)
        return n;
    return chars >= 2 ? k - last : k;
}
