/* Image quality metrics for the FP8 mode's cost (kiln-quality,
 * tools/gpu/check.sh fp8): PSNR and SSIM of one image against a reference
 * of the same size, and a side-by-side contact sheet.
 *
 *   double p = kiln_quality_psnr(&a, &b);   // dB, INFINITY when identical
 *   double s = kiln_quality_ssim(&a, &b);   // 1 when identical
 *   const kiln_image *pairs[][2] = {{&a, &b}, ...};
 *   kiln_quality_sheet(pairs, n, 512, 2, &sheet, &err);
 *
 * PSNR is over the 8-bit RGB values (peak 255).  SSIM is Wang et al.'s
 * (2004) on the luma Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601, as
 * skimage's and the paper's grayscale use): 11x11 Gaussian windows of sigma
 * 1.5, K1 = 0.01, K2 = 0.03, L = 255, averaged over the windows that fit
 * inside the image (skimage's structural_similarity with
 * gaussian_weights=True, use_sample_covariance=False, data_range=255).
 * Pure functions over the caller's images; reentrant. */
#ifndef KILN_TOOLS_BENCH_QUALITY_H
#define KILN_TOOLS_BENCH_QUALITY_H

#include "common/image.h"

/* PSNR: -1 when the sizes differ.  SSIM: NaN when the sizes differ, the
 * images are smaller than one 11x11 window or memory runs out. */
double kiln_quality_psnr(const kiln_image *a, const kiln_image *b);
double kiln_quality_ssim(const kiln_image *a, const kiln_image *b);

/* The median and the worst (smallest) of n values, n >= 1; `v` is sorted
 * in place. */
void kiln_quality_summary(double *v, int n, double *median, double *worst);

/* A contact sheet: n pairs (left, right) each scaled to `thumb` pixels
 * wide (box filter; the height follows the aspect of the pair's left
 * image, all pairs of one size), `cols` pairs per row.  *out is allocated
 * (kiln_image_free).  KILN_ERR_INVALID for n < 1 or images of differing
 * sizes, KILN_ERR_NOMEM. */
kiln_status kiln_quality_sheet(const kiln_image *const (*pairs)[2], int n, int thumb, int cols,
                               kiln_image *out, kiln_err *err);

#endif
