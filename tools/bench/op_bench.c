/* kiln-opbench: times single backend ops at the shapes the klein pipeline
 * runs at 1024x1024 (DiT joint attention over 4096 image + 512 text tokens,
 * the VAE mid-block attention, the Qwen3 encoder's causal attention, the
 * VAE decoder's convolutions and GroupNorms, the text encoders' GEMMs,
 * one large GEMM for calibration), so that each kernel change is measured on its own before
 * the pipeline is.  Attention
 * and convolutions run on two instances: the default (cuDNN where it
 * serves the shape) and one with KILN_CUDNN=0 (kiln's own kernels).
 *
 *   kiln-opbench [--device cuda] [--gpu N] [--iters 20] [--warmup 3]
 *
 * Each time is the mean of --iters calls after --warmup calls, between two
 * backend syncs, on a host clock; inputs are random bf16 values.  Prints a
 * table; exit status 1 when an op fails. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"

typedef struct opts {
    const char *device;
    int gpu, iters, warmup;
} opts;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint64_t rng = 0x2545f4914f6cdd1dull;

static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 40) / 16777216.0 * 2.0 - 1.0);
}

/* A random tensor on `be`; 0 on success. */
static int random_tensor(kiln_backend *be, kiln_tensor *t, int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    float *h = malloc((size_t)n * sizeof *h);
    if (!h)
        return -1;
    for (int64_t i = 0; i < n; i++)
        h[i] = frand();
    int rc = kiln_be_from_host(be, t, ndim, shape, h, KILN_F32) ? -1 : 0;
    free(h);
    return rc;
}

/* Mean milliseconds of o->iters calls of run(be, t, arg) after o->warmup
 * calls, or -1 with the error printed (also when `ready` says the inputs
 * could not be made).  Frees the n tensors of t either way. */
static double time_calls(kiln_backend *be, const char *what, int ready,
                         void (*run)(kiln_backend *be, kiln_tensor *t, const void *arg),
                         kiln_tensor *t, int n, const void *arg, const opts *o)
{
    double ms = -1;
    if (ready) {
        for (int i = 0; i < o->warmup; i++)
            run(be, t, arg);
        kiln_be_sync(be);
        double t0 = now_s();
        for (int i = 0; i < o->iters; i++)
            run(be, t, arg);
        kiln_be_sync(be);
        ms = 1e3 * (now_s() - t0) / o->iters;
    }
    kiln_err err = {0};
    if (kiln_be_check(be, &err) || !ready) {
        fprintf(stderr, "kiln-opbench: %s: %s\n", what,
                err.msg[0] ? err.msg : "out of host memory for the inputs");
        ms = -1;
    }
    for (int i = 0; i < n; i++)
        kiln_be_free(be, &t[i]);
    return ms;
}

typedef struct attn_case {
    const char *what;
    int64_t s, hq, hkv, d;
    int causal, key_len;
} attn_case;

static void run_attention(kiln_backend *be, kiln_tensor *t, const void *arg)
{
    kiln_be_attention(be, &t[3], &t[0], &t[1], &t[2], arg);
}

static double time_attention(kiln_backend *be, const attn_case *c, const opts *o)
{
    kiln_tensor t[4] = {{0}}; /* q, k, v, out */
    int key_len[1] = {(int)c->key_len};
    kiln_attn_opts ao = {.scale = 0.088f, .causal = c->causal,
                         .key_len = c->key_len ? key_len : NULL};
    int ready = !random_tensor(be, &t[0], 4, (int64_t[]){1, c->s, c->hq, c->d}) &&
                !random_tensor(be, &t[1], 4, (int64_t[]){1, c->s, c->hkv, c->d}) &&
                !random_tensor(be, &t[2], 4, (int64_t[]){1, c->s, c->hkv, c->d}) &&
                !kiln_be_alloc(be, &t[3], be->act_dtype, 4, (int64_t[]){1, c->s, c->hq, c->d});
    char what[96];
    snprintf(what, sizeof what, "attention %s", c->what);
    return time_calls(be, what, ready, run_attention, t, 4, &ao, o);
}

typedef struct conv_case {
    int64_t cin, hw, cout, k;
} conv_case;

static void run_conv(kiln_backend *be, kiln_tensor *t, const void *arg)
{
    const int *pads = arg;
    kiln_be_conv2d(be, &t[3], &t[0], &t[1], &t[2], NULL, 1, pads);
}

static double time_conv(kiln_backend *be, const conv_case *c, const opts *o)
{
    kiln_tensor t[4] = {{0}}; /* x, w, bias, y */
    int pad = (int)(c->k / 2), pads[4] = {pad, pad, pad, pad};
    /* Channels last, as the VAE runs: x (1, HW, HW, Cin), w (Cout, k, k, Cin). */
    int ready = !random_tensor(be, &t[0], 4, (int64_t[]){1, c->hw, c->hw, c->cin}) &&
                !random_tensor(be, &t[1], 4, (int64_t[]){c->cout, c->k, c->k, c->cin}) &&
                !random_tensor(be, &t[2], 1, (int64_t[]){c->cout}) &&
                !kiln_be_alloc(be, &t[3], be->act_dtype, 4,
                               (int64_t[]){1, c->hw, c->hw, c->cout});
    return time_calls(be, "conv2d", ready, run_conv, t, 4, pads, o);
}

