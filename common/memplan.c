/* Memory limits of this process (see memplan.h). */
#include "common/memplan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* First line of root/rel as an unsigned number ("max" -> UINT64_MAX).
 * 0 ok, -1 missing or unparsable. */
static int read_u64(const char *root, const char *rel, uint64_t *out)
{
    char path[1024], line[128];
    snprintf(path, sizeof path, "%.400s%.600s", root, rel);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char *ok = fgets(line, sizeof line, f);
    fclose(f);
    if (!ok)
        return -1;
    line[strcspn(line, "\n")] = 0;
    if (!strcmp(line, "max")) {
        *out = UINT64_MAX;
        return 0;
    }
    char *end;
    unsigned long long v = strtoull(line, &end, 10);
    if (end == line || *end)
        return -1;
    *out = v;
    return 0;
}

/* v1 reports "no limit" as a huge page-rounded number (PAGE_COUNTER_MAX
 * pages, 2^63 - 4096 on x86-64; 2^64 - 1 on some kernels): anything past
 * 2^62 bytes is no limit. */
static uint64_t v1_limit(uint64_t v)
{
    return v >= (1ull << 62) ? UINT64_MAX : v;
}

static void take_limit(shoal_memplan_probe *p, uint64_t v, const char *rel, int version)
{
    if (!p->cgroup_version || v < p->cgroup_limit) {
        p->cgroup_limit = v;
        p->cgroup_version = version;
        snprintf(p->cgroup_file, sizeof p->cgroup_file, "%.511s", rel);
    }
}

static void try_limit(shoal_memplan_probe *p, const char *root, const char *rel, int version)
{
    uint64_t v;
    if (read_u64(root, rel, &v))
        return;
    take_limit(p, version == 1 ? v1_limit(v) : v, rel, version);
}

/* v1 memory.stat's hierarchical_memory_limit: the kernel's own minimum over
 * the cgroup and every ancestor, including ancestors a container cannot see. */
static void try_v1_stat(shoal_memplan_probe *p, const char *root, const char *rel)
{
    char path[1024], line[256];
    snprintf(path, sizeof path, "%.400s%.600s", root, rel);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    static const char key[] = "hierarchical_memory_limit ";
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, sizeof key - 1))
            continue;
        char *num = line + sizeof key - 1, *end;
        unsigned long long v = strtoull(num, &end, 10);
        if (end != num && (*end == '\n' || !*end))
            take_limit(p, v1_limit(v), rel, 1);
        break;
    }
    fclose(f);
}

/* A cgroup's limit is the smallest over it and its ancestors: walk from
 * base/cg up to base (the root of the mounted tree), reading every level's
 * limit file. A level that is missing (a container that sees only its own
 * subtree mounted at base) is skipped. */
static void walk_limits(shoal_memplan_probe *p, const char *root, const char *base, const char *cg, int version)
{
    char dir[512], rel[600];
    snprintf(dir, sizeof dir, "%s", cg);
    for (;;) {
        size_t n = strlen(dir);
        while (n && dir[n - 1] == '/')
            dir[--n] = 0;
        if (version == 2) {
            snprintf(rel, sizeof rel, "%.40s%.500s/memory.max", base, dir);
            try_limit(p, root, rel, 2);
        } else {
            snprintf(rel, sizeof rel, "%.40s%.500s/memory.limit_in_bytes", base, dir);
            try_limit(p, root, rel, 1);
            snprintf(rel, sizeof rel, "%.40s%.500s/memory.stat", base, dir);
            try_v1_stat(p, root, rel);
        }
        if (!n)
            break;
        char *slash = strrchr(dir, '/');
        if (!slash)
            break;
        *slash = 0;
    }
}

void shoal_memplan_read(const char *root, shoal_memplan_probe *p)
{
    memset(p, 0, sizeof *p);
    p->cgroup_limit = UINT64_MAX;
    p->mem_available = UINT64_MAX;
    char path[1024], line[1024];
    /* the process's cgroups: "0::/path" (v2), "N:memory:/path" or
     * "N:...,memory,...:/path" (v1) */
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    if (f) {
        while (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\n")] = 0;
            char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
            if (!c2)
                continue;
            *c1 = 0;
            *c2 = 0;
            const char *ctrl = c1 + 1, *cg = c2 + 1;
            if (!strcmp(line, "0") && !*ctrl) {
                walk_limits(p, root, "/sys/fs/cgroup", cg, 2);
                walk_limits(p, root, "/sys/fs/cgroup/unified", cg, 2); /* hybrid layout */
            } else {
                char cs[256];
                snprintf(cs, sizeof cs, ",%s,", ctrl);
                if (strstr(cs, ",memory,"))
                    walk_limits(p, root, "/sys/fs/cgroup/memory", cg, 1);
            }
        }
        fclose(f);
    }
    /* without /proc/self/cgroup: the mounts' roots (a container's own cgroup) */
    walk_limits(p, root, "/sys/fs/cgroup", "", 2);
    walk_limits(p, root, "/sys/fs/cgroup/memory", "", 1);
    snprintf(path, sizeof path, "%s/proc/meminfo", root);
    f = fopen(path, "r");
    if (f) {
        unsigned long long kb;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
                p->mem_available = kb * 1024ull;
            else if (sscanf(line, "MemTotal: %llu kB", &kb) == 1)
                p->mem_total = kb * 1024ull;
        }
        fclose(f);
    }
}

uint64_t shoal_memplan_usable(const shoal_memplan_probe *p)
{
    return p->cgroup_limit < p->mem_available ? p->cgroup_limit : p->mem_available;
}

uint64_t shoal_memplan_peak_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return kb * 1024ull;
}

const char *shoal_memplan_fmt(uint64_t bytes, char *buf, size_t cap)
{
    if (bytes == UINT64_MAX)
        snprintf(buf, cap, "unlimited");
    else if (bytes >= (1ull << 30))
        snprintf(buf, cap, "%.2f GiB", (double)bytes / 1073741824.0);
    else
        snprintf(buf, cap, "%.1f MiB", (double)bytes / 1048576.0);
    return buf;
}
