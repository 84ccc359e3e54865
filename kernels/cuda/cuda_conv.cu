/* CUDA 2-D convolution (channels last, bf16) as an implicit GEMM on tensor
 * cores, for the shapes cuDNN declines or when it is absent:
 *   Y[p, co] = sum_k X_col[p, k] * W[co, k] + bias[co]
 * with p = (b, oy, ox) over the output pixels and k = (ky, kx, ci) in the
 * weight's own (Cout, kh, kw, Cin) order, so W is a plain row-major
 * Cout x K matrix, X_col's row p is the receptive field of pixel p (runs
 * of Cin contiguous channels in x (B, H, W, Cin)) and Y (B, Ho, Wo, Cout)
 * is row-major pixels x Cout.  X_col is never materialised: each 128 x 32
 * tile of it is gathered from x with the zero padding applied on the fly.
 * Asymmetric padding (the VAE downsampler's) falls out of the same index
 * arithmetic.
 *
 * A block of 8 warps computes a 128 (pixel) x 128 (Cout) tile, each warp a
 * 64 x 32 part with mma.sync m16n8k16 and fp32 accumulators; both operand
 * tiles are stored k-contiguous, as ldmatrix reads them.  The (ky, kx, ci)
 * decomposition of every k is tabulated once per block in shared memory
 * (no divisions in the gather), and the next K step's loads are in flight
 * in registers while the tensor cores work on the current one (two shared
 * memory stages, one barrier per step). */
#include "cuda_internal.cuh"
#include "cuda_mma.cuh"

#define CV_BM 128 /* pixels */
#define CV_BN 128 /* output channels */
#define CV_BK 32
#define CV_THREADS 256
#define CV_S (CV_BK + 8) /* padded smem rows: conflict-free ldmatrix */
#define CV_TILE_BYTES (2 * (CV_BM + CV_BN) * CV_S * 2)
#define CV_MAX_K 16384 /* the k table must fit in shared memory */

typedef struct conv_params {
    const bf16 *x, *w;
    const void *bias;
    const bf16 *res; /* the residual, (npix, cout), or NULL */
    int bias_bf16, vec_w, vec_x;
    bf16 *y;
    int cin, h, wd, cout, kh, kw, stride, pad_top, pad_left, ho, wo, k;
    int64_t npix; /* B * ho * wo */
} conv_params;

/* One K step's global loads, held in registers until they are stored. */
typedef struct conv_regs {
    uint4 w[2]; /* 16 weights: two 8-wide chunks, or 16 scalars */
    uint4 x[2]; /* 16 gathered inputs: two 8-channel runs, or 16 scalars */
} conv_regs;

/* The pixels a thread gathers for, fixed for the whole K loop: rows
 * (tid >> 2) + 64 j of the tile with 8-channel loads (j = 0, 1), row
 * tid & 127 with element loads (j = 0).  off is the element offset of the
 * receptive field's top-left tap, (iy0, ix0), which may lie in the
 * padding; a pixel past the end gets iy0 so far out that no tap is read. */
typedef struct conv_pix {
    int64_t off[2];
    int iy0[2], ix0[2];
} conv_pix;

__device__ __forceinline__ void conv_pixel(const conv_params &p, int64_t px, conv_pix *q, int j)
{
    q->off[j] = 0;
    q->iy0[j] = -(1 << 30);
    q->ix0[j] = 0;
    if (px >= p.npix)
        return;
    int64_t plane = (int64_t)p.ho * p.wo, b = px / plane, r = px % plane;
    q->iy0[j] = (int)(r / p.wo) * p.stride - p.pad_top;
    q->ix0[j] = (int)(r % p.wo) * p.stride - p.pad_left;
    q->off[j] = ((b * p.h + q->iy0[j]) * p.wd + q->ix0[j]) * (int64_t)p.cin;
}

/* x at tap k of pixel j, or NULL in the zero padding. */
__device__ __forceinline__ const bf16 *conv_tap(const conv_params &p, const int2 *ktab,
                                                const conv_pix &q, int j, int k)
{
    int2 e = ktab[k];
    int iy = q.iy0[j] + (e.y >> 16), ix = q.ix0[j] + (e.y & 0xffff);
    return iy >= 0 && iy < p.h && ix >= 0 && ix < p.wd ? p.x + q.off[j] + e.x : NULL;
}

