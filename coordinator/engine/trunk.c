/* Trunk budget (engine.h shoal_trunk_mode): the memory plan, the resident
 * load and the streaming set-up, for a model opened with a budget. The units
 * are each layer's attention matrices and its FFN's matrices (two per layer:
 * the forward finishes with one before it needs the other, so the streaming
 * buffers are sized by half a layer, not a whole one; the small vectors are
 * fp32 copies made at bind time and always resident), and lm_head cut into
 * equal row slices no larger than the largest layer part. Each MoE layer's
 * router is a unit of its own, pinned resident (small: experts x hidden), so
 * that the prefetch hint can apply the next layer's router a layer early. The embedding table
 * is never held: each token's row is read with pread by the forward. Which
 * units stay resident: first fit in forward order (layer 0's attention, its
 * FFN, layer 1's ..., then the lm_head slices), with the two buffers sized by
 * the largest unit left to stream; that order lets the reader fetch the first
 * streamed unit while the resident layers compute. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/err.h"
#include "common/log.h"
#include "common/memplan.h"
#include "coordinator/engine/engine_int.h"

/* a layer's two units: its attention matrices, then its FFN's (dense MLP, or
 * the MoE's router, latent projections and shared experts) */
static const size_t attn_fields[] = {
    offsetof(shoal__layer, g_proj), offsetof(shoal__layer, o_proj), offsetof(shoal__layer, q_proj),
    offsetof(shoal__layer, k_proj), offsetof(shoal__layer, v_proj), offsetof(shoal__layer, f_a),
    offsetof(shoal__layer, f_b),    offsetof(shoal__layer, b_proj), offsetof(shoal__layer, q_a),
    offsetof(shoal__layer, q_b),    offsetof(shoal__layer, kv_a),   offsetof(shoal__layer, kv_b),
};
static const size_t ffn_fields[] = {
    offsetof(shoal__layer, mlp_gate), offsetof(shoal__layer, mlp_up), offsetof(shoal__layer, mlp_down),
    offsetof(shoal__layer, rdown),    offsetof(shoal__layer, rup),
    offsetof(shoal__layer, sh_gate),  offsetof(shoal__layer, sh_up),  offsetof(shoal__layer, sh_down),
};
#define NATTN (sizeof attn_fields / sizeof attn_fields[0])
#define NFFN (sizeof ffn_fields / sizeof ffn_fields[0])

int shoal_model_parse_trunk(const char *s, shoal_trunk_mode *mode, uint64_t *bytes)
{
    *bytes = 0;
    if (!strcmp(s, "small"))
        *mode = SHOAL_TRUNK_SMALL;
    else if (!strcmp(s, "medium"))
        *mode = SHOAL_TRUNK_MEDIUM;
    else if (!strcmp(s, "large"))
        *mode = SHOAL_TRUNK_LARGE;
    else if (!strcmp(s, "auto"))
        *mode = SHOAL_TRUNK_AUTO;
    else {
        char *end;
        errno = 0;
        double g = strtod(s, &end);
        if (errno || end == s || *end || !(g > 0) || g > 1e9)
            return SHOAL_EINVAL;
        *mode = SHOAL_TRUNK_BYTES;
        *bytes = (uint64_t)(g * 1073741824.0);
        if (!*bytes)
            return SHOAL_EINVAL;
    }
    return 0;
}

static const char *mode_name(shoal_trunk_mode md)
{
    switch (md) {
    case SHOAL_TRUNK_SMALL: return "small";
    case SHOAL_TRUNK_MEDIUM: return "medium";
    case SHOAL_TRUNK_LARGE: return "large";
    case SHOAL_TRUNK_AUTO: return "auto";
    case SHOAL_TRUNK_BYTES: return "bytes";
    default: return "mapped";
    }
}

static void point(void *owner, const shoal__tunit *tu, const void *base)
{
    for (int i = 0; i < tu->u.n_ext; i++)
        ((shoal__wmat *)((char *)owner + tu->field[i]))->p = base ? (const char *)base + tu->ext[i].at : NULL;
}

