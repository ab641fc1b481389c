/* Chat encoder (XTML) tests. The structure is checked against the segments the
 * official encoding_k3.py produced (tests/fixtures/tokenizer/xtml_official.json,
 * transcribed from ATLAS official-xtml.json, HF rev f831ab66); with the real K3
 * vocabulary (SHOAL_K3_TOKENIZER_DIR) the token counts of SPEC §5.5. Cases the
 * official fixture does not cover (thinking effort, tool choice none, response
 * format, dynamic tools, errors) are checked against the rules of SPEC §5.4 as
 * written there and in chat.h. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/text/chat.h"
#include "coordinator/text/chatjson.h"
#include "coordinator/text/tokenizer.h"
#include "tests/unit/test.h"

static shoal_tok *tiny;

static shoal_tok *open_tiny(void)
{
    if (!tiny) {
        char err[512];
        if (shoal_tok_open(&tiny, test_src_path("tests/models/tiny-k3"), NULL, err, sizeof err))
            fprintf(stderr, "  open tiny-k3: %s\n", err);
    }
    return tiny;
}

static json_t *fixture(void)
{
    static json_t *fx;
    if (!fx) {
        json_error_t je;
        fx = json_load_file(test_src_path("tests/fixtures/tokenizer/xtml_official.json"), 0, &je);
        if (!fx)
            fprintf(stderr, "  fixture: %s\n", je.text);
    }
    return fx;
}

static json_t *fixture_case(const char *name)
{
    json_t *c;
    size_t i;
    json_array_foreach(json_object_get(fixture(), "cases"), i, c) if (!strcmp(
        json_string_value(json_object_get(c, "name")), name)) return c;
    return NULL;
}

/* the encoder's keyword arguments of a fixture case as options */
static shoal_chat_opts case_opts(const json_t *c)
{
    const json_t *kw = json_object_get(c, "kwargs");
    shoal_chat_opts o = {0};
    o.thinking_off = json_is_false(json_object_get(kw, "thinking"));
    o.no_generation_prompt = json_is_false(json_object_get(kw, "add_generation_prompt"));
    o.tools = json_object_get(kw, "tools");
    o.tool_choice = json_object_get(kw, "tool_choice");
    return o;
}

/* compares rendered segments with a JSON list of [text, special] */
static int same_segments(const shoal_chat_segs *s, const json_t *want, const char *name)
{
    size_t n = shoal_chat_segs_count(s);
    if (n != json_array_size(want)) {
        fprintf(stderr, "  %s: %zu segments, want %zu\n", name, n, json_array_size(want));
    }
    for (size_t i = 0; i < n && i < json_array_size(want); i++) {
        shoal_chat_seg g = shoal_chat_segs_get(s, i);
        const json_t *w = json_array_get(want, i);
        const json_t *wt = json_array_get(w, 0);
        if (g.len != json_string_length(wt) || memcmp(g.text, json_string_value(wt), g.len) ||
            g.special != json_is_true(json_array_get(w, 1))) {
            fprintf(stderr, "  %s: segment %zu is [\"%s\", %d], want [\"%s\", %d]\n", name, i, g.text,
                    g.special, json_string_value(wt), json_is_true(json_array_get(w, 1)));
            return 0;
        }
    }
    return n == json_array_size(want);
}

static void t_official_segments(void)
{
    json_t *fx = fixture();
    CHECK(fx != NULL);
    if (!fx)
        return;
    json_t *c;
    size_t i;
    int ncases = 0;
    json_array_foreach(json_object_get(fx, "cases"), i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        shoal_chat_opts o = case_opts(c);
        shoal_chat_segs *s;
        char err[512];
        int rc = shoal_chat_render(json_object_get(c, "messages"), &o, &s, err, sizeof err);
        CHECK_MSG(rc == 0, "%s: %s", name, err);
        if (rc)
            continue;
        CHECK_MSG(same_segments(s, json_object_get(c, "segments"), name), "case %s", name);
        shoal_chat_segs_free(s);
        ncases++;
    }
    CHECK_EQ_INT(ncases, 10);
}

/* With the project's vocabulary: special segments are one id each, text never
 * produces a special id, and the ids decode to the concatenated segments. */
