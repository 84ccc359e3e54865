/* CUDA normalisations: RMSNorm (whole rows or per-head groups), LayerNorm
 * without affine followed by adaLN modulation, GroupNorm with optional SiLU.
 * Statistics are fp32; mean and variance are two passes over the row (the
 * second from cache), never E[x^2] - E[x]^2. */
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

/* GroupNorm in two launches so that a group of millions of elements (VAE
 * at full resolution) is spread over many blocks: gn_stats writes a (mean,
 * M2) pair per chunk of a group, gn_apply merges a group's pairs (Chan et
 * al.'s parallel variance) and normalises its chunk. */
__global__ void gn_stats_kernel(float *part, const void *x, int xbf, int64_t n, int64_t chunk)
{
    __shared__ float red[32];
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    const int64_t base = grp * n;
    float sum = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        sum += ld_act(x, base + i, xbf);
    float mean = block_sum(sum, red) / (float)(hi - lo), m2 = 0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = ld_act(x, base + i, xbf) - mean;
        m2 += v * v;
    }
    m2 = block_sum(m2, red);
    if (threadIdx.x == 0) {
        part[(grp * gridDim.x + blockIdx.x) * 2] = mean;
        part[(grp * gridDim.x + blockIdx.x) * 2 + 1] = m2;
    }
}

/* Running (count, mean, M2) of Chan et al., merged pairwise. */
struct gn_moments {
    float n, mean, m2;
};

__device__ __forceinline__ gn_moments gn_merge(gn_moments a, gn_moments b)
{
    float n = a.n + b.n;
    if (n == 0.0f)
        return a;
    float delta = b.mean - a.mean, fb = b.n / n;
    return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

__device__ __forceinline__ gn_moments gn_warp_merge(gn_moments m)
{
    for (int o = 16; o > 0; o >>= 1) {
        gn_moments u = {__shfl_xor_sync(0xffffffffu, m.n, o),
                        __shfl_xor_sync(0xffffffffu, m.mean, o),
                        __shfl_xor_sync(0xffffffffu, m.m2, o)};
        m = gn_merge(m, u);
    }
    return m;
}

/* gn_stats for bf16 with n and chunk multiples of 8: one pass instead of
 * two (the second pass of a 0.5 MB chunk came from DRAM, not cache), 16-byte
 * loads; each 8-element vector's exact two-pass moments are merged into the
 * thread's running ones, threads and warps merged the same way. */
__global__ void gn_stats_vec_kernel(float *part, const bf16 *x, int64_t n, int64_t chunk)
{
    __shared__ gn_moments red[32];
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    const uint4 *xv = (const uint4 *)(x + grp * n);
    gn_moments m = {0.0f, 0.0f, 0.0f};
    for (int64_t i = lo / 8 + threadIdx.x; i < hi / 8; i += blockDim.x) {
        uint4 v = xv[i];
        const bf16 *e = (const bf16 *)&v;
        float f[8], sum = 0, m2 = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            f[j] = __bfloat162float(e[j]);
            sum += f[j];
        }
        float mean = sum * 0.125f;
#pragma unroll
        for (int j = 0; j < 8; j++)
            m2 += (f[j] - mean) * (f[j] - mean);
        m = gn_merge(m, {8.0f, mean, m2});
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    m = gn_warp_merge(m);
    if (lane == 0)
        red[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? red[lane] : gn_moments{0.0f, 0.0f, 0.0f};
        m = gn_warp_merge(m);
        if (lane == 0) {
            part[(grp * gridDim.x + blockIdx.x) * 2] = m.mean;
            part[(grp * gridDim.x + blockIdx.x) * 2 + 1] = m.m2;
        }
    }
}

/* Merges a group's chunk moments (the same for every thread of the grid
 * row); double, as the pairs of a million-element group add up. */
__device__ __forceinline__ void gn_group_stats(const float *part, int64_t grp, int64_t n,
                                               int64_t chunk, float eps, float *fmean, float *inv)
{
    double cnt = 0, mean = 0, m2 = 0;
    for (unsigned s = 0; s < gridDim.x; s++) {
        int64_t slo = s * chunk, shi = slo + chunk < n ? slo + chunk : n;
        double nb = (double)(shi - slo), mb = part[(grp * gridDim.x + s) * 2];
        double delta = mb - mean, tot = cnt + nb;
        mean += delta * nb / tot;
        m2 += part[(grp * gridDim.x + s) * 2 + 1] + delta * delta * cnt * nb / tot;
        cnt = tot;
    }
    *fmean = (float)mean;
    *inv = rsqrtf((float)(m2 / cnt) + eps);
}

/* diffusers' VAE: GroupNorm (bf16 output) and then SiLU as a separate bf16 op. */
__global__ void gn_apply_kernel(void *y, int ybf, const void *x, int xbf, const float *part,
                                const void *w, int wbf, const void *b, int bbf, int64_t n,
                                int64_t chunk, int64_t hw, int64_t cpg, int groups, float eps,
                                int silu)
{
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    /* Every thread merges the few pairs itself: cheaper than a barrier. */
    float fmean, inv;
    gn_group_stats(part, grp, n, chunk, eps, &fmean, &inv);
    int64_t c0 = (grp % groups) * cpg, base = grp * n;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        int64_t c = c0 + i / hw;
        float v = (ld_act(x, base + i, xbf) - fmean) * inv * ld_act(w, c, wbf) + ld_act(b, c, bbf);
        if (silu) {
            v = rnd_act(v, ybf);
            v = v / (1.0f + __expf(-v));
        }
        st_act(y, base + i, v, ybf);
    }
}

