/* curve: CURVE keys, key files and the ZAP handler (see curve.h). */
#include "common/curve.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/log.h"

#define ZAP_EP "inproc://zeromq.zap.01"

int shoal_curve_available(void)
{
    return zmq_has("curve") != 0;
}

int shoal_curve_valid(const char *z)
{
    uint8_t b[32];
    return z && strlen(z) == 40 && zmq_z85_decode(b, z) != NULL;
}

int shoal_curve_needed(const char *ep)
{
    return strncmp(ep, "ipc://", 6) != 0 && strncmp(ep, "inproc://", 9) != 0;
}

int shoal_curve_keygen(shoal_curve_keypair *kp, char *err, size_t errlen)
{
    if (!shoal_curve_available() || zmq_curve_keypair(kp->pub, kp->sec))
        return shoal_err_set(err, errlen, SHOAL_EUNSUPPORTED, "this libzmq has no CURVE support (zmq_has(\"curve\"))");
    return 0;
}

static int write_file(const char *path, const char *text, int mode, int excl, char *err, size_t errlen)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (excl ? O_EXCL : O_TRUNC), mode);
    if (fd < 0)
        return shoal_err_set(err, errlen, errno == EEXIST ? SHOAL_EINVAL : -errno, "%s: %s%s", path,
                             strerror(errno), errno == EEXIST ? " (use --force to replace it)" : "");
    size_t n = strlen(text);
    ssize_t w = write(fd, text, n);
    int e = errno;
    if (fchmod(fd, (mode_t)mode) || close(fd) || w != (ssize_t)n)
        return shoal_err_set(err, errlen, -(w < 0 ? e : EIO), "%s: write failed", path);
    return 0;
}

int shoal_curve_write(const shoal_curve_keypair *kp, const char *prefix, int force, char *err, size_t errlen)
{
    char path[4096], text[256];
    snprintf(text, sizeof text, "# shoal CURVE key pair (shoal keygen): keep this file secret\npublic %s\nsecret %s\n",
             kp->pub, kp->sec);
    if (snprintf(path, sizeof path, "%s.key", prefix) >= (int)sizeof path)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "key prefix too long");
    int rc = write_file(path, text, 0600, !force, err, errlen);
    if (rc)
        return rc;
    snprintf(text, sizeof text, "# shoal CURVE public key (shoal keygen)\npublic %s\n", kp->pub);
    snprintf(path, sizeof path, "%s.pub", prefix);
    return write_file(path, text, 0644, 0, err, errlen);
}

/* Calls fn(key, value) for each "key value" or bare "value" line. */
static int read_lines(const char *path, int want_private, int (*fn)(void *ctx, const char *k, const char *v),
                      void *ctx, char *err, size_t errlen)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return shoal_err_set(err, errlen, -errno, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) || sb.st_size > (1 << 20)) {
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: not a key file", path);
    }
    if (want_private && (sb.st_mode & 077)) {
        close(fd);
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "%s: a secret key file must not be readable by group or others (chmod 600 %s)", path,
                             path);
    }
    char *buf = shoal_xmalloc((size_t)sb.st_size + 1);
    ssize_t r = read(fd, buf, (size_t)sb.st_size);
    close(fd);
    if (r < 0) {
        free(buf);
        return shoal_err_set(err, errlen, -errno, "%s: %s", path, strerror(errno));
    }
    buf[r] = 0;
    int rc = 0, lineno = 0;
    for (char *save = NULL, *line = strtok_r(buf, "\n", &save); line && !rc; line = strtok_r(NULL, "\n", &save)) {
        lineno++;
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t'))
            line[--n] = 0;
        while (*line == ' ' || *line == '\t')
            line++;
        if (!*line || *line == '#')
            continue;
        char *sp = strpbrk(line, " \t");
        const char *k = "", *v = line;
        if (sp) {
            *sp = 0;
            k = line;
            v = sp + 1;
            while (*v == ' ' || *v == '\t')
                v++;
        }
        if (!shoal_curve_valid(v))
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: line %d: not a 40-character Z85 CURVE key", path,
                               lineno);
        else
            rc = fn(ctx, k, v);
        if (rc > 0)
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: line %d: unexpected \"%s\"", path, lineno, k);
    }
    free(buf);
    return rc;
}

