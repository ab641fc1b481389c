/* OpenAI-compatible API -- the public face of the api room (coordinator/api/:
 * http.c, api.c, api_parse.c, the scheduler sched.c over jobs.c). May use:
 * common/, text/, engine/ and obs/; not cluster/ (the model it serves comes
 * with its expert backend already plugged in by `shoal serve`, cmd/serve.c).
 *
 * Routes HTTP exchanges (api/http.h) to the
 * scheduler (api/sched.h) and formats what comes back. Owns request
 * validation (every field type- and range-checked, errors in OpenAI's error
 * object naming the field), authentication (Bearer or x-api-key), the
 * response memo lookup, and the JSON / server-sent-event response formats of
 * /v1/chat/completions, /v1/completions, /v1/models, plus /health and
 * /metrics; /v1/messages (+ count_tokens, Anthropic) and /v1/responses
 * (OpenAI Responses) are translations onto the chat path (api_anthropic.c,
 * api_responses.c, sharing api_int.h). docs/API.md lists the fields honoured, the defaults and the
 * errors. Callers: `shoal serve` (coordinator/cmd/serve.c), the fuzz target and
 * tests.
 *
 * Threads: shoal_api_on_request and everything it starts run on the HTTP loop
 * thread; events from the model thread reach it through shoal_http_post. The
 * parse functions are pure and thread-safe. */
#ifndef SHOAL_API_H
#define SHOAL_API_H

#include <jansson.h>
#include <stddef.h>

#include "common/metrics.h"
#include "coordinator/api/http.h"
#include "coordinator/api/sched.h"

/* What validation needs to know about the served model. */
typedef struct {
    const char *model_name; /* the only accepted `model` */
    int vocab;              /* prompt token ids must be in [0, vocab) */
    int max_context;        /* max_tokens above this is refused at once */
} shoal_api_limits;

/* An OpenAI error: HTTP status, error.type, error.code (may be ""),
 * error.param (the field, "" for none) and error.message. */
typedef struct {
    int status;
    char type[32];
    char code[40];
    char param[160];
    char message[320];
} shoal_api_error;

/* ---- the unknown-field policy (one for every endpoint, docs/API.md) ----
 * Every key of every request object is one of:
 *   used      the endpoint implements it (its own list, `used` below);
 *   refused   a field of a known vocabulary (OpenAI, Anthropic, vLLM/SGLang,
 *             llama-server) that would change the output and that shoal does
 *             not implement (a grammar, guided_json, mirostat, ...): 400
 *             `unsupported_parameter` naming it -- unless it carries its
 *             neutral value (false, 0, 1.0, null, empty: what a client sends
 *             by default), then it is ignored like the next;
 *   ignored   anything else -- a known field that does not change the output
 *             (store, metadata, priority, ...) or a field in no known
 *             vocabulary (a vendor extension): accepted, listed once per
 *             request in the response header `x-shoal-ignored: a,b` and
 *             counted in shoal_api_ignored_fields_total{field} (a field in no
 *             known vocabulary is counted as field="other", so clients cannot
 *             grow the metric without bound).
 * Nested objects are checked with their path: "messages[].cache_control",
 * "stream_options.x". */
#define SHOAL_API_MAX_IGNORED 16

typedef struct {
    int n;       /* names held (at most SHOAL_API_MAX_IGNORED; more are counted in dropped) */
    int dropped;
    char name[SHOAL_API_MAX_IGNORED][64]; /* the path, header-safe (A-Za-z0-9_.[]- only, '?' else) */
    int known[SHOAL_API_MAX_IGNORED];     /* 1: in a known vocabulary (the metric's label) */
} shoal_api_ignored;

/* Checks obj's keys (obj not an object: nothing to check). where: the path
 * prefix ("" at the top level, "messages[]", "stream_options"); used: the
 * NULL-terminated keys the endpoint implements in that object. Appends the
 * ignored ones to *ign (deduplicated). Returns 0, or -1 with *err naming the
 * first refused field. */
int shoal_api_check_fields(const json_t *obj, const char *where, const char *const *used, shoal_api_ignored *ign,
                           shoal_api_error *err);
/* "a,b,c" (", +N more" past the cap); "" when none. */
void shoal_api_ignored_list(const shoal_api_ignored *ign, char *buf, size_t cap);
/* Adds path to *ign (deduplicated): a field the endpoint accepts and
 * ignores, found by its own checks (known: in a known vocabulary). */
