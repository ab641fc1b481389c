/* kernels: every hot loop of shoal and the only intrinsics in the tree.
 * Callers: the coordinator's model forward and the worker's expert execution.
 *
 * Contracts (enforced by tests/unit/test_kernels.c, FP contract in kernels/README.md):
 * - Outputs first, then inputs, then sizes. Matrices are row-major exactly as
 *   stored in the checkpoint: W[rows, cols], y = W x ("x @ W^T").
 * - Kernels never allocate and never log; scratch is passed in by the caller.
 * - Determinism: every GEMM/GEMV output element y[t][r] depends only on row r
 *   of W and on x[t]; it is bit-identical for any T, any batch composition, any
 *   OpenMP thread count, and for every ISA variant (the scalar version defines
 *   the summation order; SIMD variants reproduce it). Batched prefill therefore
 *   equals token-by-token decode bit for bit, and an expert computed on any
 *   worker equals the in-process one.
 * - Parallelism is over output rows (or heads) only, never inside a dot product.
 * - Widths passed to the matrix kernels are multiples of 32 (every K3 width is).
 */
#ifndef SHOAL_KERNELS_H
#define SHOAL_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef enum { SHOAL_ISA_SCALAR = 0, SHOAL_ISA_AVX2 = 1, SHOAL_ISA_AVX512 = 2 } shoal_isa;

/* Pick the best variant the CPU supports (CPUID), unless SHOAL_ISA=scalar|avx2|avx512
 * overrides it (refused with SHOAL_EUNSUPPORTED if the CPU lacks it). Idempotent;
 * the caller logs shoal_isa_name(shoal_kernels_isa()). */
int shoal_kernels_init(void);
shoal_isa shoal_kernels_isa(void);
int shoal_kernels_set_isa(shoal_isa isa); /* tests and benchmarks; 0 or SHOAL_EUNSUPPORTED */
int shoal_kernels_cpu_has(shoal_isa isa);
shoal_isa shoal_kernels_cpu_best(void); /* the best variant the CPU supports (for shoal_build_info) */
const char *shoal_isa_name(shoal_isa isa);
/* Bytes of L2 cache per core as the kernels size their blocks (sysconf at
 * shoal_kernels_init; 1 MiB when the system does not say). */
long shoal_kernels_l2_bytes(void);

/* ---- instruction peaks (shoal bench peak) -------------------------------- */

/* The arithmetic ceilings a kernel figure is stated against: fp32 FMA (the
 * widest vector the CPU has), AVX512-BF16 vdpbf16ps, AVX512-VNNI vpdpbusd
 * (int8), AMX TDPBF16PS. */
typedef enum {
    SHOAL_PEAK_FMA_F32 = 0,
    SHOAL_PEAK_BF16_DOT = 1,
    SHOAL_PEAK_INT8_VNNI = 2,
    SHOAL_PEAK_AMX_BF16 = 3,
} shoal_peak;
#define SHOAL_PEAK_COUNT 4
/* Run n iterations of that instruction's loop on the calling thread (no memory
 * traffic; 12 independent chains, or 4 AMX tiles) and return the
 * multiply-adds done; 0 when the CPU or the build lacks it. *what names the
 * instruction used (e.g. "vfmadd231ps zmm"). */
double shoal_kernels_peak(shoal_peak kind, long n, const char **what);

/* ---- matrix kernels ---------------------------------------------------- */

/* y[T, rows] = x[T, cols] · W[rows, cols]^T; W row-major bf16. */
void shoal_gemm_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols, int T);
/* Same with W row-major fp32 (float32 checkpoints). */
void shoal_gemm_f32(float *y, const float *w, const float *x, int rows, int cols, int T);
/* Same with W in compressed-tensors MXFP4 (SPEC §4.2): packed[rows, cols/2]
 * (element 2j in the low nibble of byte j), scale[rows, cols/32] E8M0 (2^(e-127)).
 * Computed straight from the packed bytes; never a dequantized copy. */
void shoal_gemm_mxfp4(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows,
                      int cols, int T);
/* The matrix-unit order ("mu"; kernels/README.md, "Matrix-unit order"): the
 * same products as shoal_gemm_bf16 / shoal_gemm_mxfp4 in the order AMX-BF16
 * computes them: x rounded to bf16 at the input, per 32 columns two FMA chains
 * (even, odd columns) folded into the output as C + (E + O), subnormals
 * flushed. An opt-in numerics class: bit-identical across ISAs (AMX where its
 * start-up self-test passes, the AVX-512F / AVX2 emulation or the scalar
 * specification elsewhere), T, threads and batch composition, but not equal
 * to shoal_gemm_bf16. */
