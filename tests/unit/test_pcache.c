/* Unit tests of the prefix cache (coordinator/pcache/pcache.h) and the engine's
 * state export/import (engine.h), on tests/models/tiny-k3:
 *   format     -- a state file round-trips; every single-byte change of the
 *                 header and of sampled payload bytes, every truncation and
 *                 an appended byte are refused; another fingerprint is
 *                 SHOAL_EFINGERPRINT, another state layout SHOAL_EFORMAT;
 *   identity   -- resuming from a capture (memory tier, disk tier, and at
 *                 positions 1, a chunk boundary and mid-chunk) and prefilling
 *                 the rest gives the logits of the whole prompt's prefill,
 *                 bit for bit (memcmp), in chunks of 4;
 *   index      -- the longest captured prefix wins, never one longer than
 *                 max or off the prompt; LRU eviction under a memory budget
 *                 of two captures; an evicted capture on disk is read back;
 *   reindex    -- a reopened cache finds its directory's captures; a file
 *                 of another fingerprint is refused and counted. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "coordinator/pcache/pcache.h"
#include "coordinator/engine/engine.h"
#include "test.h"

#define NP 40
static int32_t P[NP];

static shoal_model *open_tiny(void)
{
    char err[4096];
    shoal_model_opts o = {.max_context = 128, .max_batch = 4, .quiet = 1};
    shoal_model *m = NULL;
    int rc = shoal_model_open(&m, test_src_path("tests/models/tiny-k3"), &o, err, sizeof err);
    if (rc) {
        fprintf(stderr, "  open: %s\n", err);
        return NULL;
    }
    return m;
}

static char tmpdir[256];

static void make_tmp(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/shoal-test-pcache-XXXXXX");
    if (!mkdtemp(tmpdir))
        SKIP("mkdtemp failed");
}

static void rm_tmp(void)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
    if (system(cmd)) {
    }
}

static int read_whole(const char *path, uint8_t **out, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc((size_t)sz + 1);
    *n = fread(*out, 1, (size_t)sz, f);
    fclose(f);
    return 0;
}

static void t_format(void)
{
    make_tmp();
    uint8_t fp[32], fp2[32];
    for (int i = 0; i < 32; i++)
        fp[i] = (uint8_t)i, fp2[i] = (uint8_t)(i + 1);
    int32_t ids[5] = {3, 1, 4, 1, 5};
    size_t fixed = 40, per = 12, sb = fixed + 5 * per;
    uint8_t *state = malloc(sb);
    for (size_t i = 0; i < sb; i++)
        state[i] = (uint8_t)(i * 31 + 7);
    float logits[3] = {1.5f, -2.0f, 0.25f};
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/a.shst", tmpdir);
    CHECK_EQ_INT(shoal_pcache_file_write(path, fp, ids, 5, state, sb, logits, 3, err, sizeof err), 0);
    shoal_pcache_file *f = NULL;
    CHECK_EQ_INT(shoal_pcache_file_read(&f, path, fp, fixed, per, err, sizeof err), 0);
    if (f) {
        CHECK(f->h.n_ids == 5 && f->h.n_logits == 3 && f->h.state_bytes == sb);
        CHECK(!memcmp(f->ids, ids, sizeof ids) && !memcmp(f->state, state, sb) && !memcmp(f->logits, logits, 12));
    }
    shoal_pcache_file_free(f);
    f = NULL;
    CHECK_EQ_INT(shoal_pcache_file_read(&f, path, fp2, fixed, per, err, sizeof err), SHOAL_EFINGERPRINT);
    CHECK(f == NULL && strstr(err, "a.shst") && strstr(err, "another model"));
    CHECK_EQ_INT(shoal_pcache_file_read(&f, path, fp, fixed, per + 4, err, sizeof err), SHOAL_EFORMAT);
    uint8_t *b = NULL;
    size_t n = 0;
    if (read_whole(path, &b, &n))
        SKIP("cannot reread the state file");
    shoal_pcache_hdr h;
    CHECK_EQ_INT(shoal_pcache_verify(&h, b, n, err, sizeof err), 0);
    /* every byte of the header, and every 7th after it, flipped: refused */
    int accepted = 0;
    for (size_t i = 0; i < n; i += i < SHOAL_PCACHE_HDR_BYTES ? 1 : 7) {
        b[i] ^= 0x10;
        accepted += shoal_pcache_verify(&h, b, n, err, sizeof err) == 0;
        b[i] ^= 0x10;
    }
    CHECK_EQ_INT(accepted, 0);
    for (size_t k = 0; k < n; k++)
        accepted += shoal_pcache_verify(&h, b, k, err, sizeof err) == 0;
    CHECK_EQ_INT(accepted, 0);
    uint8_t *b2 = malloc(n + 1);
    memcpy(b2, b, n);
    b2[n] = 0;
    CHECK(shoal_pcache_verify(&h, b2, n + 1, err, sizeof err) == SHOAL_EFORMAT);
    /* the same through the file reader: truncated by one byte */
    FILE *w = fopen(path, "wb");
    fwrite(b, 1, n - 1, w);
    fclose(w);
    CHECK_EQ_INT(shoal_pcache_file_read(&f, path, fp, fixed, per, err, sizeof err), SHOAL_EFORMAT);
    CHECK(strstr(err, "truncated") != NULL);
    free(b);
    free(b2);
    free(state);
    rm_tmp();
}

/* logits [n, V] of P[0..n) prefilled from scratch in chunks of 4 */
static float *full_logits(shoal_model *m, int V)
{
    float *lg = malloc(sizeof(float) * NP * (size_t)V);
    shoal_seq *s;
    char err[512];
    shoal_seq_create(&s, m, 0, err, sizeof err);
    CHECK_EQ_INT(shoal_seq_prefill(s, P, NP, SHOAL_LOGITS_ALL, lg, err, sizeof err), 0);
    shoal_seq_free(s);
    return lg;
}

static void resume_case(shoal_model *m, const float *ref, int V, int p, uint64_t mem, const char *dir)
{
    char err[512];
    uint8_t fp[32] = {9};
    shoal_pcache *pc;
    shoal_pcache_opts o = {.model = m, .fingerprint = fp, .mem_bytes = mem, .dir = dir};
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    shoal_seq *a, *b;
    shoal_seq_create(&a, m, 0, err, sizeof err);
    shoal_seq_create(&b, m, 0, err, sizeof err);
    CHECK_EQ_INT(shoal_seq_prefill(a, P, p, SHOAL_LOGITS_NONE, NULL, err, sizeof err), 0);
    CHECK_EQ_INT(shoal_pcache_capture(pc, P, p, a, err, sizeof err), 0);
    shoal_seq_free(a);
    CHECK_EQ_INT(shoal_pcache_resume(pc, P, NP, NP - 1, b), p);
    CHECK_EQ_INT(shoal_seq_pos(b), p);
    float *lg = malloc(sizeof(float) * (size_t)(NP - p) * (size_t)V);
    CHECK_EQ_INT(shoal_seq_prefill(b, P + p, NP - p, SHOAL_LOGITS_ALL, lg, err, sizeof err), 0);
    CHECK_MSG(!memcmp(lg, ref + (size_t)p * V, sizeof(float) * (size_t)(NP - p) * (size_t)V),
              "resumed at %d (mem %llu, dir %s): logits differ", p, (unsigned long long)mem, dir ? dir : "-");
    shoal_pcache_stats st;
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.hits == 1 && st.tokens_saved == (uint64_t)p && st.captures == 1);
    CHECK(st.disk_reads == (mem ? 0u : 1u));
    free(lg);
    shoal_seq_free(b);
    shoal_pcache_close(pc);
}

static void t_identity(void)
{
    shoal_model *m = open_tiny();
    if (!m)
        SKIP("tests/models/tiny-k3 does not open");
    shoal_model_info in;
    shoal_model_get_info(m, &in);
    float *ref = full_logits(m, in.vocab);
    make_tmp();
    int ps[] = {1, 8, 23};
    for (int i = 0; i < 3; i++) {
        resume_case(m, ref, in.vocab, ps[i], 64u << 20, NULL);
        char d[300];
        snprintf(d, sizeof d, "%s/d%d", tmpdir, i);
        resume_case(m, ref, in.vocab, ps[i], 0, d); /* disk only: read back, verified, imported */
    }
    rm_tmp();
    free(ref);
    shoal_model_close(m);
}

