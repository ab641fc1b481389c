/* coordinator/plan: the placement planner and the cluster manifest, on
 * hand-computed cases (the expected owners below were worked out by hand from
 * the method in docs/CLUSTER.md, not produced by the code). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/err.h"
#include "common/planfile.h"
#include "coordinator/cmd/plan.h"
#include "test.h"

static const uint8_t moe3[3] = {0, 1, 1}; /* layer 0 dense, layers 1-2 MoE */

static void t_equal_split(void)
{
    uint64_t budget[2] = {1000, 1000};
    int32_t owner[12];
    shoal_plan_in in = {.num_layers = 3, .num_experts = 4, .is_moe = moe3, .expert_bytes = 10, .nworkers = 2,
                        .budget = budget};
    char err[256];
    CHECK_EQ_INT(shoal_plan_compute(&in, owner, err, sizeof err), 0);
    const int32_t want[12] = {-1, -1, -1, -1, 0, 0, 1, 1, 0, 0, 1, 1};
    CHECK(!memcmp(owner, want, sizeof want));
    char *r = NULL;
    shoal_plan_ranges(owner, NULL, 3, moe3, 4, 0, &r);
    CHECK(!strcmp(r, "1-2:0-1"));
    free(r);
    shoal_plan_ranges(owner, NULL, 3, moe3, 4, 1, &r);
    CHECK(!strcmp(r, "1-2:2-3"));
    free(r);
}

/* Budgets 10, 100, 100 B at 10 B per expert: caps 1, 8, 8 for 8 experts.
 * Water filling: level 8/3 = 2 >= 1 -> w0 holds 1; 7 left over 2 workers ->
 * 3 each, the remainder to w1: counts 1, 4, 3. Layer 1 (2 layers left):
 * left/2 = 0.5, 2, 1.5 -> floors 0, 2, 1 (3 of 4), remainders 1, 0, 1 -> +1 to
 * w0: 1, 2, 1. Layer 2: what is left, 0, 2, 2. */
static void t_capped(void)
{
    uint64_t budget[3] = {10, 100, 100};
    int32_t owner[12];
    shoal_plan_in in = {.num_layers = 3, .num_experts = 4, .is_moe = moe3, .expert_bytes = 10, .nworkers = 3,
                        .budget = budget};
    char err[256];
    CHECK_EQ_INT(shoal_plan_compute(&in, owner, err, sizeof err), 0);
    const int32_t want[12] = {-1, -1, -1, -1, 0, 1, 1, 2, 1, 1, 2, 2};
    CHECK(!memcmp(owner, want, sizeof want));
    const char *rw[3] = {"1:0", "1:1-2,2:0-1", "1:3,2:2-3"};
    for (int w = 0; w < 3; w++) {
        char *r = NULL;
        shoal_plan_ranges(owner, NULL, 3, moe3, 4, w, &r);
        CHECK_MSG(!strcmp(r, rw[w]), "worker %d: %s, want %s", w, r, rw[w]);
        free(r);
    }
}

/* 8 experts of 10 B on budgets of 10 and 29 B: caps 1 + 2 = 3, short by 5
 * experts = 50 B. */
