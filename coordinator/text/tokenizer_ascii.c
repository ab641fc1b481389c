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
 * And one non-ASCII case, the CJK one (PCRE2 was a third of the instructions
 * of a Chinese text): alternative 1 (Han+) comes first and is greedy with
 * nothing after it, so a piece that starts with a Han character is the whole
 * run of Han characters. han_class() knows some ranges for sure (Han, or not
 * Han) and says "unknown" elsewhere; the unit test t_han_class checks every
 * code point it claims against PCRE2's class, so it cannot drift. */
#include <stddef.h>
#include <stdint.h>

#include "coordinator/text/tokenizer_int.h"

enum { UP = 1, LO = 2, DG = 4, WS = 8, NL = 16 };

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
#define IS_PREFIX(c) (!(cls[c] & (NL | LETTER | DG)))
#define IS_PUNCT(c) (!(cls[c] & (WS | LETTER | DG)))

/* end of the run of bytes of class mask from j; *stop = 1 when the run ended
 * at a non-ASCII byte (its class is unknown here) */
static inline size_t run(const uint8_t *s, size_t n, size_t j, uint8_t mask, int *stop)
{
    while (j < n && s[j] < 0x80 && (cls[s[j]] & mask))
        j++;
    *stop = j < n && s[j] >= 0x80;
    return j;
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

int shoal__tok_han_class(uint32_t c)
{
    if (c < 0x2E80)
        return 0;
    if ((c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF))
        return 1;
    if ((c >= 0x3000 && c <= 0x3004) || (c >= 0x3008 && c <= 0x3020) || (c >= 0x3040 && c <= 0x30FF) ||
        (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xFF00 && c <= 0xFFEF))
        return 0;
    return -1;
}

/* the code point at s[i] (valid UTF-8) and its length in *l; 0 for a
 * sequence cut by n (then PCRE2 decides) */
static inline uint32_t cp_at(const uint8_t *s, size_t n, size_t i, size_t *l)
{
    uint8_t c = s[i];
    size_t k = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (i + k > n)
        return *l = 0;
    *l = k;
    switch (k) {
    case 1:
        return c;
    case 2:
        return (uint32_t)(c & 0x1F) << 6 | (s[i + 1] & 0x3F);
    case 3:
        return (uint32_t)(c & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3F);
    default:
        return (uint32_t)(c & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 |
               (uint32_t)(s[i + 2] & 0x3F) << 6 | (s[i + 3] & 0x3F);
    }
}

/* alternative 1 at a non-ASCII s[i]: the end of the Han run, or 0 */
static size_t han_piece(const uint8_t *s, size_t n, size_t i)
{
    size_t l, j = i;
    uint32_t c = cp_at(s, n, j, &l);
    if (!l || shoal__tok_han_class(c) != 1)
        return 0;
    for (;;) {
        j += l;
        if (j == n)
            return j;
        c = cp_at(s, n, j, &l);
        if (!l)
            return 0;
        int h = shoal__tok_han_class(c);
        if (h == 0)
            return j;
        if (h < 0)
            return 0;
    }
}

size_t shoal__tok_ascii_piece(const uint8_t *s, size_t n, size_t i)
{
    uint8_t c = s[i];
    if (c >= 0x80)
        return han_piece(s, n, i);
    int stop;
    /* 2, 3: letters, with one PREFIX character before them */
    size_t j = i;
    if (!(cls[c] & LETTER) && IS_PREFIX(c) && i + 1 < n) {
        if (s[i + 1] >= 0x80)
            return 0;
        if (cls[s[i + 1]] & LETTER)
            j = i + 1;
    }
    if (cls[s[j]] & LETTER) {
        size_t k = run(s, n, j, UP, &stop);
        if (stop)
            return 0;
        size_t m = run(s, n, k, LO, &stop);
        if (stop)
            return 0;
        /* m > k: alternative 2; m == k > j: alternative 3 */
        return contraction(s, n, m);
    }
    /* 4 */
    if (cls[c] & DG) {
        size_t k = i;
        while (k < n && k < i + 3) {
            if (s[k] >= 0x80)
                return 0;
            if (!(cls[s[k]] & DG))
                break;
            k++;
        }
        return k;
    }
    /* 5 */
    size_t p = n;
    if (c == ' ' && i + 1 < n) {
        if (s[i + 1] >= 0x80)
            return 0;
        if (IS_PUNCT(s[i + 1]))
            p = i + 1;
    } else if (IS_PUNCT(c)) {
        p = i;
    }
    if (p < n) {
        size_t q = p;
        while (q < n && s[q] < 0x80 && IS_PUNCT(s[q]))
            q++;
        if (q < n && s[q] >= 0x80)
            return 0;
        while (q < n && s[q] < 0x80 && (cls[s[q]] & NL))
            q++;
        return q;
    }
    /* 6, 7, 8: c is white space */
    size_t k = run(s, n, i, WS, &stop);
    if (stop)
        return 0;
    for (size_t x = k; x > i; x--)
        if (cls[s[x - 1]] & NL)
            return x;
    if (k == n)
        return n;
    return k - i >= 2 ? k - 1 : k;
}
