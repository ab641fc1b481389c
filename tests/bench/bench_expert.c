/* bench_expert: one MoE layer's routed experts at T = 1, K3 widths (SPEC §2:
 * d = routed_expert_hidden_size 3584, f = moe_intermediate_size 3072, MXFP4),
 * E experts in a row (default 16 = num_experts_per_token), as the in-process
 * engine (experts_local.c) and the worker (serve.c) run them. Not a test;
 * figures for docs/PERFORMANCE.md ("Routed experts: one parallel region per
 * expert"). Rows, interleaved round by round in one process, the order
 * rotated every round:
 *   many    shoal_expert_ffn_many over the layer's experts (threads take whole
 *           experts: one region per layer; what the in-process engine calls)
 *   ffn     shoal_expert_ffn per expert (one region per expert; the worker)
 *   matrix  the matrix-at-a-time form it replaced, from public kernels:
 *           shoal_gemm_mxfp4 for W1, W3, shoal_situ_glu, W2 in chunks of f rows
 *           (one OpenMP region per GEMV); the bf16 outputs of many, ffn and
 *           matrix must be equal bit for bit (checked every round on layer 0;
 *           a mismatch fails the run)
 *   sweep   a 256-bit XOR sweep over the same weight bytes, split in 1 MiB
 *           pieces over the threads (the bound of bench_engine)
 *   read    shoal_read_bw_pass over 512 MiB of other memory (`shoal bench`)
 * Weights: L distinct layers (default 2: 2 x 16 x 17.5 MB, ten times the
 * L3), cycled, so every layer streams from DRAM. --file PATH puts them in a
 * file mapped MAP_SHARED instead of malloc (the engine maps its safetensors):
 * its first round is the cold one (page faults), reported apart.
 * usage: bench_expert [--threads N] [--rounds R] [--experts E] [--layers L] [--file PATH]
 * Output: one line per row and round (key=value), then a summary per row:
 * median [min, max] of seconds per layer, GB/s of weight bytes, ratio to the
 * same round's sweep. */
#include <fcntl.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/st.h"
#include "kernels/kernels.h"
#include "tests/bench/bench_util.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}



static double sweep(const uint8_t *p, size_t n, uint64_t *sink)
{
    size_t pieces = (n + (1u << 20) - 1) >> 20;
    uint64_t acc = 0;
    double t0 = now();
#pragma omp parallel for schedule(static) reduction(^ : acc)
    for (size_t k = 0; k < pieces; k++) {
        size_t off = k << 20, len = n - off < (1u << 20) ? n - off : (1u << 20);
        acc ^= bench_sweep_avx2(p + off, len);
    }
    *sink ^= acc;
    return now() - t0;
}

enum { D = 3584, F = 3072 };

/* the matrix-at-a-time form (the previous shoal_expert_ffn), public kernels only */
static void ffn_matrix(uint16_t *y, const shoal_expert_w *e, const float *x, float *scr)
{
    float *h1 = scr, *h3 = scr + F;
    shoal_gemm_mxfp4(h1, e->w1, e->w1_scale, x, F, D, 1);
    shoal_gemm_mxfp4(h3, e->w3, e->w3_scale, x, F, D, 1);
    shoal_situ_glu(h1, h1, h3, F, 4.0f, 25.0f);
    for (int r0 = 0; r0 < D; r0 += F) {
        int n = D - r0 < F ? D - r0 : F;
        shoal_gemm_mxfp4(h3, (const uint8_t *)e->w2 + (size_t)r0 * (F / 2), e->w2_scale + (size_t)r0 * (F / 32), h1,
                         n, F, 1);
        for (int j = 0; j < n; j++)
            y[r0 + j] = shoal_f32_to_bf16(h3[j]);
    }
}

