/* tokenizer: vocabulary loading, the K3 pre-tokenizer, rank BPE, special
 * tokens, decoding and the streaming detokenizer. See tokenizer.h for the
 * contracts; the comments here say why the code is shaped as it is. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "coordinator/text/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <pcre2.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/utf8.h"
#include "coordinator/text/tokenizer_int.h"
#include "coordinator/text/tokenizer_uni.h"

/* tokenization_kimi.py: TIKTOKEN_MAX_ENCODE_CHARS and MAX_NO_WHITESPACES_CHARS */
#define MAX_ENCODE_CHARS 400000
#define MAX_RUN_CHARS 25000
/* pieces up to this many bytes use tiktoken's quadratic merge loop (fastest for
 * the short pieces of real text); longer ones the heap, O(n log n) */
#define BPE_SMALL_MAX 128
#define RANK_NONE INT32_MAX

typedef struct {
    uint32_t child;   /* first child node index, 0 = none */
    uint32_t sibling; /* next sibling, 0 = none */
    int32_t id;       /* special id ending here, -1 = none */
    uint8_t byte;
} trie_node;

struct shoal_tok {
    int32_t n_ranks, n_reserved;
    uint8_t *bytes;    /* all ordinary token bytes, rank order */
    uint32_t *off;     /* n_ranks + 1 offsets into bytes */
    uint64_t *slots;   /* hash: (tag << 32) | (rank + 1); 0 = empty */
    uint32_t mask;
    uint64_t *filt;    /* filter in front of slots (see filt_bits), fmask + 1 words */
    uint32_t fmask;
    int32_t *pair;     /* rank of each 2-byte string (65536), RANK_NONE if none */
    int32_t byte_rank[256];
    char **sname;      /* n_reserved special names (named or reserved_token_ID) */
    size_t *sname_len;
    uint8_t *skippable; /* n_reserved flags */
    trie_node *trie;
    uint32_t trie_n;
    uint8_t first_byte[256]; /* 1 if some special name starts with this byte */
    int32_t bos, eos, pad, unk;
    uint8_t sha256[32];
    size_t vocab_bytes;
    pcre2_code *re;
    int jit;
};

/* Python str.isspace: general category Zs or bidirectional class WS, B or S
 * (checked against Python in tests/fixtures/tokenizer/unicode_classes.tsv). */
int shoal__tok_py_isspace(uint32_t c)
{
    if (c < 0x80)
        return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* ------------------------------------------------------------- pattern -- */

/* SPEC §5.2 in PCRE2 syntax. The oracle's `[X&&[^\p{Han}]]` (set intersection)
 * becomes `(?:(?!HAN)[X])`; each property gets the code points the oracle's
 * Unicode tables have and Debian's PCRE2 lacks (tokenizer_uni.h); \p{Han} is
 * PCRE2's \p{sc:Han} (script, as in Rust's regex: PCRE2's plain \p{Han} means
 * Script_Extensions and also matches CJK punctuation), and \s is written out
 * (PCRE2's also matches U+180E). */
#define P_HAN "\\p{sc:Han}" SHOAL_TOK_UNI_HAN_ADD
#define P_L "\\p{L}" SHOAL_TOK_UNI_L_ADD
#define P_N "\\p{N}" SHOAL_TOK_UNI_N_ADD
#define P_UPPER_ITEMS                                                                              \
    "\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}" SHOAL_TOK_UNI_LU_ADD SHOAL_TOK_UNI_LT_ADD                \
        SHOAL_TOK_UNI_LM_ADD SHOAL_TOK_UNI_LO_ADD SHOAL_TOK_UNI_M_ADD
#define P_LOWER_ITEMS                                                                              \
    "\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}" SHOAL_TOK_UNI_LL_ADD SHOAL_TOK_UNI_LM_ADD SHOAL_TOK_UNI_LO_ADD  \
        SHOAL_TOK_UNI_M_ADD

#define C_HAN "[" P_HAN "]"
#define C_UPPER "(?:(?!" C_HAN ")[" P_UPPER_ITEMS "])"
#define C_LOWER "(?:(?!" C_HAN ")[" P_LOWER_ITEMS "])"
#define C_PREFIX "[^\\r\\n" P_L P_N "]"
#define C_N "[" P_N "]"
#define C_PUNCT "[^" SHOAL_TOK_UNI_WS P_L P_N "]"
#define C_WS "[" SHOAL_TOK_UNI_WS "]"
#define C_NOTWS "[^" SHOAL_TOK_UNI_WS "]"
#define C_CRLF "[\\r\\n]"
#define CONTRACTIONS "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

static const char k3_pattern[] =
    C_HAN "+"                                                              /* 1 */
    "|" C_PREFIX "?" C_UPPER "*" C_LOWER "+" CONTRACTIONS                  /* 2 */
    "|" C_PREFIX "?" C_UPPER "+" C_LOWER "*" CONTRACTIONS                  /* 3 */
    "|" C_N "{1,3}"                                                        /* 4 */
    "| ?" C_PUNCT "+" C_CRLF "*"                                           /* 5 */
    "|" C_WS "*" C_CRLF "+"                                                /* 6 */
    "|" C_WS "+(?!" C_NOTWS ")"                                            /* 7 */
    "|" C_WS "+";                                                          /* 8 */

int shoal__tok_pattern(char *buf, size_t n)
{
    size_t l = sizeof k3_pattern - 1;
    if (l + 1 > n)
        return -1;
    memcpy(buf, k3_pattern, l + 1);
    return (int)l;
}

int shoal__tok_class_pattern(const char *name, char *buf, size_t n)
{
    static const struct {
        const char *name, *pat;
    } classes[] = {
        {"Han", C_HAN},     {"UPPER", C_UPPER}, {"LOWER", C_LOWER}, {"PREFIX", C_PREFIX},
        {"N", C_N},         {"PUNCT", C_PUNCT}, {"WS", C_WS},       {"NOTWS", C_NOTWS},
        {"CRLF", C_CRLF},
    };
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++) {
        if (strcmp(classes[i].name, name))
            continue;
        size_t l = strlen(classes[i].pat);
        if (l + 1 > n)
            return -1;
        memcpy(buf, classes[i].pat, l + 1);
        return (int)l;
    }
    return -1;
}

