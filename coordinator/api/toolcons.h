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
 * "any JSON object", docs/API.md). Callers: the scheduler (one per slot,
 * and one look-ahead clone per slot for the masks of drafted verify rows).
 * The tokenizer, the vocabulary trie and the tools array outlive it.
 *
 * Compiled constraints (each call index's header choice, each tool's
 * arguments) are compiled once per toolcons, on first need or by
 * shoal_toolcons_prepare, and shared read-only with its clones. Threads: a
 * toolcons is single-threaded, but for this hand-over: while one thread
 * runs shoal_toolcons_mask on the original, or copy/accept/mask on a clone,
 * the owner's thread may call shoal_toolcons_prepare on the original (it
 * touches only the compiled caches, which mask never reads) and nothing
 * else on it; the original is never advanced while a clone runs. */
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
/* Advance by the sampled id (one the last mask allowed). Returns 0; on a
 * clone, SHOAL_EBUSY where the id enters a call header or a tool's
 * arguments not compiled yet (a clone never compiles: the look-ahead
 * stops there; the clone's state is then undefined until the next copy). */
int shoal_toolcons_accept(shoal_toolcons *tc, int32_t id);
/* A look-ahead copy of tc: its own state and run scratch (allocates), the
 * compiled constraints borrowed from tc's original; closed on its own,
 * before or after the original, but never used after it. */
shoal_toolcons *shoal_toolcons_clone(const shoal_toolcons *src);
/* dst (a clone of src's original) takes src's whole state: phase, forced
 * ids, call count, header bytes, the header's or arguments' run. Never
 * allocates (a mask thread looks ahead through drafted ids with it). */
void shoal_toolcons_copy(shoal_toolcons *dst, const shoal_toolcons *src);
/* On the original, before a clone looks ahead (at most a verify chunk,
 * SHOAL_DRAFT_MAX_K ids): compiles what the look-ahead may enter, i.e. the
 * next two calls' headers and, once the reply has left the content, every
 * tool's arguments (each once per toolcons). A no-op on a clone. */
void shoal_toolcons_prepare(shoal_toolcons *tc);
/* Calls constrained so far (tests, metrics). */
int shoal_toolcons_calls(const shoal_toolcons *tc);

/* ids of K3's text pieces and markers, each piece encoded on its own as the
 * chat encoder writes its segments (chat.c); a piece "<|...|>" is a marker.
 * Returns the count, or -1 (a marker missing, more than cap ids). */
int shoal_toolcons_ids(const shoal_tok *t, const char *const *pieces, int n, int32_t *out, int cap, char *err,
                       size_t errlen);

#endif
