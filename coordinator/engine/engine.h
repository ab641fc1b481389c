/* Engine: the Kimi K3 forward (../shared/k3/SPEC.md §3) in one process --
 * the public face of the engine room (coordinator/engine/): this header, with
 * the sampler (sampler.h) and the expert backend interface (experts.h) it
 * includes. Behind it: model.c (open, bind tensors), forward.c (the math),
 * trunk.c / tstream.c (the trunk budget and its streaming reader), engine.c
 * (sequences, entry points), experts_local.c (the in-process experts),
 * allocguard.c. May use: common/, kernels/ and obs/; never text/, api/,
 * cluster/ or cmd/ (a remote backend is plugged in through experts.h).
 *
 * Owns two kinds of object:
 *   shoal_model -- opened once from a model directory: the config, every trunk
 *                  tensor bound by name (mapped read-only, never copied except
 *                  small vectors widened to fp32 once; or, under a trunk
 *                  budget, read into owned memory and partly streamed: see
 *                  shoal_trunk_mode), the routed-expert
 *                  backend (in-process by default, or one plugged in by the
 *                  distributed client), and all forward scratch, sized at open
 *                  from the config and the options;
 *   shoal_seq   -- one sequence's state: the KDA recurrent states and conv
 *                  windows plus the MLA latent cache (kv_lora + rope values per
 *                  token per MLA layer), and its position. Owned by the caller.
 * Callers: `shoal run` (coordinator/cmd/run.c), the HTTP server, the distributed
 * client (through shoal_model_set_experts), tests and benchmarks.
 *
 * Numerics (SPEC §3.9 engine default): fp32 from the stored values everywhere
 * (F32 tensors as stored, bf16 weights widened exactly, activations and the
 * AttnRes prefix sums in fp32); the one bf16 rounding kept is each routed
 * expert's output. Every per-token result is bit-identical whether the token
 * runs in a prefill chunk of any size, alone in decode, or in a decode batch
 * next to other sequences' tokens, and for any OpenMP thread count.
 *
 * Memory: nothing in prefill/decode allocates (scratch is sized at open; a
 * sequence's state at shoal_seq_create). An allocation guard around every
 * forward counts any malloc (shoal_engine_alloc_count) and, with
 * SHOAL_ALLOC_GUARD=abort in the environment (tests), aborts on it.
 *
 * Thread-safety: after open, a model is immutable except for its scratch, its
 * counters and its expert backend. Every call that runs the forward
 * (shoal_seq_prefill, shoal_seq_decode, shoal_model_decode_batch) on any
 * sequence of one model must come from one thread at a time (they share the
 * scratch and the OpenMP team); the engine itself parallelises each call.
 * Calls that do not run the forward (create/free/reset/copy/fork, getters)
 * touch only the sequences named and may run on other threads, as long as no
 * forward is using those sequences at the same time. Different models are
 * independent. The cancel flag may be written from any thread. */
#ifndef SHOAL_ENGINE_H
#define SHOAL_ENGINE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/k3cfg.h"
#include "common/st.h"
#include "coordinator/obs/obs.h"
#include "coordinator/engine/experts.h"
#include "coordinator/engine/rmat.h"
#include "coordinator/engine/sampler.h"
#include "coordinator/engine/draft.h"
#include "kernels/kernels.h"

typedef struct shoal_model shoal_model;
typedef struct shoal_seq shoal_seq;

/* How the trunk (every non-expert weight) is held (docs/CONFIG.md --trunk-gb).
 * MAPPED (the default): the store's read-only mapping, the page cache decides.
 * Any other mode holds the trunk in owned memory read with pread (O_DIRECT
 * where possible), never through the mapping: the layers (and lm_head row
 * slices) that fit the budget are read once at open and stay resident, the
 * others are streamed from disk by a background thread into two buffers
 * (double-buffered, ahead of use), and each token's embedding row is read on
 * demand. Results are bit-identical to MAPPED at every budget. */
