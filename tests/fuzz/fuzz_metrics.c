/* libFuzzer target for the Prometheus text parser (common/metrics.c), which
 * reads bytes from the network in `shoal top`. Every accepted sample must be
 * well formed, and writing it back with the writer and parsing that again
 * must give the same name, labels and value (differential round trip). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/metrics.h"

static int name_ok(const char *s, int colon)
{
    if (!*s || (*s >= '0' && *s <= '9'))
        return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
              (colon && *s == ':')))
            return 0;
    return 1;
}

typedef struct {
    const shoal_metrics_parsed *want;
    int seen;
} again_ctx;

static int again(void *ctx, const shoal_metrics_parsed *s)
{
    again_ctx *a = ctx;
    const shoal_metrics_parsed *w = a->want;
    if (a->seen++ || strcmp(s->name, w->name) || s->nlabels != w->nlabels)
        abort();
    for (int i = 0; i < s->nlabels; i++)
        if (strcmp(s->labels[i].name, w->labels[i].name) || strcmp(s->labels[i].value, w->labels[i].value))
            abort();
    if (!(s->value == w->value || (isnan(s->value) && isnan(w->value))))
        abort();
    return 0;
}

static int check(void *ctx, const shoal_metrics_parsed *s)
{
    (void)ctx;
    if (!name_ok(s->name, 1) || s->nlabels < 0 || s->nlabels > SHOAL_METRICS_MAX_LABELS)
        abort();
    for (int i = 0; i < s->nlabels; i++) {
        if (!name_ok(s->labels[i].name, 0) || !s->labels[i].value)
            abort();
        if (!strncmp(s->labels[i].name, "__", 2)) /* reserved: the writer refuses them */
            return 0;
    }
    /* a NUL cannot be in a line (refused), so label values are whole strings */
    shoal_metrics_buf b = {0};
    shoal_metrics_sample(&b, s->name, s->labels, s->nlabels, s->value);
    again_ctx a = {s, 0};
    char err[128];
    if (shoal_metrics_parse(b.p, b.len, again, &a, err, sizeof err) || a.seen != 1)
        abort();
    shoal_metrics_buf_free(&b);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[256];
    err[0] = 0;
    int rc = shoal_metrics_parse((const char *)data, size, check, NULL, err, sizeof err);
    if (rc && !strstr(err, "metrics line"))
        abort(); /* every refusal names its line */
    return 0;
}
