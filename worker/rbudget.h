/* rbudget: the worker's reply budget -- bytes of replies it has handed to
 * ZeroMQ that ZeroMQ has not yet released (a reply is released once its last
 * byte is written to the kernel, or when its connection is dropped), counted
 * per peer (ZeroMQ routing id, i.e. per connection) and in total, so a peer
 * that asks for large replies and never reads them cannot make the worker
 * hold more than a fixed number of bytes (PROTOCOL.md section 6, docs/CONFIG.md
 * "Resource bounds"). The worker's socket thread admits and allocates every
 * reply data frame here; the release runs on ZeroMQ's I/O thread as the
 * message's free function, so the counters are atomics. Only that one socket
 * thread may call shoal_rbudget_alloc. Callers: worker/expert_server.c, tests. */
#ifndef SHOAL_RBUDGET_H
#define SHOAL_RBUDGET_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    /* A reply is refused when its peer already holds unreleased replies and
     * they plus it would exceed peer_bytes, or when some are held in total
     * and they plus it would exceed total_bytes. A peer holding none may
     * always have one reply (at most the protocol's largest), so a legal
     * request is never refused for being large. Both > 0. */
    uint64_t peer_bytes;
    uint64_t total_bytes;
    /* Before refusing, wait up to this long for ZeroMQ to release earlier
     * replies (a coordinator that reads its reply may send the next request
     * a few microseconds before the I/O thread frees the last one). */
    unsigned wait_us;
} shoal_rbudget_opts;

typedef struct shoal_rbudget shoal_rbudget;

/* SHOAL_EINVAL with err for a zero limit. */
int shoal_rbudget_open(shoal_rbudget **out, const shoal_rbudget_opts *o, char *err, size_t errlen);
/* Frees the table. Call only once no message allocated here is alive (after
 * the ZeroMQ context is terminated). Accepts NULL. */
void shoal_rbudget_close(shoal_rbudget *b);

/* Admit a reply data frame of len bytes for peer (routing id bytes). 0: *data
 * (len bytes, 64-byte aligned) and *hint are to be given to
 * zmq_msg_init_data(msg, *data, len, shoal_rbudget_release, *hint) -- or to
 * shoal_rbudget_release(*data, *hint) directly if no message is made.
 * SHOAL_EBUSY: refused, why names the limit and the bytes held;
 * SHOAL_ENOMEM: allocation failed. */
int shoal_rbudget_alloc(shoal_rbudget *b, const uint8_t *peer, size_t peerlen, size_t len, void **data, void **hint,
                        char *why, size_t whylen);
/* The free function (any thread): releases the bytes and the buffer. */
void shoal_rbudget_release(void *data, void *hint);

typedef struct {
    uint64_t held;     /* bytes allocated and not yet released, all peers */
    uint64_t peak;     /* the largest `held` seen at an admission */
    uint64_t refused;  /* replies refused by a limit */
    uint64_t admitted; /* replies admitted */
} shoal_rbudget_stats;
void shoal_rbudget_stats_get(shoal_rbudget *b, shoal_rbudget_stats *out);
/* Bytes held for one peer (0 if unknown). */
uint64_t shoal_rbudget_peer_held(shoal_rbudget *b, const uint8_t *peer, size_t peerlen);

#endif
