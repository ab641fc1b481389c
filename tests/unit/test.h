/* Minimal test harness shared by every unit test binary (header-only).
 *
 *   static void t_something(void) { CHECK(x == 1); CHECK_NEAR(a, b, 1e-6); }
 *   int main(void) { RUN(t_something); ...; return test_finish(); }
 *
 * A case calls SKIP("why") to stop and count as skipped (never as passed).
 * Every case appends "PASS|FAIL|SKIP<TAB>binary<TAB>case[: reason]" to the file
 * named by $SHOAL_TEST_RESULTS (scripts/test.sh totals them). test_finish()
 * returns 1 on any failure, 77 (CTest's skip code) when every case skipped,
 * else 0. Test paths come from $SHOAL_SRC (the source tree). */
#ifndef SHOAL_TEST_H
#define SHOAL_TEST_H

#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_npass, test_nfail, test_nskip;
static int test_case_failed;
static const char *test_case_name;
static jmp_buf test_skip_jmp;
static char test_skip_reason[512];
static const char *test_binary = "test";

static void test_record(const char *status, const char *name, const char *extra)
{
    const char *path = getenv("SHOAL_TEST_RESULTS");
    printf("%s %s%s%s\n", status, name, extra ? ": " : "", extra ? extra : "");
    fflush(stdout);
    if (!path)
        return;
    FILE *f = fopen(path, "a");
    if (!f)
        return;
    fprintf(f, "%s\t%s\t%s%s%s\n", status, test_binary, name, extra ? ": " : "", extra ? extra : "");
    fclose(f);
}

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);  \
            test_case_failed = 1;                                                       \
        }                                                                               \
    } while (0)

#define CHECK_MSG(cond, ...)                                                            \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "  %s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);  \
            fprintf(stderr, __VA_ARGS__);                                               \
            fputc('\n', stderr);                                                        \
            test_case_failed = 1;                                                       \
        }                                                                               \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                              \
    do {                                                                                \
        long long va_ = (long long)(a), vb_ = (long long)(b);                           \
        if (va_ != vb_) {                                                               \
            fprintf(stderr, "  %s:%d: %s == %s failed: %lld != %lld\n", __FILE__,       \
                    __LINE__, #a, #b, va_, vb_);                                        \
            test_case_failed = 1;                                                       \
        }                                                                               \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                           \
    do {                                                                                \
        double va_ = (double)(a), vb_ = (double)(b);                                    \
        if (!(fabs(va_ - vb_) <= (tol))) {                                              \
            fprintf(stderr, "  %s:%d: |%s - %s| <= %g failed: %.9g vs %.9g\n",          \
                    __FILE__, __LINE__, #a, #b, (double)(tol), va_, vb_);               \
            test_case_failed = 1;                                                       \
        }                                                                               \
    } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                                 \
    do {                                                                                \
        const char *h_ = (hay), *n_ = (needle);                                         \
        if (!h_ || !strstr(h_, n_)) {                                                   \
            fprintf(stderr, "  %s:%d: expected \"%s\" in \"%s\"\n", __FILE__, __LINE__, \
                    n_, h_ ? h_ : "(null)");                                            \
            test_case_failed = 1;                                                       \
        }                                                                               \
    } while (0)

#define SKIP(...)                                                                       \
    do {                                                                                \
        snprintf(test_skip_reason, sizeof test_skip_reason, __VA_ARGS__);               \
        longjmp(test_skip_jmp, 1);                                                      \
    } while (0)

#define RUN(fn)                                                                         \
    do {                                                                                \
        test_case_failed = 0;                                                           \
        test_case_name = #fn;                                                           \
        if (setjmp(test_skip_jmp) == 0) {                                               \
            fn();                                                                       \
            if (test_case_failed) {                                                     \
                test_nfail++;                                                           \
                test_record("FAIL", #fn, NULL);                                         \
            } else {                                                                    \
                test_npass++;                                                           \
                test_record("PASS", #fn, NULL);                                         \
            }                                                                           \
        } else {                                                                        \
            test_nskip++;                                                               \
            test_record("SKIP", #fn, test_skip_reason);                                 \
        }                                                                               \
    } while (0)

/* Absolute path of a file in the source tree ($SHOAL_SRC, else "."). */
static inline const char *test_src_path(const char *rel)
{
    static char buf[8][4096];
    static int slot;
    const char *src = getenv("SHOAL_SRC");
    char *b = buf[slot++ & 7];
    snprintf(b, sizeof buf[0], "%s/%s", src ? src : ".", rel);
    return b;
}

/* The directory of K3's real tokenizer files (tiktoken.model and
 * tokenizer_config.json): $SHOAL_K3_TOKENIZER_DIR when set, else the shared copy
 * beside the checkout ($SHOAL_SRC/../shared/k3) when it holds tiktoken.model,
 * else NULL (the caller skips, saying how to provide it). */
static inline const char *test_k3_tokenizer_dir(void)
{
    const char *dir = getenv("SHOAL_K3_TOKENIZER_DIR");
    if (dir && *dir)
        return dir;
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s", test_src_path("../shared/k3"));
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/tiktoken.model", buf);
    FILE *f = fopen(probe, "rb");
    if (!f)
        return NULL;
    fclose(f);
    return buf;
}

static inline int test_finish(void)
{
    printf("%d passed, %d failed, %d skipped\n", test_npass, test_nfail, test_nskip);
    if (test_nfail)
        return 1;
    if (test_npass == 0 && test_nskip > 0)
        return 77;
    return 0;
}

#endif
