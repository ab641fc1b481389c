/* coordinator/owners: owner sets with replicas and the per-exchange choice,
 * on hand-computed cases (the expected picks below were worked out by hand
 * from the rule in owners.h, not produced by the code). */
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/cluster/owners.h"
#include "proto/shard.h"
#include "tests/unit/test.h"

static const uint8_t moe3[3] = {0, 1, 1}; /* layer 0 dense, layers 1-2 MoE */
static const char *names[3] = {"w0", "w1", "w2"};

static shoal_owners *open3(const char *a, const char *b, const char *c, int nw, char *err, size_t errlen, int *rc)
{
    const char *spec[3] = {a, b, c};
    shoal_proto_range *r[3] = {0};
    size_t nr[3] = {0};
    for (int w = 0; w < nw; w++)
        CHECK(shoal_shard_parse(spec[w], &r[w], &nr[w], err, errlen) == 0);
    shoal_owners *o = NULL;
    *rc = shoal_owners_open(&o, nw, (const shoal_proto_range *const *)r, nr, names, 3, moe3, 6, err, errlen);
    for (int w = 0; w < nw; w++)
        free(r[w]);
    return o;
}

/* w0 1-2:0-3, w1 1-2:2-5, w2 1:0,1:5. Layer 1 owners: e0 {0,2}, e1 {0},
 * e2 {0,1}, e3 {0,1}, e4 {1}, e5 {1,2}; layer 2: e2, e3 {0,1}, the rest one. */
static void t_sets(void)
{
    char err[512];
    int rc;
    shoal_owners *o = open3("1-2:0-3", "1-2:2-5", "1:0,1:5", 3, err, sizeof err, &rc);
    CHECK_MSG(rc == 0 && o, "%s", err);
    if (!o)
        return;
    CHECK_EQ_INT((int)shoal_owners_count(o, 0), 8);
    CHECK_EQ_INT((int)shoal_owners_count(o, 1), 8);
    CHECK_EQ_INT((int)shoal_owners_count(o, 2), 2);
    CHECK_EQ_INT((int)shoal_owners_replicated(o), 6);
    const int32_t *who;
    CHECK(shoal_owners_of(o, 1, 0, &who) == 2 && who[0] == 0 && who[1] == 2);
    CHECK(shoal_owners_of(o, 1, 5, &who) == 2 && who[0] == 1 && who[1] == 2);
    CHECK(shoal_owners_of(o, 2, 5, &who) == 1 && who[0] == 1);
    CHECK(shoal_owners_of(o, 0, 1, &who) == 0);
    CHECK(shoal_owners_of(o, 3, 1, &who) == 0 && who == NULL);
    shoal_owners_close(o);
}