/* ---------------------------------------------------------- vocabulary -- */

static inline uint64_t hash_bytes(const uint8_t *p, size_t n)
{
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xFF51AFD7ED558CCDull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
        p += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++)
        v |= (uint64_t)p[i] << (8 * i);
    h = (h ^ v) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return h;
}

/* memcmp(a, b, n) == 0 for the short strings of BPE, without a libc call or
 * a loop per byte: the first and the last word of the width that fits n
 * (overlapping when n is not a multiple), never a byte outside [0, n) */
static inline int same_bytes(const uint8_t *a, const uint8_t *b, size_t n)
{
    if (n >= 8) {
        uint64_t x, y;
        for (size_t i = 0; i + 8 < n; i += 8) {
            memcpy(&x, a + i, 8);
            memcpy(&y, b + i, 8);
            if (x != y)
                return 0;
        }
        memcpy(&x, a + n - 8, 8);
        memcpy(&y, b + n - 8, 8);
        return x == y;
    }
    if (n >= 4) {
        uint32_t x0, y0, x1, y1;
        memcpy(&x0, a, 4);
        memcpy(&y0, b, 4);
        memcpy(&x1, a + n - 4, 4);
        memcpy(&y1, b + n - 4, 4);
        return ((x0 ^ y0) | (x1 ^ y1)) == 0;
    }
    if (n >= 2) {
        uint16_t x0, y0, x1, y1;
        memcpy(&x0, a, 2);
        memcpy(&y0, b, 2);
        memcpy(&x1, a + n - 2, 2);
        memcpy(&y1, b + n - 2, 2);
        return ((x0 ^ y0) | (x1 ^ y1)) == 0;
    }
    return n == 0 || a[0] == b[0];
}

/* The rank table (2^19 slots x 8 bytes with K3's 163,584 ranks) is larger
 * than L2, and most lookups of a byte-level BPE are for strings that are no
 * token (the bytes across two merged parts): each was a cache miss on the
 * first probe. A blocked Bloom filter of 3 bits in one 64-bit word per token
 * (n_ranks / 8 words: 256 KiB for K3, fits L2 beside the pair table) answers
 * most of those without touching the table; a filter "maybe" goes on to the
 * exact lookup, so the answer never depends on it. Bits of h: word index from
 * 20 up, bit positions 46..63 (the slot index uses 0..18, the tag 32..63). */
static inline uint64_t filt_bits(uint64_t h)
{
    return 1ull << ((h >> 46) & 63) | 1ull << ((h >> 52) & 63) | 1ull << (h >> 58);
}

static inline int filt_maybe(const shoal_tok *t, uint64_t h)
{
    uint64_t m = filt_bits(h);
    return (t->filt[(h >> 20) & t->fmask] & m) == m;
}

/* the exact lookup, after the filter said maybe */
static inline int32_t probe(const shoal_tok *t, const uint8_t *p, size_t n, uint64_t h)
{
    uint32_t tag = (uint32_t)(h >> 32), i = (uint32_t)h & t->mask;
    for (;;) {
        uint64_t s = t->slots[i];
        if (!s)
            return RANK_NONE;
        if ((uint32_t)(s >> 32) == tag) {
            uint32_t r = (uint32_t)s - 1;
            if (t->off[r + 1] - t->off[r] == n && same_bytes(t->bytes + t->off[r], p, n))
                return (int32_t)r;
        }
        i = (i + 1) & t->mask;
    }
}

static inline int32_t rank_of_h(const shoal_tok *t, const uint8_t *p, size_t n, uint64_t h)
{
    return filt_maybe(t, h) ? probe(t, p, n, h) : RANK_NONE;
}

static inline int32_t rank_of(const shoal_tok *t, const uint8_t *p, size_t n)
{
    return rank_of_h(t, p, n, hash_bytes(p, n));
}

int32_t shoal__tok_rank(const shoal_tok *t, const uint8_t *p, size_t n)
{
    int32_t r = rank_of(t, p, n);
    return r == RANK_NONE ? -1 : r;
}

static int b64val(int c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

/* Strict standard base64 with padding; returns the decoded length or -1. */
static long b64decode(const char *s, size_t n, uint8_t *out)
{
    if (n == 0 || n % 4)
        return -1;
    size_t k = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int j = 0; j < 4; j++) {
            if (s[i + j] == '=' && i + 4 == n && j >= 2) {
                v[j] = 0;
                pad++;
                continue;
            }
            if (pad)
                return -1;
            v[j] = b64val((unsigned char)s[i + j]);
            if (v[j] < 0)
                return -1;
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[k++] = (uint8_t)(w >> 16);
        if (pad < 2)
            out[k++] = (uint8_t)(w >> 8);
        if (pad < 1)
            out[k++] = (uint8_t)w;
    }
    return (long)k;
}

static int read_file(const char *path, char **buf, size_t *len, char *err, size_t errlen)
{
    int orc = 0;
    FILE *f = shoal_fopen_regular(path, &orc); /* a FIFO must not block the load */
    if (!f)
        return orc == SHOAL_EFORMAT ? shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: not a regular file", path)
                                    : shoal_err_set(err, errlen, orc, "%s: %s", path, strerror(-orc));
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: cannot seek", path);
    }
    long sz = ftell(f);
    if (sz < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: cannot size", path);
    }
    char *b = shoal_xmalloc((size_t)sz + 1);
    if (fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        fclose(f);
        free(b);
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: short read", path);
    }
    fclose(f);
    b[sz] = 0;
    *buf = b;
    *len = (size_t)sz;
    return 0;
}

