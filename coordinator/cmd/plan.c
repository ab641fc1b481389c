/* plan: cluster manifest and placement planner (see plan.h; method and format
 * in docs/CLUSTER.md). */
#include "coordinator/cmd/plan.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"

/* ---- the manifest ------------------------------------------------------- */

int shoal_plan_parse_bytes(const char *s, uint64_t *out)
{
    static const struct {
        const char *u;
        double m;
    } units[] = {{"", 1},       {"B", 1},       {"KiB", 1024.0},  {"MiB", 1048576.0}, {"GiB", 1073741824.0},
                 {"TiB", 1099511627776.0},     {"KB", 1e3},      {"MB", 1e6},        {"GB", 1e9},
                 {"TB", 1e12}};
    if (!s || !isdigit((unsigned char)*s))
        return SHOAL_EFORMAT;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || !(v >= 0))
        return SHOAL_EFORMAT;
    while (*end == ' ')
        end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (!strcmp(end, units[i].u)) {
            double b = floor(v * units[i].m);
            if (b >= 18446744073709551616.0)
                return SHOAL_ERANGE;
            *out = (uint64_t)b;
            return 0;
        }
    return SHOAL_EFORMAT;
}

static int valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > SHOAL_PLAN_MAX_NAME || s[0] == '.' || s[0] == '-')
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.')
            return 0;
    return 1;
}

/* An ssh user name (POSIX portable: [A-Za-z0-9._-], not starting with '-'):
 * it is written into the Ansible inventory, so nothing else may pass. */
static int valid_user(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || s[0] == '-')
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.')
            return 0;
    return 1;
}

/* A host name or an IP address (v4, v6 with an optional %zone): letters,
 * digits and . - : % _ only. */
static int valid_address(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || s[0] == '-')
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && !strchr(".-:%_", s[i]))
            return 0;
    return 1;
}

/* Every string anywhere in the manifest (values and keys): no control
 * character (a newline or a NUL would forge lines of what is written from
 * it), and valid UTF-8 (jansson checks that). The path of the first
 * offending field is written into field. */
static int find_control(json_t *v, char *field, size_t cap, size_t at)
{
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        size_t n = json_string_length(v);
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
                return 1;
        return 0;
    }
    if (json_is_object(v)) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x) {
            int l = snprintf(field + at, at < cap ? cap - at : 0, "%s%.40s", at ? "." : "", k);
            size_t next = at + (l > 0 ? (size_t)l : 0);
            if (next >= cap)
                next = cap - 1;
            for (const char *c = k; *c; c++)
                if ((unsigned char)*c < 0x20 || *c == 0x7f) {
                    field[at] = 0;
                    snprintf(field + at, cap - at, "%s(a key)", at ? "." : "");
                    return 1;
                }
            if (find_control(x, field, cap, next))
                return 1;
        }
        field[at] = 0;
        return 0;
    }
    if (json_is_array(v)) {
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) {
            int l = snprintf(field + at, at < cap ? cap - at : 0, "[%zu]", i);
            size_t next = at + (l > 0 ? (size_t)l : 0);
            if (next >= cap)
                next = cap - 1;
            if (find_control(x, field, cap, next))
                return 1;
        }
        field[at] = 0;
    }
    return 0;
}

static int get_bytes(json_t *v, uint64_t *out)
{
    if (json_is_integer(v)) {
        if (json_integer_value(v) < 0)
            return SHOAL_ERANGE;
        *out = (uint64_t)json_integer_value(v);
        return 0;
    }
    if (json_is_string(v))
        return shoal_plan_parse_bytes(json_string_value(v), out);
    return SHOAL_EFORMAT;
}

static int get_int(json_t *v, long lo, long hi, int *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return SHOAL_ERANGE;
    *out = (int)json_integer_value(v);
    return 0;
}

