/* API request validation: every refusal names the field and carries the
 * status OpenAI uses; accepted requests are normalised as documented in
 * docs/API.md; the memo key is a function of the generation-relevant fields
 * only (key order, `stream` and `user` do not change it; a seed does). */
#include "coordinator/api/api.h"
#include "tests/unit/test.h"

static const shoal_api_limits lim = {.model_name = "tiny", .vocab = 4096, .max_context = 512};

static int parse(shoal_gen_kind k, const char *body, shoal_api_req *q, shoal_api_error *e)
{
    return shoal_api_parse(k, body, strlen(body), &lim, q, e);
}

/* Expect a refusal with this status and param; returns the error for more checks. */
static shoal_api_error refused(shoal_gen_kind k, const char *body, int status, const char *param)
{
    shoal_api_req q;
    shoal_api_error e;
    int rc = parse(k, body, &q, &e);
    CHECK_MSG(rc == -1, "accepted: %s", body);
    if (rc == 0) {
        shoal_api_req_free(&q);
        return e;
    }
    CHECK_MSG(e.status == status, "%s: status %d, want %d (%s)", body, e.status, status, e.message);
    CHECK_MSG(!strcmp(e.param, param), "%s: param '%s', want '%s' (%s)", body, e.param, param, e.message);
    CHECK(e.message[0] != '\0');
    CHECK(!strcmp(e.type, "invalid_request_error"));
    return e;
}

#define CHAT(x) "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" x "}"
#define CMPL(x) "{\"model\":\"tiny\",\"prompt\":\"hi\"" x "}"

