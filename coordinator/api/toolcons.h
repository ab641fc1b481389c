/* toolcons: tool calls the model opens on its own (tool_choice "auto", or
 * "required" with several tools) constrained while sampling (issue 36). Owns
 * the small state machine over K3's reply structure after the content
 * (chatparse.h):
 *   ... <|close|>response<|sep|> [<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>]
 *   <|close|>message<|sep|><|end_of_msg|>
 * The reasoning and the content stay free (but for <|open|>: no element
 * opens inside them). Once the model closes them, the
 * element names are forced (the only names K3's format allows there), the
 * choice between a tools section and the end of the message is the model's
 * (unless tool_choice requires a call), and each call it opens is
 *   <|open|>call tool="NAME" index="K"<|sep|>   NAME one of the declared tools
 *   <|open|>json type="object"<|sep|>ARGS<|close|>json<|sep|><|close|>call<|sep|>
 * with ARGS constrained by that function's `parameters` schema
 * (coordinator/text/constrain.h; a schema the compiler refuses is read as
 * "any JSON object", docs/API.md). Callers: the scheduler (one per slot).
 * Single-threaded; the tokenizer and the vocabulary trie outlive it. */
#ifndef SHOAL_TOOLCONS_H
#define SHOAL_TOOLCONS_H

#include <jansson.h>
#include <stdint.h>

#include "coordinator/text/text.h"

typedef struct shoal_toolcons shoal_toolcons;

typedef struct {
    const json_t *tools; /* OpenAI tools array (function tools with name + parameters) */
    int required;        /* 1: at least one call (tool_choice "required") */
    int max_calls;       /* calls in the section at most; 0 = any (parallel_tool_calls) */
    int thinking;        /* 1: the output starts in the reasoning */
} shoal_toolcons_opts;

/* SHOAL_EUNSUPPORTED when t lacks K3's chat markers. */
int shoal_toolcons_open(shoal_toolcons **out, const shoal_tok *t, const shoal_cons_vocab *v,
                        const shoal_toolcons_opts *o, char *err, size_t errlen);
void shoal_toolcons_close(shoal_toolcons *tc); /* accepts NULL */
/* mask[n_vocab] for the next id. Returns -1 when the model is free this step
 * (mask untouched) but for *ban (an id it may not take, -1 none: K3's
 * reasoning and content hold no elements, so <|open|> is banned there),
 * else the number of allowed ids (>= 1 in a well-formed state, 0: a dead
 * end the caller reports). */
int shoal_toolcons_mask(shoal_toolcons *tc, uint8_t *mask, int32_t *ban);
/* Advance by the sampled id (one the last mask allowed). */
void shoal_toolcons_accept(shoal_toolcons *tc, int32_t id);
/* Calls constrained so far (tests, metrics). */
int shoal_toolcons_calls(const shoal_toolcons *tc);

/* ids of K3's text pieces and markers, each piece encoded on its own as the
 * chat encoder writes its segments (chat.c); a piece "<|...|>" is a marker.
 * Returns the count, or -1 (a marker missing, more than cap ids). */
int shoal_toolcons_ids(const shoal_tok *t, const char *const *pieces, int n, int32_t *out, int cap, char *err,
                       size_t errlen);

#endif
