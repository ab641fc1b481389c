/* coordinator/trace: writer -> reader round trip, token ordinals across
 * chunks, validation of damaged files, statistics and plan loads against a
 * case computed by hand (the numbers in the comments). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/obs/trace.h"
#include "test.h"

static char tmpdir[256];

static const char *tmp(const char *name)
{
    static char buf[4][512];
    static int slot;
    char *b = buf[slot++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", tmpdir, name);
    return b;
}

/* The hand case: 3 layers (0 dense, 1 and 2 MoE), 4 experts, k = 2.
 * Chunk 1 = tokens 0, 1 (a prefill of 2); chunk 2 = token 2 (a decode step).
 *   token 0: L1 {0,1}  L2 {1,3}
 *   token 1: L1 {0,2}  L2 {1,2}
 *   token 2: L1 {0,1}  L2 {0,1}
 * hits L1: e0 3, e1 2, e2 1, e3 0 (6 pairs); L2: e0 1, e1 3, e2 1, e3 1 (6). */
static const shoal_trace_hdr hand_hdr = {.num_layers = 3, .num_experts = 4, .k = 2, .fingerprint = {0xab, 1, 2}};

static void write_hand(const char *path)
{
    shoal_trace *t = NULL;
    char err[256];
    CHECK_EQ_INT(shoal_trace_create(&t, path, &hand_hdr, err, sizeof err), 0);
    const int32_t c1l1[] = {0, 1, 0, 2}, c1l2[] = {1, 3, 1, 2};
    const int32_t c2l1[] = {0, 1}, c2l2[] = {0, 1};
    shoal_trace_record(t, 1, 2, 2, c1l1);
    shoal_trace_record(t, 2, 2, 2, c1l2);
    shoal_trace_record(t, 1, 1, 2, c2l1); /* layer 1 again: a new chunk */
    shoal_trace_record(t, 2, 1, 2, c2l2);
    CHECK_EQ_INT(shoal_trace_count(t), 6);
    CHECK_EQ_INT(shoal_trace_close(t, err, sizeof err), 0);
}