int main(int argc, char **argv)
{
    int threads = 1, rounds = 5, E = 16, L = 2;
    const char *file = NULL;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--threads"))
            threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--experts"))
            E = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--layers"))
            L = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--file"))
            file = argv[++i];
        else {
            fprintf(stderr, "usage: bench_expert [--threads N] [--rounds R] [--experts E] [--layers L] [--file P]\n");
            return 2;
        }
    }
    if (threads < 1 || rounds < 1 || rounds > 1000 || E < 1 || E > 64 || L < 1 || L > 64)
        return 2;
    shoal_kernels_init();
    omp_set_num_threads(threads);
    size_t mbytes = (size_t)F * (D / 2) + (size_t)F * (D / 32); /* W1 or W3 */
    size_t m2bytes = (size_t)D * (F / 2) + (size_t)D * (F / 32);
    size_t ebytes = 2 * mbytes + m2bytes, total = ebytes * (size_t)E * L;
    uint8_t *buf;
    int fd = -1;
    if (file) {
        fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)total)) {
            perror("bench_expert: file");
            return 1;
        }
        uint8_t *tmp = malloc(1 << 20);
        for (size_t off = 0; off < total; off += 1 << 20) {
            size_t n = total - off < (1u << 20) ? total - off : (1u << 20);
            for (size_t i = 0; i < n; i++)
                tmp[i] = (uint8_t)bench_rnd();
            if (pwrite(fd, tmp, n, (off_t)off) != (ssize_t)n) {
                perror("bench_expert: write");
                return 1;
            }
        }
        free(tmp);
        buf = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (buf == MAP_FAILED) {
            perror("bench_expert: mmap");
            return 1;
        }
    } else {
        buf = aligned_alloc(64, (total + 63) / 64 * 64);
        for (size_t i = 0; i < total; i++)
            buf[i] = (uint8_t)bench_rnd();
    }
    shoal_expert_w *w = calloc((size_t)E * L, sizeof *w);
    for (int i = 0; i < E * L; i++) {
        uint8_t *b = buf + (size_t)i * ebytes;
        size_t p1 = (size_t)F * (D / 2), p2 = (size_t)D * (F / 2);
        w[i] = (shoal_expert_w){.kind = SHOAL_EXPERT_MXFP4, .d = D, .f = F};
        w[i].w1 = b;
        w[i].w1_scale = b + p1;
        w[i].w3 = b + mbytes;
        w[i].w3_scale = b + mbytes + p1;
        w[i].w2 = b + 2 * mbytes;
        w[i].w2_scale = b + 2 * mbytes + p2;
        /* E8M0 scales near 2^0 (118..133): finite outputs, no NaN code */
        uint8_t *s1 = b + p1, *s3 = b + mbytes + p1, *s2 = b + 2 * mbytes + p2;
        for (size_t j = 0; j < (size_t)F * (D / 32); j++)
            s1[j] = (uint8_t)(118 + bench_rnd() % 16), s3[j] = (uint8_t)(118 + bench_rnd() % 16);
        for (size_t j = 0; j < (size_t)D * (F / 32); j++)
            s2[j] = (uint8_t)(118 + bench_rnd() % 16);
    }
    if (file) /* the cold round below faults the pages in afresh */
        madvise(buf, total, MADV_DONTNEED);
    float *x = aligned_alloc(64, sizeof(float) * D), *scr = aligned_alloc(64, sizeof(float) * 2 * F);
    for (int i = 0; i < D; i++)
        x[i] = ((float)(bench_rnd() % 2001) - 1000.0f) / 1000.0f;
    uint16_t *ya = malloc(2 * (size_t)D * E), *yb = malloc(2 * (size_t)D * E);
    size_t rb_words = (512u << 20) / 8;
    uint64_t *rb = aligned_alloc(64, rb_words * 8), sink = 0;
    for (size_t i = 0; i < rb_words; i++)
        rb[i] = i * 0x9e3779b97f4a7c15ull;
    size_t lbytes = ebytes * (size_t)E;

    printf("bench_expert d=%d f=%d E=%d layers=%d threads=%d rounds=%d expert_bytes=%zu layer_bytes=%zu mem=%s "
           "isa=%s\n",
           D, F, E, L, threads, rounds, ebytes, lbytes, file ? "file-mmap" : "malloc",
           shoal_isa_name(shoal_kernels_isa()));
    enum { NROW = 5, NK = 3 };
    static const char *names[NROW] = {"ffn", "matrix", "many", "sweep", "read"};
    double *t[NROW], *ratio[NK];
    for (int k = 0; k < NROW; k++)
        t[k] = calloc((size_t)rounds, sizeof(double));
    for (int k = 0; k < NK; k++)
        ratio[k] = calloc((size_t)rounds, sizeof(double));
    float *mscr = aligned_alloc(64, sizeof(float) * 2 * F * (size_t)threads);
    uint16_t *yc = malloc(2 * (size_t)D * E), *py[64];
    const shoal_expert_w *pe[64];
    const float *px[64];
    int pt[64];
    int layer = 0, bad = 0;
    /* round -1: warm-up (the cold faults of --file, reported apart) */
    for (int r = -1; r < rounds; r++) {
        for (int kk = 0; kk < NROW; kk++) {
            int k = (kk + (r < 0 ? 0 : r)) % NROW;
            const shoal_expert_w *lw = w + (size_t)layer * E;
            double dt;
            if (k == 0 || k == 1) {
                uint16_t *y = k == 0 ? ya : yb;
                double t0 = now();
                for (int e = 0; e < E; e++) {
                    if (k == 0)
                        shoal_expert_ffn(y + (size_t)e * D, &lw[e], x, 1, 4.0f, 25.0f, scr);
                    else
                        ffn_matrix(y + (size_t)e * D, &lw[e], x, scr);
                }
                dt = now() - t0;
                layer = (layer + 1) % L;
            } else if (k == 2) {
                for (int e = 0; e < E; e++)
                    py[e] = yc + (size_t)e * D, pe[e] = &lw[e], px[e] = x, pt[e] = 1;
                double t0 = now();
                shoal_expert_ffn_many(py, pe, px, pt, E, 4.0f, 25.0f, mscr, threads);
                dt = now() - t0;
                layer = (layer + 1) % L;
            } else if (k == 3) {
                dt = sweep(buf + (size_t)layer * lbytes, lbytes, &sink);
                layer = (layer + 1) % L;
            } else {
                dt = (double)rb_words * 8 / 1e9 / shoal_read_bw_pass(rb, rb_words, threads, &sink);
            }
            double gbps = (k == 4 ? (double)rb_words * 8 : (double)lbytes) / dt / 1e9;
            printf("round=%d row=%s s=%.6f gbps=%.3f%s\n", r, names[k], dt, gbps, r < 0 ? " (warm-up)" : "");
            if (r >= 0)
                t[k][r] = dt;
        }
        if (r >= 0) { /* the two rows ran on different layers: both again on layer 0 */
            const shoal_expert_w *lw = w;
            for (int e = 0; e < E; e++) {
                shoal_expert_ffn(ya + (size_t)e * D, &lw[e], x, 1, 4.0f, 25.0f, scr);
                ffn_matrix(yb + (size_t)e * D, &lw[e], x, scr);
                py[e] = yc + (size_t)e * D, pe[e] = &lw[e], px[e] = x, pt[e] = 1;
            }
            shoal_expert_ffn_many(py, pe, px, pt, E, 4.0f, 25.0f, mscr, threads);
        }
        if (r >= 0 && (memcmp(ya, yb, 2 * (size_t)D * E) || memcmp(ya, yc, 2 * (size_t)D * E))) {
            printf("round=%d MISMATCH: many / ffn / the matrix-at-a-time form differ\n", r);
            bad = 1;
        }
        if (r >= 0) {
            for (int k = 0; k < NK; k++)
                ratio[k][r] = t[3][r] / t[k][r];
        }
    }
    for (int k = 0; k < NROW; k++) {
        double s[1000];
        memcpy(s, t[k], sizeof(double) * (size_t)rounds);
        qsort(s, (size_t)rounds, sizeof(double), bench_cmpd);
        double bytes = k == 4 ? (double)rb_words * 8 : (double)lbytes;
        printf("summary row=%s threads=%d s_median=%.6f s_min=%.6f s_max=%.6f gbps_median=%.3f", names[k], threads,
               s[rounds / 2], s[0], s[rounds - 1], bytes / s[rounds / 2] / 1e9);
        if (k < NK) {
            memcpy(s, ratio[k], sizeof(double) * (size_t)rounds);
            qsort(s, (size_t)rounds, sizeof(double), bench_cmpd);
            printf(" ratio_to_sweep_median=%.3f min=%.3f max=%.3f", s[rounds / 2], s[0], s[rounds - 1]);
        }
        printf("\n");
    }
    printf("bits=%s sink=%llu\n", bad ? "DIFFER" : "identical", (unsigned long long)(sink & 1));
    if (file) {
        munmap(buf, total);
        close(fd);
        unlink(file);
    }
    return bad;
}
