#include <string.h>

#include "cpu_ops.h"

/* Direct convolution over channels-last data: each output pixel's Cout
 * values are sums over the taps of dot products along Cin, which is
 * contiguous in both x (B, H, W, Cin) and w (Cout, kh, kw, Cin); the
 * residual is added to the finished sum, as a separate add would. */
void cpu_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                const int pad[4])
{
    if (CPU_REQUIRE(be, x->ndim == 4 && w->ndim == 4 && y->ndim == 4 && stride >= 1 &&
                            w->shape[3] == x->shape[3] && y->shape[0] == x->shape[0] &&
                            y->shape[3] == w->shape[0] && y->data != x->data) ||
        CPU_REQUIRE(be, !residual || (residual->data != y->data &&
                                      kiln_tensor_numel(residual) == kiln_tensor_numel(y))))
        return;
    int64_t bsz = x->shape[0], h = x->shape[1], wd = x->shape[2], cin = x->shape[3];
    int64_t cout = w->shape[0], kh = w->shape[1], kw = w->shape[2];
    int64_t ho = (h + pad[0] + pad[2] - kh) / stride + 1;
    int64_t wo = (wd + pad[1] + pad[3] - kw) / stride + 1;
    if (CPU_REQUIRE(be, y->shape[1] == ho && y->shape[2] == wo &&
                            (!bias || kiln_tensor_numel(bias) == cout)))
        return;
    const float *xs = cpu_f32(x), *ws = cpu_f32(w), *bs = bias ? cpu_f32(bias) : NULL;
    const float *rs = residual ? cpu_f32(residual) : NULL;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < bsz; b++) {
        for (int64_t oy = 0; oy < ho; oy++) {
            for (int64_t ox = 0; ox < wo; ox++) {
                float *yp = cpu_f32(y) + ((b * ho + oy) * wo + ox) * cout;
                for (int64_t co = 0; co < cout; co++)
                    yp[co] = bs ? bs[co] : 0.0f;
                for (int64_t ky = 0; ky < kh; ky++) {
                    int64_t iy = oy * stride + ky - pad[0];
                    if (iy < 0 || iy >= h)
                        continue;
                    for (int64_t kx = 0; kx < kw; kx++) {
                        int64_t ix = ox * stride + kx - pad[1];
                        if (ix < 0 || ix >= wd)
                            continue;
                        const float *xp = xs + ((b * h + iy) * wd + ix) * cin;
                        for (int64_t co = 0; co < cout; co++) {
                            const float *wp = ws + ((co * kh + ky) * kw + kx) * cin;
                            float acc = 0.0f;
                            for (int64_t ci = 0; ci < cin; ci++)
                                acc += wp[ci] * xp[ci];
                            yp[co] += acc;
                        }
                    }
                }
                if (rs)
                    for (int64_t co = 0; co < cout; co++)
                        yp[co] += rs[((b * ho + oy) * wo + ox) * cout + co];
            }
        }
    }
}

void cpu_upsample_nearest2x(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && y->ndim == 4 && y->shape[0] == x->shape[0] &&
                            y->shape[3] == x->shape[3] && y->shape[1] == 2 * x->shape[1] &&
                            y->shape[2] == 2 * x->shape[2]))
        return;
    int64_t bsz = x->shape[0], h = x->shape[1], w = x->shape[2], c = x->shape[3];
    size_t px = (size_t)c * sizeof(float);
    for (int64_t b = 0; b < bsz; b++)
        for (int64_t yy = 0; yy < 2 * h; yy++)
            for (int64_t xx = 0; xx < 2 * w; xx++)
                memcpy(cpu_f32(y) + ((b * 2 * h + yy) * 2 * w + xx) * c,
                       cpu_f32(x) + ((b * h + yy / 2) * w + xx / 2) * c, px);
}
