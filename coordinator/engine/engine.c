/* Sequences and the forward entry points (engine.h). The model itself is
 * opened in model.c, the math is in forward.c, the allocation guard that
 * proves the forward never allocates is allocguard.c. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "coordinator/engine/engine_int.h"

/* ---- sequences ------------------------------------------------------------ */

static size_t kda_state_floats(const shoal_k3cfg *c)
{
    return (size_t)c->num_kda * c->kda_heads * (size_t)c->kda_head_dim * c->kda_head_dim;
}

static size_t kda_conv_floats(const shoal_k3cfg *c)
{
    return (size_t)c->num_kda * 3 * (size_t)(c->conv_kernel - 1) * c->kda_heads * c->kda_head_dim;
}

static size_t mla_row(const shoal_k3cfg *c)
{
    return (size_t)c->kv_lora_rank + c->qk_rope_dim;
}

int shoal_seq_create(shoal_seq **out, shoal_model *m, int capacity, char *err, size_t errlen)
{
    *out = NULL;
    if (capacity == 0)
        capacity = m->info.max_context;
    if (capacity < 1 || capacity > m->info.max_context)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "sequence capacity %d outside [1, max_context %d]", capacity,
                             m->info.max_context);
    const shoal_k3cfg *c = &m->cfg;
    shoal_seq *s = shoal_xcalloc(1, sizeof *s);
    s->m = m;
    s->capacity = capacity;
    /* calloc: the zero state is the initial KDA state and conv window, and a
     * large cache costs nothing until it is written */
    s->kda_S = shoal_xcalloc(kda_state_floats(c) + 1, sizeof(float));
    s->kda_conv = shoal_xcalloc(kda_conv_floats(c) + 1, sizeof(float));
    /* the MLA cache is never read before it is written; 64-byte aligned so the
     * attention kernel's 32-byte row loads never straddle cache lines;
     * untouched pages stay unallocated, as with calloc */
    if (posix_memalign((void **)&s->mla, 64, sizeof(float) * ((size_t)c->num_mla * (size_t)capacity * mla_row(c) + 1)))
        SHOAL_PANIC("out of memory: MLA cache of %d tokens", capacity);
    s->bytes = sizeof(float) * (kda_state_floats(c) + kda_conv_floats(c) +
                                (size_t)c->num_mla * (size_t)capacity * mla_row(c));
    m->seqs_alive++;
    *out = s;
    return 0;
}

void shoal_seq_free(shoal_seq *s)
{
    if (!s)
        return;
    s->m->seqs_alive--;
    free(s->ck_S0);
    free(s->ck_conv0);
    free(s->ck_tok);
    free(s->ck_o);
    free(s->kda_S);
    free(s->kda_conv);
    free(s->mla);
    free(s);
}

void shoal_seq_reset(shoal_seq *s)
{
    const shoal_k3cfg *c = &s->m->cfg;
    memset(s->kda_S, 0, sizeof(float) * kda_state_floats(c));
    memset(s->kda_conv, 0, sizeof(float) * kda_conv_floats(c));
    s->pos = 0;
    s->broken = 0;
    s->ck_n = 0;
}

int shoal_seq_pos(const shoal_seq *s)
{
    return s->pos;
}

int shoal_seq_capacity(const shoal_seq *s)
{
    return s->capacity;
}

size_t shoal_seq_bytes(const shoal_seq *s)
{
    return s->bytes;
}

int shoal_seq_copy(shoal_seq *dst, const shoal_seq *src, char *err, size_t errlen)
{
    if (dst == src)
        return 0;
    if (dst->m != src->m)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "seq copy: sequences of different models");
    if (dst->capacity < src->pos)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "seq copy: destination holds %d tokens, source is at %d",
                             dst->capacity, src->pos);
    const shoal_k3cfg *c = &src->m->cfg;
    memcpy(dst->kda_S, src->kda_S, sizeof(float) * kda_state_floats(c));
    memcpy(dst->kda_conv, src->kda_conv, sizeof(float) * kda_conv_floats(c));
    size_t row = mla_row(c);
    for (int l = 0; l < c->num_mla; l++)
        memcpy(dst->mla + (size_t)l * dst->capacity * row, src->mla + (size_t)l * src->capacity * row,
               sizeof(float) * row * (size_t)src->pos);
    dst->pos = src->pos;
    dst->broken = src->broken;
    dst->ck_n = 0;
    return 0;
}

