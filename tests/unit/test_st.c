/* common/st: safetensors single files and sharded models, lookups, dtype
 * table, conversions, and every refusal (the committed malformed fixtures in
 * tests/bad/st/, listed with their expected messages in tests/bad/expect.tsv). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/st.h"
#include "test.h"

static char tmpdir[256];

static void mktmp(void)
{
    if (tmpdir[0])
        return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal_test_st_XXXXXX");
    if (!mkdtemp(tmpdir))
        SHOAL_PANIC("mkdtemp");
}

static const char *tpath(const char *name)
{
    static char buf[4][512];
    static int k;
    mktmp();
    char *b = buf[k++ & 3];
    snprintf(b, sizeof buf[0], "%s/%s", tmpdir, name);
    return b;
}

/* Writes an 8-byte little-endian length, the header, then `data` (n bytes). */
static void write_st(const char *path, const char *hdr, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    uint64_t h = strlen(hdr);
    unsigned char lb[8];
    for (int i = 0; i < 8; i++)
        lb[i] = (unsigned char)(h >> (8 * i));
    fwrite(lb, 1, 8, f);
    fwrite(hdr, 1, h, f);
    if (n)
        fwrite(data, 1, n, f);
    fclose(f);
}

static void write_text(const char *path, const char *s)
{
    FILE *f = fopen(path, "wb");
    fputs(s, f);
    fclose(f);
}

