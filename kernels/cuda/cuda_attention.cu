/* CUDA fused attention, FlashAttention-2 style: a block of 4 warps owns 64
 * query rows of one head (16 per warp) and streams 64-key tiles of K and V
 * through shared memory; S = QK^T and O += PV run on bf16 tensor cores
 * (mma.sync m16n8k16) with fp32 accumulators, and the softmax is online in
 * fp32 (running max and sum per row, exp2 with the scale folded in).
 *
 * Head dims: d <= 128 is zero-padded to 32, 64 or 128 columns.  Larger d
 * (the VAE mid-block's single 512-wide head) uses a 512-column contraction
 * and splits the output columns into 128-wide slices, one block each; every
 * slice recomputes QK^T, which costs ~1.6x the minimal work but keeps the
 * accumulators in registers.
 *
 * Masks: keys j >= key_len[b] never count (their V rows are zero-filled, so
 * padding garbage cannot leak in through 0 * NaN); with `causal`, query i sees
 * j <= i + (Sk - Sq).  A query with no visible key gets zeros, as the CPU
 * reference does.  GQA: query head h reads kv head h / (Hq / Hkv). */
#include <math.h>

#include "cuda_internal.cuh"
#include "cuda_mma.cuh"

#define ATT_BM 64
#define ATT_BN 64
#define ATT_THREADS 128
#define ATT_BATCH_CHUNK 64 /* key_len values travel in the parameter block */

typedef struct attn_params {
    const bf16 *q, *k, *v;
    bf16 *o;
    int sq, sk, hq, hkv, d, group, nslices, causal, vec, batch0, has_key_len;
    float scale_log2;
    int key_len[ATT_BATCH_CHUNK];
} attn_params;

/* Copies a rows x COLS tile (row stride `gstride` elements, starting at
 * column col0) into shared memory with row stride SSTRIDE; rows >= nrows and
 * columns >= ncols are zero.  The vector path moves 16-byte chunks with
 * cp.async (d % 8 == 0 and aligned pointers); the other path is scalar. */
template <int COLS, int SSTRIDE>
__device__ __forceinline__ void load_tile(bf16 *s, const bf16 *g, int64_t gstride, int nrows,
                                          int col0, int ncols, int vec)
{
    if (vec) {
        constexpr int CH = COLS / 8;
        for (int c = threadIdx.x; c < ATT_BM * CH; c += ATT_THREADS) {
            int r = c / CH, cc = (c % CH) * 8;
            bf16 *dst = s + r * SSTRIDE + cc;
            if (r < nrows && cc < ncols)
                cp_async16(dst, g + r * gstride + col0 + cc);
            else
                *(uint4 *)dst = make_uint4(0, 0, 0, 0);
        }
    } else {
        for (int e = threadIdx.x; e < ATT_BM * COLS; e += ATT_THREADS) {
            int r = e / COLS, cc = e % COLS;
            s[r * SSTRIDE + cc] = (r < nrows && cc < ncols) ? g[r * gstride + col0 + cc]
                                                            : __float2bfloat16_rn(0.0f);
        }
    }
}