__device__ __forceinline__ void conv_load(conv_regs *r, const conv_params &p, const int2 *ktab,
                                          const conv_pix &q, int n0, int k0)
{
    const int tid = threadIdx.x;
    if (p.vec_w) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int c = tid + j * CV_THREADS, row = c >> 2, kk = k0 + (c & 3) * 8;
            r->w[j] = (n0 + row < p.cout && kk < p.k)
                          ? *(const uint4 *)(p.w + (int64_t)(n0 + row) * p.k + kk)
                          : make_uint4(0, 0, 0, 0);
        }
    } else {
        bf16 *a = (bf16 *)r->w;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int e = tid + i * CV_THREADS, row = e >> 5, kk = k0 + (e & 31);
            a[i] = (n0 + row < p.cout && kk < p.k) ? p.w[(int64_t)(n0 + row) * p.k + kk]
                                                   : __float2bfloat16_rn(0.0f);
        }
    }
    if (p.vec_x) {
        /* Cin % 8 == 0: the 8 k from kk share (ky, kx), 8 contiguous channels. */
        int kk = k0 + (tid & 3) * 8;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const bf16 *s = kk < p.k ? conv_tap(p, ktab, q, j, kk) : NULL;
            r->x[j] = s ? *(const uint4 *)s : make_uint4(0, 0, 0, 0);
        }
    } else {
        bf16 *b = (bf16 *)r->x;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int kk = k0 + (tid >> 7) + 2 * i;
            const bf16 *s = kk < p.k ? conv_tap(p, ktab, q, 0, kk) : NULL;
            b[i] = s ? *s : __float2bfloat16_rn(0.0f);
        }
    }
}

/* sa: pixels x k, sb: output channels x k, both CV_S apart. */
__device__ __forceinline__ void conv_store(const conv_regs *r, const conv_params &p, bf16 *sa,
                                           bf16 *sb)
{
    const int tid = threadIdx.x;
    if (p.vec_w) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int c = tid + j * CV_THREADS;
            *(uint4 *)(sb + (c >> 2) * CV_S + (c & 3) * 8) = r->w[j];
        }
    } else {
        const bf16 *a = (const bf16 *)r->w;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int e = tid + i * CV_THREADS;
            sb[(e >> 5) * CV_S + (e & 31)] = a[i];
        }
    }
    if (p.vec_x) {
#pragma unroll
        for (int j = 0; j < 2; j++)
            *(uint4 *)(sa + ((tid >> 2) + 64 * j) * CV_S + (tid & 3) * 8) = r->x[j];
    } else {
        const bf16 *b = (const bf16 *)r->x;
#pragma unroll
        for (int i = 0; i < 16; i++)
            sa[(tid & 127) * CV_S + (tid >> 7) + 2 * i] = b[i];
    }
}

__global__ void __launch_bounds__(CV_THREADS) conv2d_kernel(const conv_params p)
{
    extern __shared__ __align__(16) unsigned char cv_smem[];
    bf16 *sa = (bf16 *)cv_smem;         /* 2 stages of CV_BM x CV_S */
    bf16 *sb = sa + 2 * CV_BM * CV_S;   /* 2 stages of CV_BN x CV_S */
    int2 *ktab = (int2 *)(cv_smem + CV_TILE_BYTES);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;
    const int64_t m0 = (int64_t)blockIdx.x * CV_BM;
    const int n0 = blockIdx.y * CV_BN;

    /* k -> (offset of tap (ky, kx) channel ci from the field's top-left
     * element, ky << 16 | kx). */
    const int kwc = p.kw * p.cin;
    for (int k = tid; k < p.k; k += CV_THREADS) {
        int ky = k / kwc, rem = k % kwc, kx = rem / p.cin, ci = rem % p.cin;
        ktab[k] = make_int2((ky * p.wd + kx) * p.cin + ci, (ky << 16) | kx);
    }
    conv_pix q;
    if (p.vec_x) {
        conv_pixel(p, m0 + (tid >> 2), &q, 0);
        conv_pixel(p, m0 + (tid >> 2) + 64, &q, 1);
    } else {
        conv_pixel(p, m0 + (tid & 127), &q, 0);
    }
    __syncthreads();

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    conv_regs regs;
    conv_load(&regs, p, ktab, q, n0, 0);
    conv_store(&regs, p, sa, sb);
    __syncthreads();
    const int steps = (p.k + CV_BK - 1) / CV_BK;
    for (int s = 0; s < steps; s++) {
        const int cur = s & 1;
        if (s + 1 < steps)
            conv_load(&regs, p, ktab, q, n0, (s + 1) * CV_BK);
        const bf16 *ca = sa + cur * CV_BM * CV_S, *cb = sb + cur * CV_BN * CV_S;
#pragma unroll
        for (int ks = 0; ks < CV_BK; ks += 16) {
            uint32_t a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldsm_x4(a[mi],
                        ca + (wm * 64 + mi * 16 + (lane & 15)) * CV_S + ks + (lane >> 4) * 8);
            /* Output channels are B's columns, stored as rows of k: two
             * n-blocks of 8 per ldmatrix (cuda_attention.cu reads K so). */
#pragma unroll
            for (int np = 0; np < 2; np++) {
                uint32_t r[4];
                ldsm_x4(r, cb + (wn * 32 + np * 16 + (lane >> 4) * 8 + (lane & 7)) * CV_S + ks +
                               ((lane >> 3) & 1) * 8);
                b[2 * np][0] = r[0];
                b[2 * np][1] = r[1];
                b[2 * np + 1][0] = r[2];
                b[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
#pragma unroll
                for (int nb = 0; nb < 4; nb++)
                    mma_bf16(acc[mi][nb], a[mi], b[nb][0], b[nb][1]);
        }
        /* The other stage was last read before the previous barrier. */
        if (s + 1 < steps)
            conv_store(&regs, p, sa + (cur ^ 1) * CV_BM * CV_S, sb + (cur ^ 1) * CV_BN * CV_S);
        __syncthreads();
    }

    /* The bias is added in fp32, before the rounding to bf16; the residual
     * after it, rounded again as a separate add would be. */
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int nb = 0; nb < 4; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int64_t pix = m0 + wm * 64 + mi * 16 + g + (e >> 1) * 8;
                int co = n0 + wn * 32 + nb * 8 + 2 * t + (e & 1);
                if (co >= p.cout || pix >= p.npix)
                    continue;
                float v = acc[mi][nb][e];
                if (p.bias)
                    v += ld_act(p.bias, co, p.bias_bf16);
                if (p.res)
                    v = __bfloat162float(__float2bfloat16_rn(v)) +
                        __bfloat162float(p.res[pix * p.cout + co]);
                p.y[pix * p.cout + co] = __float2bfloat16_rn(v);
            }
}

static size_t conv_smem(int64_t k) { return CV_TILE_BYTES + (size_t)k * sizeof(int2); }

int cuda_conv_init(kiln_backend *be)
{
    return cuda_ok(be, cudaFuncSetAttribute(conv2d_kernel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)conv_smem(CV_MAX_K)),
                   "cudaFuncSetAttribute(conv2d)");
}

