/* chatparse: the incremental parser of K3's generated XTML (SPEC §5.6), on token
 * ids, for streaming and non-streaming OpenAI responses. Callers: the HTTP
 * layer (one parser per generated message), tests.
 *
 * After the generation prompt (chat.h) the model writes
 *   REASONING <|close|>think<|sep|> <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
 *   [<|open|>tools<|sep|> <|open|>call tool="NAME" index="1"<|sep|>
 *      <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> ...
 *      (or <|open|>json type="object"<|sep|>RAW<|close|>json<|sep|>)
 *    <|close|>call<|sep|> ... <|close|>tools<|sep|>]
 *   <|close|>message<|sep|><|end_of_msg|>
 * (with thinking off it starts in the response). Structure is read from the
 * ids of <|open|> <|close|> <|sep|> <|end_of_msg|> [EOS] only; the same
 * characters typed as ordinary text are text. The parser maps this to OpenAI's
 * shapes: reasoning_content, content, tool_calls[{id, type:"function",
 * function:{name, arguments}}] with arguments a JSON object string (string
 * arguments JSON-escaped, the other types' text as written), finish_reason.
 *
 * Robustness contract: any id sequence is accepted (ids outside the vocabulary
 * too); nothing aborts. What is well formed is returned; everything else is
 * reported as an issue (a short message) and, where it carries text, that text
 * is kept in content or in the issue: stray text between elements, unknown or
 * misplaced elements, mismatched closers, calls without a name, argument values
 * that are not JSON of their declared type (sent as a JSON string instead),
 * a json block that is not an object (passed through as written), elements
 * left open at the end, ids after the end. A call that is still open when the
 * output ends (truncated) is not returned as a tool call: its text is in the
 * issue. Text deltas are UTF-8-safe: a code point is never split between two
 * events; invalid bytes become U+FFFD (tokenizer.h's rule).
 *
 * Single-threaded per parser. The tokenizer must outlive the parser. */
#ifndef SHOAL_CHATPARSE_H
#define SHOAL_CHATPARSE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/text/tokenizer.h"

typedef struct shoal_chatparse shoal_chatparse;

typedef enum {
    SHOAL_CHATPARSE_REASONING, /* text: a reasoning_content delta */
    SHOAL_CHATPARSE_CONTENT,   /* text: a content delta */
    SHOAL_CHATPARSE_TOOL_CALL, /* a complete call: index, id, name, arguments */
    SHOAL_CHATPARSE_ISSUE,     /* text: what was malformed */
} shoal_chatparse_kind;

/* Pointers are borrowed for the duration of the callback only. */
typedef struct {
    shoal_chatparse_kind kind;
    const char *text; /* REASONING, CONTENT, ISSUE: UTF-8, NUL-terminated */
    size_t len;
    int index;             /* TOOL_CALL: position in tool_calls, from 0 */
    const char *id;        /* TOOL_CALL: "<id_prefix><index>" */
    const char *name;      /* TOOL_CALL: function name */
    const char *arguments; /* TOOL_CALL: a JSON object text */
} shoal_chatparse_event;

typedef void (*shoal_chatparse_cb)(void *ud, const shoal_chatparse_event *ev);

typedef struct {
    int thinking_off;      /* the prompt ended in <|open|>response<|sep|> (chat.h thinking_off) */
    const char *id_prefix; /* tool call ids; NULL: "call_"; copied */
    shoal_chatparse_cb on_event; /* optional, called from feed/finish */
    void *ud;
} shoal_chatparse_opts;

/* Looks up the structural ids in t; SHOAL_EMODEL if one is missing. */
int shoal_chatparse_open(shoal_chatparse **out, const shoal_tok *t, const shoal_chatparse_opts *o,
                         char *err, size_t errlen);
void shoal_chatparse_close(shoal_chatparse *p);

/* Feeds one generated id. Returns 1 when this id ended the message
 * (<|end_of_msg|> or [EOS]: the caller should stop generating), 0 otherwise.
 * Ids after the end are ignored (one issue is reported). */
int shoal_chatparse_feed(shoal_chatparse *p, int32_t id);

/* Ends the output: truncated = 1 when generation stopped for a length limit
 * (finish_reason "length"), 0 when it stopped for another reason (a stop id,
 * a stop string). Flushes held-back text and reports elements left open.
 * Idempotent; feed after finish is ignored. */
void shoal_chatparse_finish(shoal_chatparse *p, int truncated);

/* Results (valid after finish, and as running totals before it). */
const char *shoal_chatparse_reasoning(const shoal_chatparse *p, size_t *len);
const char *shoal_chatparse_content(const shoal_chatparse *p, size_t *len);
size_t shoal_chatparse_n_tool_calls(const shoal_chatparse *p);
/* i-th call's fields (borrowed from p); NULL for i out of range. */
const char *shoal_chatparse_tool_call(const shoal_chatparse *p, size_t i, const char **id,
                                      const char **arguments);
/* "stop", "tool_calls" or "length"; NULL before finish and before the end id. */
const char *shoal_chatparse_finish_reason(const shoal_chatparse *p);
size_t shoal_chatparse_n_issues(const shoal_chatparse *p);
const char *shoal_chatparse_issue(const shoal_chatparse *p, size_t i);

/* The OpenAI assistant message {"role":"assistant","content":...,
 * "reasoning_content":... (when any), "tool_calls":[...] (when any)}; content
 * is null when empty and there are tool calls. A new reference. */
json_t *shoal_chatparse_message(const shoal_chatparse *p);

#endif
