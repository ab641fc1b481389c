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
 * splitmix64, so a (seed, logits sequence) pair always gives the same ids. */
#ifndef SHOAL_SAMPLER_H
#define SHOAL_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    float temperature; /* <= 0: greedy */
    float top_p;       /* (0, 1]; 1 = off. 0 is treated as 1 (off). */
    int top_k;         /* >= 0; 0 = off */
    uint64_t seed;
} shoal_sampler_opts;

typedef struct shoal_sampler shoal_sampler;

/* Refuses (SHOAL_EINVAL, naming the field) a NaN/negative top_p or > 1, a
 * negative top_k, a non-finite temperature, vocab < 1. opts NULL = greedy. */
int shoal_sampler_create(shoal_sampler **out, const shoal_sampler_opts *opts, int vocab, char *err,
                         size_t errlen);
void shoal_sampler_free(shoal_sampler *s); /* accepts NULL */
/* Restart the PRNG stream from seed (same as a fresh sampler with it). */
void shoal_sampler_reseed(shoal_sampler *s, uint64_t seed);
/* logits[vocab] (not modified). Never allocates. NaN logits are never chosen
 * unless every logit is NaN (then 0). */
int32_t shoal_sampler_sample(shoal_sampler *s, const float *logits);

/* Greedy pick: index of the largest x[i], ties to the lowest index; NaN
 * ignored (0 if all NaN). */
int32_t shoal_argmax(const float *x, int n);

#endif
