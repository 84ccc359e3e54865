/* Internals shared by the CUDA backend's files (kernels/cuda/): the instance
 * state, error plumbing and small device helpers.
 *
 *   void cuda_silu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
 *   {
 *       if (!cuda_enter(be) || CUDA_REQUIRE(be, kiln_tensor_numel(y) == n)) return;
 *       silu_kernel<<<grid, 256, 0, cuda_stream(be)>>>(...);
 *       cuda_launched(be, "silu");
 *   }
 *
 * Every op runs asynchronously on the instance's one stream; only download()
 * and sync() wait.  A CUDA/cuBLAS failure or a caller bug becomes the sticky
 * error of kernels/backend.h (first one wins), and later ops are skipped by
 * the kiln_be_* wrappers.  One instance is used by one thread at a time. */
#ifndef KILN_CUDA_INTERNAL_CUH
#define KILN_CUDA_INTERNAL_CUH

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kernels/backend.h"
}

typedef __nv_bfloat16 bf16;

struct cuda_linear_cache; /* cuda_linear.cu */
struct cuda_cudnn;        /* cuda_cudnn.cuh */

typedef struct cuda_impl {
    int device;
    int num_sms;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_workspace; /* allocated once at creation */
    size_t lt_workspace_bytes;
    struct cuda_linear_cache *linear_cache;
    void *scratch; /* small per-op scratch (group-norm partials), grows on demand */
    size_t scratch_bytes;
    uint64_t scratch_epoch; /* bumped when scratch moves: recorded graphs go stale */
    struct cuda_cudnn *cudnn; /* NULL: cuDNN absent or disabled */
    int poison; /* KILN_CUDA_POISON=1: new device memory filled with NaN bytes (cuda_poison) */
    /* Page-locked host staging for download_bytes (cuda_memory.cu): made on
     * first use, grown to the largest download, freed with the instance. */
    void *pinned;
    size_t pinned_bytes;
    /* KILN_CUBLASLT_MAX_ALIGN=N (a power of two, 2..256; default 256): the
     * most operand alignment cuBLASLt is told of.  A diagnostic: below 16
     * it cannot pick kernels that move data with the tensor memory
     * accelerator, which is how tools/gpu/check.sh mixedsan tells an
     * initcheck report on TMA-stored GEMM output from a real one. */
    int lt_max_align;
    /* Device time (cuda_timer.cu): events made on first use and kept;
     * marks [0, n_marks) recorded since the last reset. */
    cudaEvent_t timer_events[KILN_BE_TIMER_MARKS];
    int n_timer_events, n_marks;
    int capturing; /* between a begun capture and its end (cuda_graph.cu's gate) */
} cuda_impl;

static inline cuda_impl *cuda_of(kiln_backend *be) { return (cuda_impl *)be->impl; }
static inline cudaStream_t cuda_stream(kiln_backend *be) { return cuda_of(be)->stream; }

/* Records `e` as the sticky KILN_ERR_DEVICE error, or loses the backend
 * (kiln_be_lose) when e leaves the context unusable; returns 1 when e is
 * cudaSuccess (so calls read `if (!cuda_ok(be, cudaX(...), "cudaX")) return;`). */
int cuda_ok(kiln_backend *be, cudaError_t e, const char *what);
/* After a library (cuBLASLt, cuDNN) reports a failure: loses the backend
 * when the context is gone (a sticky error on the stream), so the failure
 * is not taken for one the next request might not hit. */
void cuda_check_context(kiln_backend *be, const char *what);
/* Checks the launch of the kernel just queued (bad configuration, missing
 * kernel image).  Returns 1 when it was queued. */
int cuda_launched(kiln_backend *be, const char *kernel);
/* Makes the instance's device current for the calling thread; 0 on failure. */
int cuda_enter(kiln_backend *be);
/* Scratch device memory of at least `bytes`, valid until the next call.
 * Growing waits for the stream; steady-state calls allocate nothing. */
