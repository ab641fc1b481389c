/* `shoal plan --measured` (see plan_measured.h). */
#include "coordinator/cmd/plan_measured.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/k3schema.h"
#include "common/planfile.h"
#include "coordinator/cluster/cluster.h"
#include "kernels/kernels.h"
#include "proto/tshard.h"

/* A TRUNK_BATCH's header without x, bytes (its segments' names and rows, the
 * layer; with a tree xid and wait_ms): about 194 on the wire per request, as
 * measured on the k3-nano netns run (tests/e2e/test_relay_netns.py) */
#define SHOAL_PLAN_TBATCH_HDR 194.0

/* one worker's measured figures */
typedef struct {
    double bw;       /* read_bw_all x eff, bytes/s */
    double rtt;      /* RTT p50, s */
    double rout, rin; /* link rates, bytes/s */
} meas;

/* the model's per-token figures (decode, one token) */
typedef struct {
    double tall;      /* trunk bytes read per token (the embedding table not read) */
    double embed;     /* the embedding table (held by the coordinator, one row read per token) */
    double tr;        /* of which row-shardable (remote when spread) */
    double fa;        /* KDA f_a matrices (held whole by every trunk server) */
    double x_in;      /* bytes of the inputs of the trunk steps (f32; bf16 in the mu class where exact,
                         PROTOCOL.md 1.7), sent to every trunk server */
    double y_out;     /* bytes of their outputs (f32), split over the trunk servers */
    int steps_serial; /* trunk steps on the critical path */
    double etok;      /* routed-expert bytes read per token */
    double experts_all; /* bytes of every routed expert */
    int moe, k, E;
    double act;       /* one expert exchange's activation to one worker */
    double yexp;      /* one token's expert outputs (all k) */
} model_fig;

typedef struct {
    const char *label;
    int spread, G, F; /* F: relay fan-out (0: direct; SHOAL_RELAY_GREEDY: the latency-aware schedule) */
    double peer, hop;  /* the relay hops' rate (bytes/s) and latency (s) it was priced with */
    int xsends;        /* copies of each step's x the coordinator sends itself (0: trunk local) */
    double reads, coord, rt, wire, total, tok_s;
    double coord_bytes; /* what the coordinator holds in this placement */
    double *share; /* [W] expert fractions */
    int ok;
    char why[256];
} cand;

/* b bytes as GiB, or MiB below 1 GiB, 3 decimals */
static const char *gib(double b, char *buf, size_t n)
{
    if (b >= 1073741824.0)
        snprintf(buf, n, "%.3f GiB", b / 1073741824.0);
    else
        snprintf(buf, n, "%.3f MiB", b / 1048576.0);
    return buf;
}

typedef struct {
    const shoal_st *st;
    double t[2]; /* the trunk read per token, the embedding table */
} trunk_sum;

static int sum_trunk(const shoal_k3schema_entry *e, void *ctx)
{
    trunk_sum *s = ctx;
    if (e->cls != SHOAL_TC_EXPERT) { /* the pack's bytes where it has the tensor (its dtype), else the schema's */
        const shoal_tensor *t = s->st ? shoal_st_find(s->st, e->name) : NULL;
        s->t[strstr(e->name, "embed_tokens") ? 1 : 0] += t ? (double)t->nbytes : (double)shoal_k3schema_nbytes(e);
    }
    return 0;
}

/* Bytes per element of an input read by a matrix stored as dtype dt: in the
 * mu class a BF16 (or MXFP4) matrix rounds its input to bf16, so it travels
 * as bf16 (2 bytes, PROTOCOL.md 1.7); f32 (4) otherwise. */
static double xsize(int mu, int dt)
{
    return mu && (dt == SHOAL_DT_BF16 || dt == SHOAL_DT_U8) ? 2.0 : 4.0;
}

