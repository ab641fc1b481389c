/* memplan: the memory limit read from a fake /proc and /sys -- cgroup v1 (the
 * process's memory cgroup, "unlimited" as v1 writes it), cgroup v2
 * (memory.max, "max"), MemAvailable, the smaller of them; nothing readable
 * means unlimited; a parent cgroup's smaller limit wins over the process's
 * own (v1 limit_in_bytes and hierarchical_memory_limit, v2 memory.max up to
 * the mount's root). */
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

/* v2: the smallest memory.max on the way up wins, wherever it is; "max" at
 * every level is no limit; a level without the file is skipped. */
static void t_v2_parents(void)
{
    fresh();
    put("/proc/self/cgroup", "0::/a/b/c\n");
    put("/sys/fs/cgroup/a/b/c/memory.max", "max\n");
    put("/sys/fs/cgroup/a/b/memory.max", "3221225472\n");
    put("/sys/fs/cgroup/a/memory.max", "6442450944\n");
    shoal_memplan_probe p;
    shoal_memplan_read(root, &p);
    CHECK_EQ_INT(p.cgroup_version, 2);
    CHECK(p.cgroup_limit == 3221225472ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/a/b/memory.max");
    /* the grandparent's limit is now the smallest; b has no file */
    put("/sys/fs/cgroup/a/b/memory.max", "");
    put("/sys/fs/cgroup/a/memory.max", "1073741824\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 1073741824ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/sys/fs/cgroup/a/memory.max");
    /* the leaf's own smaller limit wins over the ancestors */
    put("/sys/fs/cgroup/a/b/c/memory.max", "536870912\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 536870912ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/a/b/c/memory.max");
    /* "max" everywhere: unlimited; MemAvailable decides */
    put("/sys/fs/cgroup/a/b/c/memory.max", "max\n");
    put("/sys/fs/cgroup/a/memory.max", "max\n");
    put("/proc/meminfo", "MemAvailable:   2000 kB\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    CHECK(shoal_memplan_usable(&p) == 2048000ull);
    /* the hybrid layout's unified tree */
    put("/sys/fs/cgroup/unified/a/memory.max", "2147483648\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 2147483648ull);
    /* the walk stops at the mount's root: nothing above /sys/fs/cgroup is read */
    put("/sys/fs/memory.max", "4096\n");
    put("/sys/memory.max", "4096\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 2147483648ull);
    cleanup();
}

/* v1: limit_in_bytes up the hierarchy, memory.stat's hierarchical limit, and
 * the absurd values v1 writes for "unlimited" at any level. */
static void t_v1_parents(void)
{
    fresh();
    put("/proc/self/cgroup", "4:memory:/job/7/step\n1:cpu:/x\n");
    put("/sys/fs/cgroup/memory/job/7/step/memory.limit_in_bytes", "9223372036854771712\n");
    put("/sys/fs/cgroup/memory/job/7/memory.limit_in_bytes", "18446744073709551615\n");
    put("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "12884901888\n");
    put("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    shoal_memplan_probe p;
    shoal_memplan_read(root, &p);
    CHECK_EQ_INT(p.cgroup_version, 1);
    CHECK(p.cgroup_limit == 12884901888ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/memory/job/memory.limit_in_bytes");
    /* hierarchical_memory_limit (the kernel's minimum, covering ancestors a
     * container cannot see) smaller still */
    put("/sys/fs/cgroup/memory/job/7/step/memory.stat",
        "cache 0\nrss 4096\nhierarchical_memory_limit 5368709120\nhierarchical_memsw_limit 9223372036854771712\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 5368709120ull);
    CHECK_STR_CONTAINS(p.cgroup_file, "/job/7/step/memory.stat");
    /* an absurd hierarchical value is no limit; a malformed one is ignored */
    put("/sys/fs/cgroup/memory/job/7/step/memory.stat", "hierarchical_memory_limit 9223372036854771712\n");
    put("/sys/fs/cgroup/memory/job/memory.limit_in_bytes", "9223372036854771712\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    put("/sys/fs/cgroup/memory/job/7/step/memory.stat", "hierarchical_memory_limit 12x\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == UINT64_MAX);
    /* a container: the cgroup path is not visible below the mount, whose root
     * is the container's own cgroup */
    fresh();
    put("/proc/self/cgroup", "4:memory:/docker/abc\n");
    put("/sys/fs/cgroup/memory/memory.limit_in_bytes", "2147483648\n");
    shoal_memplan_read(root, &p);
    CHECK(p.cgroup_limit == 2147483648ull);
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
    RUN(t_v2_parents);
    RUN(t_v1_parents);
    RUN(t_nothing_and_fmt);
    return test_finish();
}
