/* `shoal doctor`: measures a cluster's worker hosts and the coordinator's
 * links to them over the real connections (CURVE included), for a person (a
 * table, the worst values marked, findings in words) and for `shoal plan
 * --measured` (--json / -o doctor.json). docs/CLUSTER.md "shoal doctor";
 * the messages: PROBE / PROBE_REPLY, proto/PROTOCOL.md §3.8.
 *
 * Per worker: the host facts (CPU, ISA, cores, memory, the memory read pass
 * with one and all threads, the model disk's read rate, free disk, what it
 * holds, its version), the RTT of empty exchanges (p50, p99), the link rate
 * each way (bulk messages, a window in flight) and the time of one message of
 * the forward's size each way. This host's own facts too (the coordinator's
 * trunk reads). */
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/commands.h"
#include "common/err.h"
#include "common/log.h"
#include "coordinator/cluster/cluster.h"
#include "coordinator/cmd/plan.h"
#include "common/packfile.h"
#include "proto/fprint.h"
#include "coordinator/engine/engine.h"
#include "kernels/kernels.h"
#include "worker/expert_server.h"

typedef struct {
    const char *name;
    char id[72];
    int ok;
    char err[512];
    shoal_proto_facts f;
    double rtt_p50_us, rtt_p99_us, out_Bps, in_Bps, fwd_out_us, fwd_in_us;
    double need;      /* weight bytes the plan or the manifest gives it (0: not known) */
    double bw_together, disk_together; /* its read pass and disk rate measured with every worker at once */
    const char *need_from;
} wres;

static void usage(FILE *f)
{
    fprintf(f,
            "usage: shoal doctor --model DIR (--cluster cluster.json | --plan plan.json | --worker EP ... |\n"
            "                    --workers N) [options]\n"
            "  --cluster FILE     the manifest's worker hosts (tcp://address:port; with --curve-keys DIR,\n"
            "                     DIR/NAME.pub is host NAME's key), their budgets checked against the hosts\n"
            "  measures every worker's host and the link to it over the real connection\n"
            "  (docs/CLUSTER.md \"shoal doctor\"; PROBE, proto/PROTOCOL.md 3.8)\n"
            "  --json             print the measurements as JSON (for shoal plan --measured)\n"
            "  --numerics CLASS   the workers' numerics class, portable (default) or mu: a worker of\n"
            "                     another class is refused, as by run and serve (docs/CONFIG.md)\n"
            "  -o FILE            also write that JSON to FILE\n"
            "  --rounds N         empty exchanges per link for the RTT (default 200)\n"
            "  --bulk-bytes B     message size of the link-rate measurement (default 1048576)\n"
            "  --bulk-count N     messages each way for it (default 24; 4 in flight)\n"
            "  --fwd-bytes B      the forward's message size each way (default: one token's row,\n"
            "                     hidden_size x 4 back; out x 4, or x 2 in the mu class, whose\n"
            "                     inputs travel as bf16)\n"
            "  --no-facts         links only (the host facts pause each worker about a second)\n"
            "  --no-local         do not measure this host\n");
    shoal_dist_usage(f);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const double *sorted, int n, double p)
{
    int i = (int)ceil(p * n) - 1;
    return sorted[i < 0 ? 0 : i >= n ? n - 1 : i];
}

