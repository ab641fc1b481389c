/* common/: error table, exit codes, opening regular files, bf16 conversions. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/st.h"
#include "common/strmap.h"
#include "common/utf8.h"
#include "test.h"

static void t_err_table(void)
{
    CHECK(!strcmp(shoal_err_name(SHOAL_EFORMAT), "E_FORMAT"));
    CHECK(!strcmp(shoal_strerror(SHOAL_ETIMEOUT), "deadline exceeded"));
    CHECK(!strcmp(shoal_strerror(-ENOENT), strerror(ENOENT)));
    char buf[64];
    CHECK_EQ_INT(shoal_err_set(buf, sizeof buf, SHOAL_ERANGE, "x=%d", 7), SHOAL_ERANGE);
    CHECK(!strcmp(buf, "x=7"));
}

static void t_bf16_round_trip(void)
{
    /* bf16 -> f32 -> bf16 is the identity for every non-NaN pattern */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = shoal_bf16_to_f32((uint16_t)h);
        if (isnan(f)) {
            CHECK(isnan(shoal_bf16_to_f32(shoal_f32_to_bf16(f))));
            continue;
        }
        CHECK(shoal_f32_to_bf16(f) == h);
    }
    /* round to nearest even at the halfway point: 1 + 2^-8 is halfway between
     * 1 and 1 + 2^-7 -> 1 (even); 1 + 3*2^-8 -> 1 + 2^-6 */
    CHECK(shoal_round_bf16(1.0f + 0x1p-8f) == 1.0f);
    CHECK(shoal_round_bf16(1.0f + 3 * 0x1p-8f) == 1.0f + 0x1p-6f);
    CHECK(shoal_round_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 1.0f + 0x1p-7f);
}

/* ---- shoal_utf8_clean: the one helper outside text goes through (issue 20) */

#define FFFD "\xEF\xBF\xBD"
static void check_clean(const char *src, size_t n, size_t cap, unsigned flags, const char *want, int want_cut)
{
    char dst[256];
    int cut = -1;
    size_t k = shoal_utf8_clean(dst, cap, src, n, flags, &cut);
    CHECK_MSG(k == strlen(want) && !memcmp(dst, want, k + 1) && cut == want_cut,
              "cap %zu: got '%s' (%zu bytes, cut %d), want '%s' (cut %d)", cap, dst, k, cut, want, want_cut);
    CHECK(shoal_utf8_valid(dst, k));
}

/* 63 ASCII letters then "é" into a 64-byte (63 + NUL) buffer: the é (2 bytes)
 * does not fit whole and is left out, not cut in half -- the message-builder
 * defect of issue 20 item 1. */
static void t_utf8_clean_cut_on_boundary(void)
{
    char src[80];
    memset(src, 'a', 63);
    memcpy(src + 63, "\xC3\xA9", 3);
    char want[64];
    memset(want, 'a', 63);
    want[63] = '\0';
    check_clean(src, 65, 64, 0, want, 1);
    check_clean(src, 65, 66, 0, src, 0); /* room for 65 + NUL: whole */
    check_clean("\xE2\x82\xAC\xE2\x82\xAC", 6, 6, 0, "\xE2\x82\xAC", 1); /* 2nd euro needs 3, 2 left */
    check_clean("\xF0\x9F\xA6\x89", 4, 4, 0, "", 1);
    check_clean("abc", 3, 1, 0, "", 1);
    check_clean("abcdefgh", 8, 8, SHOAL_UTF8_MARK, "abcd...", 1);
    check_clean("abcdefg", 7, 8, SHOAL_UTF8_MARK, "abcdefg", 0);
}

/* shoal_err_set cuts a message that does not fit on a character boundary
 * (error texts carry paths, hosts and peers' words into JSON and logs) */
