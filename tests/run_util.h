/* Running the real kiln binaries from tests: fork + exec with stderr (and,
 * where asked, stdout) captured, so end-to-end tests exercise exactly what
 * a user runs.
 *
 *   const char *argv[] = {NULL, "tokenize", "--text", "A cat", NULL};
 *   int rc = test_run(test_build_path("tools/kiln"), argv, log, sizeof log);
 */
#ifndef KILN_TESTS_RUN_UTIL_H
#define KILN_TESTS_RUN_UTIL_H

#include <stddef.h>

/* Path of a built executable ("tools/kiln") under $KILN_BUILD_ROOT, in a
 * static buffer. */
const char *test_build_path(const char *rel);

/* Runs `exe` with argv (NULL-terminated; argv[0] is replaced by exe) and
 * waits.  Its stderr goes to `log` (NUL-terminated, truncated to len).
 * Returns the exit status, or -1 when it did not exit normally. */
int test_run(const char *exe, const char **argv, char *log, size_t len);

/* As test_run, and the program's stdout goes to `out` (NUL-terminated,
 * truncated to out_len) instead of the test's own stdout. */
int test_run_capture(const char *exe, const char **argv, char *out, size_t out_len, char *log,
                     size_t len);

#endif
