/* strmap: a map from byte strings to size_t values for request handling,
 * where the keys come from a client (tool-call ids, JSON object keys): an
 * open-addressing table hashed with SipHash-2-4 under a random key drawn per
 * map, so no set of keys chosen in advance collides (a fixed hash such as FNV
 * would let one request make every lookup linear). Insert and lookup are
 * O(1) expected; the table doubles at half load.
 * Keys are borrowed: they must outlive the map and not change. Callers: the
 * chat renderer (tool results to their calls), chatjson (duplicate keys).
 * Not thread-safe (one owner). Aborts on out-of-memory like shoal_xmalloc. */
#ifndef SHOAL_STRMAP_H
#define SHOAL_STRMAP_H

#include <stddef.h>

typedef struct shoal_strmap shoal_strmap;

shoal_strmap *shoal_strmap_new(void);
void shoal_strmap_free(shoal_strmap *m); /* accepts NULL */

/* Maps key[0..len) to val unless the key is present already. Returns 1 when
 * inserted, 0 when present (then *old, if given, is its value). */
int shoal_strmap_put(shoal_strmap *m, const char *key, size_t len, size_t val, size_t *old);

/* 1 and *val when key[0..len) is present, else 0. */
int shoal_strmap_get(const shoal_strmap *m, const char *key, size_t len, size_t *val);

/* Replaces the value of a present key (no-op when absent). */
void shoal_strmap_set(shoal_strmap *m, const char *key, size_t len, size_t val);

size_t shoal_strmap_count(const shoal_strmap *m);

#endif
