/* libFuzzer target for the prefix cache's state files (coordinator/pcache/
 * pcache.h; they are input: a cache directory or `shoal run --load-state`).
 * Any bytes are refused with a message or accepted; an accepted file's parts
 * lie inside it and agree with its header. Two readers: the pure verifier
 * over the buffer, and the file reader over the same bytes as a file, for a
 * model whose fingerprint is the file's own (so the checks past the
 * fingerprint run) and whose state layout is 64 + 8 bytes per token. Seeds:
 * tests/fuzz/make_seeds_pcache.py. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "coordinator/pcache/pcache.h"

#define FIXED 64
#define PER_TOKEN 8

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512] = "";
    shoal_pcache_hdr h;
    int rc = shoal_pcache_verify(&h, data, size, err, sizeof err);
    if (rc) {
        if (!err[0])
            abort();
    } else if (shoal_pcache_file_size(&h) != size || h.n_ids < 1 || h.n_ids > SHOAL_PCACHE_MAX_IDS) {
        abort();
    }
    int fd = memfd_create("fuzz_pcache", 0);
    if (fd < 0)
        return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    uint8_t fp[SHOAL_PCACHE_FP_BYTES] = {0};
    if (size >= 48)
        memcpy(fp, data + 16, sizeof fp);
    shoal_pcache_file *f = NULL;
    err[0] = 0;
    rc = shoal_pcache_file_read(&f, path, fp, FIXED, PER_TOKEN, err, sizeof err);
    if (rc) {
        if (f || !err[0])
            abort();
    } else {
        /* accepted: it passed the pure verifier too, and its parts agree */
        shoal_pcache_hdr h2;
        if (shoal_pcache_verify(&h2, data, size, err, sizeof err) || f->h.state_bytes != FIXED + (uint64_t)f->h.n_ids * PER_TOKEN ||
            shoal_pcache_ids_hash(f->ids, (int)f->h.n_ids) != f->h.ids_hash || (f->h.n_logits && !f->logits))
            abort();
        volatile uint8_t sink = 0;
        const uint8_t *st = f->state;
        for (uint64_t i = 0; i < f->h.state_bytes; i++)
            sink ^= st[i];
        for (uint32_t i = 0; i < f->h.n_logits; i++)
            sink ^= (uint8_t)f->logits[i];
        (void)sink;
        shoal_pcache_file_free(f);
    }
    close(fd);
    return 0;
}
