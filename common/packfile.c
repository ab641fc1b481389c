/* packfile: pack manifests (see packfile.h). */
#include "common/packfile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"

void shoal_packfile_hex(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

static int hv(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

int shoal_packfile_unhex(const char *s, uint8_t *out, size_t n)
{
    if (strlen(s) != 2 * n)
        return SHOAL_EFORMAT;
    for (size_t i = 0; i < n; i++) {
        int a = hv(s[2 * i]), b = hv(s[2 * i + 1]);
        if (a < 0 || b < 0)
            return SHOAL_EFORMAT;
        out[i] = (uint8_t)(a << 4 | b);
    }
    return 0;
}

int shoal_packfile_is_pack(const char *dir)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, SHOAL_PACKFILE_NAME);
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static int plain_name(const char *s)
{
    return *s && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..") && strlen(s) < 256;
}

int shoal_packfile_read(shoal_packfile *p, const char *dir, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, SHOAL_PACKFILE_NAME);
    json_error_t je;
    int orc = 0;
    FILE *jf = shoal_fopen_regular(path, &orc); /* a FIFO must not block the read */
    if (!jf)
        return orc == SHOAL_EFORMAT ? shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: not a regular file", path)
                                    : shoal_err_set(err, errlen, orc, "%s: %s", path, strerror(-orc));
    json_t *root = json_loadf(jf, JSON_REJECT_DUPLICATES, &je);
    fclose(jf);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "pack manifest %s: line %d: %s", path, je.line, je.text);
    int rc = 0;
    json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version");
    json_t *w = json_object_get(root, "worker"), *ex = json_object_get(root, "experts");
    json_t *fp = json_object_get(root, "model_fingerprint"), *files = json_object_get(root, "files");
    if (!json_is_object(root) || !json_is_string(fmt) || strcmp(json_string_value(fmt), "shoal-pack") ||
        !json_is_integer(ver) || json_integer_value(ver) != 1) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "pack manifest %s: \"format\" must be \"shoal-pack\", "
                                                       "\"version\" 1", path);
        goto out;
    }
    if (!json_is_string(w) || !json_is_string(ex) || !json_is_string(fp) ||
        shoal_packfile_unhex(json_string_value(fp), p->fingerprint, 32)) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                           "pack manifest %s: needs strings \"worker\", \"experts\" and a 64-hex-digit "
                           "\"model_fingerprint\"", path);
        goto out;
    }
    if (!json_is_array(files) || json_array_size(files) == 0 || json_array_size(files) > 100000) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "pack manifest %s: \"files\" must be a non-empty array", path);
        goto out;
    }
    p->worker = shoal_xstrdup(json_string_value(w));
    p->experts = shoal_xstrdup(json_string_value(ex));
    p->nfiles = (int)json_array_size(files);
    p->files = shoal_xcalloc((size_t)p->nfiles, sizeof *p->files);
    for (int i = 0; i < p->nfiles; i++) {
        json_t *f = json_array_get(files, (size_t)i);
        json_t *n = json_object_get(f, "name"), *b = json_object_get(f, "bytes"), *h = json_object_get(f, "blake2b");
        if (!json_is_object(f) || !json_is_string(n) || !plain_name(json_string_value(n)) || !json_is_integer(b) ||
            json_integer_value(b) < 0 || !json_is_string(h) ||
            shoal_packfile_unhex(json_string_value(h), p->files[i].blake2b, SHOAL_PACKFILE_HASH)) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                               "pack manifest %s: files[%d] needs a plain \"name\", integer \"bytes\" and a "
                               "64-hex-digit \"blake2b\"", path, i);
            goto out;
        }
        p->files[i].name = shoal_xstrdup(json_string_value(n));
        p->files[i].bytes = (uint64_t)json_integer_value(b);
    }
    json_t *tr = json_object_get(root, "trunk"), *rows = json_object_get(root, "trunk_rows");
    if (!tr && !rows)
        goto out;
    if (!json_is_string(tr) || !json_is_array(rows) || json_array_size(rows) == 0 ||
        json_array_size(rows) > 65536) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                           "pack manifest %s: \"trunk\" (a string) and \"trunk_rows\" (a non-empty array of at "
                           "most 65536) come together", path);
        goto out;
    }
    p->trunk = shoal_xstrdup(json_string_value(tr));
    p->ntrows = (int)json_array_size(rows);
    p->trows = shoal_xcalloc((size_t)p->ntrows, sizeof *p->trows);
    for (int i = 0; i < p->ntrows; i++) {
        json_t *o = json_array_get(rows, (size_t)i);
        json_t *n = json_object_get(o, "name"), *t = json_object_get(o, "tensor"), *lo = json_object_get(o, "lo");
        json_t *hi = json_object_get(o, "hi"), *dt = json_object_get(o, "dtype"), *sh = json_object_get(o, "shape");
        json_t *nb = json_object_get(o, "nbytes");
        int ok = json_is_object(o) && json_is_string(n) && json_is_string(t) && json_is_integer(lo) &&
                 json_is_integer(hi) && json_is_string(dt) && json_is_array(sh) && json_array_size(sh) == 2 &&
                 json_is_integer(json_array_get(sh, 0)) && json_is_integer(json_array_get(sh, 1)) &&
                 json_is_integer(nb) && strlen(json_string_value(n)) <= 128 && strlen(json_string_value(t)) <= 256;
        int esz = 0;
        if (ok) {
            const char *d = json_string_value(dt);
            esz = !strcmp(d, "BF16") ? 2 : !strcmp(d, "F32") ? 4 : 0;
        }
        json_int_t r = ok ? json_integer_value(json_array_get(sh, 0)) : 0;
        json_int_t c = ok ? json_integer_value(json_array_get(sh, 1)) : 0;
        json_int_t l = ok ? json_integer_value(lo) : 0, h = ok ? json_integer_value(hi) : 0;
        if (!ok || !esz || r < 1 || c < 1 || r > (1 << 24) || c > (1 << 24) || l < 0 || h < l || h >= r ||
            (uint64_t)json_integer_value(nb) != (uint64_t)r * (uint64_t)c * (uint64_t)esz) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                               "pack manifest %s: trunk_rows[%d] needs string \"name\" and \"tensor\", "
                               "0 <= \"lo\" <= \"hi\" < shape[0], \"dtype\" BF16 or F32, \"shape\" [R, C] "
                               "and \"nbytes\" = R * C * size", path, i);
            goto out;
        }
        shoal_packfile_trows *x = &p->trows[i];
        x->name = shoal_xstrdup(json_string_value(n));
        x->tensor = shoal_xstrdup(json_string_value(t));
        x->lo = (uint32_t)l;
        x->hi = (uint32_t)h;
        snprintf(x->dtype, sizeof x->dtype, "%s", json_string_value(dt));
        x->shape[0] = (uint64_t)r;
        x->shape[1] = (uint64_t)c;
        x->nbytes = (uint64_t)json_integer_value(nb);
    }