static void hash_insert(shoal_tok *t, int32_t r)
{
    const uint8_t *p = t->bytes + t->off[r];
    size_t n = t->off[r + 1] - t->off[r];
    uint64_t h = hash_bytes(p, n);
    uint32_t i = (uint32_t)h & t->mask;
    while (t->slots[i])
        i = (i + 1) & t->mask;
    t->slots[i] = (h >> 32) << 32 | (uint64_t)(uint32_t)(r + 1);
    t->filt[(h >> 20) & t->fmask] |= filt_bits(h);
}

static int load_ranks(shoal_tok *t, const char *path, char *err, size_t errlen)
{
    char *buf = NULL;
    size_t len = 0;
    int rc = read_file(path, &buf, &len, err, errlen);
    if (rc)
        return rc;
    crypto_hash_sha256(t->sha256, (const unsigned char *)buf, len);
    t->vocab_bytes = len;

    /* pass 1: count lines (tiktoken skips empty ones) */
    size_t nlines = 0;
    for (size_t i = 0; i < len;) {
        size_t e = i;
        while (e < len && buf[e] != '\n')
            e++;
        if (e > i && !(e == i + 1 && buf[i] == '\r'))
            nlines++;
        i = e + 1;
    }
    if (nlines == 0 || nlines > INT32_MAX / 2) {
        free(buf);
        return shoal_err_set(err, errlen, SHOAL_EMODEL, "%s: no tokens", path);
    }
    int32_t n = (int32_t)nlines;
    uint32_t *len_of = shoal_xcalloc((size_t)n, sizeof *len_of);
    uint8_t *seen = shoal_xcalloc((size_t)n, 1);
    uint8_t **tmp = shoal_xcalloc((size_t)n, sizeof *tmp);
    uint8_t *dec = shoal_xmalloc(len + 4);
    size_t dec_used = 0, line = 0;
    rc = 0;
    for (size_t i = 0; i < len && !rc;) {
        size_t e = i;
        while (e < len && buf[e] != '\n')
            e++;
        size_t le = e;
        if (le > i && buf[le - 1] == '\r')
            le--;
        line++;
        if (le == i) {
            i = e + 1;
            continue;
        }
        size_t sp = i;
        while (sp < le && buf[sp] != ' ')
            sp++;
        if (sp == le || sp == i) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s:%zu: expected 'base64 rank'", path, line);
            break;
        }
        long dl = b64decode(buf + i, sp - i, dec + dec_used);
        if (dl <= 0) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s:%zu: invalid base64 token", path, line);
            break;
        }
        char *endp;
        errno = 0;
        long long r = strtoll(buf + sp + 1, &endp, 10);
        if (errno || endp != buf + le || buf[sp + 1] < '0' || buf[sp + 1] > '9') {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s:%zu: invalid rank", path, line);
            break;
        }
        if (r < 0 || r >= n) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                               "%s:%zu: rank %lld outside 0..%d (ranks must be dense)", path, line,
                               r, n - 1);
            break;
        }
        if (seen[r]) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s:%zu: rank %lld appears twice", path,
                               line, r);
            break;
        }
        seen[r] = 1;
        tmp[r] = dec + dec_used;
        len_of[r] = (uint32_t)dl;
        dec_used += (size_t)dl;
        i = e + 1;
    }
    free(buf);
    if (!rc) {
        t->n_ranks = n;
        t->off = shoal_xmalloc(((size_t)n + 1) * sizeof *t->off);
        t->bytes = shoal_xmalloc(dec_used ? dec_used : 1);
        size_t o = 0;
        for (int32_t r = 0; r < n; r++) {
            t->off[r] = (uint32_t)o;
            memcpy(t->bytes + o, tmp[r], len_of[r]);
            o += len_of[r];
        }
        t->off[n] = (uint32_t)o;
        uint32_t cap = 1024;
        while (cap < (uint32_t)n * 2u)
            cap <<= 1;
        t->mask = cap - 1;
        t->slots = shoal_xcalloc(cap, sizeof *t->slots);
        uint32_t fw = 64;
        while (fw < (uint32_t)n / 8u)
            fw <<= 1;
        t->fmask = fw - 1;
        t->filt = shoal_xcalloc(fw, sizeof *t->filt);
        for (int32_t r = 0; r < n && !rc; r++) {
            size_t tl = t->off[r + 1] - t->off[r];
            if (rank_of(t, t->bytes + t->off[r], tl) != RANK_NONE)
                rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                                   "%s: rank %d repeats the bytes of rank %d", path, r,
                                   rank_of(t, t->bytes + t->off[r], tl));
            else
                hash_insert(t, r);
        }
        for (int b = 0; b < 256 && !rc; b++) {
            uint8_t c = (uint8_t)b;
            if (rank_of(t, &c, 1) == RANK_NONE)
                rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                                   "%s: byte 0x%02x has no rank (byte-level BPE needs all 256)",
                                   path, b);
        }
    }
    free(len_of);
    free(seen);
    free(tmp);
    free(dec);
    if (rc)
        return rc;
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        t->byte_rank[b] = rank_of(t, &c, 1);
    }
    t->pair = shoal_xmalloc(65536 * sizeof *t->pair);
    for (int i = 0; i < 65536; i++) {
        uint8_t two[2] = {(uint8_t)(i >> 8), (uint8_t)i};
        t->pair[i] = rank_of(t, two, 2);
    }
    return 0;
}