static int parse_root(shoal_plan_cluster *c, json_t *root, const char *what, char *err, size_t errlen)
{
    json_t *fmt = json_object_get(root, "format"), *ver = json_object_get(root, "version");
    json_t *hosts = json_object_get(root, "hosts"), *coord = json_object_get(root, "coordinator");
    if (!json_is_object(root) || !json_is_string(fmt) || strcmp(json_string_value(fmt), "shoal-cluster"))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: \"format\" must be \"shoal-cluster\"", what);
    char field[256] = "";
    if (find_control(root, field, sizeof field, 0))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: %s: a control character (e.g. a line break) in a "
                             "string", what, field);
    if (!json_is_integer(ver) || json_integer_value(ver) != 1)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: \"version\" must be the integer 1", what);
    if (get_int(json_object_get(root, "worker_port"), 1, 65535, &c->worker_port))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: \"worker_port\" must be an integer 1..65535",
                             what);
    if (!json_is_string(coord))
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: \"coordinator\" must be a host name", what);
    if (!json_is_array(hosts) || json_array_size(hosts) == 0 || json_array_size(hosts) > SHOAL_PLAN_MAX_HOSTS)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: \"hosts\" must be an array of 1..%d hosts",
                             what, SHOAL_PLAN_MAX_HOSTS);
    c->nhosts = (int)json_array_size(hosts);
    c->hosts = shoal_xcalloc((size_t)c->nhosts, sizeof *c->hosts);
    c->coordinator = -1;
    for (int i = 0; i < c->nhosts; i++) {
        json_t *h = json_array_get(hosts, (size_t)i);
        shoal_plan_host *ph = &c->hosts[i];
        if (!json_is_object(h))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: hosts[%d] must be an object", what, i);
        json_t *name = json_object_get(h, "name"), *addr = json_object_get(h, "address");
        json_t *user = json_object_get(h, "ssh_user"), *ram = json_object_get(h, "expert_ram");
        json_t *disk = json_object_get(h, "disk"), *port = json_object_get(h, "port");
        json_t *sport = json_object_get(h, "ssh_port"), *dom = json_object_get(h, "domain");
        if (!json_is_string(name) || !valid_name(json_string_value(name)))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d].name must be 1..%d of [A-Za-z0-9._-], not starting with . or -",
                                 what, i, SHOAL_PLAN_MAX_NAME);
        snprintf(ph->name, sizeof ph->name, "%s", json_string_value(name));
        for (int j = 0; j < i; j++)
            if (!strcmp(c->hosts[j].name, ph->name))
                return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: host name \"%s\" appears twice", what,
                                     ph->name);
        if (!json_is_string(addr) || json_string_length(addr) == 0 || json_string_length(addr) >= sizeof ph->address ||
            !valid_address(json_string_value(addr)))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d] (%s).address must be a host name or IP address", what, i,
                                 ph->name);
        snprintf(ph->address, sizeof ph->address, "%s", json_string_value(addr));
        if (!json_is_string(user) || json_string_length(user) == 0 || json_string_length(user) >= sizeof ph->ssh_user ||
            !valid_user(json_string_value(user)))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d] (%s).ssh_user must be a user name ([A-Za-z0-9._-], not "
                                 "starting with -)",
                                 what, i, ph->name);
        snprintf(ph->ssh_user, sizeof ph->ssh_user, "%s", json_string_value(user));
        if (get_int(json_object_get(h, "cpus"), 1, 65536, &ph->cpus))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: hosts[%d] (%s).cpus must be an integer >= 1",
                                 what, i, ph->name);
        if (!ram || get_bytes(ram, &ph->expert_ram))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d] (%s).expert_ram must be bytes (an integer, or e.g. \"180GiB\"; "
                                 "0: not a worker)",
                                 what, i, ph->name);
        if (disk && get_bytes(disk, &ph->disk))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d] (%s).disk must be bytes (an integer, or e.g. \"400GB\")", what,
                                 i, ph->name);
        ph->port = c->worker_port;
        if (port && get_int(port, 1, 65535, &ph->port))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: hosts[%d] (%s).port must be 1..65535", what,
                                 i, ph->name);
        ph->ssh_port = 22;
        if (sport && get_int(sport, 1, 65535, &ph->ssh_port))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: hosts[%d] (%s).ssh_port must be 1..65535",
                                 what, i, ph->name);
        if (dom && (!json_is_string(dom) || !valid_name(json_string_value(dom))))
            return shoal_err_set(err, errlen, SHOAL_EFORMAT,
                                 "cluster %s: hosts[%d] (%s).domain must be 1..%d of [A-Za-z0-9._-], not starting "
                                 "with . or -", what, i, ph->name, SHOAL_PLAN_MAX_NAME);
        if (dom)
            snprintf(ph->domain, sizeof ph->domain, "%s", json_string_value(dom));
        if (!strcmp(ph->name, json_string_value(coord)))
            c->coordinator = i;
    }
    if (c->coordinator < 0)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "cluster %s: coordinator \"%s\" is not one of the hosts", what,
                             json_string_value(coord));
    int workers = 0;
    for (int i = 0; i < c->nhosts; i++)
        workers += c->hosts[i].expert_ram > 0;
    if (!workers)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG, "cluster %s: no host has expert_ram > 0 (no worker)", what);
    return 0;
}

