/* A minimal test harness: each test program is one meson test made of
 * several TEST functions; a failed CHECK prints where and why and marks the
 * program failed, so one run reports every broken expectation.
 *
 *   static void test_add(void) { CHECK(1 + 1 == 2); CHECK_NEAR(x, 1.0, 1e-6); }
 *   int main(void) { RUN(test_add); return test_finish(); }
 */
#ifndef KILN_TEST_H
#define KILN_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_failures;
static int test_checks;

#define CHECK(cond)                                                                       \
    do {                                                                                  \
        test_checks++;                                                                    \
        if (!(cond)) {                                                                    \
            test_failures++;                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);       \
        }                                                                                 \
    } while (0)

#define CHECKF(cond, ...)                                                                 \
    do {                                                                                  \
        test_checks++;                                                                    \
        if (!(cond)) {                                                                    \
            test_failures++;                                                              \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);       \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fputc('\n', stderr);                                                          \
        }                                                                                 \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                             \
    CHECKF(fabs((double)(a) - (double)(b)) <= (tol), "%.9g vs %.9g (tol %g)", (double)(a), \
           (double)(b), (double)(tol))

#define RUN(fn)                                                                           \
    do {                                                                                  \
        int before_ = test_failures;                                                      \
        fn();                                                                             \
        fprintf(stderr, "%s %s\n", test_failures == before_ ? "ok  " : "FAIL", #fn);       \
    } while (0)

static inline int test_finish(void)
{
    fprintf(stderr, "%d checks, %d failed\n", test_checks, test_failures);
    return test_failures ? 1 : 0;
}

/* ||a - b|| / ||b|| over n floats (0 when both are zero). */
static inline double test_rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * (double)b[i];
        if (a[i] != a[i])
            return INFINITY;
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

#endif
