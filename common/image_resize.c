/* LANCZOS resampling, bit-exact with Pillow's Image.resize on 8-bit RGB
 * (libImaging/Resample.c: precompute_coeffs, normalize_coeffs_8bpc,
 * ImagingResampleHorizontal_8bpc / Vertical_8bpc, ImagingResampleInner).
 * Every floating-point expression keeps Pillow's operation order (the tap
 * position is multiplied by 1/filterscale, not divided by filterscale) so
 * the double weights are the same bits: a one-ulp difference could move a
 * 22-bit fixed-point rounding.  spec/pipeline.md section 8 describes the
 * same algorithm.  The pass order is Pillow 13's (python-pillow PR #9549,
 * "If height is scaled down significantly more than width, resize
 * vertically first"): the vertical pass first when the height shrinks by
 * more than twice as many pixels as the width does, else the horizontal
 * one; each pass rounds to 8 bits, so the order shows in the result.
 * Pillow up to 12 always ran the horizontal pass first. */
#include "image.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PRECISION_BITS (32 - 8 - 2)
#define LANCZOS_SUPPORT 3.0

static double sinc(double x)
{
    if (x == 0.0)
        return 1.0;
    x = x * M_PI;
    return sin(x) / x;
}

static double lanczos(double x)
{
    if (-LANCZOS_SUPPORT <= x && x < LANCZOS_SUPPORT)
        return sinc(x) * sinc(x / 3);
    return 0.0;
}

/* One axis: for output index o, taps k[o*ksize .. +count) apply to input
 * samples first .. first+count-1. */
typedef struct axis_coeffs {
    int ksize;
    int *first;
    int *count;
    int32_t *k;
} axis_coeffs;

static void axis_free(axis_coeffs *a)
{
    free(a->first);
    free(a->count);
    free(a->k);
}

static kiln_status axis_init(axis_coeffs *a, int in_size, int out_size, kiln_err *err)
{
    double scale = (double)in_size / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = LANCZOS_SUPPORT * filterscale;
    a->ksize = (int)ceil(support) * 2 + 1;
    size_t nk = (size_t)out_size * (size_t)a->ksize;
    a->first = malloc(sizeof *a->first * (size_t)out_size);
    a->count = malloc(sizeof *a->count * (size_t)out_size);
    a->k = calloc(nk, sizeof *a->k);
    double *w = malloc(sizeof *w * (size_t)a->ksize);
    if (!a->first || !a->count || !a->k || !w) {
        free(w);
        axis_free(a);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for resize coefficients");
    }
    double ss = 1.0 / filterscale;
    for (int o = 0; o < out_size; o++) {
        double center = (o + 0.5) * scale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0)
            xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size)
            xmax = in_size;
        xmax -= xmin;
        double ww = 0.0;
        for (int x = 0; x < xmax; x++) {
            w[x] = lanczos((x + xmin - center + 0.5) * ss);
            ww += w[x];
        }
        int32_t *k = a->k + (size_t)o * (size_t)a->ksize;
        for (int x = 0; x < xmax; x++) {
            double v = ww != 0.0 ? w[x] / ww : w[x];
            k[x] = v < 0 ? (int32_t)(-0.5 + v * (1 << PRECISION_BITS))
                         : (int32_t)(0.5 + v * (1 << PRECISION_BITS));
        }
        a->first[o] = xmin;
        a->count[o] = xmax;
    }
    free(w);
    return KILN_OK;
}

/* Sums stay far inside int32 as in Pillow: taps of one output add up to
 * about 1.3 * 2^22 in absolute value, times 255. */
static inline uint8_t clip8(int32_t v)
{
    if (v < 0)
        return 0;
    v >>= PRECISION_BITS;
    return v > 255 ? 255 : (uint8_t)v;
}

