/* ggml_anchor_gemm: shoal_gemm_bf16 against ggml's bf16 mul_mat (llama.cpp's CPU
 * backend) on the same shape, alternated in one process over distinct weight
 * copies (each call streams its matrix from DRAM), for the issue-33 anchor in
 * docs/PERFORMANCE.md. Not built by the project (it needs a ggml checkout and
 * is named without the bench_ prefix); build it by hand, e.g. with ggml from
 * the llama-cpp-python sdist built as static libraries (GGML_NATIVE=ON):
 *   cc -O2 -fopenmp -I. -I$G/ggml/include tests/bench/ggml_anchor_gemm.c \
 *      build/libshoal_kernels.a build/libshoal_common.a \
 *      $G/build/ggml/src/libggml.a $G/build/ggml/src/libggml-cpu.a \
 *      $G/build/ggml/src/libggml-base.a -lstdc++ -lm -o /tmp/ggml_anchor_gemm
 * usage: ggml_anchor_gemm ROWS COLS T[,T...] [ROUNDS] — one thread each.
 * SHOAL_ISA=avx2|avx512 picks shoal's kernels; ggml's are those of the build linked
 * (its compile-time flags are printed in the ggml_cpu meta line).
 * Prints one JSON line per (round, impl, T): GMAC/s by wall clock and by the
 * thread's CPU time. ggml rounds x to bf16 for its vec_dot (its own numerics);
 * shoal keeps fp32 activations: equal work, not equal results. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"
#include "kernels/kernels.h"

static double now(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rs = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
    rs ^= rs << 13, rs ^= rs >> 7, rs ^= rs << 17;
    return (uint32_t)(rs >> 11);
}

#define COPIES 2

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: ggml_anchor_gemm ROWS COLS T[,T...] [ROUNDS]\n");
        return 2;
    }
    int rows = atoi(argv[1]), cols = atoi(argv[2]), rounds = argc > 4 ? atoi(argv[4]) : 3;
    int Ts[16], nT = 0, Tmax = 1;
    for (char *p = argv[3]; *p && nT < 16;) {
        Ts[nT] = (int)strtol(p, &p, 10);
        Tmax = Ts[nT] > Tmax ? Ts[nT] : Tmax;
        nT++;
        if (*p == ',')
            p++;
    }
    if (shoal_kernels_init())
        return 3;
    omp_set_num_threads(1);
    size_t n = (size_t)rows * cols;
    size_t sumT = 0;
    for (int i = 0; i < nT; i++)
        sumT += (size_t)Ts[i];
    /* the weights, then per (round, T) x, the outputs, ggml's bf16 copy of x and the graphs */
    size_t need = COPIES * n * 2 + (size_t)rounds * sumT * ((size_t)cols * 6 * COPIES + (size_t)rows * 4 * COPIES) +
                  (size_t)rounds * nT * ((size_t)8 << 20) + ((size_t)64 << 20);
    struct ggml_init_params ip = {.mem_size = need, .mem_buffer = NULL, .no_alloc = false};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_tensor *W[COPIES];
    for (int c = 0; c < COPIES; c++) {
        W[c] = ggml_new_tensor_2d(ctx, GGML_TYPE_BF16, cols, rows);
        uint16_t *d = W[c]->data;
        for (size_t i = 0; i < n; i++) /* bf16 in [-2, 2] */
            d[i] = (uint16_t)((rnd() & 0x80ff) | 0x3e00 | ((rnd() & 1) << 8));
    }
    uint16_t *ws[COPIES];
    for (int c = 0; c < COPIES; c++) { /* shoal's own copies: both sides stream from DRAM */
        ws[c] = malloc(n * 2);
        memcpy(ws[c], W[c]->data, n * 2);
    }
    float *x = NULL, *y = malloc((size_t)Tmax * rows * 4); /* x 64-byte aligned, as the engine's */
    if (posix_memalign((void **)&x, 64, (size_t)Tmax * cols * 4) || !y)
        return 4;
    for (size_t i = 0; i < (size_t)Tmax * cols; i++)
        x[i] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
    /* what the linked ggml was compiled for (its system-info flags), so a run on a
     * restricted build (GGML_NATIVE=OFF, an ISA class) says which class it is */
    printf("{\"meta\":\"ggml_cpu\",\"value\":\"AVX %d AVX2 %d FMA %d F16C %d AVX512 %d AVX512_BF16 %d "
           "AVX512_VNNI %d AVX512_VBMI %d AMX_INT8 %d LLAMAFILE %d\"}\n",
           ggml_cpu_has_avx(), ggml_cpu_has_avx2(), ggml_cpu_has_fma(), ggml_cpu_has_f16c(), ggml_cpu_has_avx512(),
           ggml_cpu_has_avx512_bf16(), ggml_cpu_has_avx512_vnni(), ggml_cpu_has_avx512_vbmi(),
           ggml_cpu_has_amx_int8(), ggml_cpu_has_llamafile());
    printf("{\"meta\":\"shape\",\"value\":\"%dx%d bf16, isa %s, 1 thread, %d copies\"}\n", rows, cols,
           shoal_isa_name(shoal_kernels_isa()), COPIES);
    for (int r = 0; r < rounds; r++)
        for (int ti = 0; ti < nT; ti++) {
            int T = Ts[ti];
            struct ggml_tensor *X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, cols, T);
            memcpy(X->data, x, (size_t)T * cols * 4);
            struct ggml_tensor *Y[COPIES];
            struct ggml_cgraph *gf[COPIES];
            for (int c = 0; c < COPIES; c++) {
                Y[c] = ggml_mul_mat(ctx, W[c], X);
                gf[c] = ggml_new_graph(ctx);
                ggml_build_forward_expand(gf[c], Y[c]);
            }
            for (int impl = 0; impl < 2; impl++) {
                for (int warm = 0; warm < 2; warm++) {
                    double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
                    for (int c = 0; c < COPIES; c++) {
                        if (impl == 0)
                            shoal_gemm_bf16(y, ws[c], x, rows, cols, T);
                        else
                            ggml_graph_compute_with_ctx(ctx, gf[c], 1);
                    }
                    double wt = (now(CLOCK_MONOTONIC) - t0) / COPIES, ct = (now(CLOCK_THREAD_CPUTIME_ID) - c0) / COPIES;
                    if (warm)
                        printf("{\"round\":%d,\"impl\":\"%s\",\"T\":%d,\"gmacs\":%.2f,\"gmacs_cpu\":%.2f}\n", r,
                               impl ? "ggml" : "shoal", T, (double)n * T / wt / 1e9, (double)n * T / ct / 1e9);
                }
                fflush(stdout);
            }
        }
    ggml_free(ctx);
    return 0;
}