typedef struct gn_case {
    int64_t hw, c;
} gn_case;

static void run_group_norm(kiln_backend *be, kiln_tensor *t, const void *arg)
{
    (void)arg;
    kiln_be_group_norm(be, &t[3], &t[0], &t[1], &t[2], 32, 1e-6f, 1);
}

/* GroupNorm + SiLU as the VAE runs it: x (1, HW, HW, C), 32 groups. */
static double time_group_norm(kiln_backend *be, const gn_case *c, const opts *o)
{
    kiln_tensor t[4] = {{0}}; /* x, w, b, y */
    int ready = !random_tensor(be, &t[0], 4, (int64_t[]){1, c->hw, c->hw, c->c}) &&
                !random_tensor(be, &t[1], 1, (int64_t[]){c->c}) &&
                !random_tensor(be, &t[2], 1, (int64_t[]){c->c}) &&
                !kiln_be_alloc(be, &t[3], be->act_dtype, 4, (int64_t[]){1, c->hw, c->hw, c->c});
    return time_calls(be, "group_norm", ready, run_group_norm, t, 4, NULL, o);
}

static void run_linear(kiln_backend *be, kiln_tensor *t, const void *arg)
{
    kiln_be_linear(be, &t[3], &t[0], &t[1], arg ? &t[2] : NULL);
}

/* y (m, n) = x (m, kdim) w^T, plus a bias when `bias` is set. */
static double time_linear(kiln_backend *be, int64_t m, int64_t kdim, int64_t n, int bias,
                          const opts *o)
{
    kiln_tensor t[4] = {{0}}; /* x, w, bias, y */
    int ready = !random_tensor(be, &t[0], 2, (int64_t[]){m, kdim}) &&
                !random_tensor(be, &t[1], 2, (int64_t[]){n, kdim}) &&
                !random_tensor(be, &t[2], 1, (int64_t[]){n}) &&
                !kiln_be_alloc(be, &t[3], be->act_dtype, 2, (int64_t[]){m, n});
    return time_calls(be, "linear", ready, run_linear, t, 4, bias ? t : NULL, o);
}

typedef struct linear_case {
    const char *what;
    int64_t m, k, n;
} linear_case;

/* The text encoders' projections over 512 positions (qwen3-encoder.md:
 * Qwen3-4B H 2560, 32/8 heads of 128, I 9728; Qwen3-8B H 4096, I 12288),
 * the q, k and v projections apart and as one GEMM, without bias. */