/* gn_apply for bf16 x and y with hw % 8 == 0: the 8 elements of a vector
 * share a channel; same arithmetic as gn_apply_kernel. */
__global__ void gn_apply_vec_kernel(bf16 *y, const bf16 *x, const float *part, const void *w,
                                    int wbf, const void *b, int bbf, int64_t n, int64_t chunk,
                                    int64_t hw, int64_t cpg, int groups, float eps, int silu)
{
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    float fmean, inv;
    gn_group_stats(part, grp, n, chunk, eps, &fmean, &inv);
    int64_t c0 = (grp % groups) * cpg, base = grp * n;
    const uint4 *xv = (const uint4 *)(x + base);
    uint4 *yv = (uint4 *)(y + base);
    for (int64_t i = lo / 8 + threadIdx.x; i < hi / 8; i += blockDim.x) {
        int64_t c = c0 + i * 8 / hw;
        float wc = ld_act(w, c, wbf), bc = ld_act(b, c, bbf);
        uint4 v = xv[i], o4;
        const bf16 *e = (const bf16 *)&v;
        bf16 *o = (bf16 *)&o4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float t = (__bfloat162float(e[j]) - fmean) * inv * wc + bc;
            if (silu) {
                t = rnd_act(t, 1);
                t = t / (1.0f + __expf(-t));
            }
            o[j] = __float2bfloat16_rn(t);
        }
        yv[i] = o4;
    }
}

/* How a group of n elements is cut into chunks, one block each: about
 * eight blocks per multiprocessor in all, at least 2048 elements each, at
 * most 64 chunks a group; whole 8-element vectors for the vector kernels
 * (n is then a multiple of 8). */
static void gn_plan(kiln_backend *be, int64_t ngroups, int64_t n, int vec, int64_t *splits_out,
                    int64_t *chunk_out)
{
    int64_t splits = (8 * cuda_of(be)->num_sms + ngroups - 1) / ngroups;
    int64_t most = (n + 2047) / 2048;
    if (splits > most)
        splits = most;
    if (splits > 64)
        splits = 64;
    if (splits < 1)
        splits = 1;
    int64_t chunk = (n + splits - 1) / splits;
    if (vec)
        chunk = (chunk + 7) / 8 * 8;
    *chunk_out = chunk;
    *splits_out = (n + chunk - 1) / chunk; /* no empty chunk */
}

