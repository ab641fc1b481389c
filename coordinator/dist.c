/* Distributed-experts wiring for the coordinator's commands (see dist.h). */
#include "coordinator/dist.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/planfile.h"
#include "coordinator/spawn.h"
#include "proto/fprint.h"

#define MAX_PHASES 4

typedef struct {
    char name[16];
    int tokens;
    shoal_expert_client_stats st;
} phase;

struct shoal_dist {
    shoal_spawn *spawn;
    shoal_expert_client *client; /* owned by the model once set */
    int nworkers;
    phase ph[MAX_PHASES];
    int nph;
};

static int num(const char *cmd, const char *opt, const char *v, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "%s: bad value for %s: '%s' (%ld to %ld)\n", cmd, opt, v ? v : "", lo, hi);
        return -1;
    }
    *out = (int)x;
    return 1;
}

int shoal_dist_parse_arg(shoal_dist_opts *o, const char *cmd, int argc, char **argv, int *i)
{
    const char *a = argv[*i];
    const char *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    int r;
    if (!strcmp(a, "--worker")) {
        if (!v) {
            fprintf(stderr, "%s: --worker needs an endpoint\n", cmd);
            return -1;
        }
        if (o->nworker == SHOAL_EXPERT_CLIENT_MAX_WORKERS) {
            fprintf(stderr, "%s: at most %d --worker\n", cmd, SHOAL_EXPERT_CLIENT_MAX_WORKERS);
            return -1;
        }
        o->worker[o->nworker++] = v;
        r = 1;
    } else if (!strcmp(a, "--plan")) {
        if (!v) {
            fprintf(stderr, "%s: --plan needs a plan.json\n", cmd);
            return -1;
        }
        o->plan = v;
        r = 1;
    } else if (!strcmp(a, "--workers")) {
        r = num(cmd, a, v, 1, SHOAL_EXPERT_CLIENT_MAX_WORKERS, &o->nlocal);
    } else if (!strcmp(a, "--worker-threads")) {
        r = num(cmd, a, v, 1, 4096, &o->worker_threads);
    } else if (!strcmp(a, "--expert-timeout-ms")) {
        r = num(cmd, a, v, 1, 86400000, &o->timeout_ms);
    } else if (!strcmp(a, "--hello-timeout-ms")) {
        r = num(cmd, a, v, 1, 86400000, &o->hello_timeout_ms);
    } else {
        return 0;
    }
    if (r == 1)
        (*i)++;
    return r;
}

void shoal_dist_usage(FILE *f)
{
    fprintf(f, "distributed experts (proto/PROTOCOL.md):\n"
               "  --worker ENDPOINT    an expert server (`shoal expert`), e.g. tcp://10.0.0.2:5555;\n"
               "                       repeat for each; together they must own every expert once\n"
               "  --plan FILE          connect to every worker of a placement plan (`shoal plan`,\n"
               "                       docs/CLUSTER.md) at its endpoint\n"
               "  --workers N          start N local expert servers over ipc:// (experts split evenly),\n"
               "                       stopped on exit\n"
               "  --worker-threads N   OpenMP threads of each local server (default: cores / N)\n"
               "  --expert-timeout-ms T  deadline for a layer's expert replies (default 30000)\n"
               "  --hello-timeout-ms T   deadline for the workers' HELLO at start (default 60000)\n");
}

int shoal_dist_enabled(const shoal_dist_opts *o)
{
    if ((o->nworker != 0) + (o->nlocal != 0) + (o->plan != NULL) > 1)
        return -1;
    return o->nworker || o->nlocal || o->plan;
}

/* The workers of plan.json: each must have an endpoint; a plan made for another
 * model is refused before any connection. */
static int plan_endpoints(const char *path, const uint8_t *fp, shoal_planfile *pf, const char **pe, char *err,
                          size_t errlen)
{
    int rc = shoal_planfile_read(pf, path, err, errlen);
    if (rc)
        return rc;
    if (pf->has_fingerprint && memcmp(pf->fingerprint, fp, SHOAL_PROTO_FP_BYTES)) {
        char a[65], b[65];
        shoal_proto_hex(pf->fingerprint, a);
        shoal_proto_hex(fp, b);
        shoal_planfile_free(pf);
        return shoal_err_set(err, errlen, SHOAL_EFINGERPRINT, "plan %s was made for model %.16s..., this one is %.16s...",
                             path, a, b);
    }
    if (pf->nworkers > SHOAL_EXPERT_CLIENT_MAX_WORKERS) {
        rc = shoal_err_set(err, errlen, SHOAL_ERANGE, "plan %s: %d workers, at most %d", path, pf->nworkers,
                           SHOAL_EXPERT_CLIENT_MAX_WORKERS);
        shoal_planfile_free(pf);
        return rc;
    }
    for (int w = 0; w < pf->nworkers; w++) {
        if (!pf->workers[w].endpoint) {
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "plan %s: worker \"%s\" has no \"endpoint\"", path,
                               pf->workers[w].name);
            shoal_planfile_free(pf);
            return rc;
        }
        pe[w] = pf->workers[w].endpoint;
    }
    return 0;
}

