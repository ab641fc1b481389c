/* constrain unit tests: the byte matcher on hand-written accepted / refused
 * strings (each expectation read from the JSON Schema / regex definitions,
 * not from the code), the compiler's refusals, and the mask on the tiny K3
 * vocabulary and on K3's real one: every allowed token is accepted, every
 * refused one is refused, and random walks over allowed tokens end in text
 * that jansson (an independent parser) reads. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/text/constrain.h"
#include "coordinator/text/tokenizer.h"
#include "test.h"

static shoal_cons *json_c(const char *schema)
{
    json_error_t je;
    json_t *s = schema ? json_loads(schema, 0, &je) : NULL;
    if (schema && !s) {
        fprintf(stderr, "  bad test schema: %s\n", je.text);
        return NULL;
    }
    shoal_cons *c;
    char err[300];
    int rc = shoal_cons_compile_json(&c, s, err, sizeof err);
    json_decref(s);
    CHECK_MSG(rc == 0, "%s: %s", schema, err);
    return rc ? NULL : c;
}

/* a run over a 1-token dummy vocabulary: only the byte feed is used */
static shoal_cons_vocab *byte_vocab;

static int accepts(const shoal_cons *c, const char *text)
{
    shoal_cons_run *r;
    int32_t end = shoal_cons_vocab_size(byte_vocab) - 1;
    char err[200];
    if (shoal_cons_run_create(&r, c, byte_vocab, &end, 1, err, sizeof err))
        return -1;
    int ok = shoal_cons_run_feed(r, (const uint8_t *)text, strlen(text)) == 0 && shoal_cons_run_text_complete(r);
    shoal_cons_run_free(r);
    return ok;
}

/* text is a prefix of something accepted (feed succeeds) */
static int prefix_ok(const shoal_cons *c, const char *text)
{
    shoal_cons_run *r;
    int32_t end = shoal_cons_vocab_size(byte_vocab) - 1;
    char err[200];
    if (shoal_cons_run_create(&r, c, byte_vocab, &end, 1, err, sizeof err))
        return -1;
    int ok = shoal_cons_run_feed(r, (const uint8_t *)text, strlen(text)) == 0;
    shoal_cons_run_free(r);
    return ok;
}

#define YES(c, s) CHECK_MSG(accepts(c, s) == 1, "should accept: %s", s)
#define NO(c, s) CHECK_MSG(accepts(c, s) == 0, "should refuse: %s", s)

static shoal_tok *tiny;

static void t_json_object(void)
{
    shoal_cons *c = json_c(NULL);
    YES(c, "{}");
    YES(c, "{\"a\": 1}");
    YES(c, "{\"a\":[1,2.5e-3,\"x\",true,null,{\"b\":false}]}");
    YES(c, " {\n  \"k\" : \"v\\n\\u00e9\xc3\xa9\"\n}\n");
    YES(c, "{\"a\":-0.5E+10}");
    NO(c, "[]");     /* json_object: an object */
    NO(c, "{");      /* incomplete */
    NO(c, "{\"a\":01}"); /* leading zero */
    NO(c, "{\"a\":1,}");
    NO(c, "{\"a\" 1}");
    NO(c, "{\"a\":\"\x01\"}");     /* raw control character */
    NO(c, "{\"a\":\"\xc3\"}");     /* truncated UTF-8 */
    NO(c, "{\"a\":\"\xed\xa0\x80\"}"); /* an encoded surrogate */
    NO(c, "{\"a\":\"\\ud800\"}");  /* surrogate escapes are not offered */
    NO(c, "{\"a\":1}x");
    NO(c, "{\"a\":tru}");
    /* at most 18 integer digits: every integer fits int64, which the
     * server's own JSON parsing (the Anthropic path's tool input) needs */
    YES(c, "{\"a\":-999999999999999999}");
    NO(c, "{\"a\":1234567890123456789}");
    YES(c, "{\"a\":1.5e99}");
    NO(c, "{\"a\":1.5e100}");
    CHECK(prefix_ok(c, "{\"a\":\"\xe2\x82") == 1); /* a character split across tokens */
    CHECK(prefix_ok(c, "{\"a\":\"\xe2\x28") == 0);
    /* whitespace is bounded */
    char big[64] = "{";
    memset(big + 1, ' ', SHOAL_CONS_WS_MAX + 1);
    CHECK(prefix_ok(c, big) == 0);
    big[SHOAL_CONS_WS_MAX + 1] = '\0';
    CHECK(prefix_ok(c, big) == 1);
    shoal_cons_free(c);
}

static void t_schema_object(void)
{
    shoal_cons *c = json_c("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},"
                           "\"age\":{\"type\":\"integer\"},\"tag\":{\"type\":\"string\"}},"
                           "\"required\":[\"name\",\"tag\"],\"additionalProperties\":false}");
    YES(c, "{\"name\":\"x\",\"age\":3,\"tag\":\"t\"}");
    YES(c, "{\"name\":\"x\",\"tag\":\"t\"}");   /* age optional */
    NO(c, "{\"name\":\"x\"}");                  /* tag required */
    NO(c, "{\"name\":\"x\",\"age\":3.5,\"tag\":\"t\"}"); /* integer */
    NO(c, "{\"name\":\"x\",\"tag\":\"t\",\"z\":1}");  /* additionalProperties false */
    NO(c, "{\"name\":1,\"tag\":\"t\"}");
    NO(c, "{\"name\":\"x\",\"name\":\"y\",\"tag\":\"t\"}"); /* no duplicate keys */
    CHECK(prefix_ok(c, "{\"nam") == 1);
    CHECK(prefix_ok(c, "{\"ag") == 0); /* name is required first (declaration order) */
    shoal_cons_free(c);
    /* additional properties with a schema: never a declared name */
    c = json_c("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
               "\"additionalProperties\":{\"type\":\"string\"}}");
    YES(c, "{\"a\":1,\"b\":\"x\"}");
    YES(c, "{\"ab\":\"x\"}");
    NO(c, "{\"b\":1}");
    NO(c, "{\"b\":\"x\",\"a\":\"y\"}"); /* 'a' as an additional key would be validated as integer */
    NO(c, "{\"a\":\"x\"}");
    shoal_cons_free(c);
}

static void t_schema_array_string(void)
{
    shoal_cons *c = json_c("{\"type\":\"array\",\"items\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":3},"
                           "\"minItems\":1,\"maxItems\":2}");
    YES(c, "[\"ab\"]");
    YES(c, "[\"ab\", \"\xc3\xa9\xc3\xa9\xc3\xa9\"]"); /* 3 code points, 6 bytes */
    YES(c, "[\"\\n\\t\"]");                           /* escapes are one character each */
    NO(c, "[]");
    NO(c, "[\"a\"]");
    NO(c, "[\"abcd\"]");
    NO(c, "[\"ab\",\"ab\",\"ab\"]");
    shoal_cons_free(c);
    c = json_c("{\"type\":\"array\",\"prefixItems\":[{\"type\":\"boolean\"},{\"type\":\"null\"}],\"items\":false}");
    YES(c, "[true,null]");
    YES(c, "[false]");
    NO(c, "[true,null,1]");
    NO(c, "[null]");
    shoal_cons_free(c);
}

