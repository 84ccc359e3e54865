/* The CUDA backend: bf16 activations and weights, fp32 accumulation, one
 * stream per instance.  This file creates and destroys instances and holds
 * the error plumbing; the ops live in the other files of kernels/cuda/. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.cuh"


/* The errors after which "any further CUDA work will return the same
 * error; to continue using CUDA, the process must be terminated and
 * relaunched" (driver_types.h), and uncorrectable hardware errors. */
static int sticky(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorContained:
    case cudaErrorExternalDevice:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorUnknown:
        return 1;
    default:
        return 0;
    }
}

int cuda_ok(kiln_backend *be, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 1;
    if (sticky(e)) {
        kiln_be_lose(be, "cuda: %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    } else {
        kiln_be_fail(be, KILN_ERR_DEVICE, "cuda: %s: %s (%s)", what, cudaGetErrorString(e),
                     cudaGetErrorName(e));
        /* The runtime also left e in this thread's last-error slot: cleared,
         * so the next launch check (cuda_launched), perhaps a later job's
         * once this error is reported and cleared, does not read it as its
         * own. */
        cudaGetLastError();
    }
    return 0;
}

void cuda_check_context(kiln_backend *be, const char *what)
{
    cudaError_t e = cudaStreamQuery(cuda_stream(be));
    if (e != cudaSuccess && e != cudaErrorNotReady && sticky(e))
        kiln_be_lose(be, "cuda: after %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    else
        cudaGetLastError(); /* whatever the library's failure left in this thread's slot */
}

int cuda_launched(kiln_backend *be, const char *kernel)
{
    return cuda_ok(be, cudaGetLastError(), kernel);
}

int cuda_enter(kiln_backend *be)
{
    return cuda_ok(be, cudaSetDevice(cuda_of(be)->device), "cudaSetDevice");
}

void *cuda_scratch(kiln_backend *be, size_t bytes)
{
    cuda_impl *c = cuda_of(be);
    if (bytes <= c->scratch_bytes)
        return c->scratch;
    /* Earlier ops on the stream may still read the old buffer. */
    if (!cuda_ok(be, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize") ||
        !cuda_ok(be, cudaFree(c->scratch), "cudaFree"))
        return NULL;
    c->scratch = NULL;
    c->scratch_bytes = 0;
    c->scratch_epoch++;
    size_t want = bytes < (1u << 16) ? (1u << 16) : bytes;
    if (!cuda_ok(be, cudaMalloc(&c->scratch, want), "cudaMalloc(scratch)") ||
        !cuda_poison(be, c->scratch, want))
        return NULL;
    c->scratch_bytes = want;
    return c->scratch;
}

static void cuda_destroy(kiln_backend *be)
{
    cuda_impl *c = cuda_of(be);
    if (c) {
        /* Teardown is best effort: a failing device must not leak the host side.
         * Not while another backend of the process records a graph:
         * cudnnDestroy synchronises the device, which would invalidate
         * that capture (cuda_exclusive_begin). */
        cudaSetDevice(c->device);
        int held = cuda_exclusive_begin();
        if (c->stream)
            cudaStreamSynchronize(c->stream);
        cuda_linear_fini(be);
        cuda_cudnn_fini(be);
        cuda_timer_fini(be);
        if (c->lt)
            cublasLtDestroy(c->lt);
        cudaFree(c->lt_workspace);
        cudaFree(c->scratch);
        if (c->pinned)
            cudaFreeHost(c->pinned);
        if (c->stream)
            cudaStreamDestroy(c->stream);
        cuda_exclusive_end(held);
        free(c);
    }
    free(be);
}

static const kiln_backend_ops cuda_ops = {
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .download_bytes = cuda_download_bytes,
    .copy = cuda_copy,
    .sync = cuda_sync,
    .linear = cuda_linear,
    .quantize_fp8 = cuda_quantize_fp8,
    .rms_norm = cuda_rms_norm,
    .layer_norm_mod = cuda_layer_norm_mod,
    .group_norm = cuda_group_norm,
    .group_norm_stats = cuda_group_norm_stats,
    .group_norm_apply = cuda_group_norm_apply,
    .rope = cuda_rope,
    .attention = cuda_attention,
    .silu = cuda_silu,
    .tanh = cuda_tanh,
    .swiglu = cuda_swiglu,
    .add = cuda_add,
    .gated_add = cuda_gated_add,
    .euler_step = cuda_euler_step,
    .cfg = cuda_cfg,
    .copy_rows = cuda_copy_rows,
    .copy_cols = cuda_copy_cols,
    .transpose = cuda_transpose,
    .conv2d = cuda_conv2d,
    .upsample_nearest2x = cuda_upsample_nearest2x,
    .to_rgb8 = cuda_to_rgb8,
    .qkv_split = cuda_qkv_split,
    .swiglu_cols = cuda_swiglu_cols,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_destroy = cuda_graph_destroy,
    .mem_info = cuda_mem_info,
    .timer_mark = cuda_timer_mark,
    .timer_ms = cuda_timer_ms,
    .timer_reset = cuda_timer_reset,
    .destroy = cuda_destroy,
};

/* 32 MiB covers cuBLASLt's largest Hopper kernels' split-K workspace. */
#define LT_WORKSPACE_BYTES (32u << 20)

/* Creation errors: KILN_ERR_UNAVAILABLE when the machine has no usable CUDA
 * device or driver (callers and tests treat that as "no GPU here"),
 * KILN_ERR_INVALID for a device index out of range, KILN_ERR_DEVICE for any
 * other CUDA failure, including a build whose kernels do not match the GPU.
 * Declared in kernels/backend_impl.h (only under KILN_HAVE_CUDA, which the C
 * side of the build defines), hence the explicit C linkage here. */
extern "C" kiln_backend *kiln_cuda_backend_create(int device, kiln_err *err)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && !count)) {
        kiln_err_set(err, KILN_ERR_UNAVAILABLE, "no usable CUDA device: %s",
                     e == cudaSuccess ? "none found" : cudaGetErrorString(e));
        return NULL;
    }
    if (e != cudaSuccess) {
        kiln_err_set(err, KILN_ERR_DEVICE, "cuda: cudaGetDeviceCount: %s", cudaGetErrorString(e));
        return NULL;
    }
    if (device < 0 || device >= count) {
        kiln_err_set(err, KILN_ERR_INVALID, "CUDA device %d does not exist (%d found)", device,
                     count);
        return NULL;
    }
    kiln_backend *be = (kiln_backend *)calloc(1, sizeof *be);
    cuda_impl *c = (cuda_impl *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    be->ops = &cuda_ops;
    be->name = "cuda";
    be->act_dtype = KILN_BF16;
    be->device = device;
    be->impl = c;
    c->device = device;
    c->lt_workspace_bytes = LT_WORKSPACE_BYTES;
    const char *poison = getenv("KILN_CUDA_POISON");
    c->poison = poison && !strcmp(poison, "1");
    const char *max_align = getenv("KILN_CUBLASLT_MAX_ALIGN");
    c->lt_max_align = 256;
    if (max_align) {
        long a = strtol(max_align, NULL, 10);
        if (a >= 2 && a <= 256 && !(a & (a - 1)))
            c->lt_max_align = (int)a;
        else
            kiln_be_fail(be, KILN_ERR_INVALID,
                         "KILN_CUBLASLT_MAX_ALIGN=%s: want a power of two from 2 to 256", max_align);
    }

    cudaDeviceProp prop;
    if (cuda_enter(be) && cuda_ok(be, cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties")) {
        c->num_sms = prop.multiProcessorCount;
        /* mma.sync bf16 and cp.async need compute capability 8.0 or newer. */
        if (prop.major < 8)
            kiln_be_fail(be, KILN_ERR_UNSUPPORTED,
                         "CUDA device %d (%s) has compute capability %d.%d; kiln needs 8.0+",
                         device, prop.name, prop.major, prop.minor);
    }
    if (!be->error.code &&
        cuda_ok(be, cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking),
                "cudaStreamCreate") &&
        cuda_ok(be, cudaMalloc(&c->lt_workspace, c->lt_workspace_bytes), "cudaMalloc(workspace)")) {
        cublasStatus_t bs = cublasLtCreate(&c->lt);
        if (bs != CUBLAS_STATUS_SUCCESS)
            kiln_be_fail(be, KILN_ERR_DEVICE, "cublasLtCreate: %s", cublasLtGetStatusString(bs));
    }
    /* These also prove that the build holds kernels for this GPU: a missing
     * image fails here, with a clear message, instead of at the first op. */
    if (!be->error.code && cuda_linear_init(be) && cuda_attention_init(be))
        cuda_conv_init(be);
    if (!be->error.code)
        cuda_cudnn_init(be);
    if (be->error.code) {
        kiln_err_set(err, be->error.code, "%s", be->error.msg);
        if (strstr(err->msg, "no kernel image") || strstr(err->msg, "NoKernelImage"))
            kiln_err_wrap(err, "this kiln was built for other GPUs (meson -Dgpu_gencode=...)");
        cuda_destroy(be);
        return NULL;
    }
    return be;
}
