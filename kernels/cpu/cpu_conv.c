#include <string.h>

#include "cpu_ops.h"

/* Direct convolution: for every (output channel, input channel, tap) the
 * whole output plane is updated, so the inner loop runs over contiguous x. */
void cpu_conv2d(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                const kiln_tensor *bias, int stride, const int pad[4])
{
    if (CPU_REQUIRE(be, x->ndim == 4 && w->ndim == 4 && y->ndim == 4 && stride >= 1 &&
                            w->shape[1] == x->shape[1] && y->shape[0] == x->shape[0] &&
                            y->shape[1] == w->shape[0] && y->data != x->data))
        return;
    int64_t bsz = x->shape[0], cin = x->shape[1], h = x->shape[2], wd = x->shape[3];
    int64_t cout = w->shape[0], kh = w->shape[2], kw = w->shape[3];
    int64_t ho = (h + pad[0] + pad[2] - kh) / stride + 1;
    int64_t wo = (wd + pad[1] + pad[3] - kw) / stride + 1;
    if (CPU_REQUIRE(be, y->shape[2] == ho && y->shape[3] == wo &&
                            (!bias || kiln_tensor_numel(bias) == cout)))
        return;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < bsz; b++) {
        for (int64_t co = 0; co < cout; co++) {
            float *yp = cpu_f32(y) + (b * cout + co) * ho * wo;
            float bv = bias ? cpu_f32(bias)[co] : 0.0f;
            for (int64_t i = 0; i < ho * wo; i++)
                yp[i] = bv;
            for (int64_t ci = 0; ci < cin; ci++) {
                const float *xp = cpu_f32(x) + (b * cin + ci) * h * wd;
                for (int64_t ky = 0; ky < kh; ky++)
                    for (int64_t kx = 0; kx < kw; kx++) {
                        float wv = cpu_f32(w)[((co * cin + ci) * kh + ky) * kw + kx];
                        for (int64_t oy = 0; oy < ho; oy++) {
                            int64_t iy = oy * stride + ky - pad[0];
                            if (iy < 0 || iy >= h)
                                continue;
                            const float *xr = xp + iy * wd;
                            float *yr = yp + oy * wo;
                            for (int64_t ox = 0; ox < wo; ox++) {
                                int64_t ix = ox * stride + kx - pad[1];
                                if (ix >= 0 && ix < wd)
                                    yr[ox] += wv * xr[ix];
                            }
                        }
                    }
            }
        }
    }
}

void cpu_upsample_nearest2x(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && y->ndim == 4 && y->shape[0] == x->shape[0] &&
                            y->shape[1] == x->shape[1] && y->shape[2] == 2 * x->shape[2] &&
                            y->shape[3] == 2 * x->shape[3]))
        return;
    int64_t planes = x->shape[0] * x->shape[1], h = x->shape[2], w = x->shape[3];
    for (int64_t p = 0; p < planes; p++)
        for (int64_t yy = 0; yy < 2 * h; yy++)
            for (int64_t xx = 0; xx < 2 * w; xx++)
                cpu_f32(y)[(p * 2 * h + yy) * 2 * w + xx] = cpu_f32(x)[(p * h + yy / 2) * w + xx / 2];
}