typedef enum {
    SHOAL_TRUNK_MAPPED = 0,
    SHOAL_TRUNK_BYTES,  /* trunk_budget bytes */
    SHOAL_TRUNK_SMALL,  /* the minimum that works: two buffers of the largest unit */
    SHOAL_TRUNK_MEDIUM, /* halfway between the minimum and fully resident */
    SHOAL_TRUNK_LARGE,  /* fully resident */
    SHOAL_TRUNK_AUTO,   /* from the cgroup limit and MemAvailable (common/memplan.h) */
} shoal_trunk_mode;

/* "--trunk-gb" value: small|medium|large|auto or GiB (fractions allowed, > 0).
 * 0 or SHOAL_EINVAL. */
int shoal_model_parse_trunk(const char *s, shoal_trunk_mode *mode, uint64_t *bytes);

typedef struct {
    /* Default capacity (tokens: prompt + generated) of a sequence created with
     * capacity 0, and the largest capacity allowed. Required, > 0. */
    int max_context;
    /* Most tokens one forward chunk runs: a longer prefill is split into
     * chunks of this size, and decode_batch takes at most this many sequences.
     * 0 means 256. Scratch grows linearly with it. */
    int max_batch;
    /* OpenMP threads for the process (omp_set_num_threads at open); 0 leaves
     * the OpenMP default. Results do not depend on it. */
    int threads;
    /* 1: the routed experts run elsewhere. Their tensors are neither required
     * nor bound here, and shoal_model_set_experts must be called before the
     * first forward (a forward without a backend fails with SHOAL_EINVAL). */
    int remote_experts;
    /* 1: no info logs at open (warnings and errors still go to stderr; the
     * trunk memory plan is printed whenever trunk_mode is not MAPPED). */
    int quiet;
    /* Trunk memory (see shoal_trunk_mode). trunk_budget: bytes for
     * SHOAL_TRUNK_BYTES: fp32 copies of the small vectors + resident units +
     * the two streaming buffers + the embedding row buffer (scratch and
     * sequence state are planned and printed apart). A budget below the
     * minimum is refused at open with SHOAL_ECONFIG naming the minimum. */
    shoal_trunk_mode trunk_mode;
    uint64_t trunk_budget;
    int trunk_no_direct;  /* 1: buffered reads (no O_DIRECT) */
    int trunk_timeout_ms; /* deadline of one streamed unit's read; 0 = 300 s */
    /* Where tokenizer_config.json (its eos_token, a stop id) is read from;
     * NULL: the model directory (`--tokenizer DIR`). */
    const char *tokenizer_dir;
} shoal_model_opts;

/* What a caller may need to know about an open model. Plain values; cfg is
 * borrowed and lives until shoal_model_close. */
typedef struct {
    const shoal_k3cfg *cfg;
    int vocab;       /* logits per token */
    int max_context; /* opts.max_context */
    int max_batch;   /* effective opts.max_batch */
    /* Stop ids: config.json eos_token_id, and tokenizer_config.json eos_token
     * resolved through its added_tokens_decoder (real K3: 163586 and 163585),
     * deduplicated, ascending. */
    int n_eos;
    int32_t eos[SHOAL_MAX_EOS];
    /* Per-sequence state: fixed part (KDA states + conv windows, fp32) and
     * bytes per token of capacity (MLA latent cache ĉ‖k_pe, fp32, all MLA
     * layers). */
    size_t seq_fixed_bytes;
    size_t seq_bytes_per_token;
    /* The forward's scratch (allocated once at open, for max_batch tokens and
     * max_context). */
    size_t scratch_bytes;
    /* Weight bytes one token reads in decode, outside the routed experts: every
     * trunk matrix and vector once, plus one embedding row (the table itself is
     * not read). */
    uint64_t trunk_bytes_per_token;
    /* Bytes of one routed expert's three matrices (w1, w3, w2, incl. scales). */
    uint64_t expert_bytes;
    shoal_expert_kind expert_kind;
    int remote_experts;
    /* Trunk memory plan (all 0 in SHOAL_TRUNK_MAPPED mode except trunk_mode). */
    shoal_trunk_mode trunk_mode;
    uint64_t trunk_budget;         /* the budget applied (bytes) */
    uint64_t trunk_min_bytes;      /* the smallest budget that works */
    uint64_t trunk_full_bytes;     /* the budget that holds everything resident */
    uint64_t trunk_resident_bytes; /* resident unit copies */
    uint64_t trunk_buffer_bytes;   /* the two streaming buffers */
    uint64_t trunk_stream_bytes;   /* bytes streamed per forward with logits */
    int trunk_units, trunk_units_resident;
    int trunk_direct;              /* O_DIRECT reads */
} shoal_model_info;

