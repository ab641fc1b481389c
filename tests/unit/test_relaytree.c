/* coordinator/cluster/relaytree: the latency-aware relay schedule, on cases
 * worked out by hand from the rule in relaytree.h, and its properties against
 * the fixed fan-out tree and all-direct written here from PROTOCOL.md §3.9
 * under the same cost model (not from relaytree.c). The Python statement of
 * the rule (tests/bench/k3_projection.py greedy_schedule) is compared with
 * this code over a grid by tests/e2e/test_relaytree.py through
 * `test_relaytree --dump` (cases on stdin). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/cluster/relaytree.h"
#include "tests/unit/test.h"

/* c = 1, d = 0.1, hop 0.05 (a slow coordinator, fast peers): server 0 at 1
 * (the coordinator); 1: w0 at 1.15 < 2; 2: w0 at 1.25 < w1 1.3 < 2; 3: w1 at
 * 1.3 < w0 1.35 < w2 1.4; 4: w0 1.35 < w1 1.4 = w3 ... -> w0 */
static void t_hand_slow_coordinator(void)
{
    shoal_relaytree t;
    CHECK(shoal_relaytree_greedy(&t, 5, 1.0, 1.0, 10.0, 0.05, 64) == 0);
    const int par[5] = {-1, 0, 0, 1, 0}, ord[5] = {1, 1, 2, 1, 3}, lvl[5] = {1, 2, 2, 3, 2};
    const double arr[5] = {1.0, 1.15, 1.25, 1.3, 1.35};
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(t.parent[i], par[i]);
        CHECK_EQ_INT(t.order[i], ord[i]);
        CHECK_EQ_INT(t.level[i], lvl[i]);
        CHECK_EQ_INT(t.root[i], 0);
        CHECK_NEAR(t.arrival[i], arr[i], 1e-12);
    }
    CHECK_EQ_INT(t.nkids[0], 3);
    CHECK_EQ_INT(t.nkids[1], 1);
    CHECK_EQ_INT(t.direct, 1);
    CHECK_EQ_INT(t.levels, 3);
    CHECK_NEAR(t.last, 1.35, 1e-12);
}

/* the coordinator keeps sending: c = 1, d = 1, hop 0.5: 0 at 1 (C); 1: C at
 * 2 < w0 2.5; 2: w0 2.5 < C 3 < w1 3.5; 3: C 3 < w0 3.5 = w1 3.5 ->C; 4: w0 3.5
 * (earliest served of the tied) */
static void t_hand_mixed(void)
{
    shoal_relaytree t;
    CHECK(shoal_relaytree_greedy(&t, 5, 2.0, 2.0, 2.0, 0.5, 64) == 0);
    const int par[5] = {-1, -1, 0, -1, 0}, ord[5] = {1, 2, 1, 3, 2};
    const double arr[5] = {1, 2, 2.5, 3, 3.5};
    for (int i = 0; i < 5; i++) {
        CHECK_EQ_INT(t.parent[i], par[i]);
        CHECK_EQ_INT(t.order[i], ord[i]);
        CHECK_NEAR(t.arrival[i], arr[i], 1e-12);
    }
    CHECK_EQ_INT(t.direct, 3);
    CHECK_EQ_INT(t.root[4], 0);
    CHECK_EQ_INT(t.root[3], 3);
}

/* the subtree cap: with max_sub 2 and the fast peers of the first case, w0's
 * subtree takes 2, then the coordinator's second send opens another */
static void t_cap(void)
{
    shoal_relaytree t;
    CHECK(shoal_relaytree_greedy(&t, 6, 1.0, 1.0, 10.0, 0.05, 2) == 0);
    int sub0 = 0;
    for (int i = 1; i < 6; i++)
        sub0 += t.root[i] == 0;
    CHECK_EQ_INT(sub0, 2);
    CHECK_EQ_INT(t.parent[3], -1); /* 1 and 2 under w0, then nobody may take 3 but the coordinator */
    CHECK_NEAR(t.arrival[3], 2.0, 1e-12);
    CHECK(t.parent[4] == 3 && t.parent[5] == 3);
}

static void t_refused(void)
{
    shoal_relaytree t;
    t.n = -7;
    CHECK(shoal_relaytree_greedy(&t, 0, 1, 1, 1, 0, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, SHOAL_RELAYTREE_MAX + 1, 1, 1, 1, 0, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 0, 1, 1, 0, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 1, 0, 1, 0, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 1, 1, -1, 0, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 1, 1, 1, -1e-9, 64) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 1, 1, 1, 0, 0) == -1);
    CHECK(shoal_relaytree_greedy(&t, 4, 1e300, 1e-300, 1, 0, 64) == -1);
    CHECK_EQ_INT(t.n, -7);
}

/* the latest arrival of the fixed fan-out tree (PROTOCOL.md §3.9: F roots fed
 * by the coordinator one after the other, then level by level each level's
 * members taking the previous level's in turn as parents, at most F each)
 * under the same costs; F = 0: all direct */