void cuda_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                     const kiln_tensor *b, int groups, float eps, int silu)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 &&
                             kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                             kiln_tensor_numel(w) == x->shape[1] &&
                             kiln_tensor_numel(b) == x->shape[1] && is_act(x) && is_act(y) &&
                             is_act(w) && is_act(b)))
        return;
    int64_t ngroups = x->shape[0] * groups, cpg = x->shape[1] / groups;
    int64_t hw = x->shape[2] * x->shape[3], n = cpg * hw;
    if (!ngroups || !n || CUDA_REQUIRE(be, ngroups <= 65535) || !cuda_enter(be))
        return;
    int vec = is_bf16(x) && is_bf16(y) && hw % 8 == 0 &&
              ((uintptr_t)x->data | (uintptr_t)y->data) % 16 == 0;
    int64_t splits, chunk;
    gn_plan(be, ngroups, n, vec, &splits, &chunk);
    float *part = (float *)cuda_scratch(be, (size_t)(ngroups * splits * 2) * sizeof(float));
    if (!part)
        return;
    dim3 grid((unsigned)splits, (unsigned)ngroups);
    if (vec) {
        gn_stats_vec_kernel<<<grid, 256, 0, cuda_stream(be)>>>(part, (const bf16 *)x->data, n,
                                                               chunk);
        if (!cuda_launched(be, "group_norm(stats)"))
            return;
        gn_apply_vec_kernel<<<grid, 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)x->data, part, w->data, is_bf16(w), b->data,
            is_bf16(b), n, chunk, hw, cpg, groups, eps, silu);
        cuda_launched(be, "group_norm(apply)");
        return;
    }
    gn_stats_kernel<<<grid, 256, 0, cuda_stream(be)>>>(part, x->data, is_bf16(x), n, chunk);
    if (!cuda_launched(be, "group_norm(stats)"))
        return;
    gn_apply_kernel<<<grid, 256, 0, cuda_stream(be)>>>(y->data, is_bf16(y), x->data, is_bf16(x),
                                                       part, w->data, is_bf16(w), b->data,
                                                       is_bf16(b), n, chunk, hw, cpg, groups, eps,
                                                       silu);
    cuda_launched(be, "group_norm(apply)");
}

/* --- GroupNorm in pieces (kernels/backend.h group_norm_stats / _apply) ---- */

/* Merges each group's chunk moments, in chunk order and in double, into its
 * running (mean, M2) over count_before elements: one thread per group, so
 * the result never depends on scheduling (no atomics). */
__global__ void gn_stats_merge_kernel(float *stats, const float *part, int64_t ngroups,
                                      int64_t splits, int64_t n, int64_t chunk,
                                      int64_t count_before)
{
    int64_t grp = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (grp >= ngroups)
        return;
    double cnt = 0, mean = 0, m2 = 0;
    if (count_before > 0) {
        cnt = (double)count_before;
        mean = stats[grp * 2];
        m2 = stats[grp * 2 + 1];
    }
    for (int64_t s = 0; s < splits; s++) {
        int64_t slo = s * chunk, shi = slo + chunk < n ? slo + chunk : n;
        double nb = (double)(shi - slo), mb = part[(grp * splits + s) * 2];
        double delta = mb - mean, tot = cnt + nb;
        mean += delta * nb / tot;
        m2 += part[(grp * splits + s) * 2 + 1] + delta * delta * cnt * nb / tot;
        cnt = tot;
    }
    stats[grp * 2] = (float)mean;
    stats[grp * 2 + 1] = (float)m2;
}

void cuda_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                           int64_t count_before)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 && is_act(x) &&
                             stats->dtype == KILN_F32 && count_before >= 0 &&
                             kiln_tensor_numel(stats) == x->shape[0] * groups * 2))
        return;
    int64_t ngroups = x->shape[0] * groups, cpg = x->shape[1] / groups;
    int64_t hw = x->shape[2] * x->shape[3], n = cpg * hw;
    if (!ngroups || !n || CUDA_REQUIRE(be, ngroups <= 65535) || !cuda_enter(be))
        return;
    int vec = is_bf16(x) && hw % 8 == 0 && (uintptr_t)x->data % 16 == 0;
    int64_t splits, chunk;
    gn_plan(be, ngroups, n, vec, &splits, &chunk);
    float *part = (float *)cuda_scratch(be, (size_t)(ngroups * splits * 2) * sizeof(float));
    if (!part)
        return;
    dim3 grid((unsigned)splits, (unsigned)ngroups);
    if (vec)
        gn_stats_vec_kernel<<<grid, 256, 0, cuda_stream(be)>>>(part, (const bf16 *)x->data, n,
                                                               chunk);
    else
        gn_stats_kernel<<<grid, 256, 0, cuda_stream(be)>>>(part, x->data, is_bf16(x), n, chunk);
    if (!cuda_launched(be, "group_norm_stats(chunks)"))
        return;
    gn_stats_merge_kernel<<<(unsigned)((ngroups + 127) / 128), 128, 0, cuda_stream(be)>>>(
        (float *)stats->data, part, ngroups, splits, n, chunk, count_before);
    cuda_launched(be, "group_norm_stats(merge)");
}

