/* CUDA fused transformer ops (kernels/backend.h): the q|k|v split with the
 * per-head RMSNorm and RoPE in one pass over the projection, SwiGLU straight
 * into a column slice of the next GEMM's input; and the device memory query.
 *
 * qkv_split replaces three copy_cols, two rms_norm and two rope launches
 * (seven passes over (B, S, D) tensors) by one; it computes the sum of
 * squares in rms_norm_kernel's lane order and rounds where rms_norm and rope
 * round, so its bytes are those of the unfused ops. */
#include "cuda_internal.cuh"

/* One warp per (row, head) for any head size: q and k heads normalised and
 * rotated, the v head copied.  The normalised value is stored, then re-read as the rotation
 * input (rope reads the bf16 tensor rms_norm wrote); the pairs a lane
 * rotates were written by other lanes, hence the __syncwarp between. */
__global__ void qkv_split_kernel(void *q, void *k, void *v, int obf, const void *P, int pbf,
                                 const void *wq, int wqbf, const void *wk, int wkbf,
                                 const float *__restrict__ cs, const float *__restrict__ sn,
                                 int64_t rows, int64_t s, int64_t Dq, int64_t Dkv, int64_t d,
                                 float eps, int interleaved)
{
    int lane = threadIdx.x & 31;
    int64_t heads = Dq / d, kv_heads = Dkv / d, tasks = rows * heads, half = d / 2;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t task = warp; task < tasks; task += nwarps) {
        int64_t r = task / heads, h = task % heads, t = r % s;
        const int64_t row = r * (Dq + 2 * Dkv);
        for (int part = 0; part < (h < kv_heads ? 2 : 1); part++) {
            void *y = part ? k : q;
            const void *w = part ? wk : wq;
            int wbf = part ? wkbf : wqbf;
            int64_t in = row + part * Dq + h * d, dst = r * (part ? Dkv : Dq) + h * d;
            if (w) {
                float ss = 0;
                for (int64_t i = lane; i < d; i += 32) {
                    float x = ld_act(P, in + i, pbf);
                    ss += x * x;
                }
                float inv = rsqrtf(warp_sum(ss) / (float)d + eps);
                for (int64_t i = lane; i < d; i += 32) {
                    float x = rnd_act(ld_act(P, in + i, pbf) * inv, obf);
                    st_act(y, dst + i, x * ld_act(w, i, wbf), obf);
                }
            } else {
                for (int64_t i = lane; i < d; i += 32)
                    st_act(y, dst + i, ld_act(P, in + i, pbf), obf);
            }
            if (!cs)
                continue;
            __syncwarp();
            const float *c = cs + t * d, *sv = sn + t * d;
            for (int64_t i = lane; i < half; i += 32) {
                int64_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
                float a = ld_act(y, dst + i0, obf), b = ld_act(y, dst + i1, obf);
                st_act(y, dst + i0, rope_rot(a, c[i0], -b, sv[i0]), obf);
                st_act(y, dst + i1, rope_rot(b, c[i1], a, sv[i1]), obf);
            }
        }
        if (h < kv_heads)
            for (int64_t i = lane; i < d; i += 32)
                st_act(v, r * Dkv + h * d + i, ld_act(P, row + Dq + Dkv + h * d + i, pbf), obf);
    }
}

/* The same for heads of d = 32 J elements, J a power of two up to 8: a
 * lane keeps elements lane + 32 j in registers (rms_norm_kernel's order
 * for the sum of squares), and RoPE takes the partner of a pair from the
 * neighbouring lane (interleaved: lanes l and l ^ 1) or from its own
 * registers (half: j and j + J/2).  No global round trip between the norm
 * and the rotation: the generic kernel above waits on one per head. */
