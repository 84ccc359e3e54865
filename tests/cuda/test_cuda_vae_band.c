/* The VAE in bands (models/vae_band.h) against the whole-image passes on the
 * GPU, at the full-size klein VAE: decode and encode at each size, once
 * whole and once banded, each in a fresh backend (so neither inherits the
 * other's scratch), printing
 *   - the PSNR of the banded result against the whole one (over the whole
 *     one's range; the image for decode, the latent mean for encode),
 *   - the GPU memory each pass added at its peak over what the backend, the
 *     weights and the pass's input and output held before it (a thread
 *     samples cudaMemGetInfo every 0.5 ms while the pass runs),
 *   - its time.
 * Fails when a banded result is under 50 dB from the whole one, or when a
 * banded pass's peak is not below the whole pass's.
 *
 * The weights are a checkpoint's (kiln make-checkpoint --preset klein-4b:
 * random, full-size; tools/gpu/check.sh section vaefull), inputs random.
 *
 * Usage: test_cuda_vae_band --model DIR [--rows N] [--sizes WxH,WxH,...]
 *   default sizes 1024x1024,2048x2048,1024x1536; rows: the VAE's default
 * Skipped (77) without a CUDA device unless KILN_REQUIRE_GPU=1. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/log.h"
#include "kernels/backend.h"
#include "models/vae.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

typedef struct sampler {
    kiln_backend *be;
    pthread_t thread;
    atomic_int stop;
    size_t peak;
} sampler;

static void *sample_loop(void *arg)
{
    sampler *s = arg;
    while (!atomic_load(&s->stop)) {
        size_t used = 0, total = 0;
        if (!kiln_backend_mem_info(s->be, &used, &total, NULL) && used > s->peak)
            s->peak = used;
        usleep(500);
    }
    return NULL;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

typedef struct pass_result {
    double ms;
    size_t peak; /* bytes over the memory in use before the pass */
} pass_result;

/* One decode (z -> image) or encode (image -> mean) in a fresh backend;
 * out_host gets the result as f32.  Returns 0, or -1 with the reason
 * printed. */
static int run_pass(const char *model, int decode, int64_t H, int64_t W, int64_t band_above,
                    int64_t rows, const float *in_host, float *out_host, pass_result *res)
{
    kiln_err err = {0};
    kiln_backend *be = kiln_backend_create("cuda", 0, &err);
    kiln_checkpoint *ck = be ? kiln_checkpoint_open(model, &err) : NULL;
    const cJSON *cfg = ck ? kiln_checkpoint_config(ck, "vae", &err) : NULL;
    kiln_st *st = cfg ? kiln_checkpoint_weights(ck, "vae", &err) : NULL;
    kiln_vae *vae = st ? kiln_vae_load(be, cfg, st, decode ? KILN_VAE_DECODER : KILN_VAE_ENCODER,
                                       &err)
                       : NULL;
    kiln_st_close(st);
    kiln_checkpoint_close(ck);
    kiln_tensor in = {0}, out = {0};
    int ok = 0;
    if (vae && !kiln_vae_set_banding(vae, band_above, rows, &err)) {
        const kiln_vae_info *info = kiln_vae_get_info(vae);
        int64_t f = info->downscale, z = info->latent_channels;
        int64_t zs[4] = {1, z, H / f, W / f}, xs[4] = {1, 3, H, W};
        if (!kiln_be_from_host(be, &in, 4, decode ? zs : xs, in_host, KILN_F32) &&
            !kiln_be_alloc(be, &out, be->act_dtype, 4, decode ? xs : zs)) {
            kiln_be_sync(be);
            size_t used0 = 0, total = 0;
            kiln_backend_mem_info(be, &used0, &total, &err);
            sampler s = {.be = be, .peak = used0};
            pthread_create(&s.thread, NULL, sample_loop, &s);
            double t0 = now_ms();
            kiln_status rc = decode ? kiln_vae_decode(vae, &in, &out, NULL, &err)
                                    : kiln_vae_encode(vae, &in, &out, NULL, &err);
            kiln_be_sync(be);
            res->ms = now_ms() - t0;
            atomic_store(&s.stop, 1);
            pthread_join(s.thread, NULL);
            size_t used1 = 0;
            if (!kiln_backend_mem_info(be, &used1, &total, NULL) && used1 > s.peak)
                s.peak = used1;
            res->peak = s.peak - used0;
            if (!rc) {
                kiln_be_download(be, &out, out_host);
                ok = !kiln_be_check(be, &err);
            }
        }
        if (!ok && !err.code)
            kiln_be_check(be, &err);
    }
    if (!ok)
        fprintf(stderr, "%s %lldx%lld: %s\n", decode ? "decode" : "encode", (long long)W,
                (long long)H, err.msg);
    if (be) {
        kiln_be_free(be, &in);
        kiln_be_free(be, &out);
    }
    kiln_vae_free(vae);
    kiln_backend_destroy(be);
    return ok ? 0 : -1;
}