void *shoal__engine_trunk_owner(shoal_model *m, const shoal__tunit *tu)
{
    return tu->layer >= 0 ? (void *)&m->layers[tu->layer] : (void *)&m->head[tu - m->tunits - 2 * m->cfg.num_layers];
}

void shoal__engine_trunk_point(void *owner, const shoal__tunit *tu, const void *buf)
{
    point(owner, tu, buf);
}

static void add_ext(shoal__tunit *tu, const shoal__wmat *w, size_t field)
{
    int i = tu->u.n_ext++;
    size_t esz = shoal_dtype_size(w->dt);
    tu->ext[i] = (shoal_tstream_ext){.name = w->t->name,
                                     .file = w->t->file,
                                     .off = w->t->file_offset + w->t_off,
                                     .len = (uint64_t)w->rows * (uint64_t)w->cols * esz};
    tu->field[i] = field;
}

int shoal__engine_trunk_open(shoal_model *m, size_t scratch_bytes, char *err, size_t errlen)
{
    const shoal_k3cfg *c = &m->cfg;
    const shoal_model_opts *o = &m->opts;
    int L = c->num_layers, d = c->hidden_size, V = c->vocab_size;
    char b1[32], b2[32], b3[32], b4[32], b5[32], b6[32], b7[32];

    /* units: two per layer (attention, FFN) */
    m->tunits = shoal_xcalloc((size_t)2 * L + 1, sizeof *m->tunits);
    size_t max_part = 0;
    for (int i = 0; i < 2 * L; i++) {
        shoal__tunit *tu = &m->tunits[i];
        int part = i & 1;
        const size_t *fields = part ? ffn_fields : attn_fields;
        size_t nf = part ? NFFN : NATTN;
        tu->layer = i / 2;
        tu->ext = shoal_xcalloc(nf, sizeof *tu->ext);
        tu->field = shoal_xcalloc(nf, sizeof *tu->field);
        tu->u.ext = tu->ext;
        for (size_t f = 0; f < nf; f++) {
            const shoal__wmat *w = (const shoal__wmat *)((const char *)&m->layers[tu->layer] + fields[f]);
            if (w->t)
                add_ext(tu, w, fields[f]);
        }
        if (shoal_tstream_layout(&tu->u) > max_part)
            max_part = tu->u.bytes;
    }
    /* lm_head in equal row slices, none larger than the largest layer part */
    size_t hesz = shoal_dtype_size(m->lm_head.dt), row_bytes = (size_t)d * hesz;
    int rows_cap = max_part > row_bytes ? (int)(max_part / row_bytes) : 1;
    if (rows_cap > V)
        rows_cap = V;
    m->n_head = (V + rows_cap - 1) / rows_cap;
    int rows_per = (V + m->n_head - 1) / m->n_head;
    m->head = shoal_xcalloc((size_t)m->n_head, sizeof *m->head);
    m->tunits = shoal_xrealloc(m->tunits, sizeof *m->tunits * (size_t)(2 * L + m->n_head));
    for (int i = 0; i < m->n_head; i++) {
        int r0 = i * rows_per, nr = V - r0 < rows_per ? V - r0 : rows_per;
        shoal__wmat *w = &m->head[i];
        *w = m->lm_head;
        w->p = NULL;
        w->rows = nr;
        w->t_off = (uint64_t)r0 * row_bytes;
        shoal__tunit *tu = &m->tunits[2 * L + i];
        memset(tu, 0, sizeof *tu);
        tu->layer = -1;
        tu->ext = shoal_xcalloc(1, sizeof *tu->ext);
        tu->field = shoal_xcalloc(1, sizeof *tu->field);
        tu->u.ext = tu->ext;
        tu->u.optional = 1; /* only forwards that want logits read lm_head */
        add_ext(tu, w, 0);
        shoal_tstream_layout(&tu->u);
    }
    m->n_tunits = 2 * L + m->n_head;
    /* every MoE layer's router, pinned: the forward's prefetch hint applies
     * the next MoE layer's router before that layer's FFN unit is read */
    m->tunits = shoal_xrealloc(m->tunits, sizeof *m->tunits * (size_t)(m->n_tunits + L));
    for (int l = 0; l < L; l++) {
        const shoal__wmat *w = &m->layers[l].router;
        if (!w->t)
            continue;
        shoal__tunit *tu = &m->tunits[m->n_tunits++];
        memset(tu, 0, sizeof *tu);
        tu->layer = l;
        tu->pinned = 1;
        tu->ext = shoal_xcalloc(1, sizeof *tu->ext);
        tu->field = shoal_xcalloc(1, sizeof *tu->field);
        tu->u.ext = tu->ext;
        add_ext(tu, w, offsetof(shoal__layer, router));
        shoal_tstream_layout(&tu->u);
    }

    /* the plan */
    size_t eesz = shoal_dtype_size(m->embed.dt);
    uint64_t emb_bytes = ((uint64_t)m->info.max_batch * (uint64_t)d * eesz + 4095) & ~4095ull;
    uint64_t pinned = 0;
    for (int i = 0; i < m->n_tunits; i++)
        if (m->tunits[i].pinned)
            pinned += m->tunits[i].u.bytes;
    uint64_t fixed = m->owned_bytes + emb_bytes + pinned, total = 0, max_all = 0;
    for (int i = 0; i < m->n_tunits; i++) {
        if (m->tunits[i].pinned)
            continue;
        total += m->tunits[i].u.bytes;
        if (m->tunits[i].u.bytes > max_all)
            max_all = m->tunits[i].u.bytes;
    }
    uint64_t min = fixed + 2 * max_all, full = fixed + total, B = 0;
    uint64_t seq_one = m->info.seq_fixed_bytes + (uint64_t)m->info.max_context * m->info.seq_bytes_per_token;
    switch (o->trunk_mode) {
    case SHOAL_TRUNK_BYTES: B = o->trunk_budget; break;
    case SHOAL_TRUNK_SMALL: B = min; break;
    case SHOAL_TRUNK_MEDIUM: B = min + (full - min) / 2; break;
    case SHOAL_TRUNK_LARGE: B = full; break;
    case SHOAL_TRUNK_AUTO: {
        shoal_memplan_probe p;
        shoal_memplan_read("", &p);
        uint64_t usable = shoal_memplan_usable(&p);
        /* a reserve for the scratch, one sequence at max_context, the process
         * and the kernel's page cache (10% + 64 MiB) */
        uint64_t reserve = scratch_bytes + seq_one + (64ull << 20) + (usable == UINT64_MAX ? 0 : usable / 10);
        B = usable == UINT64_MAX ? full : usable > reserve ? usable - reserve : 0;
        SHOAL_INFO("trunk plan: auto: usable %s (cgroup v%d limit %s%s%s, MemAvailable %s) less a %s reserve -> %s",
                   shoal_memplan_fmt(usable, b1, sizeof b1), p.cgroup_version,
                   shoal_memplan_fmt(p.cgroup_limit, b2, sizeof b2), p.cgroup_version ? " from " : "",
                   p.cgroup_version ? p.cgroup_file : "", shoal_memplan_fmt(p.mem_available, b3, sizeof b3),
                   shoal_memplan_fmt(reserve, b4, sizeof b4), shoal_memplan_fmt(B, b5, sizeof b5));
        if (B < min)
            return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                                 "--trunk-gb auto: %s usable leaves %llu bytes (%s) for the trunk after a %s "
                                 "reserve; the trunk needs at least %llu bytes (%s)",
                                 shoal_memplan_fmt(usable, b1, sizeof b1), (unsigned long long)B,
                                 shoal_memplan_fmt(B, b2, sizeof b2), shoal_memplan_fmt(reserve, b3, sizeof b3),
                                 (unsigned long long)min, shoal_memplan_fmt(min, b4, sizeof b4));
        break;
    }
    default: return shoal_err_set(err, errlen, SHOAL_EINVAL, "trunk: mode %d", (int)o->trunk_mode);
    }
    if (B > full)
        B = full;
    if (B < min)
        return shoal_err_set(err, errlen, SHOAL_ECONFIG,
                             "--trunk-gb: a budget of %llu bytes (%s) cannot work: the trunk needs at least %llu "
                             "bytes (%s) = %s fp32 vectors + %s embedding row buffer + %s routers + 2 x %llu bytes "
                             "streaming buffers (the largest layer part); fully resident needs %llu bytes (%s)",
                             (unsigned long long)B, shoal_memplan_fmt(B, b1, sizeof b1), (unsigned long long)min,
                             shoal_memplan_fmt(min, b2, sizeof b2), shoal_memplan_fmt(m->owned_bytes, b3, sizeof b3),
                             shoal_memplan_fmt(emb_bytes, b4, sizeof b4), shoal_memplan_fmt(pinned, b6, sizeof b6),
                             (unsigned long long)max_all,
                             (unsigned long long)full, shoal_memplan_fmt(full, b5, sizeof b5));

    /* resident set: first fit in forward order, buffers sized by what is left */
    uint64_t buf = B >= full ? 0 : max_all, res = 0;
    for (;;) {
        uint64_t avail = B - fixed - 2 * buf, nb = 0;
        res = 0;
        for (int i = 0; i < m->n_tunits; i++) {
            shoal__tunit *tu = &m->tunits[i];
            tu->stream = 0;
            if (tu->pinned) {
                tu->stream = -1;
                continue;
            }
            if (tu->u.bytes <= avail - res) {
                res += tu->u.bytes;
                tu->stream = -1;
            } else if (tu->u.bytes > nb) {
                nb = tu->u.bytes;
            }
        }
        if (nb == buf)
            break;
        buf = nb;
    }
    int nres = 0, nunits = 0;
    m->sunits = shoal_xcalloc((size_t)m->n_tunits, sizeof *m->sunits);
    for (int i = 0; i < m->n_tunits; i++) {
        shoal__tunit *tu = &m->tunits[i];
        nunits += !tu->pinned;
        if (tu->stream < 0) {
            nres += !tu->pinned;
            continue;
        }
        tu->stream = m->n_sunits;
        m->sunits[m->n_sunits++] = tu->u;
    }
    uint64_t stream_bytes = total - res;

    /* reader (opens the files, O_DIRECT where the filesystem takes it) */
    int nf = shoal_st_nfiles(m->st);
    const char **paths = shoal_xcalloc((size_t)nf + 1, sizeof *paths);
    for (int i = 0; i < nf; i++)
        paths[i] = shoal_st_file_path(m->st, i);
    shoal_tstream_opts so = {.no_direct = o->trunk_no_direct, .timeout_ms = o->trunk_timeout_ms};
    int rc = shoal_tstream_open(&m->ts, paths, nf, &so, err, errlen);
    free(paths);
    if (rc)
        return rc;
    shoal_tstream_stats st;
    shoal_tstream_get_stats(m->ts, &st);

    char rl[64] = "none";
    {
        int first = -1, last = -1, contiguous = 1;
        for (int l = 0; l < L; l++)
            if (m->tunits[2 * l].stream < 0 && m->tunits[2 * l + 1].stream < 0) {
                if (first < 0)
                    first = l;
                else if (last != l - 1)
                    contiguous = 0;
                last = l;
            }
        if (first >= 0)
            snprintf(rl, sizeof rl, contiguous ? "%d-%d" : "%d-%d (not contiguous)", first, last);
    }
    int head_res = 0;
    for (int i = 0; i < m->n_head; i++)
        head_res += m->tunits[2 * L + i].stream < 0;
    SHOAL_INFO("trunk plan: budget %llu bytes (%s, preset %s): resident %d of %d units = %llu bytes (%s; whole layers %s, "
               "lm_head slices %d of %d) + routers %llu bytes, streamed %llu bytes (%s) per forward through 2 buffers of %llu bytes; fp32 "
               "vectors %llu bytes, embedding row buffer %llu bytes; minimum %llu bytes (%s), fully resident %llu "
               "bytes (%s); forward scratch %zu bytes, sequence state %zu bytes + %zu per token (%s for one at max "
               "context %d); %s reads",
               (unsigned long long)B, shoal_memplan_fmt(B, b1, sizeof b1), mode_name(o->trunk_mode), nres, nunits,
               (unsigned long long)res, shoal_memplan_fmt(res, b2, sizeof b2), rl, head_res, m->n_head,
               (unsigned long long)pinned, (unsigned long long)stream_bytes, shoal_memplan_fmt(stream_bytes, b3, sizeof b3),
               (unsigned long long)buf, (unsigned long long)m->owned_bytes, (unsigned long long)emb_bytes,
               (unsigned long long)min, shoal_memplan_fmt(min, b4, sizeof b4), (unsigned long long)full,
               shoal_memplan_fmt(full, b5, sizeof b5), scratch_bytes, m->info.seq_fixed_bytes,
               m->info.seq_bytes_per_token, shoal_memplan_fmt(seq_one, b6, sizeof b6), m->info.max_context,
               st.direct ? "O_DIRECT" : "buffered");
    (void)b7;

    /* the resident load */
    uint64_t done = 0, all_res = res + pinned, next_report = all_res / 10;
    for (int i = 0; i < m->n_tunits; i++) {
        shoal__tunit *tu = &m->tunits[i];
        if (tu->stream >= 0)
            continue;
        if (posix_memalign(&tu->mem, SHOAL_TSTREAM_ALIGN, tu->u.bytes ? tu->u.bytes : SHOAL_TSTREAM_ALIGN))
            SHOAL_PANIC("out of memory: %zu bytes of resident trunk", tu->u.bytes);
        if ((rc = shoal_tstream_read(m->ts, &tu->u, tu->mem, err, errlen)))
            return rc;
        point(shoal__engine_trunk_owner(m, tu), tu, tu->mem);
        done += tu->u.bytes;
        if (all_res >= (256ull << 20) && done >= next_report && !o->quiet) {
            SHOAL_INFO("trunk: loaded %llu of %llu resident bytes (%.0f%%)", (unsigned long long)done,
                       (unsigned long long)all_res, 100.0 * (double)done / (double)all_res);
            next_report += all_res / 10;
        }
    }
    if (posix_memalign(&m->emb_rows, SHOAL_TSTREAM_ALIGN, emb_bytes))
        SHOAL_PANIC("out of memory: embedding row buffer");
    memset(m->emb_rows, 0, emb_bytes);
    if (m->n_sunits && (rc = shoal_tstream_start(m->ts, m->sunits, m->n_sunits, err, errlen)))
        return rc;
    shoal_tstream_get_stats(m->ts, &st);
    m->ts_base_read = st.bytes_read;
    m->ts_base_stall = st.stall_s;

    shoal_model_info *in = &m->info;
    in->trunk_budget = B;
    in->trunk_min_bytes = min;
    in->trunk_full_bytes = full;
    in->trunk_resident_bytes = res + pinned;
    in->trunk_buffer_bytes = m->n_sunits ? shoal_tstream_buffer_bytes(m->ts) : 0;
    in->trunk_stream_bytes = stream_bytes;
    in->trunk_units = nunits;
    in->trunk_units_resident = nres;
    in->trunk_direct = st.direct;
    return 0;
}

void shoal__engine_trunk_close(shoal_model *m)
{
    shoal_tstream_close(m->ts);
    m->ts = NULL;
    for (int i = 0; i < m->n_tunits; i++) {
        free(m->tunits[i].ext);
        free(m->tunits[i].field);
        free(m->tunits[i].mem);
    }
    free(m->tunits);
    free(m->sunits);
    free(m->emb_rows);
}