static void t_schema_enum_anyof_ref(void)
{
    shoal_cons *c = json_c("{\"enum\":[\"red\",\"green\",1,12,null,{\"a\":[1]}]}");
    YES(c, "\"red\"");
    YES(c, "1");
    YES(c, "12");
    YES(c, "{\"a\":[1]}");
    YES(c, "null");
    NO(c, "\"blue\"");
    NO(c, "123");
    shoal_cons_free(c);
    /* enum values filtered by the rest of the schema */
    c = json_c("{\"type\":\"string\",\"enum\":[\"a\",1]}");
    YES(c, "\"a\"");
    NO(c, "1");
    shoal_cons_free(c);
    c = json_c("{\"anyOf\":[{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"}},\"required\":[\"x\"]},"
               "{\"type\":\"object\",\"properties\":{\"y\":{\"type\":\"string\"}},\"required\":[\"y\"]},"
               "{\"type\":[\"number\",\"null\"]}]}");
    YES(c, "{\"x\":1}");
    YES(c, "{\"y\":\"s\"}");
    YES(c, "2.5");
    YES(c, "null");
    NO(c, "{\"x\":\"s\"}");
    NO(c, "{\"y\":1}");
    NO(c, "\"s\"");
    shoal_cons_free(c);
    /* recursive: a tree */
    c = json_c("{\"$ref\":\"#/$defs/node\",\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":"
               "{\"v\":{\"type\":\"integer\"},\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"}}},"
               "\"required\":[\"v\",\"kids\"],\"additionalProperties\":false}}}");
    YES(c, "{\"v\":1,\"kids\":[]}");
    YES(c, "{\"v\":1,\"kids\":[{\"v\":2,\"kids\":[{\"v\":3,\"kids\":[]}]}]}");
    NO(c, "{\"v\":1,\"kids\":[{\"v\":2}]}");
    shoal_cons_free(c);
    c = json_c("{\"const\":{\"k\":\"v\"}}");
    YES(c, "{\"k\":\"v\"}");
    NO(c, "{\"k\":\"w\"}");
    shoal_cons_free(c);
}

static void t_pattern_format(void)
{
    shoal_cons *c = json_c("{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-[0-9]+$\"}");
    YES(c, "\"AB-12\"");
    NO(c, "\"AB-\"");
    NO(c, "\"ab-12\"");
    shoal_cons_free(c);
    c = json_c("{\"type\":\"string\",\"pattern\":\"ab\"}"); /* re.search: anywhere */
    YES(c, "\"xxabyy\"");
    YES(c, "\"ab\"");
    NO(c, "\"a b\"");
    shoal_cons_free(c);
    c = json_c("{\"type\":\"string\",\"format\":\"date\"}");
    YES(c, "\"2024-02-28\"");
    NO(c, "\"2024-13-01\"");
    NO(c, "\"2024-1-01\"");
    NO(c, "\"0000-08-01\""); /* year 0 is no date to Python's datetime (found by test_constrain_walk) */
    shoal_cons_free(c);
    c = json_c("{\"type\":\"string\",\"format\":\"uuid\"}");
    YES(c, "\"123e4567-e89b-12d3-a456-426614174000\"");
    NO(c, "\"123e4567-e89b-12d3-a456-42661417400\"");
    shoal_cons_free(c);
    c = json_c("{\"type\":\"string\",\"format\":\"date-time\"}");
    YES(c, "\"2024-01-02T03:04:05Z\"");
    YES(c, "\"2024-01-02T03:04:05.123+01:00\"");
    NO(c, "\"2024-01-02 03:04:05Z\"");
    shoal_cons_free(c);
}

static void expect_refused(const char *schema, int code, const char *needle)
{
    json_t *s = json_loads(schema, 0, NULL);
    shoal_cons *c = NULL;
    char err[300] = "";
    int rc = shoal_cons_compile_json(&c, s, err, sizeof err);
    json_decref(s);
    CHECK_MSG(rc == code, "%s: rc %d (%s)", schema, rc, err);
    CHECK_STR_CONTAINS(err, needle);
    shoal_cons_free(c);
}

