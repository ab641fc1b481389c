/* Output parser tests: well-formed K3 output mapped to OpenAI shapes, streamed
 * deltas equal to the totals and never splitting a code point, a rendered
 * assistant message parsed back to what it was rendered from, and malformed or
 * truncated output (every case reports issues, nothing crashes; a random-id
 * sweep runs too). Model output is written as text with the structural
 * markers and encoded with special tokens allowed: that is what the ids of a
 * real generation look like. */
#include <jansson.h>
#include <stdint.h>

#include "common/err.h"
#include "coordinator/text/chat.h"
#include "coordinator/text/chatparse.h"
#include "coordinator/text/tokenizer.h"
#include "tests/unit/test.h"

static shoal_tok *tiny;

static shoal_tok *tok(void)
{
    if (!tiny) {
        char err[512];
        if (shoal_tok_open(&tiny, test_src_path("tests/models/tiny-k3"), NULL, err, sizeof err))
            fprintf(stderr, "  open tiny-k3: %s\n", err);
    }
    return tiny;
}

typedef struct {
    char reasoning[8192], content[8192];
    size_t rl, cl;
    int ncalls, nissues, split;
} stream;

static void on_event(void *ud, const shoal_chatparse_event *ev)
{
    stream *s = ud;
    if (ev->kind == SHOAL_CHATPARSE_REASONING || ev->kind == SHOAL_CHATPARSE_CONTENT) {
        if (!shoal_utf8_valid(ev->text, ev->len))
            s->split++;
        char *dst = ev->kind == SHOAL_CHATPARSE_REASONING ? s->reasoning : s->content;
        size_t *l = ev->kind == SHOAL_CHATPARSE_REASONING ? &s->rl : &s->cl;
        if (*l + ev->len < sizeof s->content) {
            memcpy(dst + *l, ev->text, ev->len);
            *l += ev->len;
        }
    } else if (ev->kind == SHOAL_CHATPARSE_TOOL_CALL) {
        s->ncalls++;
    } else {
        s->nissues++;
    }
}

/* Parses model output written as text with markers: feeds every id (ids after
 * the end id included), then finish(truncated). */
static shoal_chatparse *parse(const char *out, int thinking_off, int truncated, stream *st)
{
    shoal_tok *t = tok();
    if (!t)
        return NULL;
    shoal_tok_ids ids = {0};
    char err[256];
    shoal_tok_encode(t, out, strlen(out), 1, &ids, err, sizeof err);
    shoal_chatparse *p;
    memset(st, 0, sizeof *st);
    shoal_chatparse_open(&p, t, &(shoal_chatparse_opts){.thinking_off = thinking_off, .on_event = on_event, .ud = st},
                         err, sizeof err);
    for (size_t i = 0; i < ids.n; i++)
        shoal_chatparse_feed(p, ids.v[i]);
    shoal_chatparse_finish(p, truncated);
    shoal_tok_ids_free(&ids);
    return p;
}

static int eq(const char *s, size_t n, const char *want) { return n == strlen(want) && !memcmp(s, want, n); }

static void dump_issues(const shoal_chatparse *p)
{
    for (size_t i = 0; i < shoal_chatparse_n_issues(p); i++)
        fprintf(stderr, "    issue: %s\n", shoal_chatparse_issue(p, i));
}