static int pair_line(void *ctx, const char *k, const char *v)
{
    shoal_curve_keypair *kp = ctx;
    if (!strcmp(k, "public"))
        snprintf(kp->pub, sizeof kp->pub, "%s", v);
    else if (!strcmp(k, "secret"))
        snprintf(kp->sec, sizeof kp->sec, "%s", v);
    else
        return 1;
    return 0;
}

int shoal_curve_read_pair(shoal_curve_keypair *kp, const char *path, char *err, size_t errlen)
{
    memset(kp, 0, sizeof *kp);
    int rc = read_lines(path, 1, pair_line, kp, err, errlen);
    if (rc)
        return rc;
    if (!kp->pub[0] || !kp->sec[0])
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: needs a \"public\" and a \"secret\" line", path);
    char derived[SHOAL_CURVE_Z85];
    if (zmq_curve_public(derived, kp->sec) || strcmp(derived, kp->pub))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: the public key does not belong to the secret key", path);
    return 0;
}

typedef struct {
    char (*keys)[SHOAL_CURVE_Z85];
    int n, cap, first_only;
} keylist;

static int pub_line(void *ctx, const char *k, const char *v)
{
    keylist *l = ctx;
    if (*k && strcmp(k, "public"))
        return 1;
    if (l->first_only && l->n)
        return 0;
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 8;
        l->keys = shoal_xrealloc(l->keys, (size_t)l->cap * sizeof *l->keys);
    }
    snprintf(l->keys[l->n++], SHOAL_CURVE_Z85, "%s", v);
    return 0;
}

int shoal_curve_read_public(char pub[SHOAL_CURVE_Z85], const char *path, char *err, size_t errlen)
{
    keylist l = {.first_only = 1};
    int rc = read_lines(path, 0, pub_line, &l, err, errlen);
    if (!rc && !l.n)
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: no public key", path);
    if (!rc)
        snprintf(pub, SHOAL_CURVE_Z85, "%s", l.keys[0]);
    free(l.keys);
    return rc;
}

int shoal_curve_read_allow(char (**keys)[SHOAL_CURVE_Z85], int *n, const char *path, char *err, size_t errlen)
{
    keylist l = {0};
    int rc = read_lines(path, 0, pub_line, &l, err, errlen);
    if (!rc && !l.n)
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: no public key", path);
    if (rc) {
        free(l.keys);
        return rc;
    }
    *keys = l.keys;
    *n = l.n;
    return 0;
}

/* ---- ZAP ------------------------------------------------------------------ */

struct shoal_curve_zap {
    void *sock;
    pthread_t th;
    char (*keys)[SHOAL_CURVE_Z85];
    int n;
    atomic_int stop;
    atomic_uint_least64_t accepted, refused;
};

static void zap_reply(void *s, const zmq_msg_t *rid, const char *code, const char *text)
{
    zmq_send(s, "1.0", 3, ZMQ_SNDMORE);
    zmq_send(s, zmq_msg_data((zmq_msg_t *)rid), zmq_msg_size((zmq_msg_t *)rid), ZMQ_SNDMORE);
    zmq_send(s, code, strlen(code), ZMQ_SNDMORE);
    zmq_send(s, text, strlen(text), ZMQ_SNDMORE);
    zmq_send(s, "", 0, ZMQ_SNDMORE); /* user id */
    zmq_send(s, "", 0, 0);           /* metadata */
}

