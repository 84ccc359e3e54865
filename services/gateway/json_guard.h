/* kiln JSON pre-scan: a bounded pass over a request body's raw text before
 * cJSON parses it, because cJSON offers no hooks to limit what it builds
 * and silently truncates strings at an escaped NUL.
 *
 *   kiln_json_guard_limits lim = {.max_nodes = 1024, .max_depth = 16};
 *   char field[32];
 *   if (kiln_json_guard(body, len, &lim, field, sizeof field, &err))
 *       -> 400 with err.msg, param `field` ("" when no field is to blame)
 *   cJSON *root = cJSON_ParseWithLength(body, len);
 *
 * It refuses a body whose values would make more than
 * max_nodes cJSON nodes (objects, arrays, strings, numbers, literals: the
 * memory cJSON allocates grows with them, about 64 bytes each, so a small
 * body of "[1,1,1,...]" cannot cost the gateway gigabytes), nesting deeper
 * than max_depth, a string holding a raw control character (RFC 8259
 * forbids them) or an escaped NUL (\u0000, which cJSON's C strings would
 * cut short).  A refusal names the top-level field whose value holds the
 * fault.  Syntax errors the scan does not need to see are left to cJSON.
 *
 * Pure and thread-safe; one pass, no allocation.
 */
#ifndef KILN_GW_JSON_GUARD_H
#define KILN_GW_JSON_GUARD_H

#include <stddef.h>

#include "common/error.h"

typedef struct kiln_json_guard_limits {
    int max_nodes;
    int max_depth;
} kiln_json_guard_limits;

/* KILN_OK, or with err set and `field` (field_cap bytes, always
 * NUL-terminated) naming the top-level key at fault ("" when none):
 * KILN_ERR_INVALID for an escaped NUL (valid JSON, a refused value),
 * KILN_ERR_FORMAT for the rest (not JSON kiln reads). */
kiln_status kiln_json_guard(const char *text, size_t len, const kiln_json_guard_limits *lim,
                            char *field, size_t field_cap, kiln_err *err);

#endif