int shoal_plan_cluster_parse(shoal_plan_cluster *c, const char *json, size_t len, const char *what, char *err,
                             size_t errlen)
{
    memset(c, 0, sizeof *c);
    json_error_t je;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: line %d: %s", what, je.line, je.text);
    int rc = parse_root(c, root, what, err, errlen);
    json_decref(root);
    if (rc)
        shoal_plan_cluster_free(c);
    return rc;
}

int shoal_plan_cluster_read(shoal_plan_cluster *c, const char *path, char *err, size_t errlen)
{
    memset(c, 0, sizeof *c);
    int orc = 0;
    FILE *f = shoal_fopen_regular(path, &orc); /* a FIFO must not block the read */
    if (!f)
        return orc == SHOAL_EFORMAT ? shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: not a regular file", path)
                                    : shoal_err_set(err, errlen, orc, "cluster %s: %s", path, strerror(-orc));
    char *buf;
    size_t n;
    int rc = shoal_read_stream(f, 64u << 20, &buf, &n);
    fclose(f);
    if (rc == -EFBIG)
        return shoal_err_set(err, errlen, SHOAL_EFORMAT, "cluster %s: larger than 64 MiB", path);
    if (rc)
        return shoal_err_set(err, errlen, SHOAL_EIO, "cluster %s: read error", path);
    rc = shoal_plan_cluster_parse(c, buf, n, path, err, errlen);
    free(buf);
    return rc;
}

void shoal_plan_cluster_free(shoal_plan_cluster *c)
{
    if (!c)
        return;
    free(c->hosts);
    memset(c, 0, sizeof *c);
}

/* ---- the planner -------------------------------------------------------- */

/* Step 1: n[w] <= cap[w], sum n = total, as equal as possible. Workers taken in
 * increasing cap (stable by index); those whose cap is below the running level
 * are filled; the rest split what is left, the remainder to the lowest
 * indexes. */
static void water_fill(int nw, const uint64_t *cap, uint64_t total, uint64_t *n)
{
    int *ord = shoal_xmalloc((size_t)nw * sizeof *ord);
    for (int i = 0; i < nw; i++)
        ord[i] = i;
    for (int i = 1; i < nw; i++) { /* insertion sort: stable, nw is small */
        int x = ord[i], j = i;
        while (j > 0 && cap[ord[j - 1]] > cap[x]) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = x;
    }
    uint64_t rem = total;
    int i = 0;
    for (; i < nw; i++) {
        uint64_t q = rem / (uint64_t)(nw - i);
        if (cap[ord[i]] > q)
            break;
        n[ord[i]] = cap[ord[i]];
        rem -= cap[ord[i]];
    }
    if (i < nw) { /* the uncapped rest: q each, +1 for the lowest indexes */
        int k = nw - i;
        uint64_t q = rem / (uint64_t)k, extra = rem % (uint64_t)k;
        for (int w = 0; w < nw; w++) {
            int uncapped = 0;
            for (int j = i; j < nw; j++)
                uncapped |= ord[j] == w;
            if (!uncapped)
                continue;
            n[w] = q + (extra > 0);
            if (extra)
                extra--;
        }
    }
    free(ord);
}