template <int DQK, int DV>
__global__ void __launch_bounds__(ATT_THREADS) attention_kernel(const attn_params p)
{
    constexpr int QS = DQK + 8, VS = DV + 8; /* +16 bytes: conflict-free ldmatrix rows */
    extern __shared__ __align__(16) unsigned char att_smem[];
    bf16 *sq = (bf16 *)att_smem;
    bf16 *sk = sq + ATT_BM * QS;
    bf16 *sv = sk + ATT_BN * QS;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int q0 = blockIdx.x * ATT_BM;
    const int h = blockIdx.y / p.nslices, col0 = (blockIdx.y % p.nslices) * DV;
    const int bi = blockIdx.z, b = p.batch0 + bi, kh = h / p.group;
    const int64_t qstride = (int64_t)p.hq * p.d, kvstride = (int64_t)p.hkv * p.d;
    const bf16 *qb = p.q + ((int64_t)b * p.sq * p.hq + h) * p.d;
    const bf16 *kb = p.k + ((int64_t)b * p.sk * p.hkv + kh) * p.d;
    const bf16 *vb = p.v + ((int64_t)b * p.sk * p.hkv + kh) * p.d;
    const int offset = p.sk - p.sq;

    int valid = p.sk;
    if (p.has_key_len && p.key_len[bi] < valid)
        valid = p.key_len[bi] < 0 ? 0 : p.key_len[bi];
    int n_end = valid;
    if (p.causal && q0 + ATT_BM + offset < n_end)
        n_end = q0 + ATT_BM + offset;

    const int row0 = q0 + warp * 16 + g; /* this thread's rows: row0 and row0 + 8 */
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
    float acc[DV / 8][4];
#pragma unroll
    for (int j = 0; j < DV / 8; j++)
        acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    if (n_end > 0) {
        int qrows = p.sq - q0 < ATT_BM ? p.sq - q0 : ATT_BM;
        load_tile<DQK, QS>(sq, qb + (int64_t)q0 * qstride, qstride, qrows, 0, p.d, p.vec);
        cp_async_commit();
    }
    for (int n0 = 0; n0 < n_end; n0 += ATT_BN) {
        int krows = valid - n0 < ATT_BN ? valid - n0 : ATT_BN;
        __syncthreads(); /* every warp is done with the previous K and V tiles */
        load_tile<DQK, QS>(sk, kb + (int64_t)n0 * kvstride, kvstride, krows, 0, p.d, p.vec);
        cp_async_commit();
        load_tile<DV, VS>(sv, vb + (int64_t)n0 * kvstride, kvstride, krows, col0, p.d - col0,
                          p.vec);
        cp_async_commit();
        cp_async_wait<1>(); /* Q and K have landed; V may still be in flight */
        __syncthreads();

        float s[ATT_BN / 8][4];
#pragma unroll
        for (int j = 0; j < ATT_BN / 8; j++)
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQK; kk += 16) {
            uint32_t a[4];
            ldsm_x4(a, sq + (warp * 16 + (lane & 15)) * QS + kk + (lane >> 4) * 8);
#pragma unroll
            for (int nb = 0; nb < ATT_BN / 8; nb += 2) {
                uint32_t bk[4];
                ldsm_x4(bk, sk + (nb * 8 + (lane >> 4) * 8 + (lane & 7)) * QS + kk +
                                ((lane >> 3) & 1) * 8);
                mma_bf16(s[nb], a, bk[0], bk[1]);
                mma_bf16(s[nb + 1], a, bk[2], bk[3]);
            }
        }

        /* Scale into log2 units and mask (only tiles that touch a boundary). */
        bool edge = n0 + ATT_BN > valid || (p.causal && n0 + ATT_BN - 1 > q0 + offset);
#pragma unroll
        for (int nb = 0; nb < ATT_BN / 8; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float x = s[nb][e] * p.scale_log2;
                if (edge) {
                    int j = n0 + nb * 8 + 2 * t + (e & 1), row = row0 + (e >> 1) * 8;
                    if (j >= valid || (p.causal && j > row + offset))
                        x = -INFINITY;
                }
                s[nb][e] = x;
            }

        /* Online softmax; a row's four values per n-block live in one quad. */
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < ATT_BN / 8; nb++)
                mx = fmaxf(mx, fmaxf(s[nb][2 * rr], s[nb][2 * rr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float m_new = fmaxf(m_run[rr], mx);
            float base = m_new == -INFINITY ? 0.0f : m_new; /* all masked so far */
            float alpha = exp2f(m_run[rr] - base);
            m_run[rr] = m_new;
            float rs = 0.0f;
#pragma unroll
            for (int nb = 0; nb < ATT_BN / 8; nb++) {
                float p0 = exp2f(s[nb][2 * rr] - base), p1 = exp2f(s[nb][2 * rr + 1] - base);
                s[nb][2 * rr] = p0;
                s[nb][2 * rr + 1] = p1;
                rs += p0 + p1;
            }
            l_run[rr] = l_run[rr] * alpha + rs;
#pragma unroll
            for (int j = 0; j < DV / 8; j++) {
                acc[j][2 * rr] *= alpha;
                acc[j][2 * rr + 1] *= alpha;
            }
        }

        cp_async_wait<0>();
        __syncthreads();
        /* O += P V: the S accumulators of n-blocks 2kk and 2kk+1 are exactly
         * the A fragment of the 16-key step kk. */
#pragma unroll
        for (int kk = 0; kk < ATT_BN / 16; kk++) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int vbk = 0; vbk < DV / 8; vbk += 2) {
                uint32_t bv[4];
                ldsm_x4_trans(bv, sv + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * VS +
                                      vbk * 8 + (lane >> 4) * 8);
                mma_bf16(acc[vbk], a, bv[0], bv[1]);
                mma_bf16(acc[vbk + 1], a, bv[2], bv[3]);
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        float l = l_run[rr];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        int row = row0 + rr * 8;
        if (row >= p.sq)
            continue;
        bf16 *orow = p.o + ((int64_t)b * p.sq + row) * qstride + (int64_t)h * p.d;
#pragma unroll
        for (int j = 0; j < DV / 8; j++) {
            int c = col0 + j * 8 + 2 * t;
            if (c < p.d)
                orow[c] = __float2bfloat16_rn(acc[j][2 * rr] * inv);
            if (c + 1 < p.d)
                orow[c + 1] = __float2bfloat16_rn(acc[j][2 * rr + 1] * inv);
        }
    }
}

