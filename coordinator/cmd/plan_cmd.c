/* `shoal plan`: model + cluster manifest (+ routing trace) -> plan.json and,
 * optionally, an Ansible inventory (docs/CLUSTER.md, docs/DEPLOY.md). */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/suggest.h"
#include "cli/commands.h"
#include "common/err.h"
#include "common/planfile.h"
#include "common/k3cfg.h"
#include "common/k3schema.h"
#include "common/st.h"
#include "coordinator/cmd/plan.h"
#include "coordinator/cmd/plan_measured.h"
#include "coordinator/obs/obs.h"
#include "proto/fprint.h"
#include "kernels/kernels.h"
#include "proto/tshard.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: shoal plan --model DIR --cluster FILE [--trace FILE] [--replicas R | --hot N] -o plan.json\n"
               "                  [--inventory FILE] [--trunk local|spread] [--measured doctor.json]\n"
               "\n"
               "Assign every routed expert (layer, expert) of the model in DIR to one worker host of\n"
               "the cluster manifest FILE (docs/CLUSTER.md): each host holds at most its expert_ram\n"
               "(and disk) budget, the number of experts per worker is as equal as the budgets allow,\n"
               "and with a routing trace (`shoal run --trace`) the hottest experts are spread so each\n"
               "worker's expected load at every layer is balanced. Deterministic for the same inputs.\n"
               "Prints each worker's experts, bytes, budget use and expected load share, and the\n"
               "imbalance. A cluster too small is refused with the shortfall.\n"
               "\n"
               "  --trace FILE      routing trace to balance load by (default: by bytes)\n"
               "  --replicas R      failover: every routed expert on R + 1 distinct hosts (distinct\n"
               "                    failure domains when the manifest names hosts' \"domain\"), each\n"
               "                    within its budget; refused naming the copies needed and the room\n"
               "                    when that cannot be; the coordinator resends a lost worker's part\n"
               "                    to another owner mid-token (default 0: one owner per expert)\n"
               "  --hot N           at every MoE layer, give the N hottest experts (by the trace; without\n"
               "                    one, the lowest ids) a second owner with room left in its budget;\n"
               "                    the coordinator sends each exchange's expert to the less loaded\n"
               "                    owner (default 0)\n"
               "  --trunk MODE      local (default): the trunk stays on the coordinator; spread: every\n"
               "                    worker also owns the i-th of N near-equal row parts of every\n"
               "                    row-shardable trunk matrix (ROWSPEC '*:i/N', PROTOCOL.md 7.1; KDA's small\n"
               "                    f_a whole on each, for one round trip fewer per KDA layer), so each\n"
               "                    reads 1/N of the trunk per token; its trunk bytes come out of its\n"
               "                    budget before the experts are placed (one fit). With --replicas R\n"
               "                    every part is also on R more hosts (distinct failure domains),\n"
               "                    each to a host with room holding the fewest parts ('*:w/N,*:p/N,...')\n"
               "  --measured FILE   choose the placement from `shoal doctor --json` measurements (docs/\n"
               "                    CLUSTER.md \"Measured plans\"): the trunk local or spread over G of the\n"
               "                    workers (the fastest memory first), the experts split by each host's\n"
               "                    measured read bandwidth within its budget; prints the predicted\n"
               "                    s/token term by term for every placement considered (overrides --trunk)\n"
               "  --slots S         with --measured: also predict tokens/s for S sequences per step (8)\n"
               "  --nic-gbps X      with --measured: the coordinator's NIC, shared by all its links\n"
               "                    (default: each link alone, as doctor measured it); with it the\n"
               "                    relay trees and the greedy relay schedule are priced too\n"
               "  --peer-gbps X     with --measured: the workers' links to each other, the relay tree's\n"
               "                    hops (default: each worker's measured link to the coordinator; the\n"
               "                    greedy schedule: the slowest trunk server's); a greedy plan writes\n"
               "                    it with the NIC and the hop into plan.json relay_rates\n"
               "  --coordinator-mem SIZE  with --measured: the bytes the coordinator may hold (e.g. 64GiB;\n"
               "                    default 0.9 x its memory in doctor.json): a placement whose coordinator\n"
               "                    part (the embedding table, and the trunk when local, else its part no\n"
               "                    row spec takes) is larger does not fit\n"
               "  --kernel-eff F    with --measured: the matrix kernels' share of the read pass (0.82)\n"
               "  --imbalance I     with --measured: the expert load imbalance assumed (1.2)\n"
               "  --overhead-us X   with --measured: software cost of one exchange beyond the measured\n"
               "                    RTT (100)\n"
               "  --numerics CLASS  with --measured: the numerics class the cluster runs (default: the one\n"
               "                    doctor.json was measured in); in mu the activations travel as bf16\n"
               "                    where exact (PROTOCOL.md 1.7), so the predicted wire bytes are fewer\n"
               "  --trunk-servers G with --measured: write this placement instead of the fastest (0: the\n"
               "                    trunk local; G: spread over G workers), for comparing placements\n"
               "  -o FILE           write plan.json here (required)\n"
               "  --inventory FILE  also write an Ansible inventory (YAML) for deploy/\n"
               "\n"
               "exit codes: 0 ok, 2 usage error, 3 invalid model, cluster or trace, or an impossible plan\n");
}

