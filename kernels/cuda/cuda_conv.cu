/* CUDA 2-D convolution (NCHW, bf16) as an implicit GEMM on tensor cores:
 *   Y[co, p] = sum_k W[co, k] * X_col[k, p] + bias[co]
 * with k = (ci, ky, kx) in the weight's own order (so W is a plain row-major
 * Cout x K matrix) and p = (b, oy, ox) over the output pixels.  X_col is
 * never materialised: each 32 x 128 tile of it is gathered from x with the
 * zero padding applied on the fly.  Asymmetric padding (the VAE
 * downsampler's (0, 1, 0, 1)) falls out of the same index arithmetic.
 * cuDNN is not used because its legacy API takes symmetric padding only.
 *
 * A block of 8 warps computes a 128 (Cout) x 128 (pixel) tile, each warp a
 * 64 x 32 part with mma.sync m16n8k16 and fp32 accumulators.  The (ci, ky,
 * kx) decomposition of every k is tabulated once per block in shared memory
 * (no divisions in the gather), and the next K step's loads are in flight
 * in registers while the tensor cores work on the current one (two shared
 * memory stages, one barrier per step). */
#include "cuda_internal.cuh"
#include "cuda_mma.cuh"

#define CV_BM 128
#define CV_BN 128
#define CV_BK 32
#define CV_THREADS 256
#define CV_AS (CV_BK + 8) /* padded smem rows: conflict-free ldmatrix */
#define CV_BS (CV_BN + 8)
#define CV_TILE_BYTES ((2 * CV_BM * CV_AS + 2 * CV_BK * CV_BS) * 2)
#define CV_MAX_K 16384 /* the k table must fit in shared memory */

typedef struct conv_params {
    const bf16 *x, *w;
    const void *bias;
    int bias_bf16, vec_w;
    bf16 *y;
    int cin, h, wd, cout, kh, kw, stride, pad_top, pad_left, ho, wo, k;
    int64_t npix; /* B * ho * wo */
} conv_params;

/* One K step's global loads, held in registers until they are stored. */
typedef struct conv_regs {
    uint4 a[2]; /* 16 weights: two 8-wide chunks, or 16 scalars */
    bf16 b[16]; /* 16 gathered inputs of this thread's pixel */
} conv_regs;

__device__ __forceinline__ void conv_load(conv_regs *r, const conv_params &p, const int2 *ktab,
                                          int m0, int k0, bool px_ok, const bf16 *xb, int iy0,
                                          int ix0)
{
    const int tid = threadIdx.x;
    if (p.vec_w) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int c = tid + j * CV_THREADS, row = c >> 2, kk = k0 + (c & 3) * 8;
            r->a[j] = (m0 + row < p.cout && kk < p.k)
                          ? *(const uint4 *)(p.w + (int64_t)(m0 + row) * p.k + kk)
                          : make_uint4(0, 0, 0, 0);
        }
    } else {
        bf16 *a = (bf16 *)r->a;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int e = tid + i * CV_THREADS, row = e >> 5, kk = k0 + (e & 31);
            a[i] = (m0 + row < p.cout && kk < p.k) ? p.w[(int64_t)(m0 + row) * p.k + kk]
                                                   : __float2bfloat16_rn(0.0f);
        }
    }
#pragma unroll
    for (int i = 0; i < 16; i++) {
        int kk = k0 + (tid >> 7) + 2 * i;
        bf16 v = __float2bfloat16_rn(0.0f);
        if (px_ok && kk < p.k) {
            int2 e = ktab[kk];
            int iy = iy0 + (e.y >> 16), ix = ix0 + (e.y & 0xffff);
            if (iy >= 0 && iy < p.h && ix >= 0 && ix < p.wd)
                v = xb[e.x + iy0 * p.wd + ix0];
        }
        r->b[i] = v;
    }
}

__device__ __forceinline__ void conv_store(const conv_regs *r, const conv_params &p, bf16 *sa,
                                           bf16 *sb)
{
    const int tid = threadIdx.x;
    if (p.vec_w) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int c = tid + j * CV_THREADS;
            *(uint4 *)(sa + (c >> 2) * CV_AS + (c & 3) * 8) = r->a[j];
        }
    } else {
        const bf16 *a = (const bf16 *)r->a;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int e = tid + i * CV_THREADS;
            sa[(e >> 5) * CV_AS + (e & 31)] = a[i];
        }
    }
#pragma unroll
    for (int i = 0; i < 16; i++)
        sb[((tid >> 7) + 2 * i) * CV_BS + (tid & 127)] = r->b[i];
}

