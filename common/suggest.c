#include "common/suggest.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#define WMAX 64

/* optimal string alignment distance of a and b (each cut at WMAX bytes) */
static int distance(const char *a, const char *b)
{
    int n = (int)strnlen(a, WMAX), m = (int)strnlen(b, WMAX);
    int d[WMAX + 1][WMAX + 1];
    for (int i = 0; i <= n; i++)
        d[i][0] = i;
    for (int j = 0; j <= m; j++)
        d[0][j] = j;
    for (int i = 1; i <= n; i++)
        for (int j = 1; j <= m; j++) {
            int c = tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]);
            int v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v)
                v = d[i][j - 1] + 1;
            if (d[i - 1][j - 1] + c < v)
                v = d[i - 1][j - 1] + c;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    return d[n][m];
}

const char *shoal_suggest(const char *word, const char *const *cands, int n)
{
    size_t wl = strlen(word);
    if (!wl || wl > WMAX)
        return NULL;
    int limit = wl >= 12 ? (int)wl / 4 : 2;
    if (wl <= 3)
        limit = 1;
    const char *best = NULL;
    int bd = limit + 1;
    for (int i = 0; i < n; i++) {
        if (!cands[i] || strlen(cands[i]) > WMAX)
            continue;
        int d = distance(word, cands[i]);
        if (d < bd) {
            bd = d;
            best = cands[i];
        }
    }
    return best;
}

const char *shoal_suggest_flag(const char *word, void (*usage)(FILE *f))
{
    static char hit[WMAX + 1];
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return NULL;
    usage(f);
    fclose(f);
    /* every "--name" token of the help, once */
    const char *cands[512] = {0};
    char *names[512];
    int n = 0;
    for (char *p = text; p && *p && n < 512; p++) {
        if (p[0] != '-' || p[1] != '-' || (p > text && (isalnum((unsigned char)p[-1]) || p[-1] == '-')))
            continue;
        size_t k = 2;
        while (isalnum((unsigned char)p[k]) || p[k] == '-')
            k++;
        if (k > 2 && k <= WMAX) {
            int dup = 0;
            for (int i = 0; i < n && !dup; i++)
                dup = strlen(names[i]) == k && !strncmp(names[i], p, k);
            if (!dup) {
                names[n] = strndup(p, k);
                cands[n] = names[n];
                n++;
            }
        }
        p += k - 1;
    }
    const char *best = shoal_suggest(word, cands, n);
    if (best)
        snprintf(hit, sizeof hit, "%s", best);
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(text);
    return best ? hit : NULL;
}

void shoal_suggest_unknown_flag(const char *cmd, const char *word, void (*usage)(FILE *f))
{
    const char *s = shoal_suggest_flag(word, usage);
    if (s)
        fprintf(stderr, "%s: unknown option '%s'; did you mean %s? ('%s --help' lists them)\n", cmd, word, s, cmd);
    else
        fprintf(stderr, "%s: unknown option '%s' ('%s --help' lists them)\n", cmd, word, cmd);
}
