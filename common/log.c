#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int log_level = -1;

static int level_from_env(void)
{
    const char *s = getenv("KILN_LOG");
    if (!s)
        return KILN_LOG_INFO;
    if (!strcmp(s, "debug"))
        return KILN_LOG_DEBUG;
    if (!strcmp(s, "warn"))
        return KILN_LOG_WARN;
    if (!strcmp(s, "error"))
        return KILN_LOG_ERROR;
    return KILN_LOG_INFO;
}

void kiln_log_set_level(kiln_log_level level) { atomic_store(&log_level, (int)level); }

int kiln_log_enabled(kiln_log_level level)
{
    int cur = atomic_load(&log_level);
    if (cur < 0) {
        cur = level_from_env();
        atomic_store(&log_level, cur);
    }
    return (int)level >= cur;
}

void kiln_log(kiln_log_level level, const char *fmt, ...)
{
    if (!kiln_log_enabled(level))
        return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld [%s] ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, names[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
    (void)w; /* nothing useful to do if stderr is gone */
}

double kiln_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}
