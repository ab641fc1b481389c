/* cachepol: the replacement policies on short access sequences whose hits
 * and victims are worked out by hand in the comments (not from the code):
 * LRU, LFU (frequency, ties to the least recent, aging), Belady's OPT, pinned
 * slots, drop, and bad options refused. */
#include <stdint.h>
#include <string.h>

#include "common/cachepol.h"
#include "common/err.h"
#include "tests/unit/test.h"

/* Replays seq (keys as letters 'A'..) and returns the hits; hitmask[i] = 1 if
 * access i hit. OPT gets each key's next use computed here. */
static int replay(shoal_cachepol_kind kind, uint32_t slots, const char *seq, uint64_t aging, char *hitmask)
{
    shoal_cachepol *p = NULL;
    char err[256];
    shoal_cachepol_opts o = {.kind = kind, .nslots = slots, .nkeys = 26, .aging = aging};
    if (shoal_cachepol_open(&p, &o, err, sizeof err))
        return -1;
    int n = (int)strlen(seq), hits = 0;
    for (int i = 0; i < n; i++) {
        uint32_t key = (uint32_t)(seq[i] - 'A');
        uint64_t next = UINT64_MAX;
        for (int j = i + 1; j < n; j++)
            if (seq[j] == seq[i]) {
                next = (uint64_t)j;
                break;
            }
        shoal_cachepol_set_next(p, key, next);
        int hit;
        int64_t ev;
        if (shoal_cachepol_access(p, key, NULL, &hit, &ev) < 0)
            hits = -1000;
        hits += hit;
        hitmask[i] = hit ? '1' : '0';
    }
    hitmask[n] = 0;
    shoal_cachepol_close(p);
    return hits;
}

static void t_lru(void)
{
    char m[64];
    /* 2 slots, A A B C A B: A m, A h, B m, C m (evicts A, least recent), A m
     * (evicts B), B m (evicts C) */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LRU, 2, "AABCAB", 0, m), 1);
    CHECK(!strcmp(m, "010000"));
    /* a cycle longer than the cache never hits under LRU */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LRU, 2, "ABCABCABC", 0, m), 0);
}

static void t_lfu(void)
{
    char m[64];
    /* 2 slots, A A B C A B: A m(1), A h(2), B m(1), C m evicts B (1 < 2),
     * A h(3), B m evicts C (C 1 < A 3) */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LFU, 2, "AABCAB", 1000, m), 2);
    CHECK(!strcmp(m, "010010"));
    /* an exactly flat cycle: counts stay tied, ties go to the least recent,
     * so LFU degenerates to LRU and gets nothing either (A B C m; A m evicts
     * B; B m evicts C; C m evicts A; ...) -- its gain on real routing comes
     * from unequal counts (t_lfu_stable_set) */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LFU, 2, "ABCABCABC", 1000, m), 0);
}

static void t_lfu_stable_set(void)
{
    char m[64];
    /* hot keys A, B (accessed twice per round) and a scan of cold C..F: with
     * 3 slots LFU keeps A and B and cycles the cold ones through one slot;
     * LRU loses A and B to the scan. Rounds: "AB" "CDEF" "AB" ...
     * LRU (3 slots): after C D E F, A and B are evicted -> every access misses. */
    const char *seq = "ABABCDEFABABCDEFABABCDEF";
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LRU, 3, seq, 1000, m), 6); /* only the repeated AB within a round */
    /* LFU: round 1: A m B m A h B h, C m (free), D m evicts C (1, least
     * recent among the count-1 keys), E m evicts D, F m evicts E; round 2
     * all of ABAB hit (4), C m evicts F, ...: 2 + 4 + 4 hits */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LFU, 3, seq, 1000, m), 10);
}

