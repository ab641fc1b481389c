/* coordinator/tstream and the engine's trunk budget (coordinator/engine/trunk.c):
 * the reader alone on a file of known bytes (layout alignment, cycles with
 * and without the optional units, O_DIRECT and buffered, a truncated file
 * reported naming the file and tensor, a consumer that would wait forever
 * stopped by its deadline), then the engine on both tiny models: logits
 * bit-identical to the mapped trunk at budgets from the minimum to fully
 * resident (prefill in several chunks with every position's logits, decode,
 * a decode batch), no allocation in the forward, a budget below the minimum
 * refused naming it, and an I/O error mid-run (the model file truncated under
 * a running model) surfacing as an error naming the file, not a hang. */
#include <errno.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/engine/engine.h"
#include "coordinator/engine/tstream.h"
#include "test.h"

static char tmpdir[256];

static void mk_tmp(void)
{
    if (tmpdir[0])
        return;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal-test-tstream-XXXXXX");
    if (!mkdtemp(tmpdir))
        tmpdir[0] = 0;
}

static uint8_t pat(uint64_t i)
{
    return (uint8_t)((i * 2654435761u) >> 13);
}

/* a file of n pattern bytes */
static const char *pattern_file(const char *name, uint64_t n)
{
    static char path[512];
    mk_tmp();
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    FILE *f = fopen(path, "wb");
    if (!f)
        return NULL;
    for (uint64_t i = 0; i < n; i++)
        fputc(pat(i), f);
    fclose(f);
    return path;
}

static int unit_ok(const shoal_tstream_unit *u, const void *buf)
{
    for (int i = 0; i < u->n_ext; i++) {
        const uint8_t *p = (const uint8_t *)buf + u->ext[i].at;
        for (uint64_t j = 0; j < u->ext[i].len; j++)
            if (p[j] != pat(u->ext[i].off + j))
                return 0;
    }
    return 1;
}

static void t_layout(void)
{
    shoal_tstream_ext e[3] = {{.name = "a", .off = 10, .len = 5000},
                              {.name = "b", .off = 8192, .len = 4096},
                              {.name = "c", .off = 4095, .len = 2}};
    shoal_tstream_unit u = {.ext = e, .n_ext = 3};
    size_t b = shoal_tstream_layout(&u);
    CHECK_EQ_INT(b % SHOAL_TSTREAM_ALIGN, 0);
    /* spans: [0, 8192) for a, [8192, 12288) for b, [12288, 20480) for c */
    CHECK_EQ_INT(b, 8192 + 4096 + 8192);
    for (int i = 0; i < 3; i++) {
        CHECK_EQ_INT(e[i].at % SHOAL_TSTREAM_ALIGN, e[i].off % SHOAL_TSTREAM_ALIGN);
        CHECK(e[i].at + e[i].len <= b);
    }
    CHECK(e[0].at + e[0].len <= e[1].at);
    CHECK(e[1].at + e[1].len <= e[2].at);
}

/* 5 units over 2 files (odd offsets and lengths, the last optional), many
 * cycles alternating need_optional */