int shoal_seq_fork(shoal_seq **out, const shoal_seq *src, int capacity, char *err, size_t errlen)
{
    *out = NULL;
    if (capacity != 0 && capacity < src->pos)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "seq fork: capacity %d below the source position %d",
                             capacity, src->pos);
    shoal_seq *s;
    int rc = shoal_seq_create(&s, src->m, capacity, err, errlen);
    if (rc)
        return rc;
    rc = shoal_seq_copy(s, src, err, errlen);
    if (rc) {
        shoal_seq_free(s);
        return rc;
    }
    *out = s;
    return 0;
}

size_t shoal_seq_state_size(const shoal_model *m, int pos)
{
    const shoal_k3cfg *c = &m->cfg;
    return sizeof(float) * (kda_state_floats(c) + kda_conv_floats(c) + (size_t)c->num_mla * (size_t)pos * mla_row(c));
}

int shoal_seq_export(const shoal_seq *s, void *buf, size_t n, char *err, size_t errlen)
{
    if (s->broken)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "seq export: the sequence is broken (a forward failed)");
    size_t need = shoal_seq_state_size(s->m, s->pos);
    if (n != need)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "seq export: %zu bytes given, the state at %d is %zu", n,
                             s->pos, need);
    const shoal_k3cfg *c = &s->m->cfg;
    char *o = buf;
    size_t a = sizeof(float) * kda_state_floats(c), b = sizeof(float) * kda_conv_floats(c);
    size_t rows = sizeof(float) * mla_row(c) * (size_t)s->pos;
    memcpy(o, s->kda_S, a);
    memcpy(o + a, s->kda_conv, b);
    o += a + b;
    for (int l = 0; l < c->num_mla; l++, o += rows)
        memcpy(o, s->mla + (size_t)l * s->capacity * mla_row(c), rows);
    return 0;
}

int shoal_seq_import(shoal_seq *s, int pos, const void *buf, size_t n, char *err, size_t errlen)
{
    if (pos < 0 || pos > s->capacity)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "seq import: position %d outside [0, capacity %d]", pos,
                             s->capacity);
    size_t need = shoal_seq_state_size(s->m, pos);
    if (n != need)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "seq import: %zu bytes given, the state at %d is %zu", n, pos,
                             need);
    const shoal_k3cfg *c = &s->m->cfg;
    const char *o = buf;
    size_t a = sizeof(float) * kda_state_floats(c), b = sizeof(float) * kda_conv_floats(c);
    size_t rows = sizeof(float) * mla_row(c) * (size_t)pos;
    memcpy(s->kda_S, o, a);
    memcpy(s->kda_conv, o + a, b);
    o += a + b;
    for (int l = 0; l < c->num_mla; l++, o += rows)
        memcpy(s->mla + (size_t)l * s->capacity * mla_row(c), o, rows);
    s->pos = pos;
    s->broken = 0;
    s->ck_n = 0;
    return 0;
}

size_t shoal_model_rewind_bytes(const shoal_model *m, int n)
{
    const shoal_k3cfg *c = &m->cfg;
    size_t C = (size_t)c->kda_heads * c->kda_head_dim;
    size_t w = 7 * C + (size_t)c->kda_heads;
    return sizeof(float) * (kda_state_floats(c) + kda_conv_floats(c) + C + (size_t)n * (size_t)c->num_kda * w);
}

int shoal_seq_reserve_rewind(shoal_seq *s, int n, char *err, size_t errlen)
{
    if (n < 0 || n >= s->m->info.max_batch)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "rewind room for %d positions outside [0, max_batch %d)", n,
                             s->m->info.max_batch);
    if (n <= s->ck_cap)
        return 0;
    const shoal_k3cfg *c = &s->m->cfg;
    size_t C = (size_t)c->kda_heads * c->kda_head_dim;
    size_t w = 7 * C + (size_t)c->kda_heads;
    if (!s->ck_S0) {
        s->ck_S0 = shoal_xmalloc(sizeof(float) * (kda_state_floats(c) + 1));
        s->ck_conv0 = shoal_xmalloc(sizeof(float) * (kda_conv_floats(c) + 1));
        s->ck_o = shoal_xmalloc(sizeof(float) * (C + 1));
        s->bytes += sizeof(float) * (kda_state_floats(c) + kda_conv_floats(c) + C);
    }
    free(s->ck_tok);
    s->ck_tok = shoal_xmalloc(sizeof(float) * ((size_t)n * (size_t)c->num_kda * w + 1));
    s->ck_tok_w = w;
    s->bytes += sizeof(float) * (size_t)c->num_kda * w * (size_t)(n - s->ck_cap);
    s->ck_cap = n;
    s->ck_n = 0;
    return 0;
}