static void t_refusals(void)
{
    expect_refused("{\"type\":\"integer\",\"minimum\":3}", SHOAL_EUNSUPPORTED, "/minimum");
    expect_refused("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\",\"contentEncoding\":\"x\"}}}",
                   SHOAL_EUNSUPPORTED, "/properties/a/contentEncoding");
    expect_refused("{\"type\":\"strin\"}", SHOAL_EINVAL, "unknown type");
    expect_refused("{\"$ref\":\"#/$defs/nope\"}", SHOAL_EINVAL, "does not resolve");
    expect_refused("{\"type\":\"string\",\"pattern\":\"(a\"}", SHOAL_EINVAL, "pattern");
    expect_refused("{\"type\":\"string\",\"pattern\":\"\\\\bword\"}", SHOAL_EUNSUPPORTED, "escape");
    expect_refused("{\"type\":\"string\",\"pattern\":\"(?=a)\"}", SHOAL_EUNSUPPORTED, "lookaround");
    /* catastrophic blow-up of the DFA: (a|b)*a(a|b){n} needs 2^n states */
    expect_refused("{\"type\":\"string\",\"pattern\":\"^(a|b)*a(a|b){20}$\"}", SHOAL_ERANGE, "too many");
    expect_refused("{\"type\":\"string\",\"format\":\"hostname\"}", SHOAL_EUNSUPPORTED, "hostname");
    expect_refused("{\"type\":\"object\",\"required\":[\"x\"]}", SHOAL_EUNSUPPORTED, "required property 'x'");
    expect_refused("{\"enum\":[1,2],\"type\":\"string\"}", SHOAL_EINVAL, "no value");
    /* nesting: refused, not a stack overflow */
    char deep[4000] = "";
    for (int i = 0; i < 100; i++)
        strcat(deep, "{\"type\":\"array\",\"items\":");
    strcat(deep, "{}");
    for (int i = 0; i < 100; i++)
        strcat(deep, "}");
    expect_refused(deep, SHOAL_ERANGE, "/items/items");
}

/* llama.cpp's grammars/arithmetic.gbnf and list.gbnf as published */
static const char *arith_gbnf = "root  ::= (expr \"=\" ws term \"\\n\")+\n"
                                "expr  ::= term ([-+*/] term)*\n"
                                "term  ::= ident | num | \"(\" ws expr \")\" ws\n"
                                "ident ::= [a-z] [a-z0-9_]* ws\n"
                                "num   ::= [0-9]+ ws\n"
                                "ws    ::= [ \\t\\n]*\n";
static const char *list_gbnf = "root ::= item+\n\n# Excludes various line break characters\n"
                               "item ::= \"- \" [^\\r\\n\\x0b\\x0c\\x85\\u2028\\u2029]+ \"\\n\"\n";

static void t_gbnf(void)
{
    shoal_cons *c;
    char err[300];
    CHECK_MSG(shoal_cons_compile_gbnf(&c, arith_gbnf, strlen(arith_gbnf), err, sizeof err) == 0, "%s", err);
    YES(c, "a=1\n");
    YES(c, "x +2 *(y -3)= 4\nb=c\n");
    NO(c, "x + 2=1\n"); /* no white space before a term */
    YES(c, "((a))=b\n"); /* nesting within the bound */
    NO(c, "a=1");          /* each line ends in a newline */
    NO(c, "a+=1\n");
    NO(c, "A=1\n");
    NO(c, "(((((a)))))=b\n"); /* past the recursion bound (a subset, documented) */
    shoal_cons_free(c);
    CHECK_MSG(shoal_cons_compile_gbnf(&c, list_gbnf, strlen(list_gbnf), err, sizeof err) == 0, "%s", err);
    YES(c, "- milk\n- eggs and ham\n");
    NO(c, "- \n");
    NO(c, "* milk\n");
    shoal_cons_free(c);
    const char *bad[] = {"root ::= undefined-rule", "root ::= \"a", "x ::= \"a\"", "root ::= (\"a\"", "root ::= [b-a]",
                         "root ::= a\na ::= b\nb ::= a"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c = NULL;
        CHECK_MSG(shoal_cons_compile_gbnf(&c, bad[i], strlen(bad[i]), err, sizeof err) != 0, "accepted %s", bad[i]);
        CHECK(c == NULL);
    }
}

