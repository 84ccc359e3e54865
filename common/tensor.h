/* kiln tensors: dtype, shape and a data pointer, owned by a backend or by the
 * host.
 *
 *   kiln_tensor t;
 *   int64_t shape[] = {2, 512, 48};
 *   if (kiln_tensor_host_alloc(&t, KILN_F32, 3, shape, &err)) return err.code;
 *   float *p = t.data;  ...  kiln_tensor_host_free(&t);
 *
 * A tensor is always dense and row-major (the last dimension is contiguous).
 * `data` points into host memory when `on_device` is 0, otherwise into the
 * memory of the backend that allocated it (see kernels/backend.h).  The
 * struct itself is a plain value: copying it copies the view, not the data;
 * only the allocator that made it frees it.  Not thread-safe to mutate.
 */
#ifndef KILN_TENSOR_H
#define KILN_TENSOR_H

#include <stdint.h>
#include <stddef.h>

#include "error.h"

#define KILN_MAX_DIMS 6

typedef enum kiln_dtype {
    KILN_F32 = 0,
    KILN_BF16,
    KILN_F16,
    KILN_F64,
    KILN_I64,
    KILN_I32,
    KILN_U8,
    /* FP8 E4M3 codes with their fp32 scale (common/fp8.h): the FP8 mode's
     * weights and quantised activations.  Only backends make them; no
     * file or message carries them (kiln_dtype_parse does not know the
     * name), since kiln's layout is its own: numel one-byte codes, then at
     * kiln_f8_scale_offset(numel) the float s that dequantises them
     * (value = e4m3(code) * s), all inside kiln_tensor_nbytes. */
    KILN_F8E4M3,
    KILN_DTYPE_COUNT
} kiln_dtype;

typedef struct kiln_tensor {
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    void *data;
    int on_device; /* 1: data belongs to a non-host backend */
} kiln_tensor;

/* Bytes per element; 0 for an invalid dtype. */
size_t kiln_dtype_size(kiln_dtype dt);
/* "F32", "BF16", ... as safetensors spells them; NULL for an invalid dtype. */
const char *kiln_dtype_name(kiln_dtype dt);
/* Parses a safetensors dtype name; returns -1 when unknown. */
int kiln_dtype_parse(const char *name, kiln_dtype *out);

/* Element count (product of the shape; 1 for ndim 0). */
int64_t kiln_tensor_numel(const kiln_tensor *t);
/* Bytes of the tensor's memory: numel * element size, and for F8E4M3 the
 * codes padded to 16 bytes plus 16 bytes holding the scale. */
size_t kiln_tensor_nbytes(const kiln_tensor *t);
/* Where an F8E4M3 tensor of numel codes keeps its float scale: right after
 * the codes, at a 16-byte boundary (so a matrix's codes and its scale can
 * each be handed to cuBLASLt as they are). */
static inline size_t kiln_f8_scale_offset(int64_t numel)
{
    return ((size_t)numel + 15) & ~(size_t)15;
}
/* Sets dtype/ndim/shape and leaves data untouched.  ndim <= KILN_MAX_DIMS. */
void kiln_tensor_set_shape(kiln_tensor *t, kiln_dtype dt, int ndim, const int64_t *shape);
/* Rows = product of all dims but the last; cols = the last dim. */
int64_t kiln_tensor_rows(const kiln_tensor *t);
int64_t kiln_tensor_cols(const kiln_tensor *t);
/* Entries [b0, b0 + n) of the first dimension (batch rows) as a tensor that
 * shares t's memory; the caller keeps 0 <= b0, b0 + n <= shape[0]. */
kiln_tensor kiln_tensor_batch_view(const kiln_tensor *t, int64_t b0, int64_t n);
/* Formats the shape as "[2, 512, 48]" into buf. */
const char *kiln_tensor_shape_str(const kiln_tensor *t, char *buf, size_t len);

/* Host allocation (64-byte aligned, zero-filled).  Fails with KILN_ERR_NOMEM
 * or KILN_ERR_INVALID (bad shape/overflow).  Free with kiln_tensor_host_free,
 * which also accepts a zeroed tensor. */
kiln_status kiln_tensor_host_alloc(kiln_tensor *t, kiln_dtype dt, int ndim,
                                   const int64_t *shape, kiln_err *err);
void kiln_tensor_host_free(kiln_tensor *t);

/* bf16 <-> f32 (round to nearest even; NaN stays NaN). */
static inline float kiln_bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

static inline uint16_t kiln_f32_to_bf16(float f)
{
    union { uint32_t u; float f; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u);
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + rounding) >> 16);
}

/* Rounds an f32 to the nearest bf16 value and returns it as f32. */
static inline float kiln_round_bf16(float f) { return kiln_bf16_to_f32(kiln_f32_to_bf16(f)); }

float kiln_f16_to_f32(uint16_t h);

/* Converts n elements of a host buffer of dtype `src_dt` (F32, BF16, F16, F64,
 * I64, I32, U8) to f32.  Returns -1 for an unsupported dtype. */
int kiln_convert_to_f32(float *dst, const void *src, kiln_dtype src_dt, size_t n);

#endif
