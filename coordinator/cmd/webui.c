#include "coordinator/cmd/webui.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/utf8.h"
#include "coordinator/api/api.h"

/* the page, embedded at build time from webui.html (CMakeLists.txt) */
extern const unsigned char shoal_webui_html[];
extern const size_t shoal_webui_html_len;

#define MAX_SUBS 64

struct shoal_webui {
    shoal_http *http;
    char *api_key;
    shoal_webui_source src;
    void *ud;
    int period_ms;
    shoal_http_ex *subs[MAX_SUBS]; /* event-stream subscribers (loop thread) */
    int nsubs;
    pthread_t ticker;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
};

/* ---- the snapshot ---------------------------------------------------------- */

static json_t *jstr(const char *s)
{
    char buf[512];
    return json_string(shoal_utf8_clip(buf, sizeof buf, s ? s : "", SHOAL_UTF8_NOCTRL));
}

typedef struct {
    json_t *coord, *workers, *layers; /* workers: an object by id, in order of appearance */
} snap_ctx;

static json_t *worker_of(snap_ctx *c, const char *id)
{
    char key[256];
    shoal_utf8_clip(key, sizeof key, id, SHOAL_UTF8_NOCTRL);
    json_t *w = json_object_get(c->workers, key);
    if (!w) {
        if (json_object_size(c->workers) >= 4096)
            return NULL;
        w = json_object();
        json_object_set_new(w, "id", json_string(key));
        json_object_set_new(c->workers, key, w);
    }
    return w;
}

/* name_bucket{le} into o[field] = {"le":[...],"count":[...]} (ascending le) */
static void add_bucket(json_t *o, const char *field, const shoal_metrics_parsed *s)
{
    const char *le = shoal_metrics_label_get(s, "le");
    if (!le)
        return;
    json_t *h = json_object_get(o, field);
    if (!h) {
        h = json_pack("{s:[],s:[]}", "le", "count");
        json_object_set_new(o, field, h);
    }
    json_t *les = json_object_get(h, "le"), *cs = json_object_get(h, "count");
    if (json_array_size(les) >= 128)
        return;
    char *end;
    double v = strtod(le, &end);
    if (!strcmp(le, "+Inf"))
        json_array_append_new(les, json_string("+Inf"));
    else if (*end || !isfinite(v))
        return;
    else
        json_array_append_new(les, json_real(v));
    json_array_append_new(cs, json_real(isfinite(s->value) ? s->value : 0));
}

