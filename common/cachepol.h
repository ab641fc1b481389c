/* cachepol: replacement policies for a fixed-slot cache of experts -- which
 * resident key to evict on a miss. Pure bookkeeping (no I/O, no threads): the
 * worker's expert store (worker/store.h) drives it for real reads and the
 * offline replay (`shoal trace replay`) drives the very same code over
 * recorded routing traces, so a hit rate measured by the replay is the hit
 * rate the store would get on that access sequence.
 *
 * Keys are dense integers 0..nkeys-1 (layer * num_experts + expert). Policies:
 * - LRU: evict the least recently used resident key.
 * - LFU: evict the resident key with the fewest accesses, ties to the least
 *   recently used; counts are kept for every key (resident or not) and halved
 *   every `aging` accesses, so heat that moves is followed. On K3-like
 *   routing (a router trained for flat usage, and layers visited in a cycle)
 *   LRU thrashes as soon as the cache is smaller than one cycle's footprint,
 *   while LFU keeps a stable resident set whose hit rate is its share of the
 *   traffic.
 * - OPT (Belady): evict the resident key whose next use is farthest; needs
 *   the future, so only the replay can use it (shoal_cachepol_set_next).
 * Not thread-safe: the owner (one thread) serialises calls. Victim choice is
 * a scan over the slots (O(slots) per miss), cheap beside an expert read. */
#ifndef SHOAL_CACHEPOL_H
#define SHOAL_CACHEPOL_H

#include <stddef.h>
#include <stdint.h>

typedef enum { SHOAL_CACHEPOL_LRU, SHOAL_CACHEPOL_LFU, SHOAL_CACHEPOL_OPT } shoal_cachepol_kind;

typedef struct {
    shoal_cachepol_kind kind;
    uint32_t nslots; /* >= 1 */
    uint32_t nkeys;  /* >= 1 */
    /* LFU: halve every count after this many accesses; 0: 4 * nkeys. */
    uint64_t aging;
} shoal_cachepol_opts;

typedef struct shoal_cachepol shoal_cachepol;

int shoal_cachepol_open(shoal_cachepol **out, const shoal_cachepol_opts *o, char *err, size_t errlen);
void shoal_cachepol_close(shoal_cachepol *p); /* accepts NULL */

/* "lru", "lfu", "opt" -> kind; 0 or SHOAL_EINVAL. */
int shoal_cachepol_parse(const char *s, shoal_cachepol_kind *out);
const char *shoal_cachepol_name(shoal_cachepol_kind k);

/* Access key. Returns its slot and sets *hit (1: it was resident). On a miss
 * the key is given a free slot or evicts a victim chosen among the slots whose
 * pinned[slot] is 0 (pinned may be NULL: none pinned) -- the caller must then
 * fill the slot; *evicted is the key that left (or -1). Returns -1 when every
 * slot is pinned (nothing is changed). OPT: call shoal_cachepol_set_next
 * before each access. */
int shoal_cachepol_access(shoal_cachepol *p, uint32_t key, const uint8_t *pinned, int *hit, int64_t *evicted);

/* Resident slot of key, or -1 (no bookkeeping changes). */
int shoal_cachepol_lookup(const shoal_cachepol *p, uint32_t key);

/* Make a key that is not resident resident without counting a use (a
 * prefetch): a free slot or the policy's victim among the slots not pinned,
 * stamped as the most recent (LRU) with its LFU count unchanged. Returns the
 * slot and *evicted as shoal_cachepol_access, or -1 (already resident, out of
 * range, or every slot pinned). A later access of the key is a hit. */
int shoal_cachepol_insert(shoal_cachepol *p, uint32_t key, const uint8_t *pinned, int64_t *evicted);

/* OPT: the position in the access sequence of key's next use after the
 * access about to be made (UINT64_MAX: never again). */
void shoal_cachepol_set_next(shoal_cachepol *p, uint32_t key, uint64_t next);

/* Forget key (its slot becomes free), e.g. after a failed read. */
void shoal_cachepol_drop(shoal_cachepol *p, uint32_t key);

/* Seed LFU counts (e.g. heat from a routing trace): counts[nkeys]. */
void shoal_cachepol_seed(shoal_cachepol *p, const uint64_t *counts);

#endif