template <int J>
__global__ void qkv_split_reg_kernel(void *q, void *k, void *v, int obf, const void *P, int pbf,
                                     const void *wq, int wqbf, const void *wk, int wkbf,
                                     const float *__restrict__ cs, const float *__restrict__ sn,
                                     int64_t rows, int64_t s, int64_t Dq, int64_t Dkv, float eps,
                                     int interleaved)
{
    const int64_t d = 32 * J;
    int lane = threadIdx.x & 31;
    int64_t heads = Dq / d, kv_heads = Dkv / d, tasks = rows * heads;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t task = warp; task < tasks; task += nwarps) {
        int64_t r = task / heads, h = task % heads, t = r % s;
        const int64_t row = r * (Dq + 2 * Dkv);
        for (int part = 0; part < (h < kv_heads ? 2 : 1); part++) {
            void *y = part ? k : q;
            const void *w = part ? wk : wq;
            int wbf = part ? wkbf : wqbf;
            int64_t in = row + part * Dq + h * d, dst = r * (part ? Dkv : Dq) + h * d;
            float x[J];
#pragma unroll
            for (int j = 0; j < J; j++)
                x[j] = ld_act(P, in + lane + 32 * j, pbf);
            if (w) {
                float ss = 0;
#pragma unroll
                for (int j = 0; j < J; j++)
                    ss += x[j] * x[j];
                float inv = rsqrtf(warp_sum(ss) / (float)d + eps);
#pragma unroll
                for (int j = 0; j < J; j++)
                    x[j] = rnd_act(rnd_act(x[j] * inv, obf) * ld_act(w, lane + 32 * j, wbf), obf);
            } else {
#pragma unroll
                for (int j = 0; j < J; j++)
                    x[j] = rnd_act(x[j], obf);
            }
            if (cs) {
                const float *c = cs + t * d, *sv = sn + t * d;
                float o[J];
#pragma unroll
                for (int j = 0; j < J; j++) {
                    int64_t i = lane + 32 * j;
                    if (interleaved) {
                        float p = __shfl_xor_sync(0xffffffffu, x[j], 1);
                        o[j] = rope_rot(x[j], c[i], (lane & 1) ? p : -p, sv[i]);
                    } else if (j < J / 2) {
                        o[j] = rope_rot(x[j], c[i], -x[j + J / 2], sv[i]);
                    } else {
                        o[j] = rope_rot(x[j], c[i], x[j - J / 2], sv[i]);
                    }
                }
#pragma unroll
                for (int j = 0; j < J; j++)
                    x[j] = o[j];
            }
#pragma unroll
            for (int j = 0; j < J; j++)
                st_act(y, dst + lane + 32 * j, x[j], obf);
        }
        if (h < kv_heads) {
            int64_t in = row + Dq + Dkv + h * d, dst = r * Dkv + h * d;
#pragma unroll
            for (int j = 0; j < J; j++)
                st_act(v, dst + lane + 32 * j, ld_act(P, in + lane + 32 * j, pbf), obf);
        }
    }
}

/* The split's widths: rows of P, q's and k's (v's) columns. */
typedef struct qkv_dims {
    int64_t rows, s, Dq, Dkv;
} qkv_dims;

template <int J>
static void launch_qkv_reg(kiln_backend *be, unsigned blocks, kiln_tensor *q, kiln_tensor *k,
                           kiln_tensor *v, const kiln_tensor *P, const kiln_tensor *norm_q,
                           const kiln_tensor *norm_k, float eps, const kiln_tensor *cos,
                           const kiln_tensor *sin, kiln_rope_mode mode, qkv_dims n)
{
    qkv_split_reg_kernel<J><<<blocks, 256, 0, cuda_stream(be)>>>(
        q->data, k->data, v->data, is_bf16(q), P->data, is_bf16(P),
        norm_q ? norm_q->data : NULL, norm_q ? is_bf16(norm_q) : 0,
        norm_k ? norm_k->data : NULL, norm_k ? is_bf16(norm_k) : 0,
        cos ? (const float *)cos->data : NULL, sin ? (const float *)sin->data : NULL, n.rows, n.s,
        n.Dq, n.Dkv, eps, mode == KILN_ROPE_INTERLEAVED);
}

void cuda_qkv_split(kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                    const kiln_tensor *P, const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                    float eps, const kiln_tensor *cos, const kiln_tensor *sin,
                    kiln_rope_mode mode)
{
    if (CUDA_REQUIRE(be, P->ndim == 3 && is_act(P) && is_act(q) && q->dtype == k->dtype &&
                             q->dtype == v->dtype) ||
        P->shape[0] * P->shape[1] == 0)
        return;
    qkv_dims n = {P->shape[0] * P->shape[1], P->shape[1], 0, 0};
    n.Dq = kiln_tensor_numel(q) / n.rows, n.Dkv = kiln_tensor_numel(k) / n.rows;
    int64_t d = norm_q ? kiln_tensor_numel(norm_q) : cos ? cos->shape[1] : n.Dkv;
    if (CUDA_REQUIRE(be, P->shape[2] == n.Dq + 2 * n.Dkv && d > 0 && n.Dkv > 0 &&
                             n.Dq >= n.Dkv && n.Dq % d == 0 && n.Dkv % d == 0 && d % 2 == 0 &&
                             kiln_tensor_numel(q) == n.rows * n.Dq &&
                             kiln_tensor_numel(k) == n.rows * n.Dkv &&
                             kiln_tensor_numel(v) == n.rows * n.Dkv &&
                             (!norm_q || (kiln_tensor_numel(norm_q) == d && is_act(norm_q))) &&
                             (!norm_k || (kiln_tensor_numel(norm_k) == d && is_act(norm_k))) &&
                             !cos == !sin &&
                             (!cos || (cos->ndim == 2 && cos->shape[0] == n.s &&
                                       cos->shape[1] == d && kiln_tensor_numel(sin) == n.s * d &&
                                       cos->dtype == KILN_F32 && sin->dtype == KILN_F32))))
        return;
    int64_t tasks = n.rows * (n.Dq / d);
    if (!tasks || !cuda_enter(be))
        return;
    int64_t want = (tasks + 7) / 8, cap = (int64_t)cuda_of(be)->num_sms * 64;
    unsigned blocks = (unsigned)(want < cap ? want : cap);
    int64_t J = d % 32 ? 0 : d / 32;
    int reg = (J == 1 || J == 2 || J == 4 || J == 8) &&
              (!cos || mode == KILN_ROPE_INTERLEAVED || J % 2 == 0);
    if (reg) {
        if (J == 1)
            launch_qkv_reg<1>(be, blocks, q, k, v, P, norm_q, norm_k, eps, cos, sin, mode, n);
        else if (J == 2)
            launch_qkv_reg<2>(be, blocks, q, k, v, P, norm_q, norm_k, eps, cos, sin, mode, n);
        else if (J == 4)
            launch_qkv_reg<4>(be, blocks, q, k, v, P, norm_q, norm_k, eps, cos, sin, mode, n);
        else
            launch_qkv_reg<8>(be, blocks, q, k, v, P, norm_q, norm_k, eps, cos, sin, mode, n);
        cuda_launched(be, "qkv_split");
        return;
    }
    qkv_split_kernel<<<blocks, 256, 0, cuda_stream(be)>>>(
        q->data, k->data, v->data, is_bf16(q), P->data, is_bf16(P),
        norm_q ? norm_q->data : NULL, norm_q ? is_bf16(norm_q) : 0,
        norm_k ? norm_k->data : NULL, norm_k ? is_bf16(norm_k) : 0,
        cos ? (const float *)cos->data : NULL, sin ? (const float *)sin->data : NULL, n.rows, n.s,
        n.Dq, n.Dkv, d, eps, mode == KILN_ROPE_INTERLEAVED);
    cuda_launched(be, "qkv_split");
}

