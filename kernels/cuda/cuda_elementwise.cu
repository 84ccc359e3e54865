/* CUDA elementwise ops: SiLU, tanh, add, gated residual add, Euler update,
 * classifier-free guidance, RoPE (SwiGLU: cuda_fused.cu).  Each operand may
 * be BF16 or F32; math is fp32, and where the output is bf16 the intermediate roundings follow the
 * bf16 PyTorch ops of diffusers (noted per op), so a bf16 run tracks the
 * reference bit patterns rather than only its values. */
#include "cuda_internal.cuh"

#define GRID_STRIDE(i, n)                                                          \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)gridDim.x * blockDim.x)

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + __expf(-v)); }

__global__ void silu_kernel(void *y, int ybf, const void *x, int xbf, int64_t n)
{
    GRID_STRIDE(i, n) st_act(y, i, silu_f(ld_act(x, i, xbf)), ybf);
}

void cuda_silu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(y) == n && is_act(x) && is_act(y)) || !n ||
        !cuda_enter(be))
        return;
    silu_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(y->data, is_bf16(y), x->data,
                                                                 is_bf16(x), n);
    cuda_launched(be, "silu");
}

/* torch.tanh on a bf16 tensor computes in fp32 and rounds once, as here;
 * tanhf (not a fast approximation) keeps the fp32 path within an ulp. */
__global__ void tanh_kernel(void *y, int ybf, const void *x, int xbf, int64_t n)
{
    GRID_STRIDE(i, n) st_act(y, i, tanhf(ld_act(x, i, xbf)), ybf);
}

void cuda_tanh(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(y) == n && is_act(x) && is_act(y)) || !n ||
        !cuda_enter(be))
        return;
    tanh_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(y->data, is_bf16(y), x->data,
                                                                 is_bf16(x), n);
    cuda_launched(be, "tanh");
}

__global__ void add_kernel(void *y, int ybf, const void *a, int abf, const void *b, int bbf,
                           int64_t n)
{
    GRID_STRIDE(i, n) st_act(y, i, ld_act(a, i, abf) + ld_act(b, i, bbf), ybf);
}

/* The same for all-bf16 operands, 8 elements (16 bytes) a load: the VAE's
 * residual adds move 256 MB tensors. */
__global__ void add_vec_kernel(bf16 *y, const bf16 *a, const bf16 *b, int64_t n8)
{
    GRID_STRIDE(i, n8)
    {
        uint4 a4 = ((const uint4 *)a)[i], b4 = ((const uint4 *)b)[i], y4;
        const bf16 *av = (const bf16 *)&a4, *bv = (const bf16 *)&b4;
        bf16 *yv = (bf16 *)&y4;
#pragma unroll
        for (int k = 0; k < 8; k++)
            yv[k] = __float2bfloat16_rn(__bfloat162float(av[k]) + __bfloat162float(bv[k]));
        ((uint4 *)y)[i] = y4;
    }
}

void cuda_add(kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b)
{
    int64_t n = kiln_tensor_numel(y);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(a) == n && kiln_tensor_numel(b) == n && is_act(a) &&
                             is_act(b) && is_act(y)) ||
        !n || !cuda_enter(be))
        return;
    if (is_bf16(y) && is_bf16(a) && is_bf16(b) && n % 8 == 0 &&
        ((uintptr_t)y->data | (uintptr_t)a->data | (uintptr_t)b->data) % 16 == 0)
        add_vec_kernel<<<cuda_blocks(be, n / 8), 256, 0, cuda_stream(be)>>>(
            (bf16 *)y->data, (const bf16 *)a->data, (const bf16 *)b->data, n / 8);
    else
        add_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(
            y->data, is_bf16(y), a->data, is_bf16(a), b->data, is_bf16(b), n);
    cuda_launched(be, "add");
}

/* x + gate * y: the product is its own bf16 tensor in diffusers. */
__global__ void gated_add_kernel(void *x, int xbf, const void *gate, int gbf, const void *y,
                                 int ybf, int64_t n, int64_t sd, int64_t d)
{
    GRID_STRIDE(i, n)
    {
        float v = ld_act(y, i, ybf);
        if (gate)
            v = rnd_act(ld_act(gate, (i / sd) * d + i % d, gbf) * v, xbf);
        st_act(x, i, ld_act(x, i, xbf) + v, xbf);
    }
}

/* The same for all-bf16 operands (D % 8 == 0 with a gate): 8 elements (16
 * bytes) per load and store, one index division per 8 elements. */
__global__ void gated_add_vec_kernel(bf16 *__restrict__ x, const bf16 *__restrict__ gate,
                                     const bf16 *__restrict__ y, int64_t n8, int64_t sd8,
                                     int64_t d8)
{
    GRID_STRIDE(i, n8)
    {
        uint4 x4 = ((const uint4 *)x)[i], y4 = ((const uint4 *)y)[i], g4;
        if (gate)
            g4 = ((const uint4 *)gate)[(i / sd8) * d8 + i % d8];
        bf16 *xv = (bf16 *)&x4;
        const bf16 *yv = (const bf16 *)&y4, *gv = (const bf16 *)&g4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float v = __bfloat162float(yv[j]);
            if (gate)
                v = rnd_act(__bfloat162float(gv[j]) * v, 1);
            xv[j] = __float2bfloat16_rn(__bfloat162float(xv[j]) + v);
        }
        ((uint4 *)x)[i] = x4;
    }
}