static void *zap_main(void *arg)
{
    shoal_curve_zap *z = arg;
    while (!atomic_load(&z->stop)) {
        zmq_pollitem_t pi = {.socket = z->sock, .events = ZMQ_POLLIN};
        if (zmq_poll(&pi, 1, 100) <= 0)
            continue;
        /* version, request id, domain, address, identity, mechanism, credentials... */
        zmq_msg_t f[8];
        int nf = 0, more = 1;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, z->sock, 0) < 0) {
                zmq_msg_close(&m);
                break;
            }
            more = zmq_msg_more(&m);
            if (nf < 8)
                f[nf++] = m;
            else
                zmq_msg_close(&m);
        }
        if (nf < 2) { /* malformed; a REP socket must still answer */
            zmq_msg_t empty;
            zmq_msg_init(&empty);
            zap_reply(z->sock, &empty, "500", "malformed ZAP request");
            zmq_msg_close(&empty);
            for (int i = 0; i < nf; i++)
                zmq_msg_close(&f[i]);
            continue;
        }
        const char *why = "mechanism not CURVE";
        int ok = 0;
        char addr[64] = "?";
        if (nf >= 4)
            snprintf(addr, sizeof addr, "%.*s", (int)zmq_msg_size(&f[3]), (const char *)zmq_msg_data(&f[3]));
        char key[SHOAL_CURVE_Z85] = "";
        if (nf >= 7 && zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) &&
            zmq_msg_size(&f[6]) == 32) {
            zmq_z85_encode(key, zmq_msg_data(&f[6]), 32);
            why = "client key not allowed";
            for (int i = 0; i < z->n && !ok; i++)
                ok = !strcmp(key, z->keys[i]);
        }
        if (ok) {
            atomic_fetch_add(&z->accepted, 1);
            zap_reply(z->sock, &f[1], "200", "OK");
        } else {
            atomic_fetch_add(&z->refused, 1);
            SHOAL_WARN("refused a connection from %s: %s%s%s", addr, why, key[0] ? " " : "", key);
            zap_reply(z->sock, &f[1], "400", why);
        }
        for (int i = 0; i < nf; i++)
            zmq_msg_close(&f[i]);
    }
    return NULL;
}

int shoal_curve_zap_start(shoal_curve_zap **out, void *zctx, const char (*keys)[SHOAL_CURVE_Z85], int n, char *err,
                          size_t errlen)
{
    *out = NULL;
    shoal_curve_zap *z = shoal_xcalloc(1, sizeof *z);
    z->keys = shoal_xmalloc((size_t)(n > 0 ? n : 1) * sizeof *z->keys);
    memcpy(z->keys, keys, (size_t)n * sizeof *z->keys);
    z->n = n;
    z->sock = zmq_socket(zctx, ZMQ_REP);
    int zero = 0;
    zmq_setsockopt(z->sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(z->sock, ZAP_EP)) {
        int e = errno;
        zmq_close(z->sock);
        free(z->keys);
        free(z);
        return shoal_err_set(err, errlen, -e, "ZAP handler: bind %s: %s", ZAP_EP, zmq_strerror(e));
    }
    if (pthread_create(&z->th, NULL, zap_main, z)) {
        zmq_close(z->sock);
        free(z->keys);
        free(z);
        return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "ZAP handler: cannot start its thread");
    }
    *out = z;
    return 0;
}

void shoal_curve_zap_stop(shoal_curve_zap *z)
{
    if (!z)
        return;
    atomic_store(&z->stop, 1);
    pthread_join(z->th, NULL);
    zmq_close(z->sock);
    free(z->keys);
    free(z);
}

uint64_t shoal_curve_zap_accepted(const shoal_curve_zap *z)
{
    return z ? atomic_load(&((shoal_curve_zap *)z)->accepted) : 0;
}

uint64_t shoal_curve_zap_refused(const shoal_curve_zap *z)
{
    return z ? atomic_load(&((shoal_curve_zap *)z)->refused) : 0;
}

int shoal_curve_set_server(void *sock, const shoal_curve_keypair *kp, char *err, size_t errlen)
{
    int one = 1;
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->sec, 40) ||
        zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, "shoal", 5))
        return shoal_err_set(err, errlen, -errno, "CURVE server options: %s", zmq_strerror(errno));
    return 0;
}

int shoal_curve_set_client(void *sock, const shoal_curve_keypair *kp, const char *server_pub, char *err,
                           size_t errlen)
{
    if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_pub, 40) ||
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp->pub, 40) ||
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp->sec, 40))
        return shoal_err_set(err, errlen, -errno, "CURVE client options: %s", zmq_strerror(errno));
    return 0;
}
