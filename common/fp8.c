/* E4M3 conversions (fp8.h), written for clarity: this is the reference the
 * CUDA conversion is tested against. */
#include "fp8.h"

#include <math.h>

uint8_t kiln_f32_to_e4m3(float x)
{
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (isnan(x))
        return sign | 0x7f;
    if (a > KILN_E4M3_MAX)
        return sign | 0x7e; /* saturate: S.1111.110 = 448 */
    if (a < 0x1p-6f) {
        /* Subnormals (and zero): a = m * 2^-9 with m = 0..7; m = 8 rounds
         * up into the smallest normal, which is code 8 as well.  The
         * scaling by 512 is exact and rintf rounds ties to even (the
         * default rounding mode). */
        return sign | (uint8_t)rintf(a * 512.0f);
    }
    int e2;
    float f = frexpf(a, &e2); /* a = f * 2^e2, f in [0.5, 1) */
    int e = e2 - 1;           /* a = (2f) * 2^e, 2f in [1, 2), e in -6..8 */
    /* 3 mantissa bits: (2f - 1) * 8 rounded; exact products, RNE.  A
     * mantissa of 8 carries into the exponent through the addition. */
    int m = (int)rintf((2.0f * f - 1.0f) * 8.0f);
    int code = ((e + 7) << 3) + m;
    return sign | (uint8_t)code; /* <= 0x7e: a <= 448 */
}

float kiln_e4m3_to_f32(uint8_t c)
{
    int e = (c >> 3) & 15, m = c & 7;
    float v;
    if (e == 15 && m == 7)
        v = NAN;
    else if (e == 0)
        v = ldexpf((float)m, -9);
    else
        v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (c & 0x80) ? -v : v;
}

float kiln_f8_scale_of(float amax)
{
    return amax > 0 ? amax / KILN_E4M3_MAX : 1.0f;
}