static void t_chat_refusals(void)
{
    shoal_gen_kind C = SHOAL_GEN_CHAT;
    shoal_api_error e = refused(C, "{\"model\":", 400, "");
    CHECK(!strcmp(e.code, "invalid_json"));
    refused(C, "[1,2]", 400, "body");
    refused(C, "{\"model\":\"tiny\",\"model\":\"tiny\",\"messages\":[]}", 400, ""); /* duplicate key */
    refused(C, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 400, "model");
    e = refused(C, "{\"model\":\"gpt-4\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", 400, "model");
    CHECK(!strcmp(e.code, "model_not_found"));
    refused(C, "{\"model\":7,\"messages\":[]}", 400, "model");
    refused(C, "{\"model\":\"tiny\"}", 400, "messages");
    refused(C, "{\"model\":\"tiny\",\"messages\":[]}", 400, "messages");
    refused(C, "{\"model\":\"tiny\",\"messages\":{}}", 400, "messages");
    refused(C, "{\"model\":\"tiny\",\"messages\":[3]}", 400, "messages[0]");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"content\":\"x\"}]}", 400, "messages[0].role");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"wizard\",\"content\":\"x\"}]}", 400, "messages[0].role");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\"}]}", 400, "messages[0].content");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, "messages[0].content");
    refused(C,
            "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\","
            "\"image_url\":{\"url\":\"x\"}}]}]}",
            400, "messages[0].content[0].type");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"tool\",\"content\":\"x\"}]}", 400,
            "messages[0].tool_call_id");
    refused(C,
            "{\"model\":\"tiny\",\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":"
            "\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{}}}]}]}",
            400, "messages[0].tool_calls[0].function.arguments");
    e = refused(C, CHAT(",\"n\":9"), 400, "n"); /* over the bound, SHOAL_API_MAX_N */
    CHECK(strstr(e.message, "'n'") != NULL);
    refused(C, CHAT(",\"n\":\"1\""), 400, "n");
    refused(C, CHAT(",\"temperature\":3"), 400, "temperature");
    refused(C, CHAT(",\"temperature\":\"hot\""), 400, "temperature");
    refused(C, CHAT(",\"top_p\":0"), 400, "top_p");
    refused(C, CHAT(",\"top_p\":1.5"), 400, "top_p");
    refused(C, CHAT(",\"seed\":1.5"), 400, "seed");
    refused(C, CHAT(",\"max_tokens\":0"), 400, "max_tokens");
    refused(C, CHAT(",\"max_tokens\":100000"), 400, "max_tokens");
    refused(C, CHAT(",\"max_completion_tokens\":-1"), 400, "max_completion_tokens");
    refused(C, CHAT(",\"max_tokens\":5,\"max_completion_tokens\":6"), 400, "max_tokens");
    refused(C, CHAT(",\"stream\":\"yes\""), 400, "stream");
    refused(C, CHAT(",\"stream_options\":{\"include_usage\":true}"), 400, "stream_options");
    refused(C, CHAT(",\"stream\":true,\"stream_options\":{\"include_usage\":1}"), 400,
            "stream_options.include_usage");
    refused(C, CHAT(",\"stop\":5"), 400, "stop");
    refused(C, CHAT(",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]"), 400, "stop");
    refused(C, CHAT(",\"stop\":[\"a\",\"\"]"), 400, "stop[1]");
    refused(C, CHAT(",\"tools\":{}"), 400, "tools");
    refused(C, CHAT(",\"tools\":[{\"type\":\"retrieval\"}]"), 400, "tools[0].type");
    refused(C, CHAT(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"bad name\"}}]"), 400,
            "tools[0].function.name");
    refused(C,
            CHAT(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":[]}}]"),
            400, "tools[0].function.parameters");
    refused(C,
            CHAT(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}},"
                 "{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]"),
            400, "tools[1].function.name");
    refused(C, CHAT(",\"tool_choice\":\"required\""), 400, "tool_choice");
    refused(C, CHAT(",\"tool_choice\":\"sometimes\""), 400, "tool_choice");
    refused(C,
            CHAT(",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                 "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"g\"}}"),
            400, "tool_choice.function.name");
    refused(C, CHAT(",\"reasoning_effort\":\"extreme\""), 400, "reasoning_effort");
    refused(C, CHAT(",\"thinking\":{\"type\":\"maybe\"}"), 400, "thinking.type");
    refused(C, CHAT(",\"thinking\":{\"type\":\"enabled\"},\"reasoning_effort\":\"none\""), 400, "thinking");
    refused(C, CHAT(",\"logprobs\":1"), 400, "logprobs");
    refused(C, CHAT(",\"logprobs\":true,\"top_logprobs\":21"), 400, "top_logprobs");
    refused(C, CHAT(",\"top_logprobs\":2"), 400, "top_logprobs"); /* without logprobs: true */
    refused(C, CHAT(",\"presence_penalty\":2.5"), 400, "presence_penalty");
    refused(C, CHAT(",\"frequency_penalty\":-3"), 400, "frequency_penalty");
    refused(C, CHAT(",\"repetition_penalty\":0"), 400, "repetition_penalty");
    refused(C, CHAT(",\"min_p\":1.5"), 400, "min_p");
    refused(C, CHAT(",\"logit_bias\":{\"5\":101}"), 400, "logit_bias.5");
    refused(C, CHAT(",\"logit_bias\":{\"x\":1}"), 400, "logit_bias.x");
    refused(C, CHAT(",\"logit_bias\":{\"4096\":1}"), 400, "logit_bias.4096"); /* outside the vocabulary */
    refused(C, CHAT(",\"chat_template_kwargs\":{\"thinking\":\"no\"}"), 400, "chat_template_kwargs.thinking");
    refused(C, CHAT(",\"thinking_effort\":\"extreme\""), 400, "thinking_effort");
    refused(C, CHAT(",\"chat_template_kwargs\":{\"thinking\":true},\"reasoning_effort\":\"none\""), 400,
            "chat_template_kwargs.thinking");
    refused(C,
            "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"partial\":true}]}", 400,
            "messages[0].partial");
    refused(C,
            "{\"model\":\"tiny\",\"messages\":[{\"role\":\"assistant\",\"content\":\"a\",\"partial\":true},"
            "{\"role\":\"user\",\"content\":\"hi\"}]}",
            400, "messages[0].partial");
    /* structured output (issue 36): enforced, so strict is accepted; a keyword
     * the compiler does not implement is a 400 naming it */
    e = refused(C, CHAT(",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"strict\":true,"
                        "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":1}}}}}"),
                400, "response_format.json_schema.schema");
    CHECK_STR_CONTAINS(e.message, "/properties/a/minimum");
    refused(C, CHAT(",\"guided_regex\":\"(a\""), 400, "guided_regex");
    refused(C, CHAT(",\"guided_choice\":[]"), 400, "guided_choice");
    refused(C, CHAT(",\"guided_regex\":\"a\",\"guided_choice\":[\"a\"]"), 400, "guided_choice");
    refused(C, CHAT(",\"response_format\":{\"type\":\"yaml\"}"), 400, "response_format.type");
    refused(C, CHAT(",\"modalities\":[\"audio\"]"), 400, "modalities");
    /* the field policy: an output-changing field that is not implemented is refused naming it */
    e = refused(C, CHAT(",\"structured_outputs\":{\"json\":{}}"), 400, "structured_outputs");
    CHECK(!strcmp(e.code, "unsupported_parameter"));
    refused(C, CHAT(",\"grammar\":\"root ::= undefined-rule\""), 400, "grammar"); /* GBNF: an undefined rule */
    refused(C, CHAT(",\"ignore_eos\":true"), 400, "ignore_eos");
    refused(C, CHAT(",\"stream\":true,\"stream_options\":{\"include_usage\":true},\"min_tokens\":3"), 400, "min_tokens");
    refused(C, "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"function_call\":{\"name\":\"f\"}}]}",
            400, "messages[].function_call");
    refused(C, CHAT(",\"user\":5"), 400, "user");
}

