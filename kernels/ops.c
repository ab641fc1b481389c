/* kernels: the small fp32 operations (norms, activations, KDA, MLA, top-k)
 * and the routed-expert FFN. These are scalar only (no SIMD variant), so they
 * are trivially identical on every ISA; the KDA recurrence has a per-ISA head
 * worker that follows the same per-element order (kernels/README.md).
 * Reductions over a vector (sums of squares, softmax denominators) run in
 * double in increasing index order: cheap at these widths, deterministic,
 * and more accurate than fp32. */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "common/st.h"
#include "kernels/kernels_int.h"

#define KDA_MAX_D 256 /* kernels.h: D <= 256 */

float shoal_sigmoid(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

static float sumsq_mean_inv(const float *x, int n, float eps, int mean)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * (double)x[i];
    float m = mean ? (float)(ss / n) : (float)ss;
    return 1.0f / sqrtf(m + eps);
}

void shoal_rmsnorm(float *y, const float *x, const float *w, int n, float eps)
{
    float r = sumsq_mean_inv(x, n, eps, 1);
    for (int i = 0; i < n; i++) {
        float v = x[i] * r;
        y[i] = w ? v * w[i] : v;
    }
}

void shoal_l2norm(float *x, int n, float eps)
{
    float r = sumsq_mean_inv(x, n, eps, 0);
    for (int i = 0; i < n; i++)
        x[i] *= r;
}

void shoal_softmax(float *x, int n)
{
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    double s = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    float inv = (float)(1.0 / s);
    for (int i = 0; i < n; i++)
        x[i] *= inv;
}

void shoal_situ_glu(float *y, const float *g, const float *u, int n, float b1, float b2)
{
    for (int i = 0; i < n; i++) {
        float a = b1 * tanhf(g[i] / b1) * shoal_sigmoid(g[i]);
        float b = b2 * tanhf(u[i] / b2);
        y[i] = a * b;
    }
}

/* ---- KDA ---------------------------------------------------------------- */

void shoal_kda_conv_step(float *out, float *window, const float *x, const float *taps, int C, int K)
{
    for (int c = 0; c < C; c++) {
        const float *tc = taps + (size_t)c * K;
        float acc = 0.0f;
        for (int j = 0; j < K - 1; j++)
            acc = fmaf(tc[j], window[(size_t)j * C + c], acc);
        float xc = x[c];
        acc = fmaf(tc[K - 1], xc, acc);
        for (int j = 0; j + 1 < K - 1; j++)
            window[(size_t)j * C + c] = window[(size_t)(j + 1) * C + c];
        if (K > 1)
            window[(size_t)(K - 2) * C + c] = xc;
        out[c] = acc * shoal_sigmoid(acc);
    }
}

static float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x)); /* torch's threshold 20 */
}

void shoal_kda_gate(float *g, const float *z, const float *A_log, const float *dt_bias, int H, int D,
                    int lower_bound_form, float lb)
{
    for (int h = 0; h < H; h++) {
        float a = expf(A_log[h]);
        for (int i = 0; i < D; i++) {
            size_t j = (size_t)h * D + i;
            float zz = z[j] + dt_bias[j];
            g[j] = lower_bound_form ? lb * shoal_sigmoid(a * zz) : -a * softplus(zz);
        }
    }
}

/* One head, S[i][j] (i = key index, j = value index). Order per element:
 *   S[i][j] = S[i][j] * exp(g[i]);
 *   u[j] = v[j] - (fmaf chain over i = 0..D-1 of S[i][j] * k[i], from +0);
 *   S[i][j] = fmaf(k[i], beta * u[j], S[i][j]);
 *   o[j] = fmaf chain over i of S[i][j] * q[i], from +0.
 * Every j is independent, so a SIMD worker vectorises over j unchanged. */
void shoal__kernels_kda_head_scalar(float *o, float *S, const float *q, const float *k, const float *v,
                                    const float *g, float beta, int D)
{
    float acc[KDA_MAX_D];
    for (int j = 0; j < D; j++)
        acc[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        float e = expf(g[i]);
        float *Si = S + (size_t)i * D;
        for (int j = 0; j < D; j++) {
            Si[j] = Si[j] * e;
            acc[j] = fmaf(Si[j], k[i], acc[j]);
        }
    }
    for (int j = 0; j < D; j++) {
        acc[j] = beta * (v[j] - acc[j]);
        o[j] = 0.0f;
    }
    for (int i = 0; i < D; i++) {
        float *Si = S + (size_t)i * D;
        for (int j = 0; j < D; j++) {
            Si[j] = fmaf(k[i], acc[j], Si[j]);
            o[j] = fmaf(Si[j], q[i], o[j]);
        }
    }
}

