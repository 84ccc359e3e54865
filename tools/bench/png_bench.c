/* kiln-pngbench: PNG encoder options on 1024x1024 images, CPU only.
 *
 *   kiln-pngbench [--reps N] [--size N] [--sim-threads N] [--wall] [--quick] [--only TEXT]
 *                 [IMAGE...]
 *
 * Each IMAGE (PNG, JPEG or WebP) is LANCZOS-scaled so that its short side
 * is --size (1024) and center-cropped square; three generated images join
 * them: "gradient" (smooth gradients with fine texture, photo-like),
 * "flat" (a flat graphic) and "noise" (uniform noise, what the tiny test
 * checkpoint's outputs look like).  For every option and image: the median
 * of --reps timed encodes after one warm-up, the size, and a check that
 * libpng decodes the file to exactly the source pixels (a mismatch exits 1).
 * Times are the process's CPU time by default, which other processes on a
 * shared machine do not inflate (for the multi-threaded rows it is the sum
 * over threads); --wall times wall-clock instead, for a dedicated host.
 *
 * Options: libpng's single stream (kiln_image_png_encode: zlib level, row
 * filter, Z_RLE or libpng's default Z_FILTERED), kiln's striped encoder
 * (kiln_image_png_encode_stripes) on one thread with every filter, zlib
 * strategy, level and stripe height, and libspng when it was found at build
 * time, and libdeflate's whole-buffer zlib stream of the PAETH-filtered
 * image (one thread: libdeflate cannot end a stream without a final block,
 * so it cannot make joinable stripes) when libdeflate was found.  For the
 * striped rows the "simN" column models N cores: each
 * stripe's measured time is list-scheduled on N workers in stripe order (as
 * the workers take them), plus the encoder's serial remainder, from CPU
 * times.  It ignores memory-bandwidth contention and thread start-up, so it
 * is a lower bound for the real run on an N-core host (with --wall its
 * serial part is wall time less the stripes' CPU time: exact only on an
 * idle host).  "2thr" is a real
 * run on 2 threads and "all threads" the default (up to 16, at most the
 * CPUs online): compare them with --wall on an idle host.
 * Numbers are printed as "ms/KB" per image, then the sums.  --quick runs a
 * shorter list; --only runs the options whose name contains TEXT.
 *
 * docs/PERFORMANCE.md (PNG encoder options) has the command and results. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zlib.h>

#include "common/image.h"
#include "common/image_impl.h"

#ifdef KILN_HAVE_SPNG
#include <spng.h>
#endif
#ifdef KILN_HAVE_LIBDEFLATE
#include <libdeflate.h>
#endif

#define MAX_IMAGES 16
#define MAX_STRIPES 4096

typedef enum { LIBPNG, STRIPES, SPNG, LIBDEFLATE } impl;

typedef struct option {
    const char *name;
    impl kind;
    int level, zstrategy, rows, threads;
    kiln_png_filter filter;
    int quick;    /* in the --quick set */
    int kiln_rle; /* stripes deflated by kiln_image_png_deflate_rle */
} option;

typedef struct image_in {
    char name[64];
    kiln_image img;
} image_in;

