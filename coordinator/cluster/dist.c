/* Distributed-experts wiring for the coordinator's commands (see dist.h). */
#include "coordinator/cluster/dist.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "common/curve.h"
#include "common/err.h"
#include "common/log.h"
#include "common/packfile.h"
#include "common/planfile.h"
#include "common/utf8.h"
#include "coordinator/cluster/spawn.h"
#include "coordinator/cluster/trunk_client.h"
#include "coordinator/obs/obs.h"
#include "proto/fprint.h"

#define MAX_PHASES 4

typedef struct {
    char name[16];
    int tokens;
    shoal_expert_client_stats st;
    shoal_expert_client_stats tst; /* the trunk client's (--trunk remote), else zero */
} phase;

struct shoal_dist {
    shoal_spawn *spawn;
    shoal_expert_client *client; /* owned by the model once set */
    shoal_expert_client *trunk;  /* trunk role (trunk_client.h), or NULL; owned by the model once set */
    int trunk_remote;            /* matrices computed remotely */
    const atomic_int *cancel;    /* shoal_dist_opts.cancel */
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
    } else if (!strcmp(a, "--curve-secret") || !strcmp(a, "--curve-keys") || !strcmp(a, "--worker-key")) {
        if (!v) {
            fprintf(stderr, "%s: %s needs a file\n", cmd, a);
            return -1;
        }
        if (a[2] == 'w') {
            if (o->nworker_key == SHOAL_EXPERT_CLIENT_MAX_WORKERS) {
                fprintf(stderr, "%s: at most %d --worker-key\n", cmd, SHOAL_EXPERT_CLIENT_MAX_WORKERS);
                return -1;
            }
            o->worker_key[o->nworker_key++] = v;
        } else if (!strcmp(a, "--curve-keys")) {
            o->curve_keys = v;
        } else {
            o->curve_secret = v;
        }
        r = 1;
    } else if (!strcmp(a, "--insecure-workers")) { /* not --insecure: serve's own flag (HTTP) */
        o->insecure = 1;
        return 1;
    } else if (!strcmp(a, "--prefetch")) {
        if (!v || (strcmp(v, "on") && strcmp(v, "off"))) {
            fprintf(stderr, "%s: --prefetch takes on or off, not '%s'\n", cmd, v ? v : "");
            return -1;
        }
        o->prefetch = strcmp(v, "on") ? -1 : 1;
        r = 1;
    } else if (!strcmp(a, "--trunk")) {
        if (!v || (strcmp(v, "local") && strcmp(v, "remote") && strcmp(v, "auto"))) {
            fprintf(stderr, "%s: --trunk takes local, remote or auto, not '%s'\n", cmd, v ? v : "");
            return -1;
        }
        o->trunk = !strcmp(v, "local") ? 0 : !strcmp(v, "remote") ? 1 : 2;
        r = 1;
    } else if (!strcmp(a, "--wire-act")) {
        if (!v || (strcmp(v, "auto") && strcmp(v, "f32"))) {
            fprintf(stderr, "%s: --wire-act takes auto or f32, not '%s'\n", cmd, v ? v : "");
            return -1;
        }
        o->wire_f32 = !strcmp(v, "f32");
        r = 1;
    } else if (!strcmp(a, "--relay-fanout")) {
        if (v && !strcmp(v, "greedy")) {
            o->relay_fanout = SHOAL_RELAY_GREEDY;
            r = 1;
        } else {
            r = num(cmd, a, v, 0, 4, &o->relay_fanout);
        }
        o->relay_given = 1;
        if (r == 1 && o->relay_fanout == 1) {
            fprintf(stderr, "%s: --relay-fanout takes 0 (off) or 2 to 4, not 1 (a chain relays nothing)\n", cmd);
            return -1;
        }
    } else if (!strcmp(a, "--relay-rates")) {
        char *e1 = NULL, *e2 = NULL, *e3 = NULL;
        errno = 0;
        double n = v ? strtod(v, &e1) : 0, p = e1 && *e1 == ',' ? strtod(e1 + 1, &e2) : 0,
               h = e2 && *e2 == ',' ? strtod(e2 + 1, &e3) : -1;
        if (!v || errno || !e3 || *e3 || !(n > 0 && n <= 1e6) || !(p > 0 && p <= 1e6) || !(h >= 0 && h <= 1e7)) {
            fprintf(stderr, "%s: --relay-rates takes NIC_GBPS,PEER_GBPS,HOP_US (rates > 0, hop >= 0), not '%s'\n",
                    cmd, v ? v : "");
            return -1;
        }
        o->relay_nic_gbps = n;
        o->relay_peer_gbps = p;
        o->relay_hop_us = h;
        r = 1;
    } else if (!strcmp(a, "--workers")) {
        r = num(cmd, a, v, 1, SHOAL_EXPERT_CLIENT_MAX_WORKERS, &o->nlocal);
    } else if (!strcmp(a, "--worker-threads")) {
        r = num(cmd, a, v, 1, 4096, &o->worker_threads);
    } else if (!strcmp(a, "--expert-timeout-ms")) {
        r = num(cmd, a, v, 1, 86400000, &o->timeout_ms);
    } else if (!strcmp(a, "--failover-ms")) {
        r = num(cmd, a, v, 1, 86400000, &o->failover_ms);
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
               "                       repeat for each; together they must own every expert at least\n"
               "                       once (an expert owned twice is a replica)\n"
               "  --plan FILE          connect to every worker of a placement plan (`shoal plan`,\n"
               "                       docs/CLUSTER.md) at its endpoint\n"
               "  --curve-secret FILE  our CURVE key pair (`shoal keygen`): tcp:// links are encrypted\n"
               "                       and authenticated (PROTOCOL.md section 9, docs/DEPLOY.md)\n"
               "  --worker-key FILE    the public key pinned for each --worker, in the same order\n"
               "  --curve-keys DIR     with --plan: DIR/NAME.pub is worker NAME's pinned public key\n"
               "  --insecure-workers   allow plain TCP to workers (without it a tcp:// worker needs CURVE)\n"
               "  --trunk MODE         local (default): the whole trunk here; remote: the trunk matrices\n"
               "                       the workers announce (shoal expert --trunk) run on them, every row\n"
               "                       owned at least once (else refused, naming the gaps); auto: remote\n"
               "                       when some worker announces trunk rows; with --workers N, remote\n"
               "                       gives each local worker its 1/N of every trunk matrix's rows\n"
               "  --wire-act MODE      auto (default): activations travel as bf16 to the workers that\n"
               "                       compute the same bits from them (--numerics mu, whose products\n"
               "                       round their inputs to bf16: half the bytes, the same ids); f32:\n"
               "                       always f32 (PROTOCOL.md 1.7)\n"
               "  --relay-fanout F     with --trunk remote: 0 (default) sends each trunk step's input to\n"
               "                       every trunk server; 2..4 sends it to F of them, which forward it\n"
               "                       through a tree of fan-out F to the others (shoal expert\n"
               "                       --relay-peers; PROTOCOL.md 3.9): less egress here, more hops;\n"
               "                       greedy: per step the latency-aware schedule for --relay-rates\n"
               "                       (every holder of x keeps sending, each server served earliest)\n"
               "  --relay-rates N,P,H  with --relay-fanout greedy: the coordinator's send rate N and the\n"
               "                       workers' rate to each other P in Gbit/s, a relay hop's latency H\n"
               "                       in microseconds (shoal doctor; default: the plan's relay_rates)\n"
               "  --workers N          start N local expert servers over ipc:// (experts split evenly),\n"
               "                       stopped on exit\n"
               "  --worker-threads N   OpenMP threads of each local server (default: cores / N)\n"
               "  --expert-timeout-ms T  deadline for a layer's expert replies (default 30000)\n"
               "  --failover-ms T      replicated experts: a worker silent this long in an exchange is\n"
               "                       given up and its part resent to the other owners, within the\n"
               "                       same deadline (default min(1000, expert-timeout-ms / 3))\n"
               "  --hello-timeout-ms T   deadline for the workers' HELLO at start (default 60000)\n"
               "  --prefetch on|off    hint each next MoE layer's likely experts to the workers, so\n"
               "                       those reading experts from disk (--cache-gb) start early\n"
               "                       (default %s; results are identical either way)\n",
            SHOAL_DIST_PREFETCH_DEFAULT ? "on" : "off");
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

