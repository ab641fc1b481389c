/* Logging: one line per event on stderr, "pid role time level message"
 * (role "C" for the coordinator, "W<n>" for worker n). Hot paths update
 * counters instead of logging. Thread-safe (one fprintf per line). */
#ifndef SHOAL_LOG_H
#define SHOAL_LOG_H

typedef enum { SHOAL_LOG_DEBUG, SHOAL_LOG_INFO, SHOAL_LOG_WARN, SHOAL_LOG_ERROR } shoal_log_level;

void shoal_log_set_role(const char *role);     /* copied; default "-" */
void shoal_log_set_level(shoal_log_level min); /* default INFO; SHOAL_LOG=debug at startup */
void shoal_log(shoal_log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define SHOAL_DEBUG(...) shoal_log(SHOAL_LOG_DEBUG, __VA_ARGS__)
#define SHOAL_INFO(...) shoal_log(SHOAL_LOG_INFO, __VA_ARGS__)
#define SHOAL_WARN(...) shoal_log(SHOAL_LOG_WARN, __VA_ARGS__)
#define SHOAL_ERROR(...) shoal_log(SHOAL_LOG_ERROR, __VA_ARGS__)

#endif
