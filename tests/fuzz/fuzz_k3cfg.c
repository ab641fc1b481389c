/* libFuzzer target for the K3 config reader (common/k3cfg.c) and, for small
 * accepted configs, the tensor schema walk (common/k3schema.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/k3cfg.h"
#include "common/k3schema.h"

static int count(const shoal_k3schema_entry *e, void *ctx)
{
    if (!e->name[0] || e->ndim < 1 || e->ndim > 3)
        abort();
    ++*(long *)ctx;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    shoal_k3cfg c;
    char err[4096];
    int rc = shoal_k3cfg_parse(&c, (const char *)data, size, err, sizeof err);
    if (rc) {
        if (!err[0])
            abort(); /* every refusal names its field */
        return 0;
    }
    if (c.num_kda + c.num_mla != c.num_layers || c.num_layers < 1 || c.num_layers > SHOAL_MAX_LAYERS)
        abort();
    if ((long)c.num_experts * c.num_layers <= 20000) {
        long n = 0;
        shoal_k3schema_foreach(&c, count, &n);
        shoal_k3schema_totals t;
        shoal_k3schema_sum(&c, &t);
        if ((uint64_t)n != t.count[0] + t.count[1] + t.count[2])
            abort();
    }
    return 0;
}
