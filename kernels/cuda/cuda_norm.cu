/* CUDA normalisations: RMSNorm (whole rows or per-head groups), LayerNorm
 * without affine followed by adaLN modulation, GroupNorm with optional SiLU.
 * Statistics are fp32, never E[x^2] - E[x]^2: RMSNorm's and LayerNorm's
 * mean and variance are two passes over the row (the second from cache),
 * GroupNorm's Welford updates merged with Chan et al.'s formulas. */
#include "cuda_internal.cuh"

/* One warp per group of g elements.  transformers' Qwen3RMSNorm and
 * diffusers' RMSNorm cast the normalised value to bf16 before multiplying
 * by the bf16 weight; with a bf16 output we round at the same point.  In
 * place is safe: each lane rewrites only elements it has already read. */
__global__ void rms_norm_kernel(void *y, int ybf, const void *x, int xbf, const void *w, int wbf,
                                int64_t rows, int64_t g, float eps)
{
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += nwarps) {
        int64_t base = r * g;
        float ss = 0;
        for (int64_t i = lane; i < g; i += 32) {
            float v = ld_act(x, base + i, xbf);
            ss += v * v;
        }
        float inv = rsqrtf(warp_sum(ss) / (float)g + eps);
        for (int64_t i = lane; i < g; i += 32) {
            float v = rnd_act(ld_act(x, base + i, xbf) * inv, ybf);
            st_act(y, base + i, v * ld_act(w, i, wbf), ybf);
        }
    }
}

/* The same for whole bf16 hidden vectors (g a multiple of 256): a lane
 * moves 8 consecutive elements a 16-byte load, so a row of 2560 (Qwen3-4B)
 * is 10 loads a lane instead of 80 (the element kernel took ~20 us for 512
 * such rows: latency, not bandwidth).  Its sum of squares runs in another
 * order than the element kernel's, so per-head norms, which qkv_split
 * reproduces bit for bit, stay on that one. */
__global__ void rms_norm_vec_kernel(bf16 *y, const bf16 *x, const bf16 *w, int64_t rows,
                                    int64_t g, float eps)
{
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5, g8 = g / 8;
    for (int64_t r = warp; r < rows; r += nwarps) {
        const uint4 *xr = (const uint4 *)(x + r * g);
        uint4 *yr = (uint4 *)(y + r * g);
        float ss = 0;
        for (int64_t i = lane; i < g8; i += 32) {
            uint4 v = xr[i];
            const bf16 *e = (const bf16 *)&v;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float f = __bfloat162float(e[k]);
                ss += f * f;
            }
        }
        float inv = rsqrtf(warp_sum(ss) / (float)g + eps);
        for (int64_t i = lane; i < g8; i += 32) {
            uint4 v = xr[i], wv = ((const uint4 *)w)[i];
            bf16 *e = (bf16 *)&v;
            const bf16 *we = (const bf16 *)&wv;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float f = __bfloat162float(__float2bfloat16_rn(__bfloat162float(e[k]) * inv));
                e[k] = __float2bfloat16_rn(f * __bfloat162float(we[k]));
            }
            yr[i] = v;
        }
    }
}

static unsigned warp_blocks(kiln_backend *be, int64_t rows)
{
    int64_t want = (rows + 7) / 8, cap = (int64_t)cuda_of(be)->num_sms * 64;
    return (unsigned)(want < cap ? want : cap);
}

void cuda_rms_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                   float eps)
{
    int64_t g = kiln_tensor_numel(w), n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, g > 0 && n % g == 0 && kiln_tensor_numel(y) == n && is_act(x) &&
                             is_act(y) && is_act(w)) ||
        !n || !cuda_enter(be))
        return;
    if (g > 256 && g % 256 == 0 && is_bf16(x) && is_bf16(y) && is_bf16(w) &&
        ((uintptr_t)x->data | (uintptr_t)y->data | (uintptr_t)w->data) % 16 == 0) {
        rms_norm_vec_kernel<<<warp_blocks(be, n / g), 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)x->data, (const bf16 *)w->data, n / g, g, eps);
        cuda_launched(be, "rms_norm");
        return;
    }
    rms_norm_kernel<<<warp_blocks(be, n / g), 256, 0, cuda_stream(be)>>>(
        y->data, is_bf16(y), x->data, is_bf16(x), w->data, is_bf16(w), n / g, g, eps);
    cuda_launched(be, "rms_norm");
}