static int figures(const shoal_k3cfg *cfg, const shoal_st *st, uint64_t expert_bytes, int mu, model_fig *f,
                   char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    trunk_sum tb = {.st = st};
    shoal_k3schema_foreach(cfg, sum_trunk, &tb);
    f->tall = tb.t[0];
    f->embed = tb.t[1];
    shoal_tshard_mat *m = NULL;
    int n = 0;
    if (shoal_tshard_mats(cfg, &m, &n))
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "the trunk matrices do not list");
    /* steps (PROTOCOL.md §3.7): per layer, every matrix reading the layer's
     * input (cols = hidden) is one step (f_b joins it, chained on f_a);
     * every other matrix reads its own input: a step of its own. The shared
     * experts' down projection overlaps the expert exchange (not serial). */
    for (int i = 0; i < n; i++) {
        const shoal_tensor *t = shoal_st_find(st, m[i].name);
        double b = t ? (double)t->nbytes : (double)m[i].rows * m[i].cols * 2;
        f->tr += b;
        int is_fa = strstr(m[i].name, ".f_a_proj.weight") != NULL, is_fb = strstr(m[i].name, ".f_b_proj.weight") != NULL;
        if (is_fa) {
            f->fa += b;
            continue; /* its output stays on the worker (the chain) */
        }
        f->y_out += (double)m[i].rows * 4;
        if (m[i].cols == cfg->hidden_size || is_fb) {
            /* the layer's first step: counted once per layer (below) */
            continue;
        }
        f->x_in += (double)m[i].cols * xsize(mu, t ? (int)t->dtype : SHOAL_DT_BF16);
        if (!strstr(m[i].name, "shared_experts.down_proj"))
            f->steps_serial++;
    }
    /* one first step per layer that has a matrix on the hidden input, and lm_head */
    for (int l = -1; l < cfg->num_layers; l++) {
        int any_attn = 0, any_mlp = 0;
        double xs_attn = 2, xs_mlp = 2; /* bf16 only when every matrix of the step rounds its input */
        for (int i = 0; i < n; i++) {
            if (m[i].layer != l || m[i].cols != cfg->hidden_size)
                continue;
            const shoal_tensor *t = shoal_st_find(st, m[i].name);
            double xs = xsize(mu, t ? (int)t->dtype : SHOAL_DT_BF16);
            if (strstr(m[i].name, "self_attn")) {
                any_attn = 1;
                xs_attn = xs > xs_attn ? xs : xs_attn;
            } else {
                any_mlp = 1;
                xs_mlp = xs > xs_mlp ? xs : xs_mlp;
            }
        }
        /* attention and MLP halves read different inputs (xn of each half) */
        f->x_in += (double)cfg->hidden_size * (any_attn * xs_attn + any_mlp * xs_mlp);
        f->steps_serial += any_attn + any_mlp;
    }
    free(m);
    f->moe = cfg->num_moe;
    f->k = cfg->experts_per_token;
    f->E = cfg->num_experts;
    f->etok = (double)cfg->num_moe * cfg->experts_per_token * (double)expert_bytes;
    f->experts_all = (double)cfg->num_moe * cfg->num_experts * (double)expert_bytes;
    /* an expert exchange's request: its activation row in bf16 in the mu class
     * when the experts are MXFP4 or BF16 (a worker's HELLO bf16_exact) */
    int exact = cfg->expert_format == SHOAL_EXPERTS_MXFP4;
    for (int l = 0; l < cfg->num_layers && !exact && cfg->expert_format != SHOAL_EXPERTS_MXFP4; l++) {
        shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
        if (shoal_k3schema_expert(cfg, l, 0, ent) > 0) {
            const shoal_tensor *t = shoal_st_find(st, ent[0].name);
            exact = t && t->dtype == SHOAL_DT_BF16;
            break;
        }
    }
    f->act = 16 + (double)cfg->latent_size * (mu && exact ? 2 : 4) + 16 + 8.0 * cfg->experts_per_token;
    f->yexp = (double)cfg->experts_per_token * cfg->latent_size * 2;
    return 0;
}

