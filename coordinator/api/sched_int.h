/* Scheduler internals shared by jobs.c (jobs and their events, the fair
 * queue, the response memo, kept sequence states: data and locks, no thread)
 * and sched.c (the scheduler itself: open/close and the model thread --
 * render, prefill, decode, output). sched.c calls into jobs.c, never the
 * reverse. Only these two files and the scheduler's unit test include it. */
#ifndef SHOAL_SCHED_INT_H
#define SHOAL_SCHED_INT_H

#include <pthread.h>

#include "coordinator/api/sched.h"
#include "coordinator/text/text.h"

#define SHOAL_SCHED_CLIENTS 256
#define SHOAL_SCHED_MAX_KEPT 64
#define SHOAL_SCHED_MAX_MEMO 4096
#define SHOAL_SCHED_RENDER_THREADS 2

struct shoal_sched_job {
    atomic_int refs;
    shoal_gen_params p;
    char client[256];
    char memo_key[72];
    int has_memo;
    void (*notify)(void *arg);
    void *arg;
    pthread_mutex_t mu; /* head/tail, canceled, ended */
    shoal_ev *head, *tail;
    int canceled, ended;
    atomic_int cancel;  /* read by the model thread and the engine's chunk loop */
    /* the scheduler's step_seq when the first cancel came (0: none), and
     * when the job's render was done (under mu): a slot a cancel vacates
     * goes to a waiting job at the next step boundary (sched.c, release) */
    _Atomic uint64_t cancel_step;
    uint64_t ready_step;
    _Atomic uint64_t cancel_ns; /* shoal_metrics_now_ns() at the first cancel (written before cancel_step) */
    uint64_t ready_ns;
    /* queue links, under the scheduler's mu */
    shoal_sched_job *qnext, *qprev;
    int queued;
    uint64_t t_submit; /* shoal_metrics_now_ns() at submit */
    shoal_sched_job *fork_of; /* n choices: the job whose prompt state this one copies (a reference) */
    /* The rendered prompt, written by the render thread while rstate is
     * RENDER_BUSY, read by the model thread once it is RENDER_DONE (rstate
     * under the scheduler's mu). rrc: 0, or the render's error code with the
     * message in rerr. */
    int rstate;
    int32_t *rids;
    int rn, rrc;
    char rerr[320];
};

enum { SHOAL_RENDER_NONE = 0, SHOAL_RENDER_BUSY, SHOAL_RENDER_DONE };

typedef struct {
    char key[72];
    shoal_ev *events;
    size_t bytes;
    uint64_t last;
} shoal_memo_entry;

typedef struct {
    int32_t *ids;
    int n;
    shoal_seq *seq;  /* state after ids[0..n) */
    float *logits;   /* the last token's logits */
    size_t bytes;
    uint64_t last;
} shoal_kept;

typedef struct shoal_slot shoal_slot;

