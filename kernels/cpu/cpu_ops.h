/* The CPU reference backend's operations, one file per family
 * (cpu_memory.c, cpu_linear.c, cpu_norm.c, cpu_attention.c, cpu_elementwise.c,
 * cpu_conv.c, cpu_fused.c, cpu_rgb8.c), gathered into the ops table by cpu_backend.c.
 *
 * Plain fp32 loops written for clarity: this backend is the oracle the CUDA
 * kernels are tested against.  Shape mismatches are caller bugs and become a
 * sticky KILN_ERR_INTERNAL error (see kernels/backend.h). */
#ifndef KILN_CPU_OPS_H
#define KILN_CPU_OPS_H

#include "kernels/backend.h"

/* Records a sticky error and returns 1 when `cond` is false. */
#define CPU_REQUIRE(be, cond)                                                        \
    ((cond) ? 0                                                                      \
            : (kiln_be_fail((be), KILN_ERR_INTERNAL, "cpu backend: %s: shape check failed: %s", \
                            __func__, #cond),                                        \
               1))

static inline float *cpu_f32(const kiln_tensor *t) { return (float *)t->data; }

kiln_status cpu_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                      const int64_t *shape);
void cpu_free(kiln_backend *be, kiln_tensor *t);
void cpu_upload(kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype host_dtype);
void cpu_download(kiln_backend *be, const kiln_tensor *src, float *host);
void cpu_download_bytes(kiln_backend *be, const kiln_tensor *src, void *host);
void cpu_copy(kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src);
void cpu_sync(kiln_backend *be);

void cpu_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias);
void cpu_quantize_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

void cpu_rms_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                  float eps);
void cpu_layer_norm_mod(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                        const kiln_tensor *shift, const kiln_tensor *scale, float eps);
void cpu_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                    const kiln_tensor *b, int groups, float eps, int silu);
void cpu_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                          int64_t count_before);
void cpu_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                          const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                          int64_t count, int groups, float eps, int silu);

void cpu_rope(kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos, const kiln_tensor *sin,
              kiln_rope_mode mode);
void cpu_attention(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q, const kiln_tensor *k,
                   const kiln_tensor *v, const kiln_attn_opts *opts);

void cpu_silu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cpu_tanh(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cpu_swiglu(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
void cpu_add(kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b);
void cpu_gated_add(kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                   const kiln_tensor *y);
void cpu_euler_step(kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt);
void cpu_cfg(kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos, const kiln_tensor *neg,
             float g);
void cpu_copy_rows(kiln_backend *be, kiln_tensor *dst, int64_t dst_row0, const kiln_tensor *src,
                   int64_t src_row0, int64_t n);
void cpu_copy_cols(kiln_backend *be, kiln_tensor *dst, int64_t dst_col0, const kiln_tensor *src,
                   int64_t src_col0, int64_t n);
void cpu_transpose(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

void cpu_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                const int pad[4]);
void cpu_upsample_nearest2x(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

void cpu_to_rgb8(kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x);

void cpu_qkv_split(kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                   const kiln_tensor *P, const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                   float eps, const kiln_tensor *cos, const kiln_tensor *sin, kiln_rope_mode mode);
void cpu_swiglu_cols(kiln_backend *be, kiln_tensor *y, int64_t dst_col0, const kiln_tensor *x);

#endif
