/* The FP8 mode's quantisation (kernels/backend.h quantize_fp8, and the
 * activations of linear on F8E4M3 weights, cuda_linear.cu): per tensor,
 * s = amax|x| / 448 (1 when amax is 0), codes = e4m3(x / s) with the
 * hardware conversion (__nv_cvt_float_to_fp8, round to nearest even,
 * saturating), which rounds as common/fp8.h's reference does: the op test
 * requires the same codes and scale bits.
 *
 * Three launches per call, none waiting for the host, so a step that
 * quantises still records as a CUDA graph: the amax slots are zeroed, a
 * grid-stride pass reduces |x| per block and folds the block maxima in with
 * atomicMax on the float bits (non-negative floats order as unsigned
 * integers; NaNs are skipped, as in the reference), and a second pass
 * divides and converts, one block per entry also storing s.  The amax
 * lives in the 16 bytes after an F8E4M3 tensor's scale (common/tensor.h:
 * they belong to the tensor), so no other memory is needed.  Entries
 * (batch rows quantised alone) run in one launch along grid.y.
 *
 * Both passes are memory-bound (each reads every DiT GEMM input of a step,
 * gigabytes on klein-4B at 1024x1024), so bf16 inputs whose entries are whole 16-byte vectors
 * take 8 elements a thread: one 16-byte load, and 8 codes stored as one
 * 8-byte word.  The arithmetic per element is the scalar path's. */
#include <cuda_fp8.h>

#include "cuda_internal.cuh"

extern "C" {
#include "common/fp8.h"
}

#define F8_BLOCK 256

/* The scale slot of entry e and, one float after it, its amax bits;
 * `off` is kiln_f8_scale_offset(per), computed on the host. */
__device__ __forceinline__ float *f8_slot(void *y, size_t stride, size_t off, int e)
{
    return (float *)((char *)y + (size_t)e * stride + off);
}

__global__ void f8_zero_kernel(void *y, size_t stride, size_t off, int entries)
{
    for (int e = threadIdx.x; e < entries; e += blockDim.x)
        ((unsigned *)f8_slot(y, stride, off, e))[1] = 0u;
}

/* Folds each thread's |x| maximum m into entry e's amax slot: the block
 * maximum (block_sum's pattern with fmaxf), then one atomicMax on the
 * float bits per block. */
__device__ __forceinline__ void f8_block_amax(float m, void *y, size_t stride, size_t off, int e)
{
    __shared__ float red[32];
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0)
        red[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? red[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0)
            atomicMax((unsigned *)f8_slot(y, stride, off, e) + 1, __float_as_uint(m));
    }
}

/* Entry e's scale from the amax its slot holds: kiln_f8_scale_of, with the
 * same fp32 division. */
__device__ __forceinline__ float f8_entry_scale(const float *slot)
{
    const float amax = __uint_as_float(((const unsigned *)slot)[1]);
    return amax > 0.0f ? amax / KILN_E4M3_MAX : 1.0f;
}

__global__ void f8_amax_kernel(const void *x, int x_bf16, int64_t per, void *y, size_t stride,
                               size_t off)
{
    const int e = blockIdx.y;
    const int64_t base = (int64_t)e * per;
    float m = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < per;
         i += (int64_t)gridDim.x * blockDim.x) {
        float a = fabsf(ld_act(x, base + i, x_bf16));
        if (a > m) /* false for NaN: NaNs do not count */
            m = a;
    }
    f8_block_amax(m, y, stride, off, e);
}

__global__ void f8_quant_kernel(const void *x, int x_bf16, int64_t per, void *y, size_t stride,
                                size_t off)
{
    const int e = blockIdx.y;
    float *slot = f8_slot(y, stride, off, e);
    const float s = f8_entry_scale(slot);
    const int64_t base = (int64_t)e * per;
    uint8_t *codes = (uint8_t *)y + (size_t)e * stride;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < per;
         i += (int64_t)gridDim.x * blockDim.x)
        codes[i] = (uint8_t)__nv_cvt_float_to_fp8(ld_act(x, base + i, x_bf16) / s,
                                                  __NV_SATFINITE, __NV_E4M3);
    if (blockIdx.x == 0 && threadIdx.x == 0)
        slot[0] = s;
}