static int load_doctor(const char *path, int W, const char *const *names, double eff, meas *ms, double *coord_bw,
                       double *coord_mem, int *mu, char *err, size_t errlen)
{
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_EIO, "%s: %s (line %d)", path, je.text, je.line);
    int rc = 0;
    json_t *ws = json_object_get(root, "workers");
    const char *fmt = json_string_value(json_object_get(root, "format"));
    if (!fmt || strcmp(fmt, "shoal-doctor") || !json_is_array(ws)) {
        rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s is not a `shoal doctor --json` document", path);
        goto out;
    }
    if (mu) { /* the class doctor measured the workers in (absent: a doctor before 1.7, portable) */
        const char *nc = json_string_value(json_object_get(root, "numerics"));
        shoal_numerics v = SHOAL_NUMERICS_PORTABLE;
        if (nc && shoal_numerics_parse(nc, &v)) {
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: \"numerics\" is '%s', not portable or mu", path, nc);
            goto out;
        }
        *mu = v == SHOAL_NUMERICS_MU;
    }
    double bsum = 0;
    for (int w = 0; w < W && !rc; w++) {
        json_t *o = NULL, *x;
        size_t i;
        json_array_foreach(ws, i, x)
        {
            const char *nm = json_string_value(json_object_get(x, "name"));
            if (nm && !strcmp(nm, names[w]))
                o = x;
        }
        if (!o) {
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s has no worker named %s (doctor names a worker by its "
                               "--id; start each with --id NAME, as `shoal expert --plan` does)", path, names[w]);
            break;
        }
        json_t *h = json_object_get(o, "host");
        double bw = json_number_value(json_object_get(h, "read_bw_all"));
        double tog = json_number_value(json_object_get(o, "read_bw_all_together"));
        if (tog > 0 && tog < bw) /* hosts sharing a memory bus read at this rate when all work */
            bw = tog;
        meas *q = &ms[w];
        q->bw = bw * eff;
        q->rtt = json_number_value(json_object_get(o, "rtt_p50_us")) * 1e-6;
        q->rout = json_number_value(json_object_get(o, "out_bytes_per_s"));
        q->rin = json_number_value(json_object_get(o, "in_bytes_per_s"));
        if (!json_is_true(json_object_get(o, "ok")) || q->bw <= 0 || q->rout <= 0 || q->rin <= 0)
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "%s: worker %s was not measured (%s); rerun shoal doctor "
                               "without --no-facts", path, names[w],
                               json_string_value(json_object_get(o, "error")) ? json_string_value(json_object_get(o, "error"))
                                                                               : "no host facts");
        bsum += q->bw;
    }
    if (!rc) {
        json_t *c = json_object_get(root, "coordinator");
        double cb = json_number_value(json_object_get(c, "read_bw_all")) * eff;
        *coord_bw = cb > 0 ? cb : bsum / W; /* doctor --no-local: the workers' mean */
        *coord_mem = json_number_value(json_object_get(c, "mem_total")); /* 0: not recorded */
    }
out:
    json_decref(root);
    return rc;
}

/* Expert shares minimising the slowest server's per-token reads
 * (tr[w] + s_w x EI) / bw[w], each within cap[w], summing to 1: a bisection
 * on that time T. Returns T (the reads term), or -1 when the caps do not
 * reach 1. */
static double split(int W, const meas *ms, const double *tr, const double *cap, double EI, double *s)
{
    double capsum = 0;
    for (int w = 0; w < W; w++)
        capsum += cap[w];
    if (capsum < 1 - 1e-12)
        return -1;
    double lo = 0, hi = 1;
    for (int w = 0; w < W; w++) {
        double t = (tr[w] + EI) / ms[w].bw;
        hi = t > hi ? t : hi;
    }
    for (int it = 0; it < 200; it++) {
        double mid = (lo + hi) / 2, sum = 0;
        for (int w = 0; w < W; w++) {
            double x = (mid * ms[w].bw - tr[w]) / EI;
            sum += x < 0 ? 0 : x > cap[w] ? cap[w] : x;
        }
        if (sum >= 1)
            hi = mid;
        else
            lo = mid;
    }
    double T = 0, sum = 0;
    for (int w = 0; w < W; w++) {
        double x = (hi * ms[w].bw - tr[w]) / EI;
        s[w] = x < 0 ? 0 : x > cap[w] ? cap[w] : x;
        sum += s[w];
    }
    for (int w = 0; w < W; w++) {
        s[w] /= sum;
        double t = (tr[w] + s[w] * EI) / ms[w].bw;
        T = t > T ? t : T;
    }
    return T;
}

/* The coordinator's NIC in one exchange, its two directions separate (full
 * duplex): the reply of the server that holds its input at t[i] passes the
 * incoming side in b[i] seconds, one reply after another in the order they
 * become ready. Returns when the last reply is in. */
static double nic_in_done(int n, const double *t, const double *b)
{
    int *ix = malloc((size_t)n * sizeof *ix);
    for (int i = 0; i < n; i++)
        ix[i] = i;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t[ix[j]] < t[ix[j - 1]]; j--) {
            int q = ix[j];
            ix[j] = ix[j - 1];
            ix[j - 1] = q;
        }
    double done = 0;
    for (int i = 0; i < n; i++)
        done = (t[ix[i]] > done ? t[ix[i]] : done) + b[ix[i]];
    free(ix);
    return done;
}

