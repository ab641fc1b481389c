/* The worker's owned experts as kernel views (see bank.h). */
#include "worker/bank.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "common/mapguard.h"

typedef struct {
    char *path;
    int fd;            /* our own descriptor of the mapped file, for fstat */
    uint64_t need;     /* the end of the last byte an owned tensor uses */
    uintptr_t lo, hi;  /* the addresses of the owned tensors' bytes in the mapping */
} bank_file;

#define EXPERT_FILES SHOAL_K3SCHEMA_EXPERT_MAX

struct shoal_bank {
    int num_layers, num_experts, d, f;
    float b1, b2;
    uint64_t bytes;
    shoal_expert_w *w; /* [num_layers * num_experts]; .w1 == NULL when not owned */
    int nfiles;        /* 0 for a bank from views */
    bank_file *files;  /* [nfiles], indexed as the store's files */
    int16_t *efile;    /* [num_layers * num_experts * EXPERT_FILES] file of each tensor, -1 past the last */
    int skip_check;    /* SHOAL_DEBUG_SKIP_SIZE_CHECK=1: shoal_bank_check passes (tests of the SIGBUS guard) */
};

static shoal_bank *bank_new(int num_layers, int num_experts)
{
    shoal_bank *b = shoal_xcalloc(1, sizeof *b);
    b->num_layers = num_layers;
    b->num_experts = num_experts;
    b->w = shoal_xcalloc((size_t)num_layers * (size_t)num_experts, sizeof *b->w);
    return b;
}

/* Read-ahead hint for one tensor's pages (advisory; failures are harmless). */
static void willneed(const shoal_tensor *t)
{
    static long page;
    if (!page)
        page = sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)t->data & ~(uintptr_t)(page - 1);
    uintptr_t e = (uintptr_t)t->data + t->nbytes;
    (void)madvise((void *)a, e - a, MADV_WILLNEED);
}

static int dtype_ok(const shoal_k3schema_entry *s, const shoal_tensor *t)
{
    if (t->dtype != s->dtype && (s->alt_dtype < 0 || t->dtype != (shoal_dtype)s->alt_dtype))
        return 0;
    if (t->ndim != s->ndim)
        return 0;
    for (int i = 0; i < s->ndim; i++)
        if (t->shape[i] != s->shape[i])
            return 0;
    return 1;
}