/* The 8-wide bf16 passes: `per8` = per / 8 vectors an entry. */
__global__ void f8_amax_vec_kernel(const bf16 *x, int64_t per8, void *y, size_t stride, size_t off)
{
    const int e = blockIdx.y;
    const uint4 *xv = (const uint4 *)x + (int64_t)e * per8;
    float m = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < per8;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint4 v = xv[i];
        const bf16 *h = (const bf16 *)&v;
#pragma unroll
        for (int j = 0; j < 8; j++)
            m = fmaxf(m, fabsf(__bfloat162float(h[j]))); /* fmaxf drops NaNs */
    }
    f8_block_amax(m, y, stride, off, e);
}

__global__ void f8_quant_vec_kernel(const bf16 *x, int64_t per8, void *y, size_t stride,
                                    size_t off)
{
    const int e = blockIdx.y;
    float *slot = f8_slot(y, stride, off, e);
    const float s = f8_entry_scale(slot);
    const uint4 *xv = (const uint4 *)x + (int64_t)e * per8;
    uint2 *codes = (uint2 *)((uint8_t *)y + (size_t)e * stride);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < per8;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint4 v = xv[i];
        const bf16 *h = (const bf16 *)&v;
        uint2 c;
        uint8_t *cb = (uint8_t *)&c;
#pragma unroll
        for (int j = 0; j < 8; j++)
            cb[j] = (uint8_t)__nv_cvt_float_to_fp8(__bfloat162float(h[j]) / s, __NV_SATFINITE,
                                                   __NV_E4M3);
        codes[i] = c;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0)
        slot[0] = s;
}

int cuda_fp8_quantize(kiln_backend *be, const void *x, int x_bf16, int64_t per, int entries,
                      void *y, size_t stride)
{
    if (!per || !entries)
        return 1;
    const int vec = x_bf16 && per % 8 == 0 && stride % 8 == 0 && ((uintptr_t)x & 15) == 0 &&
                    ((uintptr_t)y & 7) == 0;
    unsigned bx = cuda_blocks(be, vec ? per / 8 : per);
    /* grid.x * grid.y blocks in all: the per-SM cap of cuda_blocks spread
     * over the entries. */
    if (entries > 1 && bx > 1) {
        unsigned cap = (unsigned)(cuda_of(be)->num_sms * 32 / entries);
        bx = bx < cap ? bx : (cap ? cap : 1);
    }
    dim3 grid(bx, (unsigned)entries);
    cudaStream_t st = cuda_stream(be);
    size_t off = kiln_f8_scale_offset(per);
    f8_zero_kernel<<<1, 32, 0, st>>>(y, stride, off, entries);
    if (vec) {
        f8_amax_vec_kernel<<<grid, F8_BLOCK, 0, st>>>((const bf16 *)x, per / 8, y, stride, off);
        f8_quant_vec_kernel<<<grid, F8_BLOCK, 0, st>>>((const bf16 *)x, per / 8, y, stride, off);
    } else {
        f8_amax_kernel<<<grid, F8_BLOCK, 0, st>>>(x, x_bf16, per, y, stride, off);
        f8_quant_kernel<<<grid, F8_BLOCK, 0, st>>>(x, x_bf16, per, y, stride, off);
    }
    return cuda_launched(be, "fp8 quantize");
}

void cuda_quantize_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, y->dtype == KILN_F8E4M3 && is_act(x) && kiln_tensor_numel(y) == n) ||
        CUDA_REQUIRE(be, y->data != x->data) || !n || !cuda_enter(be))
        return;
    cuda_fp8_quantize(be, x->data, is_bf16(x), n, 1, y->data, kiln_tensor_nbytes(y));
}