void shoal_gemm_bf16_mu(float *y, const uint16_t *w, const float *x, int rows, int cols, int T);
void shoal_gemm_mxfp4_mu(float *y, const uint8_t *packed, const uint8_t *scale, const float *x, int rows, int cols,
                         int T);
/* The numerics class of the process (issue 33; docs/ARCHITECTURE.md,
 * "Numerics classes"): which order shoal_gemm_bf16 and shoal_gemm_mxfp4 (and so
 * shoal_expert_ffn and every trunk matmul) compute. PORTABLE, the default, is
 * the fp32-activation order; MU routes both to shoal_gemm_bf16_mu /
 * shoal_gemm_mxfp4_mu. fp32 weights (shoal_gemm_f32) and the transposed GEMVs
 * keep the fp32-activation order in both classes. One class per process, set
 * once at start-up before any forward (commands: --numerics); never changed
 * while kernels run on other threads. */
typedef enum { SHOAL_NUMERICS_PORTABLE = 0, SHOAL_NUMERICS_MU = 1 } shoal_numerics;
void shoal_kernels_set_numerics(shoal_numerics n);
shoal_numerics shoal_kernels_numerics(void);
const char *shoal_numerics_name(shoal_numerics n); /* "portable" | "mu" */
/* "portable" or "mu" -> 0 and *out; anything else SHOAL_EINVAL. */
int shoal_numerics_parse(const char *s, shoal_numerics *out);

/* The mu class's input rounding as bf16 bits, for the wire (PROTOCOL.md 1.7:
 * bf16 activations where the receiver rounds them anyway): y[i] = the bf16
 * value shoal_gemm_bf16_mu / shoal_gemm_mxfp4_mu read for x[i] -- round to
 * nearest even, NaN kept (quiet), a result below 2^-126 in magnitude a zero of
 * its sign -- computed by the mu specification's own rounding function, not a
 * copy of it. Idempotent: widening y exactly and rounding again gives y, so a
 * mu product of the widened y has the bits of the product of x (test_kernels
 * t_mu_wire_round, every ISA). Not shoal_f32_to_bf16 (common/st.h), which
 * keeps subnormals. Any n; no allocation; any thread. */
void shoal_mu_round_bf16(uint16_t *y, const float *x, size_t n);

/* Which engine computes the mu kernels: "amx", or the active ISA's name, with
 * a note when AMX is present but failed its start-up self-test (kernels never
 * log: `shoal version` prints it as its one line about the mu kernels). */
const char *shoal_kernels_mu_path(void);
/* Where AMX runs the mu kernels: calls of at least n tokens (n >= 1; the
 * smaller ones run the AVX-512 emulation of the same order, bit-identical).
 * Tests and benchmarks; returns the previous value; n < 1 only reads it. */
int shoal_kernels_set_amx_min_t(int n);
/* Which variant of the AMX GEMM runs (kernels/README.md, "Matrix-unit order":
 * "base", or k256, once, pf, pipe, swap joined by '+'; every one computes the
 * same bits): runs the start-up self-test on it and selects it when it
 * passes. 0, SHOAL_EINVAL for an unknown name, SHOAL_EUNSUPPORTED when AMX
 * is not in use or the variant failed the self-test (the previous one stays).
 * For benchmarks and tests, between kernel calls (not thread-safe); the
 * environment variable SHOAL_AMX_VARIANT sets it at shoal_kernels_init. */
int shoal_kernels_set_amx_variant(const char *name);
/* The AVX-512 MXFP4 decode of the portable class (kernels/README.md, "MXFP4
 * (AVX-512)"): SHIFT (a broadcast load, qword shifts and two vpermps: two
 * shuffles per 32 weights) or VPMOVZX (vpmovzxbd and two vpermps: three
 * shuffles; the default everywhere until SHIFT is timed faster on an Intel
 * CPU). Bit-identical: a speed choice only. shoal_kernels_init takes the
 * default, or what the environment variable SHOAL_MX_DECODE=shift|vpmovzx
 * says; this call is for tests and benchmarks. Not thread-safe: call it while no GEMM runs. Returns 0, or
 * SHOAL_EINVAL for an unknown value. */