typedef struct {
    uint64_t hits;
    int e;
} hot;

static int cmp_hot(const void *a, const void *b)
{
    const hot *x = a, *y = b;
    if (x->hits != y->hits)
        return x->hits > y->hits ? -1 : 1;
    return x->e - y->e;
}

int shoal_plan_compute(const shoal_plan_in *in, int32_t *owner, char *err, size_t errlen)
{
    const int L = in->num_layers, E = in->num_experts, W = in->nworkers;
    if (L <= 0 || E <= 0 || W <= 0 || in->expert_bytes == 0 || !in->is_moe || !in->budget)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan: empty model or no workers");
    int nmoe = 0;
    for (int l = 0; l < L; l++)
        nmoe += in->is_moe[l] != 0;
    uint64_t total = (uint64_t)nmoe * (uint64_t)E, sumcap = 0;
    uint64_t *cap = shoal_xcalloc((size_t)W, sizeof *cap), *n = shoal_xcalloc((size_t)W, sizeof *n);
    for (int w = 0; w < W; w++) {
        cap[w] = in->budget[w] / in->expert_bytes;
        if (cap[w] > total)
            cap[w] = total;
        sumcap += cap[w];
    }
    if (sumcap < total) {
        uint64_t shortn = total - sumcap;
        int rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                               "plan: the workers' budgets hold %llu of the %llu routed experts (%llu B each): short by "
                               "%llu experts = %llu B (%.2f GiB)",
                               (unsigned long long)sumcap, (unsigned long long)total,
                               (unsigned long long)in->expert_bytes, (unsigned long long)shortn,
                               (unsigned long long)(shortn * in->expert_bytes),
                               (double)(shortn * in->expert_bytes) / 1073741824.0);
        free(cap);
        free(n);
        return rc;
    }
    water_fill(W, cap, total, n);

    uint64_t *left = shoal_xmalloc((size_t)W * sizeof *left); /* experts still to place per worker */
    memcpy(left, n, (size_t)W * sizeof *left);
    int64_t *m = shoal_xmalloc((size_t)W * sizeof *m);       /* this layer's count per worker */
    int *ord = shoal_xmalloc((size_t)W * sizeof *ord);
    double *frac = shoal_xmalloc((size_t)W * sizeof *frac);
    double *lload = shoal_xmalloc((size_t)W * sizeof *lload);
    hot *hs = shoal_xmalloc((size_t)E * sizeof *hs);
    int remaining = nmoe;
    for (int l = 0; l < L; l++) {
        int32_t *own = owner + (size_t)l * E;
        if (!in->is_moe[l]) {
            for (int e = 0; e < E; e++)
                own[e] = -1;
            continue;
        }
        /* step 2: left[w] / remaining, floors first, then the largest
         * remainders (exact integer comparison: left mod remaining) */
        int64_t given = 0;
        for (int w = 0; w < W; w++) {
            m[w] = (int64_t)(left[w] / (uint64_t)remaining);
            frac[w] = (double)(left[w] % (uint64_t)remaining);
            given += m[w];
            ord[w] = w;
        }
        for (int i = 1; i < W; i++) { /* by remainder descending, index ascending */
            int x = ord[i], j = i;
            while (j > 0 && frac[ord[j - 1]] < frac[x]) {
                ord[j] = ord[j - 1];
                j--;
            }
            ord[j] = x;
        }
        for (int i = 0; i < W && given < E; i++)
            if (frac[ord[i]] > 0) {
                m[ord[i]]++;
                given++;
            }
        if (given != E)
            SHOAL_PANIC("plan: layer %d got %lld of %d experts", l, (long long)given, E);
        for (int w = 0; w < W; w++)
            left[w] -= (uint64_t)m[w];
        remaining--;
        /* step 3 */
        if (!in->hits) {
            int e = 0;
            for (int w = 0; w < W; w++)
                for (int64_t j = 0; j < m[w]; j++)
                    own[e++] = w;
            continue;
        }
        for (int e = 0; e < E; e++)
            hs[e] = (hot){in->hits[(size_t)l * E + e], e};
        qsort(hs, (size_t)E, sizeof *hs, cmp_hot);
        for (int w = 0; w < W; w++)
            lload[w] = 0;
        for (int i = 0; i < E; i++) {
            int best = -1;
            for (int w = 0; w < W; w++)
                if (m[w] > 0 && (best < 0 || lload[w] < lload[best]))
                    best = w;
            own[hs[i].e] = best;
            lload[best] += (double)hs[i].hits;
            m[best]--;
        }
    }
    free(cap);
    free(n);
    free(left);
    free(m);
    free(ord);
    free(frac);
    free(lload);
    free(hs);
    return 0;
}