/* Output rows 0..rows-1 come from input rows row0..row0+rows-1. */
static void pass_horizontal(uint8_t *dst, int dst_w, const uint8_t *src, int src_w, int row0,
                            int rows, const axis_coeffs *a)
{
    for (int y = 0; y < rows; y++) {
        const uint8_t *in = src + (size_t)(y + row0) * (size_t)src_w * 3;
        uint8_t *o = dst + (size_t)y * (size_t)dst_w * 3;
        for (int x = 0; x < dst_w; x++) {
            const int32_t *k = a->k + (size_t)x * (size_t)a->ksize;
            const uint8_t *p = in + (size_t)a->first[x] * 3;
            int32_t s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0;
            for (int i = 0; i < a->count[x]; i++) {
                s0 += p[3 * i] * k[i];
                s1 += p[3 * i + 1] * k[i];
                s2 += p[3 * i + 2] * k[i];
            }
            o[3 * x] = clip8(s0);
            o[3 * x + 1] = clip8(s1);
            o[3 * x + 2] = clip8(s2);
        }
    }
}

/* Input row indices are a->first[y] - row0 (the horizontal pass kept only
 * the rows from row0 on). */
static void pass_vertical(uint8_t *dst, int dst_h, const uint8_t *src, int w, int row0,
                          const axis_coeffs *a)
{
    size_t stride = (size_t)w * 3;
    for (int y = 0; y < dst_h; y++) {
        const int32_t *k = a->k + (size_t)y * (size_t)a->ksize;
        const uint8_t *in = src + (size_t)(a->first[y] - row0) * stride;
        uint8_t *o = dst + (size_t)y * stride;
        for (size_t c = 0; c < stride; c++) {
            int32_t s = 1 << (PRECISION_BITS - 1);
            for (int i = 0; i < a->count[y]; i++)
                s += in[(size_t)i * stride + c] * k[i];
            o[c] = clip8(s);
        }
    }
}

kiln_status kiln_image_resize_lanczos(const kiln_image *src, int width, int height,
                                      kiln_image *dst, kiln_err *err)
{
    if (!src || !src->pixels || src->width < 1 || src->height < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "cannot resize an empty image");
    if (width < 1 || height < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad resize target %dx%d", width, height);
    int need_h = width != src->width, need_v = height != src->height;
    axis_coeffs ah = {0}, av = {0};
    kiln_image tmp = {0}, out = {0};
    kiln_status st = KILN_OK;
    if (need_h && (st = axis_init(&ah, src->width, width, err)))
        goto done;
    if (need_v && (st = axis_init(&av, src->height, height, err)))
        goto done;

    if (need_h && need_v && height < src->height &&
        src->height - height > 2 * (src->width - width)) {
        /* Pillow 13's vertical-first order: the whole width, then the rows. */
        if ((st = kiln_image_alloc(&tmp, src->width, height, err)) ||
            (st = kiln_image_alloc(&out, width, height, err)))
            goto done;
        pass_vertical(tmp.pixels, height, src->pixels, src->width, 0, &av);
        pass_horizontal(out.pixels, width, tmp.pixels, src->width, 0, height, &ah);
        *dst = out;
        goto done;
    }

    /* `cur` holds source rows row0.. of the image the vertical pass reads.
     * The horizontal pass computes only rows the vertical taps touch: from
     * the first tap of output row 0 to the last tap of the last row. */
    const kiln_image *cur = src;
    int row0 = 0;
    if (need_h) {
        int first = need_v ? av.first[0] : 0;
        int end = need_v ? av.first[height - 1] + av.count[height - 1] : src->height;
        if ((st = kiln_image_alloc(&tmp, width, end - first, err)))
            goto done;
        pass_horizontal(tmp.pixels, width, src->pixels, src->width, first, end - first, &ah);
        cur = &tmp;
        row0 = first;
    }
    if ((st = kiln_image_alloc(&out, width, need_v ? height : cur->height, err)))
        goto done;
    if (need_v)
        pass_vertical(out.pixels, height, cur->pixels, width, row0, &av);
    else
        memcpy(out.pixels, cur->pixels, (size_t)width * (size_t)cur->height * 3);
    *dst = out;
done:
    axis_free(&ah);
    axis_free(&av);
    kiln_image_free(&tmp);
    if (st)
        kiln_image_free(&out);
    return st;
}
