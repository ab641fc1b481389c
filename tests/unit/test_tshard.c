/* proto/tshard: the ROWSPEC grammar (PROTOCOL.md §7.1), the check of announced
 * rows and the placement of row shards over workers. Expected rows are worked
 * out by hand from the grammar's formula (i/n: rows floor(iR/n) ..
 * floor((i+1)R/n)-1), the cells (cut at every boundary, each owner's range the
 * one reaching farthest) and the pick rule (the live owner with the fewest
 * rows so far, ties to the lower worker), on three small matrices of 10, 7 and
 * 5 rows; plus the list of row-shardable matrices of tests/models/tiny-k3. */
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/k3cfg.h"
#include "proto/tshard.h"
#include "test.h"

#define QN "language_model.model.layers.0.self_attn.q_proj.weight"
#define KN "language_model.model.layers.0.self_attn.k_proj.weight"
#define LN "language_model.lm_head.weight"

static const shoal_tshard_mat M[3] = {
    {.name = QN, .rows = 10, .cols = 8, .layer = 0},
    {.name = KN, .rows = 7, .cols = 8, .layer = 0},
    {.name = LN, .rows = 5, .cols = 8, .layer = -1},
};

/* parse spec; expect n entries equal to want (name, lo, hi) */
static void expect_parse(const char *spec, size_t n, const shoal_proto_trows *want)
{
    shoal_proto_trows *t = NULL;
    size_t nt = 0;
    char err[256] = "";
    int rc = shoal_tshard_parse(spec, M, 3, &t, &nt, err, sizeof err);
    CHECK_MSG(rc == 0, "%s: %s", spec, err);
    CHECK_MSG(nt == n, "%s: %zu entries, want %zu", spec, nt, n);
    for (size_t i = 0; rc == 0 && i < n && i < nt; i++)
        CHECK_MSG(!strcmp(t[i].name, want[i].name) && t[i].lo == want[i].lo && t[i].hi == want[i].hi,
                  "%s: entry %zu is %s %u-%u, want %s %u-%u", spec, i, t[i].name, t[i].lo, t[i].hi, want[i].name,
                  want[i].lo, want[i].hi);
    free(t);
}

static void expect_refused(const char *spec, int code, const char *needle)
{
    shoal_proto_trows *t = (shoal_proto_trows *)1;
    size_t nt = 99;
    char err[256] = "";
    int rc = shoal_tshard_parse(spec, M, 3, &t, &nt, err, sizeof err);
    CHECK_MSG(rc == code, "'%s': rc %d, want %d (%s)", spec, rc, code, err);
    CHECK(t == NULL && nt == 0);
    CHECK_STR_CONTAINS(err, needle);
}

static void t_parse(void)
{
    /* thirds: 10 rows -> 0-2, 3-5, 6-9; 7 rows -> 0-1, 2-3, 4-6; 5 rows -> 0, 1-2, 3-4 */
    expect_parse("*:1/3", 3, (shoal_proto_trows[]){{QN, 3, 5}, {KN, 2, 3}, {LN, 1, 2}});
    expect_parse("*:2/3", 3, (shoal_proto_trows[]){{QN, 6, 9}, {KN, 4, 6}, {LN, 3, 4}});
    expect_parse("*:0/3", 3, (shoal_proto_trows[]){{QN, 0, 2}, {KN, 0, 1}, {LN, 0, 0}});
    /* n = R: one row each; the short name (without language_model.) matches */
    expect_parse("lm_head.weight:4/5", 1, (shoal_proto_trows[]){{LN, 4, 4}});
    expect_parse("lm_head.weight:all", 1, (shoal_proto_trows[]){{LN, 0, 4}});
    expect_parse(LN ":2", 1, (shoal_proto_trows[]){{LN, 2, 2}});
    expect_parse("model.layers.0.self_attn.q_proj.weight:4", 1, (shoal_proto_trows[]){{QN, 4, 4}});
    /* a glob over two matrices, items in order, each item's matches in schema order */
    expect_parse("lm_head.weight:0-1,*_proj.weight:0-6", 3,
                 (shoal_proto_trows[]){{LN, 0, 1}, {QN, 0, 6}, {KN, 0, 6}});
    expect_parse("*q_proj*:2-9,*q_proj*:0-0", 2, (shoal_proto_trows[]){{QN, 2, 9}, {QN, 0, 0}});
    expect_parse("*.?_proj.weight:1/2", 2, (shoal_proto_trows[]){{QN, 5, 9}, {KN, 3, 6}});
}