static void evaluate(const shoal_plan_measured *m, const model_fig *f, const meas *ms, double cbw, double cmem,
                     const char *cmem_from, const int *order, cand *c)
{
    int W = m->nworkers, G = c->spread ? c->G : 0;
    double *tr = calloc((size_t)W, sizeof *tr), *cap = calloc((size_t)W, sizeof *cap);
    uint8_t *ist = calloc((size_t)W, 1);
    for (int g = 0; g < G; g++)
        ist[order[g]] = 1;
    c->ok = 1;
    for (int w = 0; w < W; w++) {
        tr[w] = ist[w] ? f->tr / G + f->fa * (1 - 1.0 / G) : 0; /* its rows, and every f_a whole */
        double room = (double)m->budget[w] - tr[w];
        /* whole experts: the room for floor(room / one expert) of them (a fraction of one holds none) */
        cap[w] = room > 0 && m->expert_bytes ? floor(room / (double)m->expert_bytes) * (double)m->expert_bytes /
                                                   f->experts_all : 0;
        if (ist[w] && room <= 0) {
            c->ok = 0;
            char a[32], b[32];
            snprintf(c->why, sizeof c->why, "%s: its trunk rows (%s) fill its budget (%s)", m->names[w],
                     gib(tr[w], a, sizeof a), gib((double)m->budget[w], b, sizeof b));
        }
    }
    /* the coordinator's memory: the embedding table, and the trunk (local) or its part no row spec takes */
    c->coord_bytes = f->embed + (G ? f->tall - f->tr : f->tall);
    if (c->ok && cmem > 0 && c->coord_bytes > cmem) {
        c->ok = 0;
        char a[32], b[32];
        snprintf(c->why, sizeof c->why, "needs %s on the coordinator, its budget is %s (%s)",
                 gib(c->coord_bytes, a, sizeof a), gib(cmem, b, sizeof b), cmem_from);
    }
    double EI = f->etok * m->imbalance;
    double reads = c->ok ? split(W, ms, tr, cap, EI, c->share) : -1;
    if (c->ok && reads < 0) {
        c->ok = 0;
        snprintf(c->why, sizeof c->why, "the budgets do not hold every routed expert%s", G ? " beside the trunk rows" : "");
    }
    if (c->ok) {
        c->reads = reads;
        c->coord = (G ? f->tall - f->tr : f->tall) / cbw;
        /* one trunk step's timeline (plan_measured.h): when each of the G trunk servers (in `order`) holds the
         * step's x -- sent by the coordinator one after the other, to every server or, with a relay tree, to
         * the F roots, each parent then feeding its children one after the other -- and its reply */
        int F = c->spread && (c->F == SHOAL_RELAY_GREEDY || (c->F >= 2 && G > c->F)) ? c->F : 0;
        int *kids = calloc((size_t)W, sizeof *kids), *root = calloc((size_t)W, sizeof *root);
        int steps = f->steps_serial > 0 ? f->steps_serial : 1;
        double xb = f->x_in / steps, nic = m->nic_Bps;
        double *t = calloc((size_t)(W > 1 ? W : 1), sizeof *t), *bn = calloc((size_t)(W > 1 ? W : 1), sizeof *bn);
        double trunk_step = 0;
        /* a relay hop: a worker-to-worker one-way latency (RTT / 2 of the slowest trunk server) + the software
         * cost of an exchange, inside each relayed copy's arrival; its rate --peer-gbps, else (the greedy
         * schedule, which takes one rate) the slowest trunk server's link, else (a fixed tree) the lower of
         * the parent's and the child's links */
        double rtt_g = 0, peer_min = 0;
        for (int g = 0; g < G; g++) {
            const meas *q = &ms[order[g]];
            double r = q->rin < q->rout ? q->rin : q->rout;
            rtt_g = q->rtt > rtt_g ? q->rtt : rtt_g;
            peer_min = g == 0 || r < peer_min ? r : peer_min;
        }
        c->hop = rtt_g / 2 + m->overhead_s;
        c->peer = m->peer_Bps > 0 ? m->peer_Bps : peer_min;
        if (G) {
            /* the tree: parent (-1: the coordinator) and position among its parent's sends, in server order */
            int *par = calloc((size_t)G, sizeof *par), *nk = calloc((size_t)G, sizeof *nk);
            int ok_tree = 1;
            if (F == SHOAL_RELAY_GREEDY) {
                shoal_relaytree *rt = malloc(sizeof *rt);
                ok_tree = nic > 0 && !shoal_relaytree_greedy(rt, G, xb, nic, c->peer, c->hop, 64);
                for (int j = 0; j < G && ok_tree; j++)
                    par[j] = rt->parent[j];
                free(rt);
            } else {
                int R = F ? F : G;
                for (int j = 0; j < G; j++)
                    par[j] = -1;
                int j = R, ls = 0, lsize = R;
                while (j < G) { /* level by level, each level's members taking the previous level's in turn */
                    int next = 0;
                    for (int o = 0; j < G && o < F * lsize; o++, j++, next++)
                        par[j] = ls + o % lsize;
                    ls += lsize;
                    lsize = next;
                }
            }
            if (!ok_tree) { /* no shared NIC: the schedule has no coordinator rate (never chosen: priced direct) */
                c->ok = 0;
                snprintf(c->why, sizeof c->why, "the greedy schedule needs the coordinator's NIC rate (--nic-gbps)");
                for (int j = 0; j < G; j++)
                    par[j] = -1;
            }
            /* the coordinator's sends (trunk_client.c send_round): to each of its children in server order x
             * with its header (at most each link's rate), each followed by the headers of that child's subtree;
             * a relayed copy of x arrives at its parent's + its turn among the parent's sends x x / rate + the
             * hop; a server computes once it holds x and its header (t) */
            int *rootof = calloc((size_t)G, sizeof *rootof);
            double *tx = calloc((size_t)G, sizeof *tx), *hat = calloc((size_t)G, sizeof *hat), sent = 0;
            for (int j = 0; j < G; j++)
                rootof[j] = par[j] < 0 ? j : rootof[par[j]];
            for (int j = 0; j < G; j++) {
                const meas *r = &ms[order[j]];
                if (par[j] < 0) {
                    sent += nic > 0 ? (xb + SHOAL_PLAN_TBATCH_HDR) / nic : 0;
                    tx[j] = t[j] = sent > xb / r->rout ? sent : xb / r->rout;
                    root[order[j]] = 1;
                    for (int k = j + 1; k < G; k++)
                        if (par[k] >= 0 && rootof[k] == j) {
                            sent += nic > 0 ? SHOAL_PLAN_TBATCH_HDR / nic : 0;
                            hat[k] = sent;
                        }
                } else {
                    const meas *pm = &ms[order[par[j]]];
                    double rate = F == SHOAL_RELAY_GREEDY || m->peer_Bps > 0 ? c->peer
                                  : pm->rin < r->rout ? pm->rin : r->rout; /* parent's upload, child's download */
                    nk[par[j]]++;
                    tx[j] = tx[par[j]] + nk[par[j]] * xb / rate + c->hop;
                    t[j] = tx[j] > hat[j] ? tx[j] : hat[j];
                }
            }
            c->xsends = 0;
            for (int q = 0; q < G; q++) {
                kids[order[q]] = nk[q];
                c->xsends += par[q] < 0;
            }
            free(rootof);
            free(tx);
            free(hat);
            free(par);
            free(nk);
            /* the replies: each leaves when its server holds x, on its own link, and through the NIC's
             * incoming side one after the other (full duplex: the two directions are separate) */
            double yb = f->y_out / steps / G;
            for (int q = 0; q < G; q++) {
                double own = t[q] + yb / ms[order[q]].rin;
                trunk_step = own > trunk_step ? own : trunk_step;
                bn[q] = nic > 0 ? yb / nic : 0;
            }
            if (nic > 0) {
                double in = nic_in_done(G, t, bn);
                trunk_step = in > trunk_step ? in : trunk_step;
            }
        }
        double rt_t = 0, rt_all = 0, wire = 0, esent = 0;
        int ne = 0;
        for (int w = 0; w < W; w++) {
            rt_all = ms[w].rtt > rt_all ? ms[w].rtt : rt_all;
            if (ist[w])
                rt_t = ms[w].rtt > rt_t ? ms[w].rtt : rt_t;
            double inv = 1 - pow(1 - c->share[w], f->k); /* chance it has one of a token's k experts */
            int gets_x = ist[w] && (!F || root[w]); /* from the coordinator: the roots only, with a tree */
            double out = f->moe * inv * f->act + (gets_x ? f->x_in : 0) + (ist[w] ? steps * SHOAL_PLAN_TBATCH_HDR : 0);
            double in = f->moe * c->share[w] * f->yexp + (ist[w] ? f->y_out / G : 0);
            /* its link: what the coordinator sends and receives, and with a tree x in from its parent and out
             * to each child */
            double pin = m->peer_Bps > 0 ? m->peer_Bps : ms[w].rout, pout = m->peer_Bps > 0 ? m->peer_Bps : ms[w].rin;
            double lt = out / ms[w].rout + in / ms[w].rin + (F && ist[w] && !root[w] ? f->x_in / pin : 0) +
                        kids[w] * f->x_in / pout;
            wire = lt > wire ? lt : wire;
            if (nic > 0 && inv > 0) { /* one MoE layer's exchange on the NIC: requests out, replies in */
                esent += inv * f->act / nic;
                t[ne] = esent;
                bn[ne++] = c->share[w] * f->yexp / nic;
            }
        }
        /* the coordinator's side: every step's timeline, and every MoE layer's on a shared NIC */
        double coord_wire = f->steps_serial * trunk_step + (ne ? f->moe * nic_in_done(ne, t, bn) : 0);
        wire = coord_wire > wire ? coord_wire : wire;
        free(t);
        free(bn);
        free(kids);
        free(root);
        double x = m->overhead_s;
        c->rt = (G ? f->steps_serial * (rt_t + x) : 0) + f->moe * (rt_all + x); /* a relay's hops: in the wire */
        c->wire = wire;
        c->total = c->reads + c->coord + c->rt + c->wire;
        /* S slots: reads and round trips once per step, the rest per sequence */
        double S = m->slots;
        double step = c->reads + c->rt + S * (c->coord * (G ? 1 : 0) + c->wire) + (G ? 0 : c->coord);
        c->tok_s = S / step;
    }
    free(tr);
    free(cap);
    free(ist);
}