static void t_completion_refusals(void)
{
    shoal_gen_kind K = SHOAL_GEN_COMPLETION;
    refused(K, "{\"model\":\"tiny\"}", 400, "prompt");
    refused(K, "{\"model\":\"tiny\",\"prompt\":\"\"}", 400, "prompt");
    refused(K, "{\"model\":\"tiny\",\"prompt\":[]}", 400, "prompt");
    refused(K, "{\"model\":\"tiny\",\"prompt\":[\"a\",\"b\"]}", 400, "prompt");
    refused(K, "{\"model\":\"tiny\",\"prompt\":[1,2,4096]}", 400, "prompt[2]");
    refused(K, "{\"model\":\"tiny\",\"prompt\":[1,-2]}", 400, "prompt[1]");
    refused(K, "{\"model\":\"tiny\",\"prompt\":[1,\"x\"]}", 400, "prompt[1]");
    refused(K, "{\"model\":\"tiny\",\"prompt\":{}}", 400, "prompt");
    refused(K, CMPL(",\"echo\":true"), 400, "echo");
    refused(K, CMPL(",\"best_of\":2"), 400, "best_of");
    refused(K, CMPL(",\"suffix\":\"x\""), 400, "suffix");
    refused(K, CMPL(",\"logprobs\":21"), 400, "logprobs");
    refused(K, CMPL(",\"logprobs\":true"), 400, "logprobs");
    refused(K, CMPL(",\"n\":9"), 400, "n");
    refused(K, CMPL(",\"n\":2,\"best_of\":3"), 400, "best_of");
    /* a prompt of ids longer than the context is refused before queueing */
    char big[8192] = "{\"model\":\"tiny\",\"prompt\":[";
    for (int i = 0; i < 600; i++)
        strcat(big, i ? ",1" : "1");
    strcat(big, "]}");
    shoal_api_error e = refused(K, big, 400, "prompt");
    CHECK(!strcmp(e.code, "context_length_exceeded"));
}

