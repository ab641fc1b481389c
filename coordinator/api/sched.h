/* Scheduler: owns the model thread and everything between a validated API
 * request and the stream of events it produces. It keeps a bounded, fair queue
 * of jobs, renders their prompts (chat template + tokenizer) on its render
 * threads, runs them on its one model thread (prefill,
 * decode, sample, detokenise, parse reasoning and tool calls, stop strings),
 * keeps recent sequences' states for conversation reuse, and memoises the
 * events of deterministic requests. Callers: the API layer (coordinator/api/api.c)
 * and tests. The model path runs only on the scheduler's thread.
 *
 * The step loop (continuous batching): the model thread holds opts.slots
 * slots. Each turn it admits queued jobs already rendered into free slots
 * (check the rendered prompt against the context, then admit its sequence state against opts.state_bytes: a job that does not
 * fit waits, first in line, until enough state is freed), then runs one step:
 * one token for every decoding slot in one shoal_model_decode_batch (so the
 * routed experts of all of them go to the backend together, one exchange per
 * worker per MoE layer), then prompt chunks of the prefilling slots, oldest
 * admission first, up to the step's token budget (opts.step_tokens less the
 * decode tokens, and at least half of it), so a long prompt does not freeze
 * the other streams. A job that ends (done, error, cancel) leaves its slot at
 * once and the slot is free for the next turn. Every slot has its own sampler
 * (its own seeded RNG) and output state, and the engine's decode_batch and
 * chunked prefill are bit-identical per sequence to running alone, so each
 * request's ids do not depend on what else runs.
 *
 * Fairness: the queue is served round-robin across client keys (the API uses
 * the peer address plus the request's `user`): the next job is the oldest one
 * of the client served least recently, so one client's burst cannot starve the
 * others; within a client, jobs run in arrival order. Two render threads take
 * queued jobs in the same order (a small request is rendered beside a large
 * one, not after it); rendering is linear in the
 * request's size (docs/CONFIG.md, "Resource bounds") and never runs on the
 * model thread, so a 4 MB request delays no running stream.
 *
 * Threads: shoal_sched_open/close and every function below may be called from
 * any one thread (the API calls them from the HTTP loop thread) unless noted;
 * the notify callback of a job runs on the model thread. Jobs are reference
 * counted; events are taken by the owner with shoal_sched_job_take. */
#ifndef SHOAL_SCHED_H
#define SHOAL_SCHED_H

#include <jansson.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "coordinator/engine/engine.h"
#include "coordinator/text/text.h"

#define SHOAL_MAX_STOP 4
#define SHOAL_MAX_STOP_BYTES 256

typedef enum { SHOAL_GEN_CHAT = 0, SHOAL_GEN_COMPLETION = 1 } shoal_gen_kind;

/* A validated request (the API checked types and ranges). Owned by the job
 * once submitted; shoal_gen_params_free releases what it points to. */
typedef struct {
    shoal_gen_kind kind;
    /* chat */
    json_t *messages;       /* array of OpenAI message objects (a reference is owned) */
    json_t *tools;          /* array of OpenAI tool objects, or NULL */
    json_t *tool_choice;    /* "none" | "auto" | "required" | {function}, or NULL */
    int max_tool_calls;     /* calls in one reply at most (1: parallel_tool_calls false); 0 = any */
    json_t *response_format; /* {"type": "json_object" | "json_schema", ...}, or NULL */
    int thinking;           /* 1: think before answering (K3 default), 0: off */
    char effort[16];        /* "" or low / medium / high / max (thinking effort) */
    /* completion */
    char *prompt;           /* UTF-8 text (NUL-terminated), or NULL when prompt_ids */
    size_t prompt_len;
    int32_t *prompt_ids;    /* token ids, checked against the vocabulary */
    int n_prompt_ids;
    /* both */
    int max_tokens;         /* > 0; 0 = until the context is full */
    float temperature;      /* >= 0; 0 = greedy */
    float top_p;            /* (0, 1] */
    int top_k;              /* >= 0; 0 = off */
    uint64_t seed;
    int nstop;
    char *stop[SHOAL_MAX_STOP];
    int return_token_ids;   /* shoal extension: report prompt and output ids */
    /* sampling adjustments (coordinator/engine/sampler.h) */
    float min_p;              /* [0, 1]; 0 = off */
    float presence_penalty;   /* [-2, 2] */
    float frequency_penalty;  /* [-2, 2] */
    float repetition_penalty; /* (0, ...]; 1 = off */
    shoal_logit_bias *bias;   /* nbias entries (owned) */
    int nbias;
    /* log-probabilities: 1 = one SHOAL_EV_LOGPROB per sampled id with the
     * log-softmax of the raw logits (before bias, penalties, temperature) */
    int logprobs;
    int top_logprobs;         /* 0..20 alternatives per id */
    int partial;              /* chat: the last message is an assistant turn to continue (Moonshot partial mode) */
    /* structured output enforced while sampling (coordinator/text/constrain.h's
     * normalised spec: {"kind": "json"|"regex"|"choice", ...}), or NULL. The API
     * compiled it once to refuse what the compiler refuses. */
    json_t *constraint;
} shoal_gen_params;