/* ---- replicas ------------------------------------------------------------- */

/* A replicated expert of load h, counted on its owner's load *a, moves to
 * its replica's *b as far as that levels them (never more than h): neither
 * ends above the busier of the two before, so replicas never raise a
 * layer's largest load. */
static void level(double *a, double *b, double h)
{
    double x = (*a - *b) / 2;
    if (x <= 0)
        return;
    if (x > h)
        x = h;
    *a -= x;
    *b += x;
}

void shoal_plan_load(const shoal_plan_in *in, const int32_t *owner, const int32_t *replica, double *load)
{
    const int L = in->num_layers, E = in->num_experts, W = in->nworkers;
    hot *hs = shoal_xmalloc((size_t)E * sizeof *hs);
    for (size_t i = 0; i < (size_t)W * L; i++)
        load[i] = 0;
    for (int l = 0; l < L; l++) {
        if (!in->is_moe[l])
            continue;
        int nh = 0;
        for (int e = 0; e < E; e++) {
            size_t c = (size_t)l * E + e;
            uint64_t h = in->hits ? in->hits[c] : 1;
            load[(size_t)owner[c] * L + l] += (double)h;
            if (replica && replica[c] >= 0)
                hs[nh++] = (hot){h, e};
        }
        qsort(hs, (size_t)nh, sizeof *hs, cmp_hot);
        for (int i = 0; i < nh; i++) {
            size_t c = (size_t)l * E + hs[i].e;
            level(&load[(size_t)owner[c] * L + l], &load[(size_t)replica[c] * L + l], (double)hs[i].hits);
        }
    }
    free(hs);
}