static void stream_cycles(int no_direct)
{
    char err[512];
    const char *p0 = pattern_file("f0", 300000);
    char p0c[512];
    snprintf(p0c, sizeof p0c, "%s", p0 ? p0 : "");
    const char *p1 = pattern_file("f1", 70001);
    if (!p0 || !p1)
        SKIP("cannot write in /tmp");
    const char *paths[2] = {p0c, p1};
    shoal_tstream_ext ex[7] = {
        {.name = "u0.a", .file = 0, .off = 3, .len = 40000},   {.name = "u0.b", .file = 1, .off = 100, .len = 7},
        {.name = "u1.a", .file = 0, .off = 4096, .len = 8192}, {.name = "u2.a", .file = 1, .off = 1, .len = 70000},
        {.name = "u3.a", .file = 0, .off = 250001, .len = 49999}, {.name = "u3.b", .file = 0, .off = 0, .len = 1},
        {.name = "u4.a", .file = 0, .off = 123457, .len = 100001},
    };
    shoal_tstream_unit u[5] = {{.ext = ex, .n_ext = 2},
                               {.ext = ex + 2, .n_ext = 1},
                               {.ext = ex + 3, .n_ext = 1},
                               {.ext = ex + 4, .n_ext = 2},
                               {.ext = ex + 6, .n_ext = 1, .optional = 1}};
    for (int i = 0; i < 5; i++)
        shoal_tstream_layout(&u[i]);
    shoal_tstream *ts = NULL;
    shoal_tstream_opts o = {.no_direct = no_direct, .timeout_ms = 10000, .chunk_bytes = 16384};
    CHECK(shoal_tstream_open(&ts, paths, 2, &o, err, sizeof err) == 0);
    if (!ts)
        return;
    CHECK(shoal_tstream_start(ts, u, 5, err, sizeof err) == 0);
    int bad = 0, want_skips = 0;
    for (int cyc = 0; cyc < 12; cyc++) {
        int need = cyc % 3 != 1;
        want_skips += !need;
        shoal_tstream_begin(ts, need);
        for (int i = 0; i < 5; i++) {
            if (u[i].optional && !need)
                continue;
            const void *buf;
            int rc = shoal_tstream_acquire(ts, i, &buf, err, sizeof err);
            CHECK_MSG(rc == 0, "cycle %d unit %d: %s", cyc, i, err);
            if (rc)
                break;
            bad += !unit_ok(&u[i], buf);
            shoal_tstream_release(ts);
        }
    }
    CHECK_EQ_INT(bad, 0);
    shoal_tstream_stats st;
    shoal_tstream_get_stats(ts, &st);
    /* the reader may have read (not skipped) into the 13th cycle */
    CHECK(st.skipped >= (uint64_t)want_skips && st.skipped <= (uint64_t)want_skips + 1);
    CHECK(st.units_read >= 12 * 4 + (12 - (uint64_t)want_skips));
    if (no_direct) {
        CHECK_EQ_INT(st.direct, 0);
    } else {
        /* u2.a ends at the (unaligned) end of f1: the aligned span's tail is
         * past EOF, which must not be taken for a refusal of O_DIRECT */
        int fd = open(p1, O_RDONLY | O_DIRECT);
        if (fd >= 0) {
            close(fd);
            int fd0 = open(p0c, O_RDONLY | O_DIRECT);
            if (fd0 >= 0) {
                close(fd0);
                CHECK_EQ_INT(st.direct, 1);
            }
        }
    }
    /* reset mid-cycle, then whole cycles again */
    shoal_tstream_begin(ts, 1);
    const void *buf;
    CHECK(shoal_tstream_acquire(ts, 0, &buf, err, sizeof err) == 0);
    shoal_tstream_reset(ts);
    CHECK(shoal_tstream_resume(ts, err, sizeof err) == 0);
    shoal_tstream_begin(ts, 1);
    for (int i = 0; i < 5; i++) {
        int rc = shoal_tstream_acquire(ts, i, &buf, err, sizeof err);
        CHECK_MSG(rc == 0, "after reset, unit %d: %s", i, err);
        if (rc)
            break;
        CHECK(unit_ok(&u[i], buf));
        shoal_tstream_release(ts);
    }
    shoal_tstream_close(ts);
}

static void t_stream_direct(void)
{
    stream_cycles(0);
}

static void t_stream_buffered(void)
{
    stream_cycles(1);
}

/* a file truncated under the reader: the acquire that needs the unit fails
 * naming the file and the tensor; a reset after restoring the file recovers */
static void t_truncated(void)
{
    char err[512];
    const char *p = pattern_file("trunc", 200000);
    if (!p)
        SKIP("cannot write in /tmp");
    char path[512];
    snprintf(path, sizeof path, "%s", p);
    const char *paths[1] = {path};
    shoal_tstream_ext ex[2] = {{.name = "layers.0.w", .off = 0, .len = 50000},
                               {.name = "layers.1.w", .off = 150000, .len = 50000}};
    shoal_tstream_unit u[2] = {{.ext = ex, .n_ext = 1}, {.ext = ex + 1, .n_ext = 1}};
    shoal_tstream_layout(&u[0]);
    shoal_tstream_layout(&u[1]);
    shoal_tstream *ts = NULL;
    shoal_tstream_opts o = {.timeout_ms = 10000};
    CHECK(shoal_tstream_open(&ts, paths, 1, &o, err, sizeof err) == 0);
    if (!ts)
        return;
    CHECK(truncate(path, 100000) == 0);
    CHECK(shoal_tstream_start(ts, u, 2, err, sizeof err) == 0);
    shoal_tstream_begin(ts, 1);
    const void *buf;
    CHECK(shoal_tstream_acquire(ts, 0, &buf, err, sizeof err) == 0);
    shoal_tstream_release(ts);
    int rc = shoal_tstream_acquire(ts, 1, &buf, err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_EIO);
    CHECK_STR_CONTAINS(err, path);
    CHECK_STR_CONTAINS(err, "layers.1.w");
    CHECK_STR_CONTAINS(err, "truncated");
    pattern_file("trunc", 200000);
    shoal_tstream_reset(ts);
    CHECK(shoal_tstream_resume(ts, err, sizeof err) == 0);
    for (int cyc = 0; cyc < 2; cyc++) {
        shoal_tstream_begin(ts, 1);
        for (int i = 0; i < 2; i++) {
            rc = shoal_tstream_acquire(ts, i, &buf, err, sizeof err);
            CHECK_MSG(rc == 0, "%s", err);
            if (rc)
                break;
            CHECK(unit_ok(&u[i], buf));
            shoal_tstream_release(ts);
        }
    }
    shoal_tstream_close(ts);
}

