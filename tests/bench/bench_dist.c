/* bench_dist: the per-layer exchange cost of the distributed experts against a
 * raw ZeroMQ round trip carrying the same bytes over the same transport,
 * measured in the same run (docs/PERFORMANCE.md, issue 7).
 *
 * It writes a synthetic model (DIR/config.json from tests/models/tiny-k3 with
 * the routed-expert geometry replaced, DIR/model.safetensors with only the
 * routed experts, MXFP4, random), starts N `shoal expert` processes splitting
 * the experts evenly and N raw echo processes, then for each repetition draws a
 * routing (T tokens x k distinct experts) and times, in alternating order:
 *   exchange: submit() -> gather() of the expert client (packing, the I/O
 *             thread hand-off, EXPERT_BATCH to every involved worker, the
 *             workers' decode/validate/compute/encode, the reply checks and
 *             the scatter into y);
 *   raw:      DEALER -> ROUTER round trips to the echo processes sending frames
 *             of exactly the request's sizes and answering frames of exactly
 *             the reply's sizes (zmq_send / zmq_recv, nothing else).
 * The workers' own queue + compute time (reported in every EXPERT_RESULT) is
 * subtracted from the exchange ("net"), so the comparison is of the protocol
 * and client against the bare transport. Expert width is the smallest legal
 * (32) to keep compute small; the bytes on the wire are those of the real
 * latent width.
 *
 * With --skip-compute the workers run with --bench-skip-compute: everything
 * but the expert FFNs (outputs zero), so the exchange is compared with the raw
 * round trip without the noise of the compute.
 *
 * Usage: bench_dist SHOAL_BIN WORKDIR [--transport ipc|tcp] [--workers N]
 *        [--reps R] [--tokens T] [--latent D] [--experts E] [--k K] [--skip-compute]
 * Prints one line per repetition and a summary (median, p10, p90), with the
 * exchange split by the client's own clocks: submit() (packing and sending)
 * and the slowest involved worker's round trip to its reply's arrival. */
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "common/st.h"
#include "coordinator/cluster/expert_client.h"
#include "proto/fprint.h"
#include "proto/shard.h"

#define MAXW 16

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    qsort(v, (size_t)n, sizeof *v, cmpd);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

/* ---- the synthetic model ------------------------------------------------- */

static int write_model(const char *dir, int latent, int experts, int k, shoal_k3cfg *cfg)
{
    char path[4096], err[2048];
    const char *src = getenv("SHOAL_SRC");
    snprintf(path, sizeof path, "%s/tests/models/tiny-k3/config.json", src ? src : ".");
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    if (!c) {
        fprintf(stderr, "bench_dist: %s: %s (set SHOAL_SRC)\n", path, je.text);
        return -1;
    }
    json_t *t = json_object_get(c, "text_config");
    json_object_set_new(t, "routed_expert_hidden_size", json_integer(latent));
    json_object_set_new(t, "moe_intermediate_size", json_integer(32));
    json_object_set_new(t, "num_experts", json_integer(experts));
    json_object_set_new(t, "num_experts_per_token", json_integer(k));
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (json_dump_file(c, path, JSON_INDENT(1))) {
        fprintf(stderr, "bench_dist: cannot write %s\n", path);
        return -1;
    }
    json_decref(c);
    if (shoal_k3cfg_load(cfg, path, err, sizeof err)) {
        fprintf(stderr, "bench_dist: %s\n", err);
        return -1;
    }
    /* header: every routed expert tensor, back to back */
    json_t *h = json_object();
    uint64_t off = 0;
    for (int l = 0; l < cfg->num_layers; l++) {
        if (!cfg->is_moe[l])
            continue;
        for (int e = 0; e < cfg->num_experts; e++) {
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(cfg, l, e, ent);
            for (int i = 0; i < n; i++) {
                uint64_t nb = shoal_k3schema_nbytes(&ent[i]);
                json_t *o = json_object();
                json_object_set_new(o, "dtype", json_string(shoal_dtype_name(ent[i].dtype)));
                json_t *sh = json_array();
                for (int d = 0; d < ent[i].ndim; d++)
                    json_array_append_new(sh, json_integer(ent[i].shape[d]));
                json_object_set_new(o, "shape", sh);
                json_t *of = json_array();
                json_array_append_new(of, json_integer((json_int_t)off));
                json_array_append_new(of, json_integer((json_int_t)(off + nb)));
                json_object_set_new(o, "data_offsets", of);
                json_object_set_new(h, ent[i].name, o);
                off += nb;
            }
        }
    }
    char *hs = json_dumps(h, JSON_COMPACT);
    json_decref(h);
    size_t hl = strlen(hs), padded = (hl + 7) & ~(size_t)7;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "bench_dist: %s: %s\n", path, strerror(errno));
        return -1;
    }
    uint64_t le = padded;
    fwrite(&le, 8, 1, f);
    fwrite(hs, 1, hl, f);
    for (size_t i = hl; i < padded; i++)
        fputc(' ', f);
    free(hs);
    /* weights: random nibbles; scale bytes 118..125 (values ~ 2^-9..2^-2) */
    uint8_t buf[65536];
    for (uint64_t done = 0; done < off;) {
        size_t n = off - done < sizeof buf ? (size_t)(off - done) : sizeof buf;
        for (size_t i = 0; i < n; i++)
            buf[i] = (uint8_t)rnd();
        fwrite(buf, 1, n, f);
        done += n;
    }
    fclose(f);
    return 0;
}