int shoal_dist_start(shoal_dist **out, const shoal_dist_opts *o, const char *model_dir, shoal_model *m, char *err,
                     size_t errlen)
{
    *out = NULL;
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    int rc = shoal_fprint_model(fp, info.cfg, shoal_model_store(m), err, errlen);
    if (rc)
        return rc;
    shoal_planfile pf = {0};
    const char *pe[SHOAL_EXPERT_CLIENT_MAX_WORKERS];
    if (o->plan && (rc = plan_endpoints(o->plan, fp, &pf, pe, err, errlen)))
        return rc;
    shoal_dist *d = shoal_xcalloc(1, sizeof *d);
    const char *const *eps = o->plan ? pe : o->worker;
    int n = o->plan ? pf.nworkers : o->nworker;
    if (o->nlocal) {
        shoal_spawn_opts so = {.model = model_dir, .n = o->nlocal, .threads = o->worker_threads,
                               .max_tokens = info.max_batch};
        if ((rc = shoal_spawn_start(&d->spawn, &so, info.cfg, err, errlen))) {
            free(d);
            return rc;
        }
        eps = shoal_spawn_endpoints(d->spawn);
        n = o->nlocal;
    }
    shoal_expert_client_opts co = {.endpoints = eps, .nworkers = n, .cfg = info.cfg, .fingerprint = fp,
                                   .max_tokens = info.max_batch, .timeout_ms = o->timeout_ms,
                                   .hello_timeout_ms = o->hello_timeout_ms,
                                   .check = d->spawn ? shoal_spawn_check : NULL, .check_ctx = d->spawn};
    rc = shoal_expert_client_open(&d->client, &co, err, errlen);
    shoal_planfile_free(&pf); /* the client copied the endpoints */
    if (rc) {
        shoal_dist_stop(d);
        return rc;
    }
    shoal_experts b = shoal_expert_client_backend(d->client);
    if ((rc = shoal_model_set_experts(m, &b, err, errlen))) {
        shoal_expert_client_close(d->client);
        shoal_dist_stop(d);
        return rc;
    }
    d->nworkers = n;
    char hex[65];
    shoal_proto_hex(fp, hex);
    SHOAL_INFO("routed experts on %d worker%s (model fingerprint %.16s...)", n, n == 1 ? "" : "s", hex);
    *out = d;
    return 0;
}

void shoal_dist_stop(shoal_dist *d)
{
    if (!d)
        return;
    shoal_spawn_stop(d->spawn);
    free(d);
}

int shoal_dist_nworkers(const shoal_dist *d)
{
    return d ? d->nworkers : 0;
}

const char *shoal_dist_worker_name(const shoal_dist *d, int i)
{
    if (!d || i < 0 || i >= d->nworkers)
        return NULL;
    return shoal_expert_client_worker_name(d->client, i);
}

int shoal_dist_set_metrics(shoal_dist *d, shoal_cmetrics *cm, char *err, size_t errlen)
{
    return d ? shoal_expert_client_set_metrics(d->client, cm, err, errlen) : 0;
}

void shoal_dist_mark(shoal_dist *d, const char *name, int tokens)
{
    if (!d || d->nph == MAX_PHASES)
        return;
    phase *p = &d->ph[d->nph++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->tokens = tokens;
    shoal_expert_client_get_stats(d->client, &p->st);
    shoal_expert_client_reset_stats(d->client);
}

void shoal_dist_json(const shoal_dist *d, json_t *o)
{
    if (!d)
        return;
    json_object_set_new(o, "workers", json_integer(d->nworkers));
    for (int i = 0; i < d->nph; i++) {
        const phase *p = &d->ph[i];
        double t = p->tokens > 0 ? p->tokens : 1;
        char key[64];
        snprintf(key, sizeof key, "%s_wire_bytes_per_token", p->name);
        json_object_set_new(o, key, json_real((double)(p->st.bytes_out + p->st.bytes_in) / t));
        snprintf(key, sizeof key, "%s_wire_bytes_out_per_token", p->name);
        json_object_set_new(o, key, json_real((double)p->st.bytes_out / t));
        snprintf(key, sizeof key, "%s_wire_messages_per_token", p->name);
        json_object_set_new(o, key, json_real((double)p->st.messages / t));
        snprintf(key, sizeof key, "%s_expert_wait_s", p->name);
        json_object_set_new(o, key, json_real(p->st.wait_s));
        snprintf(key, sizeof key, "%s_worker_compute_s", p->name);
        json_object_set_new(o, key, json_real((double)p->st.worker_compute_us * 1e-6));
    }
}

void shoal_dist_print(const shoal_dist *d, FILE *f)
{
    if (!d)
        return;
    fprintf(f, "expert workers: %d\n", d->nworkers);
    for (int i = 0; i < d->nph; i++) {
        const phase *p = &d->ph[i];
        double t = p->tokens > 0 ? p->tokens : 1;
        fprintf(f, "%s wire: %.0f B/token (%.0f out, %.0f in), %.1f messages/token, waited %.3f s for experts "
                   "(workers computed %.3f s)\n",
                p->name, (double)(p->st.bytes_out + p->st.bytes_in) / t, (double)p->st.bytes_out / t,
                (double)p->st.bytes_in / t, (double)p->st.messages / t, p->st.wait_s,
                (double)p->st.worker_compute_us * 1e-6);
    }
}
