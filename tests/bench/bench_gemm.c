/* bench_gemm: GMAC/s of one matrix kernel at the given shape and token
 * counts, for the kernel figures of docs/PERFORMANCE.md (issue 33). Not a
 * test. Weights are cycled over enough copies to leave the LLC (--copies 1
 * keeps one copy: in cache when it fits). Reports the median of the reps and
 * the [min, max], wall clock and the calling thread's CPU time.
 * usage: bench_gemm KIND ROWS COLS T[,T...] [--reps N] [--copies N] [--threads N]
 *                   [--amx-variants NAME[,NAME...]]
 *   KIND: bf16 | f32 | mxfp4, or bf16mu | mxfp4mu (the matrix-unit order)
 *   --amx-variants: the AMX GEMM's variants (kernels/README.md; "base", "k256+once",
 *   ... separated by ','), interleaved rep by rep over the same weights, one row
 *   each; a variant that fails the start-up self-test gets a row saying so and
 *   is left out. Needs AMX in use (mu kinds; SHOAL_AMX_MIN_T=1 for every T). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "kernels/kernels.h"
#include "kernels/kernels_int.h"
#include "tests/bench/bench_util.h"

static double now(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}


int main(int argc, char **argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: bench_gemm bf16|f32|mxfp4 ROWS COLS T[,T...] [--reps N] [--copies N] [--threads N] "
                        "[--amx-variants A,B,...]\n");
        return 2;
    }
    const char *kind = argv[1];
    int rows = atoi(argv[2]), cols = atoi(argv[3]);
    int Ts[32], nT = 0;
    for (char *p = argv[4]; *p && nT < 32;) {
        Ts[nT++] = (int)strtol(p, &p, 10);
        if (*p == ',')
            p++;
    }
    int reps = 5, copies = 0, threads = 1;
    const char *variants = NULL;
    for (int i = 5; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--amx-variants"))
            variants = argv[i + 1];
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--copies"))
            copies = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads"))
            threads = atoi(argv[i + 1]);
    }
    if (rows < 1 || cols < 32 || cols % 32 || reps < 1 || reps > 1000 || threads < 1) {
        fprintf(stderr, "bench_gemm: bad arguments\n");
        return 2;
    }
    if (shoal_kernels_init()) {
        fprintf(stderr, "bench_gemm: kernel ISA unavailable\n");
        return 3;
    }
    omp_set_num_threads(threads);
    int mu = !strcmp(kind, "bf16mu") || !strcmp(kind, "mxfp4mu");
    /* the variants to interleave (one unnamed pass without --amx-variants) */
    char vlist[1024], *vname[32];
    int nv = 0, vflags[32];
    snprintf(vlist, sizeof vlist, "%s", variants ? variants : "");
    if (variants) {
        if (!mu) {
            fprintf(stderr, "bench_gemm: --amx-variants needs a mu kind\n");
            return 2;
        }
        for (char *save = NULL, *tok = strtok_r(vlist, ",", &save); tok && nv < 32; tok = strtok_r(NULL, ",", &save)) {
            int rc = shoal_kernels_set_amx_variant(tok);
            if (rc) { /* unknown, AMX not in use, or failed the self-test: said, left out */
                printf("{\"kind\":\"%s\",\"amx_variant\":\"%s\",\"error\":\"%s\",\"mu_path\":\"%s\"}\n", kind, tok,
                       shoal_strerror(rc), shoal_kernels_mu_path());
                continue;
            }
            shoal__kernels_amx_variant_parse(tok, &vflags[nv]);
            vname[nv++] = tok;
        }
        if (!nv)
            return 3;
    } else
        vname[nv++] = NULL;
    int k = !strncmp(kind, "bf16", 4) ? 0 : !strcmp(kind, "f32") ? 1 : !strncmp(kind, "mxfp4", 5) ? 2 : -1;
    if (k < 0) {
        fprintf(stderr, "bench_gemm: unknown kind %s\n", kind);
        return 2;
    }
    size_t n = (size_t)rows * cols;
    size_t wb = k == 0 ? n * 2 : k == 1 ? n * 4 : n / 2 + n / 32;
    if (copies < 1)
        copies = (int)(((size_t)256 << 20) / wb + 1);
    uint8_t *w = malloc(wb * copies);
    int Tmax = 1;
    for (int i = 0; i < nT; i++)
        Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
    /* x at XOFF bytes past a 64-byte boundary (default 0): the engine's activations are
     * 64-byte aligned; a plain malloc of this size is 16 past one */
    const char *xo = getenv("XOFF");
    size_t xoff = xo ? (size_t)atoi(xo) : 0;
    char *xraw = NULL;
    float *x = posix_memalign((void **)&xraw, 64, (size_t)Tmax * cols * 4 + 64) ? NULL : (float *)(xraw + xoff),
          *y = malloc((size_t)Tmax * rows * 4);
    if (!w || !x || !y) {
        fprintf(stderr, "bench_gemm: out of memory\n");
        return 4;
    }
    for (size_t i = 0; i < wb * copies; i++)
        w[i] = (uint8_t)bench_rnd();
    if (k == 0)
        for (size_t i = 0; i < wb * copies / 2; i++) /* bf16 in [-2, 2]: exponent byte 0x3e..0x3f */
            ((uint16_t *)w)[i] = (uint16_t)((((uint16_t *)w)[i] & 0x80ff) | 0x3e00 | ((bench_rnd() & 1) << 8));
    if (k == 1)
        for (size_t i = 0; i < wb * copies / 4; i++)
            ((float *)w)[i] = (float)(bench_rnd() % 2001) / 1000.0f - 1.0f;
    if (k == 2)
        for (int c = 0; c < copies; c++)
            for (size_t i = n / 2; i < wb; i++)
                w[(size_t)c * wb + i] = (uint8_t)(118 + bench_rnd() % 12);
    for (size_t i = 0; i < (size_t)Tmax * cols; i++)
        x[i] = (float)(bench_rnd() % 2001) / 1000.0f - 1.0f;
    printf("# bench_gemm %s %dx%d isa %s threads %d copies %d reps %d l2 %ld KiB\n", kind, rows, cols,
           shoal_isa_name(shoal_kernels_isa()), threads, copies, reps, shoal_kernels_l2_bytes() >> 10);
    for (int ti = 0; ti < nT; ti++) {
        int T = Ts[ti];
        double *wt = calloc((size_t)reps * nv, sizeof *wt), *ct = calloc((size_t)reps * nv, sizeof *ct);
        for (int r = -1; r < reps; r++)
            for (int v = 0; v < nv; v++) {
                if (vname[v]) /* passed its self-test above: switched without running it again */
                    shoal__kernels_amx_set_variant(vflags[v]);
                double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_THREAD_CPUTIME_ID);
                for (int c = 0; c < copies; c++) {
                    const uint8_t *wc = w + (size_t)c * wb;
                    if (k == 0 && mu)
                        shoal_gemm_bf16_mu(y, (const uint16_t *)wc, x, rows, cols, T);
                    else if (k == 0)
                        shoal_gemm_bf16(y, (const uint16_t *)wc, x, rows, cols, T);
                    else if (k == 1)
                        shoal_gemm_f32(y, (const float *)wc, x, rows, cols, T);
                    else if (mu)
                        shoal_gemm_mxfp4_mu(y, wc, wc + n / 2, x, rows, cols, T);
                    else
                        shoal_gemm_mxfp4(y, wc, wc + n / 2, x, rows, cols, T);
                }
                if (r >= 0) {
                    wt[(size_t)v * reps + r] = (now(CLOCK_MONOTONIC) - t0) / copies;
                    ct[(size_t)v * reps + r] = (now(CLOCK_THREAD_CPUTIME_ID) - c0) / copies;
                }
            }
        for (int v = 0; v < nv; v++) {
            double *wv = wt + (size_t)v * reps, *cv = ct + (size_t)v * reps;
            if (vname[v])
                shoal_kernels_set_amx_variant(vname[v]); /* for the row's mu_path */
            qsort(wv, reps, sizeof *wv, bench_cmpd);
            qsort(cv, reps, sizeof *cv, bench_cmpd);
            double mac = (double)n * T / 1e9;
            printf("{\"kind\":\"%s\",\"shape\":\"%dx%d\",\"T\":%d,\"threads\":%d,\"isa\":\"%s\",\"gmacs\":%.2f,"
                   "\"gmacs_min\":%.2f,\"gmacs_max\":%.2f,\"gmacs_cpu\":%.2f,\"gbps\":%.2f,\"amx_variant\":\"%s\","
                   "\"mu_path\":\"%s\"}\n",
                   kind, rows, cols, T, threads, shoal_isa_name(shoal_kernels_isa()), mac / wv[reps / 2],
                   mac / wv[reps - 1], mac / wv[0], mac / cv[reps / 2], wb / wv[reps / 2] / 1e9,
                   vname[v] ? vname[v] : "-", mu ? shoal_kernels_mu_path() : "-");
        }
        fflush(stdout);
        free(wt), free(ct);
    }
    return 0;
}