/* Counters, cumulative since open or the last reset. Updated by the forward. */
typedef struct {
    uint64_t tokens;       /* tokens run through the forward */
    uint64_t chunks;       /* forward chunks (a decode step is one chunk) */
    uint64_t trunk_bytes;  /* trunk weight bytes read: every matrix once per chunk */
    uint64_t expert_bytes; /* routed-expert bytes read: each distinct (layer, expert) once per chunk */
    uint64_t expert_pairs; /* (token, routed expert) pairs computed */
    double forward_s;      /* wall seconds inside the forward */
    double experts_s;      /* of which: between experts submit and gather return */
    /* trunk budget mode: bytes read from disk by the streaming reader and the
     * embedding rows since open (after the resident load) or reset, and the
     * seconds the forward waited for a streamed unit */
    uint64_t trunk_read_bytes;
    double trunk_stall_s;
    /* prefetch hints (shoal_model_set_prefetch), per MoE layer that got one:
     * experts hinted, of those the ones its routing then used, and the
     * distinct experts it used (accuracy = hinted_used / hinted) */
    uint64_t prefetch_hinted, prefetch_hinted_used, prefetch_used;
    /* remote trunk matmuls (shoal_model_set_rmat): requests (round trips:
     * one submit/gather, any number of workers) and the seconds spent
     * between submit and the end of gather */
    uint64_t rmat_requests;
    double rmat_s;
} shoal_model_stats;

/* A sequence's state for config c: fixed bytes (KDA states, conv windows)
 * and bytes per context token (MLA latent cache); what shoal_model_info
 * reports once open (`shoal serve` sizes its default --max-context with it
 * before opening). */
void shoal_model_seq_bytes(const shoal_k3cfg *c, size_t *fixed, size_t *per_token);

/* Open the model in dir (config.json, safetensors file(s) or index,
 * tokenizer_config.json optional). Validates the config, binds every tensor the
 * forward needs with shape and dtype checks (bf16 or f32 trunk; MXFP4 or
 * unquantized experts; vision tensors ignored) and refuses the model naming
 * every missing or mis-shaped tensor in err. Logs, per F32 tensor kind, how
 * many elements have non-zero low 16 bits (SPEC §3.9).
 * Returns 0, SHOAL_EMODEL / SHOAL_ECONFIG (invalid model), SHOAL_EINVAL (bad
 * opts), or -errno. On failure *out is NULL. */
int shoal_model_open(shoal_model **out, const char *dir, const shoal_model_opts *opts, char *err,
                     size_t errlen);
/* Closes the expert backend (vt->close) and unmaps everything. All sequences
 * of the model must be freed first. Accepts NULL. */
void shoal_model_close(shoal_model *m);

void shoal_model_get_info(const shoal_model *m, shoal_model_info *out);

/* A model file truncated while mapped (the forward would read a lost page:
 * SIGBUS). Every forward checks first and fails with SHOAL_EIO naming the
 * file (logged once per file); this is the same check for /health: 0, or
 * SHOAL_EIO with err naming the file, its size now and the size its tensors
 * need. Thread-safe (fstat only). */
