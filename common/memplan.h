/* memplan: how much memory this process may use, for the memory presets
 * (`--cache-gb auto` on the expert server): the cgroup limit -- the smallest
 * over the process's cgroup (found through /proc/self/cgroup) and each of its
 * ancestors up to the root of the mounted tree: v2 memory.max, v1
 * memory.limit_in_bytes and memory.stat's hierarchical_memory_limit ("max"
 * and v1's huge "unlimited" values count as no limit) --, MemAvailable from
 * /proc/meminfo, and the
 * process's peak resident set (VmHWM) for the report at exit. Reads files
 * only; every path is below `root` ("" for the real system) so tests can
 * give a fake /proc and /sys. Thread-safe (no state). */
#ifndef SHOAL_MEMPLAN_H
#define SHOAL_MEMPLAN_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t cgroup_limit;  /* bytes; UINT64_MAX when there is none (or "max") */
    int cgroup_version;     /* 1, 2, or 0 when no limit file was found */
    char cgroup_file[512];  /* the file that gave the smallest limit (relative to root) */
    uint64_t mem_available; /* /proc/meminfo MemAvailable; UINT64_MAX if unreadable */
    uint64_t mem_total;     /* /proc/meminfo MemTotal; 0 if unreadable */
} shoal_memplan_probe;

/* Fills p; never fails (what cannot be read is reported as unlimited). */
void shoal_memplan_read(const char *root, shoal_memplan_probe *p);

/* The memory this process may plan for: min(cgroup limit, MemAvailable). */
uint64_t shoal_memplan_usable(const shoal_memplan_probe *p);

/* Peak resident set of this process in bytes (/proc/self/status VmHWM); 0
 * if unreadable. */
uint64_t shoal_memplan_peak_rss(void);

/* "12.3 GiB" / "512.0 MiB" / "unlimited" into buf. */
const char *shoal_memplan_fmt(uint64_t bytes, char *buf, size_t cap);

#endif