/* Scale tensors must hold sane exponents: rewrite them (after the random fill). */
static int fix_scales(const char *dir, const shoal_k3cfg *cfg)
{
    char err[1024];
    shoal_st *st;
    shoal_st_opts so = {.map = 0};
    if (shoal_st_open(&st, dir, &so, err, sizeof err)) {
        fprintf(stderr, "bench_dist: %s\n", err);
        return -1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    for (int l = 0; l < cfg->num_layers && f; l++)
        for (int e = 0; cfg->is_moe[l] && e < cfg->num_experts; e++) {
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(cfg, l, e, ent);
            for (int i = 0; i < n; i++) {
                if (!strstr(ent[i].name, "weight_scale"))
                    continue;
                const shoal_tensor *t = shoal_st_find(st, ent[i].name);
                uint8_t *b = malloc(t->nbytes);
                for (uint64_t j = 0; j < t->nbytes; j++)
                    b[j] = (uint8_t)(118 + rnd() % 8);
                fseek(f, (long)t->file_offset, SEEK_SET);
                fwrite(b, 1, t->nbytes, f);
                free(b);
            }
        }
    if (f)
        fclose(f);
    shoal_st_close(st);
    return f ? 0 : -1;
}

/* ---- processes ----------------------------------------------------------- */

static pid_t spawn_worker(const char *bin, const char *dir, const char *ranges, const char *ep, const char *id,
                          int skip)
{
    pid_t p = fork();
    if (p == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        /* plain TCP (--insecure): the benchmark measures the exchange without CURVE */
        const char *plain = strncmp(ep, "tcp://", 6) ? NULL : "--insecure";
        if (plain)
            execl(bin, bin, "expert", "--model", dir, "--experts", ranges, "--listen", ep, "--id", id, "--threads",
                  "1", "--max-tokens", "256", plain, skip ? "--bench-skip-compute" : (char *)NULL, (char *)NULL);
        else
            execl(bin, bin, "expert", "--model", dir, "--experts", ranges, "--listen", ep, "--id", id, "--threads",
                  "1", "--max-tokens", "256", skip ? "--bench-skip-compute" : (char *)NULL, (char *)NULL);
        _exit(127);
    }
    return p;
}

/* A raw echo server: for [id, ctl, act, route] answer [id, 36 bytes, 16 + n*latent*2 bytes]. */
static void raw_server(const char *ep, int latent)
{
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(s, ep)) {
        fprintf(stderr, "raw server: bind %s: %s\n", ep, zmq_strerror(errno));
        _exit(1);
    }
    size_t cap = 16 + (size_t)256 * 64 * (size_t)latent * 2;
    uint8_t *y = calloc(1, cap), ctl[36] = {0};
    for (;;) {
        zmq_msg_t parts[8];
        int np = 0, more = 1;
        while (more && np < 8) {
            zmq_msg_init(&parts[np]);
            if (zmq_msg_recv(&parts[np], s, 0) < 0)
                _exit(1);
            more = zmq_msg_more(&parts[np]);
            np++;
        }
        if (np == 2) /* quit */
            break;
        size_t n = np == 4 ? (zmq_msg_size(&parts[3]) - 16) / 8 : 1;
        zmq_send(s, zmq_msg_data(&parts[0]), zmq_msg_size(&parts[0]), ZMQ_SNDMORE);
        zmq_send(s, ctl, sizeof ctl, ZMQ_SNDMORE);
        zmq_send(s, y, 16 + n * (size_t)latent * 2, 0);
        for (int i = 0; i < np; i++)
            zmq_msg_close(&parts[i]);
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    _exit(0);
}

static void tcp_ep(char *ep, size_t n)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    bind(fd, (struct sockaddr *)&a, sizeof a);
    getsockname(fd, (struct sockaddr *)&a, &al);
    close(fd);
    snprintf(ep, n, "tcp://127.0.0.1:%d", ntohs(a.sin_port));
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: bench_dist SHOAL_BIN WORKDIR [--transport ipc|tcp] [--workers N] [--reps R] "
                        "[--tokens T] [--latent D] [--experts E] [--k K]\n");
        return 2;
    }
    const char *bin = argv[1], *dir = argv[2], *transport = "ipc";
    int nw = 1, reps = 200, T = 1, latent = 3584, experts = 64, k = 16, skip = 0;
    for (int i = 3; i < argc; i += 2) {
        if (!strcmp(argv[i], "--skip-compute")) {
            skip = 1;
            i--;
            continue;
        }
        if (i + 1 >= argc)
            break;
        if (!strcmp(argv[i], "--transport"))
            transport = argv[i + 1];
        else if (!strcmp(argv[i], "--workers"))
            nw = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--tokens"))
            T = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--latent"))
            latent = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--experts"))
            experts = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--k"))
            k = atoi(argv[i + 1]);
    }
    if (nw < 1 || nw > MAXW || T < 1 || T > 256 || reps < 1 || k > experts) {
        fprintf(stderr, "bench_dist: bad arguments\n");
        return 2;
    }
    shoal_log_set_level(SHOAL_LOG_WARN);
    shoal_k3cfg cfg;
    if (write_model(dir, latent, experts, k, &cfg) || fix_scales(dir, &cfg))
        return 1;
    /* raw echo servers first: fork before this process creates any ZeroMQ context */
    char wep[MAXW][128], rep_[MAXW][128], id[MAXW][16];
    pid_t wpid[MAXW], rpid[MAXW];
    for (int i = 0; i < nw; i++) {
        if (!strcmp(transport, "tcp")) {
            tcp_ep(wep[i], sizeof wep[i]);
            tcp_ep(rep_[i], sizeof rep_[i]);
        } else {
            snprintf(wep[i], sizeof wep[i], "ipc://@bench-dist-%d-w%d", (int)getpid(), i);
            snprintf(rep_[i], sizeof rep_[i], "ipc://@bench-dist-%d-raw%d", (int)getpid(), i);
        }
        rpid[i] = fork();
        if (rpid[i] == 0)
            raw_server(rep_[i], latent);
    }
    char err[4096];
    for (int i = 0; i < nw; i++) {
        shoal_proto_range *r;
        size_t nr;
        char ranges[4096];
        shoal_shard_split(i, nw, cfg.num_layers, cfg.is_moe, cfg.num_experts, &r, &nr, err, sizeof err);
        shoal_shard_format(r, nr, ranges, sizeof ranges);
        free(r);
        snprintf(id[i], sizeof id[i], "w%d", i);
        wpid[i] = spawn_worker(bin, dir, ranges, wep[i], id[i], skip);
    }
    shoal_st *st;
    shoal_st_opts so = {.map = 0};
    uint8_t fp[SHOAL_PROTO_FP_BYTES];
    if (shoal_st_open(&st, dir, &so, err, sizeof err) || shoal_fprint_model(fp, &cfg, st, err, sizeof err)) {
        fprintf(stderr, "bench_dist: %s\n", err);
        return 1;
    }
    const char *eps[MAXW];
    for (int i = 0; i < nw; i++)
        eps[i] = wep[i];
    shoal_expert_client_opts co = {.endpoints = eps, .nworkers = nw, .cfg = &cfg, .fingerprint = fp,
                                   .max_tokens = T, .timeout_ms = 30000, .hello_timeout_ms = 60000};
    shoal_expert_client *c;
    if (shoal_expert_client_open(&c, &co, err, sizeof err)) {
        fprintf(stderr, "bench_dist: %s\n", err);
        return 1;
    }
    shoal_experts b = shoal_expert_client_backend(c);
    void *zctx = zmq_ctx_new(), *rs[MAXW];
    for (int i = 0; i < nw; i++) {
        rs[i] = zmq_socket(zctx, ZMQ_DEALER);
        int zero = 0;
        zmq_setsockopt(rs[i], ZMQ_LINGER, &zero, sizeof zero);
        zmq_connect(rs[i], rep_[i]);
    }
    /* ownership of the even split, to size the raw frames like the real ones */
    int *owner = malloc(sizeof(int) * (size_t)experts);
    for (int e = 0; e < experts; e++)
        for (int w = 0; w < nw; w++)
            if ((int64_t)w * experts / nw <= e && e < (int64_t)(w + 1) * experts / nw)
                owner[e] = w;
    int layer = -1;
    for (int l = 0; l < cfg.num_layers && layer < 0; l++)
        if (cfg.is_moe[l])
            layer = l;
    float *z = malloc(sizeof(float) * (size_t)T * latent);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T * k);
    uint16_t *y = malloc(2 * (size_t)T * k * latent);
    uint8_t *rawbuf = calloc(1, 16 + (size_t)T * latent * 4 + 16 + (size_t)T * k * 8 + 64);
    for (int i = 0; i < T * latent; i++)
        z[i] = (float)((int)(rnd() % 2001) - 1000) / 500.0f;
    double *xg = malloc(sizeof(double) * (size_t)reps), *xn = malloc(sizeof(double) * (size_t)reps),
           *rw = malloc(sizeof(double) * (size_t)reps), *pr = malloc(sizeof(double) * (size_t)reps),
           *sp_sub = malloc(sizeof(double) * (size_t)reps), *sp_rtt = malloc(sizeof(double) * (size_t)reps);
    uint64_t bytes_out = 0, bytes_in = 0;
    int warm = 20;
    printf("# rep exchange_us worker_proc_us net_us raw_us\n");
    for (int r = -warm; r < reps; r++) {
        /* routing: T tokens x k distinct ascending experts */
        int ntok[MAXW] = {0}, npair[MAXW] = {0};
        for (int t = 0; t < T; t++) {
            char used[4096] = {0};
            int touched[MAXW] = {0};
            for (int s = 0; s < k;) {
                int e = (int)(rnd() % (uint32_t)experts);
                if (!used[e]) {
                    used[e] = 1;
                    s++;
                }
            }
            for (int e = 0, s = 0; e < experts; e++)
                if (used[e]) {
                    ids[t * k + s++] = e;
                    npair[owner[e]]++;
                    touched[owner[e]] = 1;
                }
            for (int w = 0; w < nw; w++)
                ntok[w] += touched[w];
        }
        double xt = 0, rt = 0, proc = 0, st_submit = 0, st_rtt = 0;
        for (int order = 0; order < 2; order++) {
            if ((order == 0) == (r % 2 == 0)) {
                shoal_expert_client_stats s0, s1;
                shoal_expert_client_get_stats(c, &s0);
                double t0 = now_us();
                int src = b.vt->submit(b.self, layer, T, k, z, ids, err, sizeof err);
                double t1 = now_us();
                if (src || b.vt->gather(b.self, y, err, sizeof err)) {
                    fprintf(stderr, "bench_dist: %s\n", err);
                    return 1;
                }
                xt = now_us() - t0;
                st_submit = t1 - t0;
                shoal_expert_client_get_stats(c, &s1);
                if (r >= 0) {
                    bytes_out += s1.bytes_out - s0.bytes_out;
                    bytes_in += s1.bytes_in - s0.bytes_in;
                }
                proc = 0;
                st_rtt = 0;
                for (int w = 0; w < nw; w++) {
                    uint64_t q, cu, rtt;
                    if (shoal_expert_client_last(c, w, &q, &cu, &rtt)) {
                        if ((double)(q + cu) > proc)
                            proc = (double)(q + cu);
                        if ((double)rtt * 1e-3 > st_rtt)
                            st_rtt = (double)rtt * 1e-3;
                    }
                }
            } else {
                double t0 = now_us();
                for (int w = 0; w < nw; w++) {
                    if (!npair[w])
                        continue;
                    uint8_t ctl[64];
                    size_t cl;
                    shoal_proto_enc_batch(ctl, sizeof ctl, &cl, (uint64_t)(r + 1000) * MAXW + (uint64_t)w, (uint32_t)layer,
                                          SHOAL_WIRE_BF16); /* the same control bytes as the real request */
                    zmq_send(rs[w], ctl, cl, ZMQ_SNDMORE);
                    zmq_send(rs[w], rawbuf, 16 + (size_t)ntok[w] * latent * 4, ZMQ_SNDMORE);
                    zmq_send(rs[w], rawbuf, 16 + (size_t)npair[w] * 8, 0);
                }
                for (int w = 0; w < nw; w++) {
                    if (!npair[w])
                        continue;
                    for (int more = 1; more;) {
                        zmq_msg_t m;
                        zmq_msg_init(&m);
                        zmq_msg_recv(&m, rs[w], 0);
                        more = zmq_msg_more(&m);
                        zmq_msg_close(&m);
                    }
                }
                rt = now_us() - t0;
            }
        }
        if (r < 0)
            continue;
        xg[r] = xt;
        sp_sub[r] = st_submit;
        sp_rtt[r] = st_rtt;
        pr[r] = proc;
        xn[r] = xt - proc;
        rw[r] = rt;
        printf("%d %.1f %.1f %.1f %.1f\n", r, xt, proc, xt - proc, rt);
    }
    double mean_xn = 0, mean_rw = 0;
    for (int r = 0; r < reps; r++) {
        mean_xn += xn[r] / reps;
        mean_rw += rw[r] / reps;
    }
    double xg50 = pct(xg, reps, 0.5), pr50 = pct(pr, reps, 0.5);
    double xn10 = pct(xn, reps, 0.1), xn50 = pct(xn, reps, 0.5), xn90 = pct(xn, reps, 0.9);
    double rw10 = pct(rw, reps, 0.1), rw50 = pct(rw, reps, 0.5), rw90 = pct(rw, reps, 0.9);
    printf("# summary transport=%s workers=%d tokens=%d k=%d latent=%d experts=%d reps=%d compute=%s\n", transport, nw,
           T, k, latent, experts, reps, skip ? "skipped" : "expert width 32");
    printf("# bytes per layer: out %.0f in %.0f (all frames, all workers)\n", (double)bytes_out / reps,
           (double)bytes_in / reps);
    printf("# exchange median %.1f us (worker queue+compute median %.1f us)\n", xg50, pr50);
    printf("# net exchange us: p10 %.1f median %.1f p90 %.1f mean %.1f\n", xn10, xn50, xn90, mean_xn);
    printf("# raw round trip us: p10 %.1f median %.1f p90 %.1f mean %.1f\n", rw10, rw50, rw90, mean_rw);
    printf("# ratio net/raw: median %.3f mean %.3f\n", xn50 / rw50, mean_xn / mean_rw);
    /* where the exchange goes, from the client's own clocks: submit() (packing and
     * sending), the slowest worker's round trip (first byte sent to its reply's
     * arrival, the worker's queue + compute included) */
    printf("# split us: submit p10 %.1f median %.1f; slowest round trip p10 %.1f median %.1f\n",
           pct(sp_sub, reps, 0.1), pct(sp_sub, reps, 0.5), pct(sp_rtt, reps, 0.1), pct(sp_rtt, reps, 0.5));
    /* stop */
    for (int w = 0; w < nw; w++) {
        zmq_send(rs[w], "q", 1, 0);
        zmq_close(rs[w]);
    }
    shoal_expert_client_close(c);
    zmq_ctx_term(zctx);
    for (int w = 0; w < nw; w++) {
        kill(wpid[w], SIGTERM);
        waitpid(wpid[w], NULL, 0);
        waitpid(rpid[w], NULL, 0);
    }
    shoal_st_close(st);
    return 0;
}