void shoal_gen_params_free(shoal_gen_params *p);
/* A deep copy (n choices: one job each). Returns 0. */
int shoal_gen_params_copy(shoal_gen_params *dst, const shoal_gen_params *src);

typedef enum {
    SHOAL_EV_START = 0, /* prompt rendered and admitted: prompt_tokens, reused_tokens (prompt
                         * tokens not prefilled: from a kept sequence or the prefix cache;
                         * the value for OpenAI cached_tokens, Anthropic cache_read_input_tokens) */
    SHOAL_EV_TEXT,      /* text of one channel */
    SHOAL_EV_TOOL,      /* a tool call starts (name) or grows (arguments text) */
    SHOAL_EV_DONE,      /* the end: finish reason and counts */
    SHOAL_EV_ERROR,     /* the end: status, code, param, message */
    SHOAL_EV_LOGPROB,   /* one sampled id's log-probability (with logprobs), before its text */
} shoal_ev_type;

#define SHOAL_MAX_TOP_LOGPROBS 20

typedef enum { SHOAL_CH_CONTENT = 0, SHOAL_CH_REASONING = 1 } shoal_channel;

typedef struct shoal_ev {
    shoal_ev_type type;
    shoal_channel channel; /* TEXT */
    int tool_index;        /* TOOL: 0-based call index */
    char *name;            /* TOOL: set on the first event of a call */
    char *text;            /* TEXT: UTF-8 (never a split sequence); TOOL: arguments piece */
    size_t len;
    /* START */
    int prompt_tokens, reused_tokens;
    /* DONE */
    char finish[16];       /* "stop" | "length" | "tool_calls" */
    int stop_index;        /* the stop string that ended it (index into stop[]), or -1 */
    int completion_tokens, reasoning_tokens;
    int32_t *prompt_ids, *output_ids; /* DONE, only with return_token_ids */
    int n_prompt_ids, n_output_ids;
    /* LOGPROB: the id, its log-probability, the top alternatives. text/len
     * hold the bytes of the id (tok_len of them) then of each alternative
     * (top_len[i] each); a token's bytes may be a partial UTF-8 sequence */
    int32_t id;
    double logprob;
    int ntop, tok_len;
    int32_t top_ids[SHOAL_MAX_TOP_LOGPROBS];
    double top_lp[SHOAL_MAX_TOP_LOGPROBS];
    int top_len[SHOAL_MAX_TOP_LOGPROBS];
    /* ERROR */
    int status;
    char code[40];
    char param[40];
    char message[256];
    struct shoal_ev *next;
} shoal_ev;

void shoal_ev_free_list(shoal_ev *e);

typedef struct shoal_sched shoal_sched;
typedef struct shoal_sched_job shoal_sched_job;

enum { SHOAL_MASK_THREAD_AUTO = 0, SHOAL_MASK_THREAD_ON, SHOAL_MASK_THREAD_OFF };

typedef struct {
    shoal_model *model;      /* borrowed; the scheduler runs its forward */
    const shoal_tok *tok;    /* borrowed */
    int queue_size;          /* waiting jobs at most (more -> SHOAL_EBUSY); > 0 */
    int slots;               /* sequences decoded together, 1..max_batch of the model */
    /* Tokens one step may run (decode tokens + prompt chunk tokens); 0: the
     * model's max_batch. Prompt chunks get what the decode tokens leave, and
     * at least half of it. */
    int step_tokens;
    /* Bytes of sequence state (shoal_model_info seq_fixed_bytes + capacity *
     * seq_bytes_per_token; capacity = prompt + max_tokens) the slots may hold
     * at once; 0: no limit. Must hold one max_context sequence. */
    size_t state_bytes;
    int keep_seqs;           /* conversation reuse: kept states (0: off) */
    size_t keep_bytes;       /* bytes the kept states may use (0: off) */
    int memo_entries;        /* response memo (0: off) */
    size_t memo_bytes;
    /* OpenMP threads of the model thread (0: OpenMP's default). OpenMP's
     * thread count is a per-thread setting, so the one given to
     * shoal_model_open on another thread does not reach the model thread. */
    int threads;
    /* Coordinator metrics (borrowed; NULL: none): the scheduler adds the
     * sampler's time to the SAMPLING phase. */
    struct shoal_cmetrics *cm;
    /* Speculative decoding of every request (engine.h shoal_spec_decode;
     * mode 0 = off): same ids, fewer passes when drafts hit. */
    shoal_draft_opts draft;
    /* Structured-output masks on a mask thread while the forward runs
     * (issue 36; the same masks either way): SHOAL_MASK_THREAD_AUTO (0,
     * the default) when the last forward took >= 10 ms, _ON at every step,
     * _OFF never (each mask computed at sampling time, after the forward). */
    int mask_thread;
    /* Prefix cache (coordinator/pcache/pcache.h; borrowed, used only on the
     * model thread; NULL: off). A prompt resumes from its longest captured
     * prefix (when longer than a kept sequence's) and prefills only the
     * rest; while prefilling, the state is captured at the end of every
     * message (after each <|end_of_msg|> id: system prompt, tool
     * declarations, each turn) and every pcache_stride tokens (0: no stride
     * captures) -- a prompt chunk ends there, which changes no bits. A
     * request whose prompt shares a prefix with one being prefilled, up to
     * a capture point not reached yet, waits for that capture instead of
     * computing the prefix again. The memory tier counts against
     * state_bytes: captures only use what the slots leave, and are evicted
     * when a request needs the room. */
    struct shoal_pcache *pcache;
    int pcache_stride;
} shoal_sched_opts;

