/* Reading the diffusers oracle (shared/oracle, found through $KILN_SHARED)
 * from tests: case metadata, reference tensors as f32, image metrics.
 * oracle_meta, oracle_open and oracle_f32 abort the test program with a
 * message when the oracle is missing or malformed (a broken test setup, not
 * a result); tests that report that as a failed check and go on use
 * oracle_check.h instead.
 *
 *   kiln_st *ref = oracle_open("klein_t2i_256", "ref_fp32.safetensors");
 *   float *want = oracle_f32(ref, "prompt_embeds", &n);
 */
#ifndef KILN_TESTS_ORACLE_UTIL_H
#define KILN_TESTS_ORACLE_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/safetensors.h"
#include "kernels/backend.h"

/* "<shared>/oracle/<rel>" in one of 8 rotating static buffers: valid
 * through the next 7 calls (not thread-safe). */
const char *oracle_path(const char *rel);
/* "<shared>/oracle/cases/<case_name>/<file>", as oracle_path. */
const char *oracle_case_path(const char *case_name, const char *file);
/* cases/<name>/meta.json, parsed (caller frees with cJSON_Delete). */
cJSON *oracle_meta(const char *case_name);
/* cases/<name>/<file> opened as safetensors (caller closes). */
kiln_st *oracle_open(const char *case_name, const char *file);
/* A tensor converted to f32 (malloc'd, caller frees); NULL when absent.
 * numel, when not NULL, receives the element count. */
float *oracle_f32(const kiln_st *st, const char *name, int64_t *numel);
/* Element count of a stored tensor. */
int64_t oracle_numel(const kiln_st_tensor *t);
/* A stored tensor converted to f32 (malloc'd, caller frees); NULL when its
 * dtype does not convert or memory runs out. */
float *oracle_tensor_f32(const kiln_st_tensor *t);
/* Element i of a stored tensor as f32 (NaN when its dtype does not
 * convert); i must be below its element count. */
float oracle_value(const kiln_st_tensor *t, size_t i);
/* PSNR in dB of two 8-bit buffers (INFINITY when identical). */
double oracle_psnr_u8(const uint8_t *a, const uint8_t *b, size_t n);
/* The CPU backend the oracle tests compare on (caller destroys).  Exits
 * the program (status 1) with a message when $KILN_SHARED is not set or
 * the backend cannot be created. */
kiln_backend *oracle_cpu_backend(void);

/* The KV pipeline is chosen by model_index.json, so the klein KV case runs
 * a copy of `src` (klein-tiny) whose index names Flux2KleinKVPipeline, its
 * components linked.  Makes it in a fresh /tmp folder written to `dir`
 * (PATH_MAX bytes) and returns dir, or NULL when it cannot be made. */
const char *oracle_kv_checkpoint(const char *src, char *dir);
/* Removes what oracle_kv_checkpoint made in dir. */
void oracle_kv_checkpoint_remove(const char *dir);

#endif