int shoal_plan_replicate(const shoal_plan_in *in, int replicas, const int32_t *owner, int32_t *replica, char *err,
                         size_t errlen)
{
    const int L = in->num_layers, E = in->num_experts, W = in->nworkers;
    for (size_t c = 0; c < (size_t)L * E; c++)
        replica[c] = -1;
    if (replicas == 0)
        return 0;
    if (replicas < 0 || replicas > E)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan: %d replicas per layer: at most the %d experts of a layer",
                             replicas, E);
    if (W < 2)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan: replicas need at least two workers (the cluster has %d)",
                             W);
    int nmoe = 0;
    for (int l = 0; l < L; l++)
        nmoe += in->is_moe[l] != 0;
    uint64_t total = (uint64_t)nmoe * (uint64_t)E, room = 0, need = (uint64_t)replicas * (uint64_t)nmoe;
    int64_t *spare = shoal_xcalloc((size_t)W, sizeof *spare);
    for (int w = 0; w < W; w++) {
        uint64_t cap = in->budget[w] / in->expert_bytes;
        spare[w] = (int64_t)(cap > total ? total : cap);
    }
    for (size_t c = 0; c < (size_t)L * E; c++)
        if (owner[c] >= 0)
            spare[owner[c]]--;
    for (int w = 0; w < W; w++)
        room += spare[w] > 0 ? (uint64_t)spare[w] : 0;
    if (room < need) {
        uint64_t s = need - room;
        int rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                               "plan: %d replicas on each of the %d MoE layers need room for %llu more experts; the "
                               "workers' budgets have room for %llu: short by %llu experts = %llu B (%.2f GiB)",
                               replicas, nmoe, (unsigned long long)need, (unsigned long long)room,
                               (unsigned long long)s, (unsigned long long)(s * in->expert_bytes),
                               (double)(s * in->expert_bytes) / 1073741824.0);
        free(spare);
        return rc;
    }
    double *lload = shoal_xmalloc((size_t)W * sizeof *lload);
    hot *hs = shoal_xmalloc((size_t)E * sizeof *hs);
    int rc = 0;
    for (int l = 0; l < L && !rc; l++) {
        if (!in->is_moe[l])
            continue;
        const int32_t *own = owner + (size_t)l * E;
        for (int w = 0; w < W; w++)
            lload[w] = 0;
        for (int e = 0; e < E; e++) {
            hs[e] = (hot){in->hits ? in->hits[(size_t)l * E + e] : 1, e};
            lload[own[e]] += (double)hs[e].hits;
        }
        qsort(hs, (size_t)E, sizeof *hs, cmp_hot);
        int placed = 0;
        for (int i = 0; i < E && placed < replicas; i++) {
            int e = hs[i].e, p = own[e], best = -1;
            for (int w = 0; w < W; w++)
                if (w != p && spare[w] > 0 &&
                    (best < 0 || lload[w] < lload[best] || (lload[w] == lload[best] && spare[w] > spare[best])))
                    best = w;
            if (best < 0)
                continue; /* only its owner has room: the next hottest */
            replica[(size_t)l * E + e] = best;
            spare[best]--;
            level(&lload[p], &lload[best], (double)hs[i].hits);
            placed++;
        }
        if (placed < replicas)
            rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                               "plan: layer %d takes %d of the %d replicas: the workers with room left own the "
                               "layer's other experts",
                               l, placed, replicas);
    }
    free(spare);
    free(lload);
    free(hs);
    return rc;
}

/* ---- redundancy (--replicas R) ------------------------------------------ */

/* Water level over owners: pour h into the least loaded of n loads so that
 * they rise to one level (the coordinator's pick sends each exchange's
 * pairs to the less loaded owner). */
static void pour(double **ld, int n, double h)
{
    for (int i = 1; i < n; i++) { /* ascending by load (n is small) */
        double *x = ld[i];
        int j = i;
        while (j > 0 && *ld[j - 1] > *x) {
            ld[j] = ld[j - 1];
            j--;
        }
        ld[j] = x;
    }
    int m = 1;
    double sum = *ld[0];
    while (m < n && *ld[m] * m - sum < h) { /* raising the m lowest to ld[m] costs less than h */
        sum += *ld[m];
        m++;
    }
    double level = (sum + h) / m;
    for (int i = 0; i < m; i++)
        *ld[i] = level;
}

void shoal_plan_load_held(const shoal_plan_in *in, const uint8_t *hold, double *load)
{
    const int L = in->num_layers, E = in->num_experts, W = in->nworkers;
    const size_t cells = (size_t)L * E;
    hot *hs = shoal_xmalloc((size_t)E * sizeof *hs);
    double **ld = shoal_xmalloc((size_t)W * sizeof *ld);
    for (size_t i = 0; i < (size_t)W * L; i++)
        load[i] = 0;
    for (int l = 0; l < L; l++) {
        if (!in->is_moe[l])
            continue;
        for (int e = 0; e < E; e++)
            hs[e] = (hot){in->hits ? in->hits[(size_t)l * E + e] : 1, e};
        qsort(hs, (size_t)E, sizeof *hs, cmp_hot);
        for (int i = 0; i < E; i++) {
            size_t c = (size_t)l * E + hs[i].e;
            int n = 0;
            for (int w = 0; w < W; w++)
                if (hold[(size_t)w * cells + c])
                    ld[n++] = &load[(size_t)w * L + l];
            if (n)
                pour(ld, n, (double)hs[i].hits);
        }
    }
    free(hs);
    free(ld);
}