/* bos_token etc. are a string, an AddedToken object {"content": ...}, or null */
static const char *role_name(json_t *root, const char *key)
{
    json_t *v = json_object_get(root, key);
    if (json_is_string(v))
        return json_string_value(v);
    if (json_is_object(v))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static uint32_t trie_add_node(shoal_tok *t, uint32_t *cap, uint8_t byte)
{
    if (t->trie_n == *cap) {
        *cap *= 2;
        t->trie = shoal_xrealloc(t->trie, *cap * sizeof *t->trie);
    }
    t->trie[t->trie_n] = (trie_node){.child = 0, .sibling = 0, .id = -1, .byte = byte};
    return t->trie_n++;
}

/* Inserts name; returns 0, or 1 if it is a prefix of, or has as a prefix,
 * another name (tiktoken's choice would then depend on hash order). */
static int trie_insert(shoal_tok *t, uint32_t *cap, const char *name, size_t len, int32_t id)
{
    uint32_t node = 0;
    for (size_t i = 0; i < len; i++) {
        if (t->trie[node].id >= 0)
            return 1;
        uint8_t b = (uint8_t)name[i];
        uint32_t c = t->trie[node].child, prev = 0;
        while (c && t->trie[c].byte != b) {
            prev = c;
            c = t->trie[c].sibling;
        }
        if (!c) {
            c = trie_add_node(t, cap, b);
            if (prev)
                t->trie[prev].sibling = c;
            else
                t->trie[node].child = c;
        }
        node = c;
    }
    if (t->trie[node].id >= 0 || t->trie[node].child)
        return 1;
    t->trie[node].id = id;
    return 0;
}

static int load_config(shoal_tok *t, const char *path, char *err, size_t errlen)
{
    json_error_t je;
    char *text;
    size_t len;
    /* through read_file's regular-file check, like every file the model
     * loader opens (json_load_file would block forever on a FIFO) */
    int rrc = read_file(path, &text, &len, err, errlen);
    if (rrc)
        return rrc;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_DECODE_INT_AS_REAL, &je);
    free(text);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_EMODEL, "%s:%d: %s", path, je.line, je.text);
    int rc = 0;
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (!json_is_object(dec)) {
        rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s: added_tokens_decoder missing or not an object",
                           path);
        goto out;
    }
    int32_t nres = t->n_reserved;
    t->sname = shoal_xcalloc((size_t)nres, sizeof *t->sname);
    t->sname_len = shoal_xcalloc((size_t)nres, sizeof *t->sname_len);
    t->skippable = shoal_xcalloc((size_t)nres, 1);
    const char *key;
    json_t *val;
    json_object_foreach(dec, key, val)
    {
        char *endp;
        errno = 0;
        long long id = strtoll(key, &endp, 10);
        if (errno || *endp || !*key || id < t->n_ranks || id >= (long long)t->n_ranks + nres) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                               "%s: added_tokens_decoder key \"%s\" is not an id in [%d, %d)", path,
                               key, t->n_ranks, t->n_ranks + nres);
            goto out;
        }
        json_t *content = json_object_get(val, "content");
        json_t *special = json_object_get(val, "special");
        if (!json_is_string(content) || json_string_length(content) == 0 || !json_is_boolean(special)) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                               "%s: added_tokens_decoder[\"%s\"] needs a non-empty \"content\" string "
                               "and a boolean \"special\"",
                               path, key);
            goto out;
        }
        int32_t s = (int32_t)(id - t->n_ranks);
        t->sname[s] = shoal_xstrdup(json_string_value(content));
        t->sname_len[s] = json_string_length(content);
        t->skippable[s] = json_is_true(special);
    }
    for (int32_t s = 0; s < nres; s++) {
        if (t->sname[s])
            continue;
        /* tokenization_kimi.py: unnamed ids are "<|reserved_token_{id}|>" */
        char b[64];
        int l = snprintf(b, sizeof b, "<|reserved_token_%d|>", t->n_ranks + s);
        t->sname[s] = shoal_xstrdup(b);
        t->sname_len[s] = (size_t)l;
        t->skippable[s] = 1;
    }
    uint32_t cap = 256;
    t->trie = shoal_xmalloc(cap * sizeof *t->trie);
    t->trie_n = 0;
    trie_add_node(t, &cap, 0);
    for (int32_t s = 0; s < nres; s++) {
        if (trie_insert(t, &cap, t->sname[s], t->sname_len[s], t->n_ranks + s)) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL,
                               "%s: special token \"%s\" (id %d) repeats, or is a prefix of or "
                               "extends, another special token",
                               path, t->sname[s], t->n_ranks + s);
            goto out;
        }
        t->first_byte[(uint8_t)t->sname[s][0]] = 1;
    }
    static const char *roles[] = {"bos_token", "eos_token", "pad_token", "unk_token"};
    int32_t *ids[] = {&t->bos, &t->eos, &t->pad, &t->unk};
    for (int i = 0; i < 4; i++) {
        *ids[i] = -1;
        const char *nm = role_name(root, roles[i]);
        if (!nm)
            continue;
        *ids[i] = shoal_tok_special_id(t, nm);
        if (*ids[i] < 0) {
            rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s: %s \"%s\" is not a special token",
                               path, roles[i], nm);
            goto out;
        }
    }
out:
    json_decref(root);
    return rc;
}

int shoal_tok_open(shoal_tok **out, const char *model_dir, const shoal_tok_opts *o, char *err,
                   size_t errlen)
{
    *out = NULL;
    char uv[32] = "";
    pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, uv);
    if (strcmp(uv, SHOAL_TOK_UNI_PCRE2_UNICODE))
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED,
                             "tokenizer: PCRE2 has Unicode %s but coordinator/text/tokenizer_uni.h was "
                             "generated for %s; rerun tools/gen_tok_unicode.py",
                             uv, SHOAL_TOK_UNI_PCRE2_UNICODE);
    if (sodium_init() < 0)
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "tokenizer: sodium_init failed");
    shoal_tok *t = shoal_xcalloc(1, sizeof *t);
    t->n_reserved = o && o->n_reserved ? o->n_reserved : 256;
    if (t->n_reserved < 0 || t->n_reserved > 1 << 20) {
        shoal_tok_close(t);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "tokenizer: n_reserved %d out of range",
                             o->n_reserved);
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/tiktoken.model", model_dir);
    int rc = load_ranks(t, path, err, errlen);
    if (!rc) {
        snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
        rc = load_config(t, path, err, errlen);
    }
    if (!rc) {
        int ec;
        PCRE2_SIZE eo;
        t->re = pcre2_compile((PCRE2_SPTR)k3_pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                              &ec, &eo, NULL);
        if (!t->re) {
            PCRE2_UCHAR m[256];
            pcre2_get_error_message(ec, m, sizeof m);
            rc = shoal_err_set(err, errlen, SHOAL_EINTERNAL, "tokenizer: pattern: %s at %zu",
                               (char *)m, (size_t)eo);
        } else {
            t->jit = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE) == 0;
        }
    }
    if (rc) {
        shoal_tok_close(t);
        return rc;
    }
    *out = t;
    return 0;
}

