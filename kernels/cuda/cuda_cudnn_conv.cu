/* 2-D convolutions (the VAE's) through cuDNN's graph API: bf16 channels-last
 * data (NHWC activations, (cout, kh, kw, cin) weights: the layout cuDNN's
 * tensor-core engines read, so cuDNN adds no NCHW<->NHWC transposes around
 * them; those took 7.6 ms of a 1024x1024 decode in NCHW), f32
 * accumulation, any stride and padding.  kiln's implicit-GEMM kernel
 * (cuda_conv.cu) reaches about 105 TFLOP/s on the VAE's 3x3 convolutions,
 * which makes the convolutions most of a 1024x1024 decode.
 *
 * Exactness: only engines whose numerical notes promise a plain reduction
 * are taken (no FFT, no Winograd, no reduced-precision reduction, no down
 * conversion of inputs, deterministic); if cuDNN offers none, kiln's kernel
 * runs.  The bias is added after the convolution's bf16 output, as PyTorch
 * does for cuDNN convolutions (at::native::_convolution adds it with
 * output.add_), so the result rounds at the same two points as diffusers'.
 *
 * Batch invariance: one plan per batch row, executed row by row, as for
 * attention (cuda_cudnn_attention.cu). */
#include <stdio.h>

#include "cuda_cudnn.cuh"

enum { UID_X = 1, UID_W, UID_Y };
enum { KIND_CONV = 2 };

typedef struct conv_shape {
    int64_t cin, h, w, cout, kh, kw, stride, pad[4], ho, wo;
} conv_shape;

/* Engines whose numerics match a plain f32-accumulated reduction. */
static int exact_engine(cuda_cudnn *c, desc_t cfg)
{
    desc_t engine = NULL;
    int64_t n = 0;
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int ok = !c->create_desc(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) &&
             !c->get_attr(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                          &engine) &&
             !c->get_attr(engine, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                          CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes);
    for (int64_t i = 0; ok && i < n; i++)
        ok = notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE ||
             notes[i] == CUDNN_NUMERICAL_NOTE_STRICT_NAN_PROP;
    if (engine)
        c->destroy_desc(engine);
    return ok;
}

static void build_conv(cuda_cudnn *c, cudnn_plan *p, const void *arg)
{
    const conv_shape *s = (const conv_shape *)arg;
    cudnn_builder b;
    cudnn_builder_init(&b, c, p);
    /* cuDNN's dimensions are always (N, C, H, W); the strides make them
     * channels-last. */
    int64_t xd[4] = {1, s->cin, s->h, s->w},
            xs[4] = {s->h * s->w * s->cin, 1, s->w * s->cin, s->cin};
    int64_t wd[4] = {s->cout, s->cin, s->kh, s->kw},
            ws[4] = {s->kh * s->kw * s->cin, 1, s->kw * s->cin, s->cin};
    int64_t yd[4] = {1, s->cout, s->ho, s->wo},
            ys[4] = {s->ho * s->wo * s->cout, 1, s->wo * s->cout, s->cout};
    desc_t x = cudnn_tensor(&b, UID_X, CUDNN_DATA_BFLOAT16, 4, xd, xs, 0);
    desc_t w = cudnn_tensor(&b, UID_W, CUDNN_DATA_BFLOAT16, 4, wd, ws, 0);
    desc_t y = cudnn_tensor(&b, UID_Y, CUDNN_DATA_BFLOAT16, 4, yd, ys, 0);

    desc_t conv = cudnn_make(&b, CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
    cudnnDataType_t acc = CUDNN_DATA_FLOAT;
    cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
    int64_t dims = 2, dil[2] = {1, 1}, strides[2] = {s->stride, s->stride};
    int64_t pre[2] = {s->pad[0], s->pad[1]}, post[2] = {s->pad[2], s->pad[3]};
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &acc,
              "conv accumulation");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode,
              "conv mode");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &dims,
              "conv dims");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dil,
              "conv dilations");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, strides,
              "conv strides");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pre,
              "conv padding");
    cudnn_set(&b, conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, post,
              "conv padding");
    cudnn_finalize(&b, conv, "convolution");

    desc_t op = cudnn_make(&b, CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR);
    float alpha = 1.0f, beta = 0.0f;
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
              &x, "conv x");
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
              &w, "conv w");
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
              &y, "conv y");
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
              CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &conv, "conv descriptor");
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, CUDNN_TYPE_FLOAT, 1, &alpha,
              "conv alpha");
    cudnn_set(&b, op, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, CUDNN_TYPE_FLOAT, 1, &beta,
              "conv beta");
    cudnn_finalize(&b, op, "convolution operation");
    char label[160];
    snprintf(label, sizeof label, "conv2d %lldx%lldx%lld -> %lld, %lldx%lld stride %lld",
             (long long)s->cin, (long long)s->h, (long long)s->w, (long long)s->cout,
             (long long)s->kh, (long long)s->kw, (long long)s->stride);
    cudnn_plan_graph(&b, &op, 1, exact_engine, label);
}