static void t_short(void)
{
    uint64_t budget[2] = {10, 29};
    int32_t owner[12];
    shoal_plan_in in = {.num_layers = 3, .num_experts = 4, .is_moe = moe3, .expert_bytes = 10, .nworkers = 2,
                        .budget = budget};
    char err[512];
    CHECK_EQ_INT(shoal_plan_compute(&in, owner, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "hold 3 of the 8");
    CHECK_STR_CONTAINS(err, "short by 5 experts = 50 B");
}

/* One MoE layer, hits 10, 7, 1, 5, two workers of 2: hottest first, each to
 * the least-loaded worker with room (ties to w0): e0 -> w0 (10, 0), e1 -> w1
 * (10, 7), e3 -> w1 (10, 12; w1 full), e2 -> w0 (11, 12). */
static void t_hits(void)
{
    const uint8_t moe2[2] = {0, 1};
    uint64_t budget[2] = {1000, 1000}, hits[8] = {0, 0, 0, 0, 10, 7, 1, 5};
    int32_t owner[8];
    shoal_plan_in in = {.num_layers = 2, .num_experts = 4, .is_moe = moe2, .expert_bytes = 10, .hits = hits,
                        .nworkers = 2, .budget = budget};
    char err[256];
    CHECK_EQ_INT(shoal_plan_compute(&in, owner, err, sizeof err), 0);
    const int32_t want[8] = {-1, -1, -1, -1, 0, 1, 0, 1};
    CHECK(!memcmp(owner, want, sizeof want));
    char *r = NULL;
    shoal_plan_ranges(owner, NULL, 2, moe2, 4, 0, &r);
    CHECK(!strcmp(r, "1:0,1:2"));
    free(r);
    /* the same inputs give the same plan */
    int32_t again[8];
    CHECK_EQ_INT(shoal_plan_compute(&in, again, err, sizeof err), 0);
    CHECK(!memcmp(owner, again, sizeof again));
}

/* One MoE layer, hits 12 9 6 5 3 1, three workers of 3 experts (30 B at
 * 10 B): 2 each, room for 1 more each. Placement (hottest first, least
 * loaded with room): e0 w0, e1 w1, e2 w2, e3 w2 (6 < 9, 12), e4 w1 (9 < 12),
 * e5 w0 (the only one with room): loads 13, 12, 11.
 * One replica: e0 (12, on w0) -> the least loaded other with room, w2 (11);
 * levelling moves (13 - 11) / 2 = 1: loads 12, 12, 12.
 * Two: then e1 (9, on w1) -> w0 (w2 has no room left); 12 vs 12: nothing
 * moves. Four: room for 3 only. */
/* Redundancy, worked by hand: layer 1 of 4 experts (N = 4), budgets of 4, 2
 * and 2 experts, R = 1: 8 copies, room 4 + 2 + 2 = 8; the order 1:0..1:3
 * repeated twice is cut into runs of 4, 2, 2: w0 all four, w1 e0 e1, w2 e2
 * e3. Domains {0, 0, 1}: w0 and w1 share one, whose room is min(6, N) = 4,
 * and w2's is 2 < 4 copies: refused. Budgets 4, 2, 1: room 7, short by 1.
 * The expected loads (no hits, 1 per expert, in id order): e0 on w0 w1 at
 * 0, 0 -> 0.5, 0.5; e1 -> 1, 1; e2 on w0 w2 at 1, 0 -> w2 rises to 1; e3 at
 * 1, 1 -> 1.5, 1.5: w0 1.5, w1 1, w2 1.5. */
static void t_redundant(void)
{
    const uint8_t moe2[2] = {0, 1};
    uint64_t budget[3] = {40, 20, 20};
    uint8_t hold[3 * 8];
    shoal_plan_in in = {.num_layers = 2, .num_experts = 4, .is_moe = moe2, .expert_bytes = 10, .nworkers = 3,
                        .budget = budget};
    char err[512];
    CHECK_EQ_INT(shoal_plan_redundant(&in, 1, NULL, 0, hold, err, sizeof err), 0);
    const uint8_t want[24] = {0, 0, 0, 0, 1, 1, 1, 1, /* w0 */ 0, 0, 0, 0, 1, 1, 0, 0, /* w1 */
                              0, 0, 0, 0, 0, 0, 1, 1 /* w2 */};
    CHECK(!memcmp(hold, want, sizeof want));
    double load[6];
    shoal_plan_load_held(&in, hold, load);
    CHECK_MSG(load[1] == 1.5 && load[3] == 1 && load[5] == 1.5, "%g %g %g", load[1], load[3], load[5]);
    const int dom[3] = {0, 0, 1};
    CHECK_EQ_INT(shoal_plan_redundant(&in, 1, dom, 2, hold, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "the budgets hold 6");
    budget[2] = 10;
    CHECK_EQ_INT(shoal_plan_redundant(&in, 1, NULL, 0, hold, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "8 expert copies");
    CHECK_STR_CONTAINS(err, "short by 1 experts = 10 B");
    CHECK_EQ_INT(shoal_plan_redundant(&in, 3, NULL, 0, hold, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "4 distinct worker hosts; the cluster has 3");
}

static void t_replicas(void)
{
    const uint8_t moe2[2] = {0, 1};
    uint64_t budget[3] = {30, 30, 30}, hits[12] = {0, 0, 0, 0, 0, 0, 12, 9, 6, 5, 3, 1};
    int32_t owner[12], rep1[12], rep2[12];
    shoal_plan_in in = {.num_layers = 2, .num_experts = 6, .is_moe = moe2, .expert_bytes = 10, .hits = hits,
                        .nworkers = 3, .budget = budget};
    char err[512];
    CHECK_EQ_INT(shoal_plan_compute(&in, owner, err, sizeof err), 0);
    const int32_t want[12] = {-1, -1, -1, -1, -1, -1, 0, 1, 2, 2, 1, 0};
    CHECK(!memcmp(owner, want, sizeof want));
    double load[6];
    shoal_plan_load(&in, owner, NULL, load);
    CHECK(load[0] == 0 && load[1] == 13 && load[3] == 12 && load[5] == 11); /* load[w * L + l] */
    CHECK_EQ_INT(shoal_plan_replicate(&in, 0, owner, rep1, err, sizeof err), 0);
    for (int i = 0; i < 12; i++)
        CHECK(rep1[i] == -1);
    CHECK_EQ_INT(shoal_plan_replicate(&in, 1, owner, rep1, err, sizeof err), 0);
    const int32_t w1[12] = {-1, -1, -1, -1, -1, -1, 2, -1, -1, -1, -1, -1};
    CHECK(!memcmp(rep1, w1, sizeof w1));
    shoal_plan_load(&in, owner, rep1, load);
    CHECK(load[1] == 12 && load[3] == 12 && load[5] == 12);
    CHECK_EQ_INT(shoal_plan_replicate(&in, 2, owner, rep2, err, sizeof err), 0);
    const int32_t w2[12] = {-1, -1, -1, -1, -1, -1, 2, 0, -1, -1, -1, -1};
    CHECK(!memcmp(rep2, w2, sizeof w2));
    char *r = NULL;
    shoal_plan_ranges(owner, rep2, 2, moe2, 6, 0, &r);
    CHECK_MSG(!strcmp(r, "1:0-1,1:5"), "%s", r);
    free(r);
    shoal_plan_ranges(owner, rep2, 2, moe2, 6, 2, &r);
    CHECK_MSG(!strcmp(r, "1:0,1:2-3"), "%s", r);
    free(r);
    CHECK_EQ_INT(shoal_plan_replicate(&in, 4, owner, rep2, err, sizeof err), SHOAL_ECONFIG);
    CHECK_STR_CONTAINS(err, "need room for 4 more experts; the workers' budgets have room for 3: short by 1 experts "
                            "= 10 B");
    CHECK_EQ_INT(shoal_plan_replicate(&in, 7, owner, rep2, err, sizeof err), SHOAL_EINVAL);
    /* no trace, 4 experts on caps 3 and 2: w0 e0-1, w1 e2-3, room on w0
     * only. The "hottest" (lowest id) e0 and e1 are w0's own: passed over;
     * e2 gets the replica, on w0 */
    uint64_t b2[2] = {30, 20};
    shoal_plan_in in2 = {.num_layers = 2, .num_experts = 4, .is_moe = moe2, .expert_bytes = 10, .nworkers = 2,
                         .budget = b2};
    int32_t o2[8], r2[8];
    CHECK_EQ_INT(shoal_plan_compute(&in2, o2, err, sizeof err), 0);
    const int32_t wo2[8] = {-1, -1, -1, -1, 0, 0, 1, 1}, wr2[8] = {-1, -1, -1, -1, -1, -1, 0, -1};
    CHECK(!memcmp(o2, wo2, sizeof wo2));
    CHECK_EQ_INT(shoal_plan_replicate(&in2, 1, o2, r2, err, sizeof err), 0);
    CHECK(!memcmp(r2, wr2, sizeof wr2));
    in2.nworkers = 1;
    CHECK_EQ_INT(shoal_plan_replicate(&in2, 1, o2, r2, err, sizeof err), SHOAL_EINVAL);
    CHECK_STR_CONTAINS(err, "at least two workers");
}

static void t_bytes(void)
{
    uint64_t v = 0;
    CHECK_EQ_INT(shoal_plan_parse_bytes("1.5GiB", &v), 0);
    CHECK(v == 1610612736ull);
    CHECK_EQ_INT(shoal_plan_parse_bytes("400GB", &v), 0);
    CHECK(v == 400000000000ull);
    CHECK_EQ_INT(shoal_plan_parse_bytes("1 KiB", &v), 0);
    CHECK(v == 1024);
    CHECK_EQ_INT(shoal_plan_parse_bytes("12", &v), 0);
    CHECK(v == 12);
    CHECK(shoal_plan_parse_bytes("x", &v) != 0);
    CHECK(shoal_plan_parse_bytes("5PB", &v) != 0);
    CHECK(shoal_plan_parse_bytes("-1", &v) != 0);
}

static const char *good =
    "{\"format\":\"shoal-cluster\",\"version\":1,\"coordinator\":\"c\",\"worker_port\":5555,\"hosts\":["
    "{\"name\":\"c\",\"address\":\"10.0.0.1\",\"ssh_user\":\"root\",\"cpus\":8,\"expert_ram\":0},"
    "{\"name\":\"w0\",\"address\":\"10.0.0.2\",\"ssh_user\":\"shoal\",\"ssh_port\":2222,\"cpus\":64,"
    "\"expert_ram\":\"180GiB\",\"disk\":\"400GB\",\"port\":6000}]}";

static void t_cluster(void)
{
    shoal_plan_cluster c;
    char err[512];
    CHECK_EQ_INT(shoal_plan_cluster_parse(&c, good, strlen(good), "t", err, sizeof err), 0);
    CHECK_EQ_INT(c.nhosts, 2);
    CHECK_EQ_INT(c.coordinator, 0);
    CHECK_EQ_INT(c.hosts[0].port, 5555);
    CHECK_EQ_INT(c.hosts[1].port, 6000);
    CHECK_EQ_INT(c.hosts[1].ssh_port, 2222);
    CHECK_EQ_INT(c.hosts[0].ssh_port, 22);
    CHECK(c.hosts[1].expert_ram == 180ull << 30);
    CHECK(c.hosts[1].disk == 400000000000ull);
    shoal_plan_cluster_free(&c);

    struct {
        const char *from, *to, *want;
    } bad[] = {
        {"\"ssh_user\":\"shoal\",", "", "ssh_user"},
        {"\"coordinator\":\"c\"", "\"coordinator\":\"x\"", "coordinator \"x\" is not one of the hosts"},
        {"\"name\":\"w0\"", "\"name\":\"c\"", "appears twice"},
        {"\"180GiB\"", "\"lots\"", "expert_ram"},
        {"\"cpus\":64", "\"cpus\":0", "cpus"},
        {"\"name\":\"w0\"", "\"name\":\"../x\"", "name must be"},
        {"\"180GiB\"", "0", "no host has expert_ram"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char buf[2048];
        const char *p = strstr(good, bad[i].from);
        CHECK(p != NULL);
        snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p - good), good, bad[i].to, p + strlen(bad[i].from));
        int rc = shoal_plan_cluster_parse(&c, buf, strlen(buf), "t", err, sizeof err);
        CHECK_MSG(rc != 0, "case %zu accepted", i);
        CHECK_STR_CONTAINS(err, bad[i].want);
    }
}

static void t_planfile(void)
{
    char path[] = "/tmp/shoal-test-plan-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    const char *doc = "{\"format\":\"shoal-plan\",\"version\":1,\"model\":{\"fingerprint\":"
                      "\"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\"},"
                      "\"workers\":[{\"name\":\"a\",\"experts\":\"1-2:0-1\",\"endpoint\":\"tcp://h:1\","
                      "\"listen\":\"tcp://0.0.0.0:1\"},{\"name\":\"b\",\"experts\":\"1-2:2-3\"}]}";
    CHECK((size_t)write(fd, doc, strlen(doc)) == strlen(doc));
    close(fd);
    shoal_planfile p;
    char err[256];
    CHECK_EQ_INT(shoal_planfile_read(&p, path, err, sizeof err), 0);
    CHECK_EQ_INT(p.nworkers, 2);
    CHECK(p.has_fingerprint && p.fingerprint[1] == 0x11 && p.fingerprint[31] == 0xff);
    const shoal_planfile_worker *b = shoal_planfile_find(&p, "b");
    CHECK(b && !strcmp(b->experts, "1-2:2-3") && !b->endpoint);
    CHECK(!strcmp(shoal_planfile_find(&p, "a")->listen, "tcp://0.0.0.0:1"));
    CHECK(!shoal_planfile_find(&p, "c"));
    CHECK_EQ_INT(p.relay_fanout, 0);
    shoal_planfile_free(&p);
    unlink(path);
}

/* relay_fanout: 0, 2..4, or "greedy" with relay_rates (PROTOCOL.md §3.9) */
static void t_planfile_relay(void)
{
    const char *w = "\"workers\":[{\"name\":\"a\",\"experts\":\"1-2:0-3\"}]";
    struct {
        const char *extra;
        int rc, fanout;
        double nic, peer, hop;
    } cs[] = {
        {"\"relay_fanout\":3", 0, 3, 0, 0, 0},
        {"\"relay_fanout\":\"greedy\",\"relay_rates\":{\"nic_gbps\":1,\"peer_gbps\":2.5,\"hop_us\":350}", 0,
         SHOAL_RELAY_GREEDY, 1, 2.5, 350},
        {"\"relay_fanout\":\"greedy\",\"relay_rates\":{\"nic_gbps\":1,\"peer_gbps\":2.5,\"hop_us\":0}", 0,
         SHOAL_RELAY_GREEDY, 1, 2.5, 0},
        {"\"relay_fanout\":\"greedy\"", SHOAL_EFORMAT, 0, 0, 0, 0},
        {"\"relay_fanout\":\"greedy\",\"relay_rates\":{\"nic_gbps\":0,\"peer_gbps\":2.5,\"hop_us\":1}",
         SHOAL_EFORMAT, 0, 0, 0, 0},
        {"\"relay_fanout\":\"greedy\",\"relay_rates\":{\"nic_gbps\":1,\"peer_gbps\":2.5,\"hop_us\":-1}",
         SHOAL_EFORMAT, 0, 0, 0, 0},
        {"\"relay_fanout\":\"greedy\",\"relay_rates\":{\"nic_gbps\":1,\"peer_gbps\":\"2\",\"hop_us\":1}",
         SHOAL_EFORMAT, 0, 0, 0, 0},
        {"\"relay_fanout\":\"fast\"", SHOAL_EFORMAT, 0, 0, 0, 0},
        {"\"relay_fanout\":1", SHOAL_EFORMAT, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        char path[] = "/tmp/shoal-test-plan-XXXXXX", doc[512], err[256];
        int fd = mkstemp(path);
        CHECK(fd >= 0);
        snprintf(doc, sizeof doc, "{\"format\":\"shoal-plan\",\"version\":1,%s,%s}", w, cs[i].extra);
        CHECK((size_t)write(fd, doc, strlen(doc)) == strlen(doc));
        close(fd);
        shoal_planfile p;
        memset(&p, 0, sizeof p);
        int rc = shoal_planfile_read(&p, path, err, sizeof err);
        CHECK_MSG(rc == cs[i].rc, "%s: rc %d (%s)", cs[i].extra, rc, rc ? err : "");
        if (!rc && !cs[i].rc) {
            CHECK_EQ_INT(p.relay_fanout, cs[i].fanout);
            CHECK(p.relay_nic_gbps == cs[i].nic && p.relay_peer_gbps == cs[i].peer && p.relay_hop_us == cs[i].hop);
        }
        if (rc)
            CHECK_STR_CONTAINS(err, "relay_");
        shoal_planfile_free(&p);
        unlink(path);
    }
}

int main(void)
{
    test_binary = "test_plan";
    RUN(t_equal_split);
    RUN(t_capped);
    RUN(t_short);
    RUN(t_hits);
    RUN(t_replicas);
    RUN(t_redundant);
    RUN(t_bytes);
    RUN(t_cluster);
    RUN(t_planfile);
    RUN(t_planfile_relay);
    return test_finish();
}
