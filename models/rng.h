/* kiln noise generator: bit-exact torch.randn on a torch CPU generator.
 *
 *   kiln_err err = {0};
 *   kiln_rng *g = kiln_rng_create(seed, &err);   // torch.Generator("cpu").manual_seed(seed)
 *   if (!g) return err.code;
 *   // klein bf16 pipeline: noise (B, 128, h, w) drawn as ONE tensor, in bf16
 *   if (kiln_randn(g, noise, (size_t)B * 128 * h * w, KILN_BF16, &err)) ...
 *   kiln_rng_destroy(g);
 *
 * Reproduces `torch.randn(n, generator=g, dtype=dt)` of torch 2.11 on an x86
 * CPU with AVX2 (shared/spec/pipeline.md §3), so a user can regenerate a
 * diffusers image from its seed: MT19937 seeded with seed mod 2^32, uniforms
 * with as many bits as the dtype's significand, Box-Muller in blocks of 16
 * (the last partial block is redrawn), fp32 with torch's AVX2 polynomial
 * log/sincos, bf16 with every operation rounded to bf16, and n < 16 through
 * torch's scalar double-precision normal_distribution.
 *
 * Output is always f32; for KILN_BF16 every value is exactly representable in
 * bf16 (kiln_f32_to_bf16 is lossless on it).  Consecutive calls continue the
 * same stream, like consecutive torch.randn calls on one generator.
 *
 * A kiln_rng is not thread-safe; use one per request (or per batch row, which
 * is what makes a row's noise independent of the batch it lands in).
 */
#ifndef KILN_MODELS_RNG_H
#define KILN_MODELS_RNG_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/tensor.h"

typedef struct kiln_rng kiln_rng;

/* A generator in the state of torch.Generator("cpu").manual_seed(seed).
 * Returns NULL with KILN_ERR_NOMEM.  The caller owns it. */
kiln_rng *kiln_rng_create(uint64_t seed, kiln_err *err);
/* Accepts NULL. */
void kiln_rng_destroy(kiln_rng *g);

/* Re-seeds in place, like manual_seed (also forgets a cached normal sample). */
void kiln_rng_seed(kiln_rng *g, uint64_t seed);

/* The next raw 32-bit MT19937 output (torch's generator.random() source). */
uint32_t kiln_rng_u32(kiln_rng *g);

/* Fills out[0..n) with standard normal values as torch.randn of n contiguous
 * elements of dtype `dt` would (the shape does not matter, only n).
 * dt: KILN_F32 or KILN_BF16, else KILN_ERR_UNSUPPORTED; out may be NULL only
 * when n is 0 (else KILN_ERR_INVALID).  Uses no memory beyond `out`. */
kiln_status kiln_randn(kiln_rng *g, float *out, size_t n, kiln_dtype dt, kiln_err *err);

#endif
