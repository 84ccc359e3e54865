/* kiln JSON helpers over cJSON: loading files, typed lookups with defaults
 * and clear errors.
 *
 *   cJSON *cfg = kiln_json_load("ckpt/transformer/config.json", "transformer/config.json", &err);
 *   int64_t layers;
 *   if (kiln_json_int(cfg, "num_layers", -1, &layers, &err)) ...  // required key
 *   cJSON_Delete(cfg);
 *
 * `label` replaces the path in messages (no absolute paths reach clients).
 * Lookups: a `def` that is not the KILN_JSON_REQUIRED sentinel is returned
 * when the key is absent or null; a present key of the wrong type is always
 * KILN_ERR_FORMAT.  All functions are thread-safe on distinct documents.
 */
#ifndef KILN_JSON_H
#define KILN_JSON_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "error.h"

#define KILN_JSON_REQUIRED INT64_MIN

/* Reads and parses a file (at most 64 MiB); NULL with err set on failure. */
cJSON *kiln_json_load(const char *path, const char *label, kiln_err *err);

kiln_status kiln_json_int(const cJSON *obj, const char *key, int64_t def, int64_t *out,
                          kiln_err *err);
/* def is used when the key is absent unless `required` is set. */
kiln_status kiln_json_double(const cJSON *obj, const char *key, int required, double def,
                             double *out, kiln_err *err);
kiln_status kiln_json_bool(const cJSON *obj, const char *key, int required, int def, int *out,
                           kiln_err *err);
/* Returns the string (owned by obj) or NULL: absent -> NULL without error when
 * !required; wrong type -> NULL with KILN_ERR_FORMAT. */
const char *kiln_json_string(const cJSON *obj, const char *key, int required, kiln_err *err);
/* Reads an array of integers into out[max]; *n gets the count.  An absent key
 * leaves *n = 0 unless required. */
kiln_status kiln_json_int_array(const cJSON *obj, const char *key, int required, int64_t *out,
                                int max, int *n, kiln_err *err);

#endif
