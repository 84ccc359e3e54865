/* Warp-level bf16 tensor-core helpers (mma.sync m16n8k16, ldmatrix, cp.async)
 * for the attention and convolution kernels.
 *
 *   float c[4] = {0};
 *   uint32_t a[4], b[4];
 *   ldsm_x4(a, &sA[row * stride + k]);        // A fragment, 16x16
 *   ldsm_x4(b, &sB[key * stride + k]);        // two B fragments (n 0-7, 8-15)
 *   mma_bf16(c, a, b[0], b[1]);
 *
 * Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
 * g = lane / 4 and t = lane % 4:
 *   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..),
 *                      a3 = (g+8, 2t+8..)
 *   B 16x8 (k x n):    b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
 *   C 16x8 f32:        c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
 * ldmatrix.x4 loads four 8x8 b16 matrices whose row addresses come from lanes
 * 0-7, 8-15, 16-23, 24-31; each lane receives (row lane/4, cols 2(lane%4)..+1)
 * of each matrix, or the transpose of that with .trans.  Row addresses must
 * be 16-byte aligned. */
#ifndef KILN_CUDA_MMA_CUH
#define KILN_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

/* c += a * b with bf16 inputs and f32 accumulators. */
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats as a bf16 pair, `lo` in the low half (the lower column). */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

/* 16-byte global -> shared copy that bypasses registers (and L1). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif
