/* curve: ZeroMQ CURVE keys and authentication for every non-ipc link between
 * coordinator and workers (proto/PROTOCOL.md section 9, docs/DEPLOY.md "Keys").
 * Key files (written by `shoal keygen`): a key pair file holds the lines
 * "public <Z85>" and "secret <Z85>" and must not be readable by group or
 * others; a public key file holds "public <Z85>" (or the bare Z85 key); an
 * allow file lists public keys, one per line ('#' comments). Z85 keys are 40
 * characters (32 bytes).
 *
 * The ZAP handler (RFC 27) answers the authentication requests of one ZeroMQ
 * context from a thread of its own: CURVE clients whose public key is listed
 * are accepted, everything else (another key, another mechanism) refused and
 * counted. Callers: the worker's server (server side), the expert client
 * (client side: keys set on each DEALER), `shoal keygen`, tests.
 * In common/ because both processes use it. */
#ifndef SHOAL_CURVE_H
#define SHOAL_CURVE_H

#include <stddef.h>
#include <stdint.h>

#define SHOAL_CURVE_Z85 41 /* 40 characters + NUL */

typedef struct {
    char pub[SHOAL_CURVE_Z85];
    char sec[SHOAL_CURVE_Z85];
} shoal_curve_keypair;

/* 1 when this libzmq supports CURVE (zmq_has("curve")). */
int shoal_curve_available(void);
/* A new key pair (zmq_curve_keypair). 0 or SHOAL_EUNSUPPORTED. */
int shoal_curve_keygen(shoal_curve_keypair *kp, char *err, size_t errlen);
/* Write PREFIX.key (pair, mode 0600) and PREFIX.pub. Refuses to overwrite an
 * existing PREFIX.key (SHOAL_EINVAL) unless force. */
int shoal_curve_write(const shoal_curve_keypair *kp, const char *prefix, int force, char *err, size_t errlen);
/* Read a key pair file; refused if group/other may read it, or malformed. */
int shoal_curve_read_pair(shoal_curve_keypair *kp, const char *path, char *err, size_t errlen);
/* Read a public key file (first key). */
int shoal_curve_read_public(char pub[SHOAL_CURVE_Z85], const char *path, char *err, size_t errlen);
/* Read every public key of an allow file (at least one); *keys allocated. */
int shoal_curve_read_allow(char (**keys)[SHOAL_CURVE_Z85], int *n, const char *path, char *err, size_t errlen);
/* 1 for a well-formed Z85 key of 40 characters that decodes to 32 bytes. */
int shoal_curve_valid(const char *z85);

/* 1 when an endpoint needs CURVE (anything but ipc:// and inproc://). */
int shoal_curve_needed(const char *endpoint);

typedef struct shoal_curve_zap shoal_curve_zap;
/* Bind the ZAP handler in zctx (before any CURVE server socket binds) and
 * start its thread. keys: the allowed client public keys (copied). */
int shoal_curve_zap_start(shoal_curve_zap **out, void *zctx, const char (*keys)[SHOAL_CURVE_Z85], int n, char *err,
                          size_t errlen);
/* Stop and join (before zmq_ctx_term). Accepts NULL. */
void shoal_curve_zap_stop(shoal_curve_zap *z);
uint64_t shoal_curve_zap_accepted(const shoal_curve_zap *z);
uint64_t shoal_curve_zap_refused(const shoal_curve_zap *z);

/* Make sock a CURVE server with this key pair (ZAP domain "shoal"). */
int shoal_curve_set_server(void *sock, const shoal_curve_keypair *kp, char *err, size_t errlen);
/* Make sock a CURVE client of the server key, with our key pair. */
int shoal_curve_set_client(void *sock, const shoal_curve_keypair *kp, const char *server_pub, char *err,
                           size_t errlen);

#endif
