#include "tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtype_info[KILN_DTYPE_COUNT] = {
    [KILN_F32] = {"F32", 4}, [KILN_BF16] = {"BF16", 2}, [KILN_F16] = {"F16", 2},
    [KILN_F64] = {"F64", 8}, [KILN_I64] = {"I64", 8},   [KILN_I32] = {"I32", 4},
    [KILN_U8] = {"U8", 1},      [KILN_F8E4M3] = {"F8_E4M3", 1},
};

size_t kiln_dtype_size(kiln_dtype dt)
{
    return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].size : 0;
}

const char *kiln_dtype_name(kiln_dtype dt)
{
    return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].name : NULL;
}

int kiln_dtype_parse(const char *name, kiln_dtype *out)
{
    for (int i = 0; i < KILN_DTYPE_COUNT; i++) {
        /* kiln's F8E4M3 carries a scale no file or message has (tensor.h). */
        if (i != KILN_F8E4M3 && !strcmp(name, dtype_info[i].name)) {
            *out = (kiln_dtype)i;
            return 0;
        }
    }
    return -1;
}

int64_t kiln_tensor_numel(const kiln_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

size_t kiln_tensor_nbytes(const kiln_tensor *t)
{
    if (t->dtype == KILN_F8E4M3)
        return kiln_f8_scale_offset(kiln_tensor_numel(t)) + 16;
    return (size_t)kiln_tensor_numel(t) * kiln_dtype_size(t->dtype);
}

void kiln_tensor_set_shape(kiln_tensor *t, kiln_dtype dt, int ndim, const int64_t *shape)
{
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < KILN_MAX_DIMS; i++)
        t->shape[i] = i < ndim ? shape[i] : 1;
}

kiln_tensor kiln_tensor_batch_view(const kiln_tensor *t, int64_t b0, int64_t n)
{
    kiln_tensor v = *t;
    size_t row = t->shape[0] ? kiln_tensor_nbytes(t) / (size_t)t->shape[0] : 0;
    v.shape[0] = n;
    v.data = (char *)t->data + (size_t)b0 * row;
    return v;
}

int64_t kiln_tensor_cols(const kiln_tensor *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

int64_t kiln_tensor_rows(const kiln_tensor *t)
{
    return kiln_tensor_numel(t) / (t->ndim ? t->shape[t->ndim - 1] : 1);
}

const char *kiln_tensor_shape_str(const kiln_tensor *t, char *buf, size_t len)
{
    size_t off = 0;
    off += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < t->ndim && off < len; i++)
        off += (size_t)snprintf(buf + off, len - off, i ? ", %lld" : "%lld",
                                (long long)t->shape[i]);
    if (off < len)
        snprintf(buf + off, len - off, "]");
    return buf;
}

kiln_status kiln_tensor_host_alloc(kiln_tensor *t, kiln_dtype dt, int ndim,
                                   const int64_t *shape, kiln_err *err)
{
    memset(t, 0, sizeof *t);
    if (ndim < 0 || ndim > KILN_MAX_DIMS || !kiln_dtype_size(dt))
        return kiln_err_set(err, KILN_ERR_INVALID, "bad tensor rank or dtype");
    uint64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (shape[i] && n > UINT64_MAX / 16 / (uint64_t)shape[i]))
            return kiln_err_set(err, KILN_ERR_INVALID, "bad tensor shape");
        n *= (uint64_t)shape[i];
    }
    size_t bytes = dt == KILN_F8E4M3 ? kiln_f8_scale_offset((int64_t)n) + 16
                                     : (size_t)n * kiln_dtype_size(dt);
    size_t rounded = (bytes + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, rounded ? rounded : 64);
    if (!p)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of host memory (%zu bytes)", bytes);
    memset(p, 0, rounded ? rounded : 64);
    kiln_tensor_set_shape(t, dt, ndim, shape);
    t->data = p;
    return KILN_OK;
}

void kiln_tensor_host_free(kiln_tensor *t)
{
    if (!t)
        return;
    free(t->data);
    t->data = NULL;
}

float kiln_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        if (man == 0) {
            v.u = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            man &= 0x3ff;
            v.u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return v.f;
}

int kiln_convert_to_f32(float *dst, const void *src, kiln_dtype src_dt, size_t n)
{
    switch (src_dt) {
    case KILN_F32:
        memcpy(dst, src, n * 4);
        return 0;
    case KILN_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = kiln_bf16_to_f32(s[i]);
        return 0;
    }
    case KILN_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = kiln_f16_to_f32(s[i]);
        return 0;
    }
    case KILN_F64: {
        const double *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return 0;
    }
    case KILN_I64: {
        const int64_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return 0;
    }
    case KILN_I32: {
        const int32_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return 0;
    }
    case KILN_U8: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = (float)s[i];
        return 0;
    }
    default:
        return -1;
    }
}
