/* Host facts for PROBE (see hostfacts.h). */
#include "worker/hostfacts.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "cli/version.h"
#include "kernels/kernels.h"

#define BW_BYTES (256u << 20)   /* memory pass buffer: far past any L3 */
#define DISK_BYTES (256u << 20) /* at most this much of the model file is read */
#define DISK_CHUNK (4u << 20)

static uint64_t bw_sink;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void cpu_model(char *out, size_t cap)
{
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10))
            continue;
        const char *c = strchr(line, ':');
        if (!c)
            break;
        c++;
        while (*c == ' ' || *c == '\t')
            c++;
        size_t n = strcspn(c, "\n");
        if (n >= cap)
            n = cap - 1;
        for (size_t i = 0; i < n; i++) /* printable ASCII only: it goes on the wire as str */
            out[i] = c[i] >= 0x20 && c[i] < 0x7f ? c[i] : '?';
        out[n] = 0;
        break;
    }
    fclose(f);
}

static void meminfo(uint64_t *total, uint64_t *avail)
{
    *total = *avail = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return;
    char line[256];
    unsigned long long v;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &v) == 1)
            *total = (uint64_t)v * 1024;
        else if (sscanf(line, "MemAvailable: %llu kB", &v) == 1)
            *avail = (uint64_t)v * 1024;
    }
    fclose(f);
}

/* The largest regular file directly in dir or one level below (a pack keeps
 * its files in subdirectories). */
static void largest_file(const char *dir, int depth, char *best, size_t cap, off_t *bsize)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char p[4096];
        if ((size_t)snprintf(p, sizeof p, "%s/%s", dir, e->d_name) >= sizeof p)
            continue;
        struct stat sb;
        if (stat(p, &sb))
            continue;
        if (S_ISREG(sb.st_mode) && sb.st_size > *bsize) {
            *bsize = sb.st_size;
            snprintf(best, cap, "%s", p);
        } else if (S_ISDIR(sb.st_mode) && depth < 1) {
            largest_file(p, depth + 1, best, cap, bsize);
        }
    }
    closedir(d);
}

/* Bytes/s reading up to DISK_BYTES of the largest model file: O_DIRECT (no
 * page cache), else a plain read after dropping the file's cached pages
 * (which a mapping may keep: then this is a cache figure). 0 on failure. */
static uint64_t disk_read_bw(const char *dir)
{
    char path[4096] = "";
    off_t size = 0;
    largest_file(dir, 0, path, sizeof path, &size);
    if (!path[0] || size < 65536)
        return 0;
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) {
        fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return 0;
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    }
    void *buf = NULL;
    if (posix_memalign(&buf, 4096, DISK_CHUNK)) {
        close(fd);
        return 0;
    }
    uint64_t want = (uint64_t)size < DISK_BYTES ? (uint64_t)size / 4096 * 4096 : DISK_BYTES, got = 0;
    double t0 = now_s();
    while (got < want) { /* whole 4096-byte blocks (O_DIRECT) */
        size_t chunk = want - got < DISK_CHUNK ? (size_t)(want - got) : DISK_CHUNK;
        ssize_t r = pread(fd, buf, chunk, (off_t)got);
        if (r <= 0)
            break;
        got += (uint64_t)r;
    }
    double dt = now_s() - t0;
    free(buf);
    close(fd);
    return got && dt > 0 ? (uint64_t)((double)got / dt) : 0;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void shoal_hostfacts_measure(shoal_proto_facts *f, const char *dir, int threads)
{
    double t0 = now_s();
    f->has = 1;
    cpu_model(f->cpu, sizeof f->cpu);
    snprintf(f->version, sizeof f->version, "%s", SHOAL_VERSION);
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    f->cores = c > 0 ? (uint32_t)c : 1;
    meminfo(&f->mem_total, &f->mem_avail);
    f->disk_free = f->disk_total = f->disk_read_bw = 0;
    struct statvfs vs;
    if (dir && !statvfs(dir, &vs)) {
        f->disk_free = (uint64_t)vs.f_bavail * vs.f_frsize;
        f->disk_total = (uint64_t)vs.f_blocks * vs.f_frsize;
    }
    if (dir)
        f->disk_read_bw = disk_read_bw(dir);
    f->read_bw_1 = f->read_bw_all = 0;
    uint64_t *buf = NULL;
    if (!posix_memalign((void **)&buf, 64, BW_BYTES)) {
        size_t n = BW_BYTES / 8;
        for (size_t i = 0; i < n; i++) /* touch every page: the pass reads memory, not fresh zero pages */
            buf[i] = i * 0x9e3779b97f4a7c15ull;
        for (int k = 0; k < 2; k++) {
            double v[3];
            for (int r = 0; r < 3; r++)
                v[r] = shoal_read_bw_pass(buf, n, k ? (threads > 0 ? threads : 1) : 1, &bw_sink);
            qsort(v, 3, sizeof v[0], cmp_d);
            if (k)
                f->read_bw_all = (uint64_t)(v[1] * 1e9);
            else
                f->read_bw_1 = (uint64_t)(v[1] * 1e9);
        }
        free(buf);
    }
    f->measure_us = (uint64_t)((now_s() - t0) * 1e6);
}
