/* constrain: structured outputs enforced while sampling (issue 36). Owns the
 * compilation of a constraint -- a JSON schema (response_format json_object /
 * json_schema), a regular expression (guided_regex, a schema's "pattern") or a
 * list of choices (guided_choice) -- into a byte-level pushdown matcher, the
 * byte trie of a vocabulary, and the per-request run that computes, before
 * each sampled token, the mask of the vocabulary ids whose bytes keep the
 * output a prefix of some string the constraint accepts.
 * Callers: the scheduler (coordinator/api/sched.c, one run per slot), the API
 * parser (compile, to refuse bad schemas with a 400 naming the keyword),
 * tests and the `constrain` benchmark.
 *
 * Soundness contract (what tests/e2e/test_constrain.py checks against Python's
 * jsonschema): every byte string the matcher accepts is valid under the
 * schema. The matcher may accept a subset of the schema's language (documented
 * in docs/API.md "Structured outputs": declared properties in declaration
 * order, absent additionalProperties read as false, whitespace runs of at
 * most SHOAL_CONS_WS_MAX bytes of space/newline/tab between tokens, regex '.'
 * and negated classes over ASCII only, ...), never a superset. Liveness: a
 * token is allowed only when the matcher can still reach an accepting state
 * after it (bounded: nesting deeper than SHOAL_CONS_DEPTH is not offered), so
 * an allowed path never dead-ends except in the documented corner cases
 * (minLength above what a pattern can produce); a run whose mask comes out
 * empty reports it and the caller ends the request.
 *
 * Thread safety: a shoal_cons and a shoal_cons_vocab are immutable after
 * creation and may be shared by many runs on many threads; a shoal_cons_run
 * is single-threaded (one per request). Compile time and memory are bounded
 * (SHOAL_CONS_MAX_NODES schema nodes, SHOAL_CONS_MAX_DFA regex states): a
 * larger input is refused with SHOAL_ERANGE and a message, never a hang. */
#ifndef SHOAL_CONSTRAIN_H
#define SHOAL_CONSTRAIN_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/text/tokenizer.h"

#define SHOAL_CONS_WS_MAX 16       /* whitespace bytes in a row between JSON tokens */
#define SHOAL_CONS_DEPTH 24        /* frames on one matcher stack (nesting) */
#define SHOAL_CONS_ALTS 6          /* live anyOf alternatives tracked at once */
#define SHOAL_CONS_MAX_NODES 4096  /* compiled schema nodes */
#define SHOAL_CONS_MAX_DFA 4096    /* states of all regex DFAs of one constraint */

typedef struct shoal_cons shoal_cons;
typedef struct shoal_cons_vocab shoal_cons_vocab;
typedef struct shoal_cons_run shoal_cons_run;

/* A JSON schema (a jansson object; NULL = any JSON object, i.e.
 * response_format json_object). Unsupported keywords and malformed values are
 * refused with SHOAL_EUNSUPPORTED / SHOAL_EINVAL and a message that starts
 * with the JSON pointer of the keyword ("/properties/a/minimum: ..."). */
int shoal_cons_compile_json(shoal_cons **out, const json_t *schema, char *err, size_t errlen);
/* The whole output matches the regex (docs/API.md lists the subset); refused
 * with SHOAL_EUNSUPPORTED (a construct outside it) or SHOAL_ERANGE (too many
 * states). */
int shoal_cons_compile_regex(shoal_cons **out, const char *re, size_t len, char *err, size_t errlen);
/* A GBNF grammar as llama-server takes it (rule "root"); recursion is
 * bounded (each rule at most 3 times along one derivation path) and classes
 * keep their ASCII members, so the matcher accepts a regular subset of the
 * grammar's language (docs/API.md "Grammars"). SHOAL_EINVAL / SHOAL_ERANGE
 * with a message on a malformed or too large grammar. */
