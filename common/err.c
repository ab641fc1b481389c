#include "common/err.h"

#include "common/utf8.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *shoal_err_name(int code)
{
    switch (code) {
#define SHOAL_ERR_NAME(name, val, msg)                                      \
    case -(val):                                                            \
        return "E_" #name;
        SHOAL_ERRNO_MAP(SHOAL_ERR_NAME)
#undef SHOAL_ERR_NAME
    default:
        break;
    }
    if (code == 0)
        return "OK";
    return code < 0 ? strerrorname_np(-code) ? strerrorname_np(-code) : "E?" : "E?";
}

const char *shoal_strerror(int code)
{
    switch (code) {
#define SHOAL_ERR_MSG(name, val, msg)                                       \
    case -(val):                                                            \
        return msg;
        SHOAL_ERRNO_MAP(SHOAL_ERR_MSG)
#undef SHOAL_ERR_MSG
    default:
        break;
    }
    if (code == 0)
        return "success";
    return code < 0 ? strerror(-code) : "unknown error";
}

int shoal_err_set(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        int w = vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
        if (w >= 0 && (size_t)w >= errlen) { /* cut to fit: never in the middle of a character */
            size_t n = strlen(err), j = n;
            while (j > 0 && n - j < 3 && ((unsigned char)err[j - 1] & 0xC0) == 0x80)
                j--;
            uint32_t cp;
            if (j > 0 && (unsigned char)err[j - 1] >= 0xC0 &&
                shoal_utf8_step((const uint8_t *)err + j - 1, n - (j - 1), &cp) == 0)
                err[j - 1] = 0;
        }
    }
    return code;
}

void shoal__panic(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "shoal: fatal at %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    abort();
}

void *shoal_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        SHOAL_PANIC("out of memory allocating %zu bytes", n);
    return p;
}

void *shoal_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        SHOAL_PANIC("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

void *shoal_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        SHOAL_PANIC("out of memory reallocating %zu bytes", n);
    return q;
}

char *shoal_xstrdup(const char *s)
{
    char *p = strdup(s);
    if (!p)
        SHOAL_PANIC("out of memory duplicating a string");
    return p;
}

int shoal_read_stream(FILE *f, size_t max, char **buf, size_t *len)
{
    size_t n = 0, cap = 0;
    char *b = NULL;
    *buf = NULL;
    for (;;) {
        if (cap - n < 65536) {
            cap = cap ? 2 * cap : 65536;
            b = shoal_xrealloc(b, cap + 1);
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (max && n > max) {
            free(b);
            return -EFBIG;
        }
        if (r == 0)
            break;
    }
    if (ferror(f)) {
        free(b);
        return SHOAL_EIO;
    }
    b[n] = 0;
    *buf = b;
    *len = n;
    return 0;
}

int shoal_err_exit_code(int code)
{
    switch (code) {
    case 0:
        return 0;
    case SHOAL_EINVAL:
        return 2;
    case SHOAL_EFORMAT:
    case SHOAL_ERANGE:
    case SHOAL_EMODEL:
    case SHOAL_ECONFIG:
    case SHOAL_EVERSION:
    case SHOAL_EFINGERPRINT:
        return 3;
    default:
        return 4;
    }
}

int shoal_open_regular(const char *path, int flags)
{
    int fd = open(path, flags | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct stat sb;
    if (fstat(fd, &sb) < 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return SHOAL_EFORMAT;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    return fd;
}

FILE *shoal_fopen_regular(const char *path, int *rc)
{
    int fd = shoal_open_regular(path, O_RDONLY);
    if (fd < 0) {
        *rc = fd;
        return NULL;
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        *rc = -errno;
        close(fd);
    }
    return f;
}