static void t_accepted_and_normalised(void)
{
    shoal_api_req q;
    shoal_api_error e;
    int rc = parse(SHOAL_GEN_CHAT,
                   "{\"model\":\"tiny\",\"messages\":[{\"role\":\"developer\",\"content\":\"be brief\"},"
                   "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\","
                   "\"text\":\"b\"}],\"name\":\"ann\"},{\"role\":\"assistant\",\"content\":null,"
                   "\"reasoning_content\":\"r\",\"tool_calls\":[{\"id\":\"c1\",\"type\":\"function\",\"function\":"
                   "{\"name\":\"f\",\"arguments\":\"{}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\","
                   "\"content\":\"42\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\","
                   "\"parameters\":{\"type\":\"object\"},\"x-extra\":1}}],\"stream\":true,\"stream_options\":"
                   "{\"include_usage\":true},\"max_completion_tokens\":7,\"stop\":\"END\",\"seed\":-3,"
                   "\"reasoning_effort\":\"high\",\"user\":\"u1\",\"store\":false,\"metadata\":{}}",
                   &q, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    if (rc)
        return;
    CHECK_EQ_INT(q.stream, 1);
    CHECK_EQ_INT(q.include_usage, 1);
    CHECK_EQ_INT(q.gen.max_tokens, 7);
    CHECK_EQ_INT(q.gen.nstop, 1);
    CHECK(!strcmp(q.gen.stop[0], "END"));
    CHECK(q.gen.seed == (uint64_t)(int64_t)-3);
    CHECK_EQ_INT(q.gen.thinking, 1);
    CHECK(!strcmp(q.gen.effort, "high"));
    CHECK(!strcmp(q.user, "u1"));
    CHECK(q.memo_key != NULL); /* a seed makes it deterministic */
    json_t *m = q.gen.messages;
    CHECK_EQ_INT(json_array_size(m), 4);
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(m, 0), "role")), "system"));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(m, 1), "content")), "a\nb"));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(m, 1), "name")), "ann"));
    CHECK(json_is_null(json_object_get(json_array_get(m, 2), "content")));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(m, 2), "reasoning_content")), "r"));
    CHECK(!strcmp(json_string_value(json_object_get(json_array_get(m, 3), "tool_call_id")), "c1"));
    json_t *fn = json_object_get(json_array_get(q.gen.tools, 0), "function");
    CHECK(json_object_get(fn, "x-extra") == NULL); /* only documented keys reach the encoder */
    CHECK(json_object_get(fn, "parameters") != NULL);
    shoal_api_req_free(&q);

    /* defaults: chat -> thinking on, temperature 1, top_p 1, no max_tokens, random seed, no memo */
    rc = parse(SHOAL_GEN_CHAT, CHAT(""), &q, &e);
    CHECK(rc == 0);
    CHECK_EQ_INT(q.gen.thinking, 1);
    CHECK_NEAR(q.gen.temperature, 1.0, 0);
    CHECK_NEAR(q.gen.top_p, 1.0, 0);
    CHECK_EQ_INT(q.gen.max_tokens, 0);
    CHECK(q.memo_key == NULL);
    shoal_api_req_free(&q);
    /* completions: max_tokens defaults to 16 (OpenAI's default) */
    rc = parse(SHOAL_GEN_COMPLETION, CMPL(""), &q, &e);
    CHECK(rc == 0);
    CHECK_EQ_INT(q.gen.max_tokens, 16);
    CHECK(q.gen.prompt && !strcmp(q.gen.prompt, "hi"));
    shoal_api_req_free(&q);
    rc = parse(SHOAL_GEN_COMPLETION, "{\"model\":\"tiny\",\"prompt\":[[5,6,7]],\"temperature\":0}", &q, &e);
    CHECK(rc == 0);
    CHECK_EQ_INT(q.gen.n_prompt_ids, 3);
    CHECK_EQ_INT(q.gen.prompt_ids[2], 7);
    CHECK(q.memo_key != NULL); /* greedy */
    shoal_api_req_free(&q);
    /* thinking off, both switches */
    rc = parse(SHOAL_GEN_CHAT, CHAT(",\"reasoning_effort\":\"none\""), &q, &e);
    CHECK(rc == 0 && q.gen.thinking == 0 && q.gen.effort[0] == 0);
    shoal_api_req_free(&q);
    rc = parse(SHOAL_GEN_CHAT, CHAT(",\"thinking\":{\"type\":\"disabled\"},\"reasoning_effort\":\"high\""), &q,
               &e);
    CHECK(rc == 0 && q.gen.thinking == 0 && q.gen.effort[0] == 0);
    shoal_api_req_free(&q);
    rc = parse(SHOAL_GEN_CHAT, CHAT(",\"reasoning_effort\":\"medium\""), &q, &e);
    CHECK(rc == 0 && q.gen.thinking == 1 && q.gen.effort[0] == 0); /* K3's default effort */
    shoal_api_req_free(&q);
}