/* An endpoint the client can connect to: tcp://HOST:PORT (PORT 1..65535) or
 * ipc://PATH, refused naming it before anything else (a wrong scheme would
 * otherwise surface as a CURVE or connection error). */
static int check_endpoint(const char *ep, char *err, size_t errlen)
{
    if (!strncmp(ep, "ipc://", 6) && ep[6])
        return 0;
    if (!strncmp(ep, "tcp://", 6)) {
        const char *colon = strrchr(ep + 6, ':');
        char *end = NULL;
        long port = colon ? strtol(colon + 1, &end, 10) : 0;
        if (colon && colon > ep + 6 && end && !*end && colon[1] && port >= 1 && port <= 65535)
            return 0;
        char e2[201]; /* the flag's text: cut on a character, cleaned */
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "expert worker %s: expected tcp://HOST:PORT (port 1..65535)",
                             shoal_utf8_clip(e2, sizeof e2, ep, SHOAL_UTF8_NOCTRL));
    }
    const char *sep = strstr(ep, "://");
    char e2[201], sch[33];
    shoal_utf8_clean(sch, sizeof sch, ep, sep ? (size_t)(sep - ep) : 0, SHOAL_UTF8_NOCTRL, NULL);
    return shoal_err_set(err, errlen, SHOAL_EINVAL,
                         "expert worker %s: unknown endpoint scheme '%s' (tcp://HOST:PORT or ipc:///PATH)",
                         shoal_utf8_clip(e2, sizeof e2, ep, SHOAL_UTF8_NOCTRL), sch);
}