void *cuda_scratch(kiln_backend *be, size_t bytes);
/* With KILN_CUDA_POISON=1 in the environment: fills `bytes` of new device
 * memory with 0xFF (NaN in bf16 and fp32) and waits for it, so a result
 * that reads memory no op wrote turns NaN or changes.  A check that the
 * output is bit-identical with and without it (tools/gpu/check.sh poison)
 * proves what initcheck is meant to, including for stores it cannot see
 * (its reports on cuBLASLt outputs, docs/GPU_CHECKS.md).  0 on failure. */
int cuda_poison(kiln_backend *be, void *ptr, size_t bytes);

/* Process-wide exclusion between stream captures and the calls that must
 * not overlap a capture on another thread of the process (cuda_graph.cu).
 * Several backends share the process's context (kiln-stages), and a
 * capture is thread-local only for the "potentially unsafe" calls: one
 * that synchronises the whole device, as cudnnDestroy does, invalidates
 * every capture in progress on it, whichever thread made the call.
 * cuda_exclusive_begin waits until no other thread is capturing and keeps
 * new captures from starting until cuda_exclusive_end(its result).  On a
 * thread that is capturing (or already exclusive) it returns 0 at once:
 * waiting would never end, and the call fails that thread's own capture,
 * which then runs op by op (models/dit_replay.c).
 *
 *   int held = cuda_exclusive_begin();
 *   ... cudnnDestroy, cudaFreeHost ...
 *   cuda_exclusive_end(held);
 */
int cuda_exclusive_begin(void);
void cuda_exclusive_end(int held);

#define CUDA_REQUIRE(be, cond)                                                           \
    ((cond) ? 0                                                                          \
            : (kiln_be_fail((be), KILN_ERR_INTERNAL, "cuda backend: %s: check failed: %s", \
                            __func__, #cond),                                            \
               1))

/* Grid size for a grid-stride loop over n elements with 256-thread blocks. */
static inline unsigned cuda_blocks(kiln_backend *be, int64_t n)
{
    int64_t want = (n + 255) / 256, cap = (int64_t)cuda_of(be)->num_sms * 32;
    if (want < 1)
        want = 1;
    return (unsigned)(want < cap ? want : cap);
}

/* --- device helpers ------------------------------------------------------ */

/* Elementwise ops accept BF16 or F32 tensors per operand; the flag is
 * uniform across the grid, so the branch costs nothing next to the load. */
__device__ __forceinline__ float ld_act(const void *p, int64_t i, int is_bf16)
{
    return is_bf16 ? __bfloat162float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

__device__ __forceinline__ void st_act(void *p, int64_t i, float v, int is_bf16)
{
    if (is_bf16)
        ((bf16 *)p)[i] = __float2bfloat16_rn(v);
    else
        ((float *)p)[i] = v;
}

/* Rounds to bf16 when the op's output is bf16: intermediate results that
 * PyTorch materialises as bf16 tensors in the bf16 pipeline are rounded at
 * the same points, so our outputs track diffusers' bit patterns closely. */
__device__ __forceinline__ float rnd_act(float v, int is_bf16)
{
    return is_bf16 ? __bfloat162float(__float2bfloat16_rn(v)) : v;
}

/* One rotated RoPE element, x * cos + y * sin, as diffusers'
 * apply_rotary_emb computes it: two fp32 products and a sum, never fused
 * into an FMA (so rope and qkv_split round identically). */
__device__ __forceinline__ float rope_rot(float x, float c, float y, float s)
{
    return __fadd_rn(__fmul_rn(x, c), __fmul_rn(y, s));
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over a block of blockDim.x threads (a multiple of 32, at most 1024);
 * every thread gets the result.  `red` holds 32 floats of shared memory. */
__device__ __forceinline__ float block_sum(float v, float *red)
{
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return warp_sum(v);
}

static inline int is_bf16(const kiln_tensor *t) { return t->dtype == KILN_BF16; }
static inline int is_act(const kiln_tensor *t)
{
    return t->dtype == KILN_BF16 || t->dtype == KILN_F32;
}

/* --- ops (one file per family) ------------------------------------------- */

kiln_status cuda_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                       const int64_t *shape);
void cuda_free(kiln_backend *be, kiln_tensor *t);
void cuda_upload(kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype host_dtype);
void cuda_download(kiln_backend *be, const kiln_tensor *src, float *host);
void cuda_download_bytes(kiln_backend *be, const kiln_tensor *src, void *host);
void cuda_copy(kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src);
void cuda_sync(kiln_backend *be);

int cuda_linear_init(kiln_backend *be);
void cuda_linear_fini(kiln_backend *be);
void cuda_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                 const kiln_tensor *bias);

/* The FP8 mode (cuda_fp8.cu).  cuda_fp8_quantize: `entries` consecutive
 * slices of `per` elements of x (BF16 when x_bf16, else F32), each
 * quantised alone into an F8E4M3 layout of `per` codes and its scale
 * (common/tensor.h) at y + e * stride (stride >= kiln_tensor_nbytes of
 * `per` codes); 1 when queued.  Nothing waits: graph-capturable. */
void cuda_quantize_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
int cuda_fp8_quantize(kiln_backend *be, const void *x, int x_bf16, int64_t per, int entries,
                      void *y, size_t stride);

void cuda_rms_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                   float eps);
void cuda_layer_norm_mod(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                         const kiln_tensor *shift, const kiln_tensor *scale, float eps);
void cuda_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                     const kiln_tensor *b, int groups, float eps, int silu);
void cuda_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                           int64_t count_before);
void cuda_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                           const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                           int64_t count, int groups, float eps, int silu);