/* diffusers (FLUX.2): LayerNorm output is a bf16 tensor, then (1 + scale),
 * the product and the shift are bf16 ops in turn. */
__global__ void layer_norm_mod_kernel(void *y, int ybf, const void *x, int xbf, const void *shift,
                                      int shbf, const void *scale, int scbf, int64_t rows,
                                      int64_t s, int64_t d, float eps)
{
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    for (int64_t r = warp; r < rows; r += nwarps) {
        int64_t base = r * d, mod = (r / s) * d;
        float sum = 0;
        for (int64_t i = lane; i < d; i += 32)
            sum += ld_act(x, base + i, xbf);
        float mean = warp_sum(sum) / (float)d, var = 0;
        for (int64_t i = lane; i < d; i += 32) {
            float v = ld_act(x, base + i, xbf) - mean;
            var += v * v;
        }
        float inv = rsqrtf(warp_sum(var) / (float)d + eps);
        for (int64_t i = lane; i < d; i += 32) {
            float v = rnd_act((ld_act(x, base + i, xbf) - mean) * inv, ybf);
            if (scale)
                v = rnd_act(v * rnd_act(1.0f + ld_act(scale, mod + i, scbf), ybf), ybf);
            if (shift)
                v += ld_act(shift, mod + i, shbf);
            st_act(y, base + i, v, ybf);
        }
    }
}

/* The same for all-bf16 operands with d % 8 == 0: 16-byte loads and stores
 * (the three passes over a row read it from L1 after the first). */
__global__ void layer_norm_mod_vec_kernel(bf16 *y, const bf16 *x, const bf16 *shift,
                                          const bf16 *scale, int64_t rows, int64_t s, int64_t d8,
                                          float eps)
{
    int lane = threadIdx.x & 31;
    int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
    const float d = (float)(d8 * 8);
    for (int64_t r = warp; r < rows; r += nwarps) {
        const uint4 *xr = (const uint4 *)x + r * d8;
        float sum = 0;
        for (int64_t c = lane; c < d8; c += 32) {
            uint4 v = xr[c];
            const bf16 *e = (const bf16 *)&v;
#pragma unroll
            for (int j = 0; j < 8; j++)
                sum += __bfloat162float(e[j]);
        }
        float mean = warp_sum(sum) / d, var = 0;
        for (int64_t c = lane; c < d8; c += 32) {
            uint4 v = xr[c];
            const bf16 *e = (const bf16 *)&v;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float t = __bfloat162float(e[j]) - mean;
                var += t * t;
            }
        }
        float inv = rsqrtf(warp_sum(var) / d + eps);
        const uint4 *sh = shift ? (const uint4 *)shift + (r / s) * d8 : NULL;
        const uint4 *sc = scale ? (const uint4 *)scale + (r / s) * d8 : NULL;
        uint4 *yr = (uint4 *)y + r * d8;
        for (int64_t c = lane; c < d8; c += 32) {
            uint4 v = xr[c], a4, b4, o4;
            if (sc)
                a4 = sc[c];
            if (sh)
                b4 = sh[c];
            const bf16 *e = (const bf16 *)&v, *av = (const bf16 *)&a4, *bv = (const bf16 *)&b4;
            bf16 *o = (bf16 *)&o4;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float t = rnd_act((__bfloat162float(e[j]) - mean) * inv, 1);
                if (sc)
                    t = rnd_act(t * rnd_act(1.0f + __bfloat162float(av[j]), 1), 1);
                if (sh)
                    t += __bfloat162float(bv[j]);
                o[j] = __float2bfloat16_rn(t);
            }
            yr[c] = o4;
        }
    }
}