static void t_dtypes(void)
{
    static const struct {
        const char *name;
        size_t size;
    } want[] = {{"BF16", 2}, {"F16", 2},  {"F32", 4},  {"F64", 8},  {"U8", 1},      {"I8", 1},
                {"I16", 2},  {"I32", 4},  {"I64", 8},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
    CHECK_EQ_INT(sizeof want / sizeof want[0], SHOAL_DT_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        shoal_dtype dt;
        CHECK_EQ_INT(shoal_dtype_parse(want[i].name, &dt), 0);
        CHECK_EQ_INT(shoal_dtype_size(dt), want[i].size);
        CHECK(!strcmp(shoal_dtype_name(dt), want[i].name));
    }
    shoal_dtype dt;
    CHECK_EQ_INT(shoal_dtype_parse("bf16", &dt), SHOAL_EFORMAT);
    CHECK_EQ_INT(shoal_dtype_parse("F4", &dt), SHOAL_EFORMAT);
}

static void t_single_file(void)
{
    /* b: BF16 [2] = {1.0, -2.0}; a: F32 [1,2] = {0.5, 3}; h: F16 [2] = {1.0, 2^-24}; z: zero-size */
    unsigned char data[4 + 8 + 4];
    const uint16_t bf[2] = {0x3f80, 0xc000};
    const float f[2] = {0.5f, 3.0f};
    const uint16_t hf[2] = {0x3c00, 0x0001};
    memcpy(data, bf, 4);
    memcpy(data + 4, f, 8);
    memcpy(data + 12, hf, 4);
    /* header key order differs from data order on purpose, with escapes and
     * metadata; padded with spaces like the reference writer */
    write_st(tpath("one.safetensors"),
             "{\"__metadata__\":{\"format\":\"pt\"},"
             "\"a\\u002ex\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[4,12]},"
             " \"b\" : {\"shape\":[2],\"dtype\":\"BF16\",\"data_offsets\":[0,4]},"
             "\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[12,16]},"
             "\"z\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[16,16]},"
             "\"s\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}   ",
             data, sizeof data);
    /* s overlaps b: refused; rewrite without it first */
    shoal_st *st = NULL;
    char err[512];
    int rc = shoal_st_open(&st, tpath("one.safetensors"), NULL, err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_EFORMAT);
    CHECK_STR_CONTAINS(err, "overlap");
    write_st(tpath("one.safetensors"),
             "{\"__metadata__\":{\"format\":\"pt\"},"
             "\"a\\u002ex\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[4,12]},"
             " \"b\" : {\"shape\":[2],\"dtype\":\"BF16\",\"data_offsets\":[0,4]},"
             "\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[12,16]},"
             "\"z\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[16,16]}}   ",
             data, sizeof data);
    rc = shoal_st_open(&st, tpath("one.safetensors"), NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    CHECK_EQ_INT(shoal_st_count(st), 4);
    CHECK_EQ_INT(shoal_st_nfiles(st), 1);
    /* file order = data order */
    CHECK(!strcmp(shoal_st_at(st, 0)->name, "b"));
    CHECK(!strcmp(shoal_st_at(st, 1)->name, "a.x"));
    CHECK(!strcmp(shoal_st_at(st, 2)->name, "h"));
    CHECK(shoal_st_at(st, 4) == NULL);
    const shoal_tensor *a = shoal_st_find(st, "a.x");
    CHECK(a && a->dtype == SHOAL_DT_F32 && a->ndim == 2 && a->shape[0] == 1 && a->shape[1] == 2);
    CHECK(a && a->nbytes == 8);
    size_t hlen = strlen("{\"__metadata__\":{\"format\":\"pt\"},"
                         "\"a\\u002ex\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[4,12]},"
                         " \"b\" : {\"shape\":[2],\"dtype\":\"BF16\",\"data_offsets\":[0,4]},"
                         "\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[12,16]},"
                         "\"z\":{\"dtype\":\"I64\",\"shape\":[0,5],\"data_offsets\":[16,16]}}   ");
    CHECK(a && a->file_offset == 8 + hlen + 4);
    float out[2] = {0};
    CHECK(a && shoal_tensor_to_f32(a, out, 2) == 0 && out[0] == 0.5f && out[1] == 3.0f);
    const shoal_tensor *b = shoal_st_find(st, "b");
    CHECK(b && shoal_tensor_to_f32(b, out, 2) == 0 && out[0] == 1.0f && out[1] == -2.0f);
    CHECK(b && shoal_tensor_to_f32(b, out, 3) == SHOAL_EINVAL);
    const shoal_tensor *h = shoal_st_find(st, "h");
    CHECK(h && shoal_tensor_to_f32(h, out, 2) == 0 && out[0] == 1.0f && out[1] == 0x1p-24f);
    const shoal_tensor *z = shoal_st_find(st, "z");
    CHECK(z && z->nbytes == 0 && z->ndim == 2);
    CHECK(shoal_st_find(st, "a\\u002ex") == NULL);
    CHECK(shoal_st_find(st, "c") == NULL);
    CHECK(shoal_st_find(st, "__metadata__") == NULL);
    shoal_st_close(st);

    /* headers only: no data pointers */
    shoal_st_opts o = {.map = 0};
    rc = shoal_st_open(&st, tpath("one.safetensors"), &o, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (!rc) {
        CHECK(shoal_st_find(st, "b")->data == NULL);
        CHECK(shoal_tensor_to_f32(shoal_st_find(st, "b"), out, 2) == SHOAL_EINVAL);
        shoal_st_close(st);
    }
    shoal_st_close(NULL);
}

static void t_sharded(void)
{
    mktmp();
    char dir[512];
    snprintf(dir, sizeof dir, "%s/sharded", tmpdir);
    mkdir(dir, 0755);
    char p1[600], p2[600], pi[600];
    snprintf(p1, sizeof p1, "%s/m-2.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/m-1.safetensors", dir);
    snprintf(pi, sizeof pi, "%s/model.safetensors.index.json", dir);
    unsigned char d[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    write_st(p1, "{\"x.0\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                 "\"x.1\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[4,8]}}",
             d, 8);
    write_st(p2, "{\"y\":{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[0,4]}}", d, 4);
    write_text(pi, "{\"metadata\":{\"total_size\":12},\"weight_map\":{\"x.1\":\"m-2.safetensors\","
                   "\"y\":\"m-1.safetensors\",\"x.0\":\"m-2.safetensors\"}}");
    shoal_st *st = NULL;
    char err[512];
    int rc = shoal_st_open(&st, dir, NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    CHECK_EQ_INT(shoal_st_nfiles(st), 2);
    CHECK_EQ_INT(shoal_st_count(st), 3);
    /* files sorted by name: m-1 first */
    CHECK_STR_CONTAINS(shoal_st_file_path(st, 0), "m-1.safetensors");
    CHECK(shoal_st_file_path(st, 2) == NULL);
    CHECK(!strcmp(shoal_st_at(st, 0)->name, "y"));
    const shoal_tensor *x1 = shoal_st_find(st, "x.1");
    CHECK(x1 && x1->file == 1 && ((const unsigned char *)x1->data)[0] == 5);
    CHECK(x1 && x1->file_offset == 8 + strlen("{\"x.0\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
                                              "\"x.1\":{\"dtype\":\"U8\",\"shape\":[2,2],\"data_offsets\":[4,8]}}") +
                                          4);
    shoal_st_close(st);
    /* the index path itself also opens */
    rc = shoal_st_open(&st, pi, NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    shoal_st_close(st);
}

/* Shards are parsed on several threads; the refusal reported is always the
 * first failing file in file order (names sorted), whatever finishes first. */
static void t_first_error_is_deterministic(void)
{
    mktmp();
    char dir[512], p[700];
    snprintf(dir, sizeof dir, "%s/twobad", tmpdir);
    mkdir(dir, 0755);
    unsigned char d[64] = {0};
    char idx[4096];
    size_t o = (size_t)snprintf(idx, sizeof idx, "{\"weight_map\":{");
    for (int i = 0; i < 12; i++) {
        char name[64];
        snprintf(name, sizeof name, "m-%02d.safetensors", i);
        snprintf(p, sizeof p, "%s/%s", dir, name);
        /* files 5 and 9 are bad in different ways, the rest are fine */
        if (i == 5)
            write_st(p, "{\"t5\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[4,2]}}", d, 4);
        else if (i == 9)
            write_st(p, "{\"t9\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}", d, 1);
        else {
            char h[128];
            snprintf(h, sizeof h, "{\"t%d\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", i);
            write_st(p, h, d, 2);
        }
        o += (size_t)snprintf(idx + o, sizeof idx - o, "%s\"t%d\":\"%s\"", i ? "," : "", i, name);
    }
    snprintf(idx + o, sizeof idx - o, "}}");
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_text(p, idx);
    for (int rep = 0; rep < 20; rep++) {
        shoal_st *st = NULL;
        char err[512];
        CHECK_EQ_INT(shoal_st_open(&st, dir, NULL, err, sizeof err), SHOAL_EFORMAT);
        CHECK_STR_CONTAINS(err, "m-05.safetensors: tensor 't5': data_offsets begin 4 > end 2");
    }
}

/* Many tensors: every name found, absent names not found. */
static void t_lookup_many(void)
{
    enum { N = 20000 };
    size_t cap = (size_t)N * 80 + 64, o = 0;
    char *h = malloc(cap);
    o += (size_t)snprintf(h + o, cap - o, "{");
    for (int i = 0; i < N; i++)
        o += (size_t)snprintf(h + o, cap - o, "%s\"t.%d.w\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                              i ? "," : "", i, i, i + 1);
    o += (size_t)snprintf(h + o, cap - o, "}");
    char *data = calloc(N, 1);
    write_st(tpath("many.safetensors"), h, data, N);
    free(h);
    free(data);
    shoal_st *st = NULL;
    char err[512];
    int rc = shoal_st_open(&st, tpath("many.safetensors"), NULL, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    if (rc)
        return;
    CHECK_EQ_INT(shoal_st_count(st), N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        char name[32];
        snprintf(name, sizeof name, "t.%d.w", i);
        const shoal_tensor *t = shoal_st_find(st, name);
        bad += !t || t->file_offset - shoal_st_at(st, 0)->file_offset != (uint64_t)i;
        snprintf(name, sizeof name, "t.%d.x", i);
        bad += shoal_st_find(st, name) != NULL;
    }
    CHECK_EQ_INT(bad, 0);
    shoal_st_close(st);
}

/* Names with an escape, a multi-byte UTF-8 character or a forbidden control
 * byte at every position relative to the 8-byte words the scanner reads. */
static void t_string_positions(void)
{
    for (int k = 0; k < 20; k++) {
        char pad[32];
        memset(pad, 'a', (size_t)k);
        pad[k] = 0;
        static const struct {
            const char *json, *want; /* in the header / decoded */
        } cases[] = {{"\\\"q", "\"q"}, {"\\u00e9z", "\xc3\xa9z"}, {"\xc3\xa9z", "\xc3\xa9z"},
                     {"\\\\", "\\"}, {"\\/x", "/x"}};
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            char hdr[256], want[64];
            snprintf(hdr, sizeof hdr, "{\"%s%s%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", pad,
                     cases[c].json, pad);
            snprintf(want, sizeof want, "%s%s%s", pad, cases[c].want, pad);
            write_st(tpath("pos.safetensors"), hdr, "x", 1);
            shoal_st *st = NULL;
            char err[512];
            int rc = shoal_st_open(&st, tpath("pos.safetensors"), NULL, err, sizeof err);
            CHECK_MSG(rc == 0, "k=%d case %zu: %s", k, c, err);
            if (!rc) {
                CHECK_MSG(shoal_st_find(st, want) != NULL, "k=%d case %zu: name not decoded as expected", k, c);
                shoal_st_close(st);
            }
        }
        /* a raw control byte or a bad UTF-8 byte is refused wherever it sits */
        static const char *const badc[] = {"\x01", "\x1f", "\xff", "\xc3(", "\t"};
        for (size_t c = 0; c < sizeof badc / sizeof badc[0]; c++) {
            char hdr[256];
            snprintf(hdr, sizeof hdr, "{\"%s%s%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", pad,
                     badc[c], pad);
            write_st(tpath("pos.safetensors"), hdr, "x", 1);
            shoal_st *st = NULL;
            char err[512];
            CHECK_MSG(shoal_st_open(&st, tpath("pos.safetensors"), NULL, err, sizeof err) == SHOAL_EFORMAT,
                      "k=%d bad %zu accepted", k, c);
            CHECK_STR_CONTAINS(err, "malformed JSON");
        }
    }
}

/* The committed malformed fixtures: each refused with its own message. */
static void t_bad_fixtures(void)
{
    FILE *f = fopen(test_src_path("tests/bad/expect.tsv"), "r");
    CHECK(f != NULL);
    if (!f)
        return;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n')
            continue;
        line[strcspn(line, "\n")] = 0;
        char *kind = strtok(line, "\t"), *rel = strtok(NULL, "\t"), *msg = strtok(NULL, "\t");
        if (!kind || !rel || !msg || strcmp(kind, "st"))
            continue;
        shoal_st *st = NULL;
        char err[1024] = "";
        int rc = shoal_st_open(&st, test_src_path(rel), NULL, err, sizeof err);
        CHECK_MSG(rc != 0, "%s was accepted", rel);
        CHECK_MSG(strstr(err, msg) != NULL, "%s: expected \"%s\" in \"%s\"", rel, msg, err);
        /* the message names the fixture's file (or, for an index, its directory) */
        char who[256];
        snprintf(who, sizeof who, "%s", rel + strlen("tests/bad/st/"));
        who[strcspn(who, "/")] = 0;
        CHECK_MSG(strstr(err, who) != NULL, "%s: message does not name %s: %s", rel, who, err);
        shoal_st_close(st);
        n++;
    }
    fclose(f);
    CHECK_MSG(n >= 12, "only %d st fixtures", n);
}

static void t_missing_path(void)
{
    shoal_st *st = (shoal_st *)1;
    char err[256];
    CHECK_EQ_INT(shoal_st_open(&st, tpath("nope.safetensors"), NULL, err, sizeof err), -ENOENT);
    CHECK(st == NULL);
    CHECK_STR_CONTAINS(err, "nope.safetensors");
    mktmp();
    char d[512];
    snprintf(d, sizeof d, "%s/emptydir", tmpdir);
    mkdir(d, 0755);
    CHECK_EQ_INT(shoal_st_open(&st, d, NULL, err, sizeof err), SHOAL_ENOTFOUND);
    CHECK_STR_CONTAINS(err, "neither model.safetensors.index.json nor model.safetensors");
}

int main(void)
{
    test_binary = "test_st";
    RUN(t_dtypes);
    RUN(t_single_file);
    RUN(t_sharded);
    RUN(t_first_error_is_deterministic);
    RUN(t_lookup_many);
    RUN(t_string_positions);
    RUN(t_bad_fixtures);
    RUN(t_missing_path);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (tmpdir[0] && system(cmd) != 0)
        fprintf(stderr, "could not remove %s\n", tmpdir);
    return test_finish();
}
