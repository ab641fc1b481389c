/* Scheduler: the fair bounded queue and the memo bounds (on the internal
 * structures), then the model thread's output path on the tiny model's real
 * tokenizer: generated ids of a K3 message (written from SPEC §5.4/§5.6, not
 * from the code) come back as reasoning, content and a tool call with
 * finish_reason tool_calls; stop strings cut across token boundaries; and the
 * API serves such a stored response over HTTP as OpenAI tool_calls (full and
 * streamed). The random tiny model never writes a tool call itself, so the
 * ids are given (shoal__sched_replay runs the same code as a live decode,
 * minus the forward); the e2e tests cover the rest with the real model. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/api/api.h"
#include "coordinator/api/http.h"
#include "coordinator/api/sched_int.h"
#include "tests/unit/test.h"

/* ---- queue and memo on a bare scheduler struct -------------------------- */

static shoal_sched *bare(int queue, int memo_entries, size_t memo_bytes)
{
    shoal_sched *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->memo_mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->rcv, NULL);
    s->o.queue_size = queue;
    s->o.memo_entries = memo_entries;
    s->o.memo_bytes = memo_bytes;
    return s;
}

static shoal_sched_job *job(const char *client)
{
    shoal_gen_params p = {.kind = SHOAL_GEN_COMPLETION};
    return shoal_sched_job_new(&p, client, NULL, NULL, NULL);
}

static void t_fair_queue(void)
{
    shoal_sched *s = bare(5, 0, 0);
    shoal_sched_job *a1 = job("a"), *a2 = job("a"), *a3 = job("a"), *b1 = job("b"), *c1 = job("c");
    shoal_sched_job *order[] = {a1, a2, a3, b1, c1};
    for (int i = 0; i < 5; i++)
        CHECK_EQ_INT(shoal_sched_submit(s, order[i]), 0);
    shoal_sched_job *extra = job("d");
    CHECK_EQ_INT(shoal_sched_submit(s, extra), SHOAL_EBUSY); /* bounded */
    /* nothing is admitted before it is rendered (issue 30: rendering runs on
     * the render thread, never the model thread) */
    pthread_mutex_lock(&s->mu);
    CHECK(shoal__sched_pop_fair(s) == NULL);
    pthread_mutex_unlock(&s->mu);
    CHECK_EQ_INT(s->nready, 0);
    /* the renderer takes them in the same fair order (no client served yet:
     * arrival order) */
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(shoal__sched_render_next(s), 1);
        CHECK_MSG(order[i]->rstate == SHOAL_RENDER_DONE, "render %d", i);
    }
    CHECK_EQ_INT(shoal__sched_render_next(s), 0);
    CHECK_EQ_INT(s->nready, 5);
    /* round robin across clients, arrival order within one: a1 b1 c1 a2 a3 */
    shoal_sched_job *want[] = {a1, b1, c1, a2, a3};
    for (int i = 0; i < 5; i++) {
        pthread_mutex_lock(&s->mu);
        shoal_sched_job *j = shoal__sched_pop_fair(s);
        pthread_mutex_unlock(&s->mu);
        CHECK_MSG(j == want[i], "pop %d", i);
        if (j)
            shoal_sched_job_unref(j); /* the queue's reference */
    }
    CHECK_EQ_INT(s->nqueued, 0);
    /* a client served recently waits behind one that was not */
    shoal_sched_job *a4 = job("a"), *d1 = job("d");
    shoal_sched_submit(s, a4);
    shoal_sched_submit(s, d1);
    /* d1 is rendered first: its client was never served */
    pthread_mutex_lock(&s->mu);
    shoal_sched_job *r1 = shoal__sched_pick_render(s);
    pthread_mutex_unlock(&s->mu);
    CHECK(r1 == d1);
    pthread_mutex_lock(&s->mu);
    shoal__sched_render_done(s, r1);
    pthread_mutex_unlock(&s->mu);
    shoal_sched_job_unref(r1);
    CHECK_EQ_INT(shoal__sched_render_next(s), 1);
    pthread_mutex_lock(&s->mu);
    shoal_sched_job *first = shoal__sched_pop_fair(s);
    pthread_mutex_unlock(&s->mu);
    CHECK(first == d1);
    shoal_sched_job_unref(first);
    /* cancel frees the place at once */
    shoal_sched_cancel(s, a4);
    CHECK_EQ_INT(s->nqueued, 0);
    CHECK_EQ_INT(s->nready, 0);
    pthread_mutex_lock(&s->mu);
    CHECK(shoal__sched_pop_fair(s) == NULL);
    pthread_mutex_unlock(&s->mu);
    shoal_sched_job *all[] = {a1, a2, a3, b1, c1, extra, a4, d1};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        shoal_sched_job_unref(all[i]);
    free(s);
}

