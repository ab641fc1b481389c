/* engine: the model's mapped files, checked before every forward (see
 * engine_int.h) and guarded against SIGBUS (engine.h, shoal_model_guard). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/k3schema.h"
#include "common/log.h"
#include "coordinator/engine/engine_int.h"

typedef struct {
    shoal_model *m;
    const char *prefix;
} need_ctx;

static int add_need(const shoal_k3schema_entry *e, void *arg)
{
    need_ctx *x = arg;
    shoal_model *m = x->m;
    /* routed experts are read here only when they are in-process */
    if (e->cls == SHOAL_TC_EXPERT && (m->opts.remote_experts || !m->have_experts))
        return 0;
    /* schema names are the nested checkpoint's ("language_model.…"); a flat
     * one (prefix "") has the same names without it */
    static const char nested[] = "language_model.";
    const char *name = e->name;
    if (!x->prefix[0] && !strncmp(name, nested, sizeof nested - 1))
        name += sizeof nested - 1;
    const shoal_tensor *t = shoal_st_find(m->st, name);
    if (!t || !t->data || t->file < 0 || t->file >= m->map_nfiles)
        return 0;
    uint64_t end = t->file_offset + t->nbytes;
    if (end > m->map_need[t->file])
        m->map_need[t->file] = end;
    return 0;
}

void shoal__engine_mapped_open(shoal_model *m, const char *prefix)
{
    m->map_nfiles = shoal_st_nfiles(m->st);
    m->map_need = shoal_xcalloc((size_t)(m->map_nfiles > 0 ? m->map_nfiles : 1), sizeof *m->map_need);
    m->map_reported = shoal_xcalloc((size_t)(m->map_nfiles > 0 ? m->map_nfiles : 1), sizeof *m->map_reported);
    need_ctx x = {.m = m, .prefix = prefix};
    shoal_k3schema_foreach(&m->cfg, add_need, &x);
}

void shoal__engine_mapped_close(shoal_model *m)
{
    free(m->map_need);
    free(m->map_reported);
    m->map_need = NULL;
    m->map_reported = NULL;
    m->map_nfiles = 0;
}

int shoal__engine_mapped_check(const shoal_model *m, char *err, size_t errlen)
{
    for (int i = 0; i < m->map_nfiles; i++) {
        if (!m->map_need[i])
            continue;
        int fd = shoal_st_file_fd(m->st, i);
        struct stat sb;
        if (fd < 0 || fstat(fd, &sb))
            continue; /* no descriptor to ask: nothing better than reading */
        if ((uint64_t)sb.st_size >= m->map_need[i])
            continue;
        const char *path = shoal_st_file_path(m->st, i);
        int rc = shoal_err_set(err, errlen, SHOAL_EIO,
                               "model file %s is now %lld bytes, the tensors read from it need %llu (truncated "
                               "while mapped); refusing to read it",
                               path, (long long)sb.st_size, (unsigned long long)m->map_need[i]);
        if (atomic_exchange(&m->map_reported[i], 1) == 0)
            SHOAL_ERROR("model: %s", err ? err : path);
        return rc;
    }
    return 0;
}

int shoal_model_check_files(const shoal_model *m, char *err, size_t errlen)
{
    return shoal__engine_mapped_check(m, err, errlen);
}

/* ---- the SIGBUS safety net ------------------------------------------------ */

static const shoal_model *g_guarded;

static void put(const char *s)
{
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(2, s, n);
        if (w <= 0)
            return;
        s += w;
        n -= (size_t)w;
    }
}

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    (void)sig;
    (void)uc;
    const shoal_model *m = g_guarded;
    uintptr_t a = (uintptr_t)si->si_addr;
    const char *path = NULL;
    for (int i = 0; m && i < m->map_nfiles && !path; i++) {
        uint64_t len;
        const char *base = shoal_st_file_map(m->st, i, &len);
        if (base && a >= (uintptr_t)base && a < (uintptr_t)base + len)
            path = shoal_st_file_path(m->st, i);
    }
    char hex[2 + 16 + 1] = "0x";
    for (int i = 0; i < 16; i++)
        hex[2 + i] = "0123456789abcdef"[(a >> (60 - 4 * i)) & 15];
    hex[18] = 0;
    put("shoal: fatal: SIGBUS reading ");
    put(path ? path : "a mapped model file");
    put(" at ");
    put(hex);
    put(" (the file shrank, or its storage failed, under the mapping, between the check before the forward "
        "and the read); exiting with status 4\n");
    _exit(4);
}

void shoal_model_guard(const shoal_model *m)
{
    struct sigaction sa = {0};
    g_guarded = m;
    if (m) {
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
    } else {
        sa.sa_handler = SIG_DFL;
    }
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
}