static void t_index(void)
{
    shoal_model *m = open_tiny();
    if (!m)
        SKIP("tests/models/tiny-k3 does not open");
    make_tmp();
    char err[512];
    uint8_t fp[32] = {1};
    size_t one = shoal_seq_state_size(m, 12);
    shoal_pcache *pc;
    /* room for two captures of 10..12 tokens, not three */
    shoal_pcache_opts o = {.model = m, .fingerprint = fp, .mem_bytes = 2 * one + 16, .dir = tmpdir};
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    shoal_seq *s, *r;
    shoal_seq_create(&s, m, 0, err, sizeof err);
    shoal_seq_create(&r, m, 0, err, sizeof err);
    int32_t Q[NP];
    memcpy(Q, P, sizeof Q);
    Q[11] = P[11] + 1; /* Q shares 11 tokens with P */
    shoal_seq_prefill(s, P, 10, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, P, 10, s, err, sizeof err), 0); /* A = P[0..10) */
    shoal_seq_prefill(s, P + 10, 2, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, P, 12, s, err, sizeof err), 0); /* B = P[0..12) */
    CHECK_EQ_INT(shoal_pcache_lookup(pc, P, NP, NP), 12);
    CHECK_EQ_INT(shoal_pcache_lookup(pc, P, NP, 11), 10); /* max */
    CHECK_EQ_INT(shoal_pcache_lookup(pc, Q, NP, NP), 10); /* Q leaves P at 11 */
    CHECK_EQ_INT(shoal_pcache_lookup(pc, P + 1, NP - 1, NP), 0);
    CHECK(shoal_pcache_has(pc, P, 12) && !shoal_pcache_has(pc, P, 11));
    CHECK_EQ_INT(shoal_pcache_resume(pc, Q, NP, NP, r), 10); /* A is now the most recent */
    shoal_seq_reset(s);
    shoal_seq_prefill(s, Q, 11, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, Q, 11, s, err, sizeof err), 0); /* C: evicts B (least recent) */
    shoal_pcache_flush(pc); /* the writer thread has written all three */
    shoal_pcache_stats st;
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.evictions == 1 && st.mem_entries == 2 && st.mem_bytes <= o.mem_bytes && st.disk_entries == 3 &&
          st.disk_writes == 3);
    /* B is still on disk: resuming P reads it back */
    CHECK_EQ_INT(shoal_pcache_resume(pc, P, NP, NP, r), 12);
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.disk_reads == 1);
    shoal_pcache_shrink(pc, 0);
    CHECK_EQ_INT((int)shoal_pcache_mem_bytes(pc), 0);
    shoal_pcache_close(pc);
    /* reindex: a new cache on the directory finds the three; a file of
     * another model is refused */
    uint8_t fp2[32] = {2};
    char path[600];
    snprintf(path, sizeof path, "%s/other.shst", tmpdir);
    size_t sb = shoal_seq_state_size(m, 3);
    void *buf = calloc(1, sb);
    CHECK_EQ_INT(shoal_pcache_file_write(path, fp2, P, 3, buf, sb, NULL, 0, err, sizeof err), 0);
    free(buf);
    o.mem_bytes = 64u << 20;
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.disk_entries == 3 && st.refused == 1 && st.mem_entries == 0);
    CHECK_EQ_INT(shoal_pcache_lookup(pc, Q, NP, NP), 11);
    CHECK_EQ_INT(shoal_pcache_resume(pc, Q, NP, NP, r), 11);
    shoal_pcache_close(pc);
    shoal_seq_free(s);
    shoal_seq_free(r);
    rm_tmp();
    shoal_model_close(m);
}

static uint64_t fsize(const char *path)
{
    struct stat st;
    return stat(path, &st) ? 0 : (uint64_t)st.st_size;
}

/* The disk budget: the least recently used file goes, the bytes counted match
 * the files; the directory's lock; an unfinished write removed at open. */