static shoal_ev *text_list(const char *t)
{
    shoal_ev *e = shoal__sched_ev_new(SHOAL_EV_TEXT);
    e->len = strlen(t);
    e->text = strdup(t);
    return e;
}

static void t_memo_bounds(void)
{
    shoal_sched *s = bare(1, 2, 1 << 20);
    shoal__sched_memo_put(s, "k1", text_list("one"), 100);
    shoal__sched_memo_put(s, "k2", text_list("two"), 100);
    shoal_ev *e = shoal_sched_memo_get(s, "k1"); /* k1 is now the most recent */
    CHECK(e && !strcmp(e->text, "one"));
    shoal_ev_free_list(e);
    shoal__sched_memo_put(s, "k3", text_list("three"), 100); /* entry limit: k2 goes */
    e = shoal_sched_memo_get(s, "k2");
    CHECK(e == NULL);
    e = shoal_sched_memo_get(s, "k3");
    CHECK(e && !strcmp(e->text, "three"));
    shoal_ev_free_list(e);
    CHECK_EQ_INT(s->nmemo, 2);
    /* byte limit: an entry over the budget is not stored; a large one evicts */
    shoal__sched_memo_put(s, "big", text_list("x"), (1 << 20) + 1);
    CHECK(shoal_sched_memo_get(s, "big") == NULL);
    shoal__sched_memo_put(s, "k4", text_list("four"), (1 << 20) - 50); /* 100 + this > budget: both go */
    CHECK_EQ_INT(s->nmemo, 1);
    CHECK(s->memo_bytes <= (size_t)1 << 20);
    while (s->nmemo)
        shoal_ev_free_list(s->memo[--s->nmemo].events);
    free(s);
}

/* ---- the output path on the real tokenizer -------------------------------- */

static shoal_model *model;
static shoal_tok *tok;
static shoal_sched *sched;

static int setup(void)
{
    if (sched)
        return 0;
    const char *dir = test_src_path("tests/models/tiny-k3");
    char err[512];
    shoal_model_opts mo = {.max_context = 256, .threads = 1, .quiet = 1};
    shoal_tok_opts to = {0};
    if (shoal_tok_open(&tok, dir, &to, err, sizeof err) || shoal_model_open(&model, dir, &mo, err, sizeof err)) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    shoal_sched_opts so = {.model = model, .tok = tok, .queue_size = 4, .slots = 1, .keep_seqs = 2,
                           .keep_bytes = 64 << 20, .memo_entries = 8, .memo_bytes = 1 << 20, .threads = 1};
    if (shoal_sched_open(&sched, &so, err, sizeof err)) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    return 0;
}

static void ids_of(const char *xtml, shoal_tok_ids *ids)
{
    char err[256];
    if (shoal_tok_encode(tok, xtml, strlen(xtml), 1, ids, err, sizeof err))
        fprintf(stderr, "encode: %s\n", err);
}

/* K3's generated message after the thinking-on generation prompt (SPEC §5.4, §5.6). */
static const char tool_msg[] =
    "Let me check the weather.<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|>"
    "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";