static double psnr_range(const float *got, const float *want, size_t n)
{
    double lo = want[0], hi = want[0], se = 0;
    for (size_t i = 0; i < n; i++) {
        lo = want[i] < lo ? want[i] : lo;
        hi = want[i] > hi ? want[i] : hi;
        se += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
    }
    return se == 0 ? INFINITY : 10 * log10((hi - lo) * (hi - lo) / (se / (double)n));
}

static void fill_random(float *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
    }
}

/* Whole, then banded; prints one row. */
static void compare(const char *model, int decode, int64_t H, int64_t W, int64_t rows)
{
    const int64_t f = 8, z = 32; /* klein: checked by run_pass's shapes */
    size_t n_in = (size_t)(decode ? z * (H / f) * (W / f) : 3 * H * W);
    size_t n_out = (size_t)(decode ? 3 * H * W : z * (H / f) * (W / f));
    float *in = malloc(sizeof(float) * n_in), *whole = malloc(sizeof(float) * n_out);
    float *band = malloc(sizeof(float) * n_out);
    CHECK(in && whole && band);
    if (!in || !whole || !band)
        goto out;
    fill_random(in, n_in, (uint32_t)(H * 7 + W + decode));
    pass_result rw = {0}, rb = {0};
    int okw = !run_pass(model, decode, H, W, KILN_VAE_BAND_NEVER, rows, in, whole, &rw);
    int okb = !run_pass(model, decode, H, W, 0, rows, in, band, &rb);
    CHECKF(okw && okb, "%s %lldx%lld failed", decode ? "decode" : "encode", (long long)W,
           (long long)H);
    if (!okw || !okb)
        goto out;
    double p = psnr_range(band, whole, n_out);
    printf("%-6s %5lldx%-5lld | whole %6.2f GiB %7.1f ms | banded (%lld rows) %6.2f GiB %7.1f ms"
           " | %6.1f dB\n",
           decode ? "decode" : "encode", (long long)W, (long long)H, rw.peak / GIB, rw.ms,
           (long long)rows, rb.peak / GIB, rb.ms, p);
    fflush(stdout);
    CHECKF(p >= 50.0, "%s %lldx%lld: banded %.1f dB from whole", decode ? "decode" : "encode",
           (long long)W, (long long)H, p);
    CHECKF(rb.peak < rw.peak, "%s %lldx%lld: banded peak %zu not below whole %zu",
           decode ? "decode" : "encode", (long long)W, (long long)H, rb.peak, rw.peak);
out:
    free(in);
    free(whole);
    free(band);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *sizes = "1024x1024,2048x2048,1024x1536";
    int64_t rows = KILN_VAE_BAND_ROWS_DEFAULT;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--sizes") && i + 1 < argc)
            sizes = argv[++i];
        else {
            fprintf(stderr, "usage: %s --model DIR [--rows N] [--sizes WxH,...]\n", argv[0]);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "%s: --model DIR (a full-size klein checkpoint) is required\n", argv[0]);
        return 2;
    }
    kiln_log_set_level(KILN_LOG_WARN);
    kiln_err err = {0};
    kiln_backend *probe = kiln_backend_create("cuda", 0, &err);
    if (!probe)
        return gpu_test_unavailable("cuda backend", &err);
    kiln_backend_destroy(probe);
    char buf[256];
    snprintf(buf, sizeof buf, "%s", sizes);
    for (char *save, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        long long w, h;
        if (sscanf(tok, "%lldx%lld", &w, &h) != 2 || w < 64 || h < 64 || w % 16 || h % 16) {
            fprintf(stderr, "bad size '%s'\n", tok);
            return 2;
        }
        compare(model, 1, h, w, rows);
        compare(model, 0, h, w, rows);
    }
    return test_finish();
}