static void t_well_formed(void)
{
    stream st;
    shoal_chatparse *p = parse("Let me think: 2+2 is 4 \xF0\x9F\xA6\x89.<|close|>think<|sep|><|open|>response<|sep|>"
                               "The answer is 4 (not <|open|> as text: \"<|sep|>\" is typed).<|close|>response<|sep|>"
                               "<|close|>message<|sep|><|end_of_msg|>",
                               0, 0, &st);
    CHECK(p != NULL);
    if (!p)
        return;
    size_t n;
    const char *r = shoal_chatparse_reasoning(p, &n);
    CHECK(eq(r, n, "Let me think: 2+2 is 4 \xF0\x9F\xA6\x89."));
    const char *c = shoal_chatparse_content(p, &n);
    /* the markers inside the content were encoded as specials here, so they
     * are structure: an <|open|> that has no <|sep|> is malformed */
    (void)c;
    CHECK_EQ_INT(st.split, 0);
    shoal_chatparse_close(p);

    p = parse("Plan.<|close|>think<|sep|><|open|>response<|sep|>Answer: caf\xC3\xA9.<|close|>response<|sep|>"
              "<|close|>message<|sep|><|end_of_msg|>",
              0, 0, &st);
    r = shoal_chatparse_reasoning(p, &n);
    CHECK(eq(r, n, "Plan."));
    c = shoal_chatparse_content(p, &n);
    CHECK(eq(c, n, "Answer: caf\xC3\xA9."));
    CHECK(eq(st.reasoning, st.rl, "Plan.") && eq(st.content, st.cl, "Answer: caf\xC3\xA9."));
    CHECK_EQ_INT(shoal_chatparse_n_issues(p), 0);
    CHECK(!strcmp(shoal_chatparse_finish_reason(p), "stop"));
    json_t *m = shoal_chatparse_message(p);
    char *js = json_dumps(m, JSON_COMPACT | JSON_PRESERVE_ORDER);
    CHECK_MSG(!strcmp(js, "{\"role\":\"assistant\",\"content\":\"Answer: café.\",\"reasoning_content\":\"Plan.\"}"), "%s", js);
    free(js);
    json_decref(m);
    shoal_chatparse_close(p);

    /* thinking off: the output starts in the response */
    p = parse("Hi.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", 1, 0, &st);
    c = shoal_chatparse_content(p, &n);
    CHECK(eq(c, n, "Hi."));
    shoal_chatparse_reasoning(p, &n);
    CHECK_EQ_INT(n, 0);
    CHECK_EQ_INT(shoal_chatparse_n_issues(p), 0);
    shoal_chatparse_close(p);
}

static void t_tool_calls(void)
{
    stream st;
    shoal_chatparse *p = parse(
        "Need weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        "<|open|>tools<|sep|><|open|>call tool=\"weather\" index=\"1\"<|sep|>"
        "<|open|>argument key=\"city\" type=\"string\"<|sep|>北京 \"quoted\"<|close|>argument<|sep|>"
        "<|open|>argument key=\"days\" type=\"number\"<|sep|>1e2<|close|>argument<|sep|>"
        "<|open|>argument key=\"ok\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>"
        "<|open|>argument key=\"xs\" type=\"array\"<|sep|>[1,2]<|close|>argument<|sep|>"
        "<|open|>argument key=\"a&amp;b\" type=\"null\"<|sep|>null<|close|>argument<|sep|>"
        "<|close|>call<|sep|>"
        "<|open|>call tool=\"clock\" index=\"2\"<|sep|><|close|>call<|sep|>"
        "<|open|>call tool=\"raw\" index=\"3\"<|sep|><|open|>json type=\"object\"<|sep|>{\"q\": [1, 2]}<|close|>json<|sep|><|close|>call<|sep|>"
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        0, 0, &st);
    CHECK(p != NULL);
    if (!p)
        return;
    dump_issues(p);
    CHECK_EQ_INT(shoal_chatparse_n_issues(p), 0);
    CHECK_EQ_INT(shoal_chatparse_n_tool_calls(p), 3);
    CHECK_EQ_INT(st.ncalls, 3);
    const char *id, *args;
    const char *name = shoal_chatparse_tool_call(p, 0, &id, &args);
    CHECK(name && !strcmp(name, "weather") && !strcmp(id, "call_0"));
    CHECK_MSG(!strcmp(args, "{\"city\":\"北京 \\\"quoted\\\"\",\"days\":1e2,\"ok\":true,\"xs\":[1,2],\"a&b\":null}"), "%s", args);
    name = shoal_chatparse_tool_call(p, 1, &id, &args);
    CHECK(!strcmp(name, "clock") && !strcmp(args, "{}"));
    name = shoal_chatparse_tool_call(p, 2, &id, &args);
    CHECK(!strcmp(name, "raw") && !strcmp(args, "{\"q\": [1, 2]}"));
    CHECK(!strcmp(shoal_chatparse_finish_reason(p), "tool_calls"));
    json_t *m = shoal_chatparse_message(p);
    CHECK(json_array_size(json_object_get(m, "tool_calls")) == 3);
    json_t *a = json_loads(json_string_value(json_object_get(json_object_get(json_array_get(json_object_get(m, "tool_calls"), 0), "function"), "arguments")),
                           JSON_DECODE_INT_AS_REAL, NULL);
    CHECK(a && !strcmp(json_string_value(json_object_get(a, "city")), "北京 \"quoted\""));
    json_decref(a);
    json_decref(m);
    shoal_chatparse_close(p);
}

