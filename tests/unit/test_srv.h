/* An expert server (worker/expert_server.h) on a thread of the test binary,
 * for the client tests (test_expert_client, test_trunk_client): started on an
 * endpoint with its routed experts and/or trunk rows, stopped through its stop
 * flag. Header-only, like test.h. */
#ifndef SHOAL_TEST_SRV_H
#define SHOAL_TEST_SRV_H

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "worker/expert_server.h"

typedef struct {
    shoal_expert_server_opts o;
    volatile sig_atomic_t stop;
    int rc;
    char err[1024], ep[128], experts[256], trunk[256];
    pthread_t th;
    int running;
} test_srv;

static void *test_srv_main(void *arg)
{
    test_srv *s = arg;
    s->o.stop = &s->stop;
    s->rc = shoal_expert_server_run(&s->o, s->err, sizeof s->err);
    return NULL;
}

/* Serve model on ep: experts (LAYERS:EXPERTS) and/or trunk (a ROWSPEC), NULL
 * for none; delay_us before each reply (a slow worker). */
static void test_srv_start(test_srv *s, const char *model, const char *ep, const char *experts, const char *trunk,
                           unsigned delay_us)
{
    char e[sizeof s->ep];
    snprintf(e, sizeof e, "%s", ep); /* ep may be s->ep (a restart in place) */
    memset(s, 0, sizeof *s);
    snprintf(s->ep, sizeof s->ep, "%s", e);
    snprintf(s->experts, sizeof s->experts, "%s", experts ? experts : "");
    snprintf(s->trunk, sizeof s->trunk, "%s", trunk ? trunk : "");
    s->o = (shoal_expert_server_opts){.model = model,
                                      .experts = experts ? s->experts : NULL,
                                      .trunk = trunk ? s->trunk : NULL,
                                      .listen = s->ep,
                                      .threads = 1,
                                      .delay_us = delay_us,
                                      .max_tokens = 64};
    s->running = pthread_create(&s->th, NULL, test_srv_main, s) == 0;
}

static void test_srv_stop(test_srv *s)
{
    if (!s->running)
        return;
    s->stop = 1;
    pthread_join(s->th, NULL);
    s->running = 0;
}

#endif
