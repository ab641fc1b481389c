/* proto: pure encode/decode of the coordinator <-> expert-server messages of
 * proto/PROTOCOL.md (the contract; version SHOAL_PROTO_MAJOR.MINOR). No sockets,
 * no model: callers are the worker's server loop, the coordinator's expert client,
 * the tests and the fuzz target.
 *
 * Encoders write a control frame (MessagePack) into a caller buffer and never
 * allocate. Decoders take the frames of one multipart message as borrowed
 * (pointer, length) pairs; decoded tensors and strings point into those frames
 * or into fixed arrays of the message struct, so a decoded message lives as long
 * as the frames it came from. Only a HELLO reply's ownership lists are allocated
 * (shoal_proto_msg_clear frees them). Every byte is bounds-checked; nothing from
 * the wire reaches an assert. Thread-safety: no shared state. */
#ifndef SHOAL_PROTO_H
#define SHOAL_PROTO_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_PROTO_MAJOR 1
#define SHOAL_PROTO_MINOR 8

#define SHOAL_PROTO_MAX_CONTROL (4u << 20) /* control frame bytes */
#define SHOAL_PROTO_MAX_FRAMES 3
#define SHOAL_PROTO_MAX_KEYS 64       /* keys in one body map */
#define SHOAL_PROTO_MAX_TEXT 1024     /* ERROR message bytes */
#define SHOAL_PROTO_MAX_ID 64         /* peer / worker id bytes */
#define SHOAL_PROTO_MAX_RANGES 262144 /* owned ranges in a HELLO reply */
#define SHOAL_PROTO_TENSOR_HDR 16
#define SHOAL_PROTO_FP_BYTES 32
#define SHOAL_PROTO_MAX_PREFETCH 1024 /* experts in one PREFETCH */
#define SHOAL_PROTO_MAX_NAME 128       /* a trunk matrix name (checkpoint tensor name) */
#define SHOAL_PROTO_MAX_TROWS 65536    /* trunk row ranges in a HELLO reply (1.3) */
#define SHOAL_PROTO_MAX_TSEGS 64       /* (matrix, rows) segments in one TRUNK_BATCH (1.3) */
#define SHOAL_PROTO_MAX_TCHAIN 8       /* chained segments in one TRUNK_BATCH (1.4) */
#define SHOAL_PROTO_MAX_CHAIN_ROWS 4096 /* rows of a chain's first matrix (1.4) */
#define SHOAL_PROTO_MAX_PROBE ((4u << 20) - 16u) /* payload bytes of a PROBE's x or its reply's y (1.5) */
#define SHOAL_PROTO_MAX_NUMERICS 16   /* bytes of HELLO 'numerics' (1.6) */
#define SHOAL_PROTO_MAX_CPU 128        /* bytes of PROBE_REPLY 'cpu' (1.5) */
#define SHOAL_PROTO_MAX_RELAY 64       /* HELLO 'relay' peers; entries of a 'fwd' subtree (1.8) */
#define SHOAL_PROTO_MAX_ENDPOINT 256   /* bytes of one HELLO 'relay' endpoint (1.8) */
#define SHOAL_PROTO_MAX_WAIT_MS 60000  /* 'wait_ms' of a relayed TRUNK_BATCH or a TRUNK_X (1.8) */

typedef enum {
    SHOAL_MSG_HELLO = 1,
    SHOAL_MSG_ERROR = 2,
    SHOAL_MSG_PING = 3,
    SHOAL_MSG_PONG = 4,
    SHOAL_MSG_STATS = 5,
    SHOAL_MSG_STATS_REPLY = 6,
    SHOAL_MSG_SHUTDOWN = 7,
    SHOAL_MSG_SHUTDOWN_ACK = 8,
    SHOAL_MSG_EXPERT_BATCH = 9,
    SHOAL_MSG_EXPERT_RESULT = 10,
    SHOAL_MSG_PREFETCH = 11, /* a notice (1.2): never answered */
    SHOAL_MSG_TRUNK_BATCH = 12,  /* 1.3: rows of trunk matrices applied to one input */
    SHOAL_MSG_TRUNK_RESULT = 13, /* 1.3 */
    SHOAL_MSG_PROBE = 14,        /* 1.5: a timed echo of a payload, and optionally the host's facts */
    SHOAL_MSG_PROBE_REPLY = 15,  /* 1.5 */
    SHOAL_MSG_TRUNK_X = 16,      /* 1.8: a relayed trunk input, worker -> worker notice */
} shoal_msg_type;

const char *shoal_msg_type_name(int type); /* "HELLO", ...; "?" if unknown */