typedef enum { SHOAL_MX_DECODE_SHIFT = 0, SHOAL_MX_DECODE_VPMOVZX = 1 } shoal_mx_decode;
int shoal_kernels_set_mx_decode(shoal_mx_decode d);
shoal_mx_decode shoal_kernels_mx_decode(void);
const char *shoal_mx_decode_name(shoal_mx_decode d); /* "shift" | "vpmovzx" */
/* The mu class's MXFP4 fold path (kernels/README.md: the block scale folded
 * out of the chains where that is exact, the table path elsewhere): on (1,
 * the default) or off (0: the table path for every block). Bit-identical: a
 * speed choice only, for A/B timings on a new CPU (SHOAL_MU_FOLD=on|off at
 * init). Not thread-safe: call it while no GEMM runs. */
void shoal_kernels_set_mu_fold(int on);
int shoal_kernels_mu_fold(void);
/* The same as one word: "amx", "avx512", "avx2" or "scalar" (metrics labels). */
const char *shoal_kernels_mu_engine(void);

/* y[cols] = W[rows, cols]^T · x[rows] (sums over r in increasing order); W bf16.
 * Used for the absorbed MLA query (W_UK^T q_nope). */
void shoal_gemv_t_bf16(float *y, const uint16_t *w, const float *x, int rows, int cols);
void shoal_gemv_t_f32(float *y, const float *w, const float *x, int rows, int cols);

/* ---- elementwise / small fp32 ops (scalar is the spec) ----------------- */

/* y[n] = w ⊙ (x / sqrt(mean(x²) + eps)); w may be NULL (no weight). y may alias x. */
void shoal_rmsnorm(float *y, const float *x, const float *w, int n, float eps);
/* x[n] /= sqrt(Σ x² + eps), in place (FLA's l2norm form, eps inside the sqrt). */
void shoal_l2norm(float *x, int n, float eps);
void shoal_softmax(float *x, int n); /* in place, max-subtracted */
float shoal_sigmoid(float x);
/* y[n] = [b1·tanh(g/b1)·sigmoid(g)] · [b2·tanh(u/b2)] (SiTU-GLU). y may alias g. */
void shoal_situ_glu(float *y, const float *g, const float *u, int n, float b1, float b2);

/* ---- KDA --------------------------------------------------------------- */

/* One token of the causal depthwise short conv + SiLU, per channel c < C:
 * out[c] = SiLU(Σ_{j<K-1} taps[c*K+j]·window[j*C+c] + taps[c*K+K-1]·x[c]);
 * window[(K-1), C] holds the previous K-1 pre-conv inputs, oldest first, zero at
 * sequence start; it is shifted and x appended. taps as stored ([C,1,K] fp32). */
void shoal_kda_conv_step(float *out, float *window, const float *x, const float *taps, int C, int K);

/* Decay gate g[H*D] (log space) from z[H*D] = f_b(f_a(x)):
 * lower_bound form: g = lb · sigmoid(exp(A_log[h]) · (z + dt_bias));
 * softplus form:    g = -exp(A_log[h]) · softplus(z + dt_bias)   (lb ignored). */
void shoal_kda_gate(float *g, const float *z, const float *A_log, const float *dt_bias, int H, int D,
                    int lower_bound_form, float lb);

/* One delta-rule step for all heads (parallel over heads). S[H, D(k), D(v)] fp32;
 * q, k [H, D] already L2-normalised (q also scaled by D^-1/2); v [H, D]; g [H, D];
 * beta [H] (post-sigmoid). Per head: S = diag(exp g) S; u = v - S^T k;
 * S += k (beta u)^T; o = S^T q. D <= 256. */
void shoal_kda_step(float *o, float *S, const float *q, const float *k, const float *v, const float *g,
                    const float *beta, int H, int D);

/* Gated output norm per head: y[h,i] = o[h,i]/sqrt(mean_i(o[h,:]²)+eps) · w[i] · sigmoid(gate[h,i]). */
void shoal_gated_rmsnorm(float *y, const float *o, const float *gate, const float *w, int H, int D, float eps);

/* ---- MLA (absorbed form; one query token against S cached tokens) ------ */

