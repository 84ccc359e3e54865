/* Reading the diffusers oracle (shared/oracle, found through $KILN_SHARED)
 * from tests: case metadata, reference tensors as f32, image metrics.
 * Every function aborts the test program with a message when the oracle is
 * missing or malformed: that is a broken test setup, not a result. */
#ifndef KILN_TESTS_ORACLE_UTIL_H
#define KILN_TESTS_ORACLE_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/safetensors.h"

/* "<shared>/oracle/<rel>" into a static buffer (not thread-safe). */
const char *oracle_path(const char *rel);
/* cases/<name>/meta.json, parsed (caller frees with cJSON_Delete). */
cJSON *oracle_meta(const char *case_name);
/* cases/<name>/<file> opened as safetensors (caller closes). */
kiln_st *oracle_open(const char *case_name, const char *file);
/* A tensor converted to f32 (malloc'd, caller frees); NULL when absent.
 * numel, when not NULL, receives the element count. */
float *oracle_f32(const kiln_st *st, const char *name, int64_t *numel);
/* PSNR in dB of two 8-bit buffers (INFINITY when identical). */
double oracle_psnr_u8(const uint8_t *a, const uint8_t *b, size_t n);

/* The KV pipeline is chosen by model_index.json, so the klein KV case runs
 * a copy of `src` (klein-tiny) whose index names Flux2KleinKVPipeline, its
 * components linked.  Makes it in a fresh /tmp folder written to `dir`
 * (PATH_MAX bytes) and returns dir, or NULL when it cannot be made. */
const char *oracle_kv_checkpoint(const char *src, char *dir);
/* Removes what oracle_kv_checkpoint made in dir. */
void oracle_kv_checkpoint_remove(const char *dir);

#endif