/* ERROR codes on the wire (PROTOCOL.md §3.2), with the shoal error code each
 * maps to on the coordinator side. */
#define SHOAL_PERR_MAP(X)                                                                                              \
    X(MALFORMED, 1, SHOAL_EPROTO)                                                                                      \
    X(VERSION, 2, SHOAL_EVERSION)                                                                                      \
    X(FINGERPRINT, 3, SHOAL_EFINGERPRINT)                                                                              \
    X(NO_HELLO, 4, SHOAL_EPROTO)                                                                                       \
    X(UNKNOWN_TYPE, 5, SHOAL_EPROTO)                                                                                   \
    X(BAD_SHAPE, 6, SHOAL_ERANGE)                                                                                      \
    X(NOT_OWNED, 7, SHOAL_ERANGE)                                                                                      \
    X(BAD_ROUTE, 8, SHOAL_ERANGE)                                                                                      \
    X(UNSUPPORTED, 9, SHOAL_EUNSUPPORTED)                                                                              \
    X(SHUTTING_DOWN, 10, SHOAL_ECANCELED)                                                                              \
    X(INTERNAL, 11, SHOAL_EINTERNAL)

typedef enum {
    SHOAL_PERR_OK = 0,
#define SHOAL_PERR_ENUM(name, val, code) SHOAL_PERR_##name = val,
    SHOAL_PERR_MAP(SHOAL_PERR_ENUM)
#undef SHOAL_PERR_ENUM
} shoal_perr;

const char *shoal_perr_name(int perr); /* "MALFORMED", ...; "?" if unknown */
int shoal_perr_to_err(int perr);       /* common/err.h code; SHOAL_EPEER if unknown */

/* Tensor frame dtypes (PROTOCOL.md §4) and the dtype names used in bodies. */
typedef enum { SHOAL_WIRE_F32 = 1, SHOAL_WIRE_BF16 = 2, SHOAL_WIRE_I32 = 3 } shoal_wire_dtype;
size_t shoal_wire_dtype_size(int dt);      /* 0 if unknown */
const char *shoal_wire_dtype_name(int dt); /* "f32", "bf16", "i32" */
#define SHOAL_WIRE_MASK(dt) (1u << (dt))

/* One frame of a multipart message (borrowed). */
typedef struct {
    const uint8_t *data;
    size_t len;
} shoal_frame;

/* A decoded tensor frame: data points at the payload inside the frame
 * (unaligned in general: copy before using it as float/int arrays). */
typedef struct {
    int dtype; /* shoal_wire_dtype */
    uint32_t rows, cols;
    const uint8_t *data;
    size_t nbytes;
} shoal_proto_tensor;

/* Rows lo..hi (inclusive) of the trunk matrix `name` (PROTOCOL.md §3.7):
 * owned (HELLO) or asked for (TRUNK_BATCH). */
typedef struct {
    char name[SHOAL_PROTO_MAX_NAME + 1];
    uint32_t lo, hi;
} shoal_proto_trows;

/* A chained segment (TRUNK_BATCH 'chain', 1.4, PROTOCOL.md §3.7): every row
 * of matrix `a` applied to the request's input, then rows b.lo..b.hi of
 * matrix b.name applied to that output. */
typedef struct {
    char a[SHOAL_PROTO_MAX_NAME + 1];
    shoal_proto_trows b;
} shoal_proto_tchain;

/* One entry of a relay subtree ('fwd', 1.8, PROTOCOL.md §3.9): peer is an
 * index into the receiver's relay peer list (< SHOAL_PROTO_MAX_RELAY); up is
 * 0 for a child of the receiver, else 1 + the position of its parent entry,
 * which comes earlier in the list (so a subtree has no loops). */
typedef struct {
    uint8_t peer, up;
} shoal_proto_fwd;

/* The relay keys of a TRUNK_BATCH or a TRUNK_X (1.8). xid 0: not relayed. */
typedef struct {
    uint64_t xid;     /* the input's id, unique per coordinator, >= 1 */
    uint32_t wait_ms; /* 1 .. SHOAL_PROTO_MAX_WAIT_MS: how long the receiver parks it */
    uint32_t nfwd;    /* fwd[0..nfwd-1]; 0: no subtree (a leaf) */
    shoal_proto_fwd fwd[SHOAL_PROTO_MAX_RELAY];
} shoal_proto_relay;

/* Inclusive range of owned experts: layers l_lo..l_hi × experts e_lo..e_hi. */
typedef struct {
    uint32_t l_lo, l_hi, e_lo, e_hi;
} shoal_proto_range;