static void hex32(const uint8_t d[32], char out[65])
{
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", d[i]);
}

int shoal_tok_check_model(const shoal_tok *t, const char *tok_dir, const char *config_path, int config_vocab,
                          char *err, size_t errlen)
{
    int32_t nv = shoal_tok_n_vocab(t);
    if (nv != config_vocab)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "tokenizer: %s/tiktoken.model has %d ranks + %d reserved = %d ids, but %s says "
                             "vocab_size %d: not this model's vocabulary",
                             tok_dir, (int)t->n_ranks, (int)t->n_reserved, (int)nv, config_path, config_vocab);
    char *buf = NULL;
    size_t len = 0;
    int rc = read_file(config_path, &buf, &len, err, errlen);
    if (rc)
        return rc;
    uint8_t d[32];
    char cfg_hex[65], tok_hex[65];
    crypto_hash_sha256(d, (const unsigned char *)buf, len);
    free(buf);
    hex32(d, cfg_hex);
    hex32(t->sha256, tok_hex);
    if (!strcmp(cfg_hex, SHOAL_K3_CONFIG_SHA256) &&
        (t->vocab_bytes != SHOAL_K3_VOCAB_BYTES || strcmp(tok_hex, SHOAL_K3_VOCAB_SHA256)))
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "tokenizer: %s/tiktoken.model (%zu bytes, sha256 %s) is not K3's vocabulary "
                             "(%d bytes, sha256 %s, SPEC 5.1), which %s (K3's published config.json) needs",
                             tok_dir, t->vocab_bytes, tok_hex, SHOAL_K3_VOCAB_BYTES, SHOAL_K3_VOCAB_SHA256,
                             config_path);
    return 0;
}

void shoal_tok_close(shoal_tok *t)
{
    if (!t)
        return;
    if (t->sname)
        for (int32_t s = 0; s < t->n_reserved; s++)
            free(t->sname[s]);
    free(t->sname);
    free(t->sname_len);
    free(t->skippable);
    free(t->trie);
    free(t->bytes);
    free(t->off);
    free(t->slots);
    free(t->filt);
    free(t->pair);
    pcre2_code_free(t->re);
    free(t);
}

int32_t shoal_tok_n_ranks(const shoal_tok *t) { return t->n_ranks; }
int32_t shoal_tok_n_vocab(const shoal_tok *t) { return t->n_ranks + t->n_reserved; }
void shoal_tok_vocab_sha256(const shoal_tok *t, uint8_t out[32]) { memcpy(out, t->sha256, 32); }
size_t shoal_tok_vocab_size_bytes(const shoal_tok *t) { return t->vocab_bytes; }
int32_t shoal_tok_bos_id(const shoal_tok *t) { return t->bos; }
int32_t shoal_tok_eos_id(const shoal_tok *t) { return t->eos; }
int32_t shoal_tok_pad_id(const shoal_tok *t) { return t->pad; }
int32_t shoal_tok_unk_id(const shoal_tok *t) { return t->unk; }

int shoal_tok_is_special(const shoal_tok *t, int32_t id)
{
    return id >= t->n_ranks && id < t->n_ranks + t->n_reserved;
}

int shoal_tok_is_skippable(const shoal_tok *t, int32_t id)
{
    return shoal_tok_is_special(t, id) && t->skippable[id - t->n_ranks];
}

/* Length of the special name starting at p[0..n), its id in *id; 0 if none. */
static size_t special_at(const shoal_tok *t, const uint8_t *p, size_t n, int32_t *id)
{
    uint32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = t->trie[node].child;
        while (c && t->trie[c].byte != p[i])
            c = t->trie[c].sibling;
        if (!c)
            return 0;
        node = c;
        if (t->trie[node].id >= 0) {
            *id = t->trie[node].id;
            return i + 1;
        }
    }
    return 0;
}

int32_t shoal_tok_special_id(const shoal_tok *t, const char *name)
{
    size_t n = strlen(name);
    int32_t id;
    if (n && special_at(t, (const uint8_t *)name, n, &id) == n)
        return id;
    return SHOAL_ENOTFOUND;
}

const uint8_t *shoal_tok_token_bytes(const shoal_tok *t, int32_t id, size_t *len)
{
    if (id >= 0 && id < t->n_ranks) {
        *len = t->off[id + 1] - t->off[id];
        return t->bytes + t->off[id];
    }
    if (shoal_tok_is_special(t, id)) {
        *len = t->sname_len[id - t->n_ranks];
        return (const uint8_t *)t->sname[id - t->n_ranks];
    }
    *len = 0;
    return NULL;
}

/* ----------------------------------------------------------------- ids -- */

void shoal_tok_ids_free(shoal_tok_ids *ids)
{
    free(ids->v);
    ids->v = NULL;
    ids->n = ids->cap = 0;
}

static void ids_reserve(shoal_tok_ids *ids, size_t extra)
{
    if (ids->n + extra <= ids->cap)
        return;
    size_t cap = ids->cap ? ids->cap : 64;
    while (cap < ids->n + extra)
        cap *= 2;
    ids->v = shoal_xrealloc(ids->v, cap * sizeof *ids->v);
    ids->cap = cap;
}

void shoal_tok_ids_push(shoal_tok_ids *ids, int32_t id)
{
    if (ids->n == ids->cap)
        ids_reserve(ids, 1);
    ids->v[ids->n++] = id;
}

/* ----------------------------------------------------------------- BPE -- */

