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

void cpu_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x);
    int64_t n = w->ndim == 2 ? w->shape[0] : -1;
    if (CPU_REQUIRE(be, w->ndim == 2 && w->shape[1] == k && kiln_tensor_cols(y) == n &&
                            kiln_tensor_rows(y) == rows &&
                            (!bias || kiln_tensor_numel(bias) == n) && y->data != x->data))
        return;
    const float *xs = cpu_f32(x), *ws = cpu_f32(w), *bs = bias ? cpu_f32(bias) : NULL;
    float *ys = cpu_f32(y);
    /* Each output element is one thread's dot product in a fixed order, so
     * results do not depend on the thread count (batch invariance). */
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j++)
            ys[r * n + j] = dot(xs + r * k, ws + j * k, k) + (bs ? bs[j] : 0.0f);
}