int shoal_model_check_files(const shoal_model *m, char *err, size_t errlen);

/* The safety net for a file truncated between that check and the read: a
 * SIGBUS handler that writes one line naming the mapped file at the faulting
 * address and exits with status 4 (the fault arrives on whichever OpenMP
 * thread was reading, inside a kernel; nothing can be unwound from there).
 * One model is guarded at a time; NULL uninstalls. For serve and run. */
void shoal_model_guard(const shoal_model *m);
/* The trunk streaming reader's own counters since open (0 when the trunk is
 * mapped or fully resident): bytes it read from disk and the seconds forwards
 * waited for a streamed unit. Unlike shoal_model_get_stats, safe to call from
 * any thread while forwards run (for /metrics); embedding rows are not
 * included (one row per token). */
void shoal_model_trunk_counters(const shoal_model *m, uint64_t *read_bytes, double *stall_s);
/* The model's tensor store (borrowed, lives until close): an in-process or
 * test backend may read expert views from it. */
const shoal_st *shoal_model_store(const shoal_model *m);

/* Replace the routed-expert backend. The model takes ownership of *b: it calls
 * b->vt->close(b->self) at model close or when replaced, and zeroes *b. The
 * backend sees submit(layer, T, k, z, ids) for every MoE layer of every chunk,
 * with T <= max_batch and k = cfg->experts_per_token. Not while a forward
 * runs. Returns 0 or SHOAL_EINVAL. */
int shoal_model_set_experts(shoal_model *m, shoal_experts *b, char *err, size_t errlen);

/* Remote trunk matmuls (coordinator/engine/rmat.h): every matrix the forward
 * applies with the matrix kernels for which b->vt->has() says 1 is computed
 * by b from then on. The model takes ownership of *b as with set_experts
 * (closed at model close or when replaced; *b zeroed). *nremote (may be
 * NULL): how many matrices went remote. Needs the mapped trunk (no
 * --trunk-gb budget: SHOAL_ECONFIG). Not while a forward runs. 0 or a code. */
int shoal_model_set_rmat(shoal_model *m, shoal_rmat *b, int *nremote, char *err, size_t errlen);

/* Prefetch hints on (1) or off (0, the default at open): after submitting MoE
 * layer L, the forward applies the next MoE layer's router (with its
 * selection bias) to layer L's FFN input, takes each token's top-k, and hands
 * the union to the backend's hint() (PROTOCOL.md PREFETCH), so workers that
 * read experts from disk start early. Results are unchanged (the hint only
 * moves reads); the cost is one router GEMV per token and MoE layer. A backend
 * without hint() makes this a no-op. Not while a forward runs. */
void shoal_model_set_prefetch(shoal_model *m, int on);

void shoal_model_get_stats(const shoal_model *m, shoal_model_stats *out);
void shoal_model_reset_stats(shoal_model *m);

/* Cooperative cancellation: when *flag is non-zero at a chunk boundary, the
 * running prefill/decode returns SHOAL_ECANCELED. The sequence then holds
 * exactly the chunks that completed (shoal_seq_pos says how many tokens); it
 * is consistent and may be continued, reset or overwritten. flag is borrowed
 * until replaced (NULL disables). */
void shoal_model_set_cancel(shoal_model *m, const atomic_int *flag);

/* Monitoring (docs/METRICS.md): the forward adds its time by phase to cm
 * (shoal_cmetrics_add_phase, shoal_cmetrics_forward) and records every routing
 * decision in trace (shoal_trace_record). Both borrowed until replaced; NULL
 * disables either. Not while a forward runs. */
void shoal_model_set_monitor(shoal_model *m, shoal_cmetrics *cm, shoal_trace *trace);

/* ---- sequences ---------------------------------------------------------- */

