/* kiln-quality: the cost in quality of a faster mode, image by image: PSNR
 * and SSIM (quality.h) of DIR_TEST/<i>.png against DIR_REF/<i>.png for
 * i < N, their median and worst, and a contact sheet of the first few
 * pairs (reference left, test right).  tools/gpu/check.sh fp8 runs it on
 * the FP8 mode's images against the exact ones of the same seeds.
 *
 *   kiln-quality --ref DIR --test DIR --n N [--sheet OUT.png] [--sheet-n 8]
 *                [--thumb 512] [--cols 2] [--min-psnr DB] [--min-ssim S]
 *
 * Prints one line per image and the summary; exit status 1 when a given
 * bar is missed by the worst image, 2 on bad usage or an unreadable or
 * mismatched image. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "quality.h"

typedef struct opts {
    const char *ref, *test, *sheet;
    int n, sheet_n, thumb, cols;
    double min_psnr, min_ssim;
} opts;

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){.sheet_n = 8, .thumb = 512, .cols = 2, .min_psnr = -1, .min_ssim = -2};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        char *end;
        double d = strtod(v, &end);
        int num = *v && !*end;
        if (!strcmp(a, "--ref"))
            o->ref = v;
        else if (!strcmp(a, "--test"))
            o->test = v;
        else if (!strcmp(a, "--sheet"))
            o->sheet = v;
        else if (!strcmp(a, "--n") && num && d >= 1 && d <= 100000)
            o->n = (int)d;
        else if (!strcmp(a, "--sheet-n") && num && d >= 1 && d <= 64)
            o->sheet_n = (int)d;
        else if (!strcmp(a, "--thumb") && num && d >= 16 && d <= 4096)
            o->thumb = (int)d;
        else if (!strcmp(a, "--cols") && num && d >= 1 && d <= 16)
            o->cols = (int)d;
        else if (!strcmp(a, "--min-psnr") && num)
            o->min_psnr = d;
        else if (!strcmp(a, "--min-ssim") && num)
            o->min_ssim = d;
        else
            return -1;
    }
    return o->ref && o->test && o->n && !(argc % 2 == 0) ? 0 : -1;
}

static int read_pair(const opts *o, int i, kiln_image *r, kiln_image *t)
{
    char pr[4096], pt[4096];
    snprintf(pr, sizeof pr, "%s/%d.png", o->ref, i);
    snprintf(pt, sizeof pt, "%s/%d.png", o->test, i);
    kiln_err err = {0};
    if (kiln_image_read_file(pr, NULL, r, &err) || kiln_image_read_file(pt, NULL, t, &err)) {
        fprintf(stderr, "kiln-quality: %s\n", err.msg);
        return -1;
    }
    if (r->width != t->width || r->height != t->height) {
        fprintf(stderr, "kiln-quality: %s is %dx%d, %s %dx%d\n", pr, r->width, r->height, pt,
                t->width, t->height);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: kiln-quality --ref DIR --test DIR --n N [--sheet OUT.png]\n"
                        "  [--sheet-n 8] [--thumb 512] [--cols 2] [--min-psnr DB] [--min-ssim S]\n"
                        "Compares DIR_TEST/<i>.png with DIR_REF/<i>.png for i < N.\n");
        return 2;
    }
    double *psnr = malloc((size_t)o.n * sizeof *psnr), *ssim = malloc((size_t)o.n * sizeof *ssim);
    int ns = o.sheet_n < o.n ? o.sheet_n : o.n;
    kiln_image *kept = calloc((size_t)ns * 2, sizeof *kept);
    if (!psnr || !ssim || !kept) {
        fprintf(stderr, "kiln-quality: out of memory\n");
        return 2;
    }
    int rc = 0, worst_p = 0, worst_s = 0;
    printf("%5s %10s %8s\n", "image", "PSNR dB", "SSIM");
    for (int i = 0; i < o.n && !rc; i++) {
        kiln_image r = {0}, t = {0};
        if (read_pair(&o, i, &r, &t)) {
            rc = 2;
        } else {
            psnr[i] = kiln_quality_psnr(&t, &r);
            ssim[i] = kiln_quality_ssim(&t, &r);
            if (isnan(ssim[i])) {
                fprintf(stderr, "kiln-quality: image %d: SSIM failed (out of memory?)\n", i);
                rc = 2;
            }
            printf("%5d %10.2f %8.5f\n", i, psnr[i], ssim[i]);
            worst_p = psnr[i] < psnr[worst_p] ? i : worst_p;
            worst_s = ssim[i] < ssim[worst_s] ? i : worst_s;
        }
        if (i < ns) {
            kept[2 * i] = r, kept[2 * i + 1] = t;
        } else {
            kiln_image_free(&r), kiln_image_free(&t);
        }
    }
    if (!rc) {
        double pm, pw, sm, sw;
        int wp = worst_p, ws = worst_s;
        kiln_quality_summary(psnr, o.n, &pm, &pw);
        kiln_quality_summary(ssim, o.n, &sm, &sw);
        printf("%d images: PSNR median %.2f dB, worst %.2f dB (image %d); SSIM median %.5f, "
               "worst %.5f (image %d)\n", o.n, pm, pw, wp, sm, sw, ws);
        if ((o.min_psnr >= 0 && pw < o.min_psnr) || (o.min_ssim >= -1 && sw < o.min_ssim)) {
            printf("below the bar (PSNR >= %g dB, SSIM >= %g)\n", o.min_psnr, o.min_ssim);
            rc = 1;
        }
    }
    if (o.sheet && rc != 2) {
        const kiln_image *(*pairs)[2] = calloc((size_t)ns, sizeof *pairs);
        kiln_image sheet = {0};
        kiln_err err = {0};
        for (int i = 0; pairs && i < ns; i++)
            pairs[i][0] = &kept[2 * i], pairs[i][1] = &kept[2 * i + 1];
        if (!pairs ||
            kiln_quality_sheet((const kiln_image *const (*)[2])pairs, ns, o.thumb, o.cols,
                               &sheet, &err) ||
            kiln_image_write_file(o.sheet, &sheet, NULL, &err)) {
            fprintf(stderr, "kiln-quality: contact sheet: %s\n", pairs ? err.msg : "out of memory");
            rc = 2;
        } else {
            printf("contact sheet (reference | test, images 0..%d): %s\n", ns - 1, o.sheet);
        }
        kiln_image_free(&sheet);
        free(pairs);
    }
    for (int i = 0; i < 2 * ns; i++)
        kiln_image_free(&kept[i]);
    free(kept), free(psnr), free(ssim);
    return rc;
}