typedef struct {
    uint32_t major, minor;
    uint8_t fingerprint[SHOAL_PROTO_FP_BYTES];
    char id[SHOAL_PROTO_MAX_ID + 1]; /* request: "peer"; reply: "worker" */
    /* reply only */
    shoal_proto_range *owned; /* decoded: allocated; encoding: borrowed */
    size_t nowned;
    uint32_t act_mask, out_mask; /* SHOAL_WIRE_MASK bits */
    uint32_t max_tokens;
    char isa[17];
    uint32_t threads;
    uint64_t expert_bytes, mem_total;
    int prefetch; /* 1.2, optional: the worker acts on PREFETCH hints (encoded only when 1) */
    /* 1.3, optional (encoded only when ntrunk > 0): owned trunk rows and the
     * trunk fingerprint over those matrices (proto/fprint.h) */
    shoal_proto_trows *trunk; /* decoded: allocated; encoding: borrowed */
    size_t ntrunk;
    uint8_t trunk_fp[SHOAL_PROTO_FP_BYTES];
    /* 1.6, optional: the worker's numerics class (docs/ARCHITECTURE.md), at
     * most 16 bytes. Encoded only when set and not "portable"; decoded as
     * "portable" when absent (a 1.0-1.5 worker computes the portable order). */
    char numerics[SHOAL_PROTO_MAX_NUMERICS + 1];
    /* 1.7, optional (encoded only when 1): a bf16 EXPERT_BATCH `act` gives
     * this worker's bits for its f32 original (the mu class, and every expert
     * it serves has MXFP4 or BF16 weights: every product reading act rounds
     * it to bf16 first). PROTOCOL.md §3.1. */
    int bf16_exact;
    /* 1.8 (PROTOCOL.md §3.9), optional. Request: relay_parent 1 (key `relay`:
     * true) -- the sender is a worker that will forward TRUNK_X on this
     * connection. Reply: the worker's relay peers (`--relay-peers`), in its
     * list order; nrelay 0: it does not relay (the key is not sent). */
    int relay_parent;
    uint32_t nrelay;
    char relay[SHOAL_PROTO_MAX_RELAY][SHOAL_PROTO_MAX_ENDPOINT + 1];
} shoal_proto_hello;

typedef struct {
    char worker[SHOAL_PROTO_MAX_ID + 1];
    uint64_t uptime_us, requests, errors, batches, tokens, pairs, bytes_in, bytes_out, queue_us, compute_us;
} shoal_proto_stats;

/* The host facts of a PROBE_REPLY (1.5, PROTOCOL.md §3.8), all optional on
 * the wire (has = 1 when the reply carried them). Rates in bytes/s. */
typedef struct {
    int has;
    char cpu[SHOAL_PROTO_MAX_CPU + 1];
    char isa[17];
    char version[33];
    uint32_t cores, threads;
    uint64_t mem_total, mem_avail, disk_free, disk_total;
    uint64_t read_bw_1, read_bw_all; /* memory read rate, one thread / all threads */
    uint64_t disk_read_bw;           /* the model files read from disk (0: not measured) */
    uint64_t held_bytes;             /* weight bytes it serves (experts + trunk rows) */
    uint64_t measure_us;             /* time the measurements took */
} shoal_proto_facts;

typedef struct {
    int type;     /* shoal_msg_type */
    uint64_t rid; /* request id (0 when the envelope did not decode) */
    shoal_proto_hello hello;
    struct {
        uint32_t code; /* shoal_perr */
        char message[SHOAL_PROTO_MAX_TEXT + 1];
    } error;
    shoal_proto_stats stats;
    struct {
        uint32_t layer;
        int out; /* shoal_wire_dtype: BF16 or F32 */
        shoal_proto_tensor act, route;
    } batch;
    struct {
        uint64_t queue_us, compute_us;
        shoal_proto_tensor y;
    } result;
    struct {
        uint32_t layer; /* the layer the rows serve (num_layers: lm_head); for logs and metrics */
        uint32_t n;     /* seg[0..n-1], 0 <= n <= SHOAL_PROTO_MAX_TSEGS */
        shoal_proto_trows seg[SHOAL_PROTO_MAX_TSEGS];
        uint32_t nchain; /* 1.4: chain[0..nchain-1] (0 when absent); n + nchain >= 1 */
        shoal_proto_tchain chain[SHOAL_PROTO_MAX_TCHAIN];
        shoal_proto_tensor x; /* F32 [T, cols], or BF16 (1.7: where exact, PROTOCOL.md §3.7) */
        /* 1.8: relay.xid != 0: the input travels through the relay tree
         * (§3.9). has_x 0: no x frame, the x comes as the TRUNK_X of this xid;
         * has_x 1 with relay.nfwd > 0: a root, which forwards x on. */
        shoal_proto_relay relay;
        int has_x;
    } tbatch;
    struct {
        shoal_proto_relay relay; /* xid, wait_ms and the receiver's subtree */
        shoal_proto_tensor x;    /* as a TRUNK_BATCH's x */
    } trunkx;
    struct {
        uint64_t queue_us, compute_us;
        shoal_proto_tensor y; /* F32 [1, T * sum of segment rows], segment-major */
    } tresult;
    struct {
        uint32_t reply; /* bytes of the reply's y payload asked for (multiple of 4, 4 ..  MAX_PROBE) */
        int facts;      /* 1: measure and send the host facts */
        shoal_proto_tensor x; /* F32 [1, n]: the payload, contents unused */
    } probe;
    struct {
        shoal_proto_facts facts;
        shoal_proto_tensor y; /* F32 [1, reply / 4] */
    } preply;
    struct {
        uint32_t layer;
        uint32_t n; /* experts[0..n-1], strictly ascending */
        uint32_t experts[SHOAL_PROTO_MAX_PREFETCH];
    } prefetch;
} shoal_proto_msg;