static double fixed_last(int G, int F, double c, double d, double h)
{
    double a[SHOAL_RELAYTREE_MAX], last = 0;
    int nk[SHOAL_RELAYTREE_MAX] = {0};
    int R = F && F < G ? F : G;
    for (int i = 0; i < R; i++)
        a[i] = (i + 1) * c;
    int j = R, start = 0, size = R;
    while (j < G) {
        int next = 0;
        for (int o = 0; o < F * size && j < G; o++, j++, next++) {
            int p = start + o % size;
            nk[p]++;
            a[j] = a[p] + nk[p] * d + h;
        }
        start += size;
        size = next;
    }
    for (int i = 0; i < G; i++)
        last = a[i] > last ? a[i] : last;
    return last;
}

/* never later than F = 2, 3, 4 or all-direct; parents precede children; the
 * same tree twice; over a grid of G, rates and hops */
static void t_properties(void)
{
    const double xbs[] = {400, 17.4e3, 1e6}, nics[] = {1e9 / 8, 10e9 / 8, 50e6 / 8},
                 peers[] = {1e9 / 8, 10e9 / 8, 100e6 / 8}, hops[] = {0, 50e-6, 0.35e-3, 5e-3};
    int cases = 0, trees = 0;
    for (int G = 1; G <= 64; G += G < 8 ? 1 : 7)
        for (size_t a = 0; a < 3; a++)
            for (size_t b = 0; b < 3; b++)
                for (size_t p = 0; p < 3; p++)
                    for (size_t q = 0; q < 4; q++) {
                        shoal_relaytree t, u;
                        memset(&t, 0, sizeof t);
                        memset(&u, 0xff, sizeof u);
                        double c = xbs[a] / nics[b], d = xbs[a] / peers[p];
                        if (shoal_relaytree_greedy(&t, G, xbs[a], nics[b], peers[p], hops[q], 64) ||
                            shoal_relaytree_greedy(&u, G, xbs[a], nics[b], peers[p], hops[q], 64)) {
                            CHECK(0);
                            continue;
                        }
                        cases++;
                        trees += t.direct < G;
                        CHECK(memcmp(t.parent, u.parent, sizeof t.parent[0] * (size_t)G) == 0 &&
                              memcmp(t.order, u.order, sizeof t.order[0] * (size_t)G) == 0 &&
                              memcmp(t.arrival, u.arrival, sizeof t.arrival[0] * (size_t)G) == 0);
                        for (int F = 0; F <= 4; F += F ? 1 : 2)
                            CHECK_MSG(t.last <= fixed_last(G, F, c, d, hops[q]) * (1 + 1e-12),
                                      "G %d xb %g nic %g peer %g hop %g: greedy %g > F=%d %g", G, xbs[a], nics[b],
                                      peers[p], hops[q], t.last, F, fixed_last(G, F, c, d, hops[q]));
                        for (int i = 0; i < G; i++) {
                            CHECK(t.parent[i] < i);
                            CHECK(t.arrival[i] >= (t.parent[i] < 0 ? c : t.arrival[t.parent[i]] + d + hops[q]) -
                                                       1e-15);
                        }
                    }
    CHECK(cases > 500 && trees > 50);
}

/* a hop long against x / nic: all direct by itself (the cloud class,
 * tests/bench/k3_projection.py: 17.4 kB per step, 10 Gb/s, 0.2 ms + 0.1 ms) */
static void t_all_direct(void)
{
    shoal_relaytree t;
    CHECK(shoal_relaytree_greedy(&t, 16, 17.4e3, 10e9 / 8, 10e9 / 8, 0.2e-3, 64) == 0);
    CHECK_EQ_INT(t.direct, 16);
    CHECK_EQ_INT(t.levels, 1);
    CHECK_NEAR(t.last, 16 * 17.4e3 / (10e9 / 8), 1e-12);
    /* the VPS class (1 Gb/s everywhere, hop 0.35 ms): a tree, its last arrival by hand ~1.05 ms against 2.23 ms
     * all direct and 1.32 ms with F = 4 */
    CHECK(shoal_relaytree_greedy(&t, 16, 17.4e3, 1e9 / 8, 1e9 / 8, 0.35e-3, 64) == 0);
    CHECK(t.direct < 16 && t.levels >= 2);
    CHECK_NEAR(t.last, 1.0524e-3, 0.02e-3);
    CHECK_NEAR(fixed_last(16, 4, 17.4e3 / (1e9 / 8), 17.4e3 / (1e9 / 8), 0.35e-3), 1.3132e-3, 0.02e-3);
}

/* --dump: per stdin line "G XB NIC PEER HOP MAXSUB", the schedule (a line
 * "parent order root arrival" per server, or "refused"), then "end" */
static int dump(void)
{
    char line[512];
    while (fgets(line, sizeof line, stdin)) {
        int G, cap;
        double xb, nic, peer, hop;
        shoal_relaytree t;
        if (sscanf(line, "%d %lf %lf %lf %lf %d", &G, &xb, &nic, &peer, &hop, &cap) != 6 ||
            shoal_relaytree_greedy(&t, G, xb, nic, peer, hop, cap))
            printf("refused\n");
        else
            for (int i = 0; i < t.n; i++)
                printf("%d %d %d %.17g\n", t.parent[i], t.order[i], t.root[i], t.arrival[i]);
        printf("end\n");
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--dump"))
        return dump();
    test_binary = "test_relaytree";
    RUN(t_hand_slow_coordinator);
    RUN(t_hand_mixed);
    RUN(t_cap);
    RUN(t_refused);
    RUN(t_properties);
    RUN(t_all_direct);
    return test_finish();
}