typedef struct {
    uint64_t submitted, refused_full, completed, canceled, failed;
    uint64_t prompt_tokens, completion_tokens, reused_tokens;
    uint64_t prefilled_tokens;  /* prompt tokens run through the forward (not reused) */
    uint64_t cache_waits;       /* requests that waited for another's prefix capture */
    uint64_t memo_hits, memo_misses, memo_entries, memo_bytes;
    uint64_t kept_seqs, kept_bytes;
    uint64_t state_bytes;    /* sequence state held by the slots now */
    uint64_t state_waits;    /* jobs that waited for state to be freed */
    uint64_t state_budget;   /* opts.state_bytes (0: no limit) */
    int slots;               /* opts.slots */
    int queued, running;
    int waiting_state;       /* 1 while the first in line waits for state */
    /* slots vacated by a cancel (a client gone) and taken by a request that
     * was waiting for one, and the most step boundaries such a request waited
     * after the cancel (or after its render, whichever came later): 1 means
     * at the first boundary after the cancel (docs/API.md, "Cancellation") */
    uint64_t handovers, handover_steps_max;
    uint64_t handover_ns_last; /* the last such request: ns from the cancel (or its render) to its admission */
} shoal_sched_stats;

int shoal_sched_open(shoal_sched **out, const shoal_sched_opts *o, char *err, size_t errlen);
/* Cancels every job (queued ones get no further event; the running one stops
 * at its next step), joins the model thread, frees the kept states and the
 * memo. Accepts NULL. */
void shoal_sched_close(shoal_sched *s);
void shoal_sched_get_stats(shoal_sched *s, shoal_sched_stats *out);

/* A job for *params (ownership taken: *params is zeroed). notify(arg) runs
 * on the model thread whenever events become available after the job's queue
 * was empty; it must not block (the API posts to the HTTP loop). client is
 * the fairness key (copied). memo_key (copied, may be NULL) marks the request
 * deterministic: its events are stored under that key when it completes. The
 * job starts with one reference, the caller's. */
shoal_sched_job *shoal_sched_job_new(shoal_gen_params *params, const char *client, const char *memo_key,
                                     void (*notify)(void *arg), void *arg);
/* n choices of one request: child (a job with the same prompt) takes the
 * prompt's state from parent once parent's prompt is prefilled, instead of
 * prefilling it again (shoal_seq_copy: bit-identical). Call before either is
 * submitted, parent first in the queue. Takes a reference on parent. */
void shoal_sched_job_fork_of(shoal_sched_job *child, shoal_sched_job *parent);
void shoal_sched_job_ref(shoal_sched_job *j);
/* Drops a reference; the last one frees the job (any thread). */
void shoal_sched_job_unref(shoal_sched_job *j);
/* Takes the events produced so far (caller frees with shoal_ev_free_list);
 * NULL when none. After an END event (DONE or ERROR) nothing more comes. */
shoal_ev *shoal_sched_job_take(shoal_sched_job *j);

/* Queues the job (the scheduler takes its own reference). Returns 0, or
 * SHOAL_EBUSY when the queue is full (nothing is queued). */
int shoal_sched_submit(shoal_sched *s, shoal_sched_job *j);
/* The client is gone: a queued job leaves the queue at once (its place is
 * free), a running one stops at its next token. No further events are
 * produced. Idempotent. */
void shoal_sched_cancel(shoal_sched *s, shoal_sched_job *j);

/* The prompt p renders to, in tokens, as admission would count it (chat:
 * messages, tools, switches, a partial last turn; completion: the prompt). Returns 0,
 * or a negative code with the renderer's message naming the field. Uses only
 * the tokenizer (immutable): any thread. */
int shoal_sched_prompt_tokens(shoal_sched *s, const shoal_gen_params *p, int *n, char *err, size_t errlen);

/* Response memo: the events stored under key (a deep copy, caller frees), or
 * NULL. Thread-safe. */
shoal_ev *shoal_sched_memo_get(shoal_sched *s, const char *key);

#endif