void shoal_gated_rmsnorm(float *y, const float *o, const float *gate, const float *w, int H, int D, float eps)
{
    for (int h = 0; h < H; h++) {
        const float *oh = o + (size_t)h * D;
        float r = sumsq_mean_inv(oh, D, eps, 1);
        for (int i = 0; i < D; i++) {
            size_t j = (size_t)h * D + i;
            y[j] = oh[i] * r * w[i] * shoal_sigmoid(gate[j]);
        }
    }
}

/* ---- MLA ---------------------------------------------------------------- */

/* Canonical 16-lane dot over the concatenation (a1[0:n1] ‖ a2[0:n2]) · b[0:n1+n2]. */
static float dot_concat(const float *a1, int n1, const float *a2, int n2, const float *b)
{
    float acc[16] = {0};
    for (int i = 0; i < n1; i++)
        acc[i & 15] = fmaf(a1[i], b[i], acc[i & 15]);
    for (int i = 0; i < n2; i++)
        acc[(n1 + i) & 15] = fmaf(a2[i], b[n1 + i], acc[(n1 + i) & 15]);
    return shoal__kernels_reduce16(acc);
}

void shoal__kernels_mla_head(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S, int R,
                             int P, float scale, float *p)
{
    size_t W = (size_t)R + P;
    for (int s = 0; s < S; s++)
        p[s] = scale * dot_concat(q_lat, R, q_pe, P, cache + s * W);
    shoal_softmax(p, S);
    for (int i = 0; i < R; i++)
        ctx[i] = 0.0f;
    for (int s = 0; s < S; s++) {
        const float *c = cache + s * W;
        for (int i = 0; i < R; i++)
            ctx[i] = fmaf(p[s], c[i], ctx[i]);
    }
}

/* The batched form is, by definition, the decode form per token: token t of
 * the block is one query at position S0+t over rows 0..S0+t. */
void shoal__kernels_mla_heads_scalar(float *ctx, const float *q_lat, const float *q_pe, const float *cache, int S0,
                                     int T, int H, int R, int P, float scale, float *scratch, int h0, int h1)
{
    size_t Sm = (size_t)S0 + T;
    for (int t = 0; t < T; t++)
        for (int h = h0; h < h1; h++) {
            size_t q = (size_t)t * H + h;
            shoal__kernels_mla_head(ctx + q * R, q_lat + q * R, q_pe + q * P, cache, S0 + t + 1, R, P, scale,
                                    scratch + q * Sm);
        }
}

/* ---- router ------------------------------------------------------------- */

/* a ranks before b: larger score, then lower index; NaN ranks after every number. */
static int ranks_before(float sa, int ia, float sb, int ib)
{
    int na = sa != sa, nb = sb != sb;
    if (na != nb)
        return nb;
    if (!na && sa != sb)
        return sa > sb;
    return ia < ib;
}

void shoal_topk(int32_t *idx, const float *score, int n, int k)
{
    int have = 0;
    for (int i = 0; i < n; i++) {
        if (have == k && !ranks_before(score[i], i, score[idx[k - 1]], idx[k - 1]))
            continue;
        int pos = have < k ? have++ : k - 1;
        while (pos > 0 && ranks_before(score[i], i, score[idx[pos - 1]], idx[pos - 1])) {
            idx[pos] = idx[pos - 1];
            pos--;
        }
        idx[pos] = i;
    }
    for (int a = 1; a < have; a++) { /* ascending index order */
        int32_t v = idx[a];
        int b = a;
        while (b > 0 && idx[b - 1] > v) {
            idx[b] = idx[b - 1];
            b--;
        }
        idx[b] = v;
    }
}

/* The routed expert (shoal_expert_ffn) is in kernels.c, beside the other
 * threaded entry points: one parallel region for all of its matrices. */