int shoal_bank_open(shoal_bank **out, const shoal_st *st, const shoal_k3cfg *cfg, const shoal_shard *own, char *err,
                    size_t errlen)
{
    *out = NULL;
    shoal_bank *b = bank_new(cfg->num_layers, cfg->num_experts);
    b->d = cfg->latent_size;
    b->f = cfg->moe_intermediate_size;
    b->b1 = cfg->situ_beta;
    b->b2 = cfg->situ_linear_beta;
    int nf = shoal_st_nfiles(st);
    if (nf > 32767) {
        shoal_bank_close(b);
        return shoal_err_set(err, errlen, SHOAL_EMODEL, "%d safetensors files: more than the bank tracks", nf);
    }
    b->nfiles = nf;
    /* the one place this debug switch is read (docs/TESTING.md): with it, a
     * shard truncated under the mapping is read anyway, so the kernel's read
     * faults and the SIGBUS guard is what answers */
    const char *dbg = getenv("SHOAL_DEBUG_SKIP_SIZE_CHECK");
    if (dbg && !strcmp(dbg, "1")) {
        b->skip_check = 1;
        SHOAL_WARN("SHOAL_DEBUG_SKIP_SIZE_CHECK=1: the per-batch shard size check is off (a debug switch for "
                   "tests; a truncated shard now ends the worker with SIGBUS)");
    }
    b->files = shoal_xcalloc((size_t)nf, sizeof *b->files);
    for (int i = 0; i < nf; i++) {
        b->files[i].fd = -1;
        b->files[i].lo = UINTPTR_MAX;
    }
    b->efile = shoal_xmalloc((size_t)cfg->num_layers * (size_t)cfg->num_experts * EXPERT_FILES * sizeof *b->efile);
    memset(b->efile, 0xff, (size_t)cfg->num_layers * (size_t)cfg->num_experts * EXPERT_FILES * sizeof *b->efile);
    for (int l = 0; l < cfg->num_layers; l++)
        for (int e = 0; e < cfg->num_experts; e++) {
            if (!shoal_shard_owns(own, l, e))
                continue;
            shoal_k3schema_entry ent[SHOAL_K3SCHEMA_EXPERT_MAX];
            int n = shoal_k3schema_expert(cfg, l, e, ent);
            if (n < 0) {
                shoal_bank_close(b);
                return shoal_err_set(err, errlen, SHOAL_EMODEL, "layer %d expert %d is not a routed expert", l, e);
            }
            const shoal_tensor *t[SHOAL_K3SCHEMA_EXPERT_MAX];
            for (int i = 0; i < n; i++) {
                t[i] = shoal_st_find(st, ent[i].name);
                if (!t[i] || !dtype_ok(&ent[i], t[i])) {
                    int rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s %s (want %s [%lld, %lld])",
                                           t[i] ? "mis-shaped" : "missing", ent[i].name, shoal_dtype_name(ent[i].dtype),
                                           (long long)ent[i].shape[0], (long long)ent[i].shape[1]);
                    shoal_bank_close(b);
                    return rc;
                }
                if (!t[i]->data) {
                    shoal_bank_close(b);
                    return shoal_err_set(err, errlen, SHOAL_EINVAL, "the tensor store is not mapped");
                }
                b->bytes += t[i]->nbytes;
                int fi = t[i]->file;
                if (fi < 0 || fi >= nf) {
                    shoal_bank_close(b);
                    return shoal_err_set(err, errlen, SHOAL_EINTERNAL, "%s: file index %d of %d", ent[i].name, fi, nf);
                }
                bank_file *bf = &b->files[fi];
                if (bf->fd < 0) {
                    const char *path = shoal_st_file_path(st, fi);
                    bf->path = shoal_xstrdup(path ? path : "?");
                    if ((bf->fd = shoal_open_regular(bf->path, O_RDONLY)) < 0) {
                        int rc = shoal_err_set(err, errlen, SHOAL_EMODEL, "%s: cannot open it again: %s", bf->path,
                                               bf->fd == SHOAL_EFORMAT ? "not a regular file" : strerror(-bf->fd));
                        bf->fd = -1;
                        shoal_bank_close(b);
                        return rc;
                    }
                }
                if (t[i]->file_offset + t[i]->nbytes > bf->need)
                    bf->need = t[i]->file_offset + t[i]->nbytes;
                if ((uintptr_t)t[i]->data < bf->lo)
                    bf->lo = (uintptr_t)t[i]->data;
                if ((uintptr_t)t[i]->data + t[i]->nbytes > bf->hi)
                    bf->hi = (uintptr_t)t[i]->data + t[i]->nbytes;
                b->efile[((size_t)l * (size_t)cfg->num_experts + (size_t)e) * EXPERT_FILES + (size_t)i] = (int16_t)fi;
            }
            shoal_expert_w *w = &b->w[(size_t)l * (size_t)b->num_experts + (size_t)e];
            w->d = b->d;
            w->f = b->f;
            if (n == 6) { /* w1, w3, w2 × (packed, scale) */
                w->kind = SHOAL_EXPERT_MXFP4;
                w->w1 = t[0]->data, w->w1_scale = t[1]->data;
                w->w3 = t[2]->data, w->w3_scale = t[3]->data;
                w->w2 = t[4]->data, w->w2_scale = t[5]->data;
            } else {
                w->kind = t[0]->dtype == SHOAL_DT_BF16 ? SHOAL_EXPERT_BF16 : SHOAL_EXPERT_F32;
                if (t[1]->dtype != t[0]->dtype || t[2]->dtype != t[0]->dtype) {
                    shoal_bank_close(b);
                    return shoal_err_set(err, errlen, SHOAL_EMODEL, "layer %d expert %d: w1/w3/w2 dtypes differ", l,
                                         e);
                }
                w->w1 = t[0]->data, w->w3 = t[1]->data, w->w2 = t[2]->data;
            }
            for (int i = 0; i < n; i++)
                willneed(t[i]);
        }
    *out = b;
    return 0;
}