static void t_opt(void)
{
    char m[64];
    /* ABCABC, 2 slots: A m, B m, C m evicts B (next A at 3, B at 4), A h,
     * B m evicts A (A never again, C at 5), C h */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_OPT, 2, "ABCABC", 0, m), 2);
    CHECK(!strcmp(m, "000101"));
    /* OPT is never worse than LRU or LFU on the sequences above */
    const char *seqs[] = {"AABCAB", "ABCABCABC", "ABABCDEFABABCDEFABABCDEF", "AAABBBCABCABCABC"};
    for (int i = 0; i < 4; i++)
        for (uint32_t s = 1; s <= 4; s++) {
            int o = replay(SHOAL_CACHEPOL_OPT, s, seqs[i], 0, m);
            CHECK(o >= replay(SHOAL_CACHEPOL_LRU, s, seqs[i], 0, m));
            CHECK(o >= replay(SHOAL_CACHEPOL_LFU, s, seqs[i], 1000, m));
        }
}

static void t_aging(void)
{
    char m[64];
    /* 1 slot keeps whatever is accessed, so use 2 slots: A x4 (count 4), then
     * B C B C B C ... with no aging A stays (B and C fight over one slot, no
     * hits); with aging every 2 accesses A's count decays to 0 and B, C both
     * fit: B C hit from the second round */
    CHECK_EQ_INT(replay(SHOAL_CACHEPOL_LFU, 2, "AAAABCBCBCBC", 1000, m), 3);
    CHECK(replay(SHOAL_CACHEPOL_LFU, 2, "AAAABCBCBCBC", 2, m) > 3);
}

static void t_pinned_and_drop(void)
{
    shoal_cachepol *p = NULL;
    char err[256];
    shoal_cachepol_opts o = {.kind = SHOAL_CACHEPOL_LRU, .nslots = 2, .nkeys = 8};
    CHECK_EQ_INT(shoal_cachepol_open(&p, &o, err, sizeof err), 0);
    uint8_t pin[2] = {0, 0};
    int hit;
    int64_t ev;
    int s0 = shoal_cachepol_access(p, 0, pin, &hit, &ev);
    int s1 = shoal_cachepol_access(p, 1, pin, &hit, &ev);
    CHECK(s0 >= 0 && s1 >= 0 && s0 != s1);
    pin[s0] = 1; /* key 0 is LRU but pinned: key 2 must evict key 1 */
    int s2 = shoal_cachepol_access(p, 2, pin, &hit, &ev);
    CHECK_EQ_INT(s2, s1);
    CHECK_EQ_INT((int)ev, 1);
    pin[s1] = 1;
    CHECK_EQ_INT(shoal_cachepol_access(p, 3, pin, &hit, &ev), -1); /* all pinned */
    CHECK_EQ_INT(shoal_cachepol_lookup(p, 3), -1);
    shoal_cachepol_drop(p, 0);
    CHECK_EQ_INT(shoal_cachepol_lookup(p, 0), -1);
    CHECK_EQ_INT(shoal_cachepol_access(p, 3, pin, &hit, &ev), s0); /* the freed slot */
    CHECK_EQ_INT(hit, 0);
    CHECK_EQ_INT(shoal_cachepol_access(p, 3, pin, &hit, &ev), s0);
    CHECK_EQ_INT(hit, 1);
    CHECK_EQ_INT(shoal_cachepol_access(p, 99, pin, &hit, &ev), -1); /* key out of range */
    shoal_cachepol_close(p);
    shoal_cachepol_opts bad = {.kind = SHOAL_CACHEPOL_LFU, .nslots = 0, .nkeys = 8};
    CHECK(shoal_cachepol_open(&p, &bad, err, sizeof err) == SHOAL_EINVAL);
    shoal_cachepol_kind k;
    CHECK(shoal_cachepol_parse("lfu", &k) == 0 && k == SHOAL_CACHEPOL_LFU);
    CHECK(shoal_cachepol_parse("mru", &k) == SHOAL_EINVAL);
}

int main(void)
{
    test_binary = "test_cachepol";
    RUN(t_lru);
    RUN(t_lfu);
    RUN(t_lfu_stable_set);
    RUN(t_opt);
    RUN(t_aging);
    RUN(t_pinned_and_drop);
    return test_finish();
}