/* The epilogue: y (pixels, C) = bf16(y + bias[c]), the bias in its own
 * dtype, then bf16(y + r) with the residual r (either may be NULL): the
 * roundings of PyTorch's bias add after a cuDNN convolution and of the
 * separate residual add, in one pass. */
__device__ __forceinline__ float conv_epilogue(float v, const void *bias, int bias_bf16,
                                               int64_t c, const bf16 *r, int64_t i)
{
    if (bias)
        v = __bfloat162float(__float2bfloat16_rn(v + ld_act(bias, c, bias_bf16)));
    if (r)
        v = __bfloat162float(__float2bfloat16_rn(v + __bfloat162float(r[i])));
    return v;
}

__global__ void bias_nhwc_kernel(bf16 *y, const void *bias, int bias_bf16, const bf16 *r,
                                 int64_t c, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16_rn(
            conv_epilogue(__bfloat162float(y[i]), bias, bias_bf16, i % c, r, i));
}

/* The same 8 values a load (c % 8 == 0: a vector's channels are
 * consecutive), so the pass runs at memory speed. */
__global__ void bias_nhwc_vec_kernel(bf16 *y, const void *bias, int bias_bf16, const bf16 *r,
                                     int64_t c8, int64_t n8)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n8;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t c0 = i % c8 * 8;
        uint4 v = ((uint4 *)y)[i], rv = r ? ((const uint4 *)r)[i] : v;
        bf16 *e = (bf16 *)&v;
#pragma unroll
        for (int k = 0; k < 8; k++)
            e[k] = __float2bfloat16_rn(conv_epilogue(__bfloat162float(e[k]), bias, bias_bf16,
                                                     c0 + k, r ? (const bf16 *)&rv : NULL, k));
        ((uint4 *)y)[i] = v;
    }
}

static void add_epilogue(kiln_backend *be, bf16 *y, const kiln_tensor *bias,
                         const kiln_tensor *residual, int64_t pixels, int64_t c)
{
    int64_t n = pixels * c;
    const void *b = bias ? bias->data : NULL;
    int bbf = bias ? is_bf16(bias) : 0;
    const bf16 *r = residual ? (const bf16 *)residual->data : NULL;
    if (c % 8 || (uintptr_t)r % 16)
        bias_nhwc_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(y, b, bbf, r, c, n);
    else
        bias_nhwc_vec_kernel<<<cuda_blocks(be, n / 8), 256, 0, cuda_stream(be)>>>(
            y, b, bbf, r, c / 8, n / 8);
    cuda_launched(be, residual ? "conv2d bias + residual" : "conv2d bias");
}

int cuda_cudnn_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                      const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                      const int pad[4])
{
    cuda_cudnn *c = cuda_of(be)->cudnn;
    conv_shape s = {x->shape[3], x->shape[1], x->shape[2], w->shape[0], w->shape[1],
                    w->shape[2], stride, {pad[0], pad[1], pad[2], pad[3]},
                    y->shape[1], y->shape[2]};
    int64_t bsz = x->shape[0], xrow = s.cin * s.h * s.w, yrow = s.cout * s.ho * s.wo;
    /* Row pointers must keep the plan's 16-byte alignment. */
    if (!c || !bsz || !xrow || !yrow || xrow % 8 || yrow % 8 || !cuda_enter(be) ||
        ((uintptr_t)x->data | (uintptr_t)w->data | (uintptr_t)y->data) % 16)
        return 0;
    int64_t key[12] = {KIND_CONV, s.cin, s.h, s.w, s.cout, s.kh, s.kw, s.stride,
                       s.pad[0], s.pad[1], s.pad[2], s.pad[3]};
    cudnn_plan *p = cudnn_find_plan(c, key, 12, build_conv, &s);
    if (!p || !p->plan)
        return 0;
    int64_t uids[3] = {UID_X, UID_W, UID_Y};
    for (int64_t b = 0; b < bsz; b++) {
        void *ptrs[3] = {(bf16 *)x->data + b * xrow, w->data, (bf16 *)y->data + b * yrow};
        if (cudnn_execute(be, p, 3, uids, ptrs, "conv2d"))
            return 1;
    }
    if (bias || residual)
        add_epilogue(be, (bf16 *)y->data, bias, residual, bsz * s.ho * s.wo, s.cout);
    return 1;
}
