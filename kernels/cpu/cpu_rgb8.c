/* The decoder output's 8-bit conversion on the CPU backend (ops.to_rgb8):
 * kernels/rgb8.h's rule per value, the same function models/latents.c's
 * kiln_latents_to_rgb8 applies.  This file is compiled with
 * -ffp-contract=off (kernels/meson.build) so the rule's multiply and add
 * are never fused.  Every byte is computed alone, so the planes run on
 * OpenMP threads without changing a value (a 1024x1024 image is ~10 ms on
 * one core). */
#include "cpu_ops.h"
#include "kernels/rgb8.h"

/* Below this many pixels a plane stays on the calling thread. */
#define PARALLEL_MIN (1 << 16)

void cpu_to_rgb8(kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && x->shape[1] == 3 && rgb->ndim == 4 &&
                            rgb->dtype == KILN_U8 && rgb->shape[0] == x->shape[0] &&
                            rgb->shape[1] == x->shape[2] && rgb->shape[2] == x->shape[3] &&
                            rgb->shape[3] == 3 &&
                            (x->dtype == KILN_F32 || x->dtype == KILN_BF16)))
        return;
    const int bf16 = x->dtype == KILN_BF16;
    const int64_t B = x->shape[0], plane = x->shape[2] * x->shape[3];
    for (int64_t b = 0; b < B; b++) {
        uint8_t *dst = (uint8_t *)rgb->data + b * 3 * plane;
        const float *sf = bf16 ? NULL : cpu_f32(x) + b * 3 * plane;
        const uint16_t *sh = bf16 ? (const uint16_t *)x->data + b * 3 * plane : NULL;
#pragma omp parallel for if (plane >= PARALLEL_MIN)
        for (int64_t i = 0; i < plane; i++)
            for (int64_t ch = 0; ch < 3; ch++) {
                int64_t k = ch * plane + i;
                dst[3 * i + ch] = kiln_rgb8_byte(bf16 ? kiln_bf16_to_f32(sh[k]) : sf[k], bf16);
            }
    }
}
