/* strmap: seeded open-addressing string map (see strmap.h). */
#include "common/strmap.h"

#include <sodium.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

typedef struct {
    const char *key; /* NULL: empty */
    size_t len;
    size_t val;
    uint64_t h;
} ent;

struct shoal_strmap {
    ent *t;
    size_t cap, n; /* cap: a power of two */
    unsigned char seed[crypto_shorthash_KEYBYTES];
};

static uint64_t hash(const shoal_strmap *m, const char *k, size_t len)
{
    unsigned char out[crypto_shorthash_BYTES];
    crypto_shorthash(out, (const unsigned char *)k, len, m->seed);
    uint64_t h;
    memcpy(&h, out, sizeof h);
    return h;
}

shoal_strmap *shoal_strmap_new(void)
{
    if (sodium_init() < 0)
        SHOAL_PANIC("libsodium cannot start");
    shoal_strmap *m = shoal_xcalloc(1, sizeof *m);
    m->cap = 16;
    m->t = shoal_xcalloc(m->cap, sizeof *m->t);
    randombytes_buf(m->seed, sizeof m->seed);
    return m;
}

void shoal_strmap_free(shoal_strmap *m)
{
    if (!m)
        return;
    free(m->t);
    free(m);
}

/* the slot holding key, or the empty slot where it would go */
static ent *find(const shoal_strmap *m, const char *key, size_t len, uint64_t h)
{
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)h & mask;; i = (i + 1) & mask) {
        ent *e = &m->t[i];
        if (!e->key || (e->h == h && e->len == len && !memcmp(e->key, key, len)))
            return e;
    }
}

static void grow(shoal_strmap *m)
{
    ent *old = m->t;
    size_t oc = m->cap;
    m->cap *= 2;
    m->t = shoal_xcalloc(m->cap, sizeof *m->t);
    for (size_t i = 0; i < oc; i++)
        if (old[i].key)
            *find(m, old[i].key, old[i].len, old[i].h) = old[i];
    free(old);
}

int shoal_strmap_put(shoal_strmap *m, const char *key, size_t len, size_t val, size_t *old)
{
    if (!key)
        key = ""; /* len is 0 then; memcmp never sees NULL */
    if (2 * (m->n + 1) > m->cap)
        grow(m);
    uint64_t h = hash(m, key, len);
    ent *e = find(m, key, len, h);
    if (e->key) {
        if (old)
            *old = e->val;
        return 0;
    }
    *e = (ent){.key = key, .len = len, .val = val, .h = h};
    m->n++;
    return 1;
}

int shoal_strmap_get(const shoal_strmap *m, const char *key, size_t len, size_t *val)
{
    if (!key)
        key = "";
    ent *e = find(m, key, len, hash(m, key, len));
    if (!e->key)
        return 0;
    if (val)
        *val = e->val;
    return 1;
}

void shoal_strmap_set(shoal_strmap *m, const char *key, size_t len, size_t val)
{
    if (!key)
        key = "";
    ent *e = find(m, key, len, hash(m, key, len));
    if (e->key)
        e->val = val;
}

size_t shoal_strmap_count(const shoal_strmap *m) { return m->n; }
