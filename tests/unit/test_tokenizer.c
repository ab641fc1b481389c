/* Tokenizer unit tests. Token-id parity with the oracle (tiktoken) is checked by
 * tests/e2e/test_tokenizer_oracle.py; here: the pre-tokenizer's character classes
 * against the oracle's tables (tests/fixtures/tokenizer/unicode_classes.tsv,
 * generated from tiktoken by tools/gen_tok_unicode.py), UTF-8 replacement
 * against the Unicode standard's examples, loading and refusal, the two BPE
 * algorithms against each other, special-token recognition, the streaming
 * detokenizer, and the real-K3 test vectors when a user supplies the file. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <sodium.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/text/tokenizer.h"
#include "coordinator/text/tokenizer_int.h"
#include "tests/unit/test.h"

static shoal_tok *tiny;

static shoal_tok *open_tiny(void)
{
    if (tiny)
        return tiny;
    char err[512];
    int rc = shoal_tok_open(&tiny, test_src_path("tests/models/tiny-k3"), NULL, err, sizeof err);
    if (rc) {
        fprintf(stderr, "  open tiny-k3: %s\n", err);
        return NULL;
    }
    return tiny;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* ------------------------------------------------------------- classes -- */

static int utf8_encode(uint32_t c, uint8_t *o)
{
    if (c < 0x80) {
        o[0] = (uint8_t)c;
        return 1;
    }
    if (c < 0x800) {
        o[0] = (uint8_t)(0xC0 | c >> 6);
        o[1] = (uint8_t)(0x80 | (c & 63));
        return 2;
    }
    if (c < 0x10000) {
        o[0] = (uint8_t)(0xE0 | c >> 12);
        o[1] = (uint8_t)(0x80 | ((c >> 6) & 63));
        o[2] = (uint8_t)(0x80 | (c & 63));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | c >> 18);
    o[1] = (uint8_t)(0x80 | ((c >> 12) & 63));
    o[2] = (uint8_t)(0x80 | ((c >> 6) & 63));
    o[3] = (uint8_t)(0x80 | (c & 63));
    return 4;
}

/* membership bitmap from "a-b c-d ..." hex ranges */
static uint8_t *parse_ranges(const char *s)
{
    uint8_t *m = calloc(0x110000, 1);
    while (*s) {
        char *e;
        unsigned long a = strtoul(s, &e, 16);
        if (*e != '-')
            break;
        unsigned long b = strtoul(e + 1, &e, 16);
        for (unsigned long c = a; c <= b && c < 0x110000; c++)
            m[c] = 1;
        s = e;
        while (*s == ' ')
            s++;
    }
    return m;
}