static void t_pick(void)
{
    char err[512];
    int rc;
    shoal_owners *o = open3("1-2:0-3", "1-2:2-5", "1:0,1:5", 3, err, sizeof err, &rc);
    if (!o)
        return;
    int32_t pick[6];
    /* layer 1, tokens {0,2} {2,3} {0,5}: pairs e0 2, e2 2, e3 1, e5 1, all
     * replicated; order e0, e2 (2 each, lower id first), e3, e5.
     * e0 {0,2} loads 0,0 -> w0 (w0 = 2); e2 {0,1}: 2 vs 0 -> w1 (w1 = 2);
     * e3 {0,1}: 2 vs 2 -> w0 (w0 = 3); e5 {1,2}: 2 vs 0 -> w2. */
    const int32_t ids1[6] = {0, 2, 2, 3, 0, 5};
    for (int e = 0; e < 6; e++)
        pick[e] = -7;
    shoal_owners_pick(o, 1, 3, 2, ids1, NULL, pick);
    const int32_t want1[6] = {0, -7, 1, 0, -7, 2};
    CHECK_MSG(!memcmp(pick, want1, sizeof want1), "%d %d %d %d %d %d", pick[0], pick[1], pick[2], pick[3], pick[4],
              pick[5]);
    /* the same object again (scratch reset): layer 1, {1,4} {1,2}: fixed
     * e1 -> w0 (2 pairs), e4 -> w1 (1); e2 {0,1}: 2 vs 1 -> w1 */
    const int32_t ids2[4] = {1, 4, 1, 2};
    for (int e = 0; e < 6; e++)
        pick[e] = -7;
    shoal_owners_pick(o, 1, 2, 2, ids2, NULL, pick);
    const int32_t want2[6] = {-7, 0, 1, -7, 1, -7};
    CHECK_MSG(!memcmp(pick, want2, sizeof want2), "%d %d %d %d %d %d", pick[0], pick[1], pick[2], pick[3], pick[4],
              pick[5]);
    /* layer 2 (e0 only on w0 there), one token {0,3}: e0 fixed on w0 -> e3 {0,1} goes to w1.
     * Out-of-range ids are skipped, not picked */
    const int32_t ids3[4] = {0, 3, 99, -1};
    for (int e = 0; e < 6; e++)
        pick[e] = -7;
    shoal_owners_pick(o, 2, 2, 2, ids3, NULL, pick);
    const int32_t want3[6] = {0, -7, -7, 1, -7, -7};
    CHECK(!memcmp(pick, want3, sizeof want3));
    /* deterministic: the same exchange gives the same picks */
    int32_t again[6];
    for (int e = 0; e < 6; e++)
        again[e] = -7;
    shoal_owners_pick(o, 1, 3, 2, ids1, NULL, again);
    CHECK(!memcmp(again, want1, sizeof want1));
    /* failover: w0 down. Layer 1 ids1 again: e0 {0,2} -> w2 (only live
     * owner); e2 {0,1} -> w1; e3 {0,1} -> w1; e5 {1,2}: w1 has 3 pairs, w2 2
     * -> w2. With w0 and w1 down, e2 and e3 have no live owner: their lowest
     * owner, w0 (the caller fails the request naming it). */
    const uint8_t live1[3] = {0, 1, 1}, live2[3] = {0, 0, 1};
    for (int e = 0; e < 6; e++)
        again[e] = -7;
    shoal_owners_pick(o, 1, 3, 2, ids1, live1, again);
    const int32_t want4[6] = {2, -7, 1, 1, -7, 2};
    CHECK_MSG(!memcmp(again, want4, sizeof want4), "%d %d %d %d %d %d", again[0], again[1], again[2], again[3],
              again[4], again[5]);
    for (int e = 0; e < 6; e++)
        again[e] = -7;
    shoal_owners_pick(o, 1, 3, 2, ids1, live2, again);
    const int32_t want5[6] = {2, -7, 0, 0, -7, 2};
    CHECK(!memcmp(again, want5, sizeof want5));
    shoal_owners_close(o);
}

/* Gaps are refused naming them; overlaps are not errors. A worker listing an
 * expert twice owns it once. */
static void t_gaps_and_duplicates(void)
{
    char err[512];
    int rc;
    shoal_owners *o = open3("1-2:0-3", "1-2:2-4", NULL, 2, err, sizeof err, &rc);
    CHECK(rc == SHOAL_ECONFIG && o == NULL);
    CHECK_STR_CONTAINS(err, "layers 1-2 expert 5: owned by no worker");
    CHECK_STR_CONTAINS(err, "(1 gap)");
    CHECK(strstr(err, "overlap") == NULL);
    o = open3("1-2:0-5,1:0-1", "2:5", NULL, 2, err, sizeof err, &rc);
    CHECK_MSG(rc == 0 && o, "%s", err);
    if (!o)
        return;
    const int32_t *who;
    CHECK(shoal_owners_of(o, 1, 0, &who) == 1 && who[0] == 0);
    CHECK(shoal_owners_of(o, 2, 5, &who) == 2 && who[0] == 0 && who[1] == 1);
    CHECK_EQ_INT((int)shoal_owners_count(o, 0), 12);
    CHECK_EQ_INT((int)shoal_owners_replicated(o), 1);
    shoal_owners_close(o);
}

int main(void)
{
    test_binary = "test_owners";
    RUN(t_sets);
    RUN(t_pick);
    RUN(t_gaps_and_duplicates);
    return test_finish();
}