/* a consumer waiting for a unit that will never come (an optional unit of a
 * cycle that was not begun: a protocol misuse) returns at its deadline */
static void t_deadline(void)
{
    char err[512];
    const char *p = pattern_file("dl", 10000);
    if (!p)
        SKIP("cannot write in /tmp");
    char path[512];
    snprintf(path, sizeof path, "%s", p);
    const char *paths[1] = {path};
    shoal_tstream_ext ex[1] = {{.name = "lm_head.weight", .off = 0, .len = 5000}};
    shoal_tstream_unit u[1] = {{.ext = ex, .n_ext = 1, .optional = 1}};
    shoal_tstream_layout(&u[0]);
    shoal_tstream *ts = NULL;
    shoal_tstream_opts o = {.timeout_ms = 300};
    CHECK(shoal_tstream_open(&ts, paths, 1, &o, err, sizeof err) == 0);
    if (!ts)
        return;
    CHECK(shoal_tstream_start(ts, u, 1, err, sizeof err) == 0);
    const void *buf;
    int rc = shoal_tstream_acquire(ts, 0, &buf, err, sizeof err);
    CHECK_EQ_INT(rc, SHOAL_ETIMEOUT);
    CHECK_STR_CONTAINS(err, "lm_head.weight");
    CHECK(buf == NULL);
    shoal_tstream_close(ts);
}

/* ---- the engine under a budget ------------------------------------------------ */

static const char *MODELS[] = {"tests/models/tiny-k3", "tests/models/tiny-k3-plain"};
static const int32_t PROMPT[] = {17, 256, 3000, 42, 42, 9, 1023, 4000, 5, 77, 3839};
#define NP ((int)(sizeof PROMPT / sizeof PROMPT[0]))
#define NDEC 5

static shoal_model *open_budget(const char *dir, shoal_trunk_mode md, uint64_t bytes, int remote, char *err,
                                size_t errlen, int *rc)
{
    shoal_model_opts o = {.max_context = 32, .max_batch = 4, .quiet = 1, .trunk_mode = md, .trunk_budget = bytes,
                          .remote_experts = remote, .trunk_timeout_ms = 20000};
    shoal_model *m = NULL;
    *rc = shoal_model_open(&m, dir, &o, err, errlen);
    return m;
}

/* all prompt positions' logits (prefill in chunks of 4), then NDEC decode
 * steps' logits (greedy), then one decode batch of two sequences */
