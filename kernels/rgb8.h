/* The decoder output's 8-bit conversion, one value at a time: the rule that
 * the host (models/latents.c kiln_latents_to_rgb8), the CPU backend's
 * to_rgb8 op and the CUDA kernel all apply, so every path gives the same
 * bytes for the same input values and dtype.
 *
 *   // x: one decoder output value (B, 3, H, W), bf16: the pipeline dtype is bf16
 *   uint8_t byte = kiln_rgb8_byte(x, bf16);
 *
 * It is diffusers' VaeImageProcessor.postprocess + numpy_to_pil:
 * `(x / 2 + 0.5).clamp(0, 1)` in the decoder's dtype (each operation
 * rounded to it), then numpy's `(v * 255).round()` in fp32 (round half to
 * even).  A NaN (a broken decode) becomes 0 instead of the undefined
 * float-to-integer conversion numpy would do; -inf gives 0 and +inf 255.
 *
 * Every operation must be rounded on its own: in CUDA the helpers use
 * __fmul_rn / __fadd_rn (nvcc would otherwise fuse v * 255 + magic into an
 * FMA, whose single rounding can differ at a half); in C each is its own
 * statement in a function and the files that include this header are
 * compiled with -ffp-contract=off (kernels/meson.build, models/meson.build).
 * Pure functions: thread-safe. */
#ifndef KILN_KERNELS_RGB8_H
#define KILN_KERNELS_RGB8_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "common/tensor.h"
#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#include <cuda_bf16.h>
#define KILN_RGB8_FN static __host__ __device__ __forceinline__
#else
#define KILN_RGB8_FN static inline
#endif

/* fp32 a * b and a + b, each rounded to nearest even on its own. */
KILN_RGB8_FN float kiln_rgb8_mul(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    float p = a * b;
    return p;
#endif
}

KILN_RGB8_FN float kiln_rgb8_add(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    float s = a + b;
    return s;
#endif
}

/* Rounds to the pipeline dtype: identity for fp32, to nearest even for bf16
 * (the device's conversion and kiln_round_bf16 agree on every value but
 * NaN payloads, which the rule maps to 0 anyway). */
KILN_RGB8_FN float kiln_rgb8_to_dt(float v, int bf16)
{
#ifdef __CUDA_ARCH__
    return bf16 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
#else
    return bf16 ? kiln_round_bf16(v) : v;
#endif
}

/* One decoder output value to its byte; bf16 is 1 when the pipeline (the
 * decoder's activations) is bf16, 0 for fp32. */
KILN_RGB8_FN uint8_t kiln_rgb8_byte(float x, int bf16)
{
    float v = kiln_rgb8_to_dt(kiln_rgb8_mul(x, 0.5f), bf16);
    v = kiln_rgb8_to_dt(kiln_rgb8_add(v, 0.5f), bf16);
    if (!(v > 0.0f))
        return 0;
    if (v > 1.0f)
        v = 1.0f;
    /* Round half to even of a value in [0, 255] by adding and removing
     * 1.5 * 2^23 (whose ulp is 1): what rintf does, without a libm call
     * per pixel. */
    const float magic = 12582912.0f;
    return (uint8_t)kiln_rgb8_add(kiln_rgb8_add(kiln_rgb8_mul(v, 255.0f), magic), -magic);
}

#endif
