/* Private to the api module (api.c, api_anthropic.c, api_responses.c): the
 * API object, the per-request state linking an exchange to its scheduler job,
 * and the helpers the three response formats share. One generation pipeline
 * (parse -> shoal_gen_params -> scheduler job -> events) serves every
 * endpoint; the formats differ only in how a request becomes
 * shoal_gen_params and how the job's events are written back:
 *   FMT_OPENAI     /v1/chat/completions, /v1/completions (api.c)
 *   FMT_ANTHROPIC  /v1/messages (api_anthropic.c)
 *   FMT_RESPONSES  /v1/responses (api_responses.c)
 * Everything here runs on the HTTP loop thread, except areq_unref (any
 * thread). */
#ifndef SHOAL_API_INT_H
#define SHOAL_API_INT_H

#include <stdatomic.h>

#include "common/sbuf.h"
#include "coordinator/api/api.h"

enum {
    EP_CHAT,
    EP_COMPLETIONS,
    EP_MESSAGES,
    EP_COUNT_TOKENS,
    EP_RESPONSES,
    EP_MODELS,
    EP_HEALTH,
    EP_METRICS,
    EP_OTHER,
    EP_N
};
extern const char *const shoal__api_ep_names[EP_N];

typedef enum { FMT_OPENAI = 0, FMT_ANTHROPIC = 1, FMT_RESPONSES = 2 } shoal__api_fmt;

#define MAX_STATUS_SLOTS 24
#define MAX_IGNORED_LABELS 96

typedef struct shoal__resp_store shoal__resp_store;

struct shoal_api {
    shoal_api_opts o;
    char model_name[128];
    char *api_key;
    shoal_http *http;
    atomic_int ready; /* set by the starting thread, read on the loop */
    long long started;
    struct {
        int status;
        uint64_t count[EP_N];
    } st[MAX_STATUS_SLOTS];
    uint64_t memo_hits_served, streams, tokens_streamed;
    /* shoal_api_ignored_fields_total{field} (api.h: the field policy) */
    struct {
        char name[64];
        uint64_t count;
    } ign[MAX_IGNORED_LABELS];
    int nign;
    int live; /* open generation requests */
    int last_status; /* the status of the response just sent (access log) */
    int handed;      /* the request became an areq, which logs its own line */
    double t0;       /* when the request being routed arrived */
    shoal__resp_store *responses; /* /v1/responses: stored conversations */
};

typedef struct {
    char id[40];
    char *name;
    shoal_sbuf args;
} tcall;

struct areq;

/* One choice of a request (n choices: one scheduler job each; the
 * Anthropic and Responses formats have one). */
typedef struct {
    struct areq *r;
    int index;
    shoal_sched_job *job;
    shoal_sbuf content, reasoning;
    tcall *calls;
    int ncalls;
    int done;
    shoal_ev *done_ev;  /* its DONE (full responses are built when every choice is done) */
    json_t *lp;         /* logprob entries not yet sent (streaming) or all of them; NULL without logprobs */
    size_t text_off;    /* completions' text_offset: bytes of the tokens so far */
} achoice;

typedef struct areq {
    atomic_int refs;
    shoal_api *api;
    shoal_http_ex *ex; /* NULL once the exchange ended */
    int ep;
    shoal__api_fmt fmt;
    shoal_gen_kind kind;
    int stream, include_usage, return_ids, logprobs;
    int memo; /* 0: not deterministic, 1: miss, 2: hit */
    char id[48];
    long long created;
    int head_sent;
    int started;
    int prompt_tokens, reused_tokens;
    int status, completion_tokens; /* for the access log */
    int ndone;
    double t0;
    char peer[64];
    char ignored[512]; /* x-shoal-ignored */
    int n;
    achoice *ch;
    /* the typed-event formats (Anthropic, Responses; one choice, ch[0]) */
    char *stops[SHOAL_MAX_STOP]; /* Anthropic: the stop strings, to name the one that matched */
    int nstop;
    int seq;           /* Responses: sequence_number of the next event */
    int nblocks;       /* content blocks / output items opened so far */
    int open_kind;     /* the open block or item: -1 none, 0 reasoning, 1 text, 2 tool call */
    char item_id[48];  /* Responses: id of the open item */
    shoal_sbuf item_text; /* Responses: text of the open item so far */
    json_t *echo;      /* Responses: the request fields the response object repeats */
    json_t *conv;      /* Responses: the conversation as chat messages (to store) */
    size_t conv_bytes; /* Responses: its JSON size or more (the store's byte bound) */
    json_t *items;     /* Responses, streaming: the output items closed so far */
    int store;         /* Responses: keep the conversation under the response id */
} areq;

/* A JSON string from bytes that should be UTF-8 (invalid bytes -> U+FFFD). */
json_t *shoal__api_jstr(const char *s, size_t n);
/* The same for a buffer's bytes (empty when it holds none). */
static inline json_t *shoal__api_sbuf_json(const shoal_sbuf *b)
{
    return shoal__api_jstr(b->p ? b->p : "", b->n);
}