/* Per worker, the pinned CURVE public key (NULL for ipc:// or --insecure);
 * refuses a tcp:// worker without one unless --insecure. */
static int curve_keys(const shoal_dist_opts *o, const char *const *eps, int n, const shoal_planfile *pf,
                      shoal_curve_keypair *kp, char (*keys)[SHOAL_CURVE_Z85], const char **pk, int *any, char *err,
                      size_t errlen)
{
    int rc;
    *any = 0;
    for (int i = 0; i < n; i++)
        if ((rc = check_endpoint(eps[i], err, errlen)))
            return rc;
    if (o->curve_secret && o->insecure)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--insecure-workers and --curve-secret are exclusive");
    if (o->nworker_key && (o->plan || o->nworker_key != o->nworker))
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--worker-key: give one per --worker (%d), in the same order",
                             o->nworker);
    if (o->curve_secret && (rc = shoal_curve_read_pair(kp, o->curve_secret, err, errlen)))
        return SHOAL_EINVAL; /* a file named by a flag: a usage mistake (exit 2) */
    for (int i = 0; i < n; i++) {
        pk[i] = NULL;
        if (!shoal_curve_needed(eps[i]))
            continue;
        if (o->insecure) {
            SHOAL_WARN("--insecure-workers: the link to expert worker %s is plain TCP, neither encrypted nor "
                       "authenticated (trusted networks, tests and benchmarks only)", eps[i]);
            continue;
        }
        const char *file = NULL;
        char path[4096];
        if (pf && o->curve_keys) {
            snprintf(path, sizeof path, "%s/%s.pub", o->curve_keys, pf->workers[i].name);
            file = path;
        } else if (!pf && i < o->nworker_key) {
            file = o->worker_key[i];
        }
        if (!o->curve_secret || !file)
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "expert worker %s is not ipc://: give --curve-secret and its public key (%s), or "
                                 "--insecure-workers for plain TCP",
                                 eps[i], pf ? "--curve-keys DIR" : "--worker-key FILE");
        if ((rc = shoal_curve_read_public(keys[i], file, err, errlen)))
            return SHOAL_EINVAL; /* a file named by a flag: a usage mistake (exit 2) */
        pk[i] = keys[i];
        *any = 1;
    }
    return 0;
}

/* The client's check while waiting for HELLOs: a stop asked for, or a
 * spawned worker that exited. */
static int start_check(void *ctx, char *err, size_t errlen)
{
    shoal_dist *d = ctx;
    if (d->cancel && atomic_load(d->cancel))
        return shoal_err_set(err, errlen, SHOAL_ECANCELED, "stopped while waiting for the workers");
    return d->spawn ? shoal_spawn_check(d->spawn, err, errlen) : 0;
}