static void t_regex_choice(void)
{
    shoal_cons *c;
    char err[200];
    const char *re = "(yes|no)( [0-9]{1,3})?";
    CHECK(shoal_cons_compile_regex(&c, re, strlen(re), err, sizeof err) == 0);
    YES(c, "yes");
    YES(c, "no 42");
    NO(c, "no 4242");
    NO(c, "maybe");
    NO(c, "yes "); /* whole-text match */
    shoal_cons_free(c);
    const char *ch[] = {"Paris", "Par", "London"};
    CHECK(shoal_cons_compile_choice(&c, ch, 3, err, sizeof err) == 0);
    YES(c, "Paris");
    YES(c, "Par");
    NO(c, "Pari");
    NO(c, " London");
    shoal_cons_free(c);
}

/* mask consistency + random walks on a vocabulary */
static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

/* gbnf non-NULL: walk that grammar instead of the schema (no jansson check) */
static void walks_g(shoal_tok *t, const char *schema, const char *gbnf, int nwalks, int check_all)
{
    shoal_cons_vocab *v;
    char err[300];
    CHECK(shoal_cons_vocab_build(&v, t, err, sizeof err) == 0);
    shoal_cons *c = NULL;
    if (gbnf)
        CHECK_MSG(shoal_cons_compile_gbnf(&c, gbnf, strlen(gbnf), err, sizeof err) == 0, "%s", err);
    else
        c = json_c(schema);
    if (!c)
        return;
    int32_t V = shoal_cons_vocab_size(v), eos = shoal_tok_eos_id(t);
    uint8_t *mask = malloc((size_t)V), *ahead = malloc((size_t)V);
    int32_t *allowed = malloc(sizeof(int32_t) * (size_t)V);
    for (int w = 0; w < nwalks; w++) {
        shoal_cons_run *r;
        CHECK(shoal_cons_run_create(&r, c, v, &eos, 1, err, sizeof err) == 0);
        /* the scheduler's look-ahead (drafted verify rows): a copy of the run
         * taken before a step, advanced by the id the walk then takes, gives
         * the mask the run itself gives after that id */
        shoal_cons_run *look = shoal_cons_run_clone(r);
        int n_ahead = -1;
        char text[8192];
        size_t tn = 0;
        for (int stepi = 0; stepi < 400; stepi++) {
            int n = shoal_cons_run_mask(r, mask);
            if (n_ahead >= 0) {
                CHECK_EQ_INT(n_ahead, n);
                CHECK_MSG(!memcmp(ahead, mask, (size_t)V), "look-ahead mask differs after %.*s", (int)tn, text);
            }
            CHECK_MSG(n > 0, "empty mask after %.*s", (int)tn, text);
            if (n <= 0)
                break;
            int na = 0;
            for (int32_t i = 0; i < V; i++)
                if (mask[i])
                    allowed[na++] = i;
            CHECK_EQ_INT(na, n);
            if (check_all && stepi < 3) {
                /* every id: allowed <=> accepted by the byte feed */
                /* every 7th id of a small vocabulary; about 4,000 ids, from a random
                 * offset, of the real one (each id replays the text into a fresh run:
                 * 23,000 of them per step took minutes under ASan) */
                int32_t nr = shoal_tok_n_ranks(t), stride = nr / 4000 > 7 ? nr / 4000 : 7;
                for (int32_t i = (int32_t)(rnd() % (uint32_t)stride); i < nr; i += stride) {
                    size_t bl;
                    const uint8_t *b = shoal_tok_token_bytes(t, i, &bl);
                    shoal_cons_run *r2;
                    shoal_cons_run_create(&r2, c, v, &eos, 1, err, sizeof err);
                    /* replay the text, then the token */
                    int ok = shoal_cons_run_feed(r2, (const uint8_t *)text, tn) == 0 &&
                             shoal_cons_run_feed(r2, b, bl) == 0;
                    CHECK_MSG(ok == mask[i], "id %d: feed %d mask %d", (int)i, ok, mask[i]);
                    shoal_cons_run_free(r2);
                }
            }
            /* prefer ending once possible half the time, else random */
            int32_t id = mask[eos] && (rnd() & 1) ? eos : allowed[rnd() % (uint32_t)na];
            shoal_cons_run_copy(look, r);
            CHECK(shoal_cons_run_accept(r, id) == 0);
            if (id == eos)
                break;
            CHECK(shoal_cons_run_accept(look, id) == 0);
            n_ahead = shoal_cons_run_mask(look, ahead);
            size_t bl;
            const uint8_t *b = shoal_tok_token_bytes(t, id, &bl);
            if (tn + bl < sizeof text) {
                memcpy(text + tn, b, bl);
                tn += bl;
            }
        }
        if (shoal_cons_run_done(r) && !gbnf) {
            json_error_t je;
            json_t *j = json_loadb(text, tn, JSON_DECODE_ANY | JSON_DECODE_INT_AS_REAL, &je);
            CHECK_MSG(j != NULL, "jansson refuses %.*s: %s", (int)tn, text, je.text);
            if (!schema)
                CHECK(json_is_object(j));
            json_decref(j);
        }
        shoal_cons_run_free(r);
        shoal_cons_run_free(look);
    }
    free(mask);
    free(ahead);
    free(allowed);
    shoal_cons_free(c);
    shoal_cons_vocab_free(v);
}

