/* kiln logging: leveled lines on stderr, one write per line.
 *
 *   kiln_log_set_level(KILN_LOG_DEBUG);
 *   KILN_LOG_INFO("loaded %s in %.1f ms", name, ms);
 *
 * Thread-safe: each line is formatted into a local buffer and written with a
 * single write(2).  The level is process-wide configuration (set once at
 * start-up), not error state.  KILN_LOG env var ("debug", "info", "warn",
 * "error") sets the initial level.
 */
#ifndef KILN_LOG_H
#define KILN_LOG_H

typedef enum kiln_log_level {
    KILN_LOG_DEBUG = 0,
    KILN_LOG_INFO,
    KILN_LOG_WARN,
    KILN_LOG_ERROR,
} kiln_log_level;

void kiln_log_set_level(kiln_log_level level);
int kiln_log_enabled(kiln_log_level level);
void kiln_log(kiln_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define KILN_LOG_DEBUG(...) kiln_log(KILN_LOG_DEBUG, __VA_ARGS__)
#define KILN_LOG_INFO(...) kiln_log(KILN_LOG_INFO, __VA_ARGS__)
#define KILN_LOG_WARN(...) kiln_log(KILN_LOG_WARN, __VA_ARGS__)
#define KILN_LOG_ERROR(...) kiln_log(KILN_LOG_ERROR, __VA_ARGS__)

/* Monotonic clock in milliseconds, for timings in logs and metrics. */
double kiln_now_ms(void);

#endif