static float *run_all(shoal_model *m, int V)
{
    char err[512];
    size_t n = (size_t)(NP + NDEC + 2) * V;
    float *lg = calloc(n, sizeof(float));
    shoal_seq *s, *s2;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    int rc = shoal_seq_prefill(s, PROMPT, NP, SHOAL_LOGITS_ALL, lg, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    const float *last = lg + (size_t)(NP - 1) * V;
    uint64_t a0 = shoal_engine_alloc_count();
    for (int i = 0; i < NDEC && !rc; i++) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (last[v] > last[best])
                best = v;
        float *out = lg + (size_t)(NP + i) * V;
        rc = shoal_seq_decode(s, best, out, err, sizeof err);
        CHECK_MSG(rc == 0, "%s", err);
        last = out;
    }
    CHECK_EQ_INT(shoal_engine_alloc_count(), a0);
    /* a decode batch: the sequence and a fork of it, two different ids; the
     * prefill chunks before it ran without logits (lm_head skipped) */
    CHECK(shoal_seq_fork(&s2, s, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(s2, PROMPT, 5, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    CHECK(shoal_seq_prefill(s, PROMPT + 3, 5, SHOAL_LOGITS_NONE, NULL, err, sizeof err) == 0);
    shoal_seq *pair[2] = {s, s2};
    int32_t ids[2] = {7, 3000};
    rc = shoal_model_decode_batch(m, pair, ids, 2, lg + (size_t)(NP + NDEC) * V, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    shoal_seq_free(s2);
    shoal_seq_free(s);
    return lg;
}

static void t_budgets_identical(void)
{
    char err[4096];
    for (int mi = 0; mi < 2; mi++) {
        const char *dir = test_src_path(MODELS[mi]);
        int rc;
        shoal_model *ref = open_budget(dir, SHOAL_TRUNK_MAPPED, 0, 0, err, sizeof err, &rc);
        CHECK_MSG(ref, "%s", err);
        if (!ref)
            return;
        shoal_model_info in;
        shoal_model_get_info(ref, &in);
        int V = in.vocab;
        float *want = run_all(ref, V);
        shoal_model_close(ref);
        /* the minimum and fully resident, from the small/large presets */
        shoal_model *m = open_budget(dir, SHOAL_TRUNK_SMALL, 0, 0, err, sizeof err, &rc);
        CHECK_MSG(m, "%s", err);
        if (!m)
            return;
        shoal_model_get_info(m, &in);
        uint64_t min = in.trunk_min_bytes, full = in.trunk_full_bytes;
        CHECK(min < full);
        CHECK_EQ_INT(in.trunk_units_resident, 0);
        shoal_model_close(m);
        /* below the minimum: refused naming it */
        m = open_budget(dir, SHOAL_TRUNK_BYTES, min - 1, 0, err, sizeof err, &rc);
        CHECK(!m);
        CHECK_EQ_INT(rc, SHOAL_ECONFIG);
        char mins[64];
        snprintf(mins, sizeof mins, "at least %llu bytes", (unsigned long long)min);
        CHECK_STR_CONTAINS(err, mins);
        uint64_t budgets[7] = {min, min + (full - min) / 8, min + (full - min) / 4, min + (full - min) / 2,
                               min + 3 * (full - min) / 4, full - 1, full};
        int prev_res = -1;
        for (int b = 0; b < 7; b++) {
            m = open_budget(dir, SHOAL_TRUNK_BYTES, budgets[b], 0, err, sizeof err, &rc);
            CHECK_MSG(m, "budget %llu: %s", (unsigned long long)budgets[b], err);
            if (!m)
                continue;
            shoal_model_get_info(m, &in);
            CHECK(in.trunk_resident_bytes + in.trunk_buffer_bytes <= budgets[b]);
            CHECK(in.trunk_units_resident >= prev_res);
            prev_res = in.trunk_units_resident;
            if (b == 6)
                CHECK_EQ_INT(in.trunk_units_resident, in.trunk_units);
            float *got = run_all(m, V);
            size_t n = (size_t)(NP + NDEC + 2) * V;
            size_t diff = n;
            for (size_t i = 0; i < n && diff == n; i++)
                if (memcmp(&got[i], &want[i], sizeof(float)))
                    diff = i;
            CHECK_MSG(diff == n, "%s budget %llu: first differing logit %zu (token row %zu)", MODELS[mi],
                      (unsigned long long)budgets[b], diff, diff / (size_t)V);
            shoal_model_stats st;
            shoal_model_get_stats(m, &st);
            if (in.trunk_stream_bytes)
                CHECK(st.trunk_read_bytes >= in.trunk_stream_bytes);
            free(got);
            shoal_model_close(m);
        }
        free(want);
    }
}

/* remote-expert backend that returns zeros (no expert tensors read) */
static int z_submit(void *self, int layer, int T, int k, const float *z, const int32_t *ids, char *err, size_t errlen)
{
    (void)layer, (void)z, (void)ids, (void)err, (void)errlen;
    *(int *)self = T * k;
    return 0;
}
static int z_gather(void *self, uint16_t *y, char *err, size_t errlen)
{
    (void)y, (void)err, (void)errlen;
    (void)self;
    return 0;
}
static void z_close(void *self)
{
    (void)self;
}
static const shoal_experts_vt z_vt = {.submit = z_submit, .gather = z_gather, .close = z_close};

static int copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    int ok = a && b;
    char buf[65536];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, a)) > 0)
        ok = fwrite(buf, 1, n, b) == n;
    if (a)
        fclose(a);
    if (b && fclose(b))
        ok = 0;
    return ok ? 0 : -1;
}

/* the model's file truncated under a running model: the forward fails with an
 * error naming the file (and a tensor), within its deadline */
static const char *IO_FILES[] = {"config.json", "model.safetensors.index.json", "model-00001-of-000003.safetensors",
                                  "model-00002-of-000003.safetensors", "model-00003-of-000003.safetensors"};
#define N_IO_FILES 5