void cuda_layer_norm_mod(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                         const kiln_tensor *shift, const kiln_tensor *scale, float eps)
{
    if (CUDA_REQUIRE(be, x->ndim == 3 && kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                             is_act(x) && is_act(y)))
        return;
    int64_t bsz = x->shape[0], s = x->shape[1], d = x->shape[2];
    if (CUDA_REQUIRE(be, (!shift || (kiln_tensor_numel(shift) == bsz * d && is_act(shift))) &&
                             (!scale || (kiln_tensor_numel(scale) == bsz * d && is_act(scale)))) ||
        !bsz || !s || !d || !cuda_enter(be))
        return;
    if (is_bf16(x) && is_bf16(y) && (!shift || is_bf16(shift)) && (!scale || is_bf16(scale)) &&
        d % 8 == 0 &&
        ((uintptr_t)x->data | (uintptr_t)y->data | (uintptr_t)(shift ? shift->data : NULL) |
         (uintptr_t)(scale ? scale->data : NULL)) % 16 == 0) {
        layer_norm_mod_vec_kernel<<<warp_blocks(be, bsz * s), 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)x->data, shift ? (const bf16 *)shift->data : NULL,
            scale ? (const bf16 *)scale->data : NULL, bsz * s, s, d / 8, eps);
        cuda_launched(be, "layer_norm_mod");
        return;
    }
    layer_norm_mod_kernel<<<warp_blocks(be, bsz * s), 256, 0, cuda_stream(be)>>>(
        y->data, is_bf16(y), x->data, is_bf16(x), shift ? shift->data : NULL,
        shift ? is_bf16(shift) : 0, scale ? scale->data : NULL, scale ? is_bf16(scale) : 0,
        bsz * s, s, d, eps);
    cuda_launched(be, "layer_norm_mod");
}

/* --- GroupNorm, channels last ------------------------------------------------
 * x (B, H, W, C): B rows of P = H * W pixels, groups of cpg = C / groups
 * consecutive channels.  Three kernels, none with atomics, so the same
 * input gives the same bits:
 *   gn_chunk_kernel  block (s, b) takes pixels [s * chunk, (s + 1) * chunk)
 *                    of row b and writes each group's (mean, M2) over them;
 *   gn_merge_kernel  block (b, g) merges group g's chunk moments, in double
 *                    and a fixed order, into its running (mean, M2);
 *   gn_apply_kernel  the normalisation, a pass of elementwise work.
 * group_norm is stats (into scratch) then apply.
 *
 * The chunk and apply kernels share one block shape: a pixel's C channels
 * are ncol = ceil(C / 8) columns of 8, a thread keeps one column for the
 * whole block (so its channels, their groups, weights and biases are set
 * once), and rows = GN_THREADS / ncol threads share a column, taking pixels
 * rows apart: a block's threads read consecutive pixels, contiguous memory.
 * A column is one 16-byte load for bf16 with C % 8 == 0 and aligned
 * pointers, else up to 8 element loads; the arithmetic after the load is
 * the same either way, so both paths give the same bits. */
#define GN_THREADS 256
#define GN_MAX_C (8 * GN_THREADS) /* every column a thread */
#define GN_UNROLL 4               /* loads in flight per thread */

/* Pixels of a chunk of n that row `row` of `rows` takes: row, row + rows, ... */
__device__ __forceinline__ int64_t gn_row_pixels(int64_t n, int row, int rows)
{
    return row < n ? (n - 1 - row) / rows + 1 : 0;
}

/* A column's 8 channels: unpacked from a 16-byte vector (the vector path
 * loads GN_UNROLL of them before using the first), or loaded one by one
 * (nch of them real).  Either way the values that follow are the same. */
__device__ __forceinline__ void gn_unpack(float f[8], uint4 v)
{
    const bf16 *e = (const bf16 *)&v;
#pragma unroll
    for (int j = 0; j < 8; j++)
        f[j] = __bfloat162float(e[j]);
}

__device__ __forceinline__ void gn_load(float f[8], const void *x, int xbf, int64_t off, int nch)
{
#pragma unroll
    for (int j = 0; j < 8; j++)
        f[j] = j < nch ? ld_act(x, off + j, xbf) : 0.0f;
}

/* The vector path's loads of pixels k .. k + U - 1 (those below kn) of a
 * thread's column, all issued before the first is used. */