static double median(double *v, int n)
{
    if (n <= 0)
        return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* median of a field over the workers other than `skip` that measured it */
static double others_median(const wres *r, int n, int skip, size_t off)
{
    double *v = shoal_xcalloc((size_t)n + 1, sizeof *v);
    int k = 0;
    for (int i = 0; i < n; i++) {
        double x = *(const double *)((const char *)&r[i] + off);
        if (i != skip && r[i].ok && x > 0)
            v[k++] = x;
    }
    double m = median(v, k);
    free(v);
    return m;
}

static json_t *facts_json(const shoal_proto_facts *f)
{
    json_t *o = json_object();
    json_object_set_new(o, "cpu", json_string(f->cpu));
    json_object_set_new(o, "isa", json_string(f->isa));
    json_object_set_new(o, "version", json_string(f->version));
    json_object_set_new(o, "cores", json_integer(f->cores));
    json_object_set_new(o, "threads", json_integer(f->threads));
    json_object_set_new(o, "mem_total", json_integer((json_int_t)f->mem_total));
    json_object_set_new(o, "mem_avail", json_integer((json_int_t)f->mem_avail));
    json_object_set_new(o, "disk_free", json_integer((json_int_t)f->disk_free));
    json_object_set_new(o, "disk_total", json_integer((json_int_t)f->disk_total));
    json_object_set_new(o, "read_bw_1", json_integer((json_int_t)f->read_bw_1));
    json_object_set_new(o, "read_bw_all", json_integer((json_int_t)f->read_bw_all));
    json_object_set_new(o, "disk_read_bw", json_integer((json_int_t)f->disk_read_bw));
    json_object_set_new(o, "held_bytes", json_integer((json_int_t)f->held_bytes));
    return o;
}

#define GB 1e9
#define MB 1e6

/* Findings in words: each compares a worker with the median of the others
 * (or a host with itself), so they read the same on any hardware. */
static void findings(const wres *r, int n, const shoal_proto_facts *local, json_t *arr)
{
    char line[1024]; /* room for an id and a whole err */
#define SAY(...)                                                                                                       \
    do {                                                                                                               \
        snprintf(line, sizeof line, __VA_ARGS__);                                                                      \
        json_array_append_new(arr, json_string(line));                                                                 \
    } while (0)
    for (int i = 0; i < n; i++) {
        const wres *w = &r[i];
        if (!w->ok) {
            SAY("%s: not measured: %s", w->id, w->err);
            continue;
        }
        double m = others_median(r, n, i, offsetof(wres, rtt_p50_us));
        if (m > 0 && w->rtt_p50_us > 2 * m && w->rtt_p50_us - m > 100)
            SAY("%s: %.2f ms RTT, %.1fx the others (%.2f ms): check it is in the same region and network", w->id,
                w->rtt_p50_us / 1e3, w->rtt_p50_us / m, m / 1e3);
        if (w->rtt_p99_us > 4 * w->rtt_p50_us && w->rtt_p99_us - w->rtt_p50_us > 500)
            SAY("%s: RTT p99 %.2f ms against p50 %.2f ms: the link or the host is jittery (a busy neighbour, "
                "CPU steal)", w->id, w->rtt_p99_us / 1e3, w->rtt_p50_us / 1e3);
        m = others_median(r, n, i, offsetof(wres, out_Bps));
        if (m > 0 && w->out_Bps < m / 2)
            SAY("%s: link to it %.0f MB/s, %.1fx slower than to the others (%.0f MB/s): a slower port or a "
                "throttled instance", w->id, w->out_Bps / MB, m / w->out_Bps, m / MB);
        m = others_median(r, n, i, offsetof(wres, in_Bps));
        if (m > 0 && w->in_Bps < m / 2)
            SAY("%s: link from it %.0f MB/s, %.1fx slower than from the others (%.0f MB/s)", w->id, w->in_Bps / MB,
                m / w->in_Bps, m / MB);
        if (!w->f.has)
            continue;
        double bw = (double)w->f.read_bw_all;
        double *v = shoal_xcalloc((size_t)n + 1, sizeof *v);
        int k = 0;
        for (int j = 0; j < n; j++)
            if (j != i && r[j].ok && r[j].f.has && r[j].f.read_bw_all)
                v[k++] = (double)r[j].f.read_bw_all;
        double mb = median(v, k);
        free(v);
        if (mb > 0 && bw < mb * 0.6)
            SAY("%s: memory read %.1f GB/s, %.1fx slower than the others (%.1f GB/s): it will set the pace of every "
                "layer unless the plan gives it less (plan --measured weighs the split by it)", w->id, bw / GB,
                mb / bw, mb / GB);
        if (w->need > 0 && w->need > (double)w->f.mem_total * 0.9)
            SAY("%s has %.0f GB of memory, %s gives it %.0f GB of weights (plus the OS and buffers): its weights "
                "will be read from disk, or give it less", w->id, (double)w->f.mem_total / GB, w->need_from,
                w->need / GB);
        else if (w->f.held_bytes > w->f.mem_total / 10 * 9)
            SAY("%s has %.0f GB of memory, its share needs %.0f GB (plus the OS and buffers): its weights will be "
                "read from disk", w->id, (double)w->f.mem_total / GB, (double)w->f.held_bytes / GB);
        else if (w->f.mem_avail < w->f.mem_total / 20)
            SAY("%s has %.1f GB of its %.0f GB memory available: little room left for the page cache", w->id,
                (double)w->f.mem_avail / GB, (double)w->f.mem_total / GB);
        if (w->f.disk_total && w->f.disk_free < w->f.disk_total / 20)
            SAY("%s: %.1f GB free of %.0f GB on the model's disk", w->id, (double)w->f.disk_free / GB,
                (double)w->f.disk_total / GB);
        if (!strcmp(w->f.isa, "scalar"))
            SAY("%s runs the scalar kernels (no AVX2): expect it to be several times slower", w->id);
        if (strcmp(w->f.version, SHOAL_VERSION))
            SAY("%s runs shoal %s, this coordinator %s", w->id, w->f.version, SHOAL_VERSION);
    }
    { /* shared hardware: several workers reading much slower together than alone */
        char names[256] = "";
        int k = 0;
        double a = 0, t = 0;
        for (int i = 0; i < n; i++)
            if (r[i].ok && r[i].f.has && r[i].bw_together > 0 && r[i].bw_together < 0.7 * (double)r[i].f.read_bw_all) {
                size_t at = strlen(names);
                snprintf(names + at, sizeof names - at, "%s%s", k ? ", " : "", r[i].id);
                a += (double)r[i].f.read_bw_all;
                t += r[i].bw_together;
                k++;
            }
        if (k >= 2)
            SAY("%s read %.1f GB/s each on average when measured at the same time, %.1f GB/s alone: they share "
                "memory bandwidth (VMs on one physical host?); plan --measured uses the figures measured together",
                names, t / k / GB, a / k / GB);
    }
    if (local && local->has && local->mem_avail < local->mem_total / 20)
        SAY("this host has %.1f GB of its %.0f GB memory available", (double)local->mem_avail / GB,
            (double)local->mem_total / GB);
#undef SAY
}

int shoal_cmd_doctor(int argc, char **argv)
{
    const char *model = NULL, *out = NULL, *cluster = NULL;
    shoal_plan_cluster cm = {0};
    char (*ckeys)[4096] = NULL;
    int json = 0, rounds = 200, bulk_count = 24, no_facts = 0, no_local = 0;
    long bulk_bytes = 1 << 20, fwd_bytes = 0;
    shoal_dist_opts d = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--model") && v) {
            model = v;
            i++;
        } else if (!strcmp(a, "-o") && v) {
            out = v;
            i++;
        } else if (!strcmp(a, "--cluster") && v) {
            cluster = v;
            i++;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--numerics")) {
            shoal_numerics nc;
            if (shoal_numerics_parse(v, &nc)) {
                fprintf(stderr, "shoal doctor: --numerics takes portable or mu, not '%s'\n", v ? v : "");
                return 2;
            }
            shoal_kernels_set_numerics(nc);
            i++;
        } else if (!strcmp(a, "--no-facts")) {
            no_facts = 1;
        } else if (!strcmp(a, "--no-local")) {
            no_local = 1;
        } else if ((!strcmp(a, "--rounds") || !strcmp(a, "--bulk-count") || !strcmp(a, "--bulk-bytes") ||
                    !strcmp(a, "--fwd-bytes")) &&
                   v) {
            char *end;
            long x = strtol(v, &end, 10);
            long hi = a[2] == 'r' || !strcmp(a, "--bulk-count") ? 100000 : (long)SHOAL_PROTO_MAX_PROBE;
            if (*end || end == v || x < 1 || x > hi) {
                fprintf(stderr, "shoal doctor: bad value for %s: '%s' (1 to %ld)\n", a, v, hi);
                return 2;
            }
            if (a[2] == 'r')
                rounds = (int)x;
            else if (!strcmp(a, "--bulk-count"))
                bulk_count = (int)x;
            else if (!strcmp(a, "--bulk-bytes"))
                bulk_bytes = x;
            else
                fwd_bytes = x;
            i++;
        } else if ((r = shoal_dist_parse_arg(&d, "shoal doctor", argc, argv, &i)) != 0) {
            if (r < 0)
                return 2;
        } else {
            fprintf(stderr, "shoal doctor: unknown or incomplete option '%s'\n", a);
            usage(stderr);
            return 2;
        }
    }
    char err[2048];
    if (cluster) { /* the manifest's worker hosts, at tcp://address:port; keys from --curve-keys DIR/NAME.pub */
        if (shoal_dist_enabled(&d)) {
            fprintf(stderr, "shoal doctor: --cluster excludes --plan, --worker and --workers\n");
            return 2;
        }
        int rc0 = shoal_plan_cluster_read(&cm, cluster, err, sizeof err);
        if (rc0) {
            fprintf(stderr, "shoal doctor: %s\n", err);
            return 3;
        }
        ckeys = shoal_xcalloc((size_t)cm.nhosts + 1, sizeof *ckeys);
        static char eps[SHOAL_EXPERT_CLIENT_MAX_WORKERS][320];
        for (int h = 0; h < cm.nhosts && d.nworker < SHOAL_EXPERT_CLIENT_MAX_WORKERS; h++) {
            const shoal_plan_host *ho = &cm.hosts[h];
            if (!ho->expert_ram)
                continue;
            snprintf(eps[d.nworker], sizeof eps[0], strchr(ho->address, ':') ? "tcp://[%s]:%d" : "tcp://%s:%d",
                     ho->address, ho->port);
            if (d.curve_keys) {
                snprintf(ckeys[d.nworker], sizeof ckeys[0], "%s/%s.pub", d.curve_keys, ho->name);
                d.worker_key[d.nworker_key++] = ckeys[d.nworker];
            }
            d.worker[d.nworker] = eps[d.nworker];
            d.nworker++;
        }
        d.curve_keys = NULL;
    }
    if (!model || shoal_dist_enabled(&d) != 1) {
        fprintf(stderr, "shoal doctor: give --model DIR and one of --cluster, --plan, --worker, --workers\n");
        usage(stderr);
        free(ckeys);
        shoal_plan_cluster_free(&cm);
        return 2;
    }
    shoal_model_opts mo = {.max_context = 8, .max_batch = 1, .threads = 1, .quiet = 1, .remote_experts = 1};
    shoal_model *m = NULL;
    int rc = shoal_model_open(&m, model, &mo, err, sizeof err);
    if (rc) {
        fprintf(stderr, "shoal doctor: %s: %s\n%s\n", model, shoal_strerror(rc), err);
        free(ckeys);
        shoal_plan_cluster_free(&cm);
        return 3;
    }
    shoal_dist *dist = NULL;
    if ((rc = shoal_dist_start(&dist, &d, model, m, err, sizeof err))) {
        fprintf(stderr, "shoal doctor: expert workers: %s: %s\n", shoal_strerror(rc), err);
        shoal_model_close(m);
        free(ckeys);
        shoal_plan_cluster_free(&cm);
        return shoal_err_exit_code(rc);
    }
    shoal_model_info info;
    shoal_model_get_info(m, &info);
    /* out: an input row (bf16 in the mu class, PROTOCOL.md 1.7); back: an f32 output row */
    long fwd_out_bytes = fwd_bytes ? fwd_bytes
                                   : (long)info.cfg->hidden_size *
                                         (shoal_kernels_numerics() == SHOAL_NUMERICS_MU ? 2 : 4);
    if (!fwd_bytes)
        fwd_bytes = (long)info.cfg->hidden_size * 4;
    shoal_expert_client *c = shoal_dist_client(dist);
    int n = shoal_dist_nworkers(dist);
    wres *r = shoal_xcalloc((size_t)n, sizeof *r);
    double *rtt = shoal_xcalloc((size_t)(rounds > bulk_count ? rounds : bulk_count) + 1, sizeof *rtt);
    for (int i = 0; i < n; i++) {
        wres *w = &r[i];
        w->name = shoal_dist_worker_name(dist, i); /* "id (endpoint)": the id alone in the table */
        const char *paren = strstr(w->name, " (");
        snprintf(w->id, sizeof w->id, "%.*s", paren ? (int)(paren - w->name) : (int)strlen(w->name), w->name);
        shoal_probe_result pr;
        memset(&pr, 0, sizeof pr);
        /* host facts, and a warm-up of the path at once */
        shoal_probe_opts po = {.out_bytes = 4, .in_bytes = 4, .count = 20, .window = 1, .facts = !no_facts,
                               .timeout_ms = 60000};
        rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err);
        w->f = pr.facts;
        /* RTT of empty exchanges, one at a time */
        if (!rc) {
            po = (shoal_probe_opts){.out_bytes = 4, .in_bytes = 4, .count = rounds, .window = 1, .timeout_ms = 60000};
            pr.rtt_us = rtt;
            if (!(rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err))) {
                qsort(rtt, (size_t)rounds, sizeof *rtt, cmp_d);
                w->rtt_p50_us = pct(rtt, rounds, 0.5);
                w->rtt_p99_us = pct(rtt, rounds, 0.99);
            }
        }
        /* the forward's message size, one at a time, each way: the median time */
        int fr = rounds < 50 ? rounds : 50;
        if (!rc) {
            po = (shoal_probe_opts){.out_bytes = (size_t)fwd_out_bytes, .in_bytes = 4, .count = fr, .window = 1,
                                    .timeout_ms = 60000};
            if (!(rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err)))
                w->fwd_out_us = median(rtt, fr);
        }
        if (!rc) {
            po = (shoal_probe_opts){.out_bytes = 4, .in_bytes = (uint32_t)fwd_bytes, .count = fr, .window = 1,
                                    .timeout_ms = 60000};
            if (!(rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err)))
                w->fwd_in_us = median(rtt, fr);
        }
        /* link rate each way: bulk messages, 4 in flight */
        if (!rc) {
            po = (shoal_probe_opts){.out_bytes = (size_t)bulk_bytes, .in_bytes = 4, .count = bulk_count, .window = 4,
                                    .timeout_ms = 120000};
            if (!(rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err)))
                w->out_Bps = (double)bulk_bytes * bulk_count / pr.total_s;
        }
        if (!rc) {
            po = (shoal_probe_opts){.out_bytes = 4, .in_bytes = (uint32_t)bulk_bytes, .count = bulk_count, .window = 4,
                                    .timeout_ms = 120000};
            if (!(rc = shoal_probe_run(c, i, &po, &pr, w->err, sizeof w->err)))
                w->in_Bps = (double)bulk_bytes * bulk_count / pr.total_s;
        }
        w->ok = rc == 0;
        if (!json)
            fprintf(stderr, "doctor: %s %s\n", w->name, w->ok ? "measured" : w->err);
    }
    free(rtt);
    /* the host facts again, every worker at the same time: hosts that share a memory bus or
     * a disk (VMs on one machine) read slower together than alone */
    if (!no_facts && n >= 2) {
        shoal_proto_facts *ft = shoal_xcalloc((size_t)n, sizeof *ft);
        int *okt = shoal_xcalloc((size_t)n, sizeof *okt);
        char e3[512];
        shoal_probe_facts_together(c, ft, okt, 120000, e3, sizeof e3);
        for (int i = 0; i < n; i++)
            if (okt[i] && r[i].ok) {
                r[i].bw_together = (double)ft[i].read_bw_all;
                r[i].disk_together = (double)ft[i].disk_read_bw;
            }
        free(ft);
        free(okt);
    }
    /* what the manifest or the plan gives each worker, by its id */
    json_t *pj = d.plan ? json_load_file(d.plan, 0, NULL) : NULL;
    for (int i = 0; i < n; i++) {
        for (int h = 0; h < cm.nhosts; h++)
            if (cm.hosts[h].expert_ram && !strcmp(cm.hosts[h].name, r[i].id)) {
                r[i].need = (double)cm.hosts[h].expert_ram;
                r[i].need_from = "the manifest";
            }
        size_t k;
        json_t *x;
        json_array_foreach(json_object_get(pj, "workers"), k, x)
        {
            const char *nm = json_string_value(json_object_get(x, "name"));
            if (nm && !strcmp(nm, r[i].id)) {
                r[i].need = json_number_value(json_object_get(x, "bytes")) +
                            json_number_value(json_object_get(x, "trunk_bytes"));
                r[i].need_from = "the plan";
            }
        }
    }
    json_decref(pj);
    shoal_proto_facts local;
    memset(&local, 0, sizeof local);
    if (!no_local) {
        int nt = omp_get_max_threads();
        shoal_hostfacts_measure(&local, model, nt);
        snprintf(local.isa, sizeof local.isa, "%s", shoal_isa_name(shoal_kernels_isa()));
        local.threads = (uint32_t)nt;
    }
    /* the report */
    json_t *root = json_object(), *jw = json_array(), *jf = json_array();
    json_object_set_new(root, "format", json_string("shoal-doctor"));
    json_object_set_new(root, "version", json_integer(1));
    json_object_set_new(root, "shoal", json_string(SHOAL_VERSION));
    /* the class the workers were measured in (--numerics): `shoal plan
     * --measured` predicts the wire bytes of that class (PROTOCOL.md 1.7) */
    json_object_set_new(root, "numerics", json_string(shoal_numerics_name(shoal_kernels_numerics())));
    { /* the model every worker's HELLO matched (PROTOCOL.md §5; a pack carries the full model's) */
        uint8_t fp[SHOAL_PROTO_FP_BYTES];
        char hex[2 * SHOAL_PROTO_FP_BYTES + 1], e2[256];
        shoal_packfile pk;
        int frc;
        if (shoal_packfile_is_pack(model)) {
            frc = shoal_packfile_read(&pk, model, e2, sizeof e2);
            if (!frc)
                memcpy(fp, pk.fingerprint, SHOAL_PROTO_FP_BYTES);
            shoal_packfile_free(&pk);
        } else {
            frc = shoal_fprint_model(fp, info.cfg, shoal_model_store(m), e2, sizeof e2);
        }
        if (!frc) {
            shoal_proto_hex(fp, hex);
            json_object_set_new(root, "model_fingerprint", json_string(hex));
            if (!json)
                printf("model fingerprint %.16s... (every worker's HELLO matched it)\n", hex);
        }
    }
    json_object_set_new(root, "fwd_bytes", json_integer(fwd_bytes));
    json_object_set_new(root, "fwd_out_bytes", json_integer(fwd_out_bytes));
    json_object_set_new(root, "bulk_bytes", json_integer(bulk_bytes));
    json_object_set_new(root, "rounds", json_integer(rounds));
    if (local.has)
        json_object_set_new(root, "coordinator", facts_json(&local));
    for (int i = 0; i < n; i++) {
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(r[i].id));
        json_object_set_new(o, "link", json_string(r[i].name));
        json_object_set_new(o, "ok", json_boolean(r[i].ok));
        if (!r[i].ok)
            json_object_set_new(o, "error", json_string(r[i].err));
        if (r[i].f.has)
            json_object_set_new(o, "host", facts_json(&r[i].f));
        json_object_set_new(o, "rtt_p50_us", json_real(r[i].rtt_p50_us));
        json_object_set_new(o, "rtt_p99_us", json_real(r[i].rtt_p99_us));
        json_object_set_new(o, "out_bytes_per_s", json_real(r[i].out_Bps));
        json_object_set_new(o, "in_bytes_per_s", json_real(r[i].in_Bps));
        json_object_set_new(o, "fwd_out_us", json_real(r[i].fwd_out_us));
        json_object_set_new(o, "fwd_in_us", json_real(r[i].fwd_in_us));
        if (r[i].need > 0)
            json_object_set_new(o, "given_bytes", json_real(r[i].need));
        if (r[i].bw_together > 0) {
            json_object_set_new(o, "read_bw_all_together", json_real(r[i].bw_together));
            json_object_set_new(o, "disk_read_bw_together", json_real(r[i].disk_together));
        }
        json_array_append_new(jw, o);
    }
    json_object_set_new(root, "workers", jw);
    findings(r, n, &local, jf);
    json_object_set_new(root, "findings", jf);
    int status = 0;
    if (out && json_dump_file(root, out, JSON_INDENT(1) | JSON_SORT_KEYS)) {
        fprintf(stderr, "shoal doctor: cannot write %s\n", out);
        status = 1;
    }
    if (json) {
        json_dumpf(root, stdout, JSON_INDENT(1) | JSON_SORT_KEYS);
        printf("\n");
    } else {
        /* the worst value of each column is marked with '*' */
        int wr = -1, wo = -1, wi = -1, wb = -1, wd = -1;
        for (int i = 0; i < n; i++) {
            if (!r[i].ok)
                continue;
            if (wr < 0 || r[i].rtt_p50_us > r[wr].rtt_p50_us)
                wr = i;
            if (wo < 0 || r[i].out_Bps < r[wo].out_Bps)
                wo = i;
            if (wi < 0 || r[i].in_Bps < r[wi].in_Bps)
                wi = i;
            if (r[i].f.has && (wb < 0 || r[i].f.read_bw_all < r[wb].f.read_bw_all))
                wb = i;
            if (r[i].f.has && (wd < 0 || r[i].f.disk_read_bw < r[wd].f.disk_read_bw))
                wd = i;
        }
        if (n < 2)
            wr = wo = wi = wb = wd = -1;
        printf("%-12s %-6s %5s %7s %7s %7s %6s %7s %8s %7s %7s %6s %8s %8s %8s %8s\n", "worker", "isa", "cores",
               "mem GB", "avail", "held GB", "rd1", "rd GB/s", "together", "disk MB/s", "free GB", "rtt ms", "p99 ms", "out MB/s",
               "in MB/s", "fwd ms");
        for (int i = 0; i < n; i++) {
            const wres *w = &r[i];
            if (!w->ok) {
                printf("%-12.12s not measured: %s\n", w->id, w->err);
                continue;
            }
            printf("%-12.12s %-6s %5u %7.1f %7.1f %7.2f %6.1f %6.1f%c %8.1f %8.0f%c %7.1f %5.2f%c %8.2f %7.0f%c %7.0f%c "
                   "%4.2f/%4.2f\n",
                   w->id, w->f.has ? w->f.isa : "?", w->f.cores, (double)w->f.mem_total / GB,
                   (double)w->f.mem_avail / GB, (double)w->f.held_bytes / GB, (double)w->f.read_bw_1 / GB,
                   (double)w->f.read_bw_all / GB, i == wb ? '*' : ' ', w->bw_together / GB,
                   (double)w->f.disk_read_bw / MB,
                   i == wd ? '*' : ' ', (double)w->f.disk_free / GB, w->rtt_p50_us / 1e3, i == wr ? '*' : ' ',
                   w->rtt_p99_us / 1e3, w->out_Bps / MB, i == wo ? '*' : ' ', w->in_Bps / MB, i == wi ? '*' : ' ',
                   w->fwd_out_us / 1e3, w->fwd_in_us / 1e3);
        }
        if (n && r[0].f.has)
            printf("cpu: %s (worker %s)\n", r[0].f.cpu, r[0].id);
        if (local.has)
            printf("this host: %s, %u cores, %.1f GB memory (%.1f available), read %.1f GB/s (1 thread %.1f)\n",
                   local.cpu, local.cores, (double)local.mem_total / GB, (double)local.mem_avail / GB,
                   (double)local.read_bw_all / GB, (double)local.read_bw_1 / GB);
        printf("fwd ms: one message out (%ld bytes: an input row) / back (%ld bytes: an output row); * marks the "
               "worst\n",
               fwd_out_bytes, fwd_bytes);
        size_t k;
        json_t *s;
        if (json_array_size(jf) == 0)
            printf("findings: none: the workers and links are alike\n");
        json_array_foreach(jf, k, s) printf("- %s\n", json_string_value(s));
    }
    json_decref(root);
    free(r);
    shoal_model_close(m);
    shoal_dist_stop(dist);
    free(ckeys);
    shoal_plan_cluster_free(&cm);
    return status;
}