static void t_err_set_cut_on_boundary(void)
{
    char b[8];
    /* 7 bytes of room: "aaaaa" + 2 of the euro's 3: the euro is left out */
    CHECK_EQ_INT(shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "aaaaa\xE2\x82\xAC"), SHOAL_EIO);
    CHECK(!strcmp(b, "aaaaa"));
    shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "aaaa\xE2\x82\xAC!"); /* the euro fits whole: kept */
    CHECK(!strcmp(b, "aaaa\xE2\x82\xAC"));
    shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "aaaaaa\xF0\x9F\xA6\x89"); /* 1 byte of 4 */
    CHECK(!strcmp(b, "aaaaaa"));
    shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "\xF0\x9F\xA6\x89\xF0\x9F\xA6\x89"); /* 3 of the 2nd's 4 */
    CHECK(!strcmp(b, "\xF0\x9F\xA6\x89"));
    shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "abcdefg\xE2\x82\xAC"); /* cut on a boundary already */
    CHECK(!strcmp(b, "abcdefg"));
    shoal_err_set(b, sizeof b, SHOAL_EIO, "%s", "abcde\xff\xff"); /* invalid bytes are not its business */
    CHECK(!strcmp(b, "abcde\xff\xff"));
}

static void t_utf8_clean_replaces_invalid(void)
{
    check_clean("/\xff", 2, 64, 0, "/" FFFD, 0);
    check_clean("a\xC3", 2, 64, 0, "a" FFFD, 0);           /* truncated sequence at the end */
    check_clean("\xED\xA0\x80x", 4, 64, 0, FFFD FFFD FFFD "x", 0); /* surrogate: 3 subparts */
    check_clean("a\0b", 3, 64, 0, "a" FFFD "b", 0);         /* NUL never survives */
    check_clean("\xff\xff", 2, 4, 0, FFFD, 1);              /* a replacement is not cut either */
    check_clean(NULL, 0, 8, 0, "", 0);
}

static void t_utf8_clean_controls_for_logs(void)
{
    check_clean("a\nb\r\x1b[0m\x7f", 9, 64, SHOAL_UTF8_NOCTRL, "a\\x0ab\\x0d\\x1b[0m\\x7f", 0);
    check_clean("\xC2\x85", 2, 64, SHOAL_UTF8_NOCTRL, "\\x85", 0); /* C1 NEL */
    check_clean("a\tb", 3, 64, 0, "a\tb", 0);                       /* kept without the flag */
    check_clean("\xC3\xA9\n", 3, 64, SHOAL_UTF8_NOCTRL, "\xC3\xA9\\x0a", 0);
}

/* issue 20 item 6: a FIFO (or a directory) is refused without blocking */
static void t_open_regular_fifo(void)
{
    char dir[] = "/tmp/shoal-test-common-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char fifo[64], reg[64];
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    snprintf(reg, sizeof reg, "%s/file", dir);
    CHECK(mkfifo(fifo, 0600) == 0);
    FILE *f = fopen(reg, "w");
    CHECK(f && fputs("hello", f) >= 0 && fclose(f) == 0);
    alarm(10); /* a regression would block in open(); fail loudly instead of hanging ctest */
    CHECK(shoal_open_regular(fifo, O_RDONLY) == SHOAL_EFORMAT);
    CHECK(shoal_open_regular(dir, O_RDONLY) == SHOAL_EFORMAT);
    CHECK(shoal_open_regular("/nonexistent/x", O_RDONLY) == -ENOENT);
    int rc = 0;
    CHECK(shoal_fopen_regular(fifo, &rc) == NULL && rc == SHOAL_EFORMAT);
    alarm(0);
    int fd = shoal_open_regular(reg, O_RDONLY);
    CHECK(fd >= 0);
    if (fd >= 0) {
        CHECK((fcntl(fd, F_GETFL) & O_NONBLOCK) == 0); /* blocking again, as a caller expects */
        char b[8] = {0};
        CHECK(read(fd, b, sizeof b) == 5 && !memcmp(b, "hello", 5));
        close(fd);
    }
    unlink(fifo);
    unlink(reg);
    rmdir(dir);
}