static void t_disk_budget(void)
{
    shoal_model *m = open_tiny();
    if (!m)
        SKIP("tests/models/tiny-k3 does not open");
    make_tmp();
    char err[512];
    uint8_t fp[32] = {3};
    uint64_t f10 = SHOAL_PCACHE_HDR_BYTES + 40 + shoal_seq_state_size(m, 10);
    uint64_t f11 = SHOAL_PCACHE_HDR_BYTES + 44 + shoal_seq_state_size(m, 11);
    uint64_t f12 = SHOAL_PCACHE_HDR_BYTES + 48 + shoal_seq_state_size(m, 12);
    shoal_pcache *pc, *pc2;
    /* disk only, room for two of these files, not three */
    shoal_pcache_opts o = {.model = m, .fingerprint = fp, .mem_bytes = 0, .dir = tmpdir, .disk_bytes = f12 + f11};
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    CHECK_EQ_INT(shoal_pcache_open(&pc2, &o, err, sizeof err), SHOAL_EBUSY); /* locked */
    CHECK(strstr(err, "in use by another process") != NULL);
    shoal_seq *s, *r;
    shoal_seq_create(&s, m, 0, err, sizeof err);
    shoal_seq_create(&r, m, 0, err, sizeof err);
    int32_t Q[NP];
    memcpy(Q, P, sizeof Q);
    Q[11] = P[11] + 1;
    shoal_seq_prefill(s, P, 10, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, P, 10, s, err, sizeof err), 0); /* A */
    shoal_seq_prefill(s, P + 10, 2, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, P, 12, s, err, sizeof err), 0); /* B */
    shoal_pcache_flush(pc);
    shoal_pcache_stats st;
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.disk_bytes == f10 + f12 && st.disk_entries == 2 && st.disk_evictions == 0 &&
          st.disk_budget == f12 + f11);
    /* A used again: B is now the least recently used */
    CHECK_EQ_INT(shoal_pcache_resume(pc, Q, NP, NP, r), 10);
    shoal_seq_reset(s);
    shoal_seq_prefill(s, Q, 11, SHOAL_LOGITS_NONE, NULL, err, sizeof err);
    CHECK_EQ_INT(shoal_pcache_capture(pc, Q, 11, s, err, sizeof err), 0); /* C: B's file goes */
    shoal_pcache_flush(pc);
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.disk_evictions == 1 && st.disk_entries == 2 && st.disk_bytes == f10 + f11);
    CHECK(!shoal_pcache_has(pc, P, 12) && shoal_pcache_has(pc, P, 10) && shoal_pcache_has(pc, Q, 11)); /* B went */
    /* the files themselves: A and C, together disk_bytes */
    uint64_t sum = 0;
    int nfiles = 0;
    DIR *d = opendir(tmpdir);
    struct dirent *de;
    char path[700];
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".shst")) {
            snprintf(path, sizeof path, "%s/%s", tmpdir, de->d_name);
            sum += fsize(path);
            nfiles++;
        }
    if (d)
        closedir(d);
    CHECK(nfiles == 2 && sum == st.disk_bytes);
    shoal_pcache_close(pc);
    /* a crash during a write leaves NAME.tmp: removed at open */
    snprintf(path, sizeof path, "%s/pc-0000000000000abc-7.shst.tmp", tmpdir);
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f) {
        fputs("half a write", f);
        fclose(f);
    }
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.removed == 1 && fsize(path) == 0 && access(path, F_OK) != 0 && st.disk_entries == 2);
    shoal_pcache_close(pc);
    /* a lower budget at open: the oldest file (A: C was written after it) goes */
    o.disk_bytes = f11;
    CHECK_EQ_INT(shoal_pcache_open(&pc, &o, err, sizeof err), 0);
    shoal_pcache_get_stats(pc, &st);
    CHECK(st.disk_entries == 1 && st.disk_bytes == f11 && st.disk_evictions == 1);
    CHECK_EQ_INT(shoal_pcache_lookup(pc, Q, NP, NP), 11);
    shoal_pcache_close(pc);
    shoal_seq_free(s);
    shoal_seq_free(r);
    rm_tmp();
    shoal_model_close(m);
}

int main(void)
{
    test_binary = "test_pcache";
    for (int i = 0; i < NP; i++)
        P[i] = (int32_t)((i * 977 + 13) % 3800 + 1);
    RUN(t_format);
    RUN(t_identity);
    RUN(t_index);
    RUN(t_disk_budget);
    return test_finish();
}