typedef struct {
    uint32_t start; /* its first byte */
    int32_t rank;   /* of merging it with the next part */
    int32_t tok;    /* its token */
} bpe_part;

/* tiktoken's merge loop: q[i] = part i (its start, the rank of merging it with
 * part i+1, its token); repeatedly merge the leftmost lowest rank. Quadratic,
 * fastest for short pieces. n >= 2, n <= BPE_SMALL_MAX. */
static void bpe_small(const shoal_tok *t, const uint8_t *p, size_t n, shoal_tok_ids *out)
{
    /* one array of parts, so a merge is one memmove, not three */
    bpe_part q[BPE_SMALL_MAX + 1];
    size_t m = n + 1;
    for (size_t i = 0; i + 1 < n; i++)
        q[i] = (bpe_part){(uint32_t)i, t->pair[(unsigned)p[i] << 8 | p[i + 1]], t->byte_rank[p[i]]};
    q[n - 1] = (bpe_part){(uint32_t)(n - 1), RANK_NONE, t->byte_rank[p[n - 1]]};
    q[n] = (bpe_part){(uint32_t)n, RANK_NONE, -1};
    for (;;) {
        /* the leftmost lowest rank: the least (rank, index), without a
         * branch per part (which rank is least is data, not a pattern) */
        uint64_t key = UINT64_MAX;
        for (size_t i = 0; i + 1 < m; i++) {
            uint64_t k = (uint64_t)(uint32_t)q[i].rank << 32 | i;
            key = k < key ? k : key;
        }
        int32_t best = (int32_t)(key >> 32);
        size_t bi = (uint32_t)key;
        if (best == RANK_NONE)
            break;
        /* parts bi and bi+1 become the token `best`; the two new candidates
         * (left part + merged, merged + right part) are independent lookups:
         * filter both, then start both table probes before waiting on either
         * (each is a likely cache miss) */
        int hl = bi > 0 && bi + 2 < m, hr = bi + 3 < m;
        int32_t rl = RANK_NONE, rr = RANK_NONE;
        const uint8_t *pl = p + (hl ? q[bi - 1].start : 0), *pr = p + q[bi].start;
        size_t nl = hl ? q[bi + 2].start - q[bi - 1].start : 0, nr = hr ? q[bi + 3].start - q[bi].start : 0;
        uint64_t xl = hl ? hash_bytes(pl, nl) : 0, xr = hr ? hash_bytes(pr, nr) : 0;
        hl = hl && filt_maybe(t, xl);
        hr = hr && filt_maybe(t, xr);
        if (hl)
            __builtin_prefetch(&t->slots[(uint32_t)xl & t->mask]);
        if (hr)
            __builtin_prefetch(&t->slots[(uint32_t)xr & t->mask]);
        if (hl)
            rl = probe(t, pl, nl, xl);
        if (hr)
            rr = probe(t, pr, nr, xr);
        if (bi > 0)
            q[bi - 1].rank = rl;
        q[bi].rank = rr;
        q[bi].tok = best;
        memmove(q + bi + 1, q + bi + 2, (m - bi - 2) * sizeof *q);
        m--;
    }
    ids_reserve(out, m - 1);
    for (size_t i = 0; i + 1 < m; i++)
        out->v[out->n + i] = q[i].tok;
    out->n += m - 1;
}

typedef struct {
    int32_t rank;
    uint32_t pos; /* symbol start: orders ties leftmost-first, like tiktoken */
    uint32_t ver;
} heap_ent;