static void t_official_ids_tiny(void)
{
    shoal_tok *t = open_tiny();
    json_t *fx = fixture();
    CHECK(t && fx);
    if (!t || !fx)
        return;
    json_t *c;
    size_t i;
    json_array_foreach(json_object_get(fx, "cases"), i, c)
    {
        shoal_chat_opts o = case_opts(c);
        shoal_chat_segs *s;
        char err[512];
        CHECK(shoal_chat_render(json_object_get(c, "messages"), &o, &s, err, sizeof err) == 0);
        shoal_tok_ids ids = {0};
        CHECK(shoal_chat_encode_segs(t, s, &ids, err, sizeof err) == 0);
        size_t nspecial_segs = 0;
        shoal_chatjson_buf all = {0};
        for (size_t k = 0; k < shoal_chat_segs_count(s); k++) {
            shoal_chat_seg g = shoal_chat_segs_get(s, k);
            nspecial_segs += (size_t)g.special;
            shoal_chatjson_put(&all, g.text, g.len);
        }
        size_t nspecial_ids = 0;
        for (size_t k = 0; k < ids.n; k++)
            nspecial_ids += (size_t)shoal_tok_is_special(t, ids.v[k]);
        CHECK_EQ_INT(nspecial_ids, nspecial_segs);
        char *d = NULL;
        size_t dl = 0, dc = 0;
        shoal_tok_decode(t, ids.v, ids.n, &d, &dl, &dc, NULL, 0);
        CHECK(dl == all.n && !memcmp(d, all.p, dl));
        free(d);
        free(all.p);
        shoal_tok_ids_free(&ids);
        shoal_chat_segs_free(s);
    }
}

/* SPEC §5.5: the official encoder's prompt lengths with the real vocabulary. */
static void t_real_k3_counts(void)
{
    const char *dir = test_k3_tokenizer_dir();
    if (!dir)
        SKIP("real K3 vocabulary: no ../shared/k3/tiktoken.model beside the checkout; set "
             "SHOAL_K3_TOKENIZER_DIR to a directory with K3's tiktoken.model and tokenizer_config.json");
    shoal_tok *t;
    char err[512];
    CHECK_MSG(shoal_tok_open(&t, dir, NULL, err, sizeof err) == 0, "%s", err);
    static const struct {
        const char *name;
        size_t n;
    } want[] = {{"plain", 22}, {"thinking", 22}, {"literal_markers", 32}, {"attribute_escape", 32},
                {"unicode", 26}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        json_t *c = fixture_case(want[i].name);
        shoal_chat_opts o = case_opts(c);
        shoal_tok_ids ids = {0};
        CHECK(shoal_chat_encode(t, json_object_get(c, "messages"), &o, &ids, err, sizeof err) == 0);
        CHECK_MSG(ids.n == want[i].n, "%s: %zu tokens, want %zu", want[i].name, ids.n, want[i].n);
        shoal_tok_ids_free(&ids);
    }
    shoal_tok_close(t);
}

/* ------------------------------------------------- beyond the fixture -- */

static shoal_chat_segs *render(const char *messages_json, const shoal_chat_opts *o, int *rc, char *err,
                               size_t errlen)
{
    json_error_t je;
    json_t *m = json_loads(messages_json, 0, &je);
    if (!m) {
        fprintf(stderr, "  bad test JSON: %s\n", je.text);
        *rc = -1;
        return NULL;
    }
    shoal_chat_segs *s = NULL;
    *rc = shoal_chat_render(m, o, &s, err, errlen);
    json_decref(m);
    return s;
}

/* the rendered text with specials in brackets, for compact expectations */
static char *flat(const shoal_chat_segs *s)
{
    shoal_chatjson_buf b = {0};
    shoal_chatjson_put(&b, "", 0);
    for (size_t i = 0; i < shoal_chat_segs_count(s); i++) {
        shoal_chat_seg g = shoal_chat_segs_get(s, i);
        shoal_chatjson_put(&b, g.text, g.len);
        if (!g.special)
            shoal_chatjson_put(&b, "|", 1); /* text segment boundary */
    }
    return b.p;
}