int shoal_dist_start(shoal_dist **out, const shoal_dist_opts *o, const char *model_dir, shoal_model *m, char *err,
                     size_t errlen)
{
    *out = NULL;
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    /* a trunk pack (`shoal pack --trunk`) has no expert headers: its manifest
     * carries the full model's fingerprint */
    int rc;
    if (shoal_packfile_is_pack(model_dir)) {
        shoal_packfile pk;
        if ((rc = shoal_packfile_read(&pk, model_dir, err, errlen)) ||
            (rc = shoal_packfile_check(&pk, model_dir, 0, err, errlen))) {
            shoal_packfile_free(&pk);
            return rc;
        }
        memcpy(fp, pk.fingerprint, SHOAL_PROTO_FP_BYTES);
        shoal_packfile_free(&pk);
    } else if ((rc = shoal_fprint_model(fp, info.cfg, shoal_model_store(m), err, errlen))) {
        return rc;
    }
    shoal_planfile pf = {0};
    const char *pe[SHOAL_EXPERT_CLIENT_MAX_WORKERS];
    if (o->plan && (rc = plan_endpoints(o->plan, fp, &pf, pe, err, errlen)))
        return rc;
    if (o->relay_given && o->relay_fanout && !o->trunk) {
        shoal_planfile_free(&pf);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-fanout %s needs --trunk remote (the relay tree "
                             "carries the trunk inputs)", o->relay_fanout == SHOAL_RELAY_GREEDY ? "greedy" :
                             o->relay_fanout == 2 ? "2" : o->relay_fanout == 3 ? "3" : "4");
    }
    int relay_fanout = o->relay_given ? o->relay_fanout : o->plan && o->trunk ? pf.relay_fanout : 0;
    /* the greedy schedule's rates: --relay-rates, else the plan's relay_rates */
    double rnic = o->relay_nic_gbps ? o->relay_nic_gbps : pf.relay_nic_gbps,
           rpeer = o->relay_nic_gbps ? o->relay_peer_gbps : pf.relay_peer_gbps,
           rhop = o->relay_nic_gbps ? o->relay_hop_us : pf.relay_hop_us;
    if (relay_fanout == SHOAL_RELAY_GREEDY && !(rnic > 0 && rpeer > 0)) {
        shoal_planfile_free(&pf);
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "--relay-fanout greedy needs the rates: --relay-rates "
                             "NIC_GBPS,PEER_GBPS,HOP_US (from shoal doctor, docs/CONFIG.md) or a plan with relay_rates");
    }
    if (!o->relay_given && relay_fanout == SHOAL_RELAY_GREEDY)
        SHOAL_INFO("latency-aware relay schedule for the trunk inputs (the plan's relay_fanout greedy: NIC %.3g Gbit/s, "
                   "peers %.3g Gbit/s, hop %.0f us)", rnic, rpeer, rhop);
    else if (!o->relay_given && relay_fanout)
        SHOAL_INFO("relay tree of fan-out %d for the trunk inputs (the plan's relay_fanout)", relay_fanout);
    shoal_dist *d = shoal_xcalloc(1, sizeof *d);
    d->cancel = o->cancel;
    const char *const *eps = o->plan ? pe : o->worker;
    int n = o->plan ? pf.nworkers : o->nworker;
    if (o->nlocal) {
        shoal_spawn_opts so = {.model = model_dir, .n = o->nlocal, .threads = o->worker_threads,
                               .max_tokens = info.max_batch, .trunk = o->trunk == 1,
                               .relay = o->trunk == 1 && relay_fanout != 0 && o->nlocal > 1};
        if ((rc = shoal_spawn_start(&d->spawn, &so, info.cfg, err, errlen))) {
            free(d);
            return rc;
        }
        eps = shoal_spawn_endpoints(d->spawn);
        n = o->nlocal;
    }
    shoal_curve_keypair kp;
    memset(&kp, 0, sizeof kp);
    char(*keys)[SHOAL_CURVE_Z85] = shoal_xcalloc((size_t)n + 1, sizeof *keys);
    const char **pk = shoal_xcalloc((size_t)n + 1, sizeof *pk);
    int any = 0;
    rc = curve_keys(o, eps, n, o->plan ? &pf : NULL, &kp, keys, pk, &any, err, errlen);
    shoal_expert_client_opts co = {.endpoints = eps, .nworkers = n, .cfg = info.cfg, .fingerprint = fp,
                                   .max_tokens = info.max_batch, .timeout_ms = o->timeout_ms,
                                   .failover_ms = o->failover_ms, .hello_timeout_ms = o->hello_timeout_ms,
                                   .check = start_check, .check_ctx = d,
                                   .busy = shoal_spawn_busy_slots(d->spawn, 0),
                                   .curve = any ? &kp : NULL, .curve_server_keys = any ? pk : NULL,
                                   .wire_f32 = o->wire_f32};
    if (!rc)
        rc = shoal_expert_client_open(&d->client, &co, err, errlen);
    if (!rc && any)
        SHOAL_INFO("CURVE on the tcp:// links (our public key %s)", kp.pub);
    if (!rc && (o->trunk == 1 || (o->trunk == 2 && shoal_expert_client_any_trunk(d->client)))) {
        shoal_expert_client_opts to = co;
        to.trunk_role = 1;
        to.relay_fanout = relay_fanout;
        if (relay_fanout == SHOAL_RELAY_GREEDY) {
            to.relay_nic_Bps = rnic * 1e9 / 8;
            to.relay_peer_Bps = rpeer * 1e9 / 8;
            to.relay_hop_s = rhop * 1e-6;
        }
        to.busy = shoal_spawn_busy_slots(d->spawn, 1);
        to.st = shoal_model_store(m);
        if ((rc = shoal_trunk_client_open(&d->trunk, &to, err, errlen)) ||
            (rc = shoal_expert_client_set_sibling(d->client, d->trunk, err, errlen))) {
            shoal_expert_client_close(d->trunk);
            d->trunk = NULL;
            shoal_expert_client_close(d->client);
            d->client = NULL;
        }
    }
    sodium_memzero(&kp, sizeof kp);
    free(keys);
    free(pk);
    shoal_planfile_free(&pf); /* the client copied the endpoints */
    if (rc) {
        shoal_dist_stop(d);
        return rc;
    }
    if (d->spawn && (rc = shoal_spawn_supervise(d->spawn, err, errlen))) { /* connected: a dead local worker is restarted */
        shoal_expert_client_close(d->client);
        shoal_expert_client_close(d->trunk);
        shoal_dist_stop(d);
        return rc;
    }
    shoal_experts b = shoal_expert_client_backend(d->client);
    if ((rc = shoal_model_set_experts(m, &b, err, errlen))) {
        shoal_expert_client_close(d->client);
        shoal_expert_client_close(d->trunk);
        shoal_dist_stop(d);
        return rc;
    }
    if (d->trunk) {
        shoal_rmat tb = shoal_trunk_client_backend(d->trunk);
        if ((rc = shoal_model_set_rmat(m, &tb, &d->trunk_remote, err, errlen))) {
            shoal_expert_client_close(d->trunk);
            shoal_dist_stop(d);
            return rc;
        }
        SHOAL_INFO("trunk: %d matri%s on the workers (--trunk %s)", d->trunk_remote,
                   d->trunk_remote == 1 ? "x" : "ces", o->trunk == 1 ? "remote" : "auto");
    }
    d->nworkers = n;
    /* the next layer's router runs for a hint only when some worker acts on it */
    int want = o->prefetch ? o->prefetch > 0 : SHOAL_DIST_PREFETCH_DEFAULT;
    int hints = want && shoal_expert_client_any_prefetch(d->client);
    shoal_model_set_prefetch(m, hints);
    char hex[65];
    shoal_proto_hex(fp, hex);
    SHOAL_INFO("routed experts on %d worker%s (model fingerprint %.16s...), prefetch hints %s", n, n == 1 ? "" : "s",
               hex, hints ? "on" : want ? "off (no worker caches experts)" : "off");
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

