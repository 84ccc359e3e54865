#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/fp8.h"
#include "cpu_ops.h"

/* Four independent partial sums keep the dependency chain short; the order
 * differs from BLAS, which is within the fp32 oracle tolerance. */
static float dot(const float *a, const float *b, int64_t n)
{
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        s0 += a[k] * b[k];
        s1 += a[k + 1] * b[k + 1];
        s2 += a[k + 2] * b[k + 2];
        s3 += a[k + 3] * b[k + 3];
    }
    for (; k < n; k++)
        s0 += a[k] * b[k];
    return (s0 + s1) + (s2 + s3);
}

/* --- the FP8 mode (kernels/backend.h linear, quantize_fp8) ----------------
 * The reference of the CUDA path: values quantised to E4M3 exactly as the
 * kernels do (common/fp8.h), the products of the quantised values summed
 * in fp32 and scaled at the end, as cuBLASLt's FP8 GEMM computes. */

void cpu_quantize_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    int64_t n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, y->dtype == KILN_F8E4M3 && x->dtype == KILN_F32 &&
                            kiln_tensor_numel(y) == n))
        return;
    const float *xs = cpu_f32(x);
    float amax = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(xs[i]);
        if (a > amax) /* false for NaN: NaNs do not count */
            amax = a;
    }
    float s = kiln_f8_scale_of(amax);
    uint8_t *codes = y->data;
    for (int64_t i = 0; i < n; i++)
        codes[i] = kiln_f32_to_e4m3(xs[i] / s);
    memcpy(codes + kiln_f8_scale_offset(n), &s, sizeof s);
}

static void linear_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                       const kiln_tensor *w, const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x), n = w->shape[0];
    if (CPU_REQUIRE(be, kiln_f8_linear_ok(n, k)) || !rows)
        return;
    /* Batch entries are quantised alone (backend.h), so a row's scale
     * never depends on the other rows of its batch. */
    int64_t entries = x->ndim >= 3 ? x->shape[0] : 1, per = entries ? rows / entries : 0;
    float *wq = malloc((size_t)(n * k) * sizeof *wq);
    float *xq = malloc((size_t)(per * k) * sizeof *xq);
    kiln_tensor x8 = {0};
    kiln_err err = {0};
    if (!wq || !xq || kiln_tensor_host_alloc(&x8, KILN_F8E4M3, 1, (int64_t[]){per * k}, &err)) {
        kiln_be_fail(be, KILN_ERR_NOMEM, "cpu backend: out of memory for an fp8 linear");
        goto out;
    }
    const uint8_t *wc = w->data;
    for (int64_t i = 0; i < n * k; i++)
        wq[i] = kiln_e4m3_to_f32(wc[i]);
    const float sw = kiln_f8_scale(w), *bs = bias ? cpu_f32(bias) : NULL;
    for (int64_t b = 0; b < entries; b++) {
        kiln_tensor xb = *x;
        kiln_tensor_set_shape(&xb, KILN_F32, 1, (int64_t[]){per * k});
        xb.data = cpu_f32(x) + b * per * k;
        cpu_quantize_fp8(be, &x8, &xb);
        if (be->error.code)
            break;
        const uint8_t *xc = x8.data;
        for (int64_t i = 0; i < per * k; i++)
            xq[i] = kiln_e4m3_to_f32(xc[i]);
        const float sxw = kiln_f8_scale(&x8) * sw;
        float *ys = cpu_f32(y) + b * per * n;
#pragma omp parallel for collapse(2) schedule(static)
        for (int64_t r = 0; r < per; r++)
            for (int64_t j = 0; j < n; j++)
                ys[r * n + j] = dot(xq + r * k, wq + j * k, k) * sxw + (bs ? bs[j] : 0.0f);
    }
out:
    kiln_tensor_host_free(&x8);
    free(wq);
    free(xq);
}

void cpu_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x);
    int64_t n = w->ndim == 2 ? w->shape[0] : -1;
    if (CPU_REQUIRE(be, w->ndim == 2 && w->shape[1] == k && kiln_tensor_cols(y) == n &&
                            kiln_tensor_rows(y) == rows &&
                            (!bias || kiln_tensor_numel(bias) == n) && y->data != x->data))
        return;
    if (w->dtype == KILN_F8E4M3) {
        linear_fp8(be, y, x, w, bias);
        return;
    }
    const float *xs = cpu_f32(x), *ws = cpu_f32(w), *bs = bias ? cpu_f32(bias) : NULL;
    float *ys = cpu_f32(y);
    /* Each output element is one thread's dot product in a fixed order, so
     * results do not depend on the thread count (batch invariance). */
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++)
            ys[r * n + j] = dot(xs + r * k, ws + j * k, k) + (bs ? bs[j] : 0.0f);
}
