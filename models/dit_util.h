/* Helpers shared by the DiTs (flux2_dit*.c, zimage_dit*.c): bounded config
 * integers, weight loading with names and shapes checked, and tensor views.
 *
 *   kiln_dit_loader l = {be, st, &err};
 *   if (kiln_dit_load2(&l, &w, D, D, "layers.0.attention.to_out.0.weight") ||
 *       kiln_dit_load_fused(&l, &qkv, D, D, "layers.0.attention",
 *                           (const char *const[]){"to_q", "to_k", "to_v"}, 3))
 *       return err.code;
 *   kiln_tensor qh = kiln_dit_heads(&q, heads, head_dim);   // (B, S, h, d) view
 *
 * Loaded tensors are owned by the caller (kiln_be_free).  Everything here is
 * reentrant; the loads use the backend, so they run on its thread.
 */
#ifndef KILN_MODELS_DIT_UTIL_H
#define KILN_MODELS_DIT_UTIL_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/safetensors.h"
#include "kernels/backend.h"

/* Far above any real size; keeps products of config values in range. */
#define KILN_DIT_CFG_MAX 1000000

/* transformer/config.json integer `key` (def when absent, or
 * KILN_JSON_REQUIRED) in 0..KILN_DIT_CFG_MAX; KILN_ERR_FORMAT naming the
 * key otherwise. */
kiln_status kiln_dit_cfg_int(const cJSON *cfg, const char *key, int64_t def, int64_t *out,
                             kiln_err *err);

typedef struct kiln_dit_loader {
    kiln_backend *be;
    const kiln_st *st;
    kiln_err *err;
} kiln_dit_loader;

/* One tensor of shape (rows, cols) or (n), converted to be->act_dtype.  A
 * missing tensor or another shape fails naming it (l->err). */
kiln_status kiln_dit_load2(kiln_dit_loader *l, kiln_tensor *t, int64_t rows, int64_t cols,
                           const char *name);
kiln_status kiln_dit_load1(kiln_dit_loader *l, kiln_tensor *t, int64_t n, const char *name);
/* n tensors "<prefix>.<names[i]>.weight" of shape (rows, cols) each,
 * stacked along dim 0 into one (n * rows, cols) matrix (fused projections). */
kiln_status kiln_dit_load_fused(kiln_dit_loader *l, kiln_tensor *t, int64_t rows, int64_t cols,
                                const char *prefix, const char *const *names, int n);

/* The FP8 mode (docs/PERFORMANCE.md): replaces the linear weights ws[0..n)
 * by F8E4M3 copies quantised per tensor on the backend (kernels/backend.h
 * quantize_fp8), freeing the originals, so every kiln_be_linear on them
 * runs as an FP8 GEMM.  A weight whose shape FP8 GEMMs cannot take
 * (common/fp8.h kiln_f8_linear_ok) or that is absent (data NULL) stays as
 * it is.  *converted (may be NULL) counts the weights replaced.  Call
 * before the first forward (recorded forwards hold the old addresses).
 * The backend's sticky error code; a failure leaves each weight either
 * replaced or as it was, so the model tears down as usual. */
kiln_status kiln_dit_quantize_fp8(kiln_backend *be, kiln_tensor *const *ws, int n, int *converted);

/* Grows a host float buffer (*buf, *cap floats) to at least `floats`;
 * KILN_ERR_NOMEM leaves it as it was. */
kiln_status kiln_dit_host_reserve(float **buf, size_t *cap, size_t floats, kiln_err *err);

/* The run-time state each DiT keeps beside its weights: the arenas of one
 * forward and of one block (*fwd, *blk) and whether forwards may be
 * replayed as graphs (*replay_enabled: the backend records graphs and
 * KILN_GRAPHS is not "0"; KILN_GRAPHS=0 runs every step op by op, for
 * profiling and for telling a recording problem from a kernel problem).
 * KILN_ERR_NOMEM on failure, leaving what was made in *fwd / *blk for the
 * caller's teardown (kiln_arena_destroy). */
kiln_status kiln_dit_runtime_init(kiln_backend *be, kiln_arena **fwd, kiln_arena **blk,
                                  int *replay_enabled, kiln_err *err);

/* Grows the RoPE tables *cos, *sin ((*cap, d) F32 each, only growing) to
 * hold `rows` rows.  When they move *epoch is bumped (recorded forwards
 * name it in their keys).  An allocation failure leaves *cap 0 and the
 * backend's sticky error. */
void kiln_dit_rope_reserve(kiln_backend *be, kiln_tensor *cos, kiln_tensor *sin, int64_t *cap,
                           uint64_t *epoch, int64_t rows, int64_t d);

/* Frees `n` block structs of `block_bytes` each, made of kiln_tensors and
 * nothing else, then the array `blocks` itself; NULL is fine. */
void kiln_dit_free_blocks(kiln_backend *be, void *blocks, int64_t n, size_t block_bytes);

/* (B, S, h * d) seen as (B, S, h, d). */
kiln_tensor kiln_dit_heads(const kiln_tensor *t, int64_t heads, int64_t head_dim);
/* Rows [row0, row0 + n) of a (1, S, C) tensor as a (1, n, C) view (with one
 * batch row they are contiguous). */
kiln_tensor kiln_dit_rows_view(const kiln_tensor *t, int64_t row0, int64_t n);

#endif