/* A fresh sequence (position 0) with room for capacity tokens (0: the model's
 * max_context; more than max_context is refused). Allocates its whole state
 * here: seq_fixed_bytes + capacity * seq_bytes_per_token. The sequence borrows
 * the model, which must outlive it. */
int shoal_seq_create(shoal_seq **out, shoal_model *m, int capacity, char *err, size_t errlen);
void shoal_seq_free(shoal_seq *s); /* accepts NULL */
/* Back to position 0 (states zeroed). No allocation. */
void shoal_seq_reset(shoal_seq *s);
int shoal_seq_pos(const shoal_seq *s);      /* tokens processed so far */
int shoal_seq_capacity(const shoal_seq *s); /* tokens it can hold */
size_t shoal_seq_bytes(const shoal_seq *s); /* state bytes it owns */

/* Keep / restore / fork for prefix reuse. KDA state is recurrent, so a prefix
 * cannot be "truncated" back: keep a copy taken at the position to return to.
 * copy: dst becomes an exact copy of src (same model; dst capacity must be >=
 * src's position, else SHOAL_ERANGE). No allocation; O(state at src pos).
 * fork: create (capacity 0 = max_context, else >= src pos) + copy. */
int shoal_seq_copy(shoal_seq *dst, const shoal_seq *src, char *err, size_t errlen);
int shoal_seq_fork(shoal_seq **out, const shoal_seq *src, int capacity, char *err, size_t errlen);

/* A sequence's state as bytes, for prefix caches and state files
 * (coordinator/pcache/pcache.h). The layout, in host float order (little-endian
 * on every supported target): the KDA states [num_kda, H, D, D], the conv
 * windows [num_kda, 3, K-1, C], then per MLA layer the rows of positions
 * 0..pos ([num_mla, pos, R + P]) -- exactly the values a forward reads, so a
 * sequence imported from an export continues bit for bit as the exported one
 * would. state_size: seq_fixed_bytes + pos * seq_bytes_per_token.
 * export: s's state at its position into buf[n] (n must equal
 * state_size(pos); a broken sequence is refused). import: s becomes the
 * sequence at pos (<= its capacity) holding buf[n] (n == state_size(pos));
 * clears any broken mark and rewind reach. Neither allocates nor runs the
 * forward; the bytes are not checked (the caller verifies a file's checksum
 * before importing it). 0, SHOAL_EINVAL or SHOAL_ERANGE. */
size_t shoal_seq_state_size(const shoal_model *m, int pos);
int shoal_seq_export(const shoal_seq *s, void *buf, size_t n, char *err, size_t errlen);
int shoal_seq_import(shoal_seq *s, int pos, const void *buf, size_t n, char *err, size_t errlen);

/* ---- forward ------------------------------------------------------------ */

typedef enum {
    SHOAL_LOGITS_NONE = 0, /* logits may be NULL */
    SHOAL_LOGITS_LAST = 1, /* logits[vocab]: the last token's */
    SHOAL_LOGITS_ALL = 2,  /* logits[n, vocab]: every token's (teacher forcing) */
} shoal_logits_mode;

/* Run n >= 1 tokens of s at positions pos..pos+n-1 (batched, in chunks of
 * max_batch: GEMMs over the chunk, each routed expert's weights read once per
 * chunk for all tokens routed to it) and append them to the state. Ids must be
 * in [0, vocab) and pos+n <= capacity (checked before anything runs: on such an
 * error the sequence is unchanged). Cancellation (checked between chunks)
 * leaves the sequence consistent, holding the completed chunks. A failure
 * inside a chunk (the expert backend) leaves its state half-updated: the
 * sequence is then marked broken and every forward on it fails with
 * SHOAL_EINVAL until shoal_seq_reset or a shoal_seq_copy into it. */
int shoal_seq_prefill(shoal_seq *s, const int32_t *ids, int n, shoal_logits_mode mode, float *logits,
                      char *err, size_t errlen);