/* Render an assistant message with the chat encoder, take the part after the
 * generation prompt, parse it: the same message comes back. */
static void t_render_parse_roundtrip(void)
{
    shoal_tok *t = tok();
    CHECK(t != NULL);
    if (!t)
        return;
    const char *msg = "[{\"role\":\"assistant\",\"content\":\"Sunny, 20\xC2\xB0" "C.\",\"reasoning_content\":\"Look it up.\","
                      "\"tool_calls\":[{\"id\":\"x\",\"type\":\"function\",\"function\":{\"name\":\"weather\","
                      "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\",\\\"days\\\":3,\\\"opts\\\":{\\\"u\\\":\\\"C\\\"}}\"}}]}]";
    json_t *m = json_loads(msg, 0, NULL);
    shoal_tok_ids ids = {0};
    char err[256];
    CHECK(shoal_chat_encode(t, m, &(shoal_chat_opts){.no_generation_prompt = 1}, &ids, err, sizeof err) == 0);
    /* drop "<|open|>message role="assistant"<|sep|><|open|>think<|sep|>": what the prompt held */
    int32_t sep = shoal_tok_special_id(t, "<|sep|>");
    size_t start = 0, seps = 0;
    while (start < ids.n && seps < 2)
        seps += ids.v[start++] == sep;
    shoal_chatparse *p;
    shoal_chatparse_open(&p, t, NULL, err, sizeof err);
    int ended = 0;
    for (size_t i = start; i < ids.n && !ended; i++)
        ended = shoal_chatparse_feed(p, ids.v[i]);
    CHECK(ended);
    shoal_chatparse_finish(p, 0);
    dump_issues(p);
    CHECK_EQ_INT(shoal_chatparse_n_issues(p), 0);
    json_t *back = shoal_chatparse_message(p);
    CHECK(!strcmp(json_string_value(json_object_get(back, "content")), "Sunny, 20\xC2\xB0" "C."));
    CHECK(!strcmp(json_string_value(json_object_get(back, "reasoning_content")), "Look it up."));
    json_t *call = json_array_get(json_object_get(back, "tool_calls"), 0);
    json_t *fn = json_object_get(call, "function");
    CHECK(!strcmp(json_string_value(json_object_get(fn, "name")), "weather"));
    json_t *want = json_loads("{\"city\":\"Paris\",\"days\":3,\"opts\":{\"u\":\"C\"}}", 0, NULL);
    json_t *got = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
    CHECK(got && json_equal(want, got));
    json_decref(want);
    json_decref(got);
    json_decref(back);
    shoal_chatparse_close(p);
    shoal_tok_ids_free(&ids);
    json_decref(m);
}

static void t_streaming_utf8(void)
{
    shoal_tok *t = tok();
    CHECK(t != NULL);
    if (!t)
        return;
    /* byte-level ids: each byte of multi-byte characters as its own id */
    const char *text = "中文 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD caf\xC3\xA9";
    shoal_chatparse *p;
    stream st;
    memset(&st, 0, sizeof st);
    char err[128];
    shoal_chatparse_open(&p, t, &(shoal_chatparse_opts){.thinking_off = 1, .on_event = on_event, .ud = &st}, err,
                         sizeof err);
    for (const char *c = text; *c; c++) {
        uint8_t b = (uint8_t)*c;
        /* the single-byte token's id */
        shoal_tok_ids one = {0};
        char *unused = NULL;
        (void)unused;
        int32_t id = -1;
        for (int32_t r = 0; r < shoal_tok_n_ranks(t) && id < 0; r++) {
            size_t l;
            const uint8_t *tb = shoal_tok_token_bytes(t, r, &l);
            if (l == 1 && tb[0] == b)
                id = r;
        }
        shoal_tok_ids_free(&one);
        shoal_chatparse_feed(p, id);
    }
    shoal_chatparse_finish(p, 1);
    CHECK_EQ_INT(st.split, 0);
    CHECK(eq(st.content, st.cl, text));
    CHECK(!strcmp(shoal_chatparse_finish_reason(p), "length"));
    shoal_chatparse_close(p);
}