/* One group's mean and 1/sqrt(var + eps) from its (mean, M2) over count. */
__device__ __forceinline__ void gn_given_stats(const float *stats, int64_t grp, int64_t count,
                                               float eps, float *fmean, float *inv)
{
    *fmean = stats[grp * 2];
    *inv = rsqrtf((float)((double)stats[grp * 2 + 1] / (double)count) + eps);
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

__global__ void gn_apply_given_kernel(void *y, int ybf, const void *x, int xbf,
                                      const float *stats, int64_t count, const void *w, int wbf,
                                      const void *b, int bbf, int64_t n, int64_t chunk,
                                      int64_t hw, int64_t cpg, int groups, float eps, int silu)
{
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    float fmean, inv;
    gn_given_stats(stats, grp, count, eps, &fmean, &inv);
    int64_t c0 = (grp % groups) * cpg, base = grp * n;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        int64_t c = c0 + i / hw;
        float v = gn_affine(ld_act(x, base + i, xbf), fmean, inv, ld_act(w, c, wbf),
                            ld_act(b, c, bbf));
        st_act(y, base + i, silu ? gn_silu(v, ybf) : v, ybf);
    }
}

/* The same for bf16 x and y with hw % 8 == 0, 16-byte vectors. */
__global__ void gn_apply_given_vec_kernel(bf16 *y, const bf16 *x, const float *stats,
                                          int64_t count, const void *w, int wbf, const void *b,
                                          int bbf, int64_t n, int64_t chunk, int64_t hw,
                                          int64_t cpg, int groups, float eps, int silu)
{
    int64_t grp = blockIdx.y, lo = blockIdx.x * chunk;
    int64_t hi = lo + chunk < n ? lo + chunk : n;
    float fmean, inv;
    gn_given_stats(stats, grp, count, eps, &fmean, &inv);
    int64_t c0 = (grp % groups) * cpg, base = grp * n;
    const uint4 *xv = (const uint4 *)(x + base);
    uint4 *yv = (uint4 *)(y + base);
    for (int64_t i = lo / 8 + threadIdx.x; i < hi / 8; i += blockDim.x) {
        int64_t c = c0 + i * 8 / hw;
        float wc = ld_act(w, c, wbf), bc = ld_act(b, c, bbf);
        uint4 v = xv[i], o4;
        const bf16 *e = (const bf16 *)&v;
        bf16 *o = (bf16 *)&o4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float t = gn_affine(__bfloat162float(e[j]), fmean, inv, wc, bc);
            o[j] = __float2bfloat16_rn(silu ? gn_silu(t, 1) : t);
        }
        yv[i] = o4;
    }
}

void cuda_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                           const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                           int64_t count, int groups, float eps, int silu)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 &&
                             kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                             kiln_tensor_numel(w) == x->shape[1] &&
                             kiln_tensor_numel(b) == x->shape[1] && is_act(x) && is_act(y) &&
                             is_act(w) && is_act(b) && stats->dtype == KILN_F32 &&
                             kiln_tensor_numel(stats) == x->shape[0] * groups * 2 && count > 0))
        return;
    int64_t ngroups = x->shape[0] * groups, cpg = x->shape[1] / groups;
    int64_t hw = x->shape[2] * x->shape[3], n = cpg * hw;
    if (!ngroups || !n || CUDA_REQUIRE(be, ngroups <= 65535) || !cuda_enter(be))
        return;
    int vec = is_bf16(x) && is_bf16(y) && hw % 8 == 0 &&
              ((uintptr_t)x->data | (uintptr_t)y->data) % 16 == 0;
    int64_t splits, chunk;
    gn_plan(be, ngroups, n, vec, &splits, &chunk);
    dim3 grid((unsigned)splits, (unsigned)ngroups);
    if (vec)
        gn_apply_given_vec_kernel<<<grid, 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)x->data, (const float *)stats->data, count, w->data,
            is_bf16(w), b->data, is_bf16(b), n, chunk, hw, cpg, groups, eps, silu);
    else
        gn_apply_given_kernel<<<grid, 256, 0, cuda_stream(be)>>>(
            y->data, is_bf16(y), x->data, is_bf16(x), (const float *)stats->data, count, w->data,
            is_bf16(w), b->data, is_bf16(b), n, chunk, hw, cpg, groups, eps, silu);
    cuda_launched(be, "group_norm_apply");
}