static int print_encoder_linears(kiln_backend *be, const opts *o)
{
    static const linear_case cases[] = {
        {"Qwen3-4B q", 512, 2560, 4096},       {"Qwen3-4B k or v", 512, 2560, 1024},
        {"Qwen3-4B q|k|v", 512, 2560, 6144},   {"Qwen3-4B o", 512, 4096, 2560},
        {"Qwen3-4B gate|up", 512, 2560, 19456}, {"Qwen3-4B down", 512, 9728, 2560},
        {"Qwen3-8B q", 512, 4096, 4096},       {"Qwen3-8B k or v", 512, 4096, 1024},
        {"Qwen3-8B q|k|v", 512, 4096, 6144},   {"Qwen3-8B o", 512, 4096, 4096},
        {"Qwen3-8B gate|up", 512, 4096, 24576}, {"Qwen3-8B down", 512, 12288, 4096},
    };
    int failed = 0;
    printf("\n%-34s %-22s %10s %10s %12s\n", "linear (text encoder, 512 tokens)", "M x K -> N",
           "default ms", "", "TFLOP/s def");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const linear_case *c = &cases[i];
        double ms = time_linear(be, c->m, c->k, c->n, 0, o);
        char shape[48];
        snprintf(shape, sizeof shape, "%lldx%lld -> %lld", (long long)c->m, (long long)c->k,
                 (long long)c->n);
        printf("%-34s %-22s %10.3f %10s %12.1f\n", c->what, shape, ms, "",
               ms > 0 ? 2.0 * (double)(c->m * c->k) * (double)c->n / (ms * 1e-3) / 1e12 : 0);
        failed |= ms < 0;
    }
    return failed;
}

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){"cuda", 0, 20, 3};
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            return -1;
        const char *a = argv[i], *v = argv[++i];
        char *end;
        long n = strtol(v, &end, 10);
        int num = *v && !*end && n >= 0 && n <= 100000;
        if (!strcmp(a, "--device"))
            o->device = v;
        else if (!strcmp(a, "--gpu") && num)
            o->gpu = (int)n;
        else if (!strcmp(a, "--iters") && num && n > 0)
            o->iters = (int)n;
        else if (!strcmp(a, "--warmup") && num)
            o->warmup = (int)n;
        else
            return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    opts o;
    if (parse(argc, argv, &o)) {
        fprintf(stderr, "usage: kiln-opbench [--device cuda|cpu] [--gpu N] [--iters N] "
                        "[--warmup N]\n");
        return 2;
    }
    kiln_err err = {0};
    kiln_backend *be = kiln_backend_create(o.device, o.gpu, &err);
    setenv("KILN_CUDNN", "0", 1);
    kiln_backend *native = be ? kiln_backend_create(o.device, o.gpu, &err) : NULL;
    unsetenv("KILN_CUDNN");
    if (!be || !native) {
        fprintf(stderr, "kiln-opbench: %s\n", err.msg);
        kiln_backend_destroy(be);
        return 1;
    }
    static const attn_case cases[] = {
        {"DiT klein-4B (4096+512 tokens)", 4608, 24, 24, 128, 0, 0},
        {"DiT klein-9B (4096+512 tokens)", 4608, 32, 32, 128, 0, 0},
        {"VAE mid-block (128x128 latent)", 16384, 1, 1, 512, 0, 0},
        {"Qwen3-4B (512 tokens, causal)", 512, 32, 8, 128, 1, 300},
    };
    int failed = 0;
    printf("%-34s %-22s %10s %10s %12s\n", "attention", "S x Hq/Hkv x d", "default ms",
           "kiln ms", "TFLOP/s def");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const attn_case *c = &cases[i];
        double a = time_attention(be, c, &o), b = time_attention(native, c, &o);
        double flop = 4.0 * (double)c->s * (double)c->s * (double)c->hq * (double)c->d;
        char shape[48];
        snprintf(shape, sizeof shape, "%lld x %lld/%lld x %lld", (long long)c->s,
                 (long long)c->hq, (long long)c->hkv, (long long)c->d);
        printf("%-34s %-22s %10.3f %10.3f %12.1f\n", c->what, shape, a, b,
               a > 0 ? flop / (a * 1e-3) / 1e12 : 0);
        failed |= a < 0 || b < 0;
    }
    /* The VAE decoder's convolutions at 1024x1024 (vae.md: block widths 512,
     * 512, 256, 128 from the latent side up), and its 3-channel output. */
    static const conv_case convs[] = {
        {512, 128, 512, 3}, {512, 256, 512, 3}, {256, 512, 256, 3},
        {128, 1024, 128, 3}, {128, 1024, 3, 3}, {512, 512, 256, 3},
    };
    printf("\n%-34s %-22s %10s %10s %12s\n", "conv2d (VAE decoder, 1024x1024)", "Cin x HW -> Cout",
           "default ms", "kiln ms", "TFLOP/s def");
    for (size_t i = 0; i < sizeof convs / sizeof convs[0]; i++) {
        const conv_case *c = &convs[i];
        double a = time_conv(be, c, &o), b = time_conv(native, c, &o);
        double flop = 2.0 * (double)c->cin * (double)c->cout * (double)(c->k * c->k) *
                      (double)(c->hw * c->hw);
        char shape[48];
        snprintf(shape, sizeof shape, "%lld x %lld^2 -> %lld", (long long)c->cin,
                 (long long)c->hw, (long long)c->cout);
        printf("%-34s %-22s %10.3f %10.3f %12.1f\n", "3x3, stride 1", shape, a, b,
               a > 0 ? flop / (a * 1e-3) / 1e12 : 0);
        failed |= a < 0 || b < 0;
    }
    /* Its GroupNorms: two reads and one write of x, so the bandwidth column
     * is 3 x the bytes of x over the time. */
    static const gn_case gns[] = {{128, 512}, {256, 512}, {512, 256}, {1024, 256}, {1024, 128}};
    printf("\n%-34s %-22s %10s %10s %12s\n", "group_norm + SiLU (VAE, 32 groups)", "HW^2 x C",
           "default ms", "kiln ms", "GB/s def");
    for (size_t i = 0; i < sizeof gns / sizeof gns[0]; i++) {
        const gn_case *c = &gns[i];
        double a = time_group_norm(be, c, &o), b = time_group_norm(native, c, &o);
        double bytes = 3.0 * (double)(c->hw * c->hw * c->c) * (double)kiln_dtype_size(be->act_dtype);
        char shape[48];
        snprintf(shape, sizeof shape, "%lld^2 x %lld", (long long)c->hw, (long long)c->c);
        printf("%-34s %-22s %10.3f %10.3f %12.1f\n", "channels last", shape, a, b,
               a > 0 ? bytes / (a * 1e-3) / 1e9 : 0);
        failed |= a < 0 || b < 0;
    }
    failed |= print_encoder_linears(be, &o);
    printf("\n");
    double ms = time_linear(be, 4608, 3072, 9216, 1, &o);
    printf("%-34s %-22s %10.3f %10s %12.1f\n", "linear (calibration)", "4608x3072 -> 9216", ms,
           "", ms > 0 ? 2.0 * 4608 * 3072 * 9216 / (ms * 1e-3) / 1e12 : 0);
    failed |= ms < 0;
    kiln_backend_destroy(native);
    kiln_backend_destroy(be);
    return failed;
}
