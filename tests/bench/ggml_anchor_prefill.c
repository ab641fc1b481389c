/* ggml_anchor_prefill: a llama-architecture prefill on ggml's CPU backend
 * (llama.cpp's compute library), for the issue-33 end-to-end anchor in
 * docs/PERFORMANCE.md when llama-bench itself is not available. It reads a
 * llama GGUF (tests/bench/make_anchor_gguf.py), and for a P-token prompt builds
 * what llama.cpp's llama graph computes, in ubatches of U tokens (llama-bench's
 * default 512) with an f16 KV cache: token embedding rows; per layer RMSNorm,
 * Q/K/V matmuls, RoPE (normal mode), K and V appended to the cache, causal
 * softmax attention over the cache (the non-flash path: KQ, soft_max_ext with a
 * mask, KQV), output matmul, residual, RMSNorm, SwiGLU FFN, residual; then the
 * final norm and the output head for the last token only. Weights stay in
 * their GGUF type (bf16 here); ggml converts activations for its vec_dot as
 * llama.cpp does. Not built by the project (it needs a ggml build); build it
 * by hand against ggml's static libraries (GGML_NATIVE=ON), e.g.
 *   cc -O2 -fopenmp -I$G/ggml/include tests/bench/ggml_anchor_prefill.c \
 *      $B/libggml.a $B/libggml-cpu.a $B/libggml-base.a -lstdc++ -lm -o ggml_anchor_prefill
 * usage: ggml_anchor_prefill MODEL.gguf P[,P...] THREADS [REPS] [UBATCH]
 * One JSON line per (P, rep): wall seconds and the process CPU seconds of the
 * prompt (graph build, allocation and compute of every ubatch), tokens/s.
 * A 16-token prompt runs first to warm the weights and allocator. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"
#include "gguf.h"

static double now(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    struct ggml_tensor *an, *wq, *wk, *wv, *wo, *fn, *wg, *wu, *wd, *kc, *vc;
} layer;

static struct ggml_context *wctx;
static int n_embd, n_layer, n_ff, n_head, hd, n_ctx;
static float eps, rope_base;
static struct ggml_tensor *tok_embd, *out_norm, *output;
static layer *L;

static struct ggml_tensor *need(const char *name)
{
    struct ggml_tensor *t = ggml_get_tensor(wctx, name);
    if (!t) {
        fprintf(stderr, "ggml_anchor_prefill: tensor %s missing\n", name);
        exit(3);
    }
    return t;
}

static uint32_t u32(struct gguf_context *g, const char *k)
{
    int64_t i = gguf_find_key(g, k);
    if (i < 0) {
        fprintf(stderr, "ggml_anchor_prefill: key %s missing\n", k);
        exit(3);
    }
    return gguf_get_val_u32(g, i);
}

/* one ubatch of U tokens at positions past..past+U-1; logits of the last
 * token when last != 0 */