static void t_parse_refusals(void)
{
    expect_refused("", SHOAL_EINVAL, "empty ROWSPEC");
    expect_refused("lm_head.weight", SHOAL_EINVAL, "is not PATTERN:ROWS");
    expect_refused(":all", SHOAL_EINVAL, "is not PATTERN:ROWS");
    expect_refused("*:all,,*:0", SHOAL_EINVAL, "is not PATTERN:ROWS");
    expect_refused("*:5-3", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:a-b", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:-1", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:0/0", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:1/", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:2147483648", SHOAL_EINVAL, "ROWS must be"); /* past INT32_MAX */
    expect_refused("*:12345678901", SHOAL_EINVAL, "ROWS must be");
    expect_refused("*:3/3", SHOAL_ERANGE, "has 10 rows");           /* i >= n */
    expect_refused("lm_head.weight:0/6", SHOAL_ERANGE, "has 5 rows"); /* n > R */
    /* row 7 exists in q_proj (10 rows) but not in k_proj (7): names k_proj */
    expect_refused("*_proj.weight:7", SHOAL_ERANGE, KN " has 7 rows");
    expect_refused("lm_head.weight:3-5", SHOAL_ERANGE, LN " has 5 rows");
    expect_refused("*embed_tokens*:all", SHOAL_ERANGE, "matches no row-shardable trunk matrix");
    expect_refused("lm_head.weight:all,nothing:0", SHOAL_ERANGE, "'nothing' matches no");
}

static void t_check(void)
{
    char err[256];
    shoal_proto_trows ok[2] = {{QN, 0, 9}, {LN, 4, 4}};
    CHECK_EQ_INT(shoal_tshard_check(ok, 2, M, 3, err, sizeof err), 0);
    shoal_proto_trows past[1] = {{KN, 3, 7}};
    CHECK_EQ_INT(shoal_tshard_check(past, 1, M, 3, err, sizeof err), SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "trunk rows 3-7 of " KN ": the matrix has 7 rows");
    shoal_proto_trows inv[1] = {{QN, 5, 4}};
    CHECK_EQ_INT(shoal_tshard_check(inv, 1, M, 3, err, sizeof err), SHOAL_ERANGE);
    shoal_proto_trows unk[1] = {{"language_model.model.embed_tokens.weight", 0, 0}};
    CHECK_EQ_INT(shoal_tshard_check(unk, 1, M, 3, err, sizeof err), SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, "not a row-shardable matrix of this model");
}

/* cells over nw workers; expect the cells (mat, lo, hi, owners as (w, range) pairs) and remote flags */
typedef struct {
    int mat;
    uint32_t lo, hi;
    int n;
    int ow[4][2];
} want_cell;

static void expect_cells(int nw, const shoal_proto_trows *const *t, const size_t *nt, const uint8_t want_remote[3],
                         size_t n, const want_cell *want)
{
    uint8_t remote[3];
    shoal_tshard_cell *c = NULL;
    shoal_tshard_owner *o = NULL;
    size_t nc = 0, no = 0;
    char err[512] = "";
    int rc = shoal_tshard_cells(M, 3, nw, t, nt, remote, &c, &nc, &o, &no, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(!memcmp(remote, want_remote, 3));
    CHECK_MSG(nc == n, "%zu cells, want %zu", nc, n);
    for (size_t i = 0; rc == 0 && i < n && i < nc; i++) {
        CHECK_MSG(c[i].mat == want[i].mat && c[i].lo == want[i].lo && c[i].hi == want[i].hi &&
                      (int)c[i].n == want[i].n,
                  "cell %zu: mat %d %u-%u with %u owners, want mat %d %u-%u with %d", i, c[i].mat, c[i].lo, c[i].hi,
                  c[i].n, want[i].mat, want[i].lo, want[i].hi, want[i].n);
        for (int j = 0; j < want[i].n && j < (int)c[i].n; j++)
            CHECK_MSG(o[c[i].off + j].w == want[i].ow[j][0] && o[c[i].off + j].range == want[i].ow[j][1],
                      "cell %zu owner %d: (%d, %d), want (%d, %d)", i, j, o[c[i].off + j].w, o[c[i].off + j].range,
                      want[i].ow[j][0], want[i].ow[j][1]);
    }
    free(c);
    free(o);
}

static void t_cells(void)
{
    /* halves of q_proj: two cells of one owner each; k_proj and lm_head stay local */
    {
        shoal_proto_trows a[] = {{QN, 0, 4}}, b[] = {{QN, 5, 9}};
        const shoal_proto_trows *t[] = {a, b};
        expect_cells(2, t, (size_t[]){1, 1}, (uint8_t[]){1, 0, 0}, 2,
                     (want_cell[]){{0, 0, 4, 1, {{0, 0}}}, {0, 5, 9, 1, {{1, 0}}}});
    }
    /* overlaps: cut at 3 and 7 (w0 0-6, w1 3-9, w2 0-9) */
    {
        shoal_proto_trows a[] = {{QN, 0, 6}}, b[] = {{QN, 3, 9}}, c[] = {{QN, 0, 9}};
        const shoal_proto_trows *t[] = {a, b, c};
        expect_cells(3, t, (size_t[]){1, 1, 1}, (uint8_t[]){1, 0, 0}, 3,
                     (want_cell[]){{0, 0, 2, 2, {{0, 0}, {2, 0}}},
                                   {0, 3, 6, 3, {{0, 0}, {1, 0}, {2, 0}}},
                                   {0, 7, 9, 2, {{1, 0}, {2, 0}}}});
    }
    /* every row owned twice, same range: one cell, two owners */
    {
        shoal_proto_trows a[] = {{LN, 0, 4}}, b[] = {{LN, 0, 4}};
        const shoal_proto_trows *t[] = {a, b};
        expect_cells(2, t, (size_t[]){1, 1}, (uint8_t[]){0, 0, 1}, 1, (want_cell[]){{2, 0, 4, 2, {{0, 0}, {1, 0}}}});
    }
    /* a part and the whole matrix on each worker: the whole (reaching
     * farthest; for w1's rows 5-9, the one starting lowest) holds every row,
     * so the cut at 5 joins again: one cell */
    {
        shoal_proto_trows a[] = {{QN, 0, 4}, {QN, 0, 9}}, b[] = {{QN, 5, 9}, {QN, 0, 9}};
        const shoal_proto_trows *t[] = {a, b};
        expect_cells(2, t, (size_t[]){2, 2}, (uint8_t[]){1, 0, 0}, 1, (want_cell[]){{0, 0, 9, 2, {{0, 1}, {1, 1}}}});
    }
    /* two adjacent ranges of one worker stay two cells (one segment may not span them) */
    {
        shoal_proto_trows a[] = {{QN, 0, 4}, {QN, 5, 9}};
        const shoal_proto_trows *t[] = {a};
        expect_cells(1, t, (size_t[]){2}, (uint8_t[]){1, 0, 0}, 2,
                     (want_cell[]){{0, 0, 4, 1, {{0, 0}}}, {0, 5, 9, 1, {{0, 1}}}});
    }
    /* interleaved stripes of q and k, listed out of order: cells by matrix then row */
    {
        shoal_proto_trows a[] = {{QN, 8, 9}, {QN, 0, 1}, {QN, 4, 5}, {KN, 0, 6}}, b[] = {{QN, 6, 7}, {QN, 2, 3}};
        const shoal_proto_trows *t[] = {a, b};
        expect_cells(2, t, (size_t[]){4, 2}, (uint8_t[]){1, 1, 0}, 6,
                     (want_cell[]){{0, 0, 1, 1, {{0, 1}}}, {0, 2, 3, 1, {{1, 1}}}, {0, 4, 5, 1, {{0, 2}}},
                                   {0, 6, 7, 1, {{1, 0}}}, {0, 8, 9, 1, {{0, 0}}}, {1, 0, 6, 1, {{0, 3}}}});
    }
    /* a worker with no trunk rows between two that have some */
    {
        shoal_proto_trows a[] = {{KN, 0, 3}}, c[] = {{KN, 4, 6}};
        const shoal_proto_trows *t[] = {a, NULL, c};
        expect_cells(3, t, (size_t[]){1, 0, 1}, (uint8_t[]){0, 1, 0}, 2,
                     (want_cell[]){{1, 0, 3, 1, {{0, 0}}}, {1, 4, 6, 1, {{2, 0}}}});
    }
}

/* A ring of replicas (shoal plan --trunk spread --replicas 1 on 4 workers):
 * q_proj's quarters 0-1, 2-4, 5-6, 7-9 (rows floor(10i/4)), quarter p on
 * workers p (listed first) and p + 1 mod 4. */
static void t_pick(void)
{
    shoal_proto_trows a[] = {{QN, 0, 1}, {QN, 7, 9}}, b[] = {{QN, 2, 4}, {QN, 0, 1}}, c[] = {{QN, 5, 6}, {QN, 2, 4}},
                      d[] = {{QN, 7, 9}, {QN, 5, 6}};
    const shoal_proto_trows *t[] = {a, b, c, d};
    expect_cells(4, t, (size_t[]){2, 2, 2, 2}, (uint8_t[]){1, 0, 0}, 4,
                 (want_cell[]){{0, 0, 1, 2, {{0, 0}, {1, 1}}}, {0, 2, 4, 2, {{1, 0}, {2, 1}}},
                               {0, 5, 6, 2, {{2, 0}, {3, 1}}}, {0, 7, 9, 2, {{0, 1}, {3, 0}}}});
    uint8_t remote[3];
    shoal_tshard_cell *cl = NULL;
    shoal_tshard_owner *o = NULL;
    size_t nc = 0, no = 0;
    char err[256];
    CHECK_EQ_INT(shoal_tshard_cells(M, 3, 4, t, (size_t[]){2, 2, 2, 2}, remote, &cl, &nc, &o, &no, err, sizeof err),
                 0);
    if (nc != 4)
        return;
    uint64_t load[4];
    int32_t pick[4];
    int w[4];
#define WORKERS()                                                                                                  \
    for (int i = 0; i < 4; i++)                                                                                    \
    w[i] = pick[i] < 0 ? -1 : o[pick[i]].w
    /* all up: each quarter to its first holder (ties to the lower index, and
     * the worker that already has rows of the matrix is passed over) */
    shoal_tshard_pick(cl, 4, o, 4, NULL, NULL, load, pick);
    WORKERS();
    CHECK_MSG(w[0] == 0 && w[1] == 1 && w[2] == 2 && w[3] == 3, "all up: %d %d %d %d", w[0], w[1], w[2], w[3]);
    /* w1 down: 0-1 -> w0; 2-4 -> w2; 5-6 -> w3 (w2 has 3 rows, w3 none);
     * 7-9 -> w0 (w0 and w3 have 2 rows each: the lower index) */
    shoal_tshard_pick(cl, 4, o, 4, (uint8_t[]){1, 0, 1, 1}, NULL, load, pick);
    WORKERS();
    CHECK_MSG(w[0] == 0 && w[1] == 2 && w[2] == 3 && w[3] == 0, "w1 down: %d %d %d %d", w[0], w[1], w[2], w[3]);
    CHECK_MSG(load[0] == 5 && load[1] == 0 && load[2] == 3 && load[3] == 2, "loads %llu %llu %llu %llu",
              (unsigned long long)load[0], (unsigned long long)load[1], (unsigned long long)load[2],
              (unsigned long long)load[3]);
    /* w0 and w1 down: 0-1 has no live owner (-1), the rest to w2, w3, w3 */
    shoal_tshard_pick(cl, 4, o, 4, (uint8_t[]){0, 0, 1, 1}, NULL, load, pick);
    WORKERS();
    CHECK_MSG(w[0] == -1 && w[1] == 2 && w[2] == 3 && w[3] == 3, "w0, w1 down: %d %d %d %d", w[0], w[1], w[2], w[3]);
    /* a resend: only quarters 1 and 2 wanted (w2 lost), the others untouched */
    pick[0] = pick[3] = -7;
    shoal_tshard_pick(cl, 4, o, 4, (uint8_t[]){1, 1, 0, 1}, (uint8_t[]){0, 1, 1, 0}, load, pick);
    CHECK_MSG(pick[0] == -7 && pick[3] == -7 && o[pick[1]].w == 1 && o[pick[2]].w == 3, "resend: %d %d %d %d",
              pick[0], pick[1], pick[2], pick[3]);
#undef WORKERS
    free(cl);
    free(o);
}

static void t_cells_refusals(void)
{
    uint8_t remote[3];
    shoal_tshard_cell *c = (shoal_tshard_cell *)1;
    shoal_tshard_owner *o = (shoal_tshard_owner *)1;
    size_t nc = 99, no = 99;
    char err[512];
    /* gaps: q rows 3-5 and 7-9, k rows 4-6; lm_head is not remote, so no gap */
    {
        shoal_proto_trows a[] = {{QN, 0, 2}, {QN, 6, 6}}, b[] = {{KN, 0, 3}};
        const shoal_proto_trows *t[] = {a, b};
        CHECK_EQ_INT(shoal_tshard_cells(M, 3, 2, t, (size_t[]){2, 1}, remote, &c, &nc, &o, &no, err, sizeof err),
                     SHOAL_ECONFIG);
        CHECK(c == NULL && nc == 0 && o == NULL && no == 0);
        CHECK_STR_CONTAINS(err, "trunk rows owned by no worker (3 gaps): " QN " rows 3-5, " QN " rows 7-9, " KN
                                " rows 4-6");
        CHECK(!strstr(err, LN));
    }
    /* one gap at the start of a matrix; one between two ranges of a worker */
    {
        shoal_proto_trows a[] = {{LN, 2, 4}};
        const shoal_proto_trows *t[] = {a};
        CHECK_EQ_INT(shoal_tshard_cells(M, 3, 1, t, (size_t[]){1}, remote, &c, &nc, &o, &no, err, sizeof err),
                     SHOAL_ECONFIG);
        CHECK_STR_CONTAINS(err, "(1 gap): " LN " rows 0-1");
        shoal_proto_trows b[] = {{KN, 0, 1}, {KN, 5, 6}};
        const shoal_proto_trows *u[] = {b};
        CHECK_EQ_INT(shoal_tshard_cells(M, 3, 1, u, (size_t[]){2}, remote, &c, &nc, &o, &no, err, sizeof err),
                     SHOAL_ECONFIG);
        CHECK_STR_CONTAINS(err, "(1 gap): " KN " rows 2-4");
    }
    /* rows outside the model */
    {
        shoal_proto_trows a[] = {{LN, 0, 5}};
        const shoal_proto_trows *t[] = {a};
        CHECK_EQ_INT(shoal_tshard_cells(M, 3, 1, t, (size_t[]){1}, remote, &c, &nc, &o, &no, err, sizeof err),
                     SHOAL_ERANGE);
        shoal_proto_trows b[] = {{"language_model.model.norm.weight", 0, 0}};
        const shoal_proto_trows *u[] = {b};
        CHECK_EQ_INT(shoal_tshard_cells(M, 3, 1, u, (size_t[]){1}, remote, &c, &nc, &o, &no, err, sizeof err),
                     SHOAL_ERANGE);
        CHECK_STR_CONTAINS(err, "outside the model");
    }
}

/* tiny-k3 (hidden 96, vocab 4096, 9 layers: 1 dense + 8 MoE): lm_head and the
 * projections are listed with their shapes; embed_tokens and kv_b_proj are not */
static void t_mats_tiny(void)
{
    shoal_k3cfg c;
    char err[256];
    if (shoal_k3cfg_load(&c, test_src_path("tests/models/tiny-k3/config.json"), err, sizeof err))
        SKIP("tests/models/tiny-k3/config.json: %s", err);
    shoal_tshard_mat *m = NULL;
    int n = 0;
    CHECK_EQ_INT(shoal_tshard_mats(&c, &m, &n), 0);
    int lm = shoal_tshard_find(m, n, LN);
    CHECK(lm >= 0);
    if (lm >= 0) {
        CHECK_EQ_INT(m[lm].rows, 4096);
        CHECK_EQ_INT(m[lm].cols, 96);
    }
    int gate = shoal_tshard_find(m, n, "language_model.model.layers.0.mlp.gate_proj.weight");
    CHECK(gate >= 0);
    if (gate >= 0) {
        CHECK_EQ_INT(m[gate].rows, 192); /* intermediate_size */
        CHECK_EQ_INT(m[gate].cols, 96);
        CHECK_EQ_INT(m[gate].layer, 0);
    }
    for (int i = 0; i < n; i++) {
        CHECK_MSG(!strstr(m[i].name, "embed_tokens") && !strstr(m[i].name, "kv_b_proj") &&
                      !strstr(m[i].name, ".experts."),
                  "%s is listed", m[i].name);
        CHECK(m[i].rows >= 2);
    }
    free(m);
}

/* The spread spec of `--workers N --trunk remote` (issue 34): part i of n,
 * f_a whole only when the model has one, refused past the smallest matrix */
static void t_spread_spec(void)
{
    char buf[96], err[256] = "";
    CHECK_EQ_INT(shoal_tshard_spread_spec(M, 3, 1, 3, buf, sizeof buf, err, sizeof err), 0);
    CHECK_MSG(!strcmp(buf, "*:1/3"), "spec %s", buf);
    CHECK_EQ_INT(shoal_tshard_spread_spec(M, 3, 4, 5, buf, sizeof buf, err, sizeof err), 0);
    CHECK_MSG(!strcmp(buf, "*:4/5"), "spec %s", buf);
    /* 6 parts: lm_head has 5 rows */
    CHECK_EQ_INT(shoal_tshard_spread_spec(M, 3, 0, 6, buf, sizeof buf, err, sizeof err), SHOAL_ERANGE);
    CHECK_STR_CONTAINS(err, LN " has 5 rows");
    CHECK_EQ_INT(shoal_tshard_spread_spec(M, 3, 3, 3, buf, sizeof buf, err, sizeof err), SHOAL_EINVAL);
    CHECK_EQ_INT(shoal_tshard_spread_spec(M, 3, 0, 2, buf, 4, err, sizeof err), SHOAL_EINVAL);
    const shoal_tshard_mat fa[2] = {{.name = "language_model.model.layers.0.self_attn.f_a_proj.weight", .rows = 4,
                                     .cols = 8, .layer = 0},
                                    {.name = QN, .rows = 10, .cols = 8, .layer = 0}};
    CHECK_EQ_INT(shoal_tshard_spread_spec(fa, 2, 1, 2, buf, sizeof buf, err, sizeof err), 0);
    CHECK_MSG(!strcmp(buf, "*:1/2,*.f_a_proj.weight:all"), "spec %s", buf);
    /* the spec parses back to part 1 of 2 of q, and f_a's part and f_a whole */
    shoal_proto_trows *t = NULL;
    size_t nt = 0;
    CHECK_EQ_INT(shoal_tshard_parse(buf, fa, 2, &t, &nt, err, sizeof err), 0);
    CHECK(nt == 3 && t && t[1].lo == 5 && t[1].hi == 9 && t[2].lo == 0 && t[2].hi == 3);
    free(t);
}

int main(void)
{
    test_binary = "test_tshard";
    RUN(t_parse);
    RUN(t_parse_refusals);
    RUN(t_check);
    RUN(t_cells);
    RUN(t_pick);
    RUN(t_cells_refusals);
    RUN(t_mats_tiny);
    RUN(t_spread_spec);
    return test_finish();
}
