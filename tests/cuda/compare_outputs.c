/* Compares two runs of kiln (e.g. the CUDA and the CPU backend, or the
 * service and the CLI) by their outputs, for tools/gpu/check.sh:
 *
 *   compare_outputs [--latents A.safetensors B.safetensors] [--image A.png B.png]
 *                   [--max-rel-err X] [--min-psnr DB]
 *
 * Prints the relative error ||a - b|| / ||b|| of the `latents` tensors
 * (as `kiln generate --latents-out` writes them) and the PSNR of the two
 * images (inf when identical).  Exit status 1 when a given bar is missed
 * (--max-rel-err for the latents, --min-psnr for the images), 2 on bad
 * usage or unreadable files. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "common/safetensors.h"

static float *read_latents(const char *path, int64_t *n)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(path, path, &err);
    const kiln_st_tensor *t = st ? kiln_st_find(st, "latents") : NULL;
    float *out = NULL;
    if (t) {
        *n = 1;
        for (int i = 0; i < t->ndim; i++)
            *n *= t->shape[i];
        out = malloc((size_t)(*n ? *n : 1) * sizeof *out);
        if (out && kiln_convert_to_f32(out, t->data, t->dtype, (size_t)*n)) {
            free(out);
            out = NULL;
        }
    }
    if (!out)
        fprintf(stderr, "compare_outputs: %s: %s\n", path, st ? "no f32/bf16 `latents`" : err.msg);
    kiln_st_close(st);
    return out;
}

static int compare_latents(const char *a_path, const char *b_path, double *rel)
{
    int64_t na = 0, nb = 0;
    float *a = read_latents(a_path, &na), *b = a ? read_latents(b_path, &nb) : NULL;
    int ok = a && b && na == nb;
    if (a && b && na != nb)
        fprintf(stderr, "compare_outputs: latents differ in size (%lld vs %lld)\n",
                (long long)na, (long long)nb);
    if (ok) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < na; i++) {
            double d = (double)a[i] - b[i];
            num += d * d, den += (double)b[i] * b[i];
            if (a[i] != a[i] || b[i] != b[i])
                num = INFINITY;
        }
        *rel = den > 0 ? sqrt(num / den) : sqrt(num);
    }
    free(a), free(b);
    return ok ? 0 : -1;
}

static int compare_images(const char *a_path, const char *b_path, double *psnr)
{
    kiln_err err = {0};
    kiln_image a = {0}, b = {0};
    int ok = 0;
    if (kiln_image_read_file(a_path, NULL, &a, &err) || kiln_image_read_file(b_path, NULL, &b, &err))
        fprintf(stderr, "compare_outputs: %s\n", err.msg);
    else if (a.width != b.width || a.height != b.height)
        fprintf(stderr, "compare_outputs: image sizes differ (%dx%d vs %dx%d)\n", a.width,
                a.height, b.width, b.height);
    else
        ok = 1;
    if (ok) {
        size_t n = (size_t)a.width * a.height * 3;
        double se = 0;
        for (size_t i = 0; i < n; i++)
            se += ((double)a.pixels[i] - b.pixels[i]) * ((double)a.pixels[i] - b.pixels[i]);
        *psnr = se == 0 ? INFINITY : 10.0 * log10(255.0 * 255.0 / (se / (double)n));
    }
    kiln_image_free(&a), kiln_image_free(&b);
    return ok ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *lat[2] = {0}, *img[2] = {0};
    double max_rel = -1, min_psnr = -1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--latents") && i + 2 < argc)
            lat[0] = argv[i + 1], lat[1] = argv[i + 2], i += 2;
        else if (!strcmp(argv[i], "--image") && i + 2 < argc)
            img[0] = argv[i + 1], img[1] = argv[i + 2], i += 2;
        else if (!strcmp(argv[i], "--max-rel-err") && i + 1 < argc)
            max_rel = atof(argv[++i]);
        else if (!strcmp(argv[i], "--min-psnr") && i + 1 < argc)
            min_psnr = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: compare_outputs [--latents A B] [--image A B] "
                            "[--max-rel-err X] [--min-psnr DB]\n");
            return 2;
        }
    }
    if (!lat[0] && !img[0]) {
        fprintf(stderr, "compare_outputs: nothing to compare\n");
        return 2;
    }
    int fail = 0;
    if (lat[0]) {
        double rel;
        if (compare_latents(lat[0], lat[1], &rel))
            return 2;
        int bad = max_rel >= 0 && !(rel < max_rel);
        printf("latents rel err %.4g%s\n", rel,
               max_rel < 0 ? "" : bad ? " (over the bar)" : " (within the bar)");
        fail |= bad;
    }
    if (img[0]) {
        double psnr;
        if (compare_images(img[0], img[1], &psnr))
            return 2;
        int bad = min_psnr >= 0 && !(psnr >= min_psnr);
        printf("image PSNR %.2f dB%s\n", psnr,
               min_psnr < 0 ? "" : bad ? " (under the bar)" : " (within the bar)");
        fail |= bad;
    }
    return fail;
}