static void ubatch(ggml_backend_t be, ggml_gallocr_t ga, const int32_t *ids, int U, int past, int last)
{
    size_t meta = ggml_tensor_overhead() * 4096 + ggml_graph_overhead_custom(8192, false);
    struct ggml_init_params ip = {.mem_size = meta, .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context *c = ggml_init(ip);
    struct ggml_cgraph *gf = ggml_new_graph_custom(c, 8192, false);
    int nkv = past + U;
    struct ggml_tensor *tok = ggml_new_tensor_1d(c, GGML_TYPE_I32, U);
    struct ggml_tensor *pos = ggml_new_tensor_1d(c, GGML_TYPE_I32, U);
    struct ggml_tensor *mask = ggml_new_tensor_2d(c, GGML_TYPE_F32, nkv, U);
    ggml_set_input(tok);
    ggml_set_input(pos);
    ggml_set_input(mask);
    struct ggml_tensor *x = ggml_get_rows(c, tok_embd, tok);
    for (int l = 0; l < n_layer; l++) {
        struct ggml_tensor *h = ggml_mul(c, ggml_rms_norm(c, x, eps), L[l].an);
        struct ggml_tensor *q = ggml_reshape_3d(c, ggml_mul_mat(c, L[l].wq, h), hd, n_head, U);
        struct ggml_tensor *k = ggml_reshape_3d(c, ggml_mul_mat(c, L[l].wk, h), hd, n_head, U);
        struct ggml_tensor *v = ggml_mul_mat(c, L[l].wv, h); /* [n_embd, U] */
        q = ggml_rope_ext(c, q, pos, NULL, hd, 0, n_ctx, rope_base, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        k = ggml_rope_ext(c, k, pos, NULL, hd, 0, n_ctx, rope_base, 1.0f, 0.0f, 1.0f, 0.0f, 0.0f);
        /* K cache [n_embd, n_ctx] rows by position; V cache transposed [n_ctx, n_embd] */
        struct ggml_tensor *kdst = ggml_view_1d(c, L[l].kc, (int64_t)U * n_embd,
                                                ggml_row_size(L[l].kc->type, n_embd) * past);
        ggml_build_forward_expand(gf, ggml_cpy(c, k, kdst));
        struct ggml_tensor *vdst = ggml_view_2d(c, L[l].vc, U, n_embd, ggml_row_size(L[l].vc->type, n_ctx),
                                                ggml_row_size(L[l].vc->type, past));
        ggml_build_forward_expand(gf, ggml_cpy(c, ggml_transpose(c, v), vdst));
        struct ggml_tensor *K = ggml_view_3d(c, L[l].kc, hd, nkv, n_head, ggml_row_size(L[l].kc->type, n_embd),
                                             ggml_row_size(L[l].kc->type, hd), 0);
        struct ggml_tensor *V = ggml_view_3d(c, L[l].vc, nkv, hd, n_head, ggml_row_size(L[l].vc->type, n_ctx),
                                             ggml_row_size(L[l].vc->type, n_ctx) * hd, 0);
        struct ggml_tensor *Q = ggml_permute(c, q, 0, 2, 1, 3);                   /* [hd, U, heads] */
        struct ggml_tensor *kq = ggml_mul_mat(c, K, Q);                           /* [nkv, U, heads] */
        kq = ggml_soft_max_ext(c, kq, mask, 1.0f / sqrtf((float)hd), 0.0f);
        struct ggml_tensor *kqv = ggml_mul_mat(c, V, kq);                         /* [hd, U, heads] */
        struct ggml_tensor *att = ggml_cont_2d(c, ggml_permute(c, kqv, 0, 2, 1, 3), n_embd, U);
        x = ggml_add(c, ggml_mul_mat(c, L[l].wo, att), x);
        h = ggml_mul(c, ggml_rms_norm(c, x, eps), L[l].fn);
        struct ggml_tensor *f = ggml_swiglu_split(c, ggml_mul_mat(c, L[l].wg, h), ggml_mul_mat(c, L[l].wu, h));
        x = ggml_add(c, ggml_mul_mat(c, L[l].wd, f), x);
    }
    struct ggml_tensor *y = x;
    if (last) {
        y = ggml_view_2d(c, x, n_embd, 1, x->nb[1], x->nb[1] * (U - 1));
        y = ggml_mul_mat(c, output, ggml_mul(c, ggml_rms_norm(c, y, eps), out_norm));
    }
    ggml_set_output(y);
    ggml_build_forward_expand(gf, y);
    if (!ggml_gallocr_alloc_graph(ga, gf)) {
        fprintf(stderr, "ggml_anchor_prefill: graph allocation failed\n");
        exit(4);
    }
    memcpy(tok->data, ids, sizeof(int32_t) * U);
    int32_t *pp = pos->data;
    for (int i = 0; i < U; i++)
        pp[i] = past + i;
    float *m = mask->data;
    for (int i = 0; i < U; i++)
        for (int j = 0; j < nkv; j++)
            m[(size_t)i * nkv + j] = j <= past + i ? 0.0f : -INFINITY;
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "ggml_anchor_prefill: compute failed\n");
        exit(4);
    }
    if (last) { /* keep the result live: a NaN check on the logits */
        const float *lg = y->data;
        for (int i = 0; i < (int)y->ne[0]; i++)
            if (lg[i] != lg[i]) {
                fprintf(stderr, "ggml_anchor_prefill: NaN logit\n");
                exit(5);
            }
    }
    ggml_free(c);
}

