#include <string.h>

#include "common/fp8.h"
#include "cpu_ops.h"

kiln_status cpu_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                      const int64_t *shape)
{
    kiln_err err = {0};
    if (kiln_tensor_host_alloc(t, dt, ndim, shape, &err)) {
        kiln_be_fail(be, err.code, "%s", err.msg);
        return err.code;
    }
    return KILN_OK;
}

void cpu_free(kiln_backend *be, kiln_tensor *t)
{
    (void)be;
    kiln_tensor_host_free(t);
}

void cpu_upload(kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype host_dtype)
{
    size_t n = (size_t)kiln_tensor_numel(dst);
    if (dst->dtype == host_dtype) {
        memcpy(dst->data, host, kiln_tensor_nbytes(dst));
        return;
    }
    if (CPU_REQUIRE(be, dst->dtype == KILN_F32))
        return;
    if (kiln_convert_to_f32(dst->data, host, host_dtype, n))
        kiln_be_fail(be, KILN_ERR_INTERNAL, "cpu backend: cannot upload dtype %s",
                     kiln_dtype_name(host_dtype));
}

void cpu_download(kiln_backend *be, const kiln_tensor *src, float *host)
{
    if (src->dtype == KILN_F8E4M3) { /* dequantised (backend.h quantize_fp8) */
        const uint8_t *codes = src->data;
        float s = kiln_f8_scale(src);
        for (int64_t i = 0; i < kiln_tensor_numel(src); i++)
            host[i] = kiln_e4m3_to_f32(codes[i]) * s;
        return;
    }
    if (kiln_convert_to_f32(host, src->data, src->dtype, (size_t)kiln_tensor_numel(src)))
        kiln_be_fail(be, KILN_ERR_INTERNAL, "cpu backend: cannot download dtype %s",
                     kiln_dtype_name(src->dtype));
}

void cpu_download_bytes(kiln_backend *be, const kiln_tensor *src, void *host)
{
    (void)be;
    size_t n = kiln_tensor_nbytes(src);
    if (n)
        memcpy(host, src->data, n);
}

void cpu_copy(kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src)
{
    if (CPU_REQUIRE(be, dst->dtype == src->dtype &&
                            kiln_tensor_numel(dst) == kiln_tensor_numel(src)))
        return;
    memmove(dst->data, src->data, kiln_tensor_nbytes(src));
}

void cpu_sync(kiln_backend *be) { (void)be; }

void cpu_copy_rows(kiln_backend *be, kiln_tensor *dst, int64_t dst_row0, const kiln_tensor *src,
                   int64_t src_row0, int64_t n)
{
    if (CPU_REQUIRE(be, dst->ndim == 3 && src->ndim == 3 && dst->shape[0] == src->shape[0] &&
                            dst->shape[2] == src->shape[2] && dst_row0 >= 0 && src_row0 >= 0 &&
                            dst_row0 + n <= dst->shape[1] && src_row0 + n <= src->shape[1]))
        return;
    int64_t d = dst->shape[2];
    for (int64_t b = 0; b < dst->shape[0]; b++)
        memmove(cpu_f32(dst) + (b * dst->shape[1] + dst_row0) * d,
                cpu_f32(src) + (b * src->shape[1] + src_row0) * d, (size_t)(n * d) * 4);
}

void cpu_copy_cols(kiln_backend *be, kiln_tensor *dst, int64_t dst_col0, const kiln_tensor *src,
                   int64_t src_col0, int64_t n)
{
    int64_t rows = kiln_tensor_rows(dst), dc = kiln_tensor_cols(dst), sc = kiln_tensor_cols(src);
    if (CPU_REQUIRE(be, rows == kiln_tensor_rows(src) && dst_col0 >= 0 && src_col0 >= 0 &&
                            dst_col0 + n <= dc && src_col0 + n <= sc))
        return;
    for (int64_t r = 0; r < rows; r++)
        memmove(cpu_f32(dst) + r * dc + dst_col0, cpu_f32(src) + r * sc + src_col0,
                (size_t)n * 4);
}

void cpu_transpose(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t m = x->shape[x->ndim - 2], n = x->shape[x->ndim - 1];
    int64_t batch = kiln_tensor_numel(x) / (m * n);
    if (CPU_REQUIRE(be, x->ndim >= 2 && y->ndim == x->ndim && y->shape[y->ndim - 2] == n &&
                            y->shape[y->ndim - 1] == m && y->data != x->data))
        return;
    for (int64_t b = 0; b < batch; b++) {
        const float *xs = cpu_f32(x) + b * m * n;
        float *ys = cpu_f32(y) + b * m * n;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++)
                ys[j * m + i] = xs[i * n + j];
    }
}