static shoal_ev *replay(shoal_gen_params *p, const char *memo_key, const char *xtml)
{
    shoal_tok_ids ids = {0};
    ids_of(xtml, &ids);
    shoal_sched_job *j = shoal_sched_job_new(p, "test", memo_key, NULL, NULL);
    int rc = shoal__sched_replay(sched, j, ids.v, (int)ids.n);
    CHECK_EQ_INT(rc, 0);
    shoal_ev *e = shoal_sched_job_take(j);
    shoal_sched_job_unref(j);
    shoal_tok_ids_free(&ids);
    return e;
}

static void collect(shoal_ev *e, char *reasoning, char *content, size_t cap, const shoal_ev **done)
{
    reasoning[0] = content[0] = '\0';
    *done = NULL;
    for (; e; e = e->next) {
        if (e->type == SHOAL_EV_TEXT)
            strncat(e->channel == SHOAL_CH_REASONING ? reasoning : content, e->text,
                    cap - strlen(e->channel == SHOAL_CH_REASONING ? reasoning : content) - 1);
        if (e->type == SHOAL_EV_DONE)
            *done = e;
    }
}

static void t_replay_tool_call(void)
{
    if (setup())
        SKIP("tiny model or tokenizer unavailable");
    shoal_gen_params p = {.kind = SHOAL_GEN_CHAT, .thinking = 1};
    shoal_ev *ev = replay(&p, NULL, tool_msg);
    char r[256], c[256];
    const shoal_ev *done;
    collect(ev, r, c, sizeof r, &done);
    CHECK(!strcmp(r, "Let me check the weather."));
    CHECK(!strcmp(c, "Sure."));
    int tools = 0;
    for (shoal_ev *e = ev; e; e = e->next)
        if (e->type == SHOAL_EV_TOOL) {
            tools++;
            CHECK_EQ_INT(e->tool_index, 0);
            CHECK(e->name && !strcmp(e->name, "get_weather"));
            json_error_t je;
            json_t *args = json_loads(e->text, 0, &je);
            CHECK_MSG(args && json_is_object(args), "arguments %s", e->text);
            CHECK(!strcmp(json_string_value(json_object_get(args, "city")), "Paris"));
            CHECK(json_integer_value(json_object_get(args, "days")) == 2);
            json_decref(args);
        }
    CHECK_EQ_INT(tools, 1);
    CHECK(done && !strcmp(done->finish, "tool_calls"));
    shoal_ev_free_list(ev);
}

static void t_replay_stop_strings(void)
{
    if (setup())
        SKIP("tiny model or tokenizer unavailable");
    /* thinking off: content from the start; the stop string spans tokens */
    shoal_gen_params p = {.kind = SHOAL_GEN_CHAT, .thinking = 0, .nstop = 1};
    p.stop[0] = strdup("o w");
    shoal_ev *ev = replay(&p, NULL, "hello world, goodbye<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    char r[256], c[256];
    const shoal_ev *done;
    collect(ev, r, c, sizeof r, &done);
    CHECK_MSG(!strcmp(c, "hell"), "content '%s'", c);
    CHECK(r[0] == '\0');
    CHECK(done && !strcmp(done->finish, "stop"));
    shoal_ev_free_list(ev);
    /* a prefix of the stop string at the end that never completes is released */
    shoal_gen_params q = {.kind = SHOAL_GEN_CHAT, .thinking = 0, .nstop = 1};
    q.stop[0] = strdup("byebye");
    ev = replay(&q, NULL, "hello bye<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>");
    collect(ev, r, c, sizeof r, &done);
    CHECK_MSG(!strcmp(c, "hello bye"), "content '%s'", c);
    CHECK(done && !strcmp(done->finish, "stop"));
    shoal_ev_free_list(ev);
    /* completions: the detokenised text, cut before the stop string */
    shoal_gen_params k = {.kind = SHOAL_GEN_COMPLETION, .nstop = 2};
    k.stop[0] = strdup("zzz");
    k.stop[1] = strdup(" wor");
    ev = replay(&k, NULL, "hello world");
    collect(ev, r, c, sizeof r, &done);
    CHECK_MSG(!strcmp(c, "hello"), "content '%s'", c);
    CHECK(done && !strcmp(done->finish, "stop"));
    shoal_ev_free_list(ev);
}

/* ---- the API over HTTP serving a stored tool-call response --------------- */

typedef struct {
    shoal_http *h;
    pthread_t t;
} loop;

static void *loop_main(void *arg)
{
    shoal_http_run(((loop *)arg)->h);
    return NULL;
}

static char *http_post(int port, const char *body, size_t *n_out)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return NULL;
    }
    char head[256];
    int hn = snprintf(head, sizeof head,
                      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      "Content-Length: %zu\r\n\r\n",
                      strlen(body));
    if (write(fd, head, (size_t)hn) != hn || write(fd, body, strlen(body)) != (ssize_t)strlen(body)) {
        close(fd);
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, 10000) <= 0)
            break;
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    close(fd);
    *n_out = n;
    return buf;
}

