/* CUDA 2-D convolution (NCHW, bf16) as an implicit GEMM on tensor cores:
 *   Y[co, p] = sum_k W[co, k] * X_col[k, p] + bias[co]
 * with k = (ci, ky, kx) in the weight's own order (so W is a plain row-major
 * Cout x K matrix) and p = (b, oy, ox) over the output pixels.  X_col is
 * never materialised: each 32 x 64 tile of it is gathered from x into shared
 * memory with the zero padding applied on the fly.  Asymmetric padding (the
 * VAE downsampler's (0, 1, 0, 1)) falls out of the same index arithmetic.
 * cuDNN is not used because its legacy API takes symmetric padding only.
 *
 * A block of 4 warps computes a 64 (Cout) x 64 (pixel) tile; each warp a
 * 32 x 32 quarter with mma.sync m16n8k16, fp32 accumulators. */
#include "cuda_internal.cuh"
#include "cuda_mma.cuh"

#define CV_BM 64
#define CV_BN 64
#define CV_BK 32
#define CV_THREADS 128
#define CV_AS (CV_BK + 8) /* padded smem rows: conflict-free ldmatrix */
#define CV_BS (CV_BN + 8)

typedef struct conv_params {
    const bf16 *x, *w;
    const void *bias;
    int bias_bf16;
    bf16 *y;
    int cin, h, wd, cout, kh, kw, stride, pad_top, pad_left, ho, wo;
    int64_t k, npix; /* K = cin * kh * kw; npix = B * ho * wo */
} conv_params;

__global__ void __launch_bounds__(CV_THREADS) conv2d_kernel(const conv_params p)
{
    __shared__ __align__(16) bf16 sa[CV_BM * CV_AS];
    __shared__ __align__(16) bf16 sb[CV_BK * CV_BS];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;
    const int m0 = blockIdx.y * CV_BM;
    const int64_t n0 = (int64_t)blockIdx.x * CV_BN;
    const int khw = p.kh * p.kw;
    const int64_t plane = (int64_t)p.ho * p.wo;

    /* The pixel this thread gathers for: fixed for the whole K loop. */
    const int col = tid % CV_BN;
    const int64_t px = n0 + col;
    const bool px_ok = px < p.npix;
    int iy0 = 0, ix0 = 0;
    const bf16 *xb = p.x;
    if (px_ok) {
        int64_t bimg = px / plane, r = px % plane;
        iy0 = (int)(r / p.wo) * p.stride - p.pad_top;
        ix0 = (int)(r % p.wo) * p.stride - p.pad_left;
        xb = p.x + bimg * p.cin * p.h * p.wd;
    }

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    for (int64_t k0 = 0; k0 < p.k; k0 += CV_BK) {
        __syncthreads();
        /* W tile: 64 rows (co) x 32 (k), coalesced along k. */
#pragma unroll
        for (int i = 0; i < CV_BM * CV_BK / CV_THREADS; i++) {
            int e = tid + i * CV_THREADS, r = e / CV_BK, c = e % CV_BK;
            int64_t kk = k0 + c;
            sa[r * CV_AS + c] = (m0 + r < p.cout && kk < p.k) ? p.w[(int64_t)(m0 + r) * p.k + kk]
                                                              : __float2bfloat16_rn(0.0f);
        }
        /* X_col tile: 32 (k) x 64 (pixels), coalesced along the output row. */
#pragma unroll
        for (int i = 0; i < CV_BK * CV_BN / CV_THREADS; i++) {
            int kr = tid / CV_BN + i * (CV_THREADS / CV_BN);
            int64_t kk = k0 + kr;
            bf16 v = __float2bfloat16_rn(0.0f);
            if (px_ok && kk < p.k) {
                int ci = (int)(kk / khw), rem = (int)(kk % khw);
                int iy = iy0 + rem / p.kw, ix = ix0 + rem % p.kw;
                if (iy >= 0 && iy < p.h && ix >= 0 && ix < p.wd)
                    v = xb[((int64_t)ci * p.h + iy) * p.wd + ix];
            }
            sb[kr * CV_BS + col] = v;
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < CV_BK; ks += 16) {
            uint32_t a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                ldsm_x4(a[mi], sa + (wm * 32 + mi * 16 + (lane & 15)) * CV_AS + ks + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                uint32_t r[4];
                ldsm_x4_trans(r, sb + (ks + ((lane >> 3) & 1) * 8 + (lane & 7)) * CV_BS + wn * 32 +
                                     np * 16 + (lane >> 4) * 8);
                b[2 * np][0] = r[0];
                b[2 * np][1] = r[1];
                b[2 * np + 1][0] = r[2];
                b[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int nb = 0; nb < 4; nb++)
                    mma_bf16(acc[mi][nb], a[mi], b[nb][0], b[nb][1]);
        }
    }

#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int nb = 0; nb < 4; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int co = m0 + wm * 32 + mi * 16 + g + (e >> 1) * 8;
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

int cuda_conv_init(kiln_backend *be)
{
    cudaFuncAttributes attr;
    return cuda_ok(be, cudaFuncGetAttributes(&attr, conv2d_kernel), "cudaFuncGetAttributes(conv2d)");
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
        CUDA_REQUIRE(be, h < INT32_MAX && wd < INT32_MAX && cin * kh * kw < INT32_MAX &&
                             (cout + CV_BM - 1) / CV_BM <= 65535))
        return;
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
    p.k = cin * kh * kw;
    p.npix = npix;
    dim3 grid((unsigned)((npix + CV_BN - 1) / CV_BN), (unsigned)((cout + CV_BM - 1) / CV_BM));
    conv2d_kernel<<<grid, CV_THREADS, 0, cuda_stream(be)>>>(p);
    cuda_launched(be, "conv2d");
}