static inline int heap_less(const heap_ent *a, const heap_ent *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(heap_ent *h, size_t *n, heap_ent e)
{
    size_t i = (*n)++;
    while (i) {
        size_t par = (i - 1) / 2;
        if (!heap_less(&e, &h[par]))
            break;
        h[i] = h[par];
        i = par;
    }
    h[i] = e;
}

static heap_ent heap_pop(heap_ent *h, size_t *n)
{
    heap_ent top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && heap_less(&h[c + 1], &h[c]))
            c++;
        if (!heap_less(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n)
        h[i] = last;
    return top;
}

/* The same merges as bpe_small in O(n log n): symbols in a linked list keyed by
 * their start offset, candidate merges in a min-heap on (rank, start) with
 * stale entries skipped by version. For long pieces (25,000-character runs). */
static void bpe_heap(const shoal_tok *t, const uint8_t *p, size_t n, shoal_tok_ids *out)
{
    uint32_t *nxt = shoal_xmalloc((n + 1) * sizeof *nxt);
    uint32_t *prv = shoal_xmalloc((n + 1) * sizeof *prv);
    uint32_t *ver = shoal_xcalloc(n + 1, sizeof *ver);
    uint8_t *dead = shoal_xcalloc(n + 1, 1);
    heap_ent *h = shoal_xmalloc((3 * n + 4) * sizeof *h);
    size_t hn = 0;
    for (size_t i = 0; i < n; i++) {
        nxt[i] = (uint32_t)(i + 1);
        prv[i] = i ? (uint32_t)(i - 1) : UINT32_MAX;
    }
    for (size_t i = 0; i + 1 < n; i++) {
        int32_t r = t->pair[(unsigned)p[i] << 8 | p[i + 1]];
        if (r != RANK_NONE)
            heap_push(h, &hn, (heap_ent){r, (uint32_t)i, 0});
    }
    while (hn) {
        heap_ent e = heap_pop(h, &hn);
        uint32_t i = e.pos;
        if (dead[i] || e.ver != ver[i])
            continue;
        uint32_t j = nxt[i];       /* the symbol merged into i */
        uint32_t k = nxt[j];       /* the one after */
        nxt[i] = k;
        if (k < n)
            prv[k] = i;
        dead[j] = 1;
        ver[i]++;
        if (k < n) {
            int32_t r = rank_of(t, p + i, nxt[k] - i);
            if (r != RANK_NONE)
                heap_push(h, &hn, (heap_ent){r, i, ver[i]});
        }
        if (prv[i] != UINT32_MAX) {
            uint32_t q = prv[i];
            ver[q]++;
            int32_t r = rank_of(t, p + q, nxt[i] - q);
            if (r != RANK_NONE)
                heap_push(h, &hn, (heap_ent){r, q, ver[q]});
        }
        if (hn + 2 > 3 * n + 4)
            SHOAL_PANIC("bpe heap overflow");
    }
    for (uint32_t i = 0; i < n; i = nxt[i]) {
        int32_t r = rank_of(t, p + i, nxt[i] - i);
        if (r == RANK_NONE)
            SHOAL_PANIC("bpe: merged bytes without a rank");
        shoal_tok_ids_push(out, r);
    }
    free(nxt);
    free(prv);
    free(ver);
    free(dead);
    free(h);
}

void shoal__tok_bpe_forced(const shoal_tok *t, const uint8_t *p, size_t n, int heap,
                           shoal_tok_ids *out)
{
    if (n == 1)
        shoal_tok_ids_push(out, rank_of(t, p, 1));
    else if (heap || n > BPE_SMALL_MAX)
        bpe_heap(t, p, n, out);
    else
        bpe_small(t, p, n, out);
}

/* -------------------------------------------------------------- encode -- */

/* A cache of the ids of BPE-encoded pieces, per encode call (so the tokenizer
 * stays immutable and shareable): text repeats its words, and BPE is most of
 * the work once the split is fast. Only for long inputs (the table is 1 MiB)
 * and short pieces; keys point into the call's text, which outlives it. One
 * 16-byte entry per slot, so a probe or an insert is one cache line (text
 * whose pieces rarely repeat, like CJK, pays a miss per piece: it was five,
 * one per array, when the fields were apart). */
#define CACHE_MIN_TEXT 16384
#define CACHE_SLOTS (1u << 16)
#define CACHE_MAX_PIECE 48

typedef struct {
    uint32_t tag;   /* high half of the piece's hash | 1; 0 = empty */
    uint32_t where; /* piece offset in the text */
    uint32_t first; /* its ids in store */
    uint8_t plen, nids;
} cache_ent;

typedef struct {
    cache_ent *ent; /* CACHE_SLOTS */
    const uint8_t *base;
    shoal_tok_ids store;
    uint32_t used;
} piece_cache;

typedef struct {
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *js;
    piece_cache *cache; /* NULL for short inputs */
} enc_scratch;

static void cache_init(enc_scratch *sc, const uint8_t *base, size_t len)
{
    if (len < CACHE_MIN_TEXT || len > UINT32_MAX)
        return;
    piece_cache *c = shoal_xcalloc(1, sizeof *c);
    c->ent = shoal_xcalloc(CACHE_SLOTS, sizeof *c->ent);
    c->base = base;
    sc->cache = c;
}

static void cache_free(piece_cache *c)
{
    if (!c)
        return;
    free(c->ent);
    shoal_tok_ids_free(&c->store);
    free(c);
}

static inline void bpe_any(const shoal_tok *t, const uint8_t *p, size_t n, shoal_tok_ids *out)
{
    if (n <= BPE_SMALL_MAX)
        bpe_small(t, p, n, out);
    else
        bpe_heap(t, p, n, out);
}

static inline void encode_piece(const shoal_tok *t, piece_cache *c, const uint8_t *p, size_t n,
                                shoal_tok_ids *out)
{
    uint64_t h = hash_bytes(p, n);
    int cached = c && n <= CACHE_MAX_PIECE;
    uint32_t i = (uint32_t)(h >> 16) & (CACHE_SLOTS - 1), tag = (uint32_t)(h >> 32) | 1;
    if (cached) /* its line loads while the rank table answers */
        __builtin_prefetch(&c->ent[i]);
    /* tiktoken: a piece that is itself a token is that token, whatever the
     * merges would say */
    int32_t r = rank_of_h(t, p, n, h);
    if (r != RANK_NONE) {
        shoal_tok_ids_push(out, r);
        return;
    }
    if (!cached) {
        bpe_any(t, p, n, out);
        return;
    }
    for (;;) {
        cache_ent *e = &c->ent[i];
        if (!e->tag)
            break;
        if (e->tag == tag && e->plen == n && same_bytes(c->base + e->where, p, n)) {
            ids_reserve(out, e->nids);
            memcpy(out->v + out->n, c->store.v + e->first, e->nids * sizeof *out->v);
            out->n += e->nids;
            return;
        }
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
    size_t before = out->n;
    bpe_any(t, p, n, out);
    if (c->used >= CACHE_SLOTS / 2)
        return; /* full enough: stop adding */
    c->ent[i] = (cache_ent){.tag = tag,
                            .where = (uint32_t)(p - c->base),
                            .first = (uint32_t)c->store.n,
                            .plen = (uint8_t)n,
                            .nids = (uint8_t)(out->n - before)};
    ids_reserve(&c->store, out->n - before);
    memcpy(c->store.v + c->store.n, out->v + before, (out->n - before) * sizeof *out->v);
    c->store.n += out->n - before;
    c->used++;
}

/* The next piece of s[0..n) (one subject: lookarounds do not see past it) at
 * or after off: 1 with [*b, *e), 0 when nothing more matches (tiktoken skips
 * text no alternative matches; the K3 pattern matches every character, so
 * there is none), or a negative error. fast: try the ASCII path first. */
static int next_piece(const shoal_tok *t, enc_scratch *sc, const uint8_t *s, size_t n, size_t off,
                      int fast, size_t *b, size_t *e, char *err, size_t errlen)
{
    if (fast) {
        size_t end = shoal__tok_ascii_piece(s, n, off);
        if (end) {
            *b = off;
            *e = end;
            return 1;
        }
    }
    for (;;) {
        int rc = t->jit ? pcre2_jit_match(t->re, s, n, off, PCRE2_NO_UTF_CHECK, sc->md, sc->mc)
                        : pcre2_match(t->re, s, n, off, PCRE2_NO_UTF_CHECK, sc->md, sc->mc);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !sc->js) {
            /* letter runs backtrack through a group per character: long runs
             * (up to 25,000 characters) outgrow the default 32 KiB JIT stack.
             * Give this call a large one and match again (matching has no
             * state to undo). */
            sc->js = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
            sc->mc = pcre2_match_context_create(NULL);
            if (!sc->js || !sc->mc)
                SHOAL_PANIC("out of memory (pcre2 jit stack)");
            pcre2_jit_stack_assign(sc->mc, NULL, sc->js);
            continue;
        }
        if (rc == PCRE2_ERROR_NOMATCH)
            return 0;
        if (rc < 0) {
            PCRE2_UCHAR m[256];
            pcre2_get_error_message(rc, m, sizeof m);
            return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "tokenizer: pcre2 match: %s",
                                 (char *)m);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(sc->md);
        if (ov[1] <= ov[0]) /* cannot happen: no alternative matches empty */
            return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "tokenizer: empty match at %zu",
                                 (size_t)ov[0]);
        *b = ov[0];
        *e = ov[1];
        return 1;
    }
}