out:
    json_decref(root);
    if (rc)
        shoal_packfile_free(p);
    return rc;
}

void shoal_packfile_free(shoal_packfile *p)
{
    if (!p)
        return;
    for (int i = 0; i < p->nfiles && p->files; i++)
        free(p->files[i].name);
    free(p->files);
    for (int i = 0; i < p->ntrows && p->trows; i++) {
        free(p->trows[i].name);
        free(p->trows[i].tensor);
    }
    free(p->trows);
    free(p->trunk);
    free(p->worker);
    free(p->experts);
    memset(p, 0, sizeof *p);
}

int shoal_packfile_hash(const char *path, uint8_t out[SHOAL_PACKFILE_HASH], uint64_t *bytes, char *err,
                        size_t errlen)
{
    int fd = shoal_open_regular(path, O_RDONLY); /* a FIFO must not block the check */
    if (fd < 0)
        return shoal_err_set(err, errlen, fd, "%s: %s", path,
                             fd == SHOAL_EFORMAT ? "not a regular file" : strerror(-fd));
    crypto_generichash_state st;
    crypto_generichash_init(&st, NULL, 0, SHOAL_PACKFILE_HASH);
    size_t cap = 4u << 20;
    unsigned char *buf = shoal_xmalloc(cap);
    uint64_t total = 0;
    int rc = 0;
    for (;;) {
        ssize_t r = read(fd, buf, cap);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = shoal_err_set(err, errlen, -errno, "%s: read: %s", path, strerror(errno));
            break;
        }
        if (r == 0)
            break;
        crypto_generichash_update(&st, buf, (unsigned long long)r);
        total += (uint64_t)r;
    }
    free(buf);
    close(fd);
    if (!rc) {
        crypto_generichash_final(&st, out, SHOAL_PACKFILE_HASH);
        if (bytes)
            *bytes = total;
    }
    return rc;
}

int shoal_packfile_check(const shoal_packfile *p, const char *dir, int verify, char *err, size_t errlen)
{
    for (int i = 0; i < p->nfiles; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, p->files[i].name);
        struct stat sb;
        if (stat(path, &sb))
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "pack %s: %s: %s", dir, p->files[i].name,
                                 strerror(errno));
        if ((uint64_t)sb.st_size != p->files[i].bytes)
            return shoal_err_set(err, errlen, SHOAL_EMODEL, "pack %s: %s has %llu bytes, the manifest says %llu", dir,
                                 p->files[i].name, (unsigned long long)sb.st_size,
                                 (unsigned long long)p->files[i].bytes);
        if (!verify)
            continue;
        uint8_t h[SHOAL_PACKFILE_HASH];
        int rc = shoal_packfile_hash(path, h, NULL, err, errlen);
        if (rc)
            return rc;
        if (memcmp(h, p->files[i].blake2b, sizeof h)) {
            char a[65], b[65];
            shoal_packfile_hex(p->files[i].blake2b, 32, a);
            shoal_packfile_hex(h, 32, b);
            return shoal_err_set(err, errlen, SHOAL_EMODEL,
                                 "pack %s: %s: checksum mismatch (manifest BLAKE2b %.16s..., file %.16s...)", dir,
                                 p->files[i].name, a, b);
        }
    }
    return 0;
}