static void walks(shoal_tok *t, const char *schema, int nwalks, int check_all)
{
    walks_g(t, schema, NULL, nwalks, check_all);
}

static const char *tree_schema =
    "{\"$ref\":\"#/$defs/n\",\"$defs\":{\"n\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\","
    "\"maxLength\":12},\"v\":{\"type\":[\"number\",\"null\"]},\"kids\":{\"type\":\"array\",\"maxItems\":2,"
    "\"items\":{\"$ref\":\"#/$defs/n\"}}},\"required\":[\"name\"],\"additionalProperties\":false}}}";

static void t_mask_tiny(void)
{
    walks(tiny, NULL, 40, 1);
    walks(tiny, tree_schema, 40, 1);
    walks_g(tiny, NULL, arith_gbnf, 20, 1); /* the DFA-only walk of a whole-text regex */
}

/* shoal_cons_run_reset (a tool call's run moves from its header to its
 * arguments): a run that was part way through one constraint, its end ids
 * taken, reset onto another gives the masks of a fresh run over that one,
 * walk after walk; a copy into a clone made over a third constraint takes
 * the source's constraint with its state. */
static void t_run_reset(void)
{
    shoal_cons_vocab *v;
    char err[300];
    CHECK(shoal_cons_vocab_build(&v, tiny, err, sizeof err) == 0);
    shoal_cons *any = json_c(NULL), *tree = json_c(tree_schema), *ch;
    const char *names[] = {"alpha", "beta"};
    CHECK(shoal_cons_compile_choice(&ch, names, 2, err, sizeof err) == 0);
    int32_t V = shoal_cons_vocab_size(v), eos = shoal_tok_eos_id(tiny), ends[2] = {eos, 7};
    uint8_t *m1 = malloc((size_t)V), *m2 = malloc((size_t)V);
    shoal_cons_run *moved, *fresh, *other;
    CHECK(shoal_cons_run_create(&moved, any, v, ends, 2, err, sizeof err) == 0);
    CHECK(shoal_cons_run_create(&other, ch, v, &eos, 1, err, sizeof err) == 0);
    CHECK(shoal_cons_run_set_prefix(moved, &ends[1], 1) == 0);
    CHECK(shoal_cons_run_accept(moved, 7) == 0); /* the prefix */
    CHECK(shoal_cons_run_feed(moved, (const uint8_t *)"{\"a\": [1", 8) == 0);
    CHECK(shoal_cons_run_reset(moved, tree, &eos, 0) == SHOAL_EINVAL); /* no end ids: refused, unchanged */
    CHECK(shoal_cons_run_feed(moved, (const uint8_t *)"]}", 2) == 0 && shoal_cons_run_text_complete(moved));
    CHECK(shoal_cons_run_accept(moved, eos) == 0 && shoal_cons_run_accept(moved, 7) == 0 &&
          shoal_cons_run_done(moved));
    int diffs = 0, steps = 0;
    for (int w = 0; w < 6; w++) {
        CHECK(shoal_cons_run_reset(moved, tree, &eos, 1) == 0);
        CHECK(shoal_cons_run_create(&fresh, tree, v, &eos, 1, err, sizeof err) == 0);
        shoal_cons_run *look = shoal_cons_run_clone(other);
        shoal_cons_run_copy(look, moved);
        for (int k = 0; k < 60; k++) {
            int n1 = shoal_cons_run_mask(moved, m1), n2 = shoal_cons_run_mask(fresh, m2);
            diffs += n1 != n2 || memcmp(m1, m2, (size_t)V);
            n1 = shoal_cons_run_mask(look, m1);
            diffs += n1 != n2 || memcmp(m1, m2, (size_t)V);
            steps++;
            if (n2 <= 0)
                break;
            int32_t id = m2[eos] && (rnd() & 1) ? eos : -1;
            for (int32_t i = (int32_t)(rnd() % (uint32_t)V); id < 0; i = (i + 1) % V)
                if (m2[i])
                    id = i;
            CHECK(shoal_cons_run_accept(moved, id) == 0 && shoal_cons_run_accept(fresh, id) == 0 &&
                  shoal_cons_run_accept(look, id) == 0);
            if (shoal_cons_run_done(fresh))
                break;
        }
        CHECK(shoal_cons_run_done(moved) == shoal_cons_run_done(fresh));
        shoal_cons_run_free(fresh);
        shoal_cons_run_free(look);
    }
    CHECK_MSG(!diffs, "%d of %d masks differ after a reset", diffs, steps);
    CHECK(steps > 30);
    shoal_cons_run_free(moved);
    shoal_cons_run_free(other);
    shoal_cons_free(any);
    shoal_cons_free(tree);
    shoal_cons_free(ch);
    free(m1);
    free(m2);
    shoal_cons_vocab_free(v);
}