static void t_roundtrip(void)
{
    const char *p = tmp("hand.trace");
    write_hand(p);
    FILE *f = fopen(p, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    CHECK_EQ_INT(size, 64 + 6 * 12); /* header + 6 records of 8 + 2*2 bytes */

    shoal_trace_file *tf = NULL;
    char err[256] = "";
    CHECK_EQ_INT(shoal_trace_open(&tf, p, err, sizeof err), 0);
    if (!tf)
        return;
    const shoal_trace_hdr *h = shoal_trace_file_hdr(tf);
    CHECK_EQ_INT(h->num_layers, 3);
    CHECK_EQ_INT(h->num_experts, 4);
    CHECK_EQ_INT(h->k, 2);
    CHECK_EQ_INT(h->fingerprint[0], 0xab);
    CHECK_EQ_INT(shoal_trace_file_count(tf), 6);
    /* records in write order: (token, layer, experts) */
    const int want[6][4] = {{0, 1, 0, 1}, {1, 1, 0, 2}, {0, 2, 1, 3}, {1, 2, 1, 2}, {2, 1, 0, 1}, {2, 2, 0, 1}};
    for (int i = 0; i < 6; i++) {
        shoal_trace_rec r;
        shoal_trace_file_get(tf, (uint64_t)i, &r);
        CHECK_MSG(r.token == (uint32_t)want[i][0] && r.layer == (uint32_t)want[i][1] && r.n == 2 &&
                      r.experts[0] == want[i][2] && r.experts[1] == want[i][3],
                  "record %d: %u %u %u %u", i, r.token, r.layer, r.experts[0], r.experts[1]);
    }
    shoal_trace_file_close(tf);
}

static void t_validation(void)
{
    /* one corrupted byte at a time: each refused naming the field */
    const char *p = tmp("hand.trace");
    write_hand(p);
    FILE *f = fopen(p, "rb");
    unsigned char buf[256];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    struct {
        const char *what;
        size_t off;
        unsigned char val;
        const char *msg;
    } cases[] = {
        {"magic", 0, 'X', "bad magic"},
        {"major", 8, 2, "format version 2.0"},
        {"layer", 64 + 4, 3, "layer 3 >= num_layers 3"},
        {"n", 64 + 6, 3, "3 experts > k 2"},
        {"expert", 64 + 8, 4, "expert 4 >= num_experts 4"},
        {"order", 64 + 8, 1, "not strictly ascending"},
        {"k", 24, 0, "header"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        unsigned char b2[256];
        memcpy(b2, buf, n);
        b2[cases[c].off] = cases[c].val;
        const char *q = tmp("bad.trace");
        f = fopen(q, "wb");
        fwrite(b2, 1, n, f);
        fclose(f);
        shoal_trace_file *tf = NULL;
        char err[256] = "";
        int rc = shoal_trace_open(&tf, q, err, sizeof err);
        CHECK_MSG(rc != 0 && !tf, "%s accepted", cases[c].what);
        CHECK_STR_CONTAINS(err, cases[c].msg);
        shoal_trace_file_close(tf);
    }
    /* unused slots must be 0xFFFF */
    {
        unsigned char b2[256];
        memcpy(b2, buf, n);
        b2[64 + 6] = 1; /* n = 1: slot 1 must then be 0xFFFF, it is 1 */
        const char *q = tmp("bad.trace");
        f = fopen(q, "wb");
        fwrite(b2, 1, n, f);
        fclose(f);
        shoal_trace_file *tf = NULL;
        char err[256] = "";
        CHECK(shoal_trace_open(&tf, q, err, sizeof err) == SHOAL_EFORMAT);
        CHECK_STR_CONTAINS(err, "unused slot 1");
    }
    /* a partial last record is ignored and counted */
    {
        const char *q = tmp("short.trace");
        f = fopen(q, "wb");
        fwrite(buf, 1, n - 5, f);
        fclose(f);
        shoal_trace_file *tf = NULL;
        char err[256] = "";
        CHECK_EQ_INT(shoal_trace_open(&tf, q, err, sizeof err), 0);
        if (tf) {
            CHECK_EQ_INT(shoal_trace_file_count(tf), 5);
            CHECK_EQ_INT(shoal_trace_file_trailing(tf), 7);
        }
        shoal_trace_file_close(tf);
    }
    /* the writer refuses an id outside the header (sticky, reported at close) */
    {
        shoal_trace *t = NULL;
        char err[256] = "";
        CHECK_EQ_INT(shoal_trace_create(&t, tmp("w.trace"), &hand_hdr, err, sizeof err), 0);
        const int32_t bad[] = {0, 4};
        shoal_trace_record(t, 1, 1, 2, bad);
        CHECK(shoal_trace_close(t, err, sizeof err) == SHOAL_EINVAL);
        CHECK_STR_CONTAINS(err, "expert id outside");
    }
}

static void t_stats(void)
{
    const char *p = tmp("hand.trace");
    write_hand(p);
    shoal_trace_file *tf = NULL;
    char err[256] = "";
    CHECK_EQ_INT(shoal_trace_open(&tf, p, err, sizeof err), 0);
    if (!tf)
        return;
    shoal_trace_stats s;
    shoal_trace_stats_compute(tf, &s);
    CHECK_EQ_INT(s.records, 6);
    CHECK_EQ_INT(s.tokens, 3);
    CHECK_EQ_INT(s.pairs, 12);
    const uint64_t want[3][4] = {{0, 0, 0, 0}, {3, 2, 1, 0}, {1, 3, 1, 1}};
    for (int l = 0; l < 3; l++)
        for (int e = 0; e < 4; e++)
            CHECK_EQ_INT(s.hits[l * 4 + e], want[l][e]);
    CHECK_EQ_INT(s.layer_records[1], 3);
    CHECK_EQ_INT(s.layer_pairs[2], 6);

    shoal_trace_conc c;
    CHECK_EQ_INT(shoal_trace_layer_conc(&s, 0, &c), 0); /* dense layer: nothing */
    CHECK_EQ_INT(shoal_trace_layer_conc(&s, 1, &c), 1);
    /* L1: mean 6/4 = 1.5, max 3 -> 2; top ceil(4/10) = 1 expert: 3/6 = 0.5;
     * p = 1/2, 1/3, 1/6: H = 1.011404 nats, / ln 4 = 0.729574; cold 1 */
    CHECK_NEAR(c.max_over_mean, 2.0, 1e-12);
    CHECK_NEAR(c.top10_share, 0.5, 1e-12);
    CHECK_NEAR(c.entropy, 0.7295739585136224, 1e-9);
    CHECK_EQ_INT(c.cold, 1);
    CHECK_EQ_INT(shoal_trace_layer_conc(&s, 2, &c), 1);
    /* L2: max 3 / 1.5 = 2; p = 1/6, 1/2, 1/6, 1/6: H = 0.5 ln 2 + 0.5 ln 6
     * = 1.242453 nats / ln 4 = 0.896241 */
    CHECK_NEAR(c.max_over_mean, 2.0, 1e-12);
    CHECK_NEAR(c.entropy, 0.8962406251802890, 1e-9);
    CHECK_EQ_INT(c.cold, 0);

    /* plan A: w0 owns experts 0-1, w1 owns 2-3 of layers 1-2.
     * L1: w0 3+2 = 5, w1 1 + 0 = 1 -> imbalance 5 / 3
     * L2: w0 1+3 = 4, w1 1 + 1 = 2 -> imbalance 4 / 3
     * shares 9/12 = 0.75 and 0.25; max/mean 0.75 / 0.5 = 1.5;
     * layer-weighted (5 + 4) / (3 + 3) = 1.5 */
    const char *pp = tmp("plan.json");
    FILE *f = fopen(pp, "w");
    fprintf(f, "{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": ["
               "{\"name\": \"w0\", \"experts\": \"1-2:0-1\"}, {\"name\": \"w1\", \"experts\": \"1-2:2-3\"}]}\n");
    fclose(f);
    shoal_trace_plan pl;
    shoal_trace_load ld;
    CHECK_EQ_INT(shoal_trace_plan_read(&pl, pp, 3, 4, err, sizeof err), 0);
    CHECK_EQ_INT(shoal_trace_plan_load(&pl, &s, &ld, err, sizeof err), 0);
    CHECK_EQ_INT(ld.owned[0], 4);
    CHECK_NEAR(ld.share[0], 0.75, 1e-12);
    CHECK_NEAR(ld.share[1], 0.25, 1e-12);
    CHECK_NEAR(ld.fair[1], 0.5, 1e-12);
    CHECK_NEAR(ld.layer_imb[1], 5.0 / 3, 1e-12);
    CHECK_NEAR(ld.layer_imb[2], 4.0 / 3, 1e-12);
    CHECK_NEAR(ld.imbalance, 1.5, 1e-12);
    CHECK_NEAR(ld.layer_weighted, 1.5, 1e-12);
    shoal_trace_load_free(&ld);
    shoal_trace_plan_free(&pl);

    /* plan B, with a replica: w2 also owns layer 1 expert 0, so its 3 hits
     * split 1.5 / 1.5 between w0 and w2.
     * L1: w0 1.5+2 = 3.5, w1 1, w2 1.5 (mean 2) -> 1.75; L2: w0 4, w1 2, w2 0
     * (mean 2) -> 2; shares w0 7.5/12, w1 3/12, w2 1.5/12; max/mean =
     * 0.625 * 3 = 1.875; layer-weighted (3.5 + 4) / (2 + 2) = 1.875 */
    f = fopen(pp, "w");
    fprintf(f, "{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": ["
               "{\"name\": \"w0\", \"experts\": \"1-2:0-1\"}, {\"name\": \"w1\", \"experts\": \"1-2:2-3\"},"
               "{\"name\": \"w2\", \"experts\": \"1:0\", \"endpoint\": \"tcp://h:1\"}]}\n");
    fclose(f);
    CHECK_EQ_INT(shoal_trace_plan_read(&pl, pp, 3, 4, err, sizeof err), 0);
    CHECK_EQ_INT(shoal_trace_plan_load(&pl, &s, &ld, err, sizeof err), 0);
    CHECK_NEAR(ld.share[0], 7.5 / 12, 1e-12);
    CHECK_NEAR(ld.share[2], 1.5 / 12, 1e-12);
    CHECK_NEAR(ld.layer_imb[1], 1.75, 1e-12);
    CHECK_NEAR(ld.layer_imb[2], 2.0, 1e-12);
    CHECK_NEAR(ld.imbalance, 1.875, 1e-12);
    CHECK_NEAR(ld.layer_weighted, 1.875, 1e-12);
    shoal_trace_load_free(&ld);
    shoal_trace_plan_free(&pl);

    /* plan C leaves layer 2 expert 3 (1 hit) to nobody: refused naming it */
    f = fopen(pp, "w");
    fprintf(f, "{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": ["
               "{\"name\": \"w0\", \"experts\": \"1-2:0-2\"}]}\n");
    fclose(f);
    CHECK_EQ_INT(shoal_trace_plan_read(&pl, pp, 3, 4, err, sizeof err), 0);
    CHECK_EQ_INT(shoal_trace_plan_load(&pl, &s, &ld, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "layer 2 expert 3");
    shoal_trace_plan_free(&pl);

    /* bad plans */
    const char *bad[][2] = {
        {"{\"format\": \"x\", \"version\": 1, \"workers\": []}", "\"format\""},
        {"{\"format\": \"shoal-plan\", \"version\": 2, \"workers\": []}", "\"version\""},
        {"{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": []}", "\"workers\""},
        {"{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": [{\"name\": \"a\"}]}", "workers[0]"},
        {"{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": [{\"name\": \"a\", \"experts\": \"1-3:0\"}]}",
         "outside the model"},
        {"{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": [{\"name\": \"a\", \"experts\": \"x\"}]}",
         "workers[0] (a).experts"},
        {"{\"format\": \"shoal-plan\", \"version\": 1, \"workers\": [{\"name\": \"a\", \"experts\": \"1:0\"},"
         "{\"name\": \"a\", \"experts\": \"1:1\"}]}",
         "appears twice"},
        {"{\"format\": \"shoal-plan\"", "line 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f = fopen(pp, "w");
        fputs(bad[i][0], f);
        fclose(f);
        err[0] = 0;
        CHECK_MSG(shoal_trace_plan_read(&pl, pp, 3, 4, err, sizeof err) != 0, "accepted %s", bad[i][0]);
        CHECK_STR_CONTAINS(err, bad[i][1]);
    }
    shoal_trace_stats_free(&s);
    shoal_trace_file_close(tf);
}

int main(void)
{
    test_binary = "test_trace";
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal_test_trace_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(t_roundtrip);
    RUN(t_validation);
    RUN(t_stats);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd)) {
    }
    return test_finish();
}
