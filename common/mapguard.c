/* mapguard: the SIGBUS safety net under mapped model files (see mapguard.h). */
#include "common/mapguard.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

static const void *volatile g_owner;
static shoal_mapguard_find_fn volatile g_find;
static const shoal_mapguard_text *volatile g_text;

/* async-signal-safe output: write(2) only */
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
    const void *owner = g_owner;
    shoal_mapguard_find_fn find = g_find;
    const shoal_mapguard_text *t = g_text;
    uintptr_t a = (uintptr_t)si->si_addr;
    const char *path = owner && find ? find(owner, a) : NULL;
    char hex[2 + 16 + 1] = "0x";
    for (int i = 0; i < 16; i++)
        hex[2 + i] = "0123456789abcdef"[(a >> (60 - 4 * i)) & 15];
    hex[18] = 0;
    put(t ? t->who : "shoal");
    put(": fatal: SIGBUS reading ");
    put(path ? path : t ? t->unknown : "a mapped file");
    put(" at ");
    put(hex);
    put(" (");
    put(t ? t->why : "the file shrank, or its storage failed, under the mapping");
    put("); exiting with status 4\n");
    _exit(4);
}

void shoal_mapguard_set(const void *owner, shoal_mapguard_find_fn find, const shoal_mapguard_text *text)
{
    struct sigaction sa = {0};
    if (owner) {
        g_find = find;
        g_text = text;
        g_owner = owner;
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
    } else {
        g_owner = NULL;
        sa.sa_handler = SIG_DFL;
    }
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
}

const void *shoal_mapguard_owner(void)
{
    return g_owner;
}