/* Splits s[0..n) into pieces and BPE-encodes each. */
static int encode_ordinary(const shoal_tok *t, enc_scratch *sc, const uint8_t *s, size_t n,
                           shoal_tok_ids *out, char *err, size_t errlen)
{
    size_t off = 0, b, e;
    while (off < n) {
        int rc = next_piece(t, sc, s, n, off, 1, &b, &e, err, errlen);
        if (rc <= 0)
            return rc;
        encode_piece(t, sc->cache, s + b, e - b, out);
        off = e;
    }
    return 0;
}

static void scratch_free(enc_scratch *sc)
{
    cache_free(sc->cache);
    pcre2_match_data_free(sc->md);
    pcre2_match_context_free(sc->mc);
    if (sc->js)
        pcre2_jit_stack_free(sc->js);
}

int shoal__tok_split(const shoal_tok *t, const uint8_t *s, size_t n, int fast, shoal_tok_ids *ends)
{
    enc_scratch sc = {0};
    sc.md = pcre2_match_data_create(1, NULL);
    if (!sc.md)
        SHOAL_PANIC("out of memory (pcre2 match data)");
    size_t off = 0, b, e;
    int rc = 0;
    while (off < n) {
        rc = next_piece(t, &sc, s, n, off, fast, &b, &e, NULL, 0);
        if (rc <= 0)
            break;
        shoal_tok_ids_push(ends, (int32_t)b);
        shoal_tok_ids_push(ends, (int32_t)e);
        off = e;
    }
    scratch_free(&sc);
    return rc < 0 ? rc : 0;
}

/* One part of the long-run split: specials (if allowed) then ordinary text. */
static int encode_part(const shoal_tok *t, enc_scratch *sc, const uint8_t *s, size_t n,
                       int allow_special, shoal_tok_ids *out, char *err, size_t errlen)
{
    if (!allow_special)
        return encode_ordinary(t, sc, s, n, out, err, errlen);
    size_t start = 0;
    for (size_t i = 0; i < n; i++) {
        if (!t->first_byte[s[i]])
            continue;
        int32_t id;
        size_t l = special_at(t, s + i, n - i, &id);
        if (!l)
            continue;
        int rc = encode_ordinary(t, sc, s + start, i - start, out, err, errlen);
        if (rc)
            return rc;
        shoal_tok_ids_push(out, id);
        i += l - 1;
        start = i + 1;
    }
    return encode_ordinary(t, sc, s + start, n - start, out, err, errlen);
}

int shoal_tok_encode(const shoal_tok *t, const char *text, size_t len, int allow_special,
                     shoal_tok_ids *out, char *err, size_t errlen)
{
    char *clean = NULL;
    const uint8_t *s = (const uint8_t *)text;
    if (!shoal_utf8_valid(text, len)) {
        size_t cl;
        shoal_utf8_sanitize(text, len, &clean, &cl);
        s = (const uint8_t *)clean;
        len = cl;
    }
    /* per-call scratch keeps the tokenizer shareable between threads; the
     * JIT stack is only made when a match needs it (see encode_ordinary) */
    enc_scratch sc = {0};
    sc.md = pcre2_match_data_create(1, NULL);
    if (!sc.md)
        SHOAL_PANIC("out of memory (pcre2 match data)");
    cache_init(&sc, s, len);
    int rc = 0;
    ids_reserve(out, len / 4 + 16);
    if (len <= MAX_RUN_CHARS) {
        /* fewer bytes than the run limit: no cut is possible */
        if (len)
            rc = encode_part(t, &sc, s, len, allow_special, out, err, errlen);
    } else {
        size_t pos = 0;
        while (pos < len && !rc) {
            /* one 400,000-code-point chunk, split before runs > 25,000 */
            size_t i = pos, slice = pos, ncp = 0, run = 0;
            int cur_space = -1;
            while (i < len && ncp < MAX_ENCODE_CHARS) {
                uint32_t cp;
                int l;
                if (s[i] < 0x80) { /* most characters: no call */
                    cp = s[i];
                    l = 1;
                } else {
                    l = shoal_utf8_step(s + i, len - i, &cp);
                    if (l <= 0)
                        SHOAL_PANIC("tokenizer: invalid UTF-8 after sanitizing");
                }
                int sp = shoal__tok_py_isspace(cp);
                if (cur_space < 0)
                    cur_space = sp;
                if (sp != cur_space) {
                    run = 1;
                    cur_space = sp;
                } else if (++run > MAX_RUN_CHARS) {
                    rc = encode_part(t, &sc, s + slice, i - slice, allow_special, out, err, errlen);
                    if (rc)
                        break;
                    slice = i;
                    run = 1;
                }
                i += (size_t)l;
                ncp++;
            }
            if (!rc)
                rc = encode_part(t, &sc, s + slice, i - slice, allow_special, out, err, errlen);
            pos = i;
        }
    }
    scratch_free(&sc);
    free(clean);
    return rc;
}