void shoal_proto_msg_clear(shoal_proto_msg *m); /* frees hello.owned if decoded; zeroes m */

/* ---- encoding (control frames; tensor frame headers) ------------------- */
/* Each writes at most cap bytes into buf and sets *len; returns 0 or SHOAL_ERANGE
 * when buf is too small or a field exceeds its wire limit. */
int shoal_proto_enc_hello(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_hello *h, int reply);
int shoal_proto_enc_error(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, int code, const char *message);
/* PING, PONG, STATS, SHUTDOWN, SHUTDOWN_ACK: empty body. */
int shoal_proto_enc_empty(uint8_t *buf, size_t cap, size_t *len, int type, uint64_t rid);
int shoal_proto_enc_stats(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_stats *s);
int shoal_proto_enc_batch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer, int out_dtype);
int shoal_proto_enc_result(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint64_t queue_us, uint64_t compute_us);
/* PREFETCH (1.2, a notice: no reply): experts[n] of `layer`, strictly
 * ascending, n <= SHOAL_PROTO_MAX_PREFETCH (n may be 0). */
int shoal_proto_enc_prefetch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                             const uint32_t *experts, uint32_t n);
/* TRUNK_BATCH (1.3): seg[n] (0 <= n <= SHOAL_PROTO_MAX_TSEGS, lo <= hi,
 * names of at most SHOAL_PROTO_MAX_NAME bytes) and, since 1.4, chain[nchain]
 * (nchain <= SHOAL_PROTO_MAX_TCHAIN; the key is written only when nchain > 0);
 * n + nchain >= 1. The x frame follows. */
int shoal_proto_enc_tbatch(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                           const shoal_proto_trows *seg, uint32_t n, const shoal_proto_tchain *chain,
                           uint32_t nchain);
/* TRUNK_BATCH with the 1.8 relay keys (PROTOCOL.md §3.9) when r && r->xid:
 * `xid`, `wait_ms`, and `fwd` when r->nfwd > 0 (then the x frame follows;
 * without fwd, no frame follows). r NULL or xid 0: as shoal_proto_enc_tbatch.
 * SHOAL_ERANGE also for relay keys out of their bounds (shoal_proto_fwd_check). */
int shoal_proto_enc_tbatch_relay(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t layer,
                                 const shoal_proto_trows *seg, uint32_t n, const shoal_proto_tchain *chain,
                                 uint32_t nchain, const shoal_proto_relay *r);
/* TRUNK_X (1.8, a notice, rid 0): xid, wait_ms, fwd when nfwd > 0; the x
 * frame follows. */
int shoal_proto_enc_trunk_x(uint8_t *buf, size_t cap, size_t *len, const shoal_proto_relay *r);
/* A subtree is well formed: nfwd <= SHOAL_PROTO_MAX_RELAY, every peer <
 * SHOAL_PROTO_MAX_RELAY and at most once, every up <= its own position. 0 or
 * SHOAL_ERANGE. */
int shoal_proto_fwd_check(const shoal_proto_fwd *fwd, uint32_t nfwd);
/* The subtree below entry e of a well-formed fwd[n], as the receiver of that
 * entry sees it (its children get up 0), into out[] (SHOAL_PROTO_MAX_RELAY
 * entries); returns its entry count. One pass: a parent precedes its children. */
uint32_t shoal_proto_fwd_subtree(const shoal_proto_fwd *fwd, uint32_t n, uint32_t e, shoal_proto_fwd *out);
/* TRUNK_RESULT (1.3); the y frame follows. */
int shoal_proto_enc_tresult(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint64_t queue_us,
                            uint64_t compute_us);