static const char *bottleneck(const cand *c)
{
    double v[4] = {c->reads, c->coord, c->rt, c->wire};
    const char *nm[4] = {"server reads (trunk rows + experts)", "coordinator reads", "round trips x RTT",
                         "wire bytes / link rate"};
    int b = 0;
    for (int i = 1; i < 4; i++)
        if (v[i] > v[b])
            b = i;
    return nm[b];
}

static int by_total(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    if (x->ok != y->ok)
        return y->ok - x->ok;
    double tie = 1e-6 * (x->total > y->total ? x->total : y->total);
    /* equal: the fewer copies of x the coordinator sends (less egress: on the k3-scale netns cluster greedy,
     * priced equal to F = 2, measured 4-5% faster sending half of F = 2's x, docs/PERFORMANCE.md), then
     * direct, the smaller fixed fan-out, the greedy schedule last (the simpler tree) */
    int fx = x->F == SHOAL_RELAY_GREEDY ? 5 : x->F, fy = y->F == SHOAL_RELAY_GREEDY ? 5 : y->F;
    if (fabs(x->total - y->total) <= tie && x->spread && y->spread && x->G == y->G && x->xsends != y->xsends)
        return x->xsends - y->xsends;
    if (fabs(x->total - y->total) <= tie && fx != fy)
        return fx - fy;
    return x->total < y->total ? -1 : x->total > y->total;
}

