/* Sampler: picks the next token id from one row of logits. Owns its PRNG
 * state and a scratch sized for the vocabulary at create, so sampling never
 * allocates. One sampler per sequence (its PRNG stream is the sequence's);
 * not thread-safe, callers serialise use of one sampler.
 *
 * Algorithm (the contract; tests/unit/test_sampler.c checks it):
 *  1. temperature <= 0, or top_k == 1: greedy -- the largest logit, ties to
 *     the lowest id. No PRNG draw.
 *  2. Candidates are ranked by logit descending, ties by id ascending. top_k > 0
 *     keeps the first top_k. Probabilities p_i = exp((l_i - l_max)/T) / Σ over
 *     the kept candidates, in double precision.
 *  3. top_p < 1 keeps the shortest rank-ordered prefix whose mass reaches
 *     top_p (at least one token), renormalised.
 *  4. One draw u in [0,1) = (xoshiro256** output >> 11) · 2^-53; the token is
 *     the first candidate (in rank order) whose cumulative mass exceeds
 *     u · total. With top_k == 0 and top_p == 1 the candidates are walked in id
 *     order instead (no ranking needed; same distribution).
 * The PRNG is xoshiro256** with its 256-bit state filled from seed by
 * splitmix64, so a (seed, logits sequence) pair always gives the same ids.
 *
 * Before step 1 the row is adjusted (only when one of these is set; in float,
 * on a copy -- the caller's row is never modified), in this order (vLLM's):
 *  a. logit_bias: l[j] += bias[j] (OpenAI's logit_bias);
 *  b. repetition_penalty r (CTRL / HF / vLLM), over every id seen in the
 *     prompt or the output (shoal_sampler_observe): l[j] > 0 ? l[j] / r : l[j] * r;
 *  c. frequency / presence (OpenAI's documented formula), over the generated
 *     ids only, c[j] = how many times j was generated:
 *     l[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty.
 * Greedy picks the argmax of the adjusted row. min_p > 0 (after top_k, before
 * top_p) keeps the ranked prefix with exp((l_i - l_max)/T) >= min_p, i.e. a
 * probability at least min_p times the most likely one's. */
#ifndef SHOAL_SAMPLER_H
#define SHOAL_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int32_t id;
    float bias;
} shoal_logit_bias;

typedef struct {
    float temperature; /* <= 0: greedy */
    float top_p;       /* (0, 1]; 1 = off. 0 is treated as 1 (off). */
    int top_k;         /* >= 0; 0 = off */
    uint64_t seed;
    float min_p;              /* [0, 1]; 0 = off */
    float presence_penalty;   /* finite; 0 = off */
    float frequency_penalty;  /* finite; 0 = off */
    float repetition_penalty; /* > 0; 1 (or 0, read as 1) = off */
    const shoal_logit_bias *bias; /* nbias entries, ids in [0, vocab); copied at create */
    int nbias;
} shoal_sampler_opts;

typedef struct shoal_sampler shoal_sampler;

/* Refuses (SHOAL_EINVAL, naming the field) a NaN/negative top_p or > 1, a
 * negative top_k, a non-finite temperature, vocab < 1, a min_p outside
 * [0, 1], a non-finite penalty or bias, repetition_penalty < 0, a bias id
 * outside the vocabulary. opts NULL = greedy. */
int shoal_sampler_create(shoal_sampler **out, const shoal_sampler_opts *opts, int vocab, char *err,
                         size_t errlen);
void shoal_sampler_free(shoal_sampler *s); /* accepts NULL */
/* An id of the sequence: a prompt id (generated = 0: counts for the
 * repetition penalty) or a generated one (counts for all three penalties).
 * The caller observes every sampled id it keeps. No-op without penalties. */
void shoal_sampler_observe(shoal_sampler *s, int32_t id, int generated);
/* 1 when the sampler adjusts rows (bias or a penalty set). */
int shoal_sampler_adjusts(const shoal_sampler *s);
/* Restart the PRNG stream from seed (same as a fresh sampler with it). */
void shoal_sampler_reseed(shoal_sampler *s, uint64_t seed);
/* logits[vocab] (not modified). Never allocates. NaN logits are never chosen
 * unless every logit is NaN (then 0). */
int32_t shoal_sampler_sample(shoal_sampler *s, const float *logits);

/* Log-probabilities of the raw row (log-softmax in double precision, NaN
 * entries left out): returns the one of id, and fills top_ids[0..k) /
 * top_lp[0..k) with the k most likely ids in rank order (larger logit first,
 * ties to the lower id; -1 / -inf past the row's end). k may be 0. */
double shoal_logprobs(const float *logits, int n, int32_t id, int k, int32_t *top_ids, double *top_lp);

/* Greedy pick: index of the largest x[i], ties to the lowest index; NaN
 * ignored (0 if all NaN). */
int32_t shoal_argmax(const float *x, int n);

#endif
