/* jobs: the scheduler's data (see sched.h, sched_int.h): jobs and their
 * events, the fair bounded queue, the response memo, the kept sequences for
 * conversation reuse. No thread of its own; the model thread is sched.c's.
 *
 * Locks: s->mu guards the queue, the client table, the kept-sequence table
 * and the counters; s->memo_mu guards the memo (read from the HTTP thread);
 * j->mu guards a job's event list and its canceled flag. The model thread
 * calls a job's notify while holding j->mu, so shoal_sched_cancel (which
 * takes j->mu) guarantees that no notify runs after it returns. Order:
 * j->mu may be taken while holding nothing else; s->mu and s->memo_mu are
 * never held while taking j->mu. */
#include "coordinator/api/sched.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/metrics.h"
#include "coordinator/text/text.h"
#include "coordinator/engine/engine.h"
#include "coordinator/api/sched_int.h"

/* ---- events --------------------------------------------------------------- */

void shoal_ev_free_list(shoal_ev *e)
{
    while (e) {
        shoal_ev *n = e->next;
        free(e->text);
        free(e->name);
        free(e->prompt_ids);
        free(e->output_ids);
        free(e);
        e = n;
    }
}

static shoal_ev *ev_new(shoal_ev_type t)
{
    shoal_ev *e = shoal_xcalloc(1, sizeof *e);
    e->type = t;
    return e;
}

static int32_t *ids_dup(const int32_t *v, int n)
{
    if (!v || n <= 0)
        return NULL;
    int32_t *c = shoal_xmalloc((size_t)n * sizeof *c);
    memcpy(c, v, (size_t)n * sizeof *c);
    return c;
}

static shoal_ev *ev_clone(const shoal_ev *e)
{
    shoal_ev *c = shoal_xmalloc(sizeof *c);
    *c = *e;
    c->next = NULL;
    if (e->text) {
        c->text = shoal_xmalloc(e->len + 1);
        memcpy(c->text, e->text, e->len + 1);
    }
    c->name = e->name ? shoal_xstrdup(e->name) : NULL;
    c->prompt_ids = ids_dup(e->prompt_ids, e->n_prompt_ids);
    c->output_ids = ids_dup(e->output_ids, e->n_output_ids);
    return c;
}

static shoal_ev *list_clone(const shoal_ev *e)
{
    shoal_ev *head = NULL, **tail = &head;
    for (; e; e = e->next) {
        *tail = ev_clone(e);
        tail = &(*tail)->next;
    }
    return head;
}

static size_t ev_bytes(const shoal_ev *e)
{
    return sizeof *e + e->len + (e->name ? strlen(e->name) : 0) +
           4 * (size_t)(e->n_prompt_ids + e->n_output_ids);
}

/* ---- jobs ------------------------------------------------------------------- */

shoal_sched_job *shoal_sched_job_new(shoal_gen_params *params, const char *client, const char *memo_key,
                                     void (*notify)(void *arg), void *arg)
{
    shoal_sched_job *j = shoal_xcalloc(1, sizeof *j);
    atomic_init(&j->refs, 1);
    atomic_init(&j->cancel, 0);
    atomic_init(&j->cancel_step, 0);
    atomic_init(&j->cancel_ns, 0);
    j->p = *params;
    memset(params, 0, sizeof *params);
    snprintf(j->client, sizeof j->client, "%s", client ? client : "");
    if (memo_key) {
        snprintf(j->memo_key, sizeof j->memo_key, "%s", memo_key);
        j->has_memo = 1;
    }
    j->notify = notify;
    j->arg = arg;
    pthread_mutex_init(&j->mu, NULL);
    return j;
}

void shoal_sched_job_fork_of(shoal_sched_job *child, shoal_sched_job *parent)
{
    shoal_sched_job_ref(parent);
    child->fork_of = parent;
}

void shoal_sched_job_ref(shoal_sched_job *j)
{
    atomic_fetch_add(&j->refs, 1);
}