int shoal_plan_redundant(const shoal_plan_in *in, int replicas, const int *domain, int ndomains, uint8_t *hold,
                         char *err, size_t errlen)
{
    const int L = in->num_layers, E = in->num_experts, W = in->nworkers;
    const size_t cells = (size_t)L * E;
    if (L <= 0 || E <= 0 || W <= 0 || in->expert_bytes == 0 || !in->is_moe || !in->budget)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan: empty model or no workers");
    if (replicas < 0)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "plan: %d replicas", replicas);
    int D = domain ? ndomains : W;
    if (D < replicas + 1)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "plan: --replicas %d puts every expert on %d distinct %s; the cluster has %d", replicas,
                             replicas + 1, domain ? "failure domains" : "worker hosts", D);
    int nmoe = 0;
    for (int l = 0; l < L; l++)
        nmoe += in->is_moe[l] != 0;
    const uint64_t N = (uint64_t)nmoe * (uint64_t)E, need = (uint64_t)(replicas + 1) * N;
    uint64_t *cap = shoal_xcalloc((size_t)W, sizeof *cap), *dcap = shoal_xcalloc((size_t)D, sizeof *dcap);
    uint64_t *dn = shoal_xcalloc((size_t)D, sizeof *dn), *hn = shoal_xcalloc((size_t)W, sizeof *hn);
    for (int w = 0; w < W; w++) {
        cap[w] = in->budget[w] / in->expert_bytes;
        if (cap[w] > N)
            cap[w] = N; /* a host holds each expert once */
        dcap[domain ? domain[w] : w] += cap[w];
    }
    uint64_t room = 0;
    for (int d = 0; d < D; d++) {
        if (dcap[d] > N)
            dcap[d] = N; /* and so does a domain */
        room += dcap[d];
    }
    int rc = 0;
    if (room < need) {
        uint64_t s = need - room;
        rc = shoal_err_set(err, errlen, SHOAL_ECONFIG,
                           "plan: --replicas %d needs each of the %llu routed experts on %d distinct %s: %llu expert "
                           "copies of %llu B; the budgets hold %llu (a %s holds an expert at most once): short by "
                           "%llu experts = %llu B (%.2f GiB)",
                           replicas, (unsigned long long)N, replicas + 1, domain ? "failure domains" : "hosts",
                           (unsigned long long)need, (unsigned long long)in->expert_bytes, (unsigned long long)room,
                           domain ? "domain" : "host", (unsigned long long)s,
                           (unsigned long long)(s * in->expert_bytes), (double)(s * in->expert_bytes) / 1073741824.0);
        goto out;
    }
    /* copies per domain as even as the budgets allow, then per host within it */
    water_fill(D, dcap, need, dn);
    {
        int *members = shoal_xmalloc((size_t)W * sizeof *members);
        uint64_t *mcap = shoal_xmalloc((size_t)W * sizeof *mcap), *mn = shoal_xmalloc((size_t)W * sizeof *mn);
        for (int d = 0; d < D; d++) {
            int m = 0;
            for (int w = 0; w < W; w++)
                if ((domain ? domain[w] : w) == d) {
                    members[m] = w;
                    mcap[m++] = cap[w];
                }
            if (m)
                water_fill(m, mcap, dn[d], mn);
            for (int j = 0; j < m; j++)
                hn[members[j]] = mn[j];
        }
        free(members);
        free(mcap);
        free(mn);
    }
    /* the cyclic order of the cells: layers interleaved (rank i of every MoE
     * layer, then rank i + 1), and within a layer, with hits, hottest and
     * coldest alternating, so that any run of it holds a fair share of every
     * layer's experts and of their load */
    {
        size_t *ord = shoal_xmalloc((size_t)N * sizeof *ord);
        hot *hs = shoal_xmalloc((size_t)E * sizeof *hs);
        int li = 0;
        for (int l = 0; l < L; l++) {
            if (!in->is_moe[l])
                continue;
            for (int e = 0; e < E; e++)
                hs[e] = (hot){in->hits ? in->hits[(size_t)l * E + e] : 0, e};
            if (in->hits)
                qsort(hs, (size_t)E, sizeof *hs, cmp_hot);
            for (int i = 0; i < E; i++) {
                int r = !in->hits ? i : (i % 2 == 0 ? i / 2 : E - 1 - i / 2);
                ord[(size_t)i * nmoe + li] = (size_t)l * E + hs[r].e;
            }
            li++;
        }
        /* wrap-around: domain after domain (hosts of a domain in turn) takes
         * the next run of the order repeated R + 1 times; a domain's run is
         * at most N long, so it holds distinct experts, and so copies of one
         * expert land in distinct domains */
        memset(hold, 0, (size_t)W * cells);
        uint64_t pos = 0;
        for (int d = 0; d < D; d++)
            for (int w = 0; w < W; w++) {
                if ((domain ? domain[w] : w) != d)
                    continue;
                for (uint64_t j = 0; j < hn[w]; j++, pos++)
                    hold[(size_t)w * cells + ord[pos % N]] = 1;
            }
        if (pos != need)
            SHOAL_PANIC("plan: %llu of %llu copies placed", (unsigned long long)pos, (unsigned long long)need);
        free(ord);
        free(hs);
    }