int shoal_cons_compile_gbnf(shoal_cons **out, const char *text, size_t len, char *err, size_t errlen);
/* The whole output is exactly one of the n strings (UTF-8, n >= 1). */
int shoal_cons_compile_choice(shoal_cons **out, const char *const *choices, int n, char *err, size_t errlen);
/* The normalised form the API stores in a request (shoal_gen_params.constraint):
 * {"kind":"json","schema":S|null} | {"kind":"regex","pattern":"..."} |
 * {"kind":"choice","choices":["...", ...]} | {"kind":"grammar","gbnf":"..."}. */
int shoal_cons_compile_spec(shoal_cons **out, const json_t *spec, char *err, size_t errlen);
void shoal_cons_free(shoal_cons *c); /* accepts NULL */

/* The byte trie of t's ordinary tokens (ids [0, n_ranks)); special ids are
 * never in a mask unless given as end ids to a run. Built once per model. */
int shoal_cons_vocab_build(shoal_cons_vocab **out, const shoal_tok *t, char *err, size_t errlen);
void shoal_cons_vocab_free(shoal_cons_vocab *v); /* accepts NULL */
int32_t shoal_cons_vocab_size(const shoal_cons_vocab *v); /* n_vocab of the tokenizer */

/* A run over c and v (both must outlive it). end_ids[0..n_end) (n_end >= 1)
 * is the fixed id sequence that must follow the constrained text (e.g. K3's
 * <|close|>response<|sep|>...<|end_of_msg|>): when the text is complete the
 * mask allows end_ids[0] (next to the text's continuations); once it is taken
 * the rest is forced one id at a time (n_end <= 64). */
int shoal_cons_run_create(shoal_cons_run **out, const shoal_cons *c, const shoal_cons_vocab *v,
                          const int32_t *end_ids, int n_end, char *err, size_t errlen);
void shoal_cons_run_free(shoal_cons_run *r); /* accepts NULL */
/* A new run with the same constraint, vocabulary, end ids and state as src
 * (its own scratch). */
shoal_cons_run *shoal_cons_run_clone(const shoal_cons_run *src);
/* dst takes src's state, its constraint and end ids included (dst from
 * shoal_cons_run_clone of a run over the same vocabulary: a run's scratch
 * depends on the vocabulary alone); never allocates, so a mask thread can
 * look ahead (drafted ids) without touching src. */
void shoal_cons_run_copy(shoal_cons_run *dst, const shoal_cons_run *src);
/* r starts over on c (over r's vocabulary; c must outlive the use) in c's
 * initial state, with end_ids[0..n_end) as in create and no prefix. Never
 * allocates (tool calls move one run from a call's header to its arguments,
 * coordinator/api/toolcons.c). SHOAL_EINVAL on bad end ids (r unchanged). */
int shoal_cons_run_reset(shoal_cons_run *r, const shoal_cons *c, const int32_t *end_ids, int n_end);
/* Ids forced before the constrained text (at most 64; e.g. K3's tool-call
 * opening up to the arguments' json element): the mask allows ids[k] alone
 * until they are all taken. Only before the first accept. */
int shoal_cons_run_set_prefix(shoal_cons_run *r, const int32_t *ids, int n);
/* mask[n_vocab]: 1 where the id is allowed, 0 elsewhere. Returns the number
 * of allowed ids (0: nothing can follow -- the caller ends the request).
 * Never allocates. */
int shoal_cons_run_mask(shoal_cons_run *r, uint8_t *mask);
/* Advance by one sampled id. Returns 0, or SHOAL_EINVAL (the id is not
 * allowed; the run is unchanged). */
int shoal_cons_run_accept(shoal_cons_run *r, int32_t id);
/* Advance by raw bytes (tests, drafting checks): 0 or SHOAL_EINVAL. Only
 * before the end ids started. */
int shoal_cons_run_feed(shoal_cons_run *r, const uint8_t *b, size_t n);
/* 1 when the text so far is a complete accepted string. */
int shoal_cons_run_text_complete(const shoal_cons_run *r);
/* 1 when every end id has been taken. */
int shoal_cons_run_done(const shoal_cons_run *r);

#endif