void cuda_gated_add(kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                    const kiln_tensor *y)
{
    int64_t n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(y) == n && is_act(x) && is_act(y)))
        return;
    int64_t sd = 1, d = 1;
    if (gate) {
        if (CUDA_REQUIRE(be, x->ndim == 3 && is_act(gate) &&
                                 kiln_tensor_numel(gate) == x->shape[0] * x->shape[2]))
            return;
        sd = x->shape[1] * x->shape[2];
        d = x->shape[2];
    }
    if (!n || !cuda_enter(be))
        return;
    if (is_bf16(x) && is_bf16(y) && (!gate || (is_bf16(gate) && d % 8 == 0)) && n % 8 == 0 &&
        ((uintptr_t)x->data | (uintptr_t)y->data | (uintptr_t)(gate ? gate->data : NULL)) % 16 ==
            0) {
        gated_add_vec_kernel<<<cuda_blocks(be, n / 8), 256, 0, cuda_stream(be)>>>(
            (bf16 *)x->data, gate ? (const bf16 *)gate->data : NULL, (const bf16 *)y->data, n / 8,
            sd / 8, d / 8);
        cuda_launched(be, "gated_add");
        return;
    }
    gated_add_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(
        x->data, is_bf16(x), gate ? gate->data : NULL, gate ? is_bf16(gate) : 0, y->data,
        is_bf16(y), n, sd, d);
    cuda_launched(be, "gated_add");
}

/* bf16 latents: x_next = bf16(x + bf16(bf16(dt) * v)) (pipeline.md section 7:
 * the 0-d fp32 dt meets the bf16 v as bf16); f32 latents: x + dt * v. */
__global__ void euler_kernel(void *x, int xbf, const void *v, int vbf, float dt, int64_t n)
{
    GRID_STRIDE(i, n)
    {
        float vi = ld_act(v, i, vbf), xi = ld_act(x, i, xbf);
        float step = xbf ? rnd_act(dt * vi, 1) : dt * vi;
        st_act(x, i, xi + step, xbf);
    }
}

void cuda_euler_step(kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt)
{
    int64_t n = kiln_tensor_numel(x);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(v) == n && is_act(x) && is_act(v)) || !n ||
        !cuda_enter(be))
        return;
    float d = is_bf16(x) ? kiln_round_bf16(dt) : dt;
    euler_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(x->data, is_bf16(x), v->data,
                                                                  is_bf16(v), d, n);
    cuda_launched(be, "euler_step");
}

/* neg + g * (pos - neg), three bf16 ops in the bf16 pipeline (g stays fp32,
 * as a Python scalar does in PyTorch). */
__global__ void cfg_kernel(void *out, int obf, const void *pos, int pbf, const void *neg, int nbf,
                           float g, int64_t n)
{
    GRID_STRIDE(i, n)
    {
        float p = ld_act(pos, i, pbf), q = ld_act(neg, i, nbf);
        float diff = rnd_act(p - q, obf);
        st_act(out, i, q + rnd_act(g * diff, obf), obf);
    }
}

void cuda_cfg(kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos, const kiln_tensor *neg,
              float g)
{
    int64_t n = kiln_tensor_numel(out);
    if (CUDA_REQUIRE(be, kiln_tensor_numel(pos) == n && kiln_tensor_numel(neg) == n &&
                             is_act(out) && is_act(pos) && is_act(neg)) ||
        !n || !cuda_enter(be))
        return;
    cfg_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(out->data, is_bf16(out), pos->data,
                                                                is_bf16(pos), neg->data,
                                                                is_bf16(neg), g, n);
    cuda_launched(be, "cfg");
}

/* One thread per rotated pair, fp32 math and one rounding, as diffusers'
 * apply_rotary_emb does for FLUX.2 (x.float(), then back to bf16). */
__global__ void rope_kernel(void *x, int xbf, const float *__restrict__ cs,
                            const float *__restrict__ sn, int64_t s, int64_t h, int64_t d,
                            int interleaved, int64_t pairs)
{
    int64_t half = d / 2;
    GRID_STRIDE(p, pairs)
    {
        int64_t i = p % half, row = p / half; /* row = (b * s + t) * h + head */
        int64_t t = (row / h) % s;
        int64_t i0 = interleaved ? 2 * i : i, i1 = interleaved ? 2 * i + 1 : i + half;
        int64_t base = row * d;
        float a = ld_act(x, base + i0, xbf), b = ld_act(x, base + i1, xbf);
        const float *c = cs + t * d, *sv = sn + t * d;
        st_act(x, base + i0, rope_rot(a, c[i0], -b, sv[i0]), xbf);
        st_act(x, base + i1, rope_rot(b, c[i1], a, sv[i1]), xbf);
    }
}

void cuda_rope(kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos, const kiln_tensor *sin,
               kiln_rope_mode mode)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && cos->ndim == 2 && cos->shape[0] == x->shape[1] &&
                             cos->shape[1] == x->shape[3] && x->shape[3] % 2 == 0 &&
                             kiln_tensor_numel(sin) == kiln_tensor_numel(cos) &&
                             cos->dtype == KILN_F32 && sin->dtype == KILN_F32 && is_act(x)))
        return;
    int64_t pairs = kiln_tensor_numel(x) / 2;
    if (!pairs || !cuda_enter(be))
        return;
    rope_kernel<<<cuda_blocks(be, pairs), 256, 0, cuda_stream(be)>>>(
        x->data, is_bf16(x), (const float *)cos->data, (const float *)sin->data, x->shape[1],
        x->shape[2], x->shape[3], mode == KILN_ROPE_INTERLEAVED, pairs);
    cuda_launched(be, "rope");
}
