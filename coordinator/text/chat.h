/* chat: the K3 XTML chat encoder (SPEC §5.4). Turns OpenAI-style chat
 * messages (a jansson array, e.g. straight from a /v1/chat/completions body)
 * into the prompt's token ids, the way the official encoding_k3.py does: a list
 * of segments (text, allow_special), each encoded on its own with the
 * tokenizer, special-token recognition on only for the structural markers
 * <|open|> <|close|> <|sep|> <|end_of_msg|>. Text a client wrote (content,
 * names, arguments, tool results) can never become structure: a user typing
 * "<|open|>" gets the ids of those ordinary bytes.
 * Callers: the HTTP layer, the CLI, tests. Thread-safe (no global state).
 *
 * What is rendered, in order (exact strings in chat.c; sources: WASTE
 * serve/xtml.py, a port of encoding_k3.py, checked against ATLAS
 * official-xtml.json, the official encoder's segments at HF rev f831ab66):
 *   1. opts.tools (non-empty array): a system message type="tool-declare" with
 *      the tool list as compact JSON, keys sorted at every level;
 *   2. the thinking-effort system message (see shoal_chat_effort_rule);
 *   3. each message:
 *      user / system: <|open|>message role="R"[ name="N"]<|sep|>CONTENT<|close|>message<|sep|><|end_of_msg|>
 *        (a system message carrying a non-empty "tools" array is instead a
 *        "## New Tools Available" tool-declare message);
 *      assistant: [think element when thinking is on, with reasoning_content
 *        (or "reasoning") when it has non-blank text] + response element with
 *        content + tools element with one call element per tool_calls entry
 *        (index from 1; arguments as typed argument elements, or one json
 *        element holding the raw text when the arguments string is not JSON);
 *      tool: role="tool" tool="NAME" index="i"; consecutive tool messages whose
 *        tool_call_id all match the last assistant's tool_calls are reordered to
 *        the call order and take the call's function name;
 *   4. tool_choice "required" / "none": a system message type="tool-choice";
 *   5. response_format json_object / json_schema: a type="response-format" message;
 *   6. the generation prompt: <|open|>message role="assistant"<|sep|> then
 *      <|open|>think<|sep|> (thinking on) or <|open|>response<|sep|>.
 *   Partial mode (Moonshot): when the last message is an assistant message
 *   with "partial": true, items 4-5 come before it, it is rendered without
 *   closing its response element (no </response>, </message>, <|end_of_msg|>)
 *   and there is no generation prompt (vLLM's continue_final_message); it
 *   must not carry tool_calls (SHOAL_EINVAL).
 * Attribute values escape & as &amp; then " as &quot;. Empty texts are not
 * segments. No [BOS] is added (SPEC §5.5).
 *
 * Input errors are refused with SHOAL_EINVAL and a message naming the field
 * ("messages[2].tool_calls[0].function.name: ..."): unknown or missing roles,
 * non-object messages, content that is neither a string, null nor an array of
 * {"type":"text"} parts, image parts (SHOAL_EUNSUPPORTED: text-only engine),
 * tool calls without a name, arguments that parse to a non-object, a tool
 * message whose name cannot be resolved, an unsupported thinking_effort. */
#ifndef SHOAL_CHAT_H
#define SHOAL_CHAT_H

#include <jansson.h>
#include <stddef.h>

#include "coordinator/text/tokenizer.h"

/* Two revisions of encoding_k3.py differ on the thinking-effort message
 * (SPEC §5.6, §8 item 3) [uncertain]; the choice is explicit. */
typedef enum {
    /* The official encoder as ported by WASTE, and consistent with the official
     * segments at rev f831ab66 (ATLAS: "Hello" with thinking on is 22 tokens, no
     * effort message): no message unless thinking_effort is given; "low",
     * "high", "max" accepted, "medium" refused. The default. */
    SHOAL_CHAT_EFFORT_ENCODER = 0,
    /* llama.cpp's Kimi-K3.jinja: thinking_effort defaults to "max" (so a message
     * is always present with thinking on); "low", "medium", "high", "max". */
    SHOAL_CHAT_EFFORT_TEMPLATE = 1,
} shoal_chat_effort_rule;

typedef struct {
    int thinking_off;          /* 0: thinking on (K3's default); 1: off */
    int no_generation_prompt;  /* 1: do not open the assistant's turn */
    const char *thinking_effort; /* NULL: the rule's default; else low|medium|high|max */
    shoal_chat_effort_rule effort_rule;
    const json_t *tools;       /* OpenAI "tools" array, or NULL */
    const json_t *tool_choice; /* "required" | "none" add a message; anything else none */
    const json_t *response_format; /* {"type": "json_object"|"json_schema", ...} or NULL */
} shoal_chat_opts;

/* Fills *o from an OpenAI /v1/chat/completions request body: tools,
 * tool_choice, response_format, and the K3 switches
 * chat_template_kwargs.thinking (bool) and thinking_effort (top level or in
 * chat_template_kwargs; "reasoning_effort" is accepted as a synonym). Borrowed
 * pointers into body: body must outlive *o. Fields not in the body keep their
 * value in *o (designated-initialise it first). SHOAL_EINVAL naming the field
 * for a wrong type. */
int shoal_chat_opts_from_request(const json_t *body, shoal_chat_opts *o, char *err, size_t errlen);

/* One segment: text[0..len) (NUL-terminated), special = 1 when it is a
 * structural marker encoded with special tokens allowed. */
typedef struct {
    const char *text;
    size_t len;
    int special;
} shoal_chat_seg;

typedef struct shoal_chat_segs shoal_chat_segs;

/* Renders messages (a JSON array) into segments; *out owns copies of every
 * text (messages may be freed afterwards). Free with shoal_chat_segs_free. */
int shoal_chat_render(const json_t *messages, const shoal_chat_opts *o, shoal_chat_segs **out,
                      char *err, size_t errlen);
size_t shoal_chat_segs_count(const shoal_chat_segs *s);
/* The i-th segment, borrowed from s. */
shoal_chat_seg shoal_chat_segs_get(const shoal_chat_segs *s, size_t i);
void shoal_chat_segs_free(shoal_chat_segs *s);

/* Encodes segments with t, appending ids to *out; a special segment must be
 * exactly one special token of t (SHOAL_EMODEL naming it otherwise). */
int shoal_chat_encode_segs(const shoal_tok *t, const shoal_chat_segs *s, shoal_tok_ids *out,
                           char *err, size_t errlen);

/* render + encode_segs. */
int shoal_chat_encode(const shoal_tok *t, const json_t *messages, const shoal_chat_opts *o,
                      shoal_tok_ids *out, char *err, size_t errlen);

#endif
