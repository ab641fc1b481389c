/* planfile: reading plan.json (see planfile.h). */
#include "common/planfile.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

static int opt_str(json_t *o, const char *key, char **out, const char *path, int w, char *err, size_t errlen)
{
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (!v)
        return 0;
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) > 1024)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: workers[%d].%s must be a string of 1..1024 bytes",
                             path, w, key);
    *out = shoal_xstrdup(json_string_value(v));
    return 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int shoal_planfile_read(shoal_planfile *p, const char *path, char *err, size_t errlen)
{
    memset(p, 0, sizeof *p);
    json_error_t je;
    int orc = 0;
    FILE *jf = shoal_fopen_regular(path, &orc); /* a FIFO must not block the read */
    if (!jf)
        return orc == SHOAL_EFORMAT ? shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: not a regular file", path)
                                    : shoal_err_set(err, errlen, orc, "%s: %s", path, strerror(-orc));
    json_t *root = json_loadf(jf, JSON_REJECT_DUPLICATES, &je);
    fclose(jf);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: line %d: %s", path, je.line, je.text);
    int rc = 0;
    json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version");
    json_t *ws = json_object_get(root, "workers"), *model = json_object_get(root, "model");
    if (!json_is_object(root) || !json_is_string(fmt) || strcmp(json_string_value(fmt), "shoal-plan")) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: \"format\" must be \"shoal-plan\"", path);
        goto out;
    }
    if (!json_is_integer(ver) || json_integer_value(ver) != 1) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: \"version\" must be the integer 1", path);
        goto out;
    }
    if (!json_is_array(ws) || json_array_size(ws) == 0 || json_array_size(ws) > SHOAL_PLANFILE_MAX_WORKERS) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: \"workers\" must be an array of 1..%d workers", path,
                           SHOAL_PLANFILE_MAX_WORKERS);
        goto out;
    }
    if (model) {
        json_t *fp = json_object_get(model, "fingerprint");
        if (!json_is_object(model) || (fp && (!json_is_string(fp) || json_string_length(fp) != 64))) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                               "plan %s: \"model\" must be an object whose \"fingerprint\" has 64 hex digits", path);
            goto out;
        }
        if (fp) {
            const char *h = json_string_value(fp);
            for (int i = 0; i < 32; i++) {
                int a = hexval(h[2 * i]), b = hexval(h[2 * i + 1]);
                if (a < 0 || b < 0) {
                    rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: model.fingerprint is not hex", path);
                    goto out;
                }
                p->fingerprint[i] = (uint8_t)(a << 4 | b);
            }
            p->has_fingerprint = 1;
        }
    }
    json_t *rf = json_object_get(root, "relay_fanout");
    int greedy = json_is_string(rf) && !strcmp(json_string_value(rf), "greedy");
    if (rf && !greedy && (!json_is_integer(rf) || (json_integer_value(rf) != 0 && (json_integer_value(rf) < 2 ||
                                                                                   json_integer_value(rf) > 4)))) {
        rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: \"relay_fanout\" must be 0, 2..4 or \"greedy\"",
                           path);
        goto out;
    }
    p->relay_fanout = greedy ? SHOAL_RELAY_GREEDY : rf ? (int)json_integer_value(rf) : 0;
    json_t *rr = json_object_get(root, "relay_rates");
    if (rr || greedy) {
        json_t *a = json_object_get(rr, "nic_gbps"), *b = json_object_get(rr, "peer_gbps"),
               *h = json_object_get(rr, "hop_us");
        if (!json_is_object(rr) || !json_is_number(a) || !json_is_number(b) || !json_is_number(h) ||
            !(json_number_value(a) > 0) || !(json_number_value(b) > 0) || !(json_number_value(h) >= 0) ||
            json_number_value(a) > 1e6 || json_number_value(b) > 1e6 || json_number_value(h) > 1e7) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: \"relay_rates\" must be an object of numbers "
                               "nic_gbps > 0, peer_gbps > 0, hop_us >= 0%s", path,
                               greedy ? " (required with relay_fanout \"greedy\")" : "");
            goto out;
        }
        p->relay_nic_gbps = json_number_value(a);
        p->relay_peer_gbps = json_number_value(b);
        p->relay_hop_us = json_number_value(h);
    }
    p->nworkers = (int)json_array_size(ws);
    p->workers = shoal_xcalloc((size_t)p->nworkers, sizeof *p->workers);
    for (int w = 0; w < p->nworkers; w++) {
        json_t *wo = json_array_get(ws, (size_t)w);
        json_t *name = json_object_get(wo, "name"), *ex = json_object_get(wo, "experts");
        if (!json_is_object(wo) || !json_is_string(name) || !json_is_string(ex)) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT,
                               "plan %s: workers[%d] must be an object with string \"name\" and \"experts\"", path, w);
            goto out;
        }
        const char *nm = json_string_value(name);
        if (!*nm || strlen(nm) > SHOAL_PLANFILE_MAX_NAME) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: workers[%d].name must have 1..%d bytes", path, w,
                               SHOAL_PLANFILE_MAX_NAME);
            goto out;
        }
        if (shoal_planfile_find(p, nm)) {
            rc = shoal_err_set(err, errlen, SHOAL_EFORMAT, "plan %s: worker name \"%s\" appears twice", path, nm);
            goto out;
        }
        shoal_planfile_worker *pw = &p->workers[w];
        pw->name = shoal_xstrdup(nm);
        pw->experts = shoal_xstrdup(json_string_value(ex));
        if ((rc = opt_str(wo, "endpoint", &pw->endpoint, path, w, err, errlen)) ||
            (rc = opt_str(wo, "listen", &pw->listen, path, w, err, errlen)) ||
            (rc = opt_str(wo, "host", &pw->host, path, w, err, errlen)) ||
            (rc = opt_str(wo, "trunk", &pw->trunk, path, w, err, errlen)))
            goto out;
    }
out:
    json_decref(root);
    if (rc)
        shoal_planfile_free(p);
    return rc;
}

void shoal_planfile_free(shoal_planfile *p)
{
    if (!p)
        return;
    for (int w = 0; w < p->nworkers && p->workers; w++) {
        free(p->workers[w].name);
        free(p->workers[w].experts);
        free(p->workers[w].endpoint);
        free(p->workers[w].listen);
        free(p->workers[w].host);
        free(p->workers[w].trunk);
    }
    free(p->workers);
    memset(p, 0, sizeof *p);
}

const shoal_planfile_worker *shoal_planfile_find(const shoal_planfile *p, const char *name)
{
    for (int w = 0; w < p->nworkers; w++)
        if (p->workers && p->workers[w].name && !strcmp(p->workers[w].name, name))
            return &p->workers[w];
    return NULL;
}