void shoal_api_ignored_add(shoal_api_ignored *ign, const char *path, int known);

#define SHOAL_API_MAX_N 8            /* `n` choices at most */
#define SHOAL_API_MAX_TOP_LOGPROBS 20

/* A validated request. */
typedef struct {
    shoal_gen_params gen;
    int stream;
    int include_usage;  /* stream_options.include_usage */
    int n;              /* choices (1..SHOAL_API_MAX_N); choice i samples with seed gen.seed + i */
    char *memo_key;     /* hex digest of the canonical request; NULL when not deterministic */
    char user[128];     /* `user` (fairness key with the peer address) */
    shoal_api_ignored ignored;
} shoal_api_req;

/* Parses and validates a request body for kind. Returns 0 and fills *out
 * (free with shoal_api_req_free), or -1 and fills *err. */
int shoal_api_parse(shoal_gen_kind kind, const char *body, size_t len, const shoal_api_limits *lim,
                    shoal_api_req *out, shoal_api_error *err);
void shoal_api_req_free(shoal_api_req *r);

/* One worker's state for /health (filled by the health callback). */
typedef struct {
    char name[128];  /* endpoint, e.g. "tcp://127.0.0.1:5601" */
    int up;          /* answered its last check */
    char state[640]; /* free text: "ready", "down: timeout", ...; room for a 512-byte reason and counts */
    /* local workers (`--workers N`) only: their supervisor's record */
    int local, restarts, hangs;
    int backing_off;           /* crash-looping: the next restart waits */
    int backoff_s;             /* that wait */
    double next_try_s;         /* seconds until that restart */
    double next_try_unix;      /* its time, seconds since the epoch */
} shoal_api_worker;

typedef struct shoal_api shoal_api;

typedef struct {
    shoal_api_limits limits;
    const char *api_key;       /* NULL: no authentication */
    shoal_sched *sched;        /* borrowed */
    /* borrowed: /health checks its mapped files (shoal_model_check_files)
     * and answers 503 "unavailable" naming a truncated one. NULL: no check. */
    const shoal_model *model;
    /* Worker states: fills up to cap entries of w, returns how many workers
     * there are (0 when the experts run in-process). NULL: no workers. Called
     * on the loop thread for /health. */
    int (*workers)(void *ud, shoal_api_worker *w, int cap);
    /* With some worker down: 1 when replicas still cover every expert and
     * trunk row (/health answers 200 "degraded"), else 0 with what is not
     * covered in why. NULL: a worker down is never covered. Loop thread. */
    int (*covered)(void *ud, char *why, size_t whylen);
    /* Appends further metric families to /metrics (the coordinator's
     * cmetrics: forward phases, per-worker exchanges). NULL: none. Loop thread. */
    void (*metrics)(void *ud, shoal_metrics_buf *b);
    /* Further routes (the cluster page, coordinator/cmd/webui.h), asked
     * first for every request with a known method: returns 1 when it
     * answered (it then owns the exchange), 0 to let the API answer (401
     * without the key, 404 for a path nobody knows). NULL: none. Loop thread. */
    int (*route)(void *ud, shoal_http_ex *ex, const shoal_http_request *req, int authorised);
    void *ud;
} shoal_api_opts;

int shoal_api_open(shoal_api **out, const shoal_api_opts *o, char *err, size_t errlen);
/* The HTTP server the exchanges come from (events are posted to its loop);
 * set before the loop runs. */
void shoal_api_set_http(shoal_api *a, shoal_http *h);
/* 1 once the model is loaded and every worker answered: /health says ready. */
void shoal_api_set_ready(shoal_api *a, int ready);
/* 1 when req carries "Authorization: Bearer API_KEY" exactly (or api_key is
 * NULL); compared by digest, in a time that does not depend on the key. For
 * `shoal serve`'s answers before the API is open (the "starting" state). */
int shoal_api_key_ok(const char *api_key, const shoal_http_request *req);
/* The HTTP request callback (ud = the shoal_api). */
void shoal_api_on_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req);
/* The /metrics exposition into b (loop thread). */
void shoal_api_metrics_text(shoal_api *a, shoal_metrics_buf *b);
/* After the HTTP loop stopped and the scheduler closed. Accepts NULL. */
void shoal_api_close(shoal_api *a);

#endif