static char *key_of(shoal_gen_kind k, const char *body)
{
    shoal_api_req q;
    shoal_api_error e;
    if (parse(k, body, &q, &e))
        return NULL;
    char *key = q.memo_key ? strdup(q.memo_key) : NULL;
    shoal_api_req_free(&q);
    return key;
}

/* The field policy (api.h): ignored fields are listed once, with their path,
 * and marked known or not; neutral values of refused fields are ignored. */
static void t_field_policy(void)
{
    shoal_api_req q;
    shoal_api_error e;
    int rc = parse(SHOAL_GEN_CHAT,
                   "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                   "\"text\":\"hi\",\"cache_control\":{}}],\"cache_control\":{}},{\"role\":\"user\",\"content\":"
                   "\"x\",\"cache_control\":{}}],\"store\":true,\"frobnicate\":1,\"ignore_eos\":false,"
                   "\"typical_p\":1.0,\"stream\":true,\"stream_options\":{\"include_usage\":true,\"zz\":1},"
                   "\"chat_template_kwargs\":{\"thinking\":false,\"foo\":1},\"n\":3,\"logprobs\":true,"
                   "\"top_logprobs\":4,\"presence_penalty\":0.5,\"frequency_penalty\":-0.25,\"repetition_penalty\":1.2,"
                   "\"min_p\":0.1,\"top_k\":-1,\"logit_bias\":{\"5\":10,\"7\":-100}}",
                   &q, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    if (rc)
        return;
    char list[512];
    shoal_api_ignored_list(&q.ignored, list, sizeof list);
    CHECK_MSG(!strcmp(list, "store,frobnicate,ignore_eos,typical_p,stream_options.zz,messages[].cache_control,"
                            "messages[].content[].cache_control,chat_template_kwargs.foo"),
              "%s", list);
    CHECK_EQ_INT(q.ignored.known[0], 1); /* store */
    CHECK_EQ_INT(q.ignored.known[1], 0); /* frobnicate: no known vocabulary */
    CHECK_EQ_INT(q.ignored.known[2], 1); /* ignore_eos: neutral value */
    CHECK_EQ_INT(q.n, 3);
    CHECK_EQ_INT(q.gen.thinking, 0);
    CHECK_EQ_INT(q.gen.logprobs, 1);
    CHECK_EQ_INT(q.gen.top_logprobs, 4);
    CHECK_NEAR(q.gen.presence_penalty, 0.5, 0);
    CHECK_NEAR(q.gen.frequency_penalty, -0.25, 0);
    CHECK_NEAR(q.gen.repetition_penalty, 1.2, 1e-7);
    CHECK_NEAR(q.gen.min_p, 0.1, 1e-7);
    CHECK_EQ_INT(q.gen.top_k, 0);
    CHECK_EQ_INT(q.gen.nbias, 2);
    CHECK(q.memo_key == NULL); /* n > 1: no memo */
    shoal_api_req_free(&q);
    /* K3's switches: chat_template_kwargs and thinking_effort, later wins */
    rc = parse(SHOAL_GEN_CHAT, CHAT(",\"thinking_effort\":\"high\""), &q, &e);
    CHECK(rc == 0 && q.gen.thinking == 1 && !strcmp(q.gen.effort, "high"));
    shoal_api_req_free(&q);
    rc = parse(SHOAL_GEN_CHAT, CHAT(",\"reasoning_effort\":\"low\",\"chat_template_kwargs\":{\"thinking_effort\":\"max\"}"),
               &q, &e);
    CHECK(rc == 0 && q.gen.thinking == 1 && !strcmp(q.gen.effort, "max"));
    shoal_api_req_free(&q);
    /* partial mode: the flag reaches the renderer on the last message */
    rc = parse(SHOAL_GEN_CHAT,
               "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},{\"role\":\"assistant\","
               "\"content\":\"Once\",\"partial\":true}]}",
               &q, &e);
    CHECK_MSG(rc == 0, "%s", e.message);
    CHECK_EQ_INT(q.gen.partial, 1);
    CHECK(json_is_true(json_object_get(json_array_get(q.gen.messages, 1), "partial")));
    shoal_api_req_free(&q);
    /* completions: logprobs is an integer */
    rc = parse(SHOAL_GEN_COMPLETION, CMPL(",\"logprobs\":0,\"n\":2,\"best_of\":2"), &q, &e);
    CHECK(rc == 0 && q.gen.logprobs == 1 && q.gen.top_logprobs == 0 && q.n == 2);
    shoal_api_req_free(&q);
    /* more ignored names than the list holds: counted, the header says how many more */
    char big[2048] = "{\"model\":\"tiny\",\"prompt\":\"hi\"";
    for (int i = 0; i < 20; i++)
        snprintf(big + strlen(big), sizeof big - strlen(big), ",\"x%d\":1", i);
    strcat(big, "}");
    rc = parse(SHOAL_GEN_COMPLETION, big, &q, &e);
    CHECK(rc == 0 && q.ignored.n == SHOAL_API_MAX_IGNORED && q.ignored.dropped == 4);
    shoal_api_ignored_list(&q.ignored, list, sizeof list);
    CHECK_MSG(strstr(list, ",+4 more") != NULL, "%s", list);
    shoal_api_req_free(&q);
}

static void t_memo_key(void)
{
    char *a = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0,\"max_tokens\":5"));
    char *b = key_of(SHOAL_GEN_CHAT, "{\"max_tokens\":5,\"temperature\":0,\"stream\":true,\"user\":\"x\","
                                     "\"messages\":[{\"content\":\"hi\",\"role\":\"user\"}],\"model\":\"tiny\"}");
    char *c = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0,\"max_tokens\":6"));
    char *d = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0.7,\"seed\":1,\"max_tokens\":5"));
    char *e = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0.7,\"seed\":2,\"max_tokens\":5"));
    char *f = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0.7,\"max_tokens\":5"));
    char *g = key_of(SHOAL_GEN_CHAT, CHAT(",\"temperature\":0,\"max_tokens\":5,\"reasoning_effort\":\"none\""));
    CHECK(a && b && c && d && e && g);
    CHECK(f == NULL); /* sampling without a seed is not deterministic */
    if (a && b && c && d && e && g) {
        CHECK(!strcmp(a, b));
        CHECK(strcmp(a, c));
        CHECK(strcmp(d, e));
        CHECK(strcmp(a, d));
        CHECK(strcmp(a, g));
        CHECK_EQ_INT(strlen(a), 64);
    }
    free(a), free(b), free(c), free(d), free(e), free(f), free(g);
}

int main(void)
{
    test_binary = "test_api";
    RUN(t_chat_refusals);
    RUN(t_completion_refusals);
    RUN(t_accepted_and_normalised);
    RUN(t_field_policy);
    RUN(t_memo_key);
    return test_finish();
}