static void t_mask_real(void)
{
    const char *dir = test_k3_tokenizer_dir();
    if (!dir)
        SKIP("real K3 vocabulary: no ../shared/k3/tiktoken.model; set SHOAL_K3_TOKENIZER_DIR");
    shoal_tok *t;
    char err[300];
    CHECK(shoal_tok_open(&t, dir, NULL, err, sizeof err) == 0);
    walks(t, NULL, 6, 0);
    walks(t, tree_schema, 6, 1);
    walks_g(t, NULL, arith_gbnf, 4, 1);
    shoal_tok_close(t);
}

int main(void)
{
    test_binary = "test_constrain";
    char err[300];
    if (shoal_tok_open(&tiny, test_src_path("tests/models/tiny-k3"), NULL, err, sizeof err)) {
        fprintf(stderr, "tiny-k3: %s\n", err);
        return 1;
    }
    if (shoal_cons_vocab_build(&byte_vocab, tiny, err, sizeof err)) {
        fprintf(stderr, "vocab: %s\n", err);
        return 1;
    }
    RUN(t_json_object);
    RUN(t_schema_object);
    RUN(t_schema_array_string);
    RUN(t_schema_enum_anyof_ref);
    RUN(t_pattern_format);
    RUN(t_refusals);
    RUN(t_regex_choice);
    RUN(t_gbnf);
    RUN(t_mask_tiny);
    RUN(t_run_reset);
    RUN(t_mask_real);
    shoal_cons_vocab_free(byte_vocab);
    shoal_tok_close(tiny);
    return test_finish();
}