int shoal_seq_rewind(shoal_seq *s, int pos, char *err, size_t errlen)
{
    if (pos == s->pos)
        return 0;
    if (s->broken)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "rewind: sequence broken by an earlier failure");
    if (pos <= s->ck_base || pos > s->ck_base + s->ck_n)
        return shoal_err_set(err, errlen, SHOAL_ERANGE,
                             "rewind to position %d: the last verify (at %d, %d states kept) cannot reach it", pos,
                             s->ck_base, s->ck_n);
    const shoal_k3cfg *c = &s->m->cfg;
    int j = pos - s->ck_base - 1, H = c->kda_heads, D = c->kda_head_dim, K = c->conv_kernel;
    size_t C = (size_t)H * D, sn = (size_t)H * D * D, win = (size_t)(K - 1) * C;
    for (int l = 0; l < c->num_kda; l++) {
        /* the state before the chunk, then the kept steps again */
        float *S = s->kda_S + (size_t)l * sn;
        memcpy(S, s->ck_S0 + (size_t)l * sn, sizeof(float) * sn);
        for (int t = 0; t <= j; t++) {
            const float *r = s->ck_tok + ((size_t)t * c->num_kda + (size_t)l) * s->ck_tok_w;
            shoal_kda_step(s->ck_o, S, r, r + C, r + 2 * C, r + 3 * C, r + 4 * C, H, D);
        }
        /* each window: the last K-1 pre-conv rows of (window before the chunk, rows 0..j) */
        for (int q = 0; q < 3; q++) {
            float *w = s->kda_conv + ((size_t)l * 3 + (size_t)q) * win;
            const float *w0 = s->ck_conv0 + ((size_t)l * 3 + (size_t)q) * win;
            for (int i = 0; i < K - 1; i++) {
                int x = j + 1 + i; /* index into w0 ++ rows */
                const float *src = x < K - 1 ? w0 + (size_t)x * C
                                             : s->ck_tok + ((size_t)(x - (K - 1)) * c->num_kda + (size_t)l) *
                                                               s->ck_tok_w + 4 * C + (size_t)H + (size_t)q * C;
                memcpy(w + (size_t)i * C, src, sizeof(float) * C);
            }
        }
    }
    /* the MLA rows past pos are never read before they are written again */
    s->pos = pos;
    s->ck_n = (int)j; /* positions before the new end can still be reached */
    return 0;
}

/* ---- forward entry points ------------------------------------------------- */

static int check_ids(const shoal_model *m, const int32_t *ids, int n, char *err, size_t errlen)
{
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->info.vocab)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "token id %d at index %d outside [0, %d)", (int)ids[i], i,
                                 m->info.vocab);
    return 0;
}

static int canceled(const shoal_model *m)
{
    return m->cancel && atomic_load(m->cancel) != 0;
}

int shoal_seq_prefill(shoal_seq *s, const int32_t *ids, int n, shoal_logits_mode mode, float *logits, char *err,
                      size_t errlen)
{
    shoal_model *m = s->m;
    if (n < 1)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "prefill: %d tokens", n);
    if (mode != SHOAL_LOGITS_NONE && !logits)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "prefill: logits requested into NULL");
    if (s->broken)
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "prefill: sequence broken by an earlier failure (reset or copy into it first)");
    if (n > s->capacity - s->pos)
        return shoal_err_set(err, errlen, SHOAL_ERANGE, "prefill: %d tokens at position %d exceed capacity %d", n,
                             s->pos, s->capacity);
    int rc = check_ids(m, ids, n, err, errlen);
    if (rc)
        return rc;
    int B = m->info.max_batch;
    for (int i = 0; i < B; i++)
        m->seqv[i] = s;
    for (int done = 0; done < n;) {
        if (canceled(m))
            return shoal_err_set(err, errlen, SHOAL_ECANCELED, "prefill canceled after %d of %d tokens", done, n);
        int T = n - done < B ? n - done : B;
        float *lg = NULL;
        int all = 0;
        if (mode == SHOAL_LOGITS_ALL) {
            lg = logits + (size_t)done * (size_t)m->info.vocab;
            all = 1;
        } else if (mode == SHOAL_LOGITS_LAST && done + T == n) {
            lg = logits;
        }
        rc = shoal__engine_forward(m, m->seqv, ids + done, T, lg, NULL, all ? T : 1, err, errlen);
        if (rc)
            return rc;
        done += T;
    }
    return 0;
}