int shoal_bank_from_views(shoal_bank **out, int num_layers, int num_experts, const shoal_shard *own,
                          const shoal_expert_w *views, float b1, float b2, char *err, size_t errlen)
{
    *out = NULL;
    shoal_bank *b = bank_new(num_layers, num_experts);
    b->b1 = b1;
    b->b2 = b2;
    for (int l = 0; l < num_layers; l++)
        for (int e = 0; e < num_experts; e++) {
            if (!shoal_shard_owns(own, l, e))
                continue;
            const shoal_expert_w *v = &views[(size_t)l * (size_t)num_experts + (size_t)e];
            if (!v->w1 || !v->w2 || !v->w3 || v->d <= 0 || v->f <= 0 || (b->d && (v->d != b->d || v->f != b->f))) {
                shoal_bank_close(b);
                return shoal_err_set(err, errlen, SHOAL_EINVAL, "layer %d expert %d: bad view", l, e);
            }
            b->d = v->d;
            b->f = v->f;
            b->w[(size_t)l * (size_t)num_experts + (size_t)e] = *v;
        }
    *out = b;
    return 0;
}

void shoal_bank_close(shoal_bank *b)
{
    if (!b)
        return;
    if (shoal_mapguard_owner() == b)
        shoal_bank_guard(NULL);
    for (int i = 0; i < b->nfiles; i++) {
        if (b->files[i].fd >= 0)
            close(b->files[i].fd);
        free(b->files[i].path);
    }
    free(b->files);
    free(b->efile);
    free(b->w);
    free(b);
}

int shoal_bank_check(const shoal_bank *b, int layer, const int32_t *experts, int n, char *err, size_t errlen)
{
    if (!b->nfiles || b->skip_check || layer < 0 || layer >= b->num_layers)
        return 0;
    int seen[16], nseen = 0; /* distinct files checked (a few: an expert's tensors sit together) */
    for (int k = 0; k < n; k++) {
        if (experts[k] < 0 || experts[k] >= b->num_experts)
            continue;
        const int16_t *ef = b->efile + ((size_t)layer * (size_t)b->num_experts + (size_t)experts[k]) * EXPERT_FILES;
        for (int i = 0; i < EXPERT_FILES && ef[i] >= 0; i++) {
            int fi = ef[i], dup = 0;
            for (int j = 0; j < nseen && !dup; j++)
                dup = seen[j] == fi;
            if (dup)
                continue;
            if (nseen < (int)(sizeof seen / sizeof seen[0]))
                seen[nseen++] = fi;
            const bank_file *bf = &b->files[fi];
            struct stat sb;
            if (fstat(bf->fd, &sb))
                return shoal_err_set(err, errlen, SHOAL_EIO, "layer %d expert %d: cannot stat %s: %s", layer,
                                     experts[k], bf->path, strerror(errno));
            if ((uint64_t)sb.st_size < bf->need)
                return shoal_err_set(err, errlen, SHOAL_EIO,
                                     "layer %d expert %d: shard %s is now %lld bytes, its experts need %llu "
                                     "(truncated while mapped); refusing to read it",
                                     layer, experts[k], bf->path, (long long)sb.st_size, (unsigned long long)bf->need);
        }
    }
    return 0;
}

/* runs in the signal handler (common/mapguard): reads the bank's table only */
static const char *find_file(const void *owner, uintptr_t a)
{
    const shoal_bank *b = owner;
    for (int i = 0; i < b->nfiles; i++)
        if (b->files[i].path && a >= b->files[i].lo && a < b->files[i].hi)
            return b->files[i].path;
    return NULL;
}

static const shoal_mapguard_text guard_text = {
    .who = "shoal expert",
    .unknown = "a mapped shard",
    .why = "the file shrank, or its storage failed, under the mapping",
};

void shoal_bank_guard(const shoal_bank *b)
{
    shoal_mapguard_set(b, find_file, &guard_text);
}

const shoal_expert_w *shoal_bank_get(const shoal_bank *b, int layer, int expert)
{
    if (layer < 0 || layer >= b->num_layers || expert < 0 || expert >= b->num_experts)
        return NULL;
    const shoal_expert_w *w = &b->w[(size_t)layer * (size_t)b->num_experts + (size_t)expert];
    return w->w1 ? w : NULL;
}

uint64_t shoal_bank_bytes(const shoal_bank *b)
{
    return b->bytes;
}
int shoal_bank_d(const shoal_bank *b)
{
    return b->d;
}
int shoal_bank_f(const shoal_bank *b)
{
    return b->f;
}
float shoal_bank_b1(const shoal_bank *b)
{
    return b->b1;
}
float shoal_bank_b2(const shoal_bank *b)
{
    return b->b2;
}