struct shoal_sched {
    shoal_sched_opts o;
    int vocab, max_context, n_eos;
    int32_t eos[SHOAL_MAX_EOS];
    shoal_cons_vocab *cvocab; /* the vocabulary trie, built at the first constrained request (model thread) */
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;     /* the model thread: a rendered job, or stopping */
    int stopping;
    /* render threads: render queued jobs (chat template + tokenizer) so that
     * no request's rendering, however large, stalls the model thread's steps;
     * two, so a small request is rendered beside a large one, not after it */
    pthread_t render_threads[SHOAL_SCHED_RENDER_THREADS];
    pthread_cond_t rcv;    /* the render threads: a job to render, or stopping */
    int render_started;    /* threads started */
    /* queue */
    shoal_sched_job *qhead, *qtail;
    int nqueued, running;
    int nready;            /* queued jobs already rendered (RENDER_DONE) */
    struct {
        int used;
        char key[256];
        uint64_t last;
    } clients[SHOAL_SCHED_CLIENTS];
    uint64_t serve_tick;
    shoal_sched_stats st;
    /* kept sequences: entries written by the model thread only (counters under mu) */
    shoal_kept kept[SHOAL_SCHED_MAX_KEPT];
    int nkept;
    size_t kept_bytes;
    uint64_t kept_tick;
    /* memo, under memo_mu */
    pthread_mutex_t memo_mu;
    shoal_memo_entry memo[SHOAL_SCHED_MAX_MEMO];
    int nmemo;
    size_t memo_bytes;
    uint64_t memo_tick, memo_hits, memo_misses;
    /* model thread */
    shoal_slot *slots;
    int nslots;
    int step_tokens;
    size_t seq_fixed, seq_per_token; /* shoal_model_info's */
    size_t spec_extra;               /* bytes drafting adds to a sequence (rewind room, verify logits); 0 when off */
    size_t state_used;     /* bytes of the slots' sequences (under mu for stats) */
    int waiting_state;
    uint64_t admit_tick;
    int max_batch;         /* the model's: tokens in one step's chunk */
    int32_t eom_id;        /* <|end_of_msg|> (message ends: prefix captures), -1 when the tokenizer has none */
    float *blogits;        /* [nslots, vocab]: one step's logits rows */
    shoal_seq **bseqs;     /* [max_batch]: the step chunk's sequence per token */
    int32_t *bids;         /* [max_batch]: and its id */
    int *brows;            /* [nslots]: chunk tokens whose logits the step wants */
    shoal_slot **bslots;   /* [nslots]: the slot of each logits row */
    shoal_slot **pslots;   /* [nslots]: prompt chunks in the step, and their lengths */
    int *pn;               /* [nslots] */
    atomic_int abort;      /* close: stops a running step */
    /* structured output, overlap (issue 36): the masks for the slots'
     * next samples are computed on the mask thread while the step's forward
     * runs (a mask depends only on the ids already accepted); the model
     * thread hands the slots over before the forward (mslots[0..mn)) and
     * joins after it, so the constraints are never touched by both at once */
    pthread_t mask_thread;
    int mask_started;      /* 0: masks are computed at sampling time */
    int mask_always;       /* --mask-thread on: hand over at every step */
    uint64_t fwd_ns_last;  /* the last step's forward (wall): hand over only
                            * when it is long enough to hide a mask and the
                            * thread's wake-up (SHOAL_SCHED_MASK_FWD_NS) */
    pthread_mutex_t mask_mu;
    pthread_cond_t mask_cv;      /* the mask thread: work, or stopping */
    pthread_cond_t mask_done_cv; /* the model thread: the work is done */
    int mask_work, mask_stop;    /* under mask_mu */
    int vmask_work;              /* under mask_mu: vslot's verify rows (after mask_work) */
    struct shoal_slot *vslot;
    shoal_slot **mslots;   /* [nslots]: slots whose next mask is due */
    int mn;
    /* step boundaries passed (the model thread counts one at the top of each
     * turn of its loop); read by shoal_sched_cancel and the render threads */
    _Atomic uint64_t step_seq;
};

void shoal__sched_emit(shoal_sched_job *j, shoal_ev *e);
/* The fair choice among rendered queued jobs, out of the queue; NULL if none. s->mu held. */
shoal_sched_job *shoal__sched_pop_fair(shoal_sched *s);
/* The fair choice among queued jobs not rendered yet, marked RENDER_BUSY with
 * a reference for the renderer (it stays queued: a cancel may still take it
 * out); NULL if none. s->mu held. */
shoal_sched_job *shoal__sched_pick_render(shoal_sched *s);
/* A picked job's render is stored: RENDER_DONE, the model thread woken. s->mu held. */
void shoal__sched_render_done(shoal_sched *s, shoal_sched_job *j);
void shoal__sched_memo_put(shoal_sched *s, const char *key, shoal_ev *events, size_t bytes);
int shoal__sched_kept_find(shoal_sched *s, const int32_t *ids, int n);
void shoal__sched_kept_put(shoal_sched *s, const int32_t *ids, int n, const shoal_seq *seq, const float *logits);
void shoal__sched_count(shoal_sched *s, const shoal_sched_stats *add);
/* Close: stop accepting, cancel and release every queued job. */
void shoal__sched_queue_stop(shoal_sched *s);
/* Close, after the model thread ended: free the kept states and the memo. */
void shoal__sched_store_free(shoal_sched *s);
size_t shoal__sched_ev_bytes(const shoal_ev *e);
shoal_ev *shoal__sched_ev_new(shoal_ev_type t);
shoal_ev *shoal__sched_ev_clone(const shoal_ev *e);

/* sched.c */
/* Picks and renders one queued job (what the render thread does each turn);
 * 0 when none was waiting, 1 otherwise. Any thread; takes s->mu. */
int shoal__sched_render_next(shoal_sched *s);
/* Test entry: runs the model thread's output path (chat parser or
 * detokenizer, stop strings, events, memo) over given ids as if they had
 * been sampled, without a forward. The job gets START (prompt 0 tokens), the
 * events, DONE. Call while the scheduler is idle. Returns 0 or an error. */
int shoal__sched_replay(shoal_sched *s, shoal_sched_job *j, const int32_t *ids, int n);

#endif
