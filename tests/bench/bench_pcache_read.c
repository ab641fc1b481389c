/* Prefix cache: how to read a large capture back from --prefix-cache-dir
 * (issue 32 item "O_DIRECT or mmap"; docs/PERFORMANCE.md "Prefix cache").
 * One state file of a full-K3 capture's size after N tokens (KDA states
 * 69 x 96 x 128 x 128 fp32 + conv windows + N x 24 MLA layers x 576 fp32) is
 * restored R times by each of three ways, interleaved (the order rotates per
 * round), each ending with the state copied into a sequence-sized buffer (what
 * shoal_seq_import does) after the whole file is verified
 * (shoal_pcache_verify: size, ids hash, payload checksum):
 *   pread   -- the shipped path: pread into a heap buffer, verify, copy;
 *   mmap    -- mmap(MAP_POPULATE) read-only, verify on the mapping, copy
 *              from it (one copy fewer);
 *   direct  -- O_DIRECT pread into an aligned buffer (no page cache), verify,
 *              copy.
 * Each way is timed cold (the file's pages dropped first with
 * posix_fadvise(DONTNEED), after an fdatasync; O_DIRECT never uses them) and
 * warm (the pages cached; not for direct). Prints one JSON line per
 * measurement. Usage: bench_pcache_read DIR [TOKENS=4096] [ROUNDS=5]. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "coordinator/pcache/pcache.h"

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void drop_pages(const char *path)
{
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

static int read_fd(int fd, uint8_t *b, size_t n)
{
    size_t off = 0;
    while (off < n) {
        size_t want = n - off > (1u << 30) ? (1u << 30) : n - off;
        ssize_t r = pread(fd, b + off, want, (off_t)off);
        if (r <= 0)
            return -1;
        off += (size_t)r;
    }
    return 0;
}

/* 0 ok; the state copied into dst */
static int restore(int way, const char *path, size_t size, void *dst, size_t sb, size_t ids_bytes)
{
    char err[256];
    shoal_pcache_hdr h;
    int rc = -1;
    if (way == 1) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return -1;
        void *m = mmap(NULL, size, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
        close(fd);
        if (m == MAP_FAILED)
            return -1;
        rc = shoal_pcache_verify(&h, m, size, err, sizeof err);
        if (!rc)
            memcpy(dst, (uint8_t *)m + SHOAL_PCACHE_HDR_BYTES + ids_bytes, sb);
        munmap(m, size);
        return rc;
    }
    size_t al = (size + 4095) & ~(size_t)4095;
    uint8_t *b = NULL;
    if (posix_memalign((void **)&b, 4096, al))
        return -1;
    int fd = open(path, O_RDONLY | O_CLOEXEC | (way == 2 ? O_DIRECT : 0));
    if (fd >= 0) {
        if (way == 2) { /* O_DIRECT: whole aligned blocks; the last read stops at the end of the file */
            size_t off = 0;
            rc = 0;
            while (off < size) {
                size_t want = al - off > (1u << 30) ? (1u << 30) : al - off;
                ssize_t r = pread(fd, b + off, want, (off_t)off);
                if (r < 0) {
                    rc = -1;
                    break;
                }
                if (r == 0)
                    break;
                off += (size_t)r;
            }
            if (off < size)
                rc = -1;
        } else {
            rc = read_fd(fd, b, size);
        }
        close(fd);
    }
    if (!rc)
        rc = shoal_pcache_verify(&h, b, size, err, sizeof err);
    if (!rc)
        memcpy(dst, b + SHOAL_PCACHE_HDR_BYTES + ids_bytes, sb);
    free(b);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [TOKENS] [ROUNDS]\n", argv[0]);
        return 2;
    }
    int n = argc > 2 ? atoi(argv[2]) : 4096, rounds = argc > 3 ? atoi(argv[3]) : 5;
    size_t fixed = (size_t)69 * 96 * 128 * 128 * 4 + (size_t)69 * 3 * 3 * 12288 * 4;
    size_t per = (size_t)24 * 576 * 4;
    size_t sb = fixed + (size_t)n * per;
    uint8_t fp[SHOAL_PCACHE_FP_BYTES] = {1};
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++)
        ids[i] = i * 7 % 163840;
    float *st = malloc(sb);
    for (size_t i = 0; i < sb / 4; i++)
        st[i] = (float)(i % 1000) * 0.001f;
    char path[4096], err[512];
    snprintf(path, sizeof path, "%s/bench_read.shst", argv[1]);
    if (shoal_pcache_file_write(path, fp, ids, n, st, sb, NULL, 0, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    struct stat s;
    stat(path, &s);
    size_t size = (size_t)s.st_size;
    void *dst = malloc(sb);
    memset(dst, 0, sb); /* the sequence's pages exist before a restore, as in the server */
    const char *names[3] = {"pread", "mmap", "direct"};
    printf("{\"file_bytes\": %zu, \"state_bytes\": %zu, \"tokens\": %d}\n", size, sb, n);
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 3; k++) {
            int way = (k + r) % 3;
            for (int warm = 0; warm < (way == 2 ? 1 : 2); warm++) {
                if (!warm)
                    drop_pages(path);
                else
                    restore(way, path, size, dst, sb, 4 * (size_t)n); /* bring the pages in */
                double t0 = now();
                int rc = restore(way, path, size, dst, sb, 4 * (size_t)n);
                double dt = now() - t0;
                int same = memcmp(dst, st, sb) == 0;
                memset(dst, 0, 4096);
                double la[1] = {0};
                getloadavg(la, 1);
                printf("{\"round\": %d, \"way\": \"%s\", \"cache\": \"%s\", \"s\": %.4f, \"GBps\": %.3f, \"ok\": %d, "
                       "\"load1\": %.2f}\n",
                       r, names[way], warm ? "warm" : "cold", dt, (double)size / dt * 1e-9, rc == 0 && same, la[0]);
                fflush(stdout);
            }
        }
    }
    unlink(path);
    free(dst);
    free(ids);
    free(st);
    return 0;
}