static void t_api_serves_tool_calls(void)
{
    if (setup())
        SKIP("tiny model or tokenizer unavailable");
    shoal_api_opts ao = {.limits = {.model_name = "tiny", .vocab = shoal_tok_n_vocab(tok), .max_context = 256},
                         .sched = sched};
    shoal_api *api;
    char err[256];
    CHECK_EQ_INT(shoal_api_open(&api, &ao, err, sizeof err), 0);
    shoal_http_opts ho = {.host = "127.0.0.1", .max_header_bytes = 8192, .max_body_bytes = 1 << 16,
                          .max_connections = 8, .request_timeout_ms = 5000, .idle_timeout_ms = 5000,
                          .write_timeout_ms = 5000, .max_write_queue = 1 << 20, .on_request = shoal_api_on_request,
                          .ud = api};
    loop L;
    CHECK_EQ_INT(shoal_http_open(&L.h, &ho, err, sizeof err), 0);
    shoal_api_set_http(api, L.h);
    shoal_api_set_ready(api, 1);
    pthread_create(&L.t, NULL, loop_main, &L);

    const char *body = "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],"
                       "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":"
                       "{\"type\":\"object\"}}}],\"temperature\":0,\"max_tokens\":64}";
    /* store the replayed response under this request's memo key */
    shoal_api_req q;
    shoal_api_error e;
    CHECK_EQ_INT(shoal_api_parse(SHOAL_GEN_CHAT, body, strlen(body), &ao.limits, &q, &e), 0);
    CHECK(q.memo_key != NULL);
    char key[80];
    snprintf(key, sizeof key, "%s", q.memo_key ? q.memo_key : "");
    shoal_ev_free_list(replay(&q.gen, key, tool_msg));
    shoal_api_req_free(&q);

    size_t n;
    char *resp = http_post(shoal_http_port(L.h), body, &n);
    CHECK(resp != NULL);
    if (resp) {
        CHECK_STR_CONTAINS(resp, "HTTP/1.1 200 OK");
        CHECK_STR_CONTAINS(resp, "x-shoal-memo: hit");
        char *js = strstr(resp, "\r\n\r\n");
        json_error_t je;
        json_t *o = js ? json_loads(js + 4, 0, &je) : NULL;
        CHECK(o != NULL);
        json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        json_t *msg = json_object_get(ch, "message");
        CHECK(!strcmp(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls"));
        CHECK(!strcmp(json_string_value(json_object_get(msg, "content")), "Sure."));
        CHECK(!strcmp(json_string_value(json_object_get(msg, "reasoning_content")), "Let me check the weather."));
        json_t *tc = json_array_get(json_object_get(msg, "tool_calls"), 0);
        CHECK_EQ_INT(json_array_size(json_object_get(msg, "tool_calls")), 1);
        CHECK(!strncmp(json_string_value(json_object_get(tc, "id")), "call_", 5));
        CHECK(!strcmp(json_string_value(json_object_get(tc, "type")), "function"));
        json_t *fn = json_object_get(tc, "function");
        CHECK(!strcmp(json_string_value(json_object_get(fn, "name")), "get_weather"));
        json_t *args = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, &je);
        CHECK(args && !strcmp(json_string_value(json_object_get(args, "city")), "Paris"));
        json_decref(args);
        json_decref(o);
        free(resp);
    }
    /* streamed: the call in one tool_calls delta, then finish_reason tool_calls */
    char sbody[1024];
    snprintf(sbody, sizeof sbody, "%.*s,\"stream\":true}", (int)strlen(body) - 1, body);
    resp = http_post(shoal_http_port(L.h), sbody, &n);
    CHECK(resp != NULL);
    if (resp) {
        CHECK_STR_CONTAINS(resp, "\"tool_calls\":[{\"index\":0,\"id\":\"call_");
        CHECK_STR_CONTAINS(resp, "\"name\":\"get_weather\"");
        CHECK_STR_CONTAINS(resp, "\"finish_reason\":\"tool_calls\"");
        CHECK_STR_CONTAINS(resp, "data: [DONE]");
        free(resp);
    }
    shoal_http_stop(L.h);
    pthread_join(L.t, NULL);
    shoal_api_close(api);
    shoal_http_close(L.h);
}

/* Issue 30: an n-choice request's children take their parent's rendered ids
 * (one render, not n); a child waits while its parent's render runs, and
 * renders itself when the parent left without one. */
static void t_fork_children_copy_the_render(void)
{
    shoal_sched *s = bare(8, 0, 0);
    int32_t ids[3] = {5, 6, 7};
    shoal_gen_params pp = {.kind = SHOAL_GEN_COMPLETION, .n_prompt_ids = 3};
    pp.prompt_ids = malloc(sizeof ids);
    memcpy(pp.prompt_ids, ids, sizeof ids);
    shoal_gen_params cp = pp;
    cp.prompt_ids = malloc(sizeof ids);
    memcpy(cp.prompt_ids, ids, sizeof ids);
    shoal_sched_job *parent = shoal_sched_job_new(&pp, "a", NULL, NULL, NULL);
    shoal_sched_job *child = shoal_sched_job_new(&cp, "a", NULL, NULL, NULL);
    shoal_sched_job_fork_of(child, parent);
    CHECK_EQ_INT(shoal_sched_submit(s, parent), 0);
    CHECK_EQ_INT(shoal_sched_submit(s, child), 0);
    pthread_mutex_lock(&s->mu);
    shoal_sched_job *first = shoal__sched_pick_render(s);
    shoal_sched_job *second = shoal__sched_pick_render(s); /* the parent is being rendered: none */
    pthread_mutex_unlock(&s->mu);
    CHECK(first == parent && second == NULL);
    /* the parent's render lands (what render_job writes) */
    parent->rids = malloc(sizeof ids);
    memcpy(parent->rids, ids, sizeof ids);
    parent->rn = 3;
    pthread_mutex_lock(&s->mu);
    shoal__sched_render_done(s, parent);
    pthread_mutex_unlock(&s->mu);
    shoal_sched_job_unref(parent); /* the renderer's reference */
    /* the child's turn copies the parent's ids */
    CHECK_EQ_INT(shoal__sched_render_next(s), 1);
    CHECK(child->rstate == SHOAL_RENDER_DONE && child->rn == 3 && child->rids && child->rids != parent->rids &&
          !memcmp(child->rids, ids, sizeof ids));
    /* a rendered child is not admitted before its queued parent */
    pthread_mutex_lock(&s->mu);
    shoal_sched_job *a = shoal__sched_pop_fair(s), *b = shoal__sched_pop_fair(s);
    pthread_mutex_unlock(&s->mu);
    CHECK(a == parent && b == child);
    shoal_sched_job_unref(a);
    shoal_sched_job_unref(b);
    shoal_sched_job_unref(child);
    shoal_sched_job_unref(parent);
    pthread_cond_destroy(&s->rcv);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->memo_mu);
    free(s);
}

int main(void)
{
    test_binary = "test_sched";
    RUN(t_fair_queue);
    RUN(t_fork_children_copy_the_render);
    RUN(t_memo_bounds);
    RUN(t_replay_tool_call);
    RUN(t_replay_stop_strings);
    RUN(t_api_serves_tool_calls);
    shoal_sched_close(sched);
    shoal_model_close(model);
    shoal_tok_close(tok);
    return test_finish();
}
