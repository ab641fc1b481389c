/* worker/wmetrics: counters and their exposition (hand-computed values), and
 * the /metrics responder over a real loopback socket (200, 404, 405, 400).
 * With SHOAL_METRICS_DUMP=PATH, writes this case's exposition there for
 * tests/e2e/test_metrics_expo.py. */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/err.h"
#include "proto/proto.h"
#include "test.h"
#include "worker/wmetrics.h"

static const uint8_t is_moe[3] = {0, 1, 1};

/* Two batches: layer 1, T 2, pairs 3 (expert 0 x2, expert 5 x1), queue 10 µs,
 * compute 300 µs; layer 2, T 1, pairs 2 (experts 1, 2), queue 0, compute 100.
 * One HELLO and one garbage message; one NOT_OWNED error reply. */
static shoal_wmetrics *build(void)
{
    shoal_wmetrics *wm = NULL;
    char err[128];
    shoal_wmetrics_opts o = {.id = "w\"0", .num_layers = 3, .is_moe = is_moe, .num_experts = 8,
                             .expert_bytes = 1000, .owned = 16};
    CHECK_EQ_INT(shoal_wmetrics_open(&wm, &o, err, sizeof err), 0);
    if (!wm)
        return NULL;
    shoal_wmetrics_request(wm, SHOAL_MSG_HELLO, 100);
    shoal_wmetrics_reply(wm, 200, 0);
    shoal_wmetrics_request(wm, 0, 7);
    shoal_wmetrics_reply(wm, 50, SHOAL_PERR_MALFORMED);
    shoal_wmetrics_request(wm, SHOAL_MSG_EXPERT_BATCH, 1000);
    shoal_wmetrics_expert(wm, 1, 0, 2);
    shoal_wmetrics_expert(wm, 1, 5, 1);
    shoal_wmetrics_batch(wm, 2, 3, 2, 10, 300);
    shoal_wmetrics_reply(wm, 400, 0);
    shoal_wmetrics_request(wm, SHOAL_MSG_EXPERT_BATCH, 600);
    shoal_wmetrics_expert(wm, 2, 1, 1);
    shoal_wmetrics_expert(wm, 2, 2, 1);
    shoal_wmetrics_batch(wm, 1, 2, 2, 0, 100);
    shoal_wmetrics_reply(wm, 300, 0);
    shoal_wmetrics_request(wm, SHOAL_MSG_EXPERT_BATCH, 500);
    shoal_wmetrics_reply(wm, 60, SHOAL_PERR_NOT_OWNED);
    shoal_wmetrics_send_failed(wm);
    shoal_wmetrics_expert(wm, 9, 0, 1);  /* out of range: ignored */
    shoal_wmetrics_expert(wm, 1, 8, 1);  /* out of range: ignored */
    shoal_wmetrics_prefetch(wm, 3, 12288, 0, 0); /* a hint read 3 experts */
    shoal_wmetrics_prefetch(wm, 0, 0, 2, 1);     /* 2 of them used, 1 evicted unused */
    shoal_wmetrics_prefetch_dropped(wm);
    return wm;
}

typedef struct {
    const char *name, *k, *v;
    int found;
    double val;
} find_ctx;

static int find(void *ctx, const shoal_metrics_parsed *s)
{
    find_ctx *c = ctx;
    if (strcmp(s->name, c->name))
        return 0;
    if (c->k) {
        const char *v = shoal_metrics_label_get(s, c->k);
        if (!v || strcmp(v, c->v))
            return 0;
    }
    c->found++;
    c->val = s->value;
    return 0;
}

static double get(const char *text, size_t len, const char *name, const char *k, const char *v)
{
    find_ctx c = {name, k, v, 0, NAN};
    char err[128];
    CHECK_EQ_INT(shoal_metrics_parse(text, len, find, &c, err, sizeof err), 0);
    CHECK_MSG(c.found == 1, "%s: %d samples", name, c.found);
    return c.val;
}

