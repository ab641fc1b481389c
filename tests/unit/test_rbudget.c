/* rbudget: the worker's reply budget (worker/rbudget.h) -- bytes held per
 * peer and in total, with the limits computed here from the documented rule
 * (a reply is refused when its peer holds some and they plus it pass the
 * per-peer limit, or when some are held in all and they plus it pass the
 * total; a peer holding none may have one when nothing else blocks it),
 * releases from another thread (as ZeroMQ's I/O thread does), the refusal
 * naming the flag, and the table of peers filling up. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "common/err.h"
#include "tests/unit/test.h"
#include "worker/rbudget.h"

typedef struct {
    void *data, *hint;
} held;

static int take(shoal_rbudget *b, const char *peer, size_t len, held *h, char *why, size_t n)
{
    int rc = shoal_rbudget_alloc(b, (const uint8_t *)peer, strlen(peer), len, &h->data, &h->hint, why, n);
    if (!rc)
        memset(h->data, 0xab, len); /* the whole buffer is writable */
    return rc;
}

static void t_per_peer_and_total(void)
{
    shoal_rbudget *b;
    char err[256], why[512];
    shoal_rbudget_opts o = {.peer_bytes = 1000, .total_bytes = 2500, .wait_us = 0};
    CHECK(shoal_rbudget_open(&b, &o, err, sizeof err) == 0);
    held a[8], c[8];
    /* peer a: 400 + 400 fit (800 <= 1000), the third (1200) does not */
    CHECK(take(b, "a", 400, &a[0], why, sizeof why) == 0);
    CHECK(take(b, "a", 400, &a[1], why, sizeof why) == 0);
    CHECK(take(b, "a", 400, &a[2], why, sizeof why) == SHOAL_EBUSY);
    CHECK_STR_CONTAINS(why, "--peer-reply-mb");
    CHECK_STR_CONTAINS(why, "800 bytes");
    CHECK(shoal_rbudget_peer_held(b, (const uint8_t *)"a", 1) == 800);
    /* peer c holds none: one reply larger than its limit is admitted (1500 > 1000), total 2300 */
    CHECK(take(b, "c", 1500, &c[0], why, sizeof why) == 0);
    /* now c holds some: refused */
    CHECK(take(b, "c", 1, &c[1], why, sizeof why) == SHOAL_EBUSY);
    /* a third peer: 2300 + 300 > 2500 total: refused naming the total */
    CHECK(take(b, "d", 300, &c[2], why, sizeof why) == SHOAL_EBUSY);
    CHECK_STR_CONTAINS(why, "--reply-budget-mb");
    CHECK(take(b, "d", 200, &c[2], why, sizeof why) == 0); /* 2500: exactly the total */
    shoal_rbudget_stats st;
    shoal_rbudget_stats_get(b, &st);
    CHECK(st.held == 2500 && st.peak == 2500 && st.refused == 3 && st.admitted == 4);
    /* released (as ZeroMQ does after writing): the bytes come back */
    shoal_rbudget_release(a[0].data, a[0].hint);
    CHECK(shoal_rbudget_peer_held(b, (const uint8_t *)"a", 1) == 400);
    CHECK(take(b, "a", 700, &a[2], why, sizeof why) == SHOAL_EBUSY); /* a: 400 + 700 > 1000 */
    CHECK_STR_CONTAINS(why, "--peer-reply-mb");
    CHECK(take(b, "a", 600, &a[2], why, sizeof why) == SHOAL_EBUSY); /* a 1000 fits; total 2100 + 600 does not */
    CHECK_STR_CONTAINS(why, "--reply-budget-mb");
    shoal_rbudget_release(c[0].data, c[0].hint);
    CHECK(take(b, "a", 600, &a[2], why, sizeof why) == 0); /* a: 400 + 600 = 1000, total 1200 */
    shoal_rbudget_release(a[1].data, a[1].hint);
    shoal_rbudget_release(a[2].data, a[2].hint);
    shoal_rbudget_release(c[2].data, c[2].hint);
    shoal_rbudget_stats_get(b, &st);
    CHECK(st.held == 0);
    /* nothing held anywhere: any size is admitted (a mapped block) */
    CHECK(take(b, "e", 5u << 20, &a[3], why, sizeof why) == 0);
    CHECK(((uintptr_t)a[3].data & 63) == 0);
    shoal_rbudget_release(a[3].data, a[3].hint);
    shoal_rbudget_close(b);
}

typedef struct {
    held h;
} rel_arg;

static void *release_later(void *p)
{
    rel_arg *r = p;
    struct timespec ts = {0, 20 * 1000000L};
    nanosleep(&ts, NULL);
    shoal_rbudget_release(r->h.data, r->h.hint);
    return NULL;
}

/* a refusal waits up to wait_us for a release from another thread */
static void t_waits_for_release(void)
{
    shoal_rbudget *b;
    char err[256], why[512];
    shoal_rbudget_opts o = {.peer_bytes = 100, .total_bytes = 1000, .wait_us = 2000000};
    CHECK(shoal_rbudget_open(&b, &o, err, sizeof err) == 0);
    rel_arg r;
    held h2;
    CHECK(take(b, "p", 100, &r.h, why, sizeof why) == 0);
    pthread_t th;
    pthread_create(&th, NULL, release_later, &r);
    CHECK(take(b, "p", 100, &h2, why, sizeof why) == 0); /* admitted once the first is released */
    pthread_join(th, NULL);
    shoal_rbudget_release(h2.data, h2.hint);
    shoal_rbudget_close(b);
}

/* 256 peers holding replies: the 257th is refused, naming that; one releasing frees a slot */
static void t_peer_table_full(void)
{
    shoal_rbudget *b;
    char err[256], why[512], id[16];
    shoal_rbudget_opts o = {.peer_bytes = 100, .total_bytes = 1 << 20, .wait_us = 0};
    CHECK(shoal_rbudget_open(&b, &o, err, sizeof err) == 0);
    static held hs[257];
    for (int i = 0; i < 256; i++) {
        snprintf(id, sizeof id, "peer%d", i);
        CHECK(take(b, id, 10, &hs[i], why, sizeof why) == 0);
    }
    CHECK(take(b, "late", 10, &hs[256], why, sizeof why) == SHOAL_EBUSY);
    CHECK_STR_CONTAINS(why, "other connections hold unread replies");
    shoal_rbudget_release(hs[7].data, hs[7].hint);
    CHECK(take(b, "late", 10, &hs[256], why, sizeof why) == 0);
    for (int i = 0; i < 257; i++)
        if (i != 7)
            shoal_rbudget_release(hs[i].data, hs[i].hint);
    shoal_rbudget_close(b);
    CHECK(shoal_rbudget_open(&b, &(shoal_rbudget_opts){.peer_bytes = 0, .total_bytes = 1}, err, sizeof err) ==
          SHOAL_EINVAL);
    CHECK(b == NULL);
    shoal_rbudget_close(NULL);
}

int main(void)
{
    test_binary = "test_rbudget";
    RUN(t_per_peer_and_total);
    RUN(t_waits_for_release);
    RUN(t_peer_table_full);
    return test_finish();
}