/* ctx[H, R] = Σ_s p[h,s] · c_s[0:R], p[h,:] = softmax_s(scale · (q_lat[h]·c_s[0:R] + q_pe[h]·c_s[R:R+P]))
 * cache[S, R+P] rows (ĉ ‖ k_pe); scratch[H*S]. Parallel over heads. */
void shoal_mla_attend(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S, int H, int R,
                      int P, float scale, float *scratch);

/* Batched (prefill) form: T query tokens of one sequence at positions S0..S0+T-1,
 * whose cache rows 0..S0+T-1 are already written; token t attends to rows
 * 0..S0+t (causal). q_lat [T, H, R], q_pe [T, H, P], ctx [T, H, R]. Every
 * token's ctx is bit-identical to shoal_mla_attend for that token alone with
 * S = S0+t+1 (any T, ISA, thread count). Tokens go SHOAL_MLA_TBLOCK at a time;
 * the cache is read once per block of tokens and chunk of heads (kernels/README.md),
 * not once per token and thread. scratch: shoal_mla_prefill_scratch(S0, T, H) floats. */
#define SHOAL_MLA_TBLOCK 4
void shoal_mla_attend_prefill(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0, int T,
                              int H, int R, int P, float scale, float *scratch);
static inline size_t shoal_mla_prefill_scratch(int S0, int T, int H)
{
    return (size_t)(T < SHOAL_MLA_TBLOCK ? T : SHOAL_MLA_TBLOCK) * (size_t)H * (size_t)(S0 + T);
}

/* ---- router ------------------------------------------------------------ */

/* idx[k] = indices of the k largest score[n], ties broken by the lower index;
 * returned in ascending index order (the canonical expert order). */
void shoal_topk(int32_t *idx, const float *score, int n, int k);

/* ---- one routed expert (shared by the in-process engine and the worker) -- */

typedef enum { SHOAL_EXPERT_MXFP4 = 0, SHOAL_EXPERT_BF16 = 1, SHOAL_EXPERT_F32 = 2 } shoal_expert_kind;

typedef struct {
    shoal_expert_kind kind;
    int d; /* latent width (in of w1/w3, out of w2) */
    int f; /* expert intermediate width */
    /* MXFP4: w?_packed + w?_scale; BF16/F32: w? (scale NULL). Borrowed views. */
    const void *w1, *w3, *w2;
    const uint8_t *w1_scale, *w3_scale, *w2_scale;
} shoal_expert_w;

/* y[T, d] = bf16( W2 · SiTU(W1 x, W3 x) ) for T tokens x[T, d]; each output
 * rounded to bf16 (SPEC §3.6 step 4) and stored as bf16 bits.
 * scratch: 2*T*f floats. */
void shoal_expert_ffn(uint16_t *y, const shoal_expert_w *e, const float *x, int T, float b1, float b2,
                      float *scratch);
/* n experts in one call (a MoE layer in decode): expert i over T[i] tokens
 * x[i][T[i], d] -> y[i][T[i], d], each output exactly shoal_expert_ffn's.
 * With at least 4 experts per thread the threads take whole experts (one
 * parallel region for the lot, no barrier between experts: at T = 1 a
 * region per expert costs wake-ups comparable to the expert's own time on
 * a shared machine); otherwise it calls shoal_expert_ffn expert by expert.
 * scratch: scratch_threads * 2 * maxT * f floats, maxT = the largest T[i];
 * at most scratch_threads threads run (>= 1). */
void shoal_expert_ffn_many(uint16_t *const *y, const shoal_expert_w *const *e, const float *const *x, const int *T,
                           int n, float b1, float b2, float *scratch, int scratch_threads);


/* ---- memory read pass -------------------------------------------------- */

/* The STREAM-like read pass of `shoal bench` and of the worker's host facts
 * (PROBE, PROTOCOL.md §3.8): each thread sums its contiguous share of
 * buf[nwords] as 64-bit words, read as four concurrent sequential streams with
 * software prefetch -- the access pattern of the GEMV kernels (four weight
 * rows in flight), so kernel / read ratios compare like with like. One pass
 * with `threads` OpenMP threads (0: the current default); GB/s (1e9 bytes/s)
 * of the words read. *sink absorbs the sum (pass a global, so the loads
 * cannot be elided). No allocation; any thread (kernels/readbw.c). */
double shoal_read_bw_pass(const uint64_t *buf, size_t nwords, int threads, uint64_t *sink);

#endif
