/* libFuzzer target for the routing trace reader (coordinator/obs/trace.c): any
 * bytes as a trace file are refused with a message or accepted, and then
 * every record obeys the header and the statistics add up. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "coordinator/obs/trace.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("fuzz_trace", 0);
    if (fd < 0)
        return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64], err[512] = "";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    shoal_trace_file *f = NULL;
    int rc = shoal_trace_open(&f, path, err, sizeof err);
    if (rc) {
        if (f || !err[0])
            abort();
        close(fd);
        return 0;
    }
    const shoal_trace_hdr *h = shoal_trace_file_hdr(f);
    uint64_t n = shoal_trace_file_count(f);
    if (h->k < 1 || h->k > SHOAL_TRACE_MAX_K || h->num_experts < h->k || h->num_layers < 1)
        abort();
    if ((uint64_t)h->num_layers * h->num_experts <= (1u << 22)) {
        uint64_t pairs = 0;
        for (uint64_t i = 0; i < n; i++) {
            shoal_trace_rec r;
            shoal_trace_file_get(f, i, &r);
            if (r.layer >= h->num_layers || r.n > h->k)
                abort();
            for (uint32_t j = 0; j < r.n; j++)
                if (r.experts[j] >= h->num_experts || (j && r.experts[j] <= r.experts[j - 1]))
                    abort();
            pairs += r.n;
        }
        shoal_trace_stats s;
        shoal_trace_stats_compute(f, &s);
        uint64_t sum = 0;
        for (uint64_t c = 0; c < (uint64_t)h->num_layers * h->num_experts; c++)
            sum += s.hits[c];
        if (s.records != n || s.pairs != pairs || sum != pairs)
            abort();
        for (uint32_t l = 0; l < h->num_layers; l++) {
            shoal_trace_conc c;
            if (shoal_trace_layer_conc(&s, l, &c) &&
                (c.max_over_mean < 1.0 - 1e-9 || c.top10_share <= 0 || c.top10_share > 1 + 1e-12 ||
                 c.entropy < -1e-12 || c.entropy > 1 + 1e-9))
                abort();
        }
        shoal_trace_stats_free(&s);
    }
    shoal_trace_file_close(f);
    close(fd);
    return 0;
}