/* ---- request validation, shared by the three translations (api_parse.c) ---- */
/* Fills e as a request error and returns -1: type "authentication_error" for
 * 401, else "invalid_request_error"; code (NULL: ""); the param and the
 * formatted message may carry the client's text: both go through the clean
 * copy, so they are valid UTF-8 (JSON) whatever was sent and wherever the
 * buffer cuts them. */
int shoal__api_fail(shoal_api_error *e, int status, const char *code, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Client text quoted in a message: cut on a character boundary, never in the
 * middle of one (the "%.64s" of a printf would); buf is an array. */
#define QUOTE(buf, s) shoal_utf8_clip(buf, sizeof buf, (s), SHOAL_UTF8_MARK)
/* A field that is missing or null. */
static inline int shoal__api_absent(const json_t *v)
{
    return !v || json_is_null(v);
}
void shoal__api_random_hex(char *out, size_t nbytes);
/* Sends body (reference taken) as the JSON response; 500 if it cannot be built. */
void shoal__api_respond_json(shoal_api *a, shoal_http_ex *ex, int ep, int status, json_t *body, const char *extra);
/* An error in the shape of ep's API (OpenAI's error object, or Anthropic's). */
void shoal__api_respond_error(shoal_api *a, shoal_http_ex *ex, int ep, const shoal_api_error *e, const char *extra);
json_t *shoal__api_error_json(int ep, const shoal_api_error *e);
void shoal__api_count(shoal_api *a, int ep, int status);
/* x-request-id, x-shoal-memo, x-shoal-reused-tokens, x-shoal-ignored lines. */
void shoal__api_extra_headers(areq *r, char *buf, size_t cap);
/* The tool call of index of a choice (created with its id on first use). */
tcall *shoal__api_call_at(achoice *c, int index);
/* One server-sent event: "event: name\n" (when name) + "data: json\n\n". */
void shoal__api_sse(areq *r, const char *name, json_t *obj);

/* A request parsed by one of the formats: makes its areq (one reference, the
 * exchange's; q's ignored fields counted and listed), for the caller to fill
 * the format's fields, then shoal__api_start answers from the memo or submits
 * the job(s). */
areq *shoal__api_areq_new(shoal_api *a, shoal_http_ex *ex, int ep, shoal__api_fmt fmt, const shoal_api_req *q,
                          const char *id_prefix);
void shoal__api_start(areq *r, shoal_api_req *q);
/* 1 and a 503 sent when the model is not loaded yet. */
int shoal__api_not_ready(shoal_api *a, shoal_http_ex *ex, int ep);

/* A request whose parsing (or rendering, for count_tokens) is heavy: work(d)
 * runs on the HTTP layer's thread pool with d->req (a private copy of the
 * body; method and path are not kept) and must touch no shared state and
 * answer nothing; then done(d) runs on the loop thread: it answers d->ex, or,
 * when d->ex is NULL (the client left, or the server is stopping and the
 * request was answered 503 without work running: d->ran 0), only frees d->ctx.
 * The access line is written for it unless done hands the exchange to an
 * areq. Linear work on a 4 MB body no longer stalls every other connection. */
typedef struct shoal__api_deferred shoal__api_deferred;
struct shoal__api_deferred {
    shoal_api *a;
    shoal_http_ex *ex;
    int ep, ran;
    double t0;
    char peer[64];
    shoal_http_request req;
    void *ctx;
    void (*work)(shoal__api_deferred *d);
    void (*done)(shoal__api_deferred *d);
};
void shoal__api_defer(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req, int ep,
                      void (*work)(shoal__api_deferred *d), void (*done)(shoal__api_deferred *d), void *ctx);

/* A request's ignored fields into shoal_api_ignored_fields_total. */
void shoal__api_count_ignored(shoal_api *a, const shoal_api_ignored *ign);

/* ---- Anthropic Messages (api_anthropic.c) ---- */
void shoal__api_anth_messages(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req);
void shoal__api_anth_count_tokens(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req);
void shoal__api_anth_head(areq *r);
void shoal__api_anth_text(areq *r, shoal_channel ch, const char *t, size_t n);
void shoal__api_anth_tool(areq *r, const shoal_ev *e);
void shoal__api_anth_done(areq *r, const shoal_ev *e);
void shoal__api_anth_full(areq *r, const shoal_ev *e);
void shoal__api_anth_stream_error(areq *r, const shoal_api_error *e);

/* ---- OpenAI Responses (api_responses.c) ---- */
void shoal__api_resp_create(shoal_api *a, shoal_http_ex *ex, const shoal_http_request *req);
void shoal__api_resp_head(areq *r);
void shoal__api_resp_text(areq *r, shoal_channel ch, const char *t, size_t n);
void shoal__api_resp_tool(areq *r, const shoal_ev *e);
void shoal__api_resp_done(areq *r, const shoal_ev *e);
void shoal__api_resp_full(areq *r, const shoal_ev *e);
void shoal__api_resp_stream_error(areq *r, const shoal_api_error *e);
void shoal__api_resp_store_free(shoal__resp_store *st);

#endif
