/* PSNR, SSIM and contact sheets (quality.h). */
#include "quality.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double kiln_quality_psnr(const kiln_image *a, const kiln_image *b)
{
    if (a->width != b->width || a->height != b->height)
        return -1;
    size_t n = (size_t)a->width * a->height * 3;
    double se = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a->pixels[i] - b->pixels[i];
        se += d * d;
    }
    return se == 0 ? INFINITY : 10 * log10(255.0 * 255.0 * (double)n / se);
}

#define WIN 11 /* window side; radius 5 */

/* Luma plane of an image, doubles. */
static double *luma(const kiln_image *im)
{
    size_t n = (size_t)im->width * im->height;
    double *y = malloc(n * sizeof *y);
    if (y)
        for (size_t i = 0; i < n; i++)
            y[i] = 0.299 * im->pixels[3 * i] + 0.587 * im->pixels[3 * i + 1] +
                   0.114 * im->pixels[3 * i + 2];
    return y;
}

/* The Gaussian-weighted mean over each window that fits ("valid"
 * positions, (w - 10) x (h - 10) of them) of src, separably: rows then
 * columns.  tmp holds h * (w - 10) doubles. */
static void blur(const double *src, int w, int h, const double *g, double *tmp, double *dst)
{
    int ow = w - WIN + 1, oh = h - WIN + 1;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < ow; x++) {
            double s = 0;
            for (int k = 0; k < WIN; k++)
                s += g[k] * src[(size_t)y * w + x + k];
            tmp[(size_t)y * ow + x] = s;
        }
    for (int y = 0; y < oh; y++)
        for (int x = 0; x < ow; x++) {
            double s = 0;
            for (int k = 0; k < WIN; k++)
                s += g[k] * tmp[(size_t)(y + k) * ow + x];
            dst[(size_t)y * ow + x] = s;
        }
}

double kiln_quality_ssim(const kiln_image *a, const kiln_image *b)
{
    if (a->width != b->width || a->height != b->height || a->width < WIN || a->height < WIN)
        return NAN;
    const int w = a->width, h = a->height, ow = w - WIN + 1, oh = h - WIN + 1;
    const size_t n = (size_t)w * h, on = (size_t)ow * oh;
    double g[WIN], gs = 0;
    for (int k = 0; k < WIN; k++)
        gs += g[k] = exp(-(double)((k - WIN / 2) * (k - WIN / 2)) / (2 * 1.5 * 1.5));
    for (int k = 0; k < WIN; k++)
        g[k] /= gs;
    double *x = luma(a), *y = luma(b), *prod = malloc(n * sizeof *prod);
    double *tmp = malloc((size_t)h * ow * sizeof *tmp);
    double *m[5];
    int ok = x && y && prod && tmp;
    for (int i = 0; i < 5; i++)
        ok = (m[i] = ok ? malloc(on * sizeof **m) : NULL) && ok;
    double result = NAN;
    if (ok) {
        /* E[x], E[y], E[x^2], E[y^2], E[xy] over each window. */
        blur(x, w, h, g, tmp, m[0]);
        blur(y, w, h, g, tmp, m[1]);
        for (size_t i = 0; i < n; i++)
            prod[i] = x[i] * x[i];
        blur(prod, w, h, g, tmp, m[2]);
        for (size_t i = 0; i < n; i++)
            prod[i] = y[i] * y[i];
        blur(prod, w, h, g, tmp, m[3]);
        for (size_t i = 0; i < n; i++)
            prod[i] = x[i] * y[i];
        blur(prod, w, h, g, tmp, m[4]);
        const double c1 = (0.01 * 255) * (0.01 * 255), c2 = (0.03 * 255) * (0.03 * 255);
        double sum = 0;
        for (size_t i = 0; i < on; i++) {
            double mx = m[0][i], my = m[1][i];
            double vx = m[2][i] - mx * mx, vy = m[3][i] - my * my, cxy = m[4][i] - mx * my;
            sum += (2 * mx * my + c1) * (2 * cxy + c2) /
                   ((mx * mx + my * my + c1) * (vx + vy + c2));
        }
        result = sum / (double)on;
    }
    free(x), free(y), free(prod), free(tmp);
    for (int i = 0; i < 5; i++)
        free(m[i]); /* every m[i] was set, NULL once an allocation failed */
    return result;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void kiln_quality_summary(double *v, int n, double *median, double *worst)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    *median = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
    *worst = v[0];
}

/* src scaled to tw x th by averaging the source pixels each target pixel
 * covers (nearest source rectangle), written at (x0, y0) of dst. */
static void paste_scaled(kiln_image *dst, int x0, int y0, const kiln_image *src, int tw, int th)
{
    for (int ty = 0; ty < th; ty++) {
        int sy0 = (int)((int64_t)ty * src->height / th);
        int sy1 = (int)((int64_t)(ty + 1) * src->height / th);
        if (sy1 <= sy0)
            sy1 = sy0 + 1;
        for (int tx = 0; tx < tw; tx++) {
            int sx0 = (int)((int64_t)tx * src->width / tw);
            int sx1 = (int)((int64_t)(tx + 1) * src->width / tw);
            if (sx1 <= sx0)
                sx1 = sx0 + 1;
            for (int c = 0; c < 3; c++) {
                unsigned sum = 0, cnt = 0;
                for (int sy = sy0; sy < sy1; sy++)
                    for (int sx = sx0; sx < sx1; sx++, cnt++)
                        sum += src->pixels[((size_t)sy * src->width + sx) * 3 + c];
                dst->pixels[((size_t)(y0 + ty) * dst->width + x0 + tx) * 3 + c] =
                    (uint8_t)((sum + cnt / 2) / cnt);
            }
        }
    }
}

kiln_status kiln_quality_sheet(const kiln_image *const (*pairs)[2], int n, int thumb, int cols,
                               kiln_image *out, kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (n < 1 || thumb < 1 || cols < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "contact sheet: nothing to show");
    const kiln_image *first = pairs[0][0];
    for (int i = 0; i < n; i++)
        for (int s = 0; s < 2; s++)
            if (pairs[i][s]->width != first->width || pairs[i][s]->height != first->height)
                return kiln_err_set(err, KILN_ERR_INVALID,
                                    "contact sheet: image %d is %dx%d, the first %dx%d", i,
                                    pairs[i][s]->width, pairs[i][s]->height, first->width,
                                    first->height);
    int th = (int)((int64_t)thumb * first->height / first->width);
    if (th < 1)
        th = 1;
    const int gap = 8, rows = (n + cols - 1) / cols;
    /* Each cell: left | right with no gap between (the comparison), cells
     * apart by `gap` pixels of white. */
    int W = cols * 2 * thumb + (cols + 1) * gap, H = rows * th + (rows + 1) * gap;
    if (kiln_image_alloc(out, W, H, err))
        return err->code;
    memset(out->pixels, 255, (size_t)W * H * 3);
    for (int i = 0; i < n; i++) {
        int x0 = gap + (i % cols) * (2 * thumb + gap), y0 = gap + (i / cols) * (th + gap);
        paste_scaled(out, x0, y0, pairs[i][0], thumb, th);
        paste_scaled(out, x0 + thumb, y0, pairs[i][1], thumb, th);
    }
    return KILN_OK;
}