int shoal_plan_measured_choose(shoal_plan_measured *m, char *err, size_t errlen)
{
    int W = m->nworkers, rc;
    model_fig f;
    meas *ms = calloc((size_t)W, sizeof *ms);
    double cbw = 0, dmem = 0;
    int mu = m->numerics;
    if ((rc = load_doctor(m->doctor, W, m->names, m->eff, ms, &cbw, &dmem, mu < 0 ? &mu : NULL, err, errlen))) {
        free(ms);
        return rc;
    }
    m->numerics = mu;
    if ((rc = figures(m->cfg, m->st, m->expert_bytes, mu, &f, err, errlen))) {
        free(ms);
        return rc;
    }
    /* trunk servers: the cheapest first, by what one token would cost it
     * holding the whole trunk alone -- its round trips, its link, its reads
     * (ties: manifest order) */
    int *order = malloc((size_t)W * sizeof *order);
    double *tcost = malloc((size_t)W * sizeof *tcost);
    for (int w = 0; w < W; w++) {
        order[w] = w;
        tcost[w] = f.steps_serial * (ms[w].rtt + m->overhead_s) + f.x_in / ms[w].rout + f.y_out / ms[w].rin +
                   f.tr / ms[w].bw;
    }
    for (int i = 1; i < W; i++)
        for (int j = i; j > 0 && tcost[order[j]] < tcost[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    shoal_tshard_mat *mats = NULL;
    int nm = 0, minrows = 1 << 30;
    shoal_tshard_mats(m->cfg, &mats, &nm);
    for (int i = 0; i < nm; i++)
        minrows = mats[i].rows < minrows ? mats[i].rows : minrows;
    free(mats);
    /* the coordinator's budget: --coordinator-mem, else 0.9 x its memory as doctor recorded it */
    double cmem = m->coord_mem ? (double)m->coord_mem : floor(dmem * 0.9);
    const char *cmem_from = m->coord_mem ? "--coordinator-mem" : "0.9 x its memory in doctor.json";
    cand cs[40];
    int nc = 0;
    char labels[40][48];
    memset(cs, 0, sizeof cs);
    snprintf(labels[nc], sizeof labels[nc], "trunk local");
    cs[nc++] = (cand){.label = labels[0], .spread = 0};
    for (int G = 1; G <= W && nc < 40; G = G * 2 > W && G < W ? W : G * 2) {
        if (G > minrows || (m->max_trunk_servers && G != W))
            continue;
        snprintf(labels[nc], sizeof labels[nc], "trunk spread over %d", G);
        cs[nc] = (cand){.label = labels[nc], .spread = 1, .G = G};
        nc++;
        for (int F = 2; F <= 4 && G >= 4 && F < G && nc < 40; F++) { /* the relay trees (PROTOCOL.md §3.9) */
            snprintf(labels[nc], sizeof labels[nc], "spread over %d, relay F=%d", G, F);
            cs[nc] = (cand){.label = labels[nc], .spread = 1, .G = G, .F = F};
            nc++;
        }
        if (G >= 2 && m->nic_Bps > 0 && G <= SHOAL_RELAYTREE_MAX && nc < 40) { /* the latency-aware schedule */
            snprintf(labels[nc], sizeof labels[nc], "spread over %d, relay greedy", G);
            cs[nc] = (cand){.label = labels[nc], .spread = 1, .G = G, .F = SHOAL_RELAY_GREEDY};
            nc++;
        }
        if (G == W)
            break;
    }
    for (int i = 0; i < nc; i++) {
        cs[i].share = calloc((size_t)W, sizeof(double));
        evaluate(m, &f, ms, cbw, cmem, cmem_from, order, &cs[i]);
    }
    qsort(cs, (size_t)nc, sizeof cs[0], by_total);
    if (m->force_G >= 0) { /* a placement asked for: it goes first, the rest stay as runners-up */
        int f2 = -1;
        for (int i = 0; i < nc; i++)
            if (cs[i].spread == (m->force_G > 0) && (!m->force_G || cs[i].G == m->force_G) && !cs[i].F)
                f2 = i;
        if (f2 < 0) {
            for (int i = 0; i < nc; i++)
                free(cs[i].share);
            free(order);
            free(tcost);
            free(ms);
            return shoal_err_set(err, errlen, SHOAL_ECONFIG, "--trunk-servers %d is not a placement considered "
                                 "(1, 2, 4, ... and all %d workers, at most the smallest matrix's rows)", m->force_G, W);
        }
        cand t = cs[f2];
        memmove(&cs[1], &cs[0], (size_t)f2 * sizeof cs[0]);
        cs[0] = t;
    }
    printf("measured plan (%s; assumed: kernel efficiency %.2f of the read pass, load imbalance %.2f, %.0f us per "
           "exchange beyond the RTT):\n", m->doctor, m->eff, m->imbalance, m->overhead_s * 1e6);
    printf("  per token: trunk %.3f GB (%.3f GB row-shardable), experts %.3f GB; %d serial trunk steps + %d "
           "expert exchanges; trunk inputs %.1f kB per trunk server (%s), outputs %.1f kB; expert request %.2f kB\n",
           f.tall / 1e9, f.tr / 1e9, f.etok / 1e9, f.steps_serial, f.moe, f.x_in / 1e3,
           mu ? "numerics mu: bf16 where the products round them, PROTOCOL.md 1.7" : "numerics portable: f32",
           f.y_out / 1e3, f.act / 1e3);
    char g1[32], g2[32], g3[32];
    printf("  coordinator memory: holds %s with the trunk local, %s spread (the embedding table, %s, and the "
           "trunk's part no row spec takes); ", gib(f.embed + f.tall, g1, sizeof g1),
           gib(f.embed + f.tall - f.tr, g2, sizeof g2), gib(f.embed, g3, sizeof g3));
    if (cmem > 0)
        printf("its budget %s (%s)\n", gib(cmem, g1, sizeof g1), cmem_from);
    else
        printf("no budget (--coordinator-mem, or doctor.json's coordinator mem_total)\n");
    printf("  %-28s %10s %10s %10s %10s %10s %9s  %s\n", "placement", "reads s", "coord s", "rtt s", "wire s",
           "s/token", "tok/s@" , "bottleneck");
    for (int i = 0; i < nc; i++) {
        if (!cs[i].ok) {
            printf("  %-28s does not fit: %s\n", cs[i].label, cs[i].why);
            continue;
        }
        printf("  %-28s %10.4f %10.4f %10.4f %10.4f %10.4f %9.2f  %s%s\n", cs[i].label, cs[i].reads, cs[i].coord,
               cs[i].rt, cs[i].wire, cs[i].total, cs[i].tok_s, bottleneck(&cs[i]), i == 0 ? (m->force_G >= 0 ? "  <- asked for" : "  <- chosen") : "");
    }
    printf("  (tok/s at --slots %d: reads and round trips once per step, wire and coordinator work per sequence)\n",
           m->slots);
    if (!nc || !cs[0].ok) {
        rc = shoal_err_set(err, errlen, SHOAL_ECONFIG, "no placement fits the budgets: %s", nc ? cs[0].why : "none");
    } else {
        m->spread = cs[0].spread;
        m->G = cs[0].G;
        m->relay_fanout = cs[0].F;
        m->relay_peer_Bps = cs[0].peer;
        m->relay_hop_s = cs[0].hop;
        m->predicted_s = cs[0].total;
        for (int w = 0; w < W; w++)
            m->tslot[w] = -1;
        if (m->spread) { /* parts in worker order among the chosen servers */
            int p = 0;
            uint8_t *sel = calloc((size_t)W, 1);
            for (int g = 0; g < m->G; g++)
                sel[order[g]] = 1;
            for (int w = 0; w < W; w++)
                if (sel[w])
                    m->tslot[w] = p++;
            free(sel);
        }
        /* expert counts from the shares: largest remainder, at least one each */
        uint64_t total = (uint64_t)f.moe * (uint64_t)f.E, given = 0;
        double *rem = calloc((size_t)W, sizeof *rem);
        for (int w = 0; w < W; w++) {
            double x = cs[0].share[w] * (double)total;
            m->count[w] = (uint64_t)x;
            if (!m->count[w])
                m->count[w] = 1;
            rem[w] = x - floor(x);
            given += m->count[w];
        }
        while (given < total) {
            int b = 0;
            for (int w = 1; w < W; w++)
                if (rem[w] > rem[b])
                    b = w;
            m->count[b]++;
            rem[b] = -1;
            given++;
        }
        while (given > total) { /* the minimum of one pushed it over: take from the largest */
            int b = 0;
            for (int w = 1; w < W; w++)
                if (m->count[w] > m->count[b])
                    b = w;
            m->count[b]--;
            given--;
        }
        free(rem);
        if (m->budget_split) {
            printf("  chosen: %s; the experts by the budgets (the prediction assumed the measured split)\n",
                   cs[0].label);
        } else {
            printf("  chosen: %s, experts by measured bandwidth:", cs[0].label);
            for (int w = 0; w < W; w++)
                printf(" %s %llu%s", m->names[w], (unsigned long long)m->count[w], m->tslot[w] >= 0 ? " +trunk" : "");
            printf("\n");
        }
    }
    for (int i = 0; i < nc; i++)
        free(cs[i].share);
    free(order);
    free(tcost);
    free(ms);
    return rc;
}