static void expect_flat(const char *messages, shoal_chat_opts o, const char *want)
{
    int rc;
    char err[512] = "";
    shoal_chat_segs *s = render(messages, &o, &rc, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (!s)
        return;
    char *got = flat(s);
    CHECK_MSG(!strcmp(got, want), "\n   got: %s\n  want: %s", got, want);
    free(got);
    shoal_chat_segs_free(s);
}

static void expect_error(const char *messages, shoal_chat_opts o, int code, const char *needle)
{
    int rc;
    char err[512] = "";
    shoal_chat_segs *s = render(messages, &o, &rc, err, sizeof err);
    CHECK_MSG(rc == code, "rc %d (%s), want %d for %s", rc, err, code, needle);
    CHECK(s == NULL);
    CHECK_STR_CONTAINS(err, needle);
    shoal_chat_segs_free(s);
}

#define U "[{\"role\":\"user\",\"content\":\"Hi\"}]"
#define USER "<|open|>message| role|=\"|user|\"|<|sep|>Hi|<|close|>message|<|sep|><|end_of_msg|>"
#define GEN_THINK "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>think|<|sep|>"
#define GEN_RESP "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|>"
#define EFFORT(x)                                                                                   \
    "<|open|>message| role|=\"|system|\"| type|=\"|thinking-effort|\"|<|sep|>`thinking_effort` "   \
    "guides on how much to think in your thinking channel (not including the response channel), "  \
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "     \
    "with `thinking_effort=" x "`.|<|close|>message|<|sep|><|end_of_msg|>"

static void t_thinking_effort_rules(void)
{
    /* the encoder's rule: nothing by default, low/high/max, medium refused */
    expect_flat(U, (shoal_chat_opts){0}, USER GEN_THINK);
    expect_flat(U, (shoal_chat_opts){.thinking_effort = "high"}, EFFORT("high") USER GEN_THINK);
    expect_error(U, (shoal_chat_opts){.thinking_effort = "medium"}, SHOAL_EINVAL, "thinking_effort \"medium\"");
    /* thinking off: no effort message, no check */
    expect_flat(U, (shoal_chat_opts){.thinking_off = 1, .thinking_effort = "medium"}, USER GEN_RESP);
    /* the template's rule: max by default, medium accepted */
    expect_flat(U, (shoal_chat_opts){.effort_rule = SHOAL_CHAT_EFFORT_TEMPLATE}, EFFORT("max") USER GEN_THINK);
    expect_flat(U, (shoal_chat_opts){.effort_rule = SHOAL_CHAT_EFFORT_TEMPLATE, .thinking_effort = "medium"},
                EFFORT("medium") USER GEN_THINK);
    expect_error(U, (shoal_chat_opts){.effort_rule = SHOAL_CHAT_EFFORT_TEMPLATE, .thinking_effort = "huge"},
                 SHOAL_EINVAL, "low, medium, high, max");
}

static void t_choice_format_dynamic(void)
{
    json_t *none = json_string("none"), *autoc = json_string("auto");
    expect_flat(U, (shoal_chat_opts){.tool_choice = none, .no_generation_prompt = 1},
                USER "<|open|>message| role|=\"|system|\"| type|=\"|tool-choice|\"|<|sep|>The system is "
                     "invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next "
                     "message.|<|close|>message|<|sep|><|end_of_msg|>");
    expect_flat(U, (shoal_chat_opts){.tool_choice = autoc, .no_generation_prompt = 1}, USER);
    json_t *rf = json_loads("{\"type\":\"json_object\"}", 0, NULL);
    expect_flat(U, (shoal_chat_opts){.response_format = rf, .no_generation_prompt = 1},
                USER "<|open|>message| role|=\"|system|\"| type|=\"|response-format|\"|<|sep|>The system is "
                     "invoked with `response_format=json_object`.\nYour response must be raw JSON data "
                     "without markdown code blocks (```json) or any additional "
                     "formatting.|<|close|>message|<|sep|><|end_of_msg|>");
    json_decref(rf);
    rf = json_loads("{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":{\"type\":\"object\","
                    "\"properties\":{\"b\":{\"type\":\"number\"},\"a\":{\"type\":\"string\"}}}}}",
                    0, NULL);
    expect_flat(U, (shoal_chat_opts){.response_format = rf, .no_generation_prompt = 1},
                USER "<|open|>message| role|=\"|system|\"| type|=\"|response-format|\"|<|sep|>The system is "
                     "invoked with `response_format=json_schema`.\nYour response must be raw JSON data "
                     "without markdown code blocks (```json) or any additional formatting.\nThe JSON "
                     "data must match the following schema:\n```json\n{\"properties\":{\"a\":{\"type\":"
                     "\"string\"},\"b\":{\"type\":\"number\"}},\"type\":\"object\"}\n```|<|close|>message|"
                     "<|sep|><|end_of_msg|>");
    json_decref(rf);
    json_decref(none);
    json_decref(autoc);
    /* a system message with tools is the dynamic declaration */
    expect_flat("[{\"role\":\"system\",\"tools\":[{\"b\":1,\"a\":\"é\"}]}]", (shoal_chat_opts){.no_generation_prompt = 1},
                "<|open|>message| role|=\"|system|\"| type|=\"|tool-declare|\"|<|sep|>## New Tools "
                "Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to "
                "all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
                "[{\"a\":\"é\",\"b\":1}]\n```|<|close|>message|<|sep|><|end_of_msg|>");
}

static void t_assistant_history(void)
{
    /* thinking on: an empty think element on every assistant turn, blank
     * reasoning not written; "reasoning" is the fallback field; name attributes */
    expect_flat("[{\"role\":\"assistant\",\"name\":\"bot\",\"content\":\"A\",\"reasoning_content\":\"  \"},"
                "{\"role\":\"assistant\",\"content\":[{\"type\":\"text\",\"text\":\"B\"},{\"type\":\"text\",\"text\":\"C\"}],"
                "\"reasoning_content\":\"\",\"reasoning\":\"R\"}]",
                (shoal_chat_opts){.no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"| name|=\"|bot|\"|<|sep|><|open|>think|<|sep|><|close|>think|"
                "<|sep|><|open|>response|<|sep|>A|<|close|>response|<|sep|><|close|>message|<|sep|><|end_of_msg|>"
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>think|<|sep|>R|<|close|>think|<|sep|>"
                "<|open|>response|<|sep|>B|C|<|close|>response|<|sep|><|close|>message|<|sep|><|end_of_msg|>");
    /* thinking off: no think element at all */
    expect_flat("[{\"role\":\"assistant\",\"content\":\"A\",\"reasoning_content\":\"R\"}]",
                (shoal_chat_opts){.thinking_off = 1, .no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|>A|<|close|>response|"
                "<|sep|><|close|>message|<|sep|><|end_of_msg|>");
}

/* Partial mode: the last assistant message with "partial": true stays open
 * (no closing of its response, no end of message, no generation prompt);
 * the tool-choice message comes before it; tool calls on it are refused. */
static void t_partial(void)
{
    json_t *none = json_string("none");
    expect_flat("[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Once\",\"partial\":true}]",
                (shoal_chat_opts){0},
                USER "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>think|<|sep|><|close|>think|<|sep|>"
                     "<|open|>response|<|sep|>Once|");
    expect_flat("[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Once\",\"partial\":true}]",
                (shoal_chat_opts){.thinking_off = 1, .tool_choice = none},
                USER "<|open|>message| role|=\"|system|\"| type|=\"|tool-choice|\"|<|sep|>The system is invoked with "
                     "`tool_choice=none`.\nYou MUST NOT call any tools in the next message.|<|close|>message|<|sep|>"
                     "<|end_of_msg|>" GEN_RESP "Once|");
    /* "partial": false, or on an earlier message: rendered as usual */
    expect_flat("[{\"role\":\"assistant\",\"content\":\"A\",\"partial\":true},{\"role\":\"user\",\"content\":\"Hi\"}]",
                (shoal_chat_opts){.thinking_off = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|>A|<|close|>response|"
                "<|sep|><|close|>message|<|sep|><|end_of_msg|>" USER GEN_RESP);
    expect_error("[{\"role\":\"assistant\",\"content\":null,\"partial\":true,\"tool_calls\":[{\"id\":\"c\","
                 "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}]",
                 (shoal_chat_opts){0}, SHOAL_EINVAL, "partial");
    json_decref(none);
}

#define CALL_HEAD(name, i)                                                                         \
    "<|open|>call| tool|=\"|" name "|\"| index|=\"|" i "|\"|<|sep|>"
#define ARG(k, t, v)                                                                               \
    "<|open|>argument| key|=\"|" k "|\"| type|=\"|" t "|\"|<|sep|>" v "<|close|>argument|<|sep|>"

static void t_tool_arguments(void)
{
    /* Python json.loads semantics: the last duplicate wins at the first
     * position, number spelling kept, nested containers compact, strings raw,
     * escapes decoded (lone surrogate -> U+FFFD), NaN accepted */
    expect_flat("[{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":[{\"id\":\"x\",\"function\":{\"name\":"
                "\"f\",\"arguments\":\"{ \\\"a\\\" : 1.50 , \\\"b\\\": {\\\"y\\\": [ 1, -0.0e+5 ], \\\"x\\\":"
                "\\\"q\\\\\\\"\\\\u00e9\\\"}, \\\"a\\\": \\\"\\\\ud800s\\\\n\\\", \\\"n\\\": NaN, \\\"&\\\": false}\"}}]}]",
                (shoal_chat_opts){.thinking_off = 1, .no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|><|close|>response|<|sep|>"
                "<|open|>tools|<|sep|>" CALL_HEAD("f", "1") ARG("a", "string", "\xEF\xBF\xBDs\n|")
                    ARG("b", "object", "{\"y\":[1,-0.0e+5],\"x\":\"q\\\"é\"}|") ARG("n", "number", "NaN|")
                        ARG("&amp;", "boolean", "false|") "<|close|>call|<|sep|><|close|>tools|<|sep|>"
                "<|close|>message|<|sep|><|end_of_msg|>");
    /* an arguments object (not a string): Python-style dump of each value;
     * blank string arguments: no arguments */
    expect_flat("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"g\",\"arguments\":{\"r\":100.0,"
                "\"s\":1e16,\"t\":1.5e-05,\"u\":[1,{\"k\":null}],\"v\":\"w\"}}},{\"name\":\"h\",\"arguments\":\" \"}]}]",
                (shoal_chat_opts){.thinking_off = 1, .no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|><|close|>response|<|sep|>"
                "<|open|>tools|<|sep|>" CALL_HEAD("g", "1") ARG("r", "number", "100.0|") ARG("s", "number", "1e+16|")
                    ARG("t", "number", "1.5e-05|") ARG("u", "array", "[1,{\"k\":null}]|") ARG("v", "string", "w|")
                        "<|close|>call|<|sep|>" CALL_HEAD("h", "2") "<|close|>call|<|sep|><|close|>tools|<|sep|>"
                "<|close|>message|<|sep|><|end_of_msg|>");
}

static void t_tool_results(void)
{
    /* an unresolvable run keeps its order; names fall back to the call at the
     * same position; index counts tool messages since the assistant */
    expect_flat("[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":\"a\",\"function\":{\"name\":\"f\"}},"
                "{\"id\":\"b\",\"function\":{\"name\":\"g\"}}]},"
                "{\"role\":\"tool\",\"tool_call_id\":\"zz\",\"content\":\"1\"},{\"role\":\"tool\",\"tool_call_id\":\"a\",\"content\":\"2\"}]",
                (shoal_chat_opts){.thinking_off = 1, .no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|><|close|>response|<|sep|>"
                "<|open|>tools|<|sep|>" CALL_HEAD("f", "1") "<|close|>call|<|sep|>" CALL_HEAD("g", "2")
                "<|close|>call|<|sep|><|close|>tools|<|sep|><|close|>message|<|sep|><|end_of_msg|>"
                "<|open|>message| role|=\"|tool|\"| tool|=\"|f|\"| index|=\"|1|\"|<|sep|>1|<|close|>message|<|sep|><|end_of_msg|>"
                "<|open|>message| role|=\"|tool|\"| tool|=\"|g|\"| index|=\"|2|\"|<|sep|>2|<|close|>message|<|sep|><|end_of_msg|>");
    /* integer ids match their decimal text */
    expect_flat("[{\"role\":\"assistant\",\"tool_calls\":[{\"id\":7,\"function\":{\"name\":\"f\"}},{\"id\":\"8\",\"function\":{\"name\":\"g\"}}]},"
                "{\"role\":\"tool\",\"tool_call_id\":8,\"content\":\"x\"},{\"role\":\"tool\",\"tool_call_id\":\"7\",\"content\":\"y\"}]",
                (shoal_chat_opts){.thinking_off = 1, .no_generation_prompt = 1},
                "<|open|>message| role|=\"|assistant|\"|<|sep|><|open|>response|<|sep|><|close|>response|<|sep|>"
                "<|open|>tools|<|sep|>" CALL_HEAD("f", "1") "<|close|>call|<|sep|>" CALL_HEAD("g", "2")
                "<|close|>call|<|sep|><|close|>tools|<|sep|><|close|>message|<|sep|><|end_of_msg|>"
                "<|open|>message| role|=\"|tool|\"| tool|=\"|f|\"| index|=\"|1|\"|<|sep|>y|<|close|>message|<|sep|><|end_of_msg|>"
                "<|open|>message| role|=\"|tool|\"| tool|=\"|g|\"| index|=\"|2|\"|<|sep|>x|<|close|>message|<|sep|><|end_of_msg|>");
}

/* Issue 30 item 1: past 16 members an object's repeated keys are found
 * through a map; json.loads' rule must hold either way (a repeated key keeps
 * its first position and takes the last value), and so must tool results
 * matched to thousands of calls (the first call with an id wins). */
static void t_many_keys_and_calls(void)
{
    char text[4096];
    size_t o = 0;
    o += (size_t)snprintf(text + o, sizeof text - o, "{");
    for (int i = 0; i < 40; i++)
        o += (size_t)snprintf(text + o, sizeof text - o, "%s\"k%d\":%d", i ? "," : "", i, i);
    /* repeats after the map exists, of keys before and after its creation */
    snprintf(text + o, sizeof text - o, ",\"k3\":\"z\",\"k30\":[1],\"k3\":\"last\"}");
    shoal_chatjson_members m;
    char err[128];
    CHECK_EQ_INT(shoal_chatjson_parse_object(text, strlen(text), &m, NULL, err, sizeof err), 0);
    CHECK_EQ_INT((int)m.n, 40);
    for (size_t i = 0; i < m.n && i < 40; i++) {
        char k[16];
        snprintf(k, sizeof k, "k%zu", i);
        CHECK_MSG(!strcmp(m.m[i].key, k), "position %zu: %s", i, m.m[i].key);
    }
    CHECK(m.n > 30 && !strcmp(m.m[3].text, "last") && m.m[3].type == SHOAL_CHATJSON_STRING);
    CHECK(m.n > 30 && !strcmp(m.m[30].text, "[1]") && m.m[30].type == SHOAL_CHATJSON_ARRAY);
    CHECK(m.n > 31 && !strcmp(m.m[31].text, "31"));
    shoal_chatjson_members_free(&m);

    /* 3000 calls, the results in reverse, one id given twice (the first call
     * with it names the result), an id 300 bytes long (compared in full) */
    int n = 3000;
    json_t *calls = json_array(), *msgs = json_array();
    char longa[301], longb[301];
    memset(longa, 'q', 300);
    memcpy(longb, longa, 300);
    longa[300] = longb[300] = 0;
    longb[299] = 'r';
    for (int i = 0; i < n; i++) {
        char id[32], fn[32];
        snprintf(id, sizeof id, "c%d", i == 7 ? 5 : i); /* c5 twice: at 5 and at 7 */
        snprintf(fn, sizeof fn, "f%d", i);
        json_array_append_new(calls, json_pack("{s:s,s:{s:s}}", "id", i == 1 ? longa : i == 2 ? longb : id,
                                               "function", "name", fn));
    }
    json_array_append_new(msgs, json_pack("{s:s,s:o}", "role", "assistant", "tool_calls", calls));
    for (int i = n - 1; i >= 0; i--) {
        char id[32];
        snprintf(id, sizeof id, "c%d", i);
        json_array_append_new(msgs, json_pack("{s:s,s:s,s:s}", "role", "tool", "tool_call_id",
                                              i == 1 ? longa : i == 2 ? longb : i == 7 ? "c5" : id, "content", "r"));
    }
    shoal_chat_segs *sg;
    shoal_chat_opts co = {.thinking_off = 1, .no_generation_prompt = 1};
    CHECK_EQ_INT(shoal_chat_render(msgs, &co, &sg, err, sizeof err), 0);
    /* the tool messages' tool="…" names in order: sorted by call position, the
     * two results naming c5 both take f5 (the first call with that id) */
    int k = 0, ok = 1;
    for (size_t i = 0; sg && i + 2 < shoal_chat_segs_count(sg); i++) {
        shoal_chat_seg a = shoal_chat_segs_get(sg, i), b = shoal_chat_segs_get(sg, i + 2);
        /* a tool message's tool="NAME" (role="tool" just before it), not a call's */
        if (i < 2 || strcmp(a.text, " tool") || strcmp(shoal_chat_segs_get(sg, i - 2).text, "tool"))
            continue;
        /* sorted by the position of the call each names (ties: their order in
         * the run): f0..f5, then the second result naming c5 (its first call,
         * at 5) as f5, then f6, and no result for the call at 7 */
        int want = k <= 5 ? k : k == 6 ? 5 : k == 7 ? 6 : k;
        char fn[32];
        snprintf(fn, sizeof fn, "f%d", want);
        if (strcmp(b.text, fn)) {
            CHECK_MSG(0, "result %d is named %s, want %s", k, b.text, fn);
            ok = 0;
            break;
        }
        k++;
    }
    CHECK(ok && k == n);
    shoal_chat_segs_free(sg);
    json_decref(msgs);
}

static void t_errors(void)
{
    shoal_chat_opts o = {0};
    expect_error("{}", o, SHOAL_EINVAL, "messages: must be an array");
    expect_error("[1]", o, SHOAL_EINVAL, "messages[0]: must be an object");
    expect_error("[{\"content\":\"x\"}]", o, SHOAL_EINVAL, "messages[0].role");
    expect_error("[{\"role\":\"developer\",\"content\":\"x\"}]", o, SHOAL_EINVAL, "unknown role \"developer\"");
    expect_error("[{\"role\":\"user\",\"content\":5}]", o, SHOAL_EINVAL, "messages[0].content");
    expect_error("[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]", o,
                 SHOAL_EUNSUPPORTED, "messages[0].content[0]: image parts");
    expect_error("[{\"role\":\"user\",\"name\":3,\"content\":\"x\"}]", o, SHOAL_EINVAL, "messages[0].name");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"arguments\":\"{}\"}}]}]", o,
                 SHOAL_EINVAL, "messages[0].tool_calls[0].function.name");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]",
                 o, SHOAL_EINVAL, "messages[0].tool_calls[0].function.arguments");
    expect_error("[{\"role\":\"assistant\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":3}}]}]", o,
                 SHOAL_EINVAL, "function.arguments");
    expect_error("[{\"role\":\"tool\",\"content\":\"x\"}]", o, SHOAL_EINVAL, "resolvable tool name");
    json_t *tools = json_string("x");
    expect_error("[]", (shoal_chat_opts){.tools = tools}, SHOAL_EINVAL, "tools: must be an array");
    json_decref(tools);
}

static void t_opts_from_request(void)
{
    json_t *body = json_loads("{\"messages\":[],\"tools\":[{\"type\":\"function\"}],\"tool_choice\":\"required\","
                              "\"chat_template_kwargs\":{\"thinking\":false},\"reasoning_effort\":\"low\"}",
                              0, NULL);
    shoal_chat_opts o = {0};
    char err[256];
    CHECK(shoal_chat_opts_from_request(body, &o, err, sizeof err) == 0);
    CHECK(o.thinking_off == 1);
    CHECK(o.tools == json_object_get(body, "tools"));
    CHECK(!strcmp(json_string_value(o.tool_choice), "required"));
    CHECK(o.thinking_effort && !strcmp(o.thinking_effort, "low"));
    json_decref(body);
    body = json_loads("{\"chat_template_kwargs\":{\"thinking\":\"yes\"}}", 0, NULL);
    CHECK(shoal_chat_opts_from_request(body, &o, err, sizeof err) == SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "chat_template_kwargs.thinking");
    json_decref(body);
}

int main(void)
{
    test_binary = "test_chat";
    RUN(t_official_segments);
    RUN(t_official_ids_tiny);
    RUN(t_real_k3_counts);
    RUN(t_thinking_effort_rules);
    RUN(t_choice_format_dynamic);
    RUN(t_assistant_history);
    RUN(t_partial);
    RUN(t_tool_arguments);
    RUN(t_tool_results);
    RUN(t_many_keys_and_calls);
    RUN(t_errors);
    RUN(t_opts_from_request);
    shoal_tok_close(tiny);
    json_decref(fixture());
    return test_finish();
}