static void expect_issue(const char *out, int thinking_off, int truncated, const char *needle, const char *content,
                         int ncalls)
{
    stream st;
    shoal_chatparse *p = parse(out, thinking_off, truncated, &st);
    if (!p)
        return;
    int found = 0;
    for (size_t i = 0; i < shoal_chatparse_n_issues(p); i++)
        found |= strstr(shoal_chatparse_issue(p, i), needle) != NULL;
    if (!found)
        dump_issues(p);
    CHECK_MSG(found, "no issue containing \"%s\" for %s", needle, out);
    CHECK_EQ_INT(st.nissues, (int)shoal_chatparse_n_issues(p));
    size_t n;
    const char *c = shoal_chatparse_content(p, &n);
    if (content)
        CHECK_MSG(eq(c, n, content), "content \"%.*s\", want \"%s\"", (int)n, c, content);
    CHECK_EQ_INT(shoal_chatparse_n_tool_calls(p), ncalls);
    json_t *m = shoal_chatparse_message(p); /* always builds */
    CHECK(m != NULL);
    json_decref(m);
    shoal_chatparse_close(p);
}

static void t_malformed(void)
{
    /* truncated in the middle of a call: no call, finish "length" */
    expect_issue("x<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
                 "<|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"a\" type=\"string\"<|sep|>abc",
                 0, 1, "cut off", "ok", 0);
    /* stray text between elements is kept in content and reported */
    expect_issue("<|close|>think<|sep|>stray<|open|>response<|sep|>ok<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
                 0, 0, "text outside an element", "strayok", 0);
    /* unknown element, mismatched closer, sep outside a tag */
    expect_issue("a<|close|>think<|sep|><|open|>bogus x=\"1\"<|sep|>zz<|close|>bogus<|sep|><|open|>response<|sep|>b"
                 "<|close|>tools<|sep|><|sep|>c<|close|>response<|sep|><|end_of_msg|>",
                 0, 0, "element <bogus>", "bc", 0);
    expect_issue("<|close|>think<|sep|><|open|>response<|sep|>b<|close|>tools<|sep|><|close|>response<|sep|><|end_of_msg|>",
                 0, 0, "closer </tools> matches no open element", "b", 0);
    expect_issue("<|close|>think<|sep|><|open|>response<|sep|>b<|sep|>c<|close|>response<|sep|><|end_of_msg|>",
                 0, 0, "<|sep|> outside a tag", "bc", 0);
    /* a call without a tool name is dropped; a typed value that is not JSON is sent as a string */
    expect_issue("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                 "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>"
                 "<|open|>call tool=\"g\"<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>twelve<|close|>argument<|sep|><|close|>call<|sep|>"
                 "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
                 0, 0, "without a tool name", "", 1);
    expect_issue("<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
                 "<|open|>call tool=\"g\"<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>twelve<|close|>argument<|sep|><|close|>call<|sep|>"
                 "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
                 0, 0, "is not a JSON number", "", 1);
    /* ended without the end id; left-open elements; ids after the end */
    expect_issue("r<|close|>think<|sep|><|open|>response<|sep|>partial", 0, 0, "without <|end_of_msg|>", "partial", 0);
    expect_issue("r<|close|>think<|sep|><|open|>response<|sep|>x<|end_of_msg|>more", 0, 0, "<response> was not closed",
                 "x", 0);
    expect_issue("r<|end_of_msg|>more<|end_of_msg|>", 0, 0, "ids after the end", "", 0);
    /* a tag interrupted by another tag; a special token in the output */
    expect_issue("<|open|>resp<|open|>response<|sep|>[BOS]y<|close|>response<|sep|><|end_of_msg|>", 1, 0,
                 "interrupted", NULL, 0);
    expect_issue("<|close|>think<|sep|><|open|>response<|sep|>y[BOS]z<|close|>response<|sep|><|end_of_msg|>", 0, 0,
                 "special token [BOS]", "yz", 0);
}

