/* replay: the access sequence built from a routing trace (one request per
 * run of same-layer records, distinct experts ascending, flagged request
 * starts) and the hits of LRU and OPT on it, worked out by hand below. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/cmd/replay.h"
#include "coordinator/obs/trace.h"
#include "tests/unit/test.h"

static void t_keys_and_hits(void)
{
    char path[] = "/tmp/shoal-test-replay-XXXXXX", err[512];
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    close(fd);
    shoal_trace_hdr h = {.num_layers = 2, .num_experts = 4, .k = 2};
    shoal_trace *t = NULL;
    CHECK_EQ_INT(shoal_trace_create(&t, path, &h, err, sizeof err), 0);
    /* prefill of 2 tokens: layer 0 {0,1},{1,2}; layer 1 {0,3},{0,3};
     * then one decode token: layer 0 {0,1}; layer 1 {0,3} */
    const int32_t p0[4] = {0, 1, 1, 2}, p1[4] = {0, 3, 0, 3}, d0[2] = {0, 1}, d1[2] = {0, 3};
    shoal_trace_record(t, 0, 2, 2, p0);
    shoal_trace_record(t, 1, 2, 2, p1);
    shoal_trace_record(t, 0, 1, 2, d0);
    shoal_trace_record(t, 1, 1, 2, d1);
    CHECK_EQ_INT(shoal_trace_close(t, err, sizeof err), 0);
    shoal_trace_file *f = NULL;
    CHECK_EQ_INT(shoal_trace_open(&f, path, err, sizeof err), 0);
    uint32_t *keys = NULL;
    uint64_t n = 0;
    shoal_replay_keys(f, &keys, &n);
    const uint32_t G = SHOAL_REPLAY_GROUP;
    const uint32_t want[9] = {0 | G, 1, 2, 4 | G, 7, 0 | G, 1, 4 | G, 7};
    CHECK_EQ_INT((int)n, 9);
    for (uint64_t i = 0; i < n && i < 9; i++)
        CHECK_MSG(keys[i] == want[i], "key %d: %x != %x", (int)i, keys[i], want[i]);
    uint64_t hits = 99;
    /* LRU, 3 slots: 0 1 2 miss; 4 evicts 0, 7 evicts 1; 0 evicts 2, 1 evicts
     * 4; 4 evicts 7, 7 evicts 0: no hit */
    CHECK_EQ_INT(shoal_replay_run(keys, n, 8, 3, SHOAL_CACHEPOL_LRU, 0, NULL, &hits, err, sizeof err), 0);
    CHECK_EQ_INT((int)hits, 0);
    /* OPT, 3 slots: 0 1 2 miss; 4 evicts 2 (never used again); 7 evicts 1
     * (4 is pinned by its request; 0 is next used at 5, 1 at 6); 0 hit; 1
     * evicts 7 (next use 8, farther than 4's 7); 4 hit; 7 miss: 2 hits */
    CHECK_EQ_INT(shoal_replay_run(keys, n, 8, 3, SHOAL_CACHEPOL_OPT, 0, NULL, &hits, err, sizeof err), 0);
    CHECK_EQ_INT((int)hits, 2);
    /* enough slots for everything: only the 5 first uses miss */
    CHECK_EQ_INT(shoal_replay_run(keys, n, 8, 8, SHOAL_CACHEPOL_LFU, 0, NULL, &hits, err, sizeof err), 0);
    CHECK_EQ_INT((int)hits, 4);
    CHECK(shoal_replay_run(keys, n, 4, 3, SHOAL_CACHEPOL_LRU, 0, NULL, &hits, err, sizeof err) != 0); /* key 7 >= 4 */
    free(keys);
    shoal_trace_file_close(f);
    unlink(path);
}

int main(void)
{
    test_binary = "test_replay";
    RUN(t_keys_and_hits);
    return test_finish();
}