static clockid_t bench_clock = CLOCK_PROCESS_CPUTIME_ID;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(bench_clock, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The makespan of stripes taken in order by the first free of p workers. */
static double list_schedule(const double *t, int n, int p)
{
    double free_at[64] = {0};
    if (p > 64)
        p = 64;
    double end = 0;
    for (int k = 0; k < n; k++) {
        int w = 0;
        for (int i = 1; i < p; i++)
            if (free_at[i] < free_at[w])
                w = i;
        free_at[w] += t[k];
        if (free_at[w] > end)
            end = free_at[w];
    }
    return end;
}

#ifdef KILN_HAVE_SPNG
static int spng_encode(const kiln_image *img, const option *o, kiln_buf *out, kiln_err *err)
{
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    if (!ctx)
        return kiln_err_set(err, KILN_ERR_NOMEM, "spng_ctx_new");
    struct spng_ihdr ih = {.width = (uint32_t)img->width, .height = (uint32_t)img->height,
                           .bit_depth = 8, .color_type = SPNG_COLOR_TYPE_TRUECOLOR};
    static const int choice[] = {SPNG_FILTER_CHOICE_NONE, SPNG_FILTER_CHOICE_SUB,
                                 SPNG_FILTER_CHOICE_UP,   SPNG_FILTER_CHOICE_AVG,
                                 SPNG_FILTER_CHOICE_PAETH, SPNG_FILTER_CHOICE_ALL};
    int rc = spng_set_option(ctx, SPNG_ENCODE_TO_BUFFER, 1);
    if (!rc)
        rc = spng_set_ihdr(ctx, &ih);
    if (!rc && o->level > 0)
        rc = spng_set_option(ctx, SPNG_IMG_COMPRESSION_LEVEL, o->level);
    if (!rc && o->level > 0)
        rc = spng_set_option(ctx, SPNG_IMG_COMPRESSION_STRATEGY, o->zstrategy);
    if (!rc && o->level > 0)
        rc = spng_set_option(ctx, SPNG_FILTER_CHOICE, choice[o->filter]);
    if (!rc)
        rc = spng_encode_image(ctx, img->pixels, (size_t)img->width * img->height * 3,
                               SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE);
    size_t len = 0;
    void *p = rc ? NULL : spng_get_png_buffer(ctx, &len, &rc);
    kiln_status st = rc ? kiln_err_set(err, KILN_ERR_INTERNAL, "libspng: %s", spng_strerror(rc))
                        : kiln_buf_append(out, p, len, err);
    free(p);
    spng_ctx_free(ctx);
    return st;
}
#endif

#ifdef KILN_HAVE_LIBDEFLATE
static void put_chunk(kiln_buf *out, const char *type, const uint8_t *d, size_t n, kiln_err *err)
{
    uint8_t h[8] = {(uint8_t)(n >> 24), (uint8_t)(n >> 16), (uint8_t)(n >> 8), (uint8_t)n};
    memcpy(h + 4, type, 4);
    uLong crc = crc32(crc32(0L, Z_NULL, 0), h + 4, 4);
    if (n)
        crc = crc32(crc, d, (uInt)n);
    uint8_t c[4] = {(uint8_t)(crc >> 24), (uint8_t)(crc >> 16), (uint8_t)(crc >> 8), (uint8_t)crc};
    kiln_buf_append(out, h, 8, err);
    if (n)
        kiln_buf_append(out, d, n, err);
    kiln_buf_append(out, c, 4, err);
}

static kiln_status deflate_encode(const kiln_image *img, const option *o, kiln_buf *out,
                                  kiln_err *err)
{
    size_t w3 = (size_t)img->width * 3, raw_len = (w3 + 1) * img->height;
    uint8_t *raw = malloc(raw_len + w3);
    struct libdeflate_compressor *c = libdeflate_alloc_compressor(o->level);
    size_t cap = c ? libdeflate_zlib_compress_bound(c, raw_len) : 0;
    uint8_t *z = malloc(cap ? cap : 1);
    kiln_status st = KILN_OK;
    if (!raw || !c || !z) {
        st = kiln_err_set(err, KILN_ERR_NOMEM, "libdeflate");
    } else {
        for (int y = 0; y < img->height; y++) {
            const uint8_t *cur = img->pixels + (size_t)y * w3;
            kiln_image_png_filter_row(o->filter, raw + (size_t)y * (w3 + 1), cur,
                                      y ? cur - w3 : NULL, w3, raw + raw_len);
        }
        size_t n = libdeflate_zlib_compress(c, raw, raw_len, z, cap);
        uint8_t ihdr[13] = {(uint8_t)(img->width >> 24), (uint8_t)(img->width >> 16),
                            (uint8_t)(img->width >> 8), (uint8_t)img->width,
                            (uint8_t)(img->height >> 24), (uint8_t)(img->height >> 16),
                            (uint8_t)(img->height >> 8), (uint8_t)img->height, 8, 2, 0, 0, 0};
        kiln_buf_append(out, "\x89PNG\r\n\x1a\n", 8, err);
        put_chunk(out, "IHDR", ihdr, 13, err);
        put_chunk(out, "IDAT", z, n, err);
        put_chunk(out, "IEND", NULL, 0, err);
        st = n ? err->code : kiln_err_set(err, KILN_ERR_INTERNAL, "libdeflate failed");
    }
    libdeflate_free_compressor(c);
    free(z);
    free(raw);
    return st;
}
#endif

static kiln_status encode(const kiln_image *img, const option *o, kiln_buf *out,
                          double *stripe_ms, kiln_err *err)
{
    switch (o->kind) {
    case LIBPNG:
        return kiln_image_png_encode(img, o->level, o->filter,
                                     o->zstrategy == Z_RLE ? KILN_PNG_STRATEGY_RLE
                                                           : KILN_PNG_STRATEGY_LZ77,
                                     out, err);
    case STRIPES: {
        kiln_png_stripe_opts so = {.rows = o->rows, .threads = o->threads, .level = o->level,
                                   .zstrategy = o->zstrategy, .filter = o->filter,
                                   .kiln_rle = o->kiln_rle, .stripe_ms = stripe_ms};
        return kiln_image_png_encode_stripes(img, &so, NULL, 0, out, err);
    }
    case LIBDEFLATE:
#ifdef KILN_HAVE_LIBDEFLATE
        return deflate_encode(img, o, out, err);
#else
        return kiln_err_set(err, KILN_ERR_INTERNAL, "built without libdeflate");
#endif
    default:
#ifdef KILN_HAVE_SPNG
        return spng_encode(img, o, out, err);
#else
        return kiln_err_set(err, KILN_ERR_INTERNAL, "built without libspng");
#endif
    }
}

/* ---- the images ---- */

static uint32_t rng(uint32_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 17, *s ^= *s << 5;
    return *s;
}

static void make_generated(image_in *in, const char *kind, int n, kiln_err *err)
{
    snprintf(in->name, sizeof in->name, "%s", kind);
    if (kiln_image_alloc(&in->img, n, n, err)) {
        fprintf(stderr, "kiln-pngbench: %s\n", err->msg);
        exit(2);
    }
    uint32_t s = 0x9e3779b9u;
    for (int y = 0; y < n; y++)
        for (int x = 0; x < n; x++) {
            uint8_t *p = in->img.pixels + ((size_t)y * n + x) * 3;
            double u = (double)x / n, v = (double)y / n;
            for (int c = 0; c < 3; c++) {
                double val;
                if (!strcmp(kind, "gradient")) /* a sky-like blend, soft waves, grain of +-3 */
                    val = 255 * (0.35 + 0.3 * v + 0.15 * c * u) +
                          20 * sin(9 * u + 4 * v + c) * cos(7 * v - 3 * u) +
                          (double)(rng(&s) % 7) - 3;
                else if (!strcmp(kind, "flat")) /* rectangles of 6 colours on white */
                    val = ((x / 128 + y / 96) % 3 == 0 && (x % 128) > 16) ? 40 * (c + 1) * ((x / 128) % 3)
                                                                          : 255;
                else /* noise */
                    val = rng(&s) & 255;
                p[c] = (uint8_t)(val < 0 ? 0 : val > 255 ? 255 : val);
            }
        }
}

/* Scales the short side to n (LANCZOS) and crops the center square. */
static void load_file(image_in *in, const char *path, int n, kiln_err *err)
{
    kiln_image src = {0}, scaled = {0};
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    snprintf(in->name, sizeof in->name, "%.20s", base);
    if (kiln_image_read_file(path, NULL, &src, err)) {
        fprintf(stderr, "kiln-pngbench: %s: %s\n", path, err->msg);
        exit(2);
    }
    double s = (double)n / (src.width < src.height ? src.width : src.height);
    int w = (int)lround(src.width * s), h = (int)lround(src.height * s);
    if (w < n)
        w = n;
    if (h < n)
        h = n;
    if (kiln_image_resize_lanczos(&src, w, h, &scaled, err) || kiln_image_alloc(&in->img, n, n, err)) {
        fprintf(stderr, "kiln-pngbench: %s: %s\n", path, err->msg);
        exit(2);
    }
    int x0 = (w - n) / 2, y0 = (h - n) / 2;
    for (int y = 0; y < n; y++)
        memcpy(in->img.pixels + (size_t)y * n * 3,
               scaled.pixels + ((size_t)(y0 + y) * w + x0) * 3, (size_t)n * 3);
    kiln_image_free(&src);
    kiln_image_free(&scaled);
}

/* ---- the options ---- */

#define F(x) KILN_PNG_FILTER_##x
static const option options[] = {
    /* libpng, one stream, one thread */
    {"libpng L1 rle none", LIBPNG, 1, Z_RLE, 0, 1, F(NONE), 0},
    {"libpng L1 rle sub", LIBPNG, 1, Z_RLE, 0, 1, F(SUB), 0},
    {"libpng L1 rle up", LIBPNG, 1, Z_RLE, 0, 1, F(UP), 0},
    {"libpng L1 rle avg", LIBPNG, 1, Z_RLE, 0, 1, F(AVG), 0},
    {"libpng L1 rle paeth", LIBPNG, 1, Z_RLE, 0, 1, F(PAETH), 1},
    {"libpng L1 rle adaptive", LIBPNG, 1, Z_RLE, 0, 1, F(ADAPTIVE), 0},
    {"libpng L1 filtered paeth", LIBPNG, 1, Z_FILTERED, 0, 1, F(PAETH), 0},
    {"libpng L1 filtered adaptive", LIBPNG, 1, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    {"libpng L2 filtered adaptive", LIBPNG, 2, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    {"libpng L3 filtered adaptive", LIBPNG, 3, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    {"libpng L4 filtered adaptive", LIBPNG, 4, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    {"libpng L5 filtered adaptive", LIBPNG, 5, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    {"libpng L6 filtered adaptive (Pillow)", LIBPNG, 6, Z_FILTERED, 0, 1, F(ADAPTIVE), 1},
    /* kiln's stripes on one thread (simN models N cores) */
    {"stripes64 L1 rle none", STRIPES, 1, Z_RLE, 64, 1, F(NONE), 0},
    {"stripes64 L1 rle sub", STRIPES, 1, Z_RLE, 64, 1, F(SUB), 1},
    {"stripes64 L1 rle up", STRIPES, 1, Z_RLE, 64, 1, F(UP), 1},
    {"stripes64 L1 rle avg", STRIPES, 1, Z_RLE, 64, 1, F(AVG), 0},
    {"stripes64 L1 rle paeth (default)", STRIPES, 1, Z_RLE, 64, 1, F(PAETH), 1},
    {"stripes64 L1 rle adaptive", STRIPES, 1, Z_RLE, 64, 1, F(ADAPTIVE), 1},
    {"stripes64 huffman paeth", STRIPES, 1, Z_HUFFMAN_ONLY, 64, 1, F(PAETH), 1},
    {"stripes64 L1 default paeth", STRIPES, 1, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 1},
    {"stripes64 L2 default paeth", STRIPES, 2, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 0},
    {"stripes64 L3 default paeth", STRIPES, 3, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 0},
    {"stripes64 L4 default paeth", STRIPES, 4, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 0},
    {"stripes64 L4 filtered paeth", STRIPES, 4, Z_FILTERED, 64, 1, F(PAETH), 0},
    {"stripes64 L5 default paeth", STRIPES, 5, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 0},
    {"stripes64 L6 default paeth", STRIPES, 6, Z_DEFAULT_STRATEGY, 64, 1, F(PAETH), 0},
    {"stripes64 L6 filtered paeth", STRIPES, 6, Z_FILTERED, 64, 1, F(PAETH), 0},
    {"stripes64 L1 default adaptive", STRIPES, 1, Z_DEFAULT_STRATEGY, 64, 1, F(ADAPTIVE), 0},
    {"stripes16 L1 rle paeth", STRIPES, 1, Z_RLE, 16, 1, F(PAETH), 0},
    {"stripes32 L1 rle paeth", STRIPES, 1, Z_RLE, 32, 1, F(PAETH), 1},
    {"stripes128 L1 rle paeth", STRIPES, 1, Z_RLE, 128, 1, F(PAETH), 0},
    {"stripes1024 L1 rle paeth", STRIPES, 1, Z_RLE, 1024, 1, F(PAETH), 0},
    {"stripes64 L1 rle paeth 2thr", STRIPES, 1, Z_RLE, 64, 2, F(PAETH), 1},
    {"stripes64 L1 rle paeth all threads", STRIPES, 1, Z_RLE, 64, 0, F(PAETH), 1},
    /* kiln's own run-only deflate in the stripes */
    {"stripes64 kiln-rle paeth", STRIPES, 1, Z_RLE, 64, 1, F(PAETH), 1, 1},
    {"stripes64 kiln-rle up", STRIPES, 1, Z_RLE, 64, 1, F(UP), 0, 1},
    {"stripes64 kiln-rle adaptive", STRIPES, 1, Z_RLE, 64, 1, F(ADAPTIVE), 1, 1},
    {"stripes32 kiln-rle paeth", STRIPES, 1, Z_RLE, 32, 1, F(PAETH), 0, 1},
    {"stripes64 kiln-rle paeth all threads", STRIPES, 1, Z_RLE, 64, 0, F(PAETH), 1, 1},
    /* libspng 0.7 (zlib underneath), one thread */
    {"libspng defaults", SPNG, 0, 0, 0, 1, F(ADAPTIVE), 0},
    {"libspng L1 rle paeth", SPNG, 1, Z_RLE, 0, 1, F(PAETH), 1},
    {"libspng L1 filtered adaptive", SPNG, 1, Z_FILTERED, 0, 1, F(ADAPTIVE), 0},
    /* libdeflate 1.14, one whole-buffer stream, one thread */
    {"libdeflate L1 paeth", LIBDEFLATE, 1, 0, 0, 1, F(PAETH), 1},
    {"libdeflate L2 paeth", LIBDEFLATE, 2, 0, 0, 1, F(PAETH), 0},
    {"libdeflate L4 paeth", LIBDEFLATE, 4, 0, 0, 1, F(PAETH), 0},
    {"libdeflate L6 paeth", LIBDEFLATE, 6, 0, 0, 1, F(PAETH), 0},
};
#undef F

static int usage(void)
{
    fprintf(stderr, "usage: kiln-pngbench [--reps N] [--size N] [--sim-threads N] [--wall] "
                    "[--quick] [--only TEXT] [IMAGE...]\n");
    return 2;
}

int main(int argc, char **argv)
{
    int reps = 5, size = 1024, sim = 16, quick = 0, n_in = 0;
    image_in in[MAX_IMAGES];
    const char *files[MAX_IMAGES], *only = NULL;
    int n_files = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--size") && i + 1 < argc)
            size = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--sim-threads") && i + 1 < argc)
            sim = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--wall"))
            bench_clock = CLOCK_MONOTONIC;
        else if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (argv[i][0] == '-')
            return usage();
        else if (n_files < MAX_IMAGES - 3)
            files[n_files++] = argv[i];
        else
            return usage();
    }
    if (reps < 1 || reps > 1000 || size < 16 || size > 8192 || sim < 1 || sim > 64)
        return usage();
    kiln_err err = {0};
    for (int i = 0; i < n_files; i++)
        load_file(&in[n_in++], files[i], size, &err);
    make_generated(&in[n_in++], "gradient", size, &err);
    make_generated(&in[n_in++], "flat", size, &err);
    make_generated(&in[n_in++], "noise", size, &err);

    printf("kiln-pngbench: %dx%d, median of %d after 1 warm-up, ms (%s) / KB per image\n", size,
           size, reps, bench_clock == CLOCK_MONOTONIC ? "wall" : "process CPU");
    printf("%-38s", "option");
    for (int i = 0; i < n_in; i++)
        printf(" %18.18s", in[i].name);
    printf(" %10s %9s %8s\n", "sum ms", "sum KB", "sim ms");

    double *t = malloc(sizeof *t * (size_t)reps), *tsim = malloc(sizeof *tsim * (size_t)reps);
    double *stripe_ms = malloc(sizeof *stripe_ms * MAX_STRIPES);
    if (!t || !tsim || !stripe_ms)
        return 2;
    int bad = 0;
    for (size_t oi = 0; oi < sizeof options / sizeof options[0]; oi++) {
        const option *o = &options[oi];
#ifndef KILN_HAVE_SPNG
        if (o->kind == SPNG)
            continue;
#endif
#ifndef KILN_HAVE_LIBDEFLATE
        if (o->kind == LIBDEFLATE)
            continue;
#endif
        if ((quick && !o->quick) || (only && !strstr(o->name, only)))
            continue;
        if (o->kind == STRIPES && (size + o->rows - 1) / o->rows > MAX_STRIPES)
            continue;
        printf("%-38s", o->name);
        fflush(stdout);
        double sum_ms = 0, sum_kb = 0, sum_sim = 0;
        for (int i = 0; i < n_in; i++) {
            kiln_buf b = {0};
            size_t len = 0;
            for (int r = -1; r < reps; r++) {
                b.len = 0;
                double t0 = now_ms();
                if (encode(&in[i].img, o, &b, stripe_ms, &err)) {
                    fprintf(stderr, "\n%s on %s: %s\n", o->name, in[i].name, err.msg);
                    return 1;
                }
                double ms = now_ms() - t0;
                if (r < 0)
                    continue;
                t[r] = ms;
                if (o->kind == STRIPES) {
                    int n = (size + o->rows - 1) / o->rows;
                    double work = 0;
                    for (int k = 0; k < n; k++)
                        work += stripe_ms[k];
                    tsim[r] = list_schedule(stripe_ms, n, sim) + (o->threads == 1 ? ms - work : 0);
                }
                len = b.len;
            }
            kiln_image back = {0};
            if (kiln_image_decode(b.data, b.len, NULL, &back, &err) ||
                back.width != size || back.height != size ||
                memcmp(back.pixels, in[i].img.pixels, (size_t)size * size * 3)) {
                fprintf(stderr, "\n%s on %s: the decoded pixels differ (%s)\n", o->name,
                        in[i].name, err.msg);
                bad = 1;
            }
            kiln_image_free(&back);
            kiln_buf_free(&b);
            double m = median(t, reps);
            sum_ms += m;
            sum_kb += len / 1024.0;
            if (o->kind == STRIPES && o->threads == 1)
                sum_sim += median(tsim, reps);
            printf(" %9.1f/%-8.0f", m, len / 1024.0);
            fflush(stdout);
        }
        printf(" %10.1f %9.0f", sum_ms, sum_kb);
        if (sum_sim > 0)
            printf(" %8.1f", sum_sim);
        printf("\n");
    }

    /* What the caller's serial CRC-32 cost before each worker wrote its own
     * chunk: zlib's crc32 over the default file of the first image. */
    kiln_buf b = {0};
    if (!kiln_image_encode(&in[0].img, NULL, &b, &err)) {
        for (int r = 0; r < reps; r++) {
            double t0 = now_ms();
            volatile uLong c = crc32(crc32(0L, Z_NULL, 0), b.data, (uInt)b.len);
            (void)c;
            t[r] = now_ms() - t0;
        }
        printf("crc32 over the %s default file (%zu bytes): %.2f ms\n", in[0].name, b.len,
               median(t, reps));
    }
    kiln_buf_free(&b);
    printf("sim ms: the striped work list-scheduled on %d cores plus the serial part (a lower "
           "bound)\n", sim);
    for (int i = 0; i < n_in; i++)
        kiln_image_free(&in[i].img);
    free(t);
    free(tsim);
    free(stripe_ms);
    return bad;
}
