/* Replacement policies for the expert cache (see cachepol.h). */
#include "common/cachepol.h"

#include <stdlib.h>
#include <string.h>

#include "common/err.h"

struct shoal_cachepol {
    shoal_cachepol_opts o;
    int64_t *slot_key;  /* [nslots]: resident key, -1 free */
    int32_t *key_slot;  /* [nkeys]: slot, -1 not resident */
    uint64_t *stamp;    /* [nslots]: access clock at the last use */
    uint64_t *count;    /* [nkeys]: LFU accesses (aged) */
    uint64_t *next;     /* [nkeys]: OPT next use */
    uint64_t clock, since_aging;
    uint32_t nfree;
};

int shoal_cachepol_parse(const char *s, shoal_cachepol_kind *out)
{
    static const char *names[] = {"lru", "lfu", "opt"};
    for (int i = 0; i < 3; i++)
        if (!strcmp(s, names[i])) {
            *out = (shoal_cachepol_kind)i;
            return 0;
        }
    return SHOAL_EINVAL;
}

const char *shoal_cachepol_name(shoal_cachepol_kind k)
{
    return k == SHOAL_CACHEPOL_LRU ? "lru" : k == SHOAL_CACHEPOL_LFU ? "lfu" : k == SHOAL_CACHEPOL_OPT ? "opt" : "?";
}

int shoal_cachepol_open(shoal_cachepol **out, const shoal_cachepol_opts *o, char *err, size_t errlen)
{
    *out = NULL;
    if (o->nslots < 1 || o->nkeys < 1 || o->nslots > (1u << 30) || o->nkeys > (1u << 30) ||
        (unsigned)o->kind > SHOAL_CACHEPOL_OPT)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "cache policy: %u slots, %u keys, kind %d out of range",
                             o->nslots, o->nkeys, (int)o->kind);
    shoal_cachepol *p = shoal_xcalloc(1, sizeof *p);
    p->o = *o;
    if (!p->o.aging)
        p->o.aging = 4 * (uint64_t)o->nkeys;
    p->slot_key = shoal_xmalloc(o->nslots * sizeof *p->slot_key);
    p->key_slot = shoal_xmalloc(o->nkeys * sizeof *p->key_slot);
    p->stamp = shoal_xcalloc(o->nslots, sizeof *p->stamp);
    p->count = shoal_xcalloc(o->nkeys, sizeof *p->count);
    p->next = shoal_xmalloc(o->nkeys * sizeof *p->next);
    for (uint32_t i = 0; i < o->nslots; i++)
        p->slot_key[i] = -1;
    for (uint32_t i = 0; i < o->nkeys; i++) {
        p->key_slot[i] = -1;
        p->next[i] = UINT64_MAX;
    }
    p->nfree = o->nslots;
    *out = p;
    return 0;
}

void shoal_cachepol_close(shoal_cachepol *p)
{
    if (!p)
        return;
    free(p->slot_key);
    free(p->key_slot);
    free(p->stamp);
    free(p->count);
    free(p->next);
    free(p);
}

int shoal_cachepol_lookup(const shoal_cachepol *p, uint32_t key)
{
    return key < p->o.nkeys ? p->key_slot[key] : -1;
}

void shoal_cachepol_set_next(shoal_cachepol *p, uint32_t key, uint64_t next)
{
    if (key < p->o.nkeys)
        p->next[key] = next;
}

void shoal_cachepol_seed(shoal_cachepol *p, const uint64_t *counts)
{
    memcpy(p->count, counts, p->o.nkeys * sizeof *p->count);
}

void shoal_cachepol_drop(shoal_cachepol *p, uint32_t key)
{
    if (key >= p->o.nkeys || p->key_slot[key] < 0)
        return;
    p->slot_key[p->key_slot[key]] = -1;
    p->key_slot[key] = -1;
    p->nfree++;
}

/* 1 if resident slot a is a better victim than slot b. */
static int worse(const shoal_cachepol *p, uint32_t a, uint32_t b)
{
    int64_t ka = p->slot_key[a], kb = p->slot_key[b];
    switch (p->o.kind) {
    case SHOAL_CACHEPOL_LFU:
        if (p->count[ka] != p->count[kb])
            return p->count[ka] < p->count[kb];
        return p->stamp[a] < p->stamp[b];
    case SHOAL_CACHEPOL_OPT:
        if (p->next[ka] != p->next[kb])
            return p->next[ka] > p->next[kb];
        return p->stamp[a] < p->stamp[b];
    default:
        return p->stamp[a] < p->stamp[b];
    }
}

/* Place a key that is not resident: a free slot (never one being filled:
 * the store frees only idle slots), else the policy's victim among the slots
 * not pinned (-1: none). */
static int32_t place(shoal_cachepol *p, uint32_t key, const uint8_t *pinned, int64_t *evicted)
{
    int32_t slot = -1;
    if (p->nfree) {
        for (uint32_t i = 0; i < p->o.nslots; i++)
            if (p->slot_key[i] < 0) {
                slot = (int32_t)i;
                break;
            }
        p->nfree--;
    } else {
        for (uint32_t i = 0; i < p->o.nslots; i++)
            if (!(pinned && pinned[i]) && (slot < 0 || worse(p, i, (uint32_t)slot)))
                slot = (int32_t)i;
        if (slot < 0)
            return -1;
        *evicted = p->slot_key[slot];
        p->key_slot[*evicted] = -1;
    }
    p->slot_key[slot] = key;
    p->key_slot[key] = slot;
    return slot;
}

int shoal_cachepol_insert(shoal_cachepol *p, uint32_t key, const uint8_t *pinned, int64_t *evicted)
{
    *evicted = -1;
    if (key >= p->o.nkeys || p->key_slot[key] >= 0)
        return -1;
    int32_t slot = place(p, key, pinned, evicted);
    if (slot >= 0)
        p->stamp[slot] = ++p->clock; /* recent, but no use counted */
    return slot;
}

int shoal_cachepol_access(shoal_cachepol *p, uint32_t key, const uint8_t *pinned, int *hit, int64_t *evicted)
{
    *hit = 0;
    *evicted = -1;
    if (key >= p->o.nkeys)
        return -1;
    int32_t slot = p->key_slot[key];
    if (slot < 0) {
        slot = place(p, key, pinned, evicted);
        if (slot < 0)
            return -1;
    } else {
        *hit = 1;
    }
    p->stamp[slot] = ++p->clock;
    if (p->o.kind == SHOAL_CACHEPOL_LFU) {
        p->count[key]++;
        if (++p->since_aging >= p->o.aging) {
            p->since_aging = 0;
            for (uint32_t i = 0; i < p->o.nkeys; i++)
                p->count[i] >>= 1;
        }
    }
    return slot;
}
