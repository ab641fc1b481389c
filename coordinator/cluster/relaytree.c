/* The latency-aware relay schedule (relaytree.h). */
#include "coordinator/cluster/relaytree.h"

#include <math.h>

int shoal_relaytree_greedy(shoal_relaytree *t, int G, double xb, double nic_Bps, double peer_Bps, double hop_s,
                           int max_sub)
{
    if (G < 1 || G > SHOAL_RELAYTREE_MAX || !(xb > 0) || !(nic_Bps > 0) || !(peer_Bps > 0) || !(hop_s >= 0) ||
        !isfinite(xb / nic_Bps) || !isfinite(xb / peer_Bps) || !isfinite(hop_s) || max_sub < 1)
        return -1;
    const double c = xb / nic_Bps, d = xb / peer_Bps;
    int sub[SHOAL_RELAYTREE_MAX]; /* members of root r's subtree, at index r */
    t->n = G;
    t->direct = 0;
    t->levels = 1;
    t->last = 0;
    for (int i = 0; i < G; i++) {
        /* the coordinator's next send; then each server served so far, in the
         * order they were served: strictly earlier wins, so ties go to the
         * coordinator, then to the earliest-served server */
        double best = (double)(t->direct + 1) * c;
        int by = -1;
        for (int p = 0; p < i; p++) {
            if (sub[t->root[p]] >= max_sub)
                continue;
            double when = t->arrival[p] + (double)(t->nkids[p] + 1) * d + hop_s;
            if (when < best) {
                best = when;
                by = p;
            }
        }
        t->parent[i] = (short)by;
        t->nkids[i] = 0;
        t->arrival[i] = best;
        if (by < 0) {
            t->order[i] = (short)++t->direct;
            t->root[i] = (short)i;
            t->level[i] = 1;
            sub[i] = 0;
        } else {
            t->order[i] = ++t->nkids[by];
            t->root[i] = t->root[by];
            t->level[i] = (short)(t->level[by] + 1);
            sub[t->root[i]]++;
        }
        t->levels = t->level[i] > t->levels ? t->level[i] : t->levels;
        t->last = best > t->last ? best : t->last;
    }
    return 0;
}