template <int DQK, int DV> static size_t attn_smem(void)
{
    return (size_t)(ATT_BM * (DQK + 8) + ATT_BN * (DQK + 8) + ATT_BN * (DV + 8)) * sizeof(bf16);
}

template <int DQK, int DV> static int attn_setup(kiln_backend *be)
{
    return cuda_ok(be, cudaFuncSetAttribute(attention_kernel<DQK, DV>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)attn_smem<DQK, DV>()),
                   "cudaFuncSetAttribute(attention)");
}

int cuda_attention_init(kiln_backend *be)
{
    return attn_setup<32, 32>(be) && attn_setup<64, 64>(be) && attn_setup<128, 128>(be) &&
           attn_setup<512, 128>(be);
}

template <int DQK, int DV>
static void attn_launch(kiln_backend *be, attn_params *p, int64_t bsz, const int *key_len)
{
    p->nslices = (p->d + DV - 1) / DV;
    for (int64_t b0 = 0; b0 < bsz; b0 += ATT_BATCH_CHUNK) {
        int nb = (int)(bsz - b0 < ATT_BATCH_CHUNK ? bsz - b0 : ATT_BATCH_CHUNK);
        p->batch0 = (int)b0;
        for (int i = 0; i < nb; i++)
            p->key_len[i] = key_len ? key_len[b0 + i] : p->sk;
        dim3 grid((unsigned)((p->sq + ATT_BM - 1) / ATT_BM), (unsigned)(p->hq * p->nslices),
                  (unsigned)nb);
        attention_kernel<DQK, DV><<<grid, ATT_THREADS, attn_smem<DQK, DV>(), cuda_stream(be)>>>(*p);
        if (!cuda_launched(be, "attention"))
            return;
    }
}

void cuda_attention(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q, const kiln_tensor *k,
                    const kiln_tensor *v, const kiln_attn_opts *opts)
{
    if (CUDA_REQUIRE(be, q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4))
        return;
    int64_t bsz = q->shape[0], sq = q->shape[1], hq = q->shape[2], d = q->shape[3];
    int64_t sk = k->shape[1], hkv = k->shape[2];
    if (CUDA_REQUIRE(be, k->shape[0] == bsz && v->shape[0] == bsz && k->shape[3] == d &&
                             v->shape[1] == sk && v->shape[2] == hkv && hkv > 0 &&
                             hq % hkv == 0 && o->shape[0] == bsz && o->shape[1] == sq &&
                             o->shape[2] == hq && o->data != q->data) ||
        CUDA_REQUIRE(be, q->dtype == KILN_BF16 && k->dtype == KILN_BF16 &&
                             v->dtype == KILN_BF16 && o->dtype == KILN_BF16))
        return;
    if (v->shape[3] != d || o->shape[3] != d || d > 512 || d < 1 || sq > INT32_MAX / 2 ||
        sk > INT32_MAX / 2 || hq * 4 > 65535) {
        kiln_be_fail(be, KILN_ERR_UNSUPPORTED,
                     "cuda attention: unsupported shape (d=%lld, dv=%lld, Sq=%lld, Sk=%lld, "
                     "heads=%lld); needs dv == d <= 512",
                     (long long)d, (long long)v->shape[3], (long long)sq, (long long)sk,
                     (long long)hq);
        return;
    }
    if (!bsz || !sq || !hq || !cuda_enter(be) || cuda_cudnn_attention(be, o, q, k, v, opts) ||
        cuda_attention_gemm(be, o, q, k, v, opts))
        return;
    attn_params p;
    memset(&p, 0, sizeof p);
    p.q = (const bf16 *)q->data;
    p.k = (const bf16 *)k->data;
    p.v = (const bf16 *)v->data;
    p.o = (bf16 *)o->data;
    p.sq = (int)sq;
    p.sk = (int)sk;
    p.hq = (int)hq;
    p.hkv = (int)hkv;
    p.d = (int)d;
    p.group = (int)(hq / hkv);
    p.causal = opts->causal;
    p.has_key_len = opts->key_len != NULL;
    p.scale_log2 = opts->scale * 1.4426950408889634f;
    p.vec = d % 8 == 0 && ((uintptr_t)q->data | (uintptr_t)k->data | (uintptr_t)v->data) % 16 == 0;
    if (d <= 32)
        attn_launch<32, 32>(be, &p, bsz, opts->key_len);
    else if (d <= 64)
        attn_launch<64, 64>(be, &p, bsz, opts->key_len);
    else if (d <= 128)
        attn_launch<128, 128>(be, &p, bsz, opts->key_len);
    else
        attn_launch<512, 128>(be, &p, bsz, opts->key_len);
}
