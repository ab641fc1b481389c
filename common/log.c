#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static char log_role[16] = "-";
static int log_min = -1;

void shoal_log_set_role(const char *role)
{
    snprintf(log_role, sizeof log_role, "%s", role ? role : "-");
}

void shoal_log_set_level(shoal_log_level min)
{
    log_min = (int)min;
}

static int effective_min(void)
{
    if (log_min < 0) {
        /* SHOAL_LOG is a debug switch; read once, here only. */
        const char *e = getenv("SHOAL_LOG");
        log_min = SHOAL_LOG_INFO;
        if (e && !strcmp(e, "debug"))
            log_min = SHOAL_LOG_DEBUG;
        else if (e && !strcmp(e, "warn"))
            log_min = SHOAL_LOG_WARN;
        else if (e && !strcmp(e, "error"))
            log_min = SHOAL_LOG_ERROR;
    }
    return log_min;
}

void shoal_log(shoal_log_level lvl, const char *fmt, ...)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    if ((int)lvl < effective_min())
        return;
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    char ts[32];
    strftime(ts, sizeof ts, "%H:%M:%S", &tm);
    fprintf(stderr, "%d %s %s.%03ld %s %s\n", (int)getpid(), log_role, ts, (long)(tv.tv_usec / 1000),
            names[lvl], msg);
}