__device__ __forceinline__ float silu_f32(float v) { return v / (1.0f + __expf(-v)); }

/* diffusers/transformers: silu(gate) * up as two bf16 ops.  The vector path
 * moves 8 bf16 (16 bytes) per load and store. */
__global__ void swiglu_vec_kernel(bf16 *__restrict__ y, const bf16 *__restrict__ x, int64_t rows,
                                  int64_t f8, int64_t ld8, int64_t col8)
{
    int64_t n = rows * f8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / f8, c = i % f8;
        uint4 g4 = ((const uint4 *)x)[r * 2 * f8 + c], u4 = ((const uint4 *)x)[r * 2 * f8 + f8 + c];
        const bf16 *g = (const bf16 *)&g4, *u = (const bf16 *)&u4;
        uint4 o4;
        bf16 *o = (bf16 *)&o4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float a = __bfloat162float(__float2bfloat16_rn(silu_f32(__bfloat162float(g[j]))));
            o[j] = __float2bfloat16_rn(a * __bfloat162float(u[j]));
        }
        ((uint4 *)y)[r * ld8 + col8 + c] = o4;
    }
}

__global__ void swiglu_cols_kernel(void *y, int ybf, const void *x, int xbf, int64_t rows,
                                   int64_t f, int64_t ld, int64_t col0)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * f;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / f, c = i % f;
        float g = rnd_act(silu_f32(ld_act(x, r * 2 * f + c, xbf)), ybf);
        st_act(y, r * ld + col0 + c, g * ld_act(x, r * 2 * f + f + c, xbf), ybf);
    }
}

void cuda_swiglu_cols(kiln_backend *be, kiln_tensor *y, int64_t dst_col0, const kiln_tensor *x)
{
    int64_t rows = kiln_tensor_rows(x), f = kiln_tensor_cols(x) / 2, ld = kiln_tensor_cols(y);
    if (CUDA_REQUIRE(be, kiln_tensor_cols(x) % 2 == 0 && kiln_tensor_rows(y) == rows &&
                             dst_col0 >= 0 && dst_col0 + f <= ld && y->data != x->data &&
                             is_act(x) && is_act(y)) ||
        !rows || !f || !cuda_enter(be))
        return;
    int vec = is_bf16(x) && is_bf16(y) && f % 8 == 0 && ld % 8 == 0 && dst_col0 % 8 == 0 &&
              ((uintptr_t)x->data | (uintptr_t)y->data) % 16 == 0;
    if (vec)
        swiglu_vec_kernel<<<cuda_blocks(be, rows * f / 8), 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)x->data, rows, f / 8, ld / 8, dst_col0 / 8);
    else
        swiglu_cols_kernel<<<cuda_blocks(be, rows * f), 256, 0, cuda_stream(be)>>>(
            y->data, is_bf16(y), x->data, is_bf16(x), rows, f, ld, dst_col0);
    cuda_launched(be, "swiglu");
}

void cuda_swiglu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    if (CUDA_REQUIRE(be, kiln_tensor_cols(x) == 2 * kiln_tensor_cols(y)))
        return;
    cuda_swiglu_cols(be, y, 0, x);
}

kiln_status cuda_mem_info(kiln_backend *be, size_t *free_bytes, size_t *total_bytes)
{
    if (cudaSetDevice(cuda_of(be)->device) != cudaSuccess ||
        cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) {
        cudaGetLastError();
        return KILN_ERR_DEVICE;
    }
    return KILN_OK;
}