static void t_unicode_classes(void)
{
    FILE *f = fopen(test_src_path("tests/fixtures/tokenizer/unicode_classes.tsv"), "r");
    CHECK(f != NULL);
    if (!f)
        return;
    static char line[1 << 20];
    int nclasses = 0, fast_classes = 0;
    /* the fast path's letter logic assumes no character is both a PREFIX
     * and a letter (combining marks are, so it must not know them) */
    for (uint32_t c = 0; c < 0x110000; c++) {
        int k = shoal__tok_cp_class(c);
        if (k >= 0 && (k & 32) && (k & 3)) {
            CHECK_MSG(0, "fast path: U+%04X is both PREFIX and a letter", c);
            break;
        }
    }
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#')
            continue;
        char *tab = strchr(line, '\t');
        if (!tab)
            continue;
        *tab = 0;
        line[strcspn(tab + 1, "\n") + (size_t)(tab + 1 - line)] = 0;
        uint8_t *want = parse_ranges(tab + 1);
        size_t bad = 0;
        uint32_t first_bad = 0;
        if (!strcmp(line, "ISSPACE")) {
            for (uint32_t c = 0; c < 0x110000; c++) {
                if (c >= 0xD800 && c < 0xE000)
                    continue;
                if (!!shoal__tok_py_isspace(c) != want[c] && !bad++)
                    first_bad = c;
            }
        } else {
            char pat[1 << 16];
            int l = shoal__tok_class_pattern(line, pat, sizeof pat);
            CHECK_MSG(l > 0, "class %s", line);
            int ec;
            PCRE2_SIZE eo;
            pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, (size_t)l, PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED,
                                           &ec, &eo, NULL);
            CHECK(re != NULL);
            if (!re) {
                free(want);
                continue;
            }
            pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
            pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
            for (uint32_t c = 0; c < 0x110000; c++) {
                if (c >= 0xD800 && c < 0xE000)
                    continue;
                uint8_t b[4];
                int n = utf8_encode(c, b);
                int r = pcre2_match(re, b, (size_t)n, 0, 0, md, NULL);
                int got = r > 0 && pcre2_get_ovector_pointer(md)[1] == (PCRE2_SIZE)n;
                if (got != want[c] && !bad++)
                    first_bad = c;
            }
            pcre2_match_data_free(md);
            pcre2_code_free(re);
        }
        CHECK_MSG(bad == 0, "class %s: %zu code points differ from the oracle, first U+%04X", line, bad,
                  first_bad);
        /* the split's fast path: every class bit of every code point it
         * claims to know, as the oracle's table has it */
        static const struct {
            const char *name;
            int bit;
        } fast_bits[] = {{"UPPER", 1}, {"LOWER", 2}, {"N", 4},   {"WS", 8},
                         {"CRLF", 16}, {"PREFIX", 32}, {"PUNCT", 64}, {"Han", 128}};
        for (size_t fb = 0; fb < sizeof fast_bits / sizeof fast_bits[0]; fb++) {
            if (strcmp(line, fast_bits[fb].name))
                continue;
            size_t known = 0, wrong = 0;
            uint32_t first_wrong = 0;
            for (uint32_t c = 0; c < 0x110000; c++) {
                if (c >= 0xD800 && c < 0xE000)
                    continue;
                int k = shoal__tok_cp_class(c);
                if (k < 0)
                    continue;
                known++;
                if (!!(k & fast_bits[fb].bit) != want[c] && !wrong++)
                    first_wrong = c;
            }
            CHECK_MSG(wrong == 0, "fast path, class %s: %zu code points differ from the oracle, first U+%04X",
                      line, wrong, first_wrong);
            CHECK(known > 80000);
            fast_classes++;
        }
        free(want);
        nclasses++;
    }
    fclose(f);
    CHECK_EQ_INT(nclasses, 10);
    CHECK_EQ_INT(fast_classes, 8);
}

/* -------------------------------------------------------------- UTF-8 -- */

static void check_sanitize(const char *in, size_t n, const char *want)
{
    char *out;
    size_t len;
    shoal_utf8_sanitize(in, n, &out, &len);
    CHECK_MSG(len == strlen(want) && !memcmp(out, want, len), "sanitize gave %zu bytes", len);
    free(out);
}

/* The Unicode Standard, §3.9 "U+FFFD Substitution of Maximal Subparts"
 * (Tables 3-8 to 3-11): each maximal subpart of an ill-formed sequence is one
 * U+FFFD. */
#define R "\xEF\xBF\xBD"
static void t_utf8_maximal_subparts(void)
{
    check_sanitize("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", 13, "a" R R R "b" R "c" R R "d");
    check_sanitize("\xC0\xAF\xE0\x80\xBF\xF0\x81\x82\x41", 9, R R R R R R R R "A");
    check_sanitize("\xED\xA0\x80\xED\xBF\xBF\xED\xAF\x41", 9, R R R R R R R R "A");
    check_sanitize("\xF4\x91\x92\x93\xFF\x41\x80\xBF\x42", 9, R R R R R "A" R R "B");
    check_sanitize("\xE1\x80\xE2\xF0\x91\x92\xF1\xBF\x41", 9, R R R R "A");
    check_sanitize("\xE4\xBD", 2, R); /* truncated at the end: one subpart */
    check_sanitize("ok \xF0\x9F\xA6\x89", 7, "ok \xF0\x9F\xA6\x89");
    CHECK(shoal_utf8_valid("\xF4\x8F\xBF\xBF", 4));
    CHECK(!shoal_utf8_valid("\xF4\x90\x80\x80", 4));
    CHECK(!shoal_utf8_valid("\xED\xA0\x80", 3));
}