void shoal_sched_job_unref(shoal_sched_job *j)
{
    if (!j || atomic_fetch_sub(&j->refs, 1) != 1)
        return;
    shoal_gen_params_free(&j->p);
    free(j->rids);
    shoal_ev_free_list(j->head);
    shoal_sched_job_unref(j->fork_of);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

shoal_ev *shoal_sched_job_take(shoal_sched_job *j)
{
    pthread_mutex_lock(&j->mu);
    shoal_ev *e = j->head;
    j->head = j->tail = NULL;
    pthread_mutex_unlock(&j->mu);
    return e;
}

/* Model thread: append an event; wake the owner if the list was empty. */
void shoal__sched_emit(shoal_sched_job *j, shoal_ev *e)
{
    pthread_mutex_lock(&j->mu);
    if (j->canceled || j->ended) {
        pthread_mutex_unlock(&j->mu);
        shoal_ev_free_list(e);
        return;
    }
    int was_empty = j->head == NULL;
    if (j->tail)
        j->tail->next = e;
    else
        j->head = e;
    j->tail = e;
    if (e->type == SHOAL_EV_DONE || e->type == SHOAL_EV_ERROR)
        j->ended = 1;
    if (was_empty && j->notify)
        j->notify(j->arg);
    pthread_mutex_unlock(&j->mu);
}

/* ---- fair queue (s->mu held) ------------------------------------------------ */

static uint64_t client_last_served(shoal_sched *s, const char *client)
{
    for (int i = 0; i < SHOAL_SCHED_CLIENTS; i++)
        if (s->clients[i].used && !strcmp(s->clients[i].key, client))
            return s->clients[i].last;
    return 0; /* never served: first in line */
}

static void client_mark_served(shoal_sched *s, const char *client)
{
    int slot = -1, oldest = 0;
    for (int i = 0; i < SHOAL_SCHED_CLIENTS; i++) {
        if (s->clients[i].used && !strcmp(s->clients[i].key, client)) {
            slot = i;
            break;
        }
        if (!s->clients[i].used) {
            if (slot < 0)
                slot = i;
        } else if (s->clients[i].last < s->clients[oldest].last || !s->clients[oldest].used) {
            oldest = i;
        }
    }
    if (slot < 0)
        slot = oldest; /* table full: forget the client served longest ago */
    s->clients[slot].used = 1;
    snprintf(s->clients[slot].key, sizeof s->clients[slot].key, "%s", client);
    s->clients[slot].last = ++s->serve_tick;
}

static void queue_remove(shoal_sched *s, shoal_sched_job *j)
{
    if (j->qprev)
        j->qprev->qnext = j->qnext;
    else
        s->qhead = j->qnext;
    if (j->qnext)
        j->qnext->qprev = j->qprev;
    else
        s->qtail = j->qprev;
    j->qnext = j->qprev = NULL;
    j->queued = 0;
    s->nqueued--;
    if (j->rstate == SHOAL_RENDER_DONE)
        s->nready--;
}

/* The queued job in state rstate whose client was served longest ago (the
 * oldest such job wins ties), or NULL. */
static shoal_sched_job *fair_pick(shoal_sched *s, int rstate)
{
    shoal_sched_job *best = NULL;
    uint64_t best_last = 0;
    for (shoal_sched_job *j = s->qhead; j; j = j->qnext) {
        if (j->rstate != rstate)
            continue;
        /* n choices: a child's prompt is its parent's; it is copied from the
         * parent's render (shoal__sched_render_next) rather than rendered n
         * times, so the child waits while the parent's render is on its way */
        if (rstate == SHOAL_RENDER_NONE && j->fork_of && j->fork_of->rstate != SHOAL_RENDER_DONE &&
            (j->fork_of->queued || j->fork_of->rstate == SHOAL_RENDER_BUSY))
            continue;
        /* n choices: a child rendered before its parent waits for the parent
         * to be admitted first (it copies the parent's prompt state) */
        if (rstate == SHOAL_RENDER_DONE && j->fork_of && j->fork_of->queued)
            continue;
        uint64_t last = client_last_served(s, j->client);
        if (!best || last < best_last) { /* strict: the oldest job wins ties */
            best = j;
            best_last = last;
        }
    }
    return best;
}

shoal_sched_job *shoal__sched_pop_fair(shoal_sched *s)
{
    shoal_sched_job *best = fair_pick(s, SHOAL_RENDER_DONE);
    if (best) {
        queue_remove(s, best);
        client_mark_served(s, best->client);
    }
    return best;
}

shoal_sched_job *shoal__sched_pick_render(shoal_sched *s)
{
    shoal_sched_job *j = s->stopping ? NULL : fair_pick(s, SHOAL_RENDER_NONE);
    if (j) {
        j->rstate = SHOAL_RENDER_BUSY;
        shoal_sched_job_ref(j);
    }
    return j;
}

void shoal__sched_render_done(shoal_sched *s, shoal_sched_job *j)
{
    j->rstate = SHOAL_RENDER_DONE;
    j->ready_step = atomic_load(&s->step_seq);
    j->ready_ns = shoal_metrics_now_ns();
    if (j->queued) {
        s->nready++;
        pthread_cond_signal(&s->cv);
    }
    pthread_cond_broadcast(&s->rcv); /* children waiting for this render */
}

int shoal_sched_submit(shoal_sched *s, shoal_sched_job *j)
{
    pthread_mutex_lock(&s->mu);
    if (s->stopping || s->nqueued >= s->o.queue_size) {
        s->st.refused_full++;
        pthread_mutex_unlock(&s->mu);
        return SHOAL_EBUSY;
    }
    shoal_sched_job_ref(j);
    j->queued = 1;
    j->t_submit = shoal_metrics_now_ns();
    j->qprev = s->qtail;
    j->qnext = NULL;
    if (s->qtail)
        s->qtail->qnext = j;
    else
        s->qhead = j;
    s->qtail = j;
    s->nqueued++;
    s->st.submitted++;
    pthread_cond_signal(&s->rcv); /* rendered first, then the model thread's */
    pthread_mutex_unlock(&s->mu);
    return 0;
}

void shoal_sched_cancel(shoal_sched *s, shoal_sched_job *j)
{
    int dequeued = 0;
    pthread_mutex_lock(&s->mu);
    if (j->queued) {
        queue_remove(s, j);
        dequeued = 1;
        s->st.canceled++;
    }
    pthread_mutex_unlock(&s->mu);
    uint64_t none = 0, none_ns = 0;
    if (atomic_compare_exchange_strong(&j->cancel_ns, &none_ns, shoal_metrics_now_ns()))
        atomic_compare_exchange_strong(&j->cancel_step, &none, atomic_load(&s->step_seq));
    atomic_store(&j->cancel, 1);
    pthread_mutex_lock(&j->mu);
    j->canceled = 1;
    pthread_mutex_unlock(&j->mu);
    if (dequeued)
        shoal_sched_job_unref(j); /* the queue's reference */
}

/* ---- memo --------------------------------------------------------------------- */

shoal_ev *shoal_sched_memo_get(shoal_sched *s, const char *key)
{
    shoal_ev *r = NULL;
    pthread_mutex_lock(&s->memo_mu);
    for (int i = 0; i < s->nmemo; i++) {
        if (!strcmp(s->memo[i].key, key)) {
            s->memo[i].last = ++s->memo_tick;
            r = list_clone(s->memo[i].events);
            break;
        }
    }
    if (r)
        s->memo_hits++;
    else
        s->memo_misses++;
    pthread_mutex_unlock(&s->memo_mu);
    return r;
}

static void memo_evict_one(shoal_sched *s)
{
    int lru = 0;
    for (int i = 1; i < s->nmemo; i++)
        if (s->memo[i].last < s->memo[lru].last)
            lru = i;
    s->memo_bytes -= s->memo[lru].bytes;
    shoal_ev_free_list(s->memo[lru].events);
    s->memo[lru] = s->memo[--s->nmemo];
}

/* Takes ownership of events. */
void shoal__sched_memo_put(shoal_sched *s, const char *key, shoal_ev *events, size_t bytes)
{
    if (s->o.memo_entries <= 0 || bytes > s->o.memo_bytes) {
        shoal_ev_free_list(events);
        return;
    }
    pthread_mutex_lock(&s->memo_mu);
    for (int i = 0; i < s->nmemo; i++) {
        if (!strcmp(s->memo[i].key, key)) { /* a concurrent identical request stored it first */
            pthread_mutex_unlock(&s->memo_mu);
            shoal_ev_free_list(events);
            return;
        }
    }
    while (s->nmemo > 0 && (s->nmemo >= s->o.memo_entries || s->memo_bytes + bytes > s->o.memo_bytes))
        memo_evict_one(s);
    shoal_memo_entry *m = &s->memo[s->nmemo++];
    snprintf(m->key, sizeof m->key, "%s", key);
    m->events = events;
    m->bytes = bytes;
    m->last = ++s->memo_tick;
    s->memo_bytes += bytes;
    pthread_mutex_unlock(&s->memo_mu);
}

/* ---- kept sequences (model thread only; counters under s->mu) --------------- */

static void kept_drop(shoal_sched *s, int i)
{
    shoal_kept *k = &s->kept[i];
    s->kept_bytes -= k->bytes;
    shoal_seq_free(k->seq);
    free(k->ids);
    free(k->logits);
    s->kept[i] = s->kept[--s->nkept];
}

/* The kept sequence whose ids are the longest prefix of ids[0..n), or -1. */
int shoal__sched_kept_find(shoal_sched *s, const int32_t *ids, int n)
{
    int best = -1;
    for (int i = 0; i < s->nkept; i++) {
        shoal_kept *k = &s->kept[i];
        if (k->n <= n && (best < 0 || k->n > s->kept[best].n) && !memcmp(k->ids, ids, (size_t)k->n * sizeof *ids))
            best = i;
    }
    if (best >= 0)
        s->kept[best].last = ++s->kept_tick;
    return best;
}

/* Keeps a copy of seq (at position n = the number of ids) and the logits of
 * its last token. */
void shoal__sched_kept_put(shoal_sched *s, const int32_t *ids, int n, const shoal_seq *seq, const float *logits)
{
    if (s->o.keep_seqs <= 0 || n <= 0 || shoal_seq_pos(seq) != n)
        return;
    for (int i = 0; i < s->nkept; i++)
        if (s->kept[i].n == n && !memcmp(s->kept[i].ids, ids, (size_t)n * sizeof *ids)) {
            s->kept[i].last = ++s->kept_tick;
            return;
        }
    shoal_seq *copy;
    char err[256];
    if (shoal_seq_fork(&copy, seq, n, err, sizeof err)) {
        SHOAL_WARN("sched: cannot keep a sequence of %d tokens: %s", n, err);
        return;
    }
    size_t bytes = shoal_seq_bytes(copy) + (size_t)n * sizeof *ids + (size_t)s->vocab * sizeof(float);
    if (bytes > s->o.keep_bytes) {
        shoal_seq_free(copy);
        return;
    }
    pthread_mutex_lock(&s->mu);
    while (s->nkept > 0 && (s->nkept >= s->o.keep_seqs || s->kept_bytes + bytes > s->o.keep_bytes)) {
        int lru = 0;
        for (int i = 1; i < s->nkept; i++)
            if (s->kept[i].last < s->kept[lru].last)
                lru = i;
        kept_drop(s, lru);
    }
    shoal_kept *k = &s->kept[s->nkept++];
    k->ids = ids_dup(ids, n);
    k->n = n;
    k->seq = copy;
    k->logits = shoal_xmalloc((size_t)s->vocab * sizeof(float));
    memcpy(k->logits, logits, (size_t)s->vocab * sizeof(float));
    k->bytes = bytes;
    k->last = ++s->kept_tick;
    s->kept_bytes += bytes;
    pthread_mutex_unlock(&s->mu);
}

/* ---- stop / free / stats ------------------------------------------------------ */

void shoal__sched_queue_stop(shoal_sched *s)
{
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    shoal_sched_job *q = s->qhead;
    s->qhead = s->qtail = NULL;
    s->nqueued = 0;
    s->nready = 0;
    pthread_cond_broadcast(&s->cv);
    pthread_cond_broadcast(&s->rcv);
    pthread_mutex_unlock(&s->mu);
    while (q) {
        shoal_sched_job *n = q->qnext;
        q->queued = 0;
        atomic_store(&q->cancel, 1);
        pthread_mutex_lock(&q->mu);
        q->canceled = 1;
        pthread_mutex_unlock(&q->mu);
        shoal_sched_job_unref(q);
        q = n;
    }
}

void shoal__sched_store_free(shoal_sched *s)
{
    while (s->nkept)
        kept_drop(s, s->nkept - 1);
    while (s->nmemo)
        memo_evict_one(s);
}

void shoal_sched_get_stats(shoal_sched *s, shoal_sched_stats *out)
{
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    out->queued = s->nqueued;
    out->running = s->running;
    out->kept_seqs = (uint64_t)s->nkept;
    out->kept_bytes = s->kept_bytes;
    out->state_bytes = s->state_used;
    out->waiting_state = s->waiting_state;
    out->state_budget = s->o.state_bytes;
    out->slots = s->o.slots;
    pthread_mutex_unlock(&s->mu);
    pthread_mutex_lock(&s->memo_mu);
    out->memo_hits = s->memo_hits;
    out->memo_misses = s->memo_misses;
    out->memo_entries = (uint64_t)s->nmemo;
    out->memo_bytes = s->memo_bytes;
    pthread_mutex_unlock(&s->memo_mu);
}

void shoal__sched_count(shoal_sched *s, const shoal_sched_stats *add)
{
    pthread_mutex_lock(&s->mu);
    s->st.completed += add->completed;
    s->st.canceled += add->canceled;
    s->st.failed += add->failed;
    s->st.prompt_tokens += add->prompt_tokens;
    s->st.completion_tokens += add->completion_tokens;
    s->st.reused_tokens += add->reused_tokens;
    s->st.prefilled_tokens += add->prefilled_tokens;
    s->st.cache_waits += add->cache_waits;
    pthread_mutex_unlock(&s->mu);
}

size_t shoal__sched_ev_bytes(const shoal_ev *e)
{
    return ev_bytes(e);
}

shoal_ev *shoal__sched_ev_new(shoal_ev_type t)
{
    return ev_new(t);
}

shoal_ev *shoal__sched_ev_clone(const shoal_ev *e)
{
    return ev_clone(e);
}