void cuda_rope(kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos, const kiln_tensor *sin,
               kiln_rope_mode mode);
int cuda_attention_init(kiln_backend *be);
void cuda_attention(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q, const kiln_tensor *k,
                    const kiln_tensor *v, const kiln_attn_opts *opts);
/* cuDNN-backed ops (cuda_cudnn*.cu).  init never fails: without cuDNN,
 * cudnn stays NULL.  The ops return 0 when they decline a call (kiln's
 * kernel runs it), 1 when they ran it or recorded an error; callers have
 * validated the arguments. */
void cuda_cudnn_init(kiln_backend *be);
void cuda_cudnn_fini(kiln_backend *be);
int cuda_cudnn_attention(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q,
                         const kiln_tensor *k, const kiln_tensor *v, const kiln_attn_opts *opts);
int cuda_cudnn_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                      const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                      const int pad[4]);

/* One wide head (d >= 256, no mask) as GEMMs, cuda_attention_gemm.cu; 0 when
 * it declines the call, as the cuDNN ops do. */
int cuda_attention_gemm(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q,
                        const kiln_tensor *k, const kiln_tensor *v, const kiln_attn_opts *opts);

void cuda_silu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cuda_tanh(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cuda_swiglu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cuda_add(kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b);
void cuda_gated_add(kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                    const kiln_tensor *y);
void cuda_euler_step(kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt);
void cuda_cfg(kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos, const kiln_tensor *neg,
              float g);

void cuda_copy_rows(kiln_backend *be, kiln_tensor *dst, int64_t dst_row0, const kiln_tensor *src,
                    int64_t src_row0, int64_t n);
void cuda_copy_cols(kiln_backend *be, kiln_tensor *dst, int64_t dst_col0, const kiln_tensor *src,
                    int64_t src_col0, int64_t n);
void cuda_transpose(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cuda_upsample_nearest2x(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cuda_to_rgb8(kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x);

void cuda_qkv_split(kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                    const kiln_tensor *P, const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                    float eps, const kiln_tensor *cos, const kiln_tensor *sin,
                    kiln_rope_mode mode);
void cuda_swiglu_cols(kiln_backend *be, kiln_tensor *y, int64_t dst_col0, const kiln_tensor *x);
kiln_status cuda_mem_info(kiln_backend *be, size_t *free_bytes, size_t *total_bytes);

void cuda_graph_begin(kiln_backend *be);
kiln_graph *cuda_graph_end(kiln_backend *be);
int cuda_graph_launch(kiln_backend *be, kiln_graph *g);
void cuda_graph_destroy(kiln_backend *be, kiln_graph *g);

int cuda_timer_mark(kiln_backend *be);
double cuda_timer_ms(kiln_backend *be, int a, int b);
void cuda_timer_reset(kiln_backend *be);
void cuda_timer_fini(kiln_backend *be);

int cuda_conv_init(kiln_backend *be);
void cuda_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                 const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                 const int pad[4]);

#endif