__global__ void __launch_bounds__(CV_THREADS) conv2d_kernel(const conv_params p)
{
    extern __shared__ __align__(16) unsigned char cv_smem[];
    bf16 *sa = (bf16 *)cv_smem;     /* 2 stages of CV_BM x CV_AS */
    bf16 *sb = sa + 2 * CV_BM * CV_AS; /* 2 stages of CV_BK x CV_BS */
    int2 *ktab = (int2 *)(cv_smem + CV_TILE_BYTES);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * CV_BM;
    const int64_t n0 = (int64_t)blockIdx.x * CV_BN;
    const int64_t plane = (int64_t)p.ho * p.wo;

    /* k -> (offset of (ci, ky, kx) in one image, ky << 16 | kx). */
    const int khw = p.kh * p.kw, hw = p.h * p.wd;
    for (int k = tid; k < p.k; k += CV_THREADS) {
        int ci = k / khw, rem = k % khw, ky = rem / p.kw, kx = rem % p.kw;
        ktab[k] = make_int2(ci * hw + ky * p.wd + kx, (ky << 16) | kx);
    }

    /* The pixel this thread gathers for: fixed for the whole K loop. */
    const int64_t px = n0 + (tid & 127);
    const bool px_ok = px < p.npix;
    int iy0 = 0, ix0 = 0;
    const bf16 *xb = p.x;
    if (px_ok) {
        int64_t bimg = px / plane, r = px % plane;
        iy0 = (int)(r / p.wo) * p.stride - p.pad_top;
        ix0 = (int)(r % p.wo) * p.stride - p.pad_left;
        xb = p.x + bimg * p.cin * hw;
    }
    __syncthreads();

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    conv_regs regs;
    conv_load(&regs, p, ktab, m0, 0, px_ok, xb, iy0, ix0);
    conv_store(&regs, p, sa, sb);
    __syncthreads();
    const int steps = (p.k + CV_BK - 1) / CV_BK;
    for (int s = 0; s < steps; s++) {
        const int cur = s & 1;
        if (s + 1 < steps)
            conv_load(&regs, p, ktab, m0, (s + 1) * CV_BK, px_ok, xb, iy0, ix0);
        const bf16 *ca = sa + cur * CV_BM * CV_AS, *cb = sb + cur * CV_BK * CV_BS;
#pragma unroll
        for (int ks = 0; ks < CV_BK; ks += 16) {
            uint32_t a[4][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++)
                ldsm_x4(a[mi], ca + (wm * 64 + mi * 16 + (lane & 15)) * CV_AS + ks + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                uint32_t r[4];
                ldsm_x4_trans(r, cb + (ks + ((lane >> 3) & 1) * 8 + (lane & 7)) * CV_BS + wn * 32 +
                                     np * 16 + (lane >> 4) * 8);
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
            conv_store(&regs, p, sa + (cur ^ 1) * CV_BM * CV_AS, sb + (cur ^ 1) * CV_BK * CV_BS);
        __syncthreads();
    }

#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int nb = 0; nb < 4; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int co = m0 + wm * 64 + mi * 16 + g + (e >> 1) * 8;
                int64_t pix = n0 + wn * 32 + nb * 8 + 2 * t + (e & 1);
                if (co >= p.cout || pix >= p.npix)
                    continue;
                float v = acc[mi][nb][e];
                if (p.bias)
                    v += ld_act(p.bias, co, p.bias_bf16);
                int64_t bimg = pix / plane, r = pix % plane;
                p.y[(bimg * p.cout + co) * plane + r] = __float2bfloat16_rn(v);
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
                 const kiln_tensor *bias, int stride, const int pad[4])
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && w->ndim == 4 && y->ndim == 4 && stride >= 1 &&
                             w->shape[1] == x->shape[1] && y->shape[0] == x->shape[0] &&
                             y->shape[1] == w->shape[0] && y->data != x->data) ||
        CUDA_REQUIRE(be, x->dtype == KILN_BF16 && w->dtype == KILN_BF16 &&
                             y->dtype == KILN_BF16 && (!bias || is_act(bias))))
        return;
    int64_t bsz = x->shape[0], cin = x->shape[1], h = x->shape[2], wd = x->shape[3];
    int64_t cout = w->shape[0], kh = w->shape[2], kw = w->shape[3];
    int64_t ho = (h + pad[0] + pad[2] - kh) / stride + 1;
    int64_t wo = (wd + pad[1] + pad[3] - kw) / stride + 1;
    if (CUDA_REQUIRE(be, y->shape[2] == ho && y->shape[3] == wo && ho > 0 && wo > 0 &&
                             (!bias || kiln_tensor_numel(bias) == cout)) ||
        CUDA_REQUIRE(be, cin * h * wd < INT32_MAX && (cout + CV_BM - 1) / CV_BM <= 65535 &&
                             kh < 32768 && kw < 32768))
        return;
    if (cuda_cudnn_conv2d(be, y, x, w, bias, stride, pad))
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
    dim3 grid((unsigned)((npix + CV_BN - 1) / CV_BN), (unsigned)((cout + CV_BM - 1) / CV_BM));
    conv2d_kernel<<<grid, CV_THREADS, conv_smem(p.k), cuda_stream(be)>>>(p);
    cuda_launched(be, "conv2d");
}