static json_t *num(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

static int collect(void *ctx, const shoal_metrics_parsed *s)
{
    snap_ctx *c = ctx;
    const char *n = s->name;
    size_t nl = strlen(n);
    if (!strcmp(n, "shoal_build_info")) {
        json_t *b = json_object();
        for (int i = 0; i < s->nlabels; i++)
            json_object_set_new(b, s->labels[i].name, jstr(s->labels[i].value));
        json_object_set_new(c->coord, "build", b);
        return 0;
    }
    if (!strcmp(n, "process_start_time_seconds")) {
        json_object_set_new(c->coord, n, num(s->value));
        return 0;
    }
    if (strncmp(n, "shoal_", 6))
        return 0;
    if (!strcmp(n, "shoal_failover_takeover_pairs_total")) {
        const char *from = shoal_metrics_label_get(s, "from"), *to = shoal_metrics_label_get(s, "to");
        json_t *w = from && to ? worker_of(c, from) : NULL;
        if (w) {
            json_t *t = json_object_get(w, "taken_by");
            if (!t) {
                t = json_object();
                json_object_set_new(w, "taken_by", t);
            }
            char key[256];
            json_object_set_new(t, shoal_utf8_clip(key, sizeof key, to, SHOAL_UTF8_NOCTRL), num(s->value));
        }
        return 0;
    }
    if (!strcmp(n, "shoal_layer_imbalance")) {
        const char *l = shoal_metrics_label_get(s, "layer");
        if (l && strlen(l) < 16)
            json_object_set_new(c->layers, l, num(s->value));
        return 0;
    }
    if (!strncmp(n, "shoal_worker_", 13)) {
        const char *id = shoal_metrics_label_get(s, "worker");
        json_t *w = id ? worker_of(c, id) : NULL;
        if (!w)
            return 0;
        const char *f = n + 13;
        size_t fl = strlen(f);
        if (!strcmp(f, "info")) {
            json_object_set_new(w, "endpoint", jstr(shoal_metrics_label_get(s, "endpoint")));
        } else if (fl > 7 && !strcmp(f + fl - 7, "_bucket")) {
            char base[96];
            snprintf(base, sizeof base, "%.*s", (int)(fl - 7), f);
            add_bucket(w, base, s);
        } else if (!strcmp(f, "layer_pairs_total")) {
            const char *l = shoal_metrics_label_get(s, "layer");
            json_t *lp = json_object_get(w, "layer_pairs");
            if (!lp) {
                lp = json_object();
                json_object_set_new(w, "layer_pairs", lp);
            }
            if (l && strlen(l) < 16)
                json_object_set_new(lp, l, num(s->value));
        } else if (s->nlabels == 1) { /* only `worker`: a plain series of the worker */
            json_object_set_new(w, f, num(s->value));
        }
        return 0;
    }
    if (!strcmp(n, "shoal_http_responses_total")) {
        const char *ep = shoal_metrics_label_get(s, "endpoint"), *st = shoal_metrics_label_get(s, "status");
        if (ep && st && strlen(st) < 8) {
            json_t *h = json_object_get(c->coord, "http_responses");
            if (!h) {
                h = json_object();
                json_object_set_new(c->coord, "http_responses", h);
            }
            char key[200];
            snprintf(key, sizeof key, "%.180s %s", ep, st);
            char k2[256];
            json_object_set_new(h, shoal_utf8_clip(k2, sizeof k2, key, SHOAL_UTF8_NOCTRL), num(s->value));
        }
        return 0;
    }
    if (nl > 21 && !strcmp(n + nl - 15, "_seconds_bucket") && !strncmp(n, "shoal_request_", 14) &&
        s->nlabels == 1) {
        char base[96];
        snprintf(base, sizeof base, "%.*s", (int)(nl - 6 - 7), n + 6); /* request_ttft_seconds */
        add_bucket(c->coord, base, s);
        return 0;
    }
    if (!s->nlabels)
        json_object_set_new(c->coord, n + 6, num(s->value));
    return 0;
}

char *shoal_webui_cluster_json(const char *metrics, size_t len, const json_t *health, char *err, size_t errlen)
{
    snap_ctx c = {json_object(), json_object(), json_object()};
    int rc = shoal_metrics_parse(metrics, len, collect, &c, err, errlen);
    if (rc) {
        json_decref(c.coord);
        json_decref(c.workers);
        json_decref(c.layers);
        return NULL;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    json_t *ws = json_array();
    const char *id;
    json_t *w;
    json_t *hws = health ? json_object_get(health, "workers") : NULL;
    json_object_foreach(c.workers, id, w) {
        /* the health entry names it "ID (ENDPOINT)" (serve) or by its endpoint (top --web) */
        const char *ep = json_string_value(json_object_get(w, "endpoint"));
        size_t i;
        json_t *hw;
        json_array_foreach(hws, i, hw) {
            const char *name = json_string_value(json_object_get(hw, "endpoint"));
            size_t il = strlen(id);
            if (name && ((!strncmp(name, id, il) && (name[il] == ' ' || !name[il])) || (ep && strstr(name, ep)))) {
                json_t *up = json_object_get(hw, "up"), *st = json_object_get(hw, "state");
                json_object_set_new(w, "health", json_pack("{s:O,s:O}", "up", up ? up : json_null(), "state",
                                                           st ? st : json_null()));
                break;
            }
        }
        json_array_append(ws, w);
    }
    const char *status = health ? json_string_value(json_object_get(health, "status")) : NULL;
    json_t *root = json_pack("{s:f,s:s,s:o,s:o,s:o}", "time", (double)ts.tv_sec + ts.tv_nsec / 1e9, "status",
                             status ? status : "unknown", "coordinator", c.coord, "workers", ws, "layers", c.layers);
    json_decref(c.workers);
    char *out = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    if (!out)
        shoal_err_set(err, errlen, SHOAL_EINTERNAL, "webui: cannot format the snapshot");
    return out;
}

/* ---- routes and the event stream ------------------------------------------ */

static void drop_sub(shoal_webui *w, shoal_http_ex *ex)
{
    for (int i = 0; i < w->nsubs; i++)
        if (w->subs[i] == ex) {
            w->subs[i] = w->subs[--w->nsubs];
            return;
        }
}

typedef struct {
    shoal_webui *w;
    shoal_http_ex *ex;
} sub_ref;

static void on_sub_abort(void *arg)
{
    sub_ref *r = arg;
    drop_sub(r->w, r->ex);
    shoal_http_stream_end(r->ex); /* frees the aborted exchange */
    free(r);
}

static void send_event(shoal_http_ex *ex, const char *json)
{
    shoal_http_stream_write(ex, "event: cluster\ndata: ", 21);
    shoal_http_stream_write(ex, json, strlen(json));
    shoal_http_stream_write(ex, "\n\n", 2);
}

static void tick(void *arg)
{
    shoal_webui *w = arg;
    if (!w->nsubs)
        return;
    char *json = w->src(w->ud);
    if (!json)
        return;
    for (int i = 0; i < w->nsubs; i++)
        send_event(w->subs[i], json);
    free(json);
}

static void *ticker(void *arg)
{
    shoal_webui *w = arg;
    pthread_mutex_lock(&w->mu);
    while (!w->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(w->period_ms % 1000) * 1000000L;
        ts.tv_sec += w->period_ms / 1000 + ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        if (!w->stop && shoal_http_post(w->http, tick, w))
            break; /* the server is stopping */
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static const char PAGE_HEADERS[] =
    "Cache-Control: no-store\r\n"
    "X-Content-Type-Options: nosniff\r\n"
    "Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'\r\n";

static void answer_json(shoal_http_ex *ex, int status, const char *body)
{
    shoal_http_respond(ex, status, "application/json", "Cache-Control: no-store\r\n", body, strlen(body));
}

int shoal_webui_route(void *ud, shoal_http_ex *ex, const shoal_http_request *req, int authorised)
{
    shoal_webui *w = ud;
    const char *p = req->path;
    if (strcmp(req->method, "GET") && strcmp(req->method, "HEAD"))
        return 0;
    if (!strcmp(p, "/") || !strcmp(p, "/ui")) { /* no data in it: no key needed to load it */
        shoal_http_respond(ex, 200, "text/html; charset=utf-8", PAGE_HEADERS, shoal_webui_html,
                           shoal_webui_html_len);
        return 1;
    }
    int snap = !strcmp(p, "/v1/cluster"), events = !strcmp(p, "/v1/cluster/events");
    if ((!snap && !events) || !authorised)
        return 0;
    char *json = w->src(w->ud);
    if (!json) {
        answer_json(ex, 503, "{\"error\":{\"message\":\"the cluster state cannot be read now\",\"type\":"
                             "\"server_error\",\"param\":null,\"code\":\"not_ready\"}}");
        return 1;
    }
    if (snap) {
        answer_json(ex, 200, json);
        free(json);
        return 1;
    }
    if (w->nsubs == MAX_SUBS || !strcmp(req->method, "HEAD")) {
        free(json);
        answer_json(ex, w->nsubs == MAX_SUBS ? 503 : 200,
                    "{\"error\":{\"message\":\"too many event streams\",\"type\":\"server_error\",\"param\":null,"
                    "\"code\":\"busy\"}}");
        return 1;
    }
    shoal_http_stream_begin(ex, 200, "text/event-stream", "Cache-Control: no-store\r\nX-Accel-Buffering: no\r\n");
    send_event(ex, json);
    free(json);
    sub_ref *r = shoal_xcalloc(1, sizeof *r);
    r->w = w;
    r->ex = ex;
    w->subs[w->nsubs++] = ex;
    shoal_http_ex_on_abort(ex, on_sub_abort, r);
    return 1;
}

void shoal_webui_on_request(void *ud, shoal_http_ex *ex, const shoal_http_request *req)
{
    shoal_webui *w = ud;
    int auth = shoal_api_key_ok(w->api_key, req);
    if (shoal_webui_route(w, ex, req, auth))
        return;
    if (!auth)
        shoal_http_respond(ex, 401, "application/json", "WWW-Authenticate: Bearer\r\n",
                           "{\"error\":{\"message\":\"You didn't provide the API key\",\"type\":"
                           "\"invalid_request_error\",\"param\":null,\"code\":\"invalid_api_key\"}}",
                           strlen("{\"error\":{\"message\":\"You didn't provide the API key\",\"type\":"
                                  "\"invalid_request_error\",\"param\":null,\"code\":\"invalid_api_key\"}}"));
    else
        answer_json(ex, 404, "{\"error\":{\"message\":\"no such endpoint\",\"type\":\"invalid_request_error\","
                             "\"param\":null,\"code\":\"not_found\"}}");
}

int shoal_webui_open(shoal_webui **out, shoal_http *http, const char *api_key, shoal_webui_source src, void *ud,
                     int period_ms, char *err, size_t errlen)
{
    *out = NULL;
    if (!http || !src || period_ms < 50)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "webui: http, source and a period >= 50 ms are required");
    shoal_webui *w = shoal_xcalloc(1, sizeof *w);
    w->http = http;
    w->api_key = api_key ? shoal_xstrdup(api_key) : NULL;
    w->src = src;
    w->ud = ud;
    w->period_ms = period_ms;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    if (pthread_create(&w->ticker, NULL, ticker, w)) {
        free(w->api_key);
        free(w);
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "webui: cannot start the ticker thread");
    }
    *out = w;
    return 0;
}

void shoal_webui_close(shoal_webui *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->ticker, NULL);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    if (w->api_key) {
        memset(w->api_key, 0, strlen(w->api_key));
        free(w->api_key);
    }
    free(w);
}