template <bool VEC, int U>
__device__ __forceinline__ void gn_prefetch(uint4 raw[U], const void *x, int64_t off,
                                            int64_t step, int64_t k, int64_t kn)
{
    if (VEC) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (k + u < kn)
                raw[u] = *(const uint4 *)((const bf16 *)x + off + (k + u) * step);
    }
}

/* A pixel's column as floats: its prefetched vector, or loaded now. */
template <bool VEC>
__device__ __forceinline__ void gn_fetch(float f[8], const uint4 &raw, const void *x, int xbf,
                                         int64_t at, int nch)
{
    if (VEC)
        gn_unpack(f, raw);
    else
        gn_load(f, x, xbf, at, nch);
}

template <bool VEC>
__device__ __forceinline__ void gn_store(void *y, int ybf, int64_t off, const float f[8], int nch)
{
    if (VEC) {
        uint4 v;
        bf16 *e = (bf16 *)&v;
#pragma unroll
        for (int j = 0; j < 8; j++)
            e[j] = __float2bfloat16_rn(f[j]);
        *(uint4 *)((bf16 *)y + off) = v;
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < nch)
                st_act(y, off + j, f[j], ybf);
    }
}

/* Each thread runs Welford's update per channel over its pixels (in fp32:
 * a few hundred values); the block then merges, per group, the moments of
 * its channels in every row with Chan et al.'s formulas for many sets,
 * mean = sum n_i mean_i / n and M2 = sum (M2_i + n_i (mean_i - mean)^2),
 * one warp a group.  part (B, splits, groups, 2). */
