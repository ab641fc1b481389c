/* proto/tshard: the ROWSPEC grammar (PROTOCOL.md §7.1), the check of announced
 * rows and the placement of row shards over workers. Expected rows are worked
 * out by hand from the grammar's formula (i/n: rows floor(iR/n) ..
 * floor((i+1)R/n)-1) and the placement rule (the owner whose range reaches
 * farthest, ties to the lower worker), on three small matrices of 10, 7 and 5
 * rows; plus the list of row-shardable matrices of tests/models/tiny-k3. */
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

/* place over nw workers; expect the pieces (mat, w, lo, hi) and remote flags */
static void expect_place(int nw, const shoal_proto_trows *const *t, const size_t *nt, const uint8_t want_remote[3],
                         size_t n, const shoal_tshard_piece *want)
{
    uint8_t remote[3];
    shoal_tshard_piece *p = NULL;
    size_t np = 0;
    char err[512] = "";
    int rc = shoal_tshard_place(M, 3, nw, t, nt, remote, &p, &np, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(!memcmp(remote, want_remote, 3));
    CHECK_MSG(np == n, "%zu pieces, want %zu", np, n);
    for (size_t i = 0; rc == 0 && i < n && i < np; i++)
        CHECK_MSG(p[i].mat == want[i].mat && p[i].w == want[i].w && p[i].lo == want[i].lo && p[i].hi == want[i].hi,
                  "piece %zu: mat %d w %d %u-%u, want mat %d w %d %u-%u", i, p[i].mat, p[i].w, p[i].lo, p[i].hi,
                  want[i].mat, want[i].w, want[i].lo, want[i].hi);
    free(p);
}

static void t_place(void)
{
    /* halves of q_proj: two pieces; k_proj and lm_head stay local */
    {
        shoal_proto_trows a[] = {{QN, 0, 4}}, b[] = {{QN, 5, 9}};
        const shoal_proto_trows *t[] = {a, b};
        expect_place(2, t, (size_t[]){1, 1}, (uint8_t[]){1, 0, 0}, 2,
                     (shoal_tshard_piece[]){{0, 0, 0, 4}, {0, 1, 5, 9}});
    }
    /* overlap: w2 owns all of q and reaches farthest from row 0 -> one piece */
    {
        shoal_proto_trows a[] = {{QN, 0, 6}}, b[] = {{QN, 3, 9}}, c[] = {{QN, 0, 9}};
        const shoal_proto_trows *t[] = {a, b, c};
        expect_place(3, t, (size_t[]){1, 1, 1}, (uint8_t[]){1, 0, 0}, 1, (shoal_tshard_piece[]){{0, 2, 0, 9}});
    }
    /* a tie (every row owned twice, same reach): the lower worker index */
    {
        shoal_proto_trows a[] = {{LN, 0, 4}}, b[] = {{LN, 0, 4}};
        const shoal_proto_trows *t[] = {a, b};
        expect_place(2, t, (size_t[]){1, 1}, (uint8_t[]){0, 0, 1}, 1, (shoal_tshard_piece[]){{2, 0, 0, 4}});
    }
    /* a chain: w0 0-5, w1 3-9 -> w0 0-5 (only owner of row 0), then w1 6-9 */
    {
        shoal_proto_trows a[] = {{QN, 0, 5}}, b[] = {{QN, 3, 9}};
        const shoal_proto_trows *t[] = {a, b};
        expect_place(2, t, (size_t[]){1, 1}, (uint8_t[]){1, 0, 0}, 2,
                     (shoal_tshard_piece[]){{0, 0, 0, 5}, {0, 1, 6, 9}});
    }
    /* interleaved stripes of q and k, listed out of order: pieces by matrix then row */
    {
        shoal_proto_trows a[] = {{QN, 8, 9}, {QN, 0, 1}, {QN, 4, 5}, {KN, 0, 6}}, b[] = {{QN, 6, 7}, {QN, 2, 3}};
        const shoal_proto_trows *t[] = {a, b};
        expect_place(2, t, (size_t[]){4, 2}, (uint8_t[]){1, 1, 0}, 6,
                     (shoal_tshard_piece[]){{0, 0, 0, 1}, {0, 1, 2, 3}, {0, 0, 4, 5}, {0, 1, 6, 7}, {0, 0, 8, 9},
                                            {1, 0, 0, 6}});
    }
    /* a worker with no trunk rows between two that have some */
    {
        shoal_proto_trows a[] = {{KN, 0, 3}}, c[] = {{KN, 4, 6}};
        const shoal_proto_trows *t[] = {a, NULL, c};
        expect_place(3, t, (size_t[]){1, 0, 1}, (uint8_t[]){0, 1, 0}, 2,
                     (shoal_tshard_piece[]){{1, 0, 0, 3}, {1, 2, 4, 6}});
    }
}

static void t_place_refusals(void)
{
    uint8_t remote[3];
    shoal_tshard_piece *p = (shoal_tshard_piece *)1;
    size_t np = 99;
    char err[512];
    /* gaps: q rows 3-5 and 7-9, k rows 4-6; lm_head is not remote, so no gap */
    {
        shoal_proto_trows a[] = {{QN, 0, 2}, {QN, 6, 6}}, b[] = {{KN, 0, 3}};
        const shoal_proto_trows *t[] = {a, b};
        CHECK_EQ_INT(shoal_tshard_place(M, 3, 2, t, (size_t[]){2, 1}, remote, &p, &np, err, sizeof err),
                     SHOAL_ECONFIG);
        CHECK(p == NULL && np == 0);
        CHECK_STR_CONTAINS(err, "trunk rows owned by no worker (3 gaps): " QN " rows 3-5, " QN " rows 7-9, " KN
                                " rows 4-6");
        CHECK(!strstr(err, LN));
    }
    /* one gap at the start of a matrix */
    {
        shoal_proto_trows a[] = {{LN, 2, 4}};
        const shoal_proto_trows *t[] = {a};
        CHECK_EQ_INT(shoal_tshard_place(M, 3, 1, t, (size_t[]){1}, remote, &p, &np, err, sizeof err),
                     SHOAL_ECONFIG);
        CHECK_STR_CONTAINS(err, "(1 gap): " LN " rows 0-1");
    }
    /* rows outside the model */
    {
        shoal_proto_trows a[] = {{LN, 0, 5}};
        const shoal_proto_trows *t[] = {a};
        CHECK_EQ_INT(shoal_tshard_place(M, 3, 1, t, (size_t[]){1}, remote, &p, &np, err, sizeof err), SHOAL_ERANGE);
        shoal_proto_trows b[] = {{"language_model.model.norm.weight", 0, 0}};
        const shoal_proto_trows *u[] = {b};
        CHECK_EQ_INT(shoal_tshard_place(M, 3, 1, u, (size_t[]){1}, remote, &p, &np, err, sizeof err), SHOAL_ERANGE);
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

int main(void)
{
    test_binary = "test_tshard";
    RUN(t_parse);
    RUN(t_parse_refusals);
    RUN(t_check);
    RUN(t_place);
    RUN(t_place_refusals);
    RUN(t_mats_tiny);
    return test_finish();
}