out:
    free(cap);
    free(dcap);
    free(dn);
    free(hn);
    return rc;
}

/* ---- RANGES --------------------------------------------------------------- */

typedef struct {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0)
            SHOAL_PANIC("vsnprintf");
        if (b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        b->cap = (b->cap ? b->cap * 2 : 256) + (size_t)k;
        b->s = shoal_xrealloc(b->s, b->cap);
        if (b->n == 0)
            b->s[0] = 0;
    }
}

/* Does w hold (owner or replica) cell c? With owner NULL, replica is a
 * hold bitmap cast (shoal_plan_ranges_held). */
static const uint8_t *held_map;
static size_t held_cells;
static int holds(const int32_t *owner, const int32_t *replica, size_t c, int w)
{
    if (!owner)
        return held_map[(size_t)w * held_cells + c] != 0;
    return owner[c] == w || (replica && replica[c] == w);
}

/* Do layers a and b have the same set of experts held by w? */
static int same_row(const int32_t *owner, const int32_t *replica, int E, int a, int b, int w)
{
    for (int e = 0; e < E; e++)
        if (holds(owner, replica, (size_t)a * E + e, w) != holds(owner, replica, (size_t)b * E + e, w))
            return 0;
    return 1;
}

int shoal_plan_ranges(const int32_t *owner, const int32_t *replica, int num_layers, const uint8_t *is_moe,
                      int num_experts, int w, char **out)
{
    const int E = num_experts;
    sbuf b = {0};
    sb_printf(&b, "%s", "");
    int first = 1;
    for (int l = 0; l < num_layers;) {
        if (!is_moe[l]) {
            l++;
            continue;
        }
        int hi = l;
        while (hi + 1 < num_layers && is_moe[hi + 1] && same_row(owner, replica, E, l, hi + 1, w))
            hi++;
        for (int e = 0; e < E;) {
            if (!holds(owner, replica, (size_t)l * E + e, w)) {
                e++;
                continue;
            }
            int ehi = e;
            while (ehi + 1 < E && holds(owner, replica, (size_t)l * E + ehi + 1, w))
                ehi++;
            if (l == hi)
                sb_printf(&b, "%s%d:", first ? "" : ",", l);
            else
                sb_printf(&b, "%s%d-%d:", first ? "" : ",", l, hi);
            if (e == ehi)
                sb_printf(&b, "%d", e);
            else
                sb_printf(&b, "%d-%d", e, ehi);
            first = 0;
            e = ehi + 1;
        }
        l = hi + 1;
    }
    *out = b.s;
    return 0;
}

int shoal_plan_ranges_held(const uint8_t *hold, int num_layers, const uint8_t *is_moe, int num_experts, int w,
                           char **out)
{
    held_map = hold;
    held_cells = (size_t)num_layers * (size_t)num_experts;
    int rc = shoal_plan_ranges(NULL, NULL, num_layers, is_moe, num_experts, w, out);
    held_map = NULL;
    return rc;
}
