/* Drafter: proposes the next tokens of a sequence for speculative decoding
 * (issue 21), from the sequence itself -- prompt lookup, no model. Part of the
 * engine room's public face (included by engine.h, like sampler.h); the
 * verify side is shoal_spec_* in engine.h. Pure token logic: no engine state,
 * no allocation after create. One drafter per sequence; not thread-safe.
 *
 * Algorithm (the contract; tests/unit/test_draft.c checks it):
 *  1. Match: the longest suffix of hist (length L, ngram_min <= L <=
 *     ngram_max) that also ends at an earlier position i < n - 1; among
 *     equally long matches the most recent (largest i).
 *  2. Draft: the tokens after the match, hist[i + 1], hist[i + 2], ... read
 *     through hist extended by the draft itself (so a match inside a loop
 *     continues the loop past the end of hist), up to min(K, limit).
 *  3. K adapts to the acceptance (shoal_drafter_update): the drafts of a
 *     chunk are modelled as accepted one after the other with probability r
 *     until the first rejection; r = S / N with S = accepted drafts and
 *     N = accepted + rejections, both decayed by 0.8 per verified chunk
 *     (start: S = 1, N = 2). A verify pass of k drafts costs
 *     1 + cost0 + cost * k plain passes (docs/PERFORMANCE.md measures both;
 *     defaults cost 0.2, cost0 0.3) and yields 1 + r + r^2 + ... + r^k tokens on
 *     average; K is the k in 0..max with the most tokens per cost (k = 0:
 *     one token for one pass; ties to the smaller k). K = 0 means no verify
 *     at all: the caller then only shadows one draft (proposes it, decodes
 *     plainly, and reports whether the next token equalled it), so r keeps
 *     being measured at no cost and K comes back when drafts start to hit.
 *     With fixed = 1, K = max always.
 * No match of at least ngram_min tokens: no draft (the caller decodes
 * plainly, at no extra cost). */
#ifndef SHOAL_DRAFT_H
#define SHOAL_DRAFT_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    SHOAL_DRAFT_OFF = 0,
    SHOAL_DRAFT_NGRAM = 1,  /* prompt lookup (above) */
    SHOAL_DRAFT_SCRIPT = 2, /* tests: propose script[n..] at history length n (a given
                             * token list, e.g. plain decoding's ids with planted errors) */
} shoal_draft_mode;

#define SHOAL_DRAFT_MAX_K 16

typedef struct {
    shoal_draft_mode mode;
    int max;       /* most drafts per chunk, 1..SHOAL_DRAFT_MAX_K; 0 = 8 */
    int ngram_min; /* shortest suffix match that drafts; 0 = 2 */
    int ngram_max; /* longest suffix match looked for; 0 = 16 */
    int fixed;     /* 1: K = max always (no adaptation) */
    double cost;   /* one more verify position / one pass, in (0, 1); 0 = 0.2 */
    double cost0;  /* a verify pass's fixed extra / one pass, in [0, 4]; 0 = 0.3, < 0 = none */
    const int32_t *script; /* SHOAL_DRAFT_SCRIPT: borrowed, n_script ids */
    int n_script;
} shoal_draft_opts;

typedef struct shoal_drafter shoal_drafter;

/* "--draft" value: ngram|off. 0 or SHOAL_EINVAL. */
int shoal_draft_parse_mode(const char *s, shoal_draft_mode *mode);
/* "--draft-cost" value: PER[,FIXED] into cost (0 < PER < 1) and cost0
 * (0 <= FIXED <= 4; absent: the default). 0 or SHOAL_EINVAL. */
int shoal_draft_parse_cost(const char *s, shoal_draft_opts *o);
/* Checks opts (SHOAL_EINVAL naming the field). NULL opts: ngram, defaults. */
int shoal_drafter_create(shoal_drafter **out, const shoal_draft_opts *opts, char *err, size_t errlen);
void shoal_drafter_free(shoal_drafter *d); /* accepts NULL */
/* A new sequence: K and the acceptance estimate back to their start. */
void shoal_drafter_reset(shoal_drafter *d);
/* Up to limit drafts continuing hist[0..n) into out[] (the caller passes
 * min(K, what it can use), or 1 for a shadow draft); returns how many (0:
 * none). Never allocates. */
int shoal_drafter_propose(shoal_drafter *d, const int32_t *hist, int n, int limit, int32_t *out);
/* A verified chunk: drafted drafts were proposed, the first accepted of them
 * were accepted (accepted < drafted: the next one was rejected). */
void shoal_drafter_update(shoal_drafter *d, int drafted, int accepted);
int shoal_drafter_k(const shoal_drafter *d);
int shoal_drafter_max(const shoal_drafter *d);
shoal_draft_mode shoal_drafter_mode(const shoal_drafter *d);

#endif