template <bool VEC>
__global__ void __launch_bounds__(GN_THREADS)
    gn_chunk_kernel(float *part, const void *x, int xbf, int64_t pixels, int64_t chunk, int c,
                    int groups)
{
    extern __shared__ float gn_smem[]; /* mean, then M2, of each (row, channel) */
    const int64_t b = blockIdx.y, p0 = blockIdx.x * chunk;
    const int64_t n = chunk < pixels - p0 ? chunk : pixels - p0;
    const int ncol = (c + 7) / 8, rows = GN_THREADS / ncol, width = ncol * 8;
    const int row = threadIdx.x / ncol, c0 = threadIdx.x % ncol * 8;
    float *smean = gn_smem, *sm2 = gn_smem + rows * width;
    if (row < rows) {
        float mean[8], m2[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            mean[j] = m2[j] = 0.0f;
        const int nch = c - c0 < 8 ? c - c0 : 8;
        const int64_t kn = gn_row_pixels(n, row, rows), step = (int64_t)rows * c;
        const int64_t off = (b * pixels + p0 + row) * c + c0;
        constexpr int U = VEC ? GN_UNROLL : 1;
        for (int64_t k = 0; k < kn; k += U) {
            uint4 raw[U];
            gn_prefetch<VEC, U>(raw, x, off, step, k, kn);
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (k + u >= kn)
                    break;
                float f[8];
                gn_fetch<VEC>(f, raw[u], x, xbf, off + (k + u) * step, nch);
                const float rk = __frcp_rn((float)(k + u + 1));
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    float d = f[j] - mean[j];
                    mean[j] = __fmaf_rn(d, rk, mean[j]);
                    m2[j] = __fmaf_rn(d, f[j] - mean[j], m2[j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            smean[row * width + c0 + j] = mean[j];
            sm2[row * width + c0 + j] = m2[j];
        }
    }
    __syncthreads();
    /* Set e of group g: channel g * cpg + e % cpg of row e / cpg. */
    const int lane = threadIdx.x & 31, cpg = c / groups, sets = cpg * rows;
    const float total = (float)(cpg * n);
    for (int g = threadIdx.x >> 5; g < groups; g += GN_THREADS / 32) {
        float s = 0.0f;
        for (int e = lane; e < sets; e += 32) {
            const int r = e / cpg;
            s += (float)gn_row_pixels(n, r, rows) * smean[r * width + g * cpg + e % cpg];
        }
        const float mean = warp_sum(s) / total;
        float q = 0.0f;
        for (int e = lane; e < sets; e += 32) {
            const int r = e / cpg, i = r * width + g * cpg + e % cpg;
            const float d = smean[i] - mean;
            q += sm2[i] + (float)gn_row_pixels(n, r, rows) * d * d;
        }
        q = warp_sum(q);
        if (lane == 0) {
            float *o = part + ((b * gridDim.x + blockIdx.x) * groups + g) * 2;
            o[0] = mean;
            o[1] = q;
        }
    }
}

/* Sum over a block of GN_THREADS threads in double, in a fixed order; every
 * thread gets the same result.  `red` holds GN_THREADS / 32 doubles. */
__device__ __forceinline__ double gn_block_sum(double v, double *red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red's previous use is read */
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < GN_THREADS / 32 ? red[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Block b * groups + g merges group g's chunk moments and its running
 * (mean, M2) over count_before elements (none when 0: stats' old contents
 * are ignored) with the many-set formulas above, in double; each thread
 * takes every GN_THREADS-th chunk in order and the block sums in a fixed
 * tree, so the result never depends on scheduling. */
__global__ void __launch_bounds__(GN_THREADS)
    gn_merge_kernel(float *stats, const float *part, int64_t splits, int64_t pixels,
                    int64_t chunk, int groups, int64_t cpg, int64_t count_before)
{
    __shared__ double red[GN_THREADS / 32];
    const int64_t b = blockIdx.x / groups, g = blockIdx.x % groups;
    float *st = stats + (int64_t)blockIdx.x * 2;
    const double cb = (double)count_before;
    const double mean0 = count_before ? st[0] : 0.0, m20 = count_before ? st[1] : 0.0;
    double s = 0;
    for (int64_t i = threadIdx.x; i < splits; i += GN_THREADS) {
        const int64_t hi = (i + 1) * chunk < pixels ? (i + 1) * chunk : pixels;
        s += (double)(cpg * (hi - i * chunk)) * part[((b * splits + i) * groups + g) * 2];
    }
    const double mean = (cb * mean0 + gn_block_sum(s, red)) / (cb + (double)(cpg * pixels));
    double q = 0;
    for (int64_t i = threadIdx.x; i < splits; i += GN_THREADS) {
        const int64_t hi = (i + 1) * chunk < pixels ? (i + 1) * chunk : pixels;
        const float *pm = part + ((b * splits + i) * groups + g) * 2;
        const double d = pm[0] - mean;
        q += pm[1] + (double)(cpg * (hi - i * chunk)) * d * d;
    }
    q = gn_block_sum(q, red) + m20 + cb * (mean0 - mean) * (mean0 - mean);
    if (threadIdx.x == 0) {
        st[0] = (float)mean;
        st[1] = (float)q;
    }
}

/* (x - mean) * inv * w + b with every rounding spelled out, so that the
 * element and the vector kernel give the same bits (left to itself nvcc
 * contracts the two loops' expressions into different FMAs). */
__device__ __forceinline__ float gn_affine(float x, float mean, float inv, float w, float b)
{
    return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), inv), w, b);
}

/* diffusers' VAE: GroupNorm output rounded to the activation dtype, then SiLU. */
__device__ __forceinline__ float gn_silu(float v, int ybf)
{
    v = rnd_act(v, ybf);
    return __fdiv_rn(v, __fadd_rn(1.0f, __expf(-v)));
}

/* y = (x - mean) * inv * w + b, optional SiLU, with stats (B, groups, 2)
 * holding each group's (mean, M2) over count elements.  The block first
 * turns its row's stats into each channel's (mean, inv) in shared memory
 * (registers for them made the vector kernel too big for three blocks a
 * multiprocessor); each thread holds its 8 channels' weights and biases.
 * y may alias x: a thread reads each of its elements before writing it. */
template <bool VEC>
__global__ void __launch_bounds__(GN_THREADS, 3)
    gn_apply_kernel(void *y, int ybf, const void *x, int xbf, const float *stats, int64_t count,
                    const void *w, int wbf, const void *bias, int bbf, int64_t pixels,
                    int64_t chunk, int c, int groups, float eps, int silu)
{
    extern __shared__ float2 gn_chan[]; /* (mean, inv) of each channel */
    const int64_t b = blockIdx.y, p0 = blockIdx.x * chunk;
    const int64_t n = chunk < pixels - p0 ? chunk : pixels - p0;
    const int cpg = c / groups;
    for (int ch = threadIdx.x; ch < c; ch += GN_THREADS) {
        const float *st = stats + (b * groups + ch / cpg) * 2;
        gn_chan[ch] = make_float2(st[0], rsqrtf((float)((double)st[1] / (double)count) + eps));
    }
    __syncthreads();
    const int ncol = (c + 7) / 8, rows = GN_THREADS / ncol;
    const int row = threadIdx.x / ncol, c0 = threadIdx.x % ncol * 8;
    if (row >= rows)
        return;
    const int nch = c - c0 < 8 ? c - c0 : 8;
    const float2 *mi = gn_chan + c0;
    float wc[8], bc[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int ch = j < nch ? c0 + j : c - 1; /* a channel past C is never stored */
        wc[j] = ld_act(w, ch, wbf);
        bc[j] = ld_act(bias, ch, bbf);
    }
    const int64_t kn = gn_row_pixels(n, row, rows), step = (int64_t)rows * c;
    const int64_t off = (b * pixels + p0 + row) * c + c0;
    constexpr int U = VEC ? GN_UNROLL : 1;
    for (int64_t k = 0; k < kn; k += U) {
        uint4 raw[U];
        gn_prefetch<VEC, U>(raw, x, off, step, k, kn);
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (k + u >= kn)
                break;
            float f[8];
            gn_fetch<VEC>(f, raw[u], x, xbf, off + (k + u) * step, nch);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const float v = gn_affine(f[j], mi[j].x, mi[j].y, wc[j], bc[j]);
                f[j] = silu ? gn_silu(v, ybf) : v;
            }
            gn_store<VEC>(y, ybf, off + (k + u) * step, f, nch);
        }
    }
}

