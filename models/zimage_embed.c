/* Host-side RoPE tables of the Z-Image DiT (spec/z-image-turbo.md §3.3):
 * diffusers' RopeEmbedder builds them once on the CPU with torch.polar of
 * an fp32 angle, so the cosine and sine are fp32 functions of the rounded
 * angle (FLUX.2 takes them in float64 instead, flux2_embed.c). */
#include "zimage_dit.h"

#include <math.h>

void kiln_zimage_rope_table(const int32_t *ids, int64_t n, const int64_t *axes_dims, double theta,
                            float *cos_out, float *sin_out)
{
    int64_t d = 0;
    for (int a = 0; a < KILN_ZIMAGE_ROPE_AXES; a++)
        d += axes_dims[a];
    for (int64_t s = 0; s < n; s++) {
        float *cr = cos_out + s * d, *sr = sin_out + s * d;
        int64_t col = 0;
        for (int a = 0; a < KILN_ZIMAGE_ROPE_AXES; a++) {
            const int64_t dim = axes_dims[a];
            const double pos = (double)ids[s * KILN_ZIMAGE_ROPE_AXES + a];
            for (int64_t j = 0; j < dim / 2; j++) {
                /* 1 / theta ** (arange(0, dim, 2) / dim) and the outer
                 * product in float64, then .float(). */
                double omega = 1.0 / pow(theta, (double)(2 * j) / (double)dim);
                float phi = (float)(pos * omega);
                float c = cosf(phi), si = sinf(phi);
                cr[col + 2 * j] = cr[col + 2 * j + 1] = c;
                sr[col + 2 * j] = sr[col + 2 * j + 1] = si;
            }
            col += dim;
        }
    }
}