static void t_random_ids(void)
{
    shoal_tok *t = tok();
    CHECK(t != NULL);
    if (!t)
        return;
    uint64_t s = 12345;
    int32_t special[] = {shoal_tok_special_id(t, "<|open|>"), shoal_tok_special_id(t, "<|close|>"),
                         shoal_tok_special_id(t, "<|sep|>"), shoal_tok_special_id(t, "<|end_of_msg|>")};
    for (int iter = 0; iter < 2000; iter++) {
        shoal_chatparse *p;
        char err[64];
        stream st;
        memset(&st, 0, sizeof st);
        shoal_chatparse_open(&p, t, &(shoal_chatparse_opts){.thinking_off = iter & 1, .on_event = on_event, .ud = &st},
                             err, sizeof err);
        int n = 1 + iter % 200;
        for (int i = 0; i < n; i++) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            int32_t id = s % 3 == 0 ? special[(s >> 8) % 4] : (int32_t)((s >> 16) % (uint64_t)(shoal_tok_n_vocab(t) + 10)) - 5;
            shoal_chatparse_feed(p, id);
        }
        shoal_chatparse_finish(p, (int)(s & 1));
        CHECK_EQ_INT(st.split, 0);
        json_t *m = shoal_chatparse_message(p);
        CHECK(m != NULL);
        size_t rl, cl;
        shoal_chatparse_reasoning(p, &rl);
        shoal_chatparse_content(p, &cl);
        CHECK(rl == st.rl && cl == st.cl);
        json_decref(m);
        shoal_chatparse_close(p);
    }
}

/* ------------------------------------------------ the real vocabulary -- */

/* One generated-output segment as the real model's ids: a structural marker
 * as its one special id, text as ordinary ids (special strings in it stay
 * text) -- the way encoding_k3.py builds every element (SPEC §5.4). */
static void seg(const shoal_tok *t, shoal_tok_ids *ids, const char *text, int special)
{
    if (special) {
        shoal_tok_ids_push(ids, shoal_tok_special_id(t, text));
        return;
    }
    char err[256];
    shoal_tok_encode(t, text, strlen(text), 0, ids, err, sizeof err);
}

/* An element's opening with attributes, segment by segment: <|open|> TAG
 * (" key" '="' value '"')* <|sep|>. */
static void open_el(const shoal_tok *t, shoal_tok_ids *ids, const char *tag, const char *const *kv, int n)
{
    seg(t, ids, "<|open|>", 1);
    seg(t, ids, tag, 0);
    for (int i = 0; i < n; i++) {
        char k[64];
        snprintf(k, sizeof k, " %s", kv[2 * i]);
        seg(t, ids, k, 0);
        seg(t, ids, "=\"", 0);
        seg(t, ids, kv[2 * i + 1], 0);
        seg(t, ids, "\"", 0);
    }
    seg(t, ids, "<|sep|>", 1);
}

static void close_el(const shoal_tok *t, shoal_tok_ids *ids, const char *tag)
{
    seg(t, ids, "<|close|>", 1);
    seg(t, ids, tag, 0);
    seg(t, ids, "<|sep|>", 1);
}

/* The parser on a real-vocabulary id stream (issue 24): reasoning, content
 * and a typed tool call written with K3's 163,840 ids, where CJK, emoji ZWJ
 * sequences and combining marks are multi-byte tokens and typed markers are
 * ordinary ids; fed one id at a time, the deltas add up to the totals, no
 * delta splits a code point, and the results are the texts written. */
