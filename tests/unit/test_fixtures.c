/* Committed ground truth is intact: every model and fixture file listed in
 * tests/fixtures/MANIFEST.json has the recorded sha256 (libsodium), no file in
 * those directories is missing from the manifest, and each fixture has the
 * fields and sizes docs/TESTING.md promises (so the engine's tests cannot pass
 * by reading an empty or truncated fixture). */
#include <dirent.h>
#include <jansson.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "test.h"

static json_t *manifest;

static int sha256_file(const char *path, char hex[65])
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    static unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        crypto_hash_sha256_update(&st, buf, n);
    int bad = ferror(f);
    fclose(f);
    if (bad)
        return -1;
    unsigned char out[crypto_hash_sha256_BYTES];
    crypto_hash_sha256_final(&st, out);
    sodium_bin2hex(hex, 65, out, sizeof out);
    return 0;
}

static void load_manifest(void)
{
    json_error_t e;
    manifest = json_load_file(test_src_path("tests/fixtures/MANIFEST.json"), 0, &e);
    if (!manifest)
        fprintf(stderr, "  MANIFEST.json: %s (line %d)\n", e.text, e.line);
}

static void t_sha256_all(void)
{
    CHECK(manifest != NULL);
    if (!manifest)
        return;
    json_t *files = json_object_get(manifest, "sha256");
    CHECK(json_is_object(files) && json_object_size(files) > 20);
    const char *rel;
    json_t *want;
    int n = 0;
    json_object_foreach(files, rel, want)
    {
        char hex[65];
        int rc = sha256_file(test_src_path(rel), hex);
        CHECK_MSG(rc == 0, "cannot read %s", rel);
        if (rc == 0)
            CHECK_MSG(json_is_string(want) && !strcmp(hex, json_string_value(want)), "%s: sha256 %s, manifest %s",
                      rel, hex, json_string_value(want) ? json_string_value(want) : "(not a string)");
        n++;
    }
    printf("  %d files checked\n", n);
}

/* every file present in the listed directories is in the manifest */
static void t_no_unlisted_files(void)
{
    if (!manifest)
        SKIP("no manifest");
    json_t *files = json_object_get(manifest, "sha256");
    const char *dirs[] = {"tests/models/tiny-k3",   "tests/models/tiny-k3-plain", "tests/models/k3-nano",
                          "tests/fixtures/tiny-k3", "tests/fixtures/tiny-k3-plain", "tests/fixtures/k3-nano",
                          "tests/fixtures/k3-scale"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        DIR *d = opendir(test_src_path(dirs[i]));
        CHECK_MSG(d != NULL, "missing directory %s", dirs[i]);
        if (!d)
            continue;
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (de->d_name[0] == '.')
                continue;
            char rel[512];
            snprintf(rel, sizeof rel, "%s/%s", dirs[i], de->d_name);
            CHECK_MSG(json_object_get(files, rel) != NULL, "%s is not in MANIFEST.json", rel);
        }
        closedir(d);
    }
}

static json_t *load_fixture(const char *model, const char *file)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fixtures/%s/%s", model, file);
    json_error_t e;
    json_t *j = json_load_file(test_src_path(rel), 0, &e);
    CHECK_MSG(j != NULL, "%s: %s", rel, e.text);
    return j;
}

static size_t arr_len(json_t *o, const char *key)
{
    json_t *a = json_object_get(o, key);
    return json_is_array(a) ? json_array_size(a) : 0;
}

static void check_model_fixtures(const char *model, size_t vocab)
{
    json_t *g = load_fixture(model, "greedy.json");
    if (g) {
        CHECK(arr_len(g, "prompt_ids") >= 16);
        CHECK(arr_len(g, "generated_ids") >= 24);
        json_decref(g);
    }
    json_t *tf = load_fixture(model, "teacher_forced.json");
    if (tf) {
        size_t n = arr_len(tf, "ids");
        CHECK(n >= 48);
        CHECK(arr_len(tf, "argmax") == n);
        CHECK(arr_len(tf, "margin") == n);
        size_t i;
        json_t *v;
        json_array_foreach(json_object_get(tf, "argmax"), i, v)
            CHECK(json_is_integer(v) && json_integer_value(v) >= 0 && (size_t)json_integer_value(v) < vocab);
        json_decref(tf);
    }
    json_t *lg = load_fixture(model, "logits.json");
    if (lg) {
        size_t n = arr_len(lg, "ids");
        CHECK(n >= 48 && arr_len(lg, "top_ids") == n && arr_len(lg, "top_values") == n);
        CHECK(json_array_size(json_array_get(json_object_get(lg, "top_ids"), 0)) == 32);
        json_t *rows = json_object_get(lg, "full_rows");
        CHECK(arr_len(rows, "positions") >= 2 && arr_len(rows, "positions") == arr_len(rows, "values"));
        CHECK(json_array_size(json_array_get(json_object_get(rows, "values"), 0)) == vocab);
        json_decref(lg);
    }
    json_t *h = load_fixture(model, "hidden.json");
    if (h) {
        CHECK(arr_len(h, "layers") >= 5);
        json_decref(h);
    }
    json_t *s = load_fixture(model, "sampled.json");
    if (s) {
        CHECK(arr_len(s, "generated_ids") >= 16);
        json_decref(s);
    }
    json_t *tol = json_object_get(json_object_get(manifest, "tolerances"), model);
    CHECK_MSG(json_is_number(json_object_get(tol, "logits_abs")), "%s: no logits_abs tolerance", model);
}

static void t_fixture_shapes(void)
{
    if (!manifest)
        SKIP("no manifest");
    check_model_fixtures("tiny-k3", 4096);
    check_model_fixtures("tiny-k3-plain", 4096);
    check_model_fixtures("k3-nano", 2048);
}

/* the scale fixture names every regenerated model file with size and sha256 */
static void t_scale_fixture(void)
{
    if (!manifest)
        SKIP("no manifest");
    json_t *s = load_fixture("k3-scale", "scale.json");
    if (!s)
        return;
    json_t *files = json_object_get(s, "model_files");
    CHECK(json_is_object(files) && json_object_size(files) >= 6);
    const char *fn;
    json_t *v;
    json_object_foreach(files, fn, v)
    {
        CHECK_MSG(json_is_string(json_object_get(v, "sha256")) &&
                      strlen(json_string_value(json_object_get(v, "sha256"))) == 64,
                  "scale.json: %s has no sha256", fn);
        CHECK_MSG(json_is_integer(json_object_get(v, "bytes")), "scale.json: %s has no size", fn);
    }
    size_t n = arr_len(s, "ids");
    CHECK(n >= 8 && arr_len(s, "argmax") == n && arr_len(s, "top_ids") == n);
    CHECK(arr_len(s, "generated_ids") >= 4);
    CHECK(json_is_number(json_object_get(json_object_get(json_object_get(manifest, "tolerances"), "k3-scale"),
                                         "logits_abs")));
    json_decref(s);
}

int main(void)
{
    test_binary = "test_fixtures";
    if (sodium_init() < 0) {
        fprintf(stderr, "sodium_init failed\n");
        return 1;
    }
    load_manifest();
    RUN(t_sha256_all);
    RUN(t_no_unlisted_files);
    RUN(t_fixture_shapes);
    RUN(t_scale_fixture);
    json_decref(manifest);
    return test_finish();
}
