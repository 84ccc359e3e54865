/* Host-side embeddings of the FLUX.2 DiT: the sinusoidal time projection
 * and the RoPE tables (spec/flux2-klein.md §3.1 and §4).  They run on the
 * host in exactly the precision diffusers uses, because near t = 1000 the
 * sinusoid arguments reach 1000 rad and one ulp of a frequency shows. */
#include "flux2_dit.h"

#include <math.h>

void kiln_flux2_time_proj(float t, int64_t channels, float *out)
{
    /* diffusers get_timestep_embedding with flip_sin_to_cos and
     * downscale_freq_shift 0: the exponent is fl32(-ln 10000) * j in fp32,
     * divided exactly by half, then an fp32 exp. */
    const int64_t half = channels / 2;
    const float c = (float)-log(10000.0);
    for (int64_t j = 0; j < half; j++) {
        float e = (c * (float)j) / (float)half;
        float a = t * expf(e);
        out[j] = cosf(a);
        out[half + j] = sinf(a);
    }
}

void kiln_flux2_rope_table(const int32_t *ids, int64_t n, const int64_t *axes_dims,
                           double theta, float *cos_out, float *sin_out)
{
    int64_t d = 0;
    for (int a = 0; a < KILN_FLUX2_ROPE_AXES; a++)
        d += axes_dims[a];
    for (int64_t s = 0; s < n; s++) {
        float *cr = cos_out + s * d, *sr = sin_out + s * d;
        int64_t col = 0;
        for (int a = 0; a < KILN_FLUX2_ROPE_AXES; a++) {
            const int64_t dim = axes_dims[a];
            const double pos = (double)ids[s * KILN_FLUX2_ROPE_AXES + a];
            for (int64_t j = 0; j < dim / 2; j++) {
                /* float64 throughout as diffusers' Flux2PosEmbed does
                 * (freqs_dtype float64 off MPS), rounded to fp32 at the end. */
                double omega = 1.0 / pow(theta, (double)(2 * j) / (double)dim);
                double phi = pos * omega;
                float c = (float)cos(phi), si = (float)sin(phi);
                cr[col + 2 * j] = cr[col + 2 * j + 1] = c;
                sr[col + 2 * j] = sr[col + 2 * j + 1] = si;
            }
            col += dim;
        }
    }
}
