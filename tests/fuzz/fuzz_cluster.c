/* libFuzzer target for the cluster manifest reader (coordinator/cmd/plan.c) and,
 * for accepted manifests, the planner on a small model with the hosts'
 * budgets: every refusal names something; an accepted plan owns every expert
 * exactly once within each worker's budget, and its replicas (1 or 2 per layer,
 * chosen by the input's size) are on another worker, still within budget; and
 * a redundant plan (--replicas 1 or 2) holds every expert on R + 1 workers of
 * distinct failure domains, within budget. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "coordinator/cmd/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    shoal_plan_cluster c;
    char err[4096] = "";
    if (shoal_plan_cluster_parse(&c, (const char *)data, size, "fuzz", err, sizeof err)) {
        if (!err[0])
            abort();
        return 0;
    }
    if (c.coordinator < 0 || c.coordinator >= c.nhosts)
        abort();
    enum { L = 3, E = 5 };
    static const uint8_t moe[L] = {0, 1, 1};
    uint64_t budget[SHOAL_PLAN_MAX_HOSTS];
    int W = 0;
    for (int i = 0; i < c.nhosts; i++)
        if (c.hosts[i].expert_ram)
            budget[W++] = c.hosts[i].expert_ram;
    int32_t owner[L * E];
    shoal_plan_in in = {.num_layers = L, .num_experts = E, .is_moe = moe, .expert_bytes = 100, .nworkers = W,
                        .budget = budget};
    if (shoal_plan_compute(&in, owner, err, sizeof err) == 0) {
        uint64_t *cnt = calloc((size_t)W, sizeof *cnt);
        for (int l = 0; l < L; l++)
            for (int e = 0; e < E; e++) {
                int w = owner[l * E + e];
                if (!moe[l] ? w != -1 : (w < 0 || w >= W))
                    abort();
                if (moe[l])
                    cnt[w]++;
            }
        for (int w = 0; w < W; w++)
            if (cnt[w] * 100 > budget[w])
                abort();
        int32_t replica[L * E];
        int nrep = 1 + (int)(size % 2);
        if (shoal_plan_replicate(&in, nrep, owner, replica, err, sizeof err) == 0) {
            for (int l = 0; l < L; l++) {
                int nl = 0;
                for (int e = 0; e < E; e++) {
                    int r = replica[l * E + e];
                    if (r < 0)
                        continue;
                    if (!moe[l] || r >= W || r == owner[l * E + e])
                        abort();
                    cnt[r]++;
                    nl++;
                }
                if (moe[l] && nl != nrep)
                    abort();
            }
            for (int w = 0; w < W; w++)
                if (cnt[w] * 100 > budget[w])
                    abort();
        } else if (!err[0]) {
            abort();
        }
        free(cnt);
    } else if (!err[0]) {
        abort();
    }
    /* redundancy: R = 1 or 2 (by the input's size), failure domains from
     * the manifest when it names any; accepted: every MoE expert on exactly
     * R + 1 workers in distinct domains, nothing else held, each within its
     * budget; refused: with a message */
    if (W > 0) {
        int R = 1 + (int)(size / 2 % 2), dom[SHOAL_PLAN_MAX_HOSTS], nd = 0, named = 0;
        char dn[SHOAL_PLAN_MAX_HOSTS][SHOAL_PLAN_MAX_NAME + 1];
        for (int i = 0, w = 0; i < c.nhosts; i++) {
            if (!c.hosts[i].expert_ram)
                continue;
            const char *d = c.hosts[i].domain[0] ? c.hosts[i].domain : c.hosts[i].name;
            named |= c.hosts[i].domain[0] != 0;
            dom[w] = -1;
            for (int j = 0; j < nd && dom[w] < 0; j++)
                if (!strcmp(dn[j], d))
                    dom[w] = j;
            if (dom[w] < 0) {
                strcpy(dn[nd], d);
                dom[w] = nd++;
            }
            w++;
        }
        uint8_t *hold = malloc((size_t)W * L * E);
        err[0] = 0;
        if (shoal_plan_redundant(&in, R, named ? dom : NULL, nd, hold, err, sizeof err) == 0) {
            for (int w = 0; w < W; w++) {
                uint64_t n = 0;
                for (int x = 0; x < L * E; x++)
                    n += hold[(size_t)w * L * E + x];
                if (n * 100 > budget[w])
                    abort();
            }
            for (int l = 0; l < L; l++)
                for (int e = 0; e < E; e++) {
                    int n = 0;
                    uint8_t seen[SHOAL_PLAN_MAX_HOSTS] = {0};
                    for (int w = 0; w < W; w++) {
                        if (!hold[(size_t)w * L * E + l * E + e])
                            continue;
                        int d = named ? dom[w] : w;
                        if (seen[d]++)
                            abort(); /* two copies in one domain */
                        n++;
                    }
                    if (moe[l] ? n != R + 1 : n != 0)
                        abort();
                }
        } else if (!err[0]) {
            abort();
        }
        free(hold);
    }
    shoal_plan_cluster_free(&c);
    return 0;
}