static void prompt(ggml_backend_t be, ggml_gallocr_t ga, const int32_t *ids, int P, int U)
{
    for (int done = 0; done < P;) {
        int n = P - done < U ? P - done : U;
        ubatch(be, ga, ids + done, n, done, done + n == P);
        done += n;
    }
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: ggml_anchor_prefill MODEL.gguf P[,P...] THREADS [REPS] [UBATCH]\n");
        return 2;
    }
    int Ps[16], nP = 0, Pmax = 16;
    for (char *p = argv[2]; *p && nP < 16;) {
        Ps[nP] = (int)strtol(p, &p, 10);
        Pmax = Ps[nP] > Pmax ? Ps[nP] : Pmax;
        nP++;
        if (*p == ',')
            p++;
    }
    int threads = atoi(argv[3]), reps = argc > 4 ? atoi(argv[4]) : 1, U = argc > 5 ? atoi(argv[5]) : 512;
    double l0 = now(CLOCK_MONOTONIC);
    struct gguf_init_params gp = {.no_alloc = false, .ctx = &wctx};
    struct gguf_context *g = gguf_init_from_file(argv[1], gp);
    if (!g) {
        fprintf(stderr, "ggml_anchor_prefill: cannot read %s\n", argv[1]);
        return 3;
    }
    n_embd = (int)u32(g, "llama.embedding_length");
    n_layer = (int)u32(g, "llama.block_count");
    n_ff = (int)u32(g, "llama.feed_forward_length");
    n_head = (int)u32(g, "llama.attention.head_count");
    hd = n_embd / n_head;
    int64_t ke = gguf_find_key(g, "llama.attention.layer_norm_rms_epsilon");
    eps = ke >= 0 ? gguf_get_val_f32(g, ke) : 1e-5f;
    int64_t kr = gguf_find_key(g, "llama.rope.freq_base");
    rope_base = kr >= 0 ? gguf_get_val_f32(g, kr) : 10000.0f;
    n_ctx = Pmax;
    tok_embd = need("token_embd.weight");
    out_norm = need("output_norm.weight");
    output = need("output.weight");
    L = calloc((size_t)n_layer, sizeof *L);
    struct ggml_init_params kp = {.mem_size = (size_t)n_layer * (2 * ggml_tensor_overhead() +
                                                                 2 * (size_t)n_embd * n_ctx * 2 + 256),
                                  .mem_buffer = NULL, .no_alloc = false};
    struct ggml_context *kctx = ggml_init(kp);
    char nm[128];
    for (int l = 0; l < n_layer; l++) {
#define W(f, s)                                              \
    snprintf(nm, sizeof nm, "blk.%d.%s.weight", l, s);        \
    L[l].f = need(nm)
        W(an, "attn_norm");
        W(wq, "attn_q");
        W(wk, "attn_k");
        W(wv, "attn_v");
        W(wo, "attn_output");
        W(fn, "ffn_norm");
        W(wg, "ffn_gate");
        W(wu, "ffn_up");
        W(wd, "ffn_down");
#undef W
        L[l].kc = ggml_new_tensor_2d(kctx, GGML_TYPE_F16, n_embd, n_ctx);
        L[l].vc = ggml_new_tensor_2d(kctx, GGML_TYPE_F16, n_ctx, n_embd);
    }
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, threads);
    ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)Pmax);
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < Pmax; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        ids[i] = i == 0 ? 1 : (int32_t)(r % (uint64_t)tok_embd->ne[1]);
    }
    printf("{\"meta\":\"model\",\"value\":\"%s: llama, %d layers, embd %d, ff %d, heads %d, weights %s; load %.1f s\"}\n",
           argv[1], n_layer, n_embd, n_ff, n_head, ggml_type_name(L[0].wq->type), now(CLOCK_MONOTONIC) - l0);
    prompt(be, ga, ids, 16, U); /* warm */
    for (int pi = 0; pi < nP; pi++)
        for (int rep = 0; rep < reps; rep++) {
            double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_PROCESS_CPUTIME_ID);
            prompt(be, ga, ids, Ps[pi], U);
            double wt = now(CLOCK_MONOTONIC) - t0, ct = now(CLOCK_PROCESS_CPUTIME_ID) - c0;
            printf("{\"tokens\":%d,\"rep\":%d,\"threads\":%d,\"ubatch\":%d,\"seconds\":%.4f,\"cpu_seconds\":%.4f,"
                   "\"tokens_per_s\":%.3f}\n",
                   Ps[pi], rep, threads, U, wt, ct, Ps[pi] / wt);
            fflush(stdout);
        }
    ggml_gallocr_free(ga);
    ggml_backend_free(be);
    ggml_free(kctx);
    ggml_free(wctx);
    gguf_free(g);
    free(ids);
    free(L);
    return 0;
}
