/* memplan: the memory limit read from a fake /proc and /sys -- cgroup v1 (the
 * process's memory cgroup, "unlimited" as v1 writes it), cgroup v2
 * (memory.max, "max"), MemAvailable, the smaller of them; nothing readable
 * means unlimited. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/memplan.h"
#include "tests/unit/test.h"

static char root[256];

static void put(const char *rel, const char *text)
{
    char path[1024], dir[1024];
    snprintf(path, sizeof path, "%s%s", root, rel);
    snprintf(dir, sizeof dir, "%s", path);
    for (char *p = dir + strlen(root) + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        mkdir(dir, 0755);
        *p = '/';
    }
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

static void fresh(void)
{
    snprintf(root, sizeof root, "/tmp/shoal-test-memplan-%d-XXXXXX", (int)getpid());
    if (!mkdtemp(root))
        root[0] = 0;
}

static void cleanup(void)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    if (system(cmd)) {
    }
}

static void t_v1(void)
{
    fresh();
    put("/proc/self/cgroup", "12:pids:/a\n5:cpuacct,cpu:/a\n4:memory:/job/7\n0::/\n");
    put("/sys/fs/cgroup/memory/job/7/memory.limit_in_bytes", "8589934592\n");
    put("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put("/proc/meminfo", "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n");
    shoal_memplan_probe p;
    shoal_memplan_read(root, &p);
    CHECK_EQ_INT(p.cgroup_version, 1);
    CHECK(p.cgroup_limit == 8589934592ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/job/7/");
    CHECK(p.mem_available == 20000000ull * 1024);
    CHECK(p.mem_total == 24000000ull * 1024);
    CHECK(shoal_memplan_usable(&p) == 8589934592ull);
    /* v1's "no limit" and a larger MemAvailable: MemAvailable wins */
    put("/sys/fs/cgroup/memory/job/7/memory.limit_in_bytes", "9223372036854771712\n");
    put("/proc/meminfo", "MemAvailable:   1000 kB\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    CHECK(shoal_memplan_usable(&p) == 1024000ull);
    cleanup();
}

static void t_v2(void)
{
    fresh();
    put("/proc/self/cgroup", "0::/user.slice/shoal.service\n");
    put("/sys/fs/cgroup/user.slice/shoal.service/memory.max", "4294967296\n");
    put("/sys/fs/cgroup/memory.max", "max\n");
    shoal_memplan_probe p;
    shoal_memplan_read(root, &p);
    CHECK_EQ_INT(p.cgroup_version, 2);
    CHECK(p.cgroup_limit == 4294967296ull);
    CHECK(p.mem_available == UINT64_MAX); /* no meminfo */
    CHECK(shoal_memplan_usable(&p) == 4294967296ull);
    put("/sys/fs/cgroup/user.slice/shoal.service/memory.max", "max\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    put("/sys/fs/cgroup/user.slice/shoal.service/memory.max", "garbage\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    cleanup();
}

static void t_nothing_and_fmt(void)
{
    fresh();
    shoal_memplan_probe p;
    shoal_memplan_read(root, &p);
    CHECK_EQ_INT(p.cgroup_version, 0);
    CHECK(shoal_memplan_usable(&p) == UINT64_MAX);
    char b[32];
    CHECK(!strcmp(shoal_memplan_fmt(UINT64_MAX, b, sizeof b), "unlimited"));
    CHECK(!strcmp(shoal_memplan_fmt(3ull << 30, b, sizeof b), "3.00 GiB"));
    CHECK(!strcmp(shoal_memplan_fmt(512ull << 20, b, sizeof b), "512.0 MiB"));
    CHECK(shoal_memplan_peak_rss() > 0); /* this process, from the real /proc */
    cleanup();
}

int main(void)
{
    test_binary = "test_memplan";
    RUN(t_v1);
    RUN(t_v2);
    RUN(t_nothing_and_fmt);
    return test_finish();
}
