/* relay: a worker's links to its relay peers (`shoal expert --relay-peers`,
 * PROTOCOL.md §3.9, 1.8) -- one DEALER per peer, over which this worker, as a
 * relay parent, forwards a trunk input (TRUNK_X) to its children. It owns the
 * peer list (announced in HELLO, in order), the sockets, and the HELLO each
 * link needs before its first TRUNK_X (`relay: true`; sent again after the
 * peer answered anything with ERROR, e.g. a restarted peer's NO_HELLO).
 * Children never answer TRUNK_X; what comes back (HELLO replies, ERRORs) is
 * read and dropped by shoal_relay_drain. Every send is non-blocking: a child
 * that is not connected or whose queue is full loses that input (counted,
 * the coordinator's failover resends it directly), never a wait.
 *
 * The parking of requests and inputs waiting for their other half is the
 * server loop's (worker/expert_server.c). Callers: the server loop only; one
 * thread owns a shoal_relay and its sockets. */
#ifndef SHOAL_RELAY_H
#define SHOAL_RELAY_H

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "proto/proto.h"
#include "worker/wmetrics.h"

typedef struct {
    /* comma-separated `endpoint[@key]`: key a Z85 public key of 40 characters
     * or a file holding one (`shoal keygen`'s .pub); required for an
     * endpoint that needs CURVE (tcp://) unless this worker runs without
     * CURVE (--insecure). At most SHOAL_PROTO_MAX_RELAY entries. */
    const char *list;
    const char *self;         /* this worker's --listen: an entry equal to it gets no socket */
    const char *curve_secret; /* this worker's key pair file; NULL: plain links */
    void *zctx;               /* the worker's ZeroMQ context; borrowed */
    const uint8_t *fingerprint; /* the model's (SHOAL_PROTO_FP_BYTES), for the HELLO; borrowed */
    const char *id;             /* this worker's id, the HELLO's `peer` */
    shoal_wmetrics *wm;         /* relay counters (NULL: none); borrowed */
} shoal_relay_opts;

typedef struct shoal_relay shoal_relay;

/* Parses the list and opens (connects) every peer's DEALER. SHOAL_EINVAL
 * naming the entry: empty, too long, more than 64, a bad key, a tcp:// peer
 * without a key while this worker has CURVE on, a duplicate endpoint. */
int shoal_relay_open(shoal_relay **out, const shoal_relay_opts *o, char *err, size_t errlen);
void shoal_relay_close(shoal_relay *r); /* accepts NULL; before zmq_ctx_term */

/* The peers' endpoints, in list order (for HELLO `relay`); valid until close. */
int shoal_relay_count(const shoal_relay *r);
const char *const *shoal_relay_endpoints(const shoal_relay *r);

/* Check a subtree against this worker's list: 0, or the first entry whose
 * peer index is not in the list or is this worker itself. */
int shoal_relay_check(const shoal_relay *r, const shoal_proto_fwd *fwd, uint32_t n, uint32_t *bad);

/* Forward x (the frame as received; it is referenced, not copied) to every
 * child of fwd[n] (entries with up 0), each with its own subtree, as TRUNK_X
 * {xid, wait_ms}. Returns the number of children it went to; the others are
 * counted as dropped. Never blocks. */
int shoal_relay_forward(shoal_relay *r, uint64_t xid, uint32_t wait_ms, const shoal_proto_fwd *fwd, uint32_t n,
                        zmq_msg_t *x);

/* Send HELLO on every link that needs one and is connected (at start, and
 * after the peer answered ERROR); read and drop whatever the peers sent back.
 * Called every turn of the server loop (at least every 100 ms). Never blocks. */
void shoal_relay_drain(shoal_relay *r);

#endif