static void hex32(const uint8_t *b, char *out)
{
    for (int i = 0; i < 32; i++)
        sprintf(out + 2 * i, "%02x", b[i]);
}

/* s as a YAML double-quoted scalar: " and \\ escaped, any byte below 0x20
 * or 0x7f as \\xNN (the manifest refuses them; the plan path may hold any). */
static void yq(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            fprintf(f, "\\x%02x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void inv_host(FILE *f, const shoal_plan_host *h, int worker)
{
    fputs("        ", f);
    yq(f, h->name);
    fputs(":\n          ansible_host: ", f);
    yq(f, h->address);
    fputs("\n          ansible_user: ", f);
    yq(f, h->ssh_user);
    fprintf(f, "\n          ansible_port: %d\n          shoal_cpus: %d\n", h->ssh_port, h->cpus);
    if (worker)
        fprintf(f, "          shoal_worker_port: %d\n", h->port);
}

static int write_inventory(const char *path, const shoal_plan_cluster *c, const char *plan_path)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "shoal plan: %s: %s\n", path, strerror(errno));
        return -1;
    }
    const shoal_plan_host *co = &c->hosts[c->coordinator];
    /* every string quoted (yq), whatever the manifest's checks let through */
    fputs("# Ansible inventory written by `shoal plan` from the cluster manifest (docs/DEPLOY.md).\n"
          "all:\n  vars:\n    shoal_plan_file: ", f);
    yq(f, plan_path);
    fprintf(f, "\n    shoal_worker_port_default: %d\n  children:\n    shoal_coordinator:\n      hosts:\n", c->worker_port);
    inv_host(f, co, 0);
    fprintf(f, "    shoal_workers:\n      hosts:\n");
    for (int i = 0; i < c->nhosts; i++)
        if (c->hosts[i].expert_ram)
            inv_host(f, &c->hosts[i], 1);
    int bad = ferror(f);
    if (fclose(f) || bad) {
        fprintf(stderr, "shoal plan: %s: write error\n", path);
        return -1;
    }
    return 0;
}

