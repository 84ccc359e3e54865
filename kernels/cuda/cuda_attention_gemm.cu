/* Attention with one wide head (the VAE mid-block: d = 512, one head,
 * 16384 tokens at 1024x1024) as two cuBLASLt GEMMs around a softmax pass.
 * cuDNN's SDPA declines d = 512 and kiln's flash kernel reaches only 66
 * TFLOP/s there (8.4 ms); the GEMMs run near the matmul rate.
 *
 * Per batch row and chunk of query rows: S = Q K^T in f32, P = exp(scale S
 * - rowmax) rounded to bf16 with l = the row sum of the unrounded values,
 * O = P V in f32, o = O / l in bf16: the roundings of a flash kernel (bf16
 * P into the PV product, f32 accumulation and normaliser), computed in a
 * different order.  Each batch row runs alone, so a row's result never
 * depends on its batch. */
#include <math.h>
#include <string.h>

#include "cuda_internal.cuh"

/* f32 scores of one chunk at most (the P and O buffers come on top). */
#define ATTN_GEMM_SCORE_BYTES ((size_t)64 << 20)

__device__ __forceinline__ float block_max(float v, float *red)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* One block per score row, two reads of the row (the max, then the
 * exponentials): for rows too long for the register kernel below. */
__global__ void attn_softmax_kernel(bf16 *__restrict__ P, float *__restrict__ l,
                                    const float *__restrict__ S, int64_t sk, float scale)
{
    __shared__ float red[32];
    const float *s = S + blockIdx.x * sk;
    bf16 *p = P + blockIdx.x * sk;
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < sk; i += blockDim.x)
        m = fmaxf(m, s[i] * scale);
    m = block_max(m, red);
    float sum = 0;
    for (int64_t i = threadIdx.x; i < sk; i += blockDim.x) {
        float e = __expf(s[i] * scale - m);
        p[i] = __float2bfloat16_rn(e);
        sum += e;
    }
    sum = block_sum(sum, red);
    if (threadIdx.x == 0)
        l[blockIdx.x] = sum;
}

/* The same with the row read once: ATTN_ROW_THREADS threads keep up to
 * ATTN_ROW_VALS of its scores each in registers (every load issued before
 * the first is used), so rows of up to 16384 keys (the VAE mid-block at
 * 1024x1024) cost one read of S instead of two.  The same roundings; the
 * row sum is added in another order. */
#define ATTN_ROW_THREADS 1024
#define ATTN_ROW_VALS 16
__global__ void __launch_bounds__(ATTN_ROW_THREADS)
    attn_softmax_row_kernel(bf16 *__restrict__ P, float *__restrict__ l,
                            const float *__restrict__ S, int64_t sk, float scale)
{
    __shared__ float red[32];
    const float *s = S + blockIdx.x * sk;
    bf16 *p = P + blockIdx.x * sk;
    float x[ATTN_ROW_VALS];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < ATTN_ROW_VALS; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * ATTN_ROW_THREADS;
        x[j] = i < sk ? s[i] * scale : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < ATTN_ROW_VALS; j++)
        m = fmaxf(m, x[j]);
    m = block_max(m, red);
    float sum = 0;
#pragma unroll
    for (int j = 0; j < ATTN_ROW_VALS; j++) {
        const int64_t i = threadIdx.x + (int64_t)j * ATTN_ROW_THREADS;
        if (i < sk) {
            float e = __expf(x[j] - m);
            p[i] = __float2bfloat16_rn(e);
            sum += e;
        }
    }
    sum = block_sum(sum, red);
    if (threadIdx.x == 0)
        l[blockIdx.x] = sum;
}

__global__ void attn_finish_kernel(bf16 *__restrict__ o, const float *__restrict__ O,
                                   const float *__restrict__ l, int64_t rows, int64_t d)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * d;
         i += (int64_t)gridDim.x * blockDim.x)
        o[i] = __float2bfloat16_rn(O[i] / l[i / d]);
}

static size_t align256(size_t v) { return (v + 255) / 256 * 256; }