/* One call's shape and its cut into chunks of pixels, one block each. */
typedef struct gn_call {
    int64_t bsz, pixels, splits, chunk;
    int c, groups;
} gn_call;

/* Checks x (B, H, W, C) for `groups` and plans the chunks: about 32 blocks
 * per multiprocessor in all (a short last wave), but at least 16K elements
 * a block.  Returns 1 when there is work (0 also after a failed check). */
static int gn_call_of(kiln_backend *be, const kiln_tensor *x, int groups, gn_call *k)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[3] % groups == 0 && is_act(x)) ||
        CUDA_REQUIRE(be, x->shape[3] <= GN_MAX_C && x->shape[0] <= 65535))
        return 0;
    k->bsz = x->shape[0];
    k->pixels = x->shape[1] * x->shape[2];
    k->c = (int)x->shape[3];
    k->groups = groups;
    if (!k->bsz || !k->pixels || !k->c)
        return 0;
    int64_t want = (32 * (int64_t)cuda_of(be)->num_sms + k->bsz - 1) / k->bsz;
    int64_t chunk = (k->pixels + want - 1) / want, least = (16384 + k->c - 1) / k->c;
    k->chunk = chunk > least ? chunk : least;
    k->splits = (k->pixels + k->chunk - 1) / k->chunk; /* no empty chunk */
    return 1;
}

/* Merges x's moments into stats (B, groups, 2) over count_before elements,
 * through part (B * splits * groups * 2 floats).  1 when queued. */
static int gn_stats_run(kiln_backend *be, float *stats, float *part, const kiln_tensor *x,
                        const gn_call *k, int64_t count_before)
{
    dim3 grid((unsigned)k->splits, (unsigned)k->bsz);
    const int ncol = (k->c + 7) / 8;
    const size_t smem = 2 * (size_t)(GN_THREADS / ncol * ncol * 8) * sizeof(float);
    if (is_bf16(x) && k->c % 8 == 0 && (uintptr_t)x->data % 16 == 0)
        gn_chunk_kernel<true><<<grid, GN_THREADS, smem, cuda_stream(be)>>>(
            part, x->data, 1, k->pixels, k->chunk, k->c, k->groups);
    else
        gn_chunk_kernel<false><<<grid, GN_THREADS, smem, cuda_stream(be)>>>(
            part, x->data, is_bf16(x), k->pixels, k->chunk, k->c, k->groups);
    if (!cuda_launched(be, "group_norm_stats(chunks)"))
        return 0;
    gn_merge_kernel<<<(unsigned)(k->bsz * k->groups), GN_THREADS, 0, cuda_stream(be)>>>(
        stats, part, k->splits, k->pixels, k->chunk, k->groups, k->c / k->groups, count_before);
    return cuda_launched(be, "group_norm_stats(merge)");
}