int shoal_seq_verify(shoal_seq *s, const int32_t *ids, int n, float *logits, char *err, size_t errlen)
{
    if (n < 1 || n > s->m->info.max_batch || n - 1 > s->ck_cap)
        return shoal_err_set(err, errlen, SHOAL_EINVAL,
                             "verify: %d tokens (one chunk of at most max_batch %d, rewind room %d + 1)", n,
                             s->m->info.max_batch, s->ck_cap);
    int base = s->pos;
    s->ck_arm = 1;
    s->ck_base = base;
    s->ck_n = 0;
    int rc = shoal_seq_prefill(s, ids, n, SHOAL_LOGITS_ALL, logits, err, errlen);
    s->ck_arm = 0;
    s->ck_n = rc ? 0 : n - 1;
    return rc;
}

int shoal_seq_decode(shoal_seq *s, int32_t id, float *logits, char *err, size_t errlen)
{
    return shoal_seq_prefill(s, &id, 1, logits ? SHOAL_LOGITS_LAST : SHOAL_LOGITS_NONE, logits, err, errlen);
}

/* What decode_batch and step check before anything runs: the count, the
 * ids, each sequence's model, health and room (its k-th token in the chunk
 * needs pos + k < capacity); with consecutive set, a sequence's tokens must
 * be adjacent in the chunk. */
static int check_chunk(shoal_model *m, const char *what, shoal_seq *const *seqs, const int32_t *ids, int n,
                       int consecutive, char *err, size_t errlen)
{
    if (n < 1 || n > m->info.max_batch)
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s: %d tokens (max_batch %d)", what, n, m->info.max_batch);
    int rc = check_ids(m, ids, n, err, errlen);
    if (rc)
        return rc;
    for (int i = 0; i < n; i++) {
        const shoal_seq *s = seqs[i];
        if (!s || s->m != m)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s: sequence %d belongs to another model", what, i);
        if (s->broken)
            return shoal_err_set(err, errlen, SHOAL_EINVAL, "%s: sequence %d is broken (reset it)", what, i);
        int need = 0;
        for (int j = 0; j <= i; j++)
            need += seqs[j] == s;
        if (consecutive && need > 1 && seqs[i - 1] != s)
            return shoal_err_set(err, errlen, SHOAL_EINVAL,
                                 "%s: token %d's sequence appears earlier in the chunk, not just before it", what, i);
        if (s->pos + need > s->capacity)
            return shoal_err_set(err, errlen, SHOAL_ERANGE, "%s: sequence %d is full (capacity %d)", what, i,
                                 s->capacity);
    }
    if (canceled(m))
        return shoal_err_set(err, errlen, SHOAL_ECANCELED, "%s canceled", what);
    return 0;
}

int shoal_model_decode_batch(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int n, float *logits,
                             char *err, size_t errlen)
{
    int rc = check_chunk(m, "decode_batch", seqs, ids, n, 0, err, errlen);
    return rc ? rc : shoal__engine_forward(m, seqs, ids, n, logits, NULL, n, err, errlen);
}

int shoal_model_step(shoal_model *m, shoal_seq *const *seqs, const int32_t *ids, int n, const int *rows, int nrows,
                     float *logits, char *err, size_t errlen)
{
    int rc = check_chunk(m, "step", seqs, ids, n, 1, err, errlen);
    if (rc)
        return rc;
    if (nrows && !rows) /* the rows' range and order: the forward checks them */
        return shoal_err_set(err, errlen, SHOAL_EINVAL, "step: %d logits rows but no row list", nrows);
    return shoal__engine_forward(m, seqs, ids, n, nrows ? logits : NULL, rows, nrows, err, errlen);
}