/* the types of 1.3-1.8 (TRUNK_BATCH 12, PROBE 14, TRUNK_X 16) are counted under
 * their names, not as "?" (they were, with a table sized for 0..11) */
static void t_later_types(void)
{
    shoal_wmetrics *wm = NULL;
    char err[128];
    shoal_wmetrics_opts o = {.id = "w1", .num_layers = 3, .is_moe = is_moe, .num_experts = 8, .expert_bytes = 1000,
                             .owned = 16};
    CHECK_EQ_INT(shoal_wmetrics_open(&wm, &o, err, sizeof err), 0);
    if (!wm)
        return;
    shoal_wmetrics_request(wm, SHOAL_MSG_TRUNK_BATCH, 10);
    shoal_wmetrics_request(wm, SHOAL_MSG_TRUNK_BATCH, 10);
    shoal_wmetrics_request(wm, SHOAL_MSG_PROBE, 10);
    shoal_wmetrics_request(wm, SHOAL_MSG_TRUNK_X, 10);
    shoal_wmetrics_request(wm, SHOAL_MSG_TRUNK_X, 10);
    shoal_wmetrics_request(wm, SHOAL_MSG_TRUNK_X, 10);
    shoal_wmetrics_request(wm, 17, 10); /* past the last type: "?" */
    shoal_metrics_buf b = {0};
    shoal_wmetrics_write(wm, &b);
    static const struct {
        const char *type;
        double n;
    } want[] = {{"TRUNK_BATCH", 2}, {"PROBE", 1}, {"TRUNK_X", 3}, {"?", 1}, {"EXPERT_BATCH", 0}};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", want[i].type), want[i].n, 0);
    shoal_metrics_buf_free(&b);
    shoal_wmetrics_close(wm);
}

static void t_counters(void)
{
    shoal_wmetrics *wm = build();
    if (!wm)
        return;
    CHECK_EQ_INT(shoal_wmetrics_expert_hits(wm, 1, 0), 2);
    CHECK_EQ_INT(shoal_wmetrics_expert_hits(wm, 2, 2), 1);
    CHECK_EQ_INT(shoal_wmetrics_expert_hits(wm, 1, 1), 0);
    shoal_metrics_buf b = {0};
    shoal_wmetrics_write(wm, &b);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "EXPERT_BATCH"), 3, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "HELLO"), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "?"), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "PING"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "TRUNK_BATCH"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "PROBE"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "TRUNK_X"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_errors_total", "code", "NOT_OWNED"), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_errors_total", "code", "MALFORMED"), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_errors_total", "code", "BAD_ROUTE"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_received_bytes_total", NULL, NULL), 2207, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_sent_bytes_total", NULL, NULL), 1010, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_batches_total", NULL, NULL), 2, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_tokens_total", NULL, NULL), 3, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_pairs_total", NULL, NULL), 5, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_weight_bytes_total", NULL, NULL), 4000, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_queue_seconds_total", NULL, NULL), 10e-6, 1e-15);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_compute_seconds_total", NULL, NULL), 400e-6, 1e-15);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_compute_time_seconds_count", NULL, NULL), 2, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_send_failures_total", NULL, NULL), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_expert_bytes", NULL, NULL), 16000, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_expert_pairs_total", "expert", "5"), 1, 0);
    CHECK(get(b.p, b.len, "shoal_expert_server_resident_bytes", NULL, NULL) > 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_requests_total", "type", "PREFETCH"), 0, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_prefetch_reads_total", NULL, NULL), 3, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_prefetch_read_bytes_total", NULL, NULL), 12288, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_prefetch_hits_total", NULL, NULL), 2, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_prefetch_wasted_total", NULL, NULL), 1, 0);
    CHECK_NEAR(get(b.p, b.len, "shoal_expert_server_prefetch_dropped_total", NULL, NULL), 1, 0);
    CHECK(get(b.p, b.len, "shoal_expert_server_uptime_seconds", NULL, NULL) >= 0);
    CHECK_STR_CONTAINS(b.p, "worker=\"w\\\"0\"");
    /* only hit experts are listed: 4 of them */
    int n = 0;
    for (const char *p = b.p; (p = strstr(p, "\nshoal_expert_server_expert_pairs_total{")); p++)
        n++;
    CHECK_EQ_INT(n, 4);
    shoal_metrics_buf_free(&b);
    shoal_wmetrics_close(wm);
    shoal_wmetrics_close(NULL);
    shoal_wmetrics_request(NULL, 1, 1); /* NULL is a no-op */
}

