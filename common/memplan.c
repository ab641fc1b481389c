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
    snprintf(path, sizeof path, "%s%s", root, rel);
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

static void try_limit(shoal_memplan_probe *p, const char *root, const char *rel, int version)
{
    uint64_t v;
    if (read_u64(root, rel, &v))
        return;
    /* v1 reports "no limit" as a huge page-rounded number */
    if (version == 1 && v >= (1ull << 62))
        v = UINT64_MAX;
    if (!p->cgroup_version || v < p->cgroup_limit) {
        p->cgroup_limit = v;
        p->cgroup_version = version;
        snprintf(p->cgroup_file, sizeof p->cgroup_file, "%s", rel);
    }
}

void shoal_memplan_read(const char *root, shoal_memplan_probe *p)
{
    memset(p, 0, sizeof *p);
    p->cgroup_limit = UINT64_MAX;
    p->mem_available = UINT64_MAX;
    char path[1024], line[1024], rel[1024];
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
            if (!strcmp(cg, "/"))
                cg = "";
            if (!strcmp(line, "0") && !*ctrl) {
                snprintf(rel, sizeof rel, "/sys/fs/cgroup%s/memory.max", cg);
                try_limit(p, root, rel, 2);
            } else {
                char cs[256];
                snprintf(cs, sizeof cs, ",%s,", ctrl);
                if (strstr(cs, ",memory,")) {
                    snprintf(rel, sizeof rel, "/sys/fs/cgroup/memory%s/memory.limit_in_bytes", cg);
                    try_limit(p, root, rel, 1);
                }
            }
        }
        fclose(f);
    }
    /* inside a container the cgroup path may not be visible: the mount's root */
    try_limit(p, root, "/sys/fs/cgroup/memory.max", 2);
    try_limit(p, root, "/sys/fs/cgroup/memory/memory.limit_in_bytes", 1);
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