void cuda_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                 const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                 const int pad[4])
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && w->ndim == 4 && y->ndim == 4 && stride >= 1 &&
                             w->shape[3] == x->shape[3] && y->shape[0] == x->shape[0] &&
                             y->shape[3] == w->shape[0] && y->data != x->data) ||
        CUDA_REQUIRE(be, x->dtype == KILN_BF16 && w->dtype == KILN_BF16 &&
                             y->dtype == KILN_BF16 && (!bias || is_act(bias))) ||
        CUDA_REQUIRE(be, !residual || (residual->dtype == KILN_BF16 &&
                                       residual->data != y->data &&
                                       kiln_tensor_numel(residual) == kiln_tensor_numel(y))))
        return;
    int64_t bsz = x->shape[0], h = x->shape[1], wd = x->shape[2], cin = x->shape[3];
    int64_t cout = w->shape[0], kh = w->shape[1], kw = w->shape[2];
    int64_t ho = (h + pad[0] + pad[2] - kh) / stride + 1;
    int64_t wo = (wd + pad[1] + pad[3] - kw) / stride + 1;
    /* The k table's offsets, up to (kh * W + kw) * Cin, are ints. */
    if (CUDA_REQUIRE(be, y->shape[1] == ho && y->shape[2] == wo && ho > 0 && wo > 0 &&
                             (!bias || kiln_tensor_numel(bias) == cout)) ||
        CUDA_REQUIRE(be, h * wd * cin < INT32_MAX && kh * (wd + kw) * cin < INT32_MAX &&
                             (cout + CV_BN - 1) / CV_BN <= 65535 && kh < 32768 && kw < 32768))
        return;
    if (cuda_cudnn_conv2d(be, y, x, w, bias, residual, stride, pad))
        return;
    if (cin * kh * kw > CV_MAX_K) {
        kiln_be_fail(be, KILN_ERR_UNSUPPORTED, "cuda conv2d: Cin*kh*kw = %lld is over %d",
                     (long long)(cin * kh * kw), CV_MAX_K);
        return;
    }
    int64_t npix = bsz * ho * wo;
    if (!npix || !cout || !cuda_enter(be))
        return;
    conv_params p;
    p.x = (const bf16 *)x->data;
    p.w = (const bf16 *)w->data;
    p.bias = bias ? bias->data : NULL;
    p.bias_bf16 = bias ? is_bf16(bias) : 0;
    p.res = residual ? (const bf16 *)residual->data : NULL;
    p.y = (bf16 *)y->data;
    p.cin = (int)cin;
    p.h = (int)h;
    p.wd = (int)wd;
    p.cout = (int)cout;
    p.kh = (int)kh;
    p.kw = (int)kw;
    p.stride = stride;
    p.pad_top = pad[0];
    p.pad_left = pad[1];
    p.ho = (int)ho;
    p.wo = (int)wo;
    p.k = (int)(cin * kh * kw);
    p.npix = npix;
    p.vec_w = p.k % 8 == 0 && (uintptr_t)w->data % 16 == 0;
    p.vec_x = p.cin % 8 == 0 && (uintptr_t)x->data % 16 == 0;
    dim3 grid((unsigned)((npix + CV_BM - 1) / CV_BM), (unsigned)((cout + CV_BN - 1) / CV_BN));
    conv2d_kernel<<<grid, CV_THREADS, conv_smem(p.k), cuda_stream(be)>>>(p);
    cuda_launched(be, "conv2d");
}
