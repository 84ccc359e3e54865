/* A checker of the Prometheus text exposition format (version 0.0.4) with
 * the rules `promtool check metrics` applies, for tests of /metrics:
 *
 *   char why[256];
 *   if (prom_lint(text, why, sizeof why)) CHECKF(0, "%s", why);
 *
 * Lines: `# HELP name text`, `# TYPE name counter|gauge|histogram|summary|
 * untyped`, other comments, or samples `name{label="value",...} value
 * [timestamp]`.  Rules: valid metric and label names, quoted label values
 * with only \\, \" and \n escapes; HELP and TYPE at most once per family,
 * TYPE before its samples; a family's samples together; no series twice;
 * counters named *_total (promtool's lint); a histogram's samples are
 * _bucket (with le), _sum and _count, its buckets cumulative in le order
 * and its +Inf bucket equal to _count.  Not thread-safe (static state). */
#ifndef KILN_TEST_PROM_LINT_H
#define KILN_TEST_PROM_LINT_H

#include <stddef.h>

/* 0 when the text passes; else -1 with the first problem (and its line)
 * in why. */
int prom_lint(const char *text, char *why, size_t cap);

#endif