/* One token; logits[vocab] receives its logits (may be NULL). Same as a
 * prefill of one token, bit for bit. Never allocates. */
int shoal_seq_decode(shoal_seq *s, int32_t id, float *logits, char *err, size_t errlen);
/* One token for each of n distinct sequences of this model in one chunk
 * (n <= max_batch): ids[i] goes to seqs[i]; logits[n, vocab] (may be NULL).
 * Each sequence's result is bit-identical to shoal_seq_decode on it alone.
 * Validation is done for all before anything runs. */
int shoal_model_decode_batch(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int n, float *logits,
                             char *err, size_t errlen);
/* One chunk of n tokens (n <= max_batch) over any mix of sequences: a
 * decode token for some, a prompt chunk for others (the continuous-batching
 * step). Token i is ids[i] for seqs[i], at that sequence's position plus the
 * number of its earlier tokens in the chunk; a sequence's tokens must be
 * adjacent. logits[nrows, vocab] receives the logits of tokens rows[0..nrows)
 * (strictly increasing; logits NULL or nrows 0: none). Every sequence's state and every
 * logits row are bit-identical to feeding that sequence's tokens alone.
 * Validation is done for all before anything runs; a failure inside the
 * chunk marks every sequence in it broken. */
int shoal_model_step(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int n, const int *rows, int nrows,
                     float *logits, char *err, size_t errlen);

/* ---- rewind: verify a chunk, keep only a prefix of it (speculative decoding) */

/* Room for a verify chunk of up to n + 1 tokens to be cut back to any of
 * its prefixes (allocated here, never in the forward): one copy of the KDA
 * states and conv windows (seq_fixed_bytes) for the state before the chunk,
 * and per token and KDA layer the inputs of its delta-rule step and its
 * pre-conv rows (7 C + H floats, C = kda_heads x kda_head_dim). n in [0,
 * max_batch); a smaller n than already reserved keeps the room. */
int shoal_seq_reserve_rewind(shoal_seq *s, int n, char *err, size_t errlen);
/* The bytes shoal_seq_reserve_rewind(s, n) adds to a sequence of model m. */
size_t shoal_model_rewind_bytes(const shoal_model *m, int n);
/* A prefill of n tokens in one chunk (1 <= n <= max_batch, n - 1 <= the
 * reserved room) with every position's logits in logits[n, vocab], that also
 * keeps the state after each of its first n - 1 tokens. Bit-identical to
 * shoal_seq_prefill (and so to decoding the tokens one by one). */
int shoal_seq_verify(shoal_seq *s, const int32_t *ids, int n, float *logits, char *err, size_t errlen);
/* Cut the last verify chunk (started at position b) back to position pos,
 * b < pos <= current: the state becomes exactly the one after its first
 * pos - b tokens, as if the rest had never run (the KDA states before the
 * chunk restored and its first pos - b delta-rule steps replayed with the
 * kept inputs -- the same kernel on the same values, so the same bits -- and
 * the conv windows rebuilt from the kept rows; the MLA rows past pos are
 * dead). pos equal to the current position is a no-op. Any other forward on
 * s, a reset or a copy into s ends the chunk's reach (then SHOAL_ERANGE).
 * Cost: one seq_fixed_bytes copy plus pos - b KDA steps per KDA layer; it
 * runs kernels (OpenMP), so call it from the thread that runs s's forwards. */
int shoal_seq_rewind(shoal_seq *s, int pos, char *err, size_t errlen);

/* ---- speculative decoding (draft.h drafts; spec.c verifies) --------------- */