static int copy_model(const char *dir)
{
    char src[1024], dst[1024];
    for (int i = 0; i < N_IO_FILES; i++) {
        snprintf(src, sizeof src, "%s/%s", test_src_path(MODELS[0]), IO_FILES[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, IO_FILES[i]);
        if (copy_file(src, dst))
            return -1;
    }
    return 0;
}

/* the model's files truncated under a running model: the forward fails with
 * an error naming the file and a tensor, within its deadline */
static void t_engine_io_error(void)
{
    char err[4096], dst[1024];
    mk_tmp();
    if (!tmpdir[0])
        SKIP("no temporary directory");
    char dir[300];
    snprintf(dir, sizeof dir, "%s/model", tmpdir);
    mkdir(dir, 0755);
    if (copy_model(dir))
        SKIP("cannot copy the tiny model (its file list changed?)");
    int rc;
    shoal_model *m = open_budget(dir, SHOAL_TRUNK_SMALL, 0, 1, err, sizeof err, &rc);
    CHECK_MSG(m, "%s", err);
    if (!m)
        return;
    int calls = 0;
    shoal_experts b = {.vt = &z_vt, .self = &calls};
    CHECK(shoal_model_set_experts(m, &b, err, sizeof err) == 0);
    shoal_model_info in;
    shoal_model_get_info(m, &in);
    float *lg = malloc(sizeof(float) * (size_t)in.vocab);
    shoal_seq *s;
    CHECK(shoal_seq_create(&s, m, 0, err, sizeof err) == 0);
    CHECK(shoal_seq_decode(s, 5, lg, err, sizeof err) == 0);
    /* keep each shard's first 4 KiB: every tensor's data is past it */
    for (int i = 2; i < N_IO_FILES; i++) {
        snprintf(dst, sizeof dst, "%s/%s", dir, IO_FILES[i]);
        CHECK(truncate(dst, 4096) == 0);
    }
    rc = 0;
    for (int i = 0; i < 3 && !rc; i++)
        rc = shoal_seq_decode(s, 6, lg, err, sizeof err);
    /* the forward checks the mapped files' sizes before it reads (issue 30
     * item 2): refused by name, nothing run, so the sequence is not broken */
    CHECK(rc == SHOAL_EIO);
    CHECK_STR_CONTAINS(err, dir);
    CHECK_STR_CONTAINS(err, "truncated");
    CHECK(shoal_seq_pos(s) == 1);
    CHECK_EQ_INT(shoal_seq_decode(s, 6, lg, err, sizeof err), SHOAL_EIO);
    /* the model works again once the files are back, from where it was */
    CHECK(copy_model(dir) == 0);
    /* the model works again once the files are back, from where it was: the
     * reader's read-ahead from the truncated file is not kept */
    rc = shoal_seq_decode(s, 6, lg, err, sizeof err);
    CHECK_MSG(rc == 0, "%s", err);
    CHECK(shoal_seq_pos(s) == 2);
    shoal_seq_free(s);
    shoal_model_close(m);
    free(lg);
    for (int i = 0; i < N_IO_FILES; i++) {
        snprintf(dst, sizeof dst, "%s/%s", dir, IO_FILES[i]);
        unlink(dst);
    }
    rmdir(dir);
}

static void t_parse(void)
{
    shoal_trunk_mode md;
    uint64_t b;
    CHECK(shoal_model_parse_trunk("small", &md, &b) == 0 && md == SHOAL_TRUNK_SMALL);
    CHECK(shoal_model_parse_trunk("auto", &md, &b) == 0 && md == SHOAL_TRUNK_AUTO);
    CHECK(shoal_model_parse_trunk("1.5", &md, &b) == 0 && md == SHOAL_TRUNK_BYTES && b == 3ull << 29);
    CHECK(shoal_model_parse_trunk("0", &md, &b) != 0);
    CHECK(shoal_model_parse_trunk("-1", &md, &b) != 0);
    CHECK(shoal_model_parse_trunk("2G", &md, &b) != 0);
    CHECK(shoal_model_parse_trunk("", &md, &b) != 0);
}

static void cleanup(void)
{
    if (!tmpdir[0])
        return;
    const char *names[] = {"f0", "f1", "trunc", "dl"};
    char p[512];
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", tmpdir, names[i]);
        unlink(p);
    }
    rmdir(tmpdir);
}

int main(void)
{
    test_binary = "test_tstream";
    omp_set_num_threads(1);
    RUN(t_layout);
    RUN(t_stream_direct);
    RUN(t_stream_buffered);
    RUN(t_truncated);
    RUN(t_deadline);
    RUN(t_parse);
    RUN(t_budgets_identical);
    RUN(t_engine_io_error);
    cleanup();
    return test_finish();
}