static void t_real_k3_stream(void)
{
    const char *dir = test_k3_tokenizer_dir();
    if (!dir)
        SKIP("real K3 vocabulary: no ../shared/k3/tiktoken.model beside the checkout; set "
             "SHOAL_K3_TOKENIZER_DIR to a directory with K3's tiktoken.model and tokenizer_config.json");
    shoal_tok *t;
    char err[512];
    CHECK_MSG(shoal_tok_open(&t, dir, NULL, err, sizeof err) == 0, "%s", err);
    if (!t)
        return;
    static const char reasoning[] = "思考一下：👨‍👩‍👧‍👦 and e\xCC\x81\xCC\x81 -- the user typed <|open|>tools<|sep|> as text.";
    static const char content[] = "答案是 42 🏳️‍🌈 naïve café\n\n    code() [EOS] <|end_of_msg|>";
    shoal_tok_ids ids = {0};
    seg(t, &ids, reasoning, 0);
    close_el(t, &ids, "think");
    open_el(t, &ids, "response", NULL, 0);
    seg(t, &ids, content, 0);
    close_el(t, &ids, "response");
    open_el(t, &ids, "tools", NULL, 0);
    open_el(t, &ids, "call", (const char *const[]){"tool", "weather", "index", "1"}, 2);
    open_el(t, &ids, "argument", (const char *const[]){"key", "city", "type", "string"}, 2);
    seg(t, &ids, "北京 \"东城\"", 0);
    close_el(t, &ids, "argument");
    open_el(t, &ids, "argument", (const char *const[]){"key", "days", "type", "number"}, 2);
    seg(t, &ids, "3", 0);
    close_el(t, &ids, "argument");
    close_el(t, &ids, "call");
    close_el(t, &ids, "tools");
    close_el(t, &ids, "message");
    seg(t, &ids, "<|end_of_msg|>", 1);
    /* the real vocabulary's ids: all below 163,840, and the only special ids
     * are the markers (none from the typed "<|open|>", "[EOS]", "<|end_of_msg|>") */
    size_t nspecial = 0;
    for (size_t i = 0; i < ids.n; i++)
        nspecial += ids.v[i] >= 163584;
    CHECK_EQ_INT(nspecial, 2 + 2 * 2 + 2 * 2 + 2 * 2 + 2 * 2 * 2 + 2 + 1); /* think, response, tools, call, 2 arguments, message, end */

    stream st;
    memset(&st, 0, sizeof st);
    shoal_chatparse *p;
    CHECK(shoal_chatparse_open(&p, t, &(shoal_chatparse_opts){.on_event = on_event, .ud = &st}, err, sizeof err) ==
          0);
    int ended = 0;
    size_t i;
    for (i = 0; i < ids.n && !ended; i++)
        ended = shoal_chatparse_feed(p, ids.v[i]);
    CHECK(ended && i == ids.n);
    shoal_chatparse_finish(p, 0);
    dump_issues(p);
    CHECK_EQ_INT(shoal_chatparse_n_issues(p), 0);
    size_t n;
    const char *r = shoal_chatparse_reasoning(p, &n);
    CHECK_MSG(eq(r, n, reasoning), "reasoning %.*s", (int)n, r);
    const char *c = shoal_chatparse_content(p, &n);
    CHECK_MSG(eq(c, n, content), "content %.*s", (int)n, c);
    CHECK(eq(st.reasoning, st.rl, reasoning) && eq(st.content, st.cl, content));
    CHECK_EQ_INT(st.split, 0);
    CHECK_EQ_INT(shoal_chatparse_n_tool_calls(p), 1);
    const char *id, *args;
    const char *name = shoal_chatparse_tool_call(p, 0, &id, &args);
    CHECK(name && !strcmp(name, "weather"));
    CHECK_MSG(args && !strcmp(args, "{\"city\":\"北京 \\\"东城\\\"\",\"days\":3}"), "%s", args ? args : "(null)");
    CHECK(!strcmp(shoal_chatparse_finish_reason(p), "tool_calls"));
    shoal_chatparse_close(p);
    shoal_tok_ids_free(&ids);
    shoal_tok_close(t);
}

int main(void)
{
    test_binary = "test_chatparse";
    RUN(t_well_formed);
    RUN(t_tool_calls);
    RUN(t_render_parse_roundtrip);
    RUN(t_streaming_utf8);
    RUN(t_malformed);
    RUN(t_random_ids);
    RUN(t_real_k3_stream);
    shoal_tok_close(tiny);
    return test_finish();
}
