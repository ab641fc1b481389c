/* Error codes for the whole tree: one X-macro table generates the enum, the
 * names and the messages. Fallible functions return 0 or a negative code from
 * this table, or -errno for system errors. Every module that reports detail
 * writes a message into a caller-provided (char *err, size_t errlen) buffer. */
#ifndef SHOAL_ERR_H
#define SHOAL_ERR_H

#include <stddef.h>
#include <stdio.h>

#define SHOAL_ERRNO_MAP(X)                                                   \
    X(INVAL, 1000, "invalid argument")                                       \
    X(FORMAT, 1001, "malformed input")                                       \
    X(RANGE, 1002, "value out of range")                                     \
    X(NOTFOUND, 1003, "not found")                                           \
    X(MODEL, 1004, "invalid model")                                          \
    X(CONFIG, 1005, "invalid configuration")                                 \
    X(NOMEM, 1006, "out of memory")                                          \
    X(IO, 1007, "input/output error")                                        \
    X(PROTO, 1008, "protocol violation")                                     \
    X(VERSION, 1009, "version mismatch")                                     \
    X(FINGERPRINT, 1010, "model fingerprint mismatch")                       \
    X(TIMEOUT, 1011, "deadline exceeded")                                    \
    X(PEER, 1012, "peer failed")                                             \
    X(UNSUPPORTED, 1013, "unsupported")                                      \
    X(BUSY, 1014, "resource busy")                                           \
    X(CANCELED, 1015, "canceled")                                            \
    X(INTERNAL, 1016, "internal error")

typedef enum {
#define SHOAL_ERR_ENUM(name, val, msg) SHOAL_E##name = -(val),
    SHOAL_ERRNO_MAP(SHOAL_ERR_ENUM)
#undef SHOAL_ERR_ENUM
} shoal_errcode;

/* Short name ("E_FORMAT", "ENOENT") and message for any code (table or -errno). */
const char *shoal_err_name(int code);
const char *shoal_strerror(int code);

/* snprintf into err (if non-NULL) and return code; for one-line error returns:
 *   return shoal_err_set(err, errlen, SHOAL_EFORMAT, "%s: header too long", path); */
int shoal_err_set(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Abort with file:line on a broken invariant or out-of-memory (never on input). */
#define SHOAL_PANIC(...) shoal__panic(__FILE__, __LINE__, __VA_ARGS__)
void shoal__panic(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));

/* malloc/calloc/realloc that panic on OOM (inside an engine forward they are
 * also caught by the engine's allocation guard, coordinator/engine/allocguard.c). */
void *shoal_xmalloc(size_t n);
void *shoal_xcalloc(size_t n, size_t size);
void *shoal_xrealloc(void *p, size_t n);
char *shoal_xstrdup(const char *s);

/* Read the rest of f into a new NUL-terminated buffer (*len bytes before the
 * NUL). Returns 0, -EFBIG when it holds more than max bytes (0: no limit), or
 * SHOAL_EIO on a read error; on error *buf is NULL. f stays open. */
int shoal_read_stream(FILE *f, size_t max, char **buf, size_t *len);

/* The process exit code for an error code, the one table every command uses
 * (docs/CONFIG.md, "Exit codes"): SHOAL_EINVAL (a usage mistake: a bad or
 * conflicting flag, a value out of its range, an unreadable or malformed file
 * named by a flag such as a key file) -> 2; an invalid model, config, manifest
 * or plan, or a model/version/ownership mismatch with the workers
 * (SHOAL_EFORMAT, ERANGE, EMODEL, ECONFIG, EVERSION, EFINGERPRINT) -> 3;
 * anything else (could not listen, a worker failed or timed out, I/O) -> 4. */
int shoal_err_exit_code(int code);

/* open(2) a path that must be a regular file, without ever blocking on it: a
 * FIFO or a device would block open() or the first read forever, so the file
 * is opened O_NONBLOCK, checked with fstat, and only then made blocking again.
 * flags: O_RDONLY plus e.g. O_DIRECT (O_CLOEXEC is always added). Returns the
 * fd, -errno, or SHOAL_EFORMAT when the path is not a regular file. */
int shoal_open_regular(const char *path, int flags);

/* fopen(path, "rb") through shoal_open_regular: NULL with *rc set on error. */
FILE *shoal_fopen_regular(const char *path, int *rc);

#endif