static void gn_apply_run(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                         const kiln_tensor *w, const kiln_tensor *b, const float *stats,
                         int64_t count, const gn_call *k, float eps, int silu)
{
    dim3 grid((unsigned)k->splits, (unsigned)k->bsz);
    const size_t smem = (size_t)k->c * sizeof(float2);
    if (is_bf16(x) && is_bf16(y) && k->c % 8 == 0 &&
        ((uintptr_t)x->data | (uintptr_t)y->data) % 16 == 0)
        gn_apply_kernel<true><<<grid, GN_THREADS, smem, cuda_stream(be)>>>(
            y->data, 1, x->data, 1, stats, count, w->data, is_bf16(w), b->data, is_bf16(b),
            k->pixels, k->chunk, k->c, k->groups, eps, silu);
    else
        gn_apply_kernel<false><<<grid, GN_THREADS, smem, cuda_stream(be)>>>(
            y->data, is_bf16(y), x->data, is_bf16(x), stats, count, w->data, is_bf16(w),
            b->data, is_bf16(b), k->pixels, k->chunk, k->c, k->groups, eps, silu);
    cuda_launched(be, "group_norm_apply");
}

static int gn_affine_ok(kiln_backend *be, const kiln_tensor *y, const kiln_tensor *x,
                        const kiln_tensor *w, const kiln_tensor *b)
{
    return !CUDA_REQUIRE(be, x->ndim == 4 && kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                                 kiln_tensor_numel(w) == x->shape[3] &&
                                 kiln_tensor_numel(b) == x->shape[3] && is_act(y) &&
                                 is_act(w) && is_act(b));
}

void cuda_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                     const kiln_tensor *b, int groups, float eps, int silu)
{
    gn_call k;
    if (!gn_affine_ok(be, y, x, w, b) || !gn_call_of(be, x, groups, &k) || !cuda_enter(be))
        return;
    const int64_t nstats = k.bsz * groups * 2;
    float *stats = (float *)cuda_scratch(
        be, (size_t)(nstats + k.bsz * k.splits * groups * 2) * sizeof(float));
    if (stats && gn_stats_run(be, stats, stats + nstats, x, &k, 0))
        gn_apply_run(be, y, x, w, b, stats, k.c / groups * k.pixels, &k, eps, silu);
}

void cuda_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                           int64_t count_before)
{
    gn_call k;
    if (CUDA_REQUIRE(be, x->ndim == 4 && stats->dtype == KILN_F32 && count_before >= 0 &&
                             groups > 0 && kiln_tensor_numel(stats) == x->shape[0] * groups * 2) ||
        !gn_call_of(be, x, groups, &k) || !cuda_enter(be))
        return;
    float *part =
        (float *)cuda_scratch(be, (size_t)(k.bsz * k.splits * groups * 2) * sizeof(float));
    if (part)
        gn_stats_run(be, (float *)stats->data, part, x, &k, count_before);
}

void cuda_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                           const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                           int64_t count, int groups, float eps, int silu)
{
    gn_call k;
    if (!gn_affine_ok(be, y, x, w, b) ||
        CUDA_REQUIRE(be, stats->dtype == KILN_F32 && count > 0 && groups > 0 &&
                             kiln_tensor_numel(stats) == x->shape[0] * groups * 2) ||
        !gn_call_of(be, x, groups, &k) || !cuda_enter(be))
        return;
    gn_apply_run(be, y, x, w, b, (const float *)stats->data, count, &k, eps, silu);
}