static kiln_tensor dense(void *data, kiln_dtype dt, int64_t rows, int64_t cols)
{
    kiln_tensor t;
    memset(&t, 0, sizeof t);
    const int64_t shape[2] = {rows, cols};
    kiln_tensor_set_shape(&t, dt, 2, shape);
    t.data = data;
    t.on_device = 1;
    return t;
}

int cuda_attention_gemm(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q,
                        const kiln_tensor *k, const kiln_tensor *v, const kiln_attn_opts *opts)
{
    int64_t bsz = q->shape[0], sq = q->shape[1], d = q->shape[3], sk = k->shape[1];
    if (q->shape[2] != 1 || k->shape[2] != 1 || opts->causal || opts->key_len || d < 256 ||
        d % 8 || sk % 8)
        return 0;
    int64_t m = (int64_t)(ATTN_GEMM_SCORE_BYTES / sizeof(float)) / sk;
    if (m > sq)
        m = sq;
    if (m < 1)
        m = 1;
    size_t vt_bytes = align256((size_t)(bsz * d * sk) * sizeof(bf16));
    size_t s_bytes = align256((size_t)(m * sk) * sizeof(float));
    size_t p_bytes = align256((size_t)(m * sk) * sizeof(bf16));
    size_t o_bytes = align256((size_t)(m * d) * sizeof(float));
    char *base = (char *)cuda_scratch(be, vt_bytes + s_bytes + p_bytes + o_bytes +
                                              (size_t)m * sizeof(float));
    if (!base)
        return 1;
    const int64_t vt_shape[3] = {bsz, d, sk}, v3_shape[3] = {bsz, sk, d};
    kiln_tensor vt = *v, v3 = *v;
    kiln_tensor_set_shape(&vt, KILN_BF16, 3, vt_shape);
    vt.data = base;
    kiln_tensor_set_shape(&v3, KILN_BF16, 3, v3_shape);
    cuda_transpose(be, &vt, &v3);
    float *S = (float *)(base + vt_bytes), *O = (float *)(base + vt_bytes + s_bytes + p_bytes);
    bf16 *P = (bf16 *)(base + vt_bytes + s_bytes);
    float *l = (float *)(base + vt_bytes + s_bytes + p_bytes + o_bytes);
    for (int64_t b = 0; b < bsz && !be->error.code; b++) {
        kiln_tensor kb = dense((bf16 *)k->data + b * sk * d, KILN_BF16, sk, d);
        kiln_tensor vb = dense((bf16 *)vt.data + b * d * sk, KILN_BF16, d, sk);
        for (int64_t r0 = 0; r0 < sq && !be->error.code; r0 += m) {
            int64_t rows = sq - r0 < m ? sq - r0 : m;
            kiln_tensor qc = dense((bf16 *)q->data + (b * sq + r0) * d, KILN_BF16, rows, d);
            kiln_tensor sc = dense(S, KILN_F32, rows, sk), pc = dense(P, KILN_BF16, rows, sk);
            kiln_tensor oc = dense(O, KILN_F32, rows, d);
            cuda_linear(be, &sc, &qc, &kb, NULL);
            if (be->error.code)
                break;
            if (sk <= (int64_t)ATTN_ROW_THREADS * ATTN_ROW_VALS)
                attn_softmax_row_kernel<<<(unsigned)rows, ATTN_ROW_THREADS, 0,
                                          cuda_stream(be)>>>(P, l, S, sk, opts->scale);
            else
                attn_softmax_kernel<<<(unsigned)rows, 256, 0, cuda_stream(be)>>>(P, l, S, sk,
                                                                                 opts->scale);
            if (!cuda_launched(be, "attention(softmax)"))
                break;
            cuda_linear(be, &oc, &pc, &vb, NULL);
            if (be->error.code)
                break;
            attn_finish_kernel<<<cuda_blocks(be, rows * d), 256, 0, cuda_stream(be)>>>(
                (bf16 *)o->data + (b * sq + r0) * d, O, l, rows, d);
            cuda_launched(be, "attention(finish)");
        }
    }
    return 1;
}
