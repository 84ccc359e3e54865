/* FP8 E4M3 ("e4m3fn": 1 sign, 4 exponent bits biased by 7, 3 mantissa
 * bits; no infinities, S.1111.111 is NaN, largest finite 448, smallest
 * subnormal 2^-9) as kiln's opt-in FP8 mode stores weights and activations
 * (docs/PERFORMANCE.md "FP8 mode").
 *
 *   uint8_t c = kiln_f32_to_e4m3(x / s);          // s: the tensor's scale
 *   float back = kiln_e4m3_to_f32(c) * s;
 *   kiln_tensor w8;  // dtype KILN_F8E4M3: codes, then the scale (tensor.h)
 *   float s = kiln_f8_scale(&w8);                  // host tensors only
 *
 * The conversion is the one CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
 * __NV_E4M3) performs, so the CPU reference and the CUDA kernels quantise
 * to the same codes: round to nearest, ties to even, subnormals as E4M3
 * defines them, |x| > 448 (infinities included) saturated to +-448, NaN to
 * NaN (0x7f with the sign).  torch's float8_e4m3fn cast rounds the same
 * way but turns values past 464 into NaN instead of saturating; kiln never
 * feeds it those (x / s stays within +-448 by the choice of s).
 *
 * Pure functions: reentrant, any thread. */
#ifndef KILN_FP8_H
#define KILN_FP8_H

#include <stdint.h>

#include "tensor.h"

#define KILN_E4M3_MAX 448.0f

uint8_t kiln_f32_to_e4m3(float x);
float kiln_e4m3_to_f32(uint8_t c);

/* The per-tensor scale of kiln's FP8 mode: amax / 448 for the largest
 * magnitude amax of the values (so they map onto the whole E4M3 range),
 * 1 when amax is 0 (all zeros: any scale gives zero codes).  fp32
 * division, as the CUDA kernels compute it. */
float kiln_f8_scale_of(float amax);

/* Whether a linear layer's weight (N, K) may be stored as F8E4M3: cuBLASLt's
 * FP8 GEMMs need 16-byte-aligned leading dimensions (K codes per weight
 * row, N bf16 outputs per row), so both must be multiples of 16.  Both
 * backends refuse other shapes, so the same layers run in FP8 on each. */
static inline int kiln_f8_linear_ok(int64_t n, int64_t k)
{
    return n > 0 && k > 0 && n % 16 == 0 && k % 16 == 0;
}

/* The scale stored with a host F8E4M3 tensor's codes (tensor.h). */
static inline float kiln_f8_scale(const kiln_tensor *t)
{
    return *(const float *)((const char *)t->data + kiln_f8_scale_offset(kiln_tensor_numel(t)));
}

#endif