/* ------------------------------------------------------------ loading -- */

static void t_load_tiny(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (!t)
        return;
    json_error_t je;
    json_t *cfg = json_load_file(test_src_path("tests/models/tiny-k3/tokenizer_config.json"),
                                 JSON_DECODE_INT_AS_REAL, &je);
    CHECK(cfg != NULL);
    FILE *f = fopen(test_src_path("tests/models/tiny-k3/tiktoken.model"), "r");
    int lines = 0, ch;
    while (f && (ch = fgetc(f)) != EOF)
        lines += ch == '\n';
    if (f)
        fclose(f);
    CHECK_EQ_INT(shoal_tok_n_ranks(t), lines);
    CHECK_EQ_INT(shoal_tok_n_vocab(t), lines + 256);
    const char *key;
    json_t *v;
    int named = 0;
    json_object_foreach(json_object_get(cfg, "added_tokens_decoder"), key, v)
    {
        int id = atoi(key);
        const char *name = json_string_value(json_object_get(v, "content"));
        CHECK_EQ_INT(shoal_tok_special_id(t, name), id);
        CHECK_EQ_INT(shoal_tok_is_skippable(t, id), json_is_true(json_object_get(v, "special")));
        size_t l;
        const uint8_t *b = shoal_tok_token_bytes(t, id, &l);
        CHECK(b && l == strlen(name) && !memcmp(b, name, l));
        named++;
    }
    CHECK(named >= 16);
    CHECK_EQ_INT(shoal_tok_bos_id(t), shoal_tok_special_id(t, "[BOS]"));
    CHECK_EQ_INT(shoal_tok_eos_id(t), shoal_tok_special_id(t, "[EOS]"));
    CHECK_EQ_INT(shoal_tok_pad_id(t), shoal_tok_special_id(t, "[PAD]"));
    CHECK_EQ_INT(shoal_tok_unk_id(t), shoal_tok_special_id(t, "[UNK]"));
    /* the unnamed ids are "<|reserved_token_ID|>" (tokenization_kimi.py) */
    int unnamed = 0;
    for (int32_t id = shoal_tok_n_ranks(t); id < shoal_tok_n_vocab(t); id++) {
        char k[32], r[64];
        snprintf(k, sizeof k, "%d", id);
        if (json_object_get(json_object_get(cfg, "added_tokens_decoder"), k))
            continue;
        snprintf(r, sizeof r, "<|reserved_token_%d|>", id);
        CHECK_EQ_INT(shoal_tok_special_id(t, r), id);
        CHECK(shoal_tok_is_skippable(t, id));
        unnamed++;
    }
    CHECK_EQ_INT(unnamed + named, 256);
    CHECK_EQ_INT(shoal_tok_special_id(t, "<|open|"), SHOAL_ENOTFOUND);
    CHECK(!shoal_tok_is_special(t, 0));
    CHECK(shoal_tok_token_bytes(t, shoal_tok_n_vocab(t), &(size_t){0}) == NULL);
    CHECK(shoal_tok_token_bytes(t, -1, &(size_t){0}) == NULL);
    json_decref(cfg);
}

static char tmpdir[256];

static void write_file(const char *name, const char *text)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", tmpdir, name);
    FILE *f = fopen(p, "w");
    fputs(text, f);
    fclose(f);
}

/* A 256-byte vocabulary plus extra lines, as tiktoken.model text. */
static char *byte_vocab(const char *extra)
{
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t cap = 256 * 16 + strlen(extra) + 1;
    char *s = malloc(cap), *o = s;
    for (int i = 0; i < 256; i++)
        o += sprintf(o, "%c%c== %d\n", b64[i >> 2], b64[(i & 3) << 4], i);
    strcpy(o, extra);
    return s;
}

static void expect_refusal(const char *vocab_extra, const char *config, const char *needle)
{
    char *v = byte_vocab(vocab_extra);
    write_file("tiktoken.model", v);
    free(v);
    write_file("tokenizer_config.json", config);
    shoal_tok *t = NULL;
    char err[512] = "";
    int rc = shoal_tok_open(&t, tmpdir, NULL, err, sizeof err);
    CHECK_MSG(rc == SHOAL_EMODEL, "rc %d (%s) for %s", rc, err, needle);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(err, needle);
    shoal_tok_close(t);
}

static void t_load_refusals(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal_tok_test_%d", (int)getpid());
    mkdir(tmpdir, 0700);
    const char *ok_cfg = "{\"added_tokens_decoder\": {\"257\": {\"content\": \"[EOS]\", \"special\": true}},"
                         " \"eos_token\": \"[EOS]\"}";
    /* the valid base case opens */
    char *v = byte_vocab("YWI= 256\n");
    write_file("tiktoken.model", v);
    free(v);
    write_file("tokenizer_config.json", ok_cfg);
    shoal_tok *t;
    char err[512];
    int rc = shoal_tok_open(&t, tmpdir, NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (!rc) {
        CHECK_EQ_INT(shoal_tok_n_ranks(t), 257);
        CHECK_EQ_INT(shoal_tok_eos_id(t), 257);
        shoal_tok_ids ids = {0};
        shoal_tok_encode(t, "ab", 2, 0, &ids, err, sizeof err);
        CHECK(ids.n == 1 && ids.v[0] == 256);
        shoal_tok_ids_free(&ids);
        shoal_tok_close(t);
    }
    expect_refusal("YWI= 258\n", ok_cfg, "tiktoken.model:257: rank 258 outside");
    expect_refusal("YWI= 255\n", ok_cfg, "tiktoken.model:257: rank 255 appears twice");
    expect_refusal("YW!= 256\n", ok_cfg, "tiktoken.model:257: invalid base64");
    expect_refusal("YWI=256\n", ok_cfg, "tiktoken.model:257: expected 'base64 rank'");
    expect_refusal("YWI= x\n", ok_cfg, "tiktoken.model:257: invalid rank");
    expect_refusal("QQ== 256\n", ok_cfg, "repeats the bytes of rank 65");
    expect_refusal("YWI= 256\n", "{\"added_tokens_decoder\": {\"9999\": {\"content\": \"x\", \"special\": true}}}",
                   "key \"9999\" is not an id");
    expect_refusal("YWI= 256\n",
                   "{\"added_tokens_decoder\": {\"257\": {\"content\": \"<a>\", \"special\": true},"
                   " \"258\": {\"content\": \"<a>b\", \"special\": true}}}",
                   "prefix");
    expect_refusal("YWI= 256\n", "{\"added_tokens_decoder\": {\"257\": {\"content\": \"\", \"special\": true}}}",
                   "non-empty");
    expect_refusal("YWI= 256\n", "{\"added_tokens_decoder\": {}, \"eos_token\": \"[NOPE]\"}",
                   "eos_token \"[NOPE]\" is not a special token");
    expect_refusal("YWI= 256\n", "{\"added_tokens_decoder\": [", "tokenizer_config.json:");
    /* a missing byte: rewrite without byte 0x41 */
    {
        char *s = byte_vocab("");
        char *line = strstr(s, "QQ== 65\n");
        memcpy(line, "YWI= 65\n", 8); /* "ab" takes rank 65 instead of "A" */
        write_file("tiktoken.model", s);
        free(s);
        write_file("tokenizer_config.json", ok_cfg);
        rc = shoal_tok_open(&t, tmpdir, NULL, err, sizeof err);
        CHECK(rc == SHOAL_EMODEL);
        CHECK_STR_CONTAINS(err, "byte 0x41 has no rank");
    }
    rc = shoal_tok_open(&t, "/nonexistent/dir", NULL, err, sizeof err);
    CHECK(rc < 0 && t == NULL);
    CHECK_STR_CONTAINS(err, "/nonexistent/dir/tiktoken.model");
    char p[512];
    snprintf(p, sizeof p, "%s/tiktoken.model", tmpdir);
    unlink(p);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", tmpdir);
    unlink(p);
    rmdir(tmpdir);
}

/* ---------------------------------------------------------------- BPE -- */

static void bpe_small_equals_heap(shoal_tok *t)
{
    uint8_t buf[400];
    for (int iter = 0; iter < 3000; iter++) {
        /* a concatenation of random tokens, or random bytes */
        size_t n = 0, want = 2 + rnd() % 300;
        while (n < want) {
            if (rnd() % 4 == 0) {
                buf[n++] = (uint8_t)rnd();
                continue;
            }
            size_t l;
            const uint8_t *b = shoal_tok_token_bytes(t, (int32_t)(rnd() % (uint64_t)shoal_tok_n_ranks(t)), &l);
            if (n + l > sizeof buf)
                break;
            memcpy(buf + n, b, l);
            n += l;
        }
        if (n < 2)
            continue;
        size_t m = n > 128 ? 128 : n; /* the small algorithm's limit */
        shoal_tok_ids a = {0}, b = {0};
        shoal__tok_bpe_forced(t, buf, m, 0, &a);
        shoal__tok_bpe_forced(t, buf, m, 1, &b);
        int same = a.n == b.n && !memcmp(a.v, b.v, a.n * sizeof *a.v);
        CHECK_MSG(same, "iteration %d: %zu vs %zu ids", iter, a.n, b.n);
        char *dec = NULL;
        size_t dl = 0, cap = 0;
        shoal_tok_decode(t, b.v, b.n, &dec, &dl, &cap, NULL, 0);
        CHECK(dl == m && !memcmp(dec, buf, m));
        free(dec);
        shoal_tok_ids_free(&a);
        shoal_tok_ids_free(&b);
        if (!same)
            break;
    }
}

static shoal_tok *open_real(void);

/* on the project's vocabulary, and on K3's (163,584 ranks: the rank filter in
 * front of a table larger than the cache, tokens of CJK characters and words) */
static void t_bpe_small_equals_heap(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (t)
        bpe_small_equals_heap(t);
    t = open_real();
    if (!t)
        return;
    bpe_small_equals_heap(t);
    shoal_tok_close(t);
}

/* The fast path of the split against PCRE2 alone, on random text that is
 * mostly ASCII of every class, with non-ASCII characters of the kinds that make
 * it hand over (letters, digits, spaces, U+017F after an apostrophe) and Han
 * runs, which it splits itself when it knows every character's class. */
static void t_ascii_fast_path_equals_pcre2(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (!t)
        return;
    static const char *atoms[] = {"a", "Z", "'", "'s", "'S", "'re", "'LL", "'d", "'x", " ", "  ", "\t", "\n",
                                  "\r\n", "\v", "\f", "0", "12", "1234", "!", "?!", "(", "\x1c", "\x00", "\x7f",
                                  "\xC3\xA9", "\xC3\x89", "\xC5\xBF", "\xC2\xA0", "\xE4\xB8\xAD", "\xD9\xA3",
                                  "\xE2\x80\xA8", "\xCC\x81", "\xF0\x9F\x91\x8D", "Hello", "WORLD", "iPhone",
                                  /* Han runs and what ends them: the fast path's known Han (中, U+3400, U+20000),
                                   * Han it leaves to PCRE2 (〇 U+3007, 々 U+3005, U+2E80, U+F900), and non-Han
                                   * (，。ひ한 U+2E7F) */
                                  "\xE4\xB8\xAD\xE6\x96\x87", "\xE3\x90\x80", "\xF0\xA0\x80\x80",
                                  "\xE3\x80\x87", "\xE3\x80\x85", "\xE2\xBA\x80", "\xEF\xA4\x80",
                                  "\xEF\xBC\x8C", "\xE3\x80\x82", "\xE3\x81\xB2", "\xED\x95\x9C",
                                  "\xE2\xB9\xBF",
                                  /* kana, Hangul (in UPPER and LOWER), full-width A, a, 1 and !, U+3000,
                                   * ー (Lm), ゛ (Sk), 「」, ｱ, a combining mark after kana (unknown) */
                                  "\xE3\x81\xB2\xE3\x82\x89", "\xE3\x82\xAB\xE3\x82\xBF", "\xED\x95\x9C\xEA\xB5\xAD",
                                  "\xEF\xBC\xA1", "\xEF\xBD\x81", "\xEF\xBC\x91", "\xEF\xBC\x81", "\xE3\x80\x80",
                                  "\xE3\x83\xBC", "\xE3\x82\x9B", "\xE3\x80\x8C\xE3\x80\x8D", "\xEF\xBD\xB1",
                                  "\xE3\x82\x99"};
    int pieces = 0;
    for (int iter = 0; iter < 20000; iter++) {
        char text[256];
        size_t n = 0, want = 1 + rnd() % 40;
        while (n < want) {
            const char *x = atoms[rnd() % (sizeof atoms / sizeof atoms[0])];
            size_t l = strlen(x);
            if (n + l >= sizeof text)
                break;
            memcpy(text + n, x, l);
            n += l;
        }
        shoal_tok_ids a = {0}, b = {0};
        CHECK(shoal__tok_split(t, (const uint8_t *)text, n, 1, &a) == 0);
        CHECK(shoal__tok_split(t, (const uint8_t *)text, n, 0, &b) == 0);
        int same = a.n == b.n && !memcmp(a.v, b.v, a.n * sizeof *a.v);
        CHECK_MSG(same, "iteration %d: the split differs for \"%.*s\"", iter, (int)n, text);
        pieces += (int)a.n / 2;
        shoal_tok_ids_free(&a);
        shoal_tok_ids_free(&b);
        if (!same)
            break;
    }
    CHECK(pieces > 100000);
}

/* ------------------------------------------------------------- encode -- */

static void t_roundtrip_and_specials(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (!t)
        return;
    char err[256];
    int32_t open = shoal_tok_special_id(t, "<|open|>");
    const char *s = "say <|open|>hi<|sep|> [BOS]<|reserved_token_1|>";
    shoal_tok_ids a = {0}, b = {0};
    CHECK(shoal_tok_encode(t, s, strlen(s), 1, &a, err, sizeof err) == 0);
    CHECK(shoal_tok_encode(t, s, strlen(s), 0, &b, err, sizeof err) == 0);
    int nspecial_a = 0, nspecial_b = 0, has_open = 0;
    for (size_t i = 0; i < a.n; i++) {
        nspecial_a += shoal_tok_is_special(t, a.v[i]);
        has_open |= a.v[i] == open;
    }
    for (size_t i = 0; i < b.n; i++)
        nspecial_b += shoal_tok_is_special(t, b.v[i]);
    CHECK_EQ_INT(nspecial_a, 3); /* <|open|> <|sep|> [BOS]; reserved_token_1 is not an id here */
    CHECK(has_open);
    CHECK_EQ_INT(nspecial_b, 0);
    char *d1 = NULL, *d2 = NULL;
    size_t l1 = 0, c1 = 0, l2 = 0, c2 = 0;
    shoal_tok_decode(t, a.v, a.n, &d1, &l1, &c1, NULL, 0);
    shoal_tok_decode(t, b.v, b.n, &d2, &l2, &c2, NULL, 0);
    CHECK(l1 == strlen(s) && !memcmp(d1, s, l1));
    CHECK(l2 == strlen(s) && !memcmp(d2, s, l2));
    free(d1);
    free(d2);
    shoal_tok_ids_free(&a);
    shoal_tok_ids_free(&b);

    /* random byte soup: decode(encode(x)) == x with invalid UTF-8 replaced */
    static const char *atoms[] = {"Hello", " world", "IT'S", "\xE4\xBD\xA0\xE5\xA5\xBD", "caf\xC3\xA9",
                                  "\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD", "  ", "\r\n", "123456", "<|open|>",
                                  "\xFF", "\xE4\xBD", "\xED\xA0\x80", "\t", "'ll", "\xC2\xA0"};
    for (int iter = 0; iter < 300; iter++) {
        char text[2048];
        size_t n = 0;
        while (n < 1500) {
            const char *x = atoms[rnd() % (sizeof atoms / sizeof atoms[0])];
            memcpy(text + n, x, strlen(x));
            n += strlen(x);
        }
        for (int allow = 0; allow < 2; allow++) {
            shoal_tok_ids ids = {0};
            CHECK(shoal_tok_encode(t, text, n, allow, &ids, err, sizeof err) == 0);
            char *dec = NULL, *want;
            size_t dl = 0, dc = 0, wl;
            shoal_tok_decode(t, ids.v, ids.n, &dec, &dl, &dc, NULL, 0);
            shoal_utf8_sanitize(text, n, &want, &wl);
            CHECK(dl == wl && !memcmp(dec, want, wl));
            free(dec);
            free(want);
            shoal_tok_ids_free(&ids);
        }
    }
    /* the empty text has no ids */
    shoal_tok_ids e = {0};
    CHECK(shoal_tok_encode(t, "", 0, 1, &e, err, sizeof err) == 0 && e.n == 0);
    shoal_tok_ids_free(&e);
}

/* ---------------------------------------------------------- detokenize -- */

static void t_detok_streaming(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (!t)
        return;
    /* ids that split code points: single bytes of multi-byte sequences, and
     * invalid ones; also specials */
    for (int iter = 0; iter < 500; iter++) {
        int32_t ids[64];
        size_t n = 1 + rnd() % 64;
        for (size_t i = 0; i < n; i++) {
            uint64_t k = rnd() % 10;
            ids[i] = k < 5 ? (int32_t)(0x80 + rnd() % 0x80) /* a lone high byte */
                     : k < 9 ? (int32_t)(rnd() % (uint64_t)shoal_tok_n_ranks(t))
                             : (int32_t)(shoal_tok_n_ranks(t) + (int32_t)(rnd() % 256));
        }
        shoal_detok *d;
        shoal_detok_open(&d, t, NULL);
        char *got = malloc(1 << 16);
        size_t gl = 0;
        for (size_t i = 0; i < n; i++) {
            const char *s;
            size_t l;
            CHECK(shoal_detok_feed(d, ids[i], &s, &l) == 0);
            CHECK(shoal_utf8_valid(s, l)); /* a code point is never split */
            memcpy(got + gl, s, l);
            gl += l;
        }
        const char *s;
        size_t l;
        shoal_detok_flush(d, &s, &l);
        memcpy(got + gl, s, l);
        gl += l;
        char *raw = NULL, *want;
        size_t rl = 0, rc = 0, wl;
        shoal_tok_decode(t, ids, n, &raw, &rl, &rc, NULL, 0);
        shoal_utf8_sanitize(raw, rl, &want, &wl);
        CHECK_MSG(gl == wl && !memcmp(got, want, wl), "iteration %d", iter);
        free(raw);
        free(want);
        free(got);
        shoal_detok_close(d);
    }
    /* skip_special drops "special": true ids, keeps the XTML brackets */
    shoal_detok *d;
    shoal_detok_open(&d, t, &(shoal_detok_opts){.skip_special = 1});
    const char *s;
    size_t l;
    shoal_detok_feed(d, shoal_tok_special_id(t, "[BOS]"), &s, &l);
    CHECK_EQ_INT(l, 0);
    shoal_detok_feed(d, shoal_tok_special_id(t, "<|open|>"), &s, &l);
    CHECK(l == 8 && !memcmp(s, "<|open|>", 8));
    CHECK(shoal_detok_feed(d, -5, &s, &l) == SHOAL_ERANGE);
    shoal_detok_close(d);
}

/* ------------------------------------------------------ real vocabulary -- */

/* SPEC §5.1 identity of K3's tiktoken.model and §1.3 item 1's vectors: run
 * wherever the real tiktoken.model and K3's tokenizer_config.json are found:
 * SHOAL_K3_TOKENIZER_DIR, else ../shared/k3 beside the checkout (test.h). */
static shoal_tok *open_real(void)
{
    const char *dir = test_k3_tokenizer_dir();
    if (!dir)
        SKIP("real K3 vocabulary: no ../shared/k3/tiktoken.model beside the checkout; set "
             "SHOAL_K3_TOKENIZER_DIR to a directory with K3's tiktoken.model and tokenizer_config.json");
    shoal_tok *t;
    char err[512];
    int rc = shoal_tok_open(&t, dir, NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return NULL;
    uint8_t h[32];
    char hex[65];
    shoal_tok_vocab_sha256(t, h);
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", h[i]);
    CHECK_EQ_INT(shoal_tok_vocab_size_bytes(t), 2795286);
    CHECK_MSG(!strcmp(hex, "b6c497a7469b33ced9c38afb1ad6e47f03f5e5dc05f15930799210ec050c5103"),
              "sha256 %s is not K3's", hex);
    CHECK_EQ_INT(shoal_tok_n_vocab(t), 163840);
    return t;
}

/* The rank lookup finds every token by its bytes: the filter in front of the
 * hash table may only answer "no" for strings that are no token (a "maybe"
 * goes on to the exact lookup), so a false "no" is the one way it could change
 * ids. Every rank of the vocabulary, which the test reads back from the
 * tokenizer (token_bytes, i.e. the ranks file as loaded). */
static void check_every_rank(shoal_tok *t)
{
    int32_t n = shoal_tok_n_ranks(t), bad = 0, first_bad = -1;
    for (int32_t r = 0; r < n; r++) {
        size_t l;
        const uint8_t *b = shoal_tok_token_bytes(t, r, &l);
        if (shoal__tok_rank(t, b, l) != r && !bad++)
            first_bad = r;
    }
    CHECK_MSG(bad == 0, "%d of %d ranks not found by their bytes, first %d", bad, n, first_bad);
    /* and strings that are no token are not found: each token with a byte
     * appended that makes it no token, checked by decoding every rank */
    uint8_t buf[1024];
    int none = 0;
    for (int32_t r = 0; r < n && none < 2000; r += 97) {
        size_t l;
        const uint8_t *b = shoal_tok_token_bytes(t, r, &l);
        if (l + 1 > sizeof buf)
            continue;
        memcpy(buf, b, l);
        buf[l] = 0xFF; /* 0xFF is no byte of UTF-8: tokens ending in it are rare; check */
        int32_t got = shoal__tok_rank(t, buf, l + 1);
        if (got >= 0) {
            size_t gl;
            const uint8_t *gb = shoal_tok_token_bytes(t, got, &gl);
            CHECK(gl == l + 1 && !memcmp(gb, buf, l + 1));
        } else {
            none++;
        }
    }
    CHECK(none > 0);
}

static void t_rank_lookup_every_token(void)
{
    shoal_tok *t = open_tiny();
    CHECK(t != NULL);
    if (t)
        check_every_rank(t); /* the shared tiny tokenizer: main closes it */
    t = open_real();
    if (!t)
        return;
    check_every_rank(t);
    shoal_tok_close(t);
}

static void t_real_k3_vectors(void)
{
    shoal_tok *t = open_real();
    if (!t)
        return;
    const char *text = "According to all known laws of aviation, there is no way a";
    static const int32_t want[] = {18805, 308, 799, 5624, 12524, 318, 57195, 11, 1459, 387, 1495, 2189, 261};
    shoal_tok_ids ids = {0};
    char err[256];
    CHECK(shoal_tok_encode(t, text, strlen(text), 1, &ids, err, sizeof err) == 0);
    CHECK(ids.n == 13 && !memcmp(ids.v, want, sizeof want));
    char *d = NULL;
    size_t l = 0, c = 0;
    shoal_tok_decode(t, want, 13, &d, &l, &c, NULL, 0);
    CHECK(l == strlen(text) && !memcmp(d, text, l));
    free(d);
    CHECK_EQ_INT(shoal_tok_special_id(t, "<|end_of_msg|>"), 163586);
    CHECK_EQ_INT(shoal_tok_eos_id(t), 163585);
    shoal_tok_ids_free(&ids);
    shoal_tok_close(t);
}

int main(void)
{
    test_binary = "test_tokenizer";
    RUN(t_unicode_classes);
    RUN(t_utf8_maximal_subparts);
    RUN(t_load_tiny);
    RUN(t_load_refusals);
    RUN(t_bpe_small_equals_heap);
    RUN(t_ascii_fast_path_equals_pcre2);
    RUN(t_roundtrip_and_specials);
    RUN(t_detok_streaming);
    RUN(t_rank_lookup_every_token);
    RUN(t_real_k3_vectors);
    shoal_tok_close(tiny);
    return test_finish();
}