/* a blocking HTTP exchange on 127.0.0.1:port; returns the whole response */
static char *http(int port, const char *req)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return NULL;
    }
    send(fd, req, strlen(req), 0);
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 1 == cap)
            buf = realloc(buf, cap *= 2);
        ssize_t r = recv(fd, buf + len, cap - 1 - len, 0);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    buf[len] = 0;
    close(fd);
    return buf;
}

static void t_http(void)
{
    shoal_wmetrics *wm = build();
    if (!wm)
        return;
    int port = 0;
    char err[256];
    CHECK_EQ_INT(shoal_wmetrics_listen(wm, "127.0.0.1", 0, &port, err, sizeof err), 0);
    CHECK(port > 0);
    CHECK(shoal_wmetrics_listen(wm, "127.0.0.1", 0, &port, err, sizeof err) == SHOAL_EINVAL);
    char *r = http(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(r != NULL);
    if (r) {
        CHECK(!strncmp(r, "HTTP/1.1 200 OK\r\n", 17));
        CHECK_STR_CONTAINS(r, "Content-Type: text/plain; version=0.0.4");
        char *body = strstr(r, "\r\n\r\n");
        CHECK(body != NULL);
        if (body) {
            body += 4;
            CHECK_NEAR(get(body, strlen(body), "shoal_expert_server_batches_total", NULL, NULL), 2, 0);
            /* Content-Length matches the body */
            const char *cl = strstr(r, "Content-Length: ");
            CHECK(cl && (size_t)atol(cl + 16) == strlen(body));
        }
    }
    free(r);
    r = http(port, "GET /other HTTP/1.0\r\n\r\n");
    CHECK(r && !strncmp(r, "HTTP/1.1 404", 12));
    free(r);
    r = http(port, "POST /metrics HTTP/1.1\r\n\r\n");
    CHECK(r && !strncmp(r, "HTTP/1.1 405", 12));
    free(r);
    r = http(port, "\x01\x02garbage\r\n\r\n");
    CHECK(r && !strncmp(r, "HTTP/1.1 400", 12));
    free(r);
    r = http(port, "GET /metrics?x=1 HTTP/1.1\r\n\r\n");
    CHECK(r && !strncmp(r, "HTTP/1.1 200", 12));
    free(r);
    shoal_wmetrics_close(wm); /* joins the HTTP thread */
    r = http(port, "GET /metrics HTTP/1.1\r\n\r\n");
    CHECK(r == NULL); /* closed */
    free(r);
    /* a bad address is refused naming it */
    wm = build();
    CHECK(shoal_wmetrics_listen(wm, "not-an-ip", 0, NULL, err, sizeof err) == SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "not-an-ip");
    shoal_wmetrics_close(wm);
}

int main(void)
{
    const char *dump = getenv("SHOAL_METRICS_DUMP");
    if (dump) {
        shoal_wmetrics *wm = build();
        shoal_metrics_buf b = {0};
        shoal_wmetrics_write(wm, &b);
        FILE *f = fopen(dump, "w");
        int ok = f && fwrite(b.p, 1, b.len, f) == b.len;
        if (f && fclose(f))
            ok = 0;
        shoal_metrics_buf_free(&b);
        shoal_wmetrics_close(wm);
        return ok ? 0 : 1;
    }
    test_binary = "test_wmetrics";
    RUN(t_counters);
    RUN(t_later_types);
    RUN(t_http);
    return test_finish();
}
