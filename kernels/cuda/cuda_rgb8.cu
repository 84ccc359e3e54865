/* The decoder output's 8-bit conversion on the GPU (ops.to_rgb8), so the
 * decode stage downloads 3 bytes a pixel instead of 3 activations and the
 * host does no per-pixel work.  The rule is kernels/rgb8.h's, shared with
 * the CPU backend and models/latents.c: in device code its multiplies and
 * adds are __fmul_rn / __fadd_rn, never fused, so the bytes are the CPU's
 * (tests/cuda/test_cuda_ops: to_rgb8). */
#include "cuda_internal.cuh"
#include "kernels/rgb8.h"

/* One thread per pixel: three plane reads (coalesced across the warp) and
 * three adjacent byte stores (a warp writes 96 contiguous bytes). */
__global__ void to_rgb8_kernel(uint8_t *__restrict__ rgb, const void *__restrict__ x, int bf,
                               int64_t B, int64_t plane)
{
    int64_t total = B * plane;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t b = i / plane, p = i % plane, base = b * 3 * plane + p;
        uint8_t *o = rgb + 3 * i;
        for (int ch = 0; ch < 3; ch++)
            o[ch] = kiln_rgb8_byte(ld_act(x, base + ch * plane, bf), bf);
    }
}

void cuda_to_rgb8(kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && x->shape[1] == 3 && is_act(x) && rgb->ndim == 4 &&
                             rgb->dtype == KILN_U8 && rgb->shape[0] == x->shape[0] &&
                             rgb->shape[1] == x->shape[2] && rgb->shape[2] == x->shape[3] &&
                             rgb->shape[3] == 3))
        return;
    int64_t B = x->shape[0], plane = x->shape[2] * x->shape[3];
    if (!B || !plane || !cuda_enter(be))
        return;
    to_rgb8_kernel<<<cuda_blocks(be, B * plane), 256, 0, cuda_stream(be)>>>(
        (uint8_t *)rgb->data, x->data, is_bf16(x), B, plane);
    cuda_launched(be, "to_rgb8");
}