int shoal_cmd_plan(int argc, char **argv)
{
    const char *model = NULL, *cluster = NULL, *trace = NULL, *out = NULL, *inv = NULL;
    long replicas = 0, hot = 0;
    int spread = 0, has_fa = 0;
    /* --measured doctor.json (issue 34, plan_measured.h) */
    const char *measured = NULL;
    int mslots = 8, TW = 0, *tslot = NULL;
    double mnic = 0, mpeer = 0, meff = 0.82, mimb = 1.2, mpred = 0, movh = 100;
    int mrelay = 0; /* the relay tree's fan-out the measured plan chose (0: none; SHOAL_RELAY_GREEDY) */
    double mrpeer = 0, mrhop = 0; /* with greedy: the hops' rate (bytes/s) and latency (s) it priced */
    long mforce = -1;
    uint64_t mcmem = 0; /* --coordinator-mem (0: doctor.json's) */
    int mnum = -1; /* --numerics: -1 doctor.json's class */
    uint64_t *mcount = NULL, *pbudget = NULL;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "shoal plan: %s needs a value\n", a);
            usage(stderr);
            return 2;
        }
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--cluster"))
            cluster = v;
        else if (!strcmp(a, "--trace"))
            trace = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--out"))
            out = v;
        else if (!strcmp(a, "--inventory"))
            inv = v;
        else if (!strcmp(a, "--measured"))
            measured = v;
        else if (!strcmp(a, "--coordinator-mem")) {
            if (shoal_plan_parse_bytes(v, &mcmem) || !mcmem) {
                fprintf(stderr, "shoal plan: bad --coordinator-mem '%s' (bytes: an integer, or e.g. \"24GiB\")\n", v);
                return 2;
            }
        }
        else if (!strcmp(a, "--numerics")) {
            shoal_numerics nc;
            if (shoal_numerics_parse(v, &nc)) {
                fprintf(stderr, "shoal plan: --numerics takes portable or mu, not '%s'\n", v);
                return 2;
            }
            mnum = nc == SHOAL_NUMERICS_MU;
        }
        else if (!strcmp(a, "--trunk-servers")) {
            char *end;
            mforce = strtol(v, &end, 10);
            if (*end || end == v || mforce < 0 || mforce > 4096) {
                fprintf(stderr, "shoal plan: bad --trunk-servers '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--overhead-us")) {
            char *end;
            movh = strtod(v, &end);
            if (*end || end == v || !(movh >= 0) || movh > 1e6) {
                fprintf(stderr, "shoal plan: bad --overhead-us '%s'\n", v);
                return 2;
            }
        }
        else if (!strcmp(a, "--slots") || !strcmp(a, "--nic-gbps") || !strcmp(a, "--kernel-eff") ||
                 !strcmp(a, "--peer-gbps") ||
                 !strcmp(a, "--imbalance")) {
            char *end;
            double x = strtod(v, &end);
            if (*end || end == v || !(x > 0) || x > 1e6 || (!strcmp(a, "--kernel-eff") && x > 1) ||
                (!strcmp(a, "--imbalance") && x < 1) || (!strcmp(a, "--slots") && (x != floor(x) || x > 4096))) {
                fprintf(stderr, "shoal plan: bad %s '%s'\n", a, v);
                return 2;
            }
            if (a[2] == 's')
                mslots = (int)x;
            else if (a[2] == 'n')
                mnic = x;
            else if (a[2] == 'p')
                mpeer = x;
            else if (a[2] == 'k')
                meff = x;
            else
                mimb = x;
        }
        else if (!strcmp(a, "--trunk")) {
            if (strcmp(v, "local") && strcmp(v, "spread")) {
                fprintf(stderr, "shoal plan: --trunk takes local or spread, not '%s'\n", v);
                return 2;
            }
            spread = !strcmp(v, "spread");
        }
        else if (!strcmp(a, "--replicas") || !strcmp(a, "--hot")) {
            char *end;
            errno = 0;
            long x = strtol(v, &end, 10);
            if (errno || *end || end == v || x < 0 || x > 1000000) {
                fprintf(stderr, "shoal plan: bad %s '%s'\n", a, v);
                return 2;
            }
            *(!strcmp(a, "--hot") ? &hot : &replicas) = x;
        } else {
            if (a[0] == '-') {
                shoal_suggest_unknown_flag("shoal plan", a, usage);
                return 2;
            }
            fprintf(stderr, "shoal plan: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!model || !cluster || !out) {
        usage(stderr);
        return 2;
    }
    if (mcmem && !measured) {
        fprintf(stderr, "shoal plan: --coordinator-mem needs --measured\n");
        return 2;
    }
    if (mforce >= 0 && !measured) {
        fprintf(stderr, "shoal plan: --trunk-servers needs --measured\n");
        return 2;
    }
    if (replicas && hot) {
        fprintf(stderr, "shoal plan: --replicas and --hot are not combined (yet): with --replicas every expert "
                        "already has several owners, and the coordinator spreads each exchange over them\n");
        return 2;
    }
    char err[4096] = "", path[4096];
    int rc, ret = 3;
    shoal_k3cfg cfg;
    shoal_st *st = NULL;
    shoal_plan_cluster c = {0};
    shoal_trace_file *tf = NULL;
    shoal_trace_stats ts = {0};
    uint64_t *budget = NULL, *tbytes = NULL;
    uint8_t *tpart = NULL; /* [W * W]: worker w holds trunk part p (--trunk spread) */
    int32_t *owner = NULL, *replica = NULL;
    uint8_t *hold = NULL;
    int *dom = NULL;
    int *widx = NULL;
    json_t *root = NULL;
    snprintf(path, sizeof path, "%s/config.json", model);
    if ((rc = shoal_k3cfg_load(&cfg, path, err, sizeof err)))
        goto fail;
    shoal_st_opts so = {.map = 0};
    uint8_t fp[32];
    if ((rc = shoal_st_open(&st, model, &so, err, sizeof err)) || (rc = shoal_fprint_model(fp, &cfg, st, err, sizeof err)))
        goto fail;
    shoal_k3schema_totals tot;
    shoal_k3schema_sum(&cfg, &tot);
    if ((rc = shoal_plan_cluster_read(&c, cluster, err, sizeof err)))
        goto fail;
    const uint64_t *hits = NULL;
    if (trace) {
        if ((rc = shoal_trace_open(&tf, trace, err, sizeof err)))
            goto fail;
        const shoal_trace_hdr *h = shoal_trace_file_hdr(tf);
        static const uint8_t zero[32];
        if (h->num_layers != (uint32_t)cfg.num_layers || h->num_experts != (uint32_t)cfg.num_experts) {
            snprintf(err, sizeof err, "trace %s is for %u layers x %u experts, the model has %d x %d", trace,
                     h->num_layers, h->num_experts, cfg.num_layers, cfg.num_experts);
            goto fail;
        }
        if (memcmp(h->fingerprint, zero, 32) && memcmp(h->fingerprint, fp, 32)) {
            char a[65], b[65];
            hex32(h->fingerprint, a);
            hex32(fp, b);
            snprintf(err, sizeof err, "trace %s was recorded on model %.16s..., this model is %.16s...", trace, a, b);
            goto fail;
        }
        shoal_trace_stats_compute(tf, &ts);
        hits = ts.hits;
    }
    int W = 0;
    widx = shoal_xmalloc((size_t)c.nhosts * sizeof *widx);
    budget = shoal_xmalloc((size_t)c.nhosts * sizeof *budget);
    for (int i = 0; i < c.nhosts; i++)
        if (c.hosts[i].expert_ram) {
            widx[W] = i;
            budget[W] = c.hosts[i].expert_ram;
            if (c.hosts[i].disk && c.hosts[i].disk < budget[W])
                budget[W] = c.hosts[i].disk;
            W++;
        }
    if (measured) { /* the placement from the measurements: trunk local or on TW servers, expert counts */
        const char **names = shoal_xmalloc((size_t)(W ? W : 1) * sizeof *names);
        for (int w = 0; w < W; w++)
            names[w] = c.hosts[widx[w]].name;
        tslot = shoal_xmalloc((size_t)(W ? W : 1) * sizeof *tslot);
        mcount = shoal_xcalloc((size_t)(W ? W : 1), sizeof *mcount);
        shoal_plan_measured pm = {.cfg = &cfg, .st = st, .nworkers = W, .names = names, .budget = budget,
                                  .expert_bytes = tot.bytes_per_expert, .doctor = measured, .slots = mslots,
                                  .nic_Bps = mnic * 1e9 / 8, .peer_Bps = mpeer * 1e9 / 8, .eff = meff, .imbalance = mimb,
                                  .max_trunk_servers = replicas > 0, .tslot = tslot, .count = mcount,
                                  .overhead_s = movh * 1e-6, .force_G = (int)mforce,
                                  .budget_split = replicas || hot, .numerics = mnum, .coord_mem = mcmem};
        rc = shoal_plan_measured_choose(&pm, err, sizeof err);
        free(names);
        if (rc)
            goto fail;
        spread = pm.spread;
        TW = pm.G;
        mpred = pm.predicted_s;
        mrelay = pm.relay_fanout;
        mrpeer = pm.relay_peer_Bps;
        mrhop = pm.relay_hop_s;
        mnum = pm.numerics;
    }
    int ndom = 0, named = 0;
    if (replicas) { /* failure domains: the named ones, else each host its own */
        dom = shoal_xmalloc((size_t)(W ? W : 1) * sizeof *dom);
        for (int w = 0; w < W; w++) {
            const char *dn = c.hosts[widx[w]].domain[0] ? c.hosts[widx[w]].domain : c.hosts[widx[w]].name;
            dom[w] = -1;
            for (int v = 0; v < w && dom[w] < 0; v++) {
                const char *dv = c.hosts[widx[v]].domain[0] ? c.hosts[widx[v]].domain : c.hosts[widx[v]].name;
                if (!strcmp(dn, dv))
                    dom[w] = dom[v];
            }
            if (dom[w] < 0)
                dom[w] = ndom++;
            named |= c.hosts[widx[w]].domain[0] != 0;
        }
    }
    /* --trunk spread: worker w owns part w of W of every row-shardable
     * matrix (rows floor(wR/W) .. floor((w+1)R/W)-1, ROWSPEC "*:w/W") and,
     * with --replicas R, R more parts, so that every part is on R + 1
     * distinct hosts (failure domains when named); those bytes come out of
     * its budget first, so trunk and experts are one fit */
    tbytes = shoal_xcalloc((size_t)(W ? W : 1), sizeof *tbytes);
    tpart = shoal_xcalloc((size_t)(W ? W : 1) * (size_t)(W ? W : 1), 1);
    if (spread) {
        shoal_tshard_mat *mats = NULL;
        int nm = 0;
        if (W < 1 || (rc = shoal_tshard_mats(&cfg, &mats, &nm))) {
            snprintf(err, sizeof err, "--trunk spread: %s", W < 1 ? "no worker hosts" : "the trunk matrices do not list");
            rc = SHOAL_ECONFIG;
            goto fail;
        }
        if (replicas && ndom < replicas + 1) {
            snprintf(err, sizeof err, "--trunk spread --replicas %ld puts every trunk row on %ld distinct %s; the "
                     "cluster has %d", replicas, replicas + 1, named ? "failure domains" : "worker hosts", ndom);
            rc = SHOAL_ECONFIG;
            free(mats);
            goto fail;
        }
        uint64_t *pbytes = shoal_xcalloc((size_t)W, sizeof *pbytes), fa = 0; /* bytes of each part; f_a whole */
        if (!tslot) { /* every worker its part: worker w part w of W */
            tslot = shoal_xmalloc((size_t)W * sizeof *tslot);
            for (int w = 0; w < W; w++)
                tslot[w] = w;
            TW = W;
        }
        for (int k = 0; k < nm && !rc; k++) {
            const shoal_tensor *t = shoal_st_find(st, mats[k].name);
            if (!t || mats[k].rows < TW) {
                snprintf(err, sizeof err, "--trunk spread over %d workers: %s %s", TW, mats[k].name,
                         t ? "has fewer rows than workers" : "is not in the checkpoint");
                rc = SHOAL_ECONFIG;
                break;
            }
            uint64_t row = t->nbytes / (uint64_t)mats[k].rows, R = (uint64_t)mats[k].rows;
            /* KDA's f_a whole on every worker: f_b(f_a(xn)) then rides in the
             * layer's first request (PROTOCOL.md §3.7, chains) */
            int whole = strstr(mats[k].name, ".f_a_proj.weight") != NULL;
            has_fa |= whole;
            if (whole)
                fa += R * row;
            else
                for (int p = 0; p < TW; p++)
                    pbytes[p] += ((uint64_t)(p + 1) * R / (uint64_t)TW - (uint64_t)p * R / (uint64_t)TW) * row;
        }
        free(mats);
        if (rc) {
            free(pbytes);
            goto fail;
        }
        for (int w = 0; w < W; w++) {
            if (tslot[w] < 0)
                continue; /* --measured: not one of the trunk servers */
            tpart[(size_t)w * W + tslot[w]] = 1;
            tbytes[w] = fa + pbytes[tslot[w]];
        }
        /* the replicas, copy after copy, part after part: each to a host
         * whose failure domain holds no copy of the part yet -- among those
         * with room for it in their budget, the one holding the fewest
         * parts, ties to the next after the part's first host in worker
         * order (so part p goes on hosts p .. p + R mod W when the domains
         * allow); when none has room, the one with the most budget left
         * (then refused below, with the numbers) */
        uint64_t *nparts = shoal_xcalloc((size_t)W, sizeof *nparts);
        for (int w = 0; w < W; w++)
            nparts[w] = 1;
        for (long r = 1; r <= replicas; r++)
            for (int p = 0; p < W; p++) {
                int best = -1, best_fits = 0;
                int64_t best_room = 0;
                for (int q = 1; q < W; q++) {
                    int w = (p + q) % W, taken = 0;
                    for (int v = 0; v < W && !taken; v++)
                        taken = tpart[(size_t)v * W + p] && dom[v] == dom[w];
                    if (taken)
                        continue;
                    int64_t room = (int64_t)budget[w] - (int64_t)tbytes[w];
                    int fits = room > (int64_t)pbytes[p];
                    if (best < 0 || fits > best_fits || (fits && best_fits && nparts[w] < nparts[best]) ||
                        (!fits && !best_fits && room > best_room)) {
                        best = w;
                        best_fits = fits;
                        best_room = room;
                    }
                }
                nparts[best]++;
                /* ndom >= replicas + 1: a domain without a copy is left */
                tpart[(size_t)best * W + p] = 1;
                tbytes[best] += pbytes[p];
            }
        free(pbytes);
        free(nparts);
        for (int w = 0; w < W; w++) {
            if (tbytes[w] >= budget[w]) {
                snprintf(err, sizeof err, "--trunk spread%s: host %s: its trunk rows (%.3f GiB%s) do not leave room "
                         "for experts in its budget (%.3f GiB); short by at least %.3f GiB",
                         replicas ? " --replicas" : "", c.hosts[widx[w]].name, (double)tbytes[w] / 1073741824.0,
                         replicas ? ", its parts and the replicas it holds" : "", (double)budget[w] / 1073741824.0,
                         (double)(tbytes[w] - budget[w]) / 1073741824.0);
                rc = SHOAL_ECONFIG;
                goto fail;
            }
            budget[w] -= tbytes[w];
        }
    }
    if (measured && !replicas && !hot) { /* the expert split by measured bandwidth: each worker's count is its cap, and the caps add up
                       to every routed expert, so the water filling gives each exactly its count; the report
                       still shows the share of the real budget used */
        pbudget = shoal_xmalloc((size_t)(W ? W : 1) * sizeof *pbudget);
        for (int w = 0; w < W; w++) {
            pbudget[w] = budget[w];
            if (budget[w] > mcount[w] * tot.bytes_per_expert)
                budget[w] = mcount[w] * tot.bytes_per_expert;
        }
    }
    const int L = cfg.num_layers, E = cfg.num_experts;
    owner = shoal_xmalloc((size_t)L * E * sizeof *owner);
    shoal_plan_in pin = {.num_layers = L, .num_experts = E, .is_moe = cfg.is_moe,
                         .expert_bytes = tot.bytes_per_expert, .hits = hits, .nworkers = W, .budget = budget};
    if ((rc = shoal_plan_compute(&pin, owner, err, sizeof err)))
        goto fail;
    replica = shoal_xmalloc((size_t)L * E * sizeof *replica);
    if ((rc = shoal_plan_replicate(&pin, (int)hot, owner, replica, err, sizeof err)))
        goto fail;
    /* the expected load without any replica, for the report */
    double lw_plain = 0;
    {
        double *l0 = shoal_xcalloc((size_t)W * L, sizeof *l0), smx = 0, smean = 0;
        shoal_plan_load(&pin, owner, NULL, l0);
        for (int l = 0; l < L; l++) {
            if (!cfg.is_moe[l])
                continue;
            double mx = 0, s = 0;
            for (int w = 0; w < W; w++) {
                s += l0[(size_t)w * L + l];
                mx = l0[(size_t)w * L + l] > mx ? l0[(size_t)w * L + l] : mx;
            }
            smx += mx;
            smean += s / W;
        }
        lw_plain = smean > 0 ? smx / smean : 0;
        free(l0);
    }
    if (replicas) {
        hold = shoal_xmalloc((size_t)W * L * E);
        if ((rc = shoal_plan_redundant(&pin, (int)replicas, named ? dom : NULL, ndom, hold, err, sizeof err)))
            goto fail;
    }

    /* expected load: trace hits, else one unit per expert; a replicated
     * expert's load levels its two owners (shoal_plan_load) */
    double *load = shoal_xcalloc((size_t)W * L, sizeof *load), total = 0, sum_max = 0, sum_mean = 0;
    if (hold)
        shoal_plan_load_held(&pin, hold, load);
    else
        shoal_plan_load(&pin, owner, replica, load);
    uint64_t *cnt = shoal_xcalloc((size_t)W, sizeof *cnt), *nrep = shoal_xcalloc((size_t)W, sizeof *nrep);
    for (int l = 0; l < L; l++) {
        if (!cfg.is_moe[l])
            continue;
        for (int e = 0; e < E; e++) {
            size_t cell = (size_t)l * E + e;
            int w = owner[cell], r2 = replica[cell];
            double x = hits ? (double)hits[cell] : 1.0;
            total += x;
            if (hold) {
                for (int v = 0; v < W; v++)
                    cnt[v] += hold[(size_t)v * L * E + cell];
                continue;
            }
            cnt[w]++;
            if (r2 >= 0) {
                cnt[r2]++;
                nrep[w]++;
                nrep[r2]++;
            }
        }
        double mx = 0, s = 0;
        for (int w = 0; w < W; w++) {
            double x = load[(size_t)w * L + l];
            s += x;
            if (x > mx)
                mx = x;
        }
        sum_max += mx;
        sum_mean += s / W;
    }
    root = json_object();
    json_object_set_new(root, "format", json_string("shoal-plan"));
    json_object_set_new(root, "version", json_integer(1));
    char fph[65];
    hex32(fp, fph);
    json_t *jm = json_object();
    json_object_set_new(jm, "fingerprint", json_string(fph));
    json_object_set_new(jm, "num_layers", json_integer(L));
    json_object_set_new(jm, "num_experts", json_integer(E));
    json_object_set_new(jm, "moe_layers", json_integer(cfg.num_moe));
    json_object_set_new(jm, "expert_bytes", json_integer((json_int_t)tot.bytes_per_expert));
    json_object_set_new(root, "model", jm);
    const shoal_plan_host *co = &c.hosts[c.coordinator];
    json_t *jc = json_object();
    json_object_set_new(jc, "name", json_string(co->name));
    json_object_set_new(jc, "address", json_string(co->address));
    json_object_set_new(root, "coordinator", jc);
    json_object_set_new(root, "load_basis", json_string(hits ? "trace" : "bytes"));
    json_object_set_new(root, "replicas", json_integer(replicas));
    if (hot)
        json_object_set_new(root, "hot", json_integer(hot));
    json_object_set_new(root, "trunk", json_string(spread ? "spread" : "local"));
    if (spread)
        json_object_set_new(root, "trunk_servers", json_integer(TW));
    if (spread && mrelay == SHOAL_RELAY_GREEDY) { /* the schedule's inputs, for run/serve --plan */
        json_object_set_new(root, "relay_fanout", json_string("greedy"));
        json_t *rr = json_object();
        json_object_set_new(rr, "nic_gbps", json_real(mnic));
        json_object_set_new(rr, "peer_gbps", json_real(mrpeer * 8 / 1e9));
        json_object_set_new(rr, "hop_us", json_real(mrhop * 1e6));
        json_object_set_new(root, "relay_rates", rr);
    } else if (spread && mrelay) { /* PROTOCOL.md §3.9: honoured by run/serve --plan and the workers' expert --plan */
        json_object_set_new(root, "relay_fanout", json_integer(mrelay));
    }
    if (measured) {
        json_t *jmz = json_object();
        json_object_set_new(jmz, "doctor", json_string(measured));
        json_object_set_new(jmz, "predicted_s_per_token", json_real(mpred));
        json_object_set_new(jmz, "slots", json_integer(mslots));
        json_object_set_new(jmz, "numerics", json_string(mnum > 0 ? "mu" : "portable"));
        json_object_set_new(root, "measured", jmz);
    }
    if (hits)
        json_object_set_new(root, "trace_pairs", json_integer((json_int_t)ts.pairs));
    json_t *jw = json_array();
    double mxshare = 0;
    printf("plan: %d MoE layers x %d experts (%.2f MiB each, %.2f GiB in all) on %d workers; load by %s\n",
           cfg.num_moe, E, (double)tot.bytes_per_expert / 1048576.0,
           (double)tot.bytes_per_expert * cfg.num_moe * E / 1073741824.0, W,
           hits ? "routing trace" : "bytes (uniform routing)");
    printf("%-20s %8s %12s %7s %8s %8s %7s\n", "worker", "experts", "GiB", "budget", "share", "fair", "ratio");
    for (int w = 0; w < W; w++) {
        const shoal_plan_host *h = &c.hosts[widx[w]];
        char *ranges = NULL, ep[400];
        if (hold)
            shoal_plan_ranges_held(hold, L, cfg.is_moe, E, w, &ranges);
        else
            shoal_plan_ranges(owner, replica, L, cfg.is_moe, E, w, &ranges);
        double wl = 0;
        for (int l = 0; l < L; l++)
            wl += load[(size_t)w * L + l];
        double share = total > 0 ? wl / total : 0;
        if (share > mxshare)
            mxshare = share;
        uint64_t bytes = cnt[w] * tot.bytes_per_expert;
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(h->name));
        json_object_set_new(o, "host", json_string(h->name));
        json_object_set_new(o, "experts", json_string(ranges));
        int v6 = strchr(h->address, ':') != NULL;
        snprintf(ep, sizeof ep, v6 ? "tcp://[%s]:%d" : "tcp://%s:%d", h->address, h->port);
        json_object_set_new(o, "endpoint", json_string(ep));
        snprintf(ep, sizeof ep, "tcp://%s:%d", v6 ? "[::]" : "0.0.0.0", h->port);
        json_object_set_new(o, "listen", json_string(ep));
        json_object_set_new(o, "expert_count", json_integer((json_int_t)cnt[w]));
        if (replicas && c.hosts[widx[w]].domain[0])
            json_object_set_new(o, "domain", json_string(c.hosts[widx[w]].domain));
        if (hot) { /* the experts it holds as the second owner */
            char *rr = NULL;
            shoal_plan_ranges(replica, NULL, L, cfg.is_moe, E, w, &rr);
            json_object_set_new(o, "replicated", json_integer((json_int_t)nrep[w]));
            if (rr[0])
                json_object_set_new(o, "replica_experts", json_string(rr));
            free(rr);
        }
        json_object_set_new(o, "bytes", json_integer((json_int_t)bytes));
        char *spec = NULL;
        if (spread && tslot[w] >= 0) { /* its own part first, then the replicas it holds, ascending */
            size_t cap = 64 + 24 * (size_t)W, at = 0;
            spec = shoal_xmalloc(cap);
            json_t *parts = json_array();
            at += (size_t)snprintf(spec + at, cap - at, "*:%d/%d", tslot[w], TW);
            json_array_append_new(parts, json_integer(tslot[w]));
            for (int p = 0; p < TW; p++)
                if (p != tslot[w] && tpart[(size_t)w * W + p]) {
                    at += (size_t)snprintf(spec + at, cap - at, ",*:%d/%d", p, TW);
                    json_array_append_new(parts, json_integer(p));
                }
            snprintf(spec + at, cap - at, "%s", has_fa ? ",*.f_a_proj.weight:all" : "");
            json_object_set_new(o, "trunk", json_string(spec));
            json_object_set_new(o, "trunk_bytes", json_integer((json_int_t)tbytes[w]));
            if (replicas)
                json_object_set_new(o, "trunk_parts", parts);
            else
                json_decref(parts);
        }
        json_object_set_new(o, "expected_share", json_real(share));
        json_array_append_new(jw, o);
        printf("%-20s %8llu %12.3f %6.1f%% %8.4f %8.4f %7.3f", h->name, (unsigned long long)cnt[w],
               (double)bytes / 1073741824.0, 100.0 * (double)bytes / (double)(pbudget ? pbudget[w] : budget[w]), share, 1.0 / W,
               share * W);
        if (spec)
            printf("  trunk %s %.3f GiB", spec, (double)tbytes[w] / 1073741824.0);
        printf("\n");
        free(spec);
        free(ranges);
    }
    json_object_set_new(root, "workers", jw);
    double imb = mxshare * W, lw = sum_mean > 0 ? sum_max / sum_mean : 0;
    json_object_set_new(root, "imbalance", json_real(imb));
    json_object_set_new(root, "layer_weighted_imbalance", json_real(lw));
    printf("imbalance (max/mean share): %.4f; layer-weighted imbalance (sum of per-layer max / mean): %.4f\n", imb,
           lw);
    json_object_set_new(root, "layer_weighted_imbalance_without_replicas", json_real(lw_plain));
    if (hot)
        printf("hot replicas: the %ld hottest experts of each MoE layer have two owners (%ld in all; \"experts\" "
               "above counts them on both); a replicated expert's load levels its two owners' as far as it goes\n",
               hot, hot * cfg.num_moe);
    if (replicas)
        printf("replicas: every routed expert%s on %ld distinct %s (\"experts\" above counts every copy); any %ld "
               "of them may fail at once\n",
               spread ? " and every part of the trunk rows" : "", replicas + 1,
               ndom < W ? "failure domains" : "hosts", replicas);
    if (replicas || hot)
        printf("layer-weighted imbalance without replicas (one owner each): %.4f\n", lw_plain);
    free(load);
    free(cnt);
    free(nrep);
    if (json_dump_file(root, out, JSON_INDENT(2) | JSON_PRESERVE_ORDER)) {
        fprintf(stderr, "shoal plan: cannot write %s: %s\n", out, strerror(errno));
        ret = 4;
        goto done;
    }
    printf("wrote %s\n", out);
    if (inv && write_inventory(inv, &c, out)) {
        ret = 4;
        goto done;
    }
    if (inv)
        printf("wrote %s\n", inv);
    ret = 0;
    goto done;
fail:
    fprintf(stderr, "shoal plan: %s\n", err);
done:
    json_decref(root);
    free(owner);
    free(replica);
    free(hold);
    free(dom);
    free(budget);
    free(tbytes);
    free(tpart);
    free(tslot);
    free(mcount);
    free(pbudget);
    free(widx);
    shoal_trace_stats_free(&ts);
    shoal_trace_file_close(tf);
    shoal_plan_cluster_free(&c);
    shoal_st_close(st);
    return ret;
}