/* PROBE (1.5): the reply's payload bytes (a multiple of 4, 4 ..
 * SHOAL_PROTO_MAX_PROBE) and whether to measure the facts; the x frame follows. */
int shoal_proto_enc_probe(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, uint32_t reply, int facts);
/* PROBE_REPLY (1.5), with the facts when f && f->has; the y frame follows. */
int shoal_proto_enc_probe_reply(uint8_t *buf, size_t cap, size_t *len, uint64_t rid, const shoal_proto_facts *f);
/* hdr[16] for a tensor frame of rows × cols elements of dtype. 0 or SHOAL_ERANGE. */
int shoal_proto_tensor_hdr(uint8_t hdr[SHOAL_PROTO_TENSOR_HDR], int dtype, uint32_t rows, uint32_t cols);
/* Byte length of such a frame (header included) into *len; SHOAL_ERANGE on overflow. */
int shoal_proto_tensor_len(int dtype, uint32_t rows, uint32_t cols, size_t *len);

/* ---- decoding ---------------------------------------------------------- */

typedef enum {
    SHOAL_SIDE_WORKER = 0,      /* decode requests: HELLO, PING, STATS, SHUTDOWN, EXPERT_BATCH, TRUNK_BATCH, PROBE;
                                   the notices PREFETCH, TRUNK_X */
    SHOAL_SIDE_COORDINATOR = 1, /* decode replies: HELLO, ERROR, PONG, STATS_REPLY, SHUTDOWN_ACK, EXPERT_RESULT, TRUNK_RESULT,
                                   PROBE_REPLY */
} shoal_proto_side;

/* Decode one message (frames[0] control, then its tensor frames). Returns 0, or
 * SHOAL_EPROTO with *perr set to the ERROR code to answer with (MALFORMED or
 * UNKNOWN_TYPE) and err naming the fault; m->rid is set as soon as the envelope
 * decoded (else 0). Structure only: dimensions against the model are checked by
 * shoal_proto_check_batch. m must be zeroed or cleared before the call. */
int shoal_proto_decode(const shoal_frame *frames, int nframes, shoal_proto_side side, shoal_proto_msg *m, int *perr,
                       char *err, size_t errlen);

/* shoal_proto_decode without allocating, for a thread that must not (the
 * coordinator's forward): the MessagePack zone lives in a scratch kept
 * between calls (one per thread; new allocates, free accepts NULL). Only a
 * HELLO (its ranges) and a control frame needing more than the zone's first
 * 2 KiB chunk still allocate. */
typedef struct shoal_proto_scratch shoal_proto_scratch;
shoal_proto_scratch *shoal_proto_scratch_new(void);
void shoal_proto_scratch_free(shoal_proto_scratch *s);
int shoal_proto_decode_with(shoal_proto_scratch *s, const shoal_frame *frames, int nframes, shoal_proto_side side,
                            shoal_proto_msg *m, int *perr, char *err, size_t errlen);

/* Read a tensor frame (header, exact length). 0 or SHOAL_EPROTO. */
int shoal_proto_tensor_decode(const shoal_frame *f, shoal_proto_tensor *t, char *err, size_t errlen);

/* What a worker accepts, for shoal_proto_check_batch. */
typedef struct {
    int num_layers;
    const uint8_t *is_moe; /* [num_layers] */
    int num_experts;
    int k; /* experts per token */
    int d; /* latent width */
    int max_tokens;
    uint32_t act_mask, out_mask;
    /* ownership predicate; NULL = owns everything */
    int (*owns)(const void *ctx, int layer, int expert);
    const void *owns_ctx;
} shoal_proto_limits;

/* Check an EXPERT_BATCH against the model, limits and ownership (PROTOCOL.md
 * §3.5, §6). Returns SHOAL_PERR_OK or the ERROR code, with err naming the field. */
int shoal_proto_check_batch(const shoal_proto_msg *m, const shoal_proto_limits *lim, char *err, size_t errlen);

/* Route pair i of a checked batch (the frame is little-endian, unaligned). */
static inline void shoal_proto_route_pair(const shoal_proto_tensor *route, uint32_t i, int32_t *t, int32_t *e)
{
    const uint8_t *p = route->data + (size_t)i * 8;
    *t = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
    *e = (int32_t)((uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24);
}

/* 64 lowercase hex digits + NUL. */
void shoal_proto_hex(const uint8_t fp[SHOAL_PROTO_FP_BYTES], char out[2 * SHOAL_PROTO_FP_BYTES + 1]);

#endif