/* the exit-code table (docs/CONFIG.md, "Exit codes") */
static void t_exit_codes(void)
{
    CHECK(shoal_err_exit_code(0) == 0);
    CHECK(shoal_err_exit_code(SHOAL_EINVAL) == 2);
    const int three[] = {SHOAL_EFORMAT, SHOAL_ERANGE, SHOAL_EMODEL, SHOAL_ECONFIG, SHOAL_EVERSION, SHOAL_EFINGERPRINT};
    for (size_t i = 0; i < sizeof three / sizeof three[0]; i++)
        CHECK(shoal_err_exit_code(three[i]) == 3);
    const int four[] = {SHOAL_EIO, SHOAL_ETIMEOUT, SHOAL_EPEER, SHOAL_EPROTO, SHOAL_EINTERNAL, -EADDRINUSE, -ENOENT};
    for (size_t i = 0; i < sizeof four / sizeof four[0]; i++)
        CHECK(shoal_err_exit_code(four[i]) == 4);
}

/* strmap (issue 30): put keeps the first value, get finds every key (binary
 * ones, the empty one, keys differing only in the last byte), through growth */
static void t_strmap(void)
{
    shoal_strmap *m = shoal_strmap_new();
    static char keys[20000][12];
    int n = 20000;
    for (int i = 0; i < n; i++) {
        snprintf(keys[i], sizeof keys[i], "k%d", i);
        keys[i][11] = (char)i; /* a byte past the NUL: never part of the key */
    }
    for (int i = 0; i < n; i++)
        CHECK_EQ_INT(shoal_strmap_put(m, keys[i], strlen(keys[i]), (size_t)i, NULL), 1);
    size_t old = 0;
    CHECK_EQ_INT(shoal_strmap_put(m, "k7", 2, 99, &old), 0);
    CHECK_EQ_INT((int)old, 7);
    CHECK_EQ_INT(shoal_strmap_put(m, "", 0, 5, NULL), 1);
    CHECK_EQ_INT(shoal_strmap_put(m, NULL, 0, 6, &old), 0);
    CHECK_EQ_INT((int)old, 5);
    static const char bin[] = {'a', 0, 'b'};
    CHECK_EQ_INT(shoal_strmap_put(m, bin, 3, 42, NULL), 1);
    CHECK_EQ_INT(shoal_strmap_put(m, bin, 1, 43, NULL), 1); /* "a" is another key */
    int bad = 0;
    for (int i = 0; i < n; i++) {
        size_t v;
        bad += !shoal_strmap_get(m, keys[i], strlen(keys[i]), &v) || v != (size_t)i;
    }
    CHECK_EQ_INT(bad, 0);
    size_t v = 0;
    CHECK(shoal_strmap_get(m, bin, 3, &v) && v == 42);
    CHECK(shoal_strmap_get(m, "a", 1, &v) && v == 43);
    CHECK(!shoal_strmap_get(m, "k20000", 6, NULL) && !shoal_strmap_get(m, "k1x", 3, NULL));
    shoal_strmap_set(m, "k1", 2, 1000);
    CHECK(shoal_strmap_get(m, "k1", 2, &v) && v == 1000);
    CHECK_EQ_INT((int)shoal_strmap_count(m), n + 3);
    shoal_strmap_free(m);
    shoal_strmap_free(NULL);
}

int main(void)
{
    test_binary = "test_common";
    RUN(t_strmap);
    RUN(t_open_regular_fifo);
    RUN(t_exit_codes);
    RUN(t_err_table);
    RUN(t_utf8_clean_cut_on_boundary);
    RUN(t_utf8_clean_replaces_invalid);
    RUN(t_err_set_cut_on_boundary);
    RUN(t_utf8_clean_controls_for_logs);
    RUN(t_bf16_round_trip);
    return test_finish();
}