/* A drop-in for shoal_seq_decode that drafts and verifies (issue 21). One
 * object per sequence (a slot, a run). Each call feeds one token and returns
 * its logits -- the same logits, bit for bit, as shoal_seq_decode would -- so
 * the caller samples and checks stops exactly as in plain decoding (the
 * sampler's draws are the same ones in the same order: same ids, greedy or
 * seeded). Behind the call: when nothing drafted is pending, the drafter
 * proposes up to K tokens that continue hist (shoal_drafter_propose), and the
 * fed token and the drafts run as one chunk (shoal_seq_verify: one pass over
 * the trunk, one expert exchange per layer for all of them); while the next
 * fed token equals the next draft, its logits come from that chunk without a
 * forward; a fed token that differs cuts the chunk back (shoal_seq_rewind) and
 * starts a new one. The sequence may therefore hold drafted tokens past the
 * fed ones: call shoal_spec_settle before using the sequence any other way
 * (copy, keep, plain decode, reset). */
typedef struct shoal_spec shoal_spec;

typedef struct {
    uint64_t fed;         /* tokens fed through shoal_spec_decode */
    uint64_t passes;      /* forwards it ran (plain and verify) */
    uint64_t verifies;    /* of which: verify chunks with at least one draft */
    uint64_t drafted;     /* tokens drafted into verify chunks */
    uint64_t accepted;    /* of those, fed next (their logits came free) */
    uint64_t rewinds;     /* verify chunks cut back */
    uint64_t shadowed;    /* K was 0: drafts proposed but not verified (draft.h 3.) */
    uint64_t shadow_hits; /* of those, equal to the token fed next */
    double rewind_s;      /* seconds in shoal_seq_rewind */
} shoal_spec_stats;

/* For sequence s (borrowed; it must outlive the object): reserves rewind
 * room on s for opts->max drafts and a [max + 1, vocab] logits buffer. opts
 * are checked (shoal_drafter_create). */
int shoal_spec_create(shoal_spec **out, shoal_seq *s, const shoal_draft_opts *opts, char *err, size_t errlen);
void shoal_spec_free(shoal_spec *sp); /* accepts NULL */
/* The bytes a spec object made with opts adds to its sequence (rewind room
 * and verify logits); 0 when drafting is off. For state budgets. */
size_t shoal_spec_bytes(const shoal_model *m, const shoal_draft_opts *opts);
/* A new generation on the sequence (after the caller reset, prefilled or
 * copied into it): forget pending drafts and the acceptance history. */
void shoal_spec_begin(shoal_spec *sp);
/* Feed hist[n - 1] (hist[0..n - 1) are the tokens the sequence already holds,
 * prompt and generated, n - 1 == the fed position) and write its logits into
 * logits[vocab]. limit: drafts beyond this many more tokens are useless (the
 * caller stops by then); 0 turns drafting off for this call. Returns 0 or the
 * forward's code (cancel: SHOAL_ECANCELED, the sequence then holds the fed
 * tokens before hist[n - 1]). */
int shoal_spec_decode(shoal_spec *sp, const int32_t *hist, int n, int limit, float *logits, char *err,
                      size_t errlen);
/* Told the k drafted ids (drafts[0..k), k >= 1) that follow the fed token,
 * on the thread that calls shoal_spec_decode, just before their verify
 * forward runs (the scheduler computes the structured-output masks of the
 * verify rows while it runs). The array is valid during the call only. */
typedef void (*shoal_spec_hook)(void *ctx, const int32_t *drafts, int k);
void shoal_spec_set_hook(shoal_spec *sp, shoal_spec_hook fn, void *ctx); /* fn NULL: none */
/* Drop pending drafts: the sequence then holds exactly the fed tokens.
 * Accepts NULL (nothing to do). */
int shoal_spec_settle(shoal_spec *sp, char *err, size_t errlen);
void shoal_spec_get_stats(const shoal_spec *sp, shoal_spec_stats *out);
/* The drafter's current K (adapted to the recent acceptance). */
int shoal_spec_k(const shoal_spec *sp);

/* Allocations seen by the engine's guard while a forward was running (with
 * SHOAL_ALLOC_GUARD=abort the first aborts instead; 0 in a correct build). */
uint64_t shoal_engine_alloc_count(void);

#endif