shoal_expert_client *shoal_dist_client(shoal_dist *d)
{
    return d ? d->client : NULL;
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

int shoal_dist_worker_up(shoal_dist *d, int i, char *why, size_t whylen)
{
    if (!d || i < 0 || i >= d->nworkers)
        return 0;
    /* with the trunk remote a worker serves two links (experts, trunk rows):
     * it is up when both are; the trunk link's reason when only it is down */
    int up = shoal_expert_client_worker_up(d->client, i, why, whylen);
    if (up && d->trunk)
        up = shoal_expert_client_worker_up(d->trunk, i, why, whylen);
    return up;
}

int shoal_dist_covered(shoal_dist *d, char *why, size_t whylen)
{
    if (!d)
        return 1;
    return shoal_expert_client_covered(d->client, why, whylen) &&
           (!d->trunk || shoal_expert_client_covered(d->trunk, why, whylen));
}

static void count_restart(void *cm, int worker)
{
    shoal_cmetrics_worker_restarted(cm, worker);
}

static void count_hang(void *cm, int worker)
{
    shoal_cmetrics_worker_hung(cm, worker);
}

int shoal_dist_local_state(shoal_dist *d, int i, shoal_spawn_state *out)
{
    if (!d || !d->spawn)
        return -1;
    return shoal_spawn_state_get(d->spawn, i, out);
}

int shoal_dist_set_metrics(shoal_dist *d, shoal_cmetrics *cm, char *err, size_t errlen)
{
    if (!d)
        return 0;
    if (cm) {
        shoal_spawn_on_restart(d->spawn, count_restart, cm);
        shoal_spawn_on_hang(d->spawn, count_hang, cm);
    }
    int rc = shoal_expert_client_set_metrics(d->client, cm, err, errlen);
    if (!rc && d->trunk)
        shoal_trunk_client_set_metrics(d->trunk, cm);
    return rc;
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
    memset(&p->tst, 0, sizeof p->tst);
    if (d->trunk) {
        shoal_expert_client_get_stats(d->trunk, &p->tst);
        shoal_expert_client_reset_stats(d->trunk);
    }
}

void shoal_dist_json(const shoal_dist *d, json_t *o)
{
    if (!d)
        return;
    json_object_set_new(o, "workers", json_integer(d->nworkers));
    json_object_set_new(o, "trunk_remote_matrices", json_integer(d->trunk_remote));
    if (d->trunk) { /* the relay tree (PROTOCOL.md §3.9): over the whole run */
        int fan;
        uint64_t relayed, fallbacks;
        shoal_trunk_client_relay_counts(d->trunk, &fan, &relayed, &fallbacks);
        json_object_set_new(o, "trunk_relay_fanout", fan == SHOAL_RELAY_GREEDY ? json_string("greedy")
                                                                                : json_integer(fan));
        json_object_set_new(o, "trunk_relayed_requests", json_integer((json_int_t)relayed));
        json_object_set_new(o, "trunk_relay_fallbacks", json_integer((json_int_t)fallbacks));
        uint64_t out = 0; /* every phase's TRUNK_BATCH bytes sent: the run's total */
        for (int i = 0; i < d->nph; i++)
            out += d->ph[i].tst.bytes_out;
        json_object_set_new(o, "trunk_wire_bytes_out", json_integer((json_int_t)out));
    }
    for (int i = 0; i < d->nph; i++) {
        const phase *p = &d->ph[i];
        double t = p->tokens > 0 ? p->tokens : 1;
        char key[64];
        /* wire figures: experts and trunk rows together; the trunk's alone too */
        uint64_t out = p->st.bytes_out + p->tst.bytes_out, in = p->st.bytes_in + p->tst.bytes_in;
        snprintf(key, sizeof key, "%s_wire_bytes_per_token", p->name);
        json_object_set_new(o, key, json_real((double)(out + in) / t));
        snprintf(key, sizeof key, "%s_wire_bytes_out_per_token", p->name);
        json_object_set_new(o, key, json_real((double)out / t));
        snprintf(key, sizeof key, "%s_wire_messages_per_token", p->name);
        json_object_set_new(o, key, json_real((double)(p->st.messages + p->tst.messages) / t));
        if (d->trunk) {
            snprintf(key, sizeof key, "%s_trunk_wire_bytes_per_token", p->name);
            json_object_set_new(o, key, json_real((double)(p->tst.bytes_out + p->tst.bytes_in) / t));
            snprintf(key, sizeof key, "%s_trunk_wire_bytes_out_per_token", p->name);
            json_object_set_new(o, key, json_real((double)p->tst.bytes_out / t));
            snprintf(key, sizeof key, "%s_trunk_wait_s", p->name);
            json_object_set_new(o, key, json_real(p->tst.wait_s));
        }
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
        if (p->st.hints || p->st.hints_dropped)
            fprintf(f, "%s prefetch hints: %llu sent, %llu dropped\n", p->name, (unsigned long long)p->st.hints,
                    (unsigned long long)p->st.hints_dropped);
    }
}
