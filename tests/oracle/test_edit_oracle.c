/* Image-to-image (strength) and inpainting (mask) against diffusers: the
 * cases tests/oracle/gen_edit_oracle.py (klein) and
 * gen_zimage_edit_oracle.py (Z-Image) write (tests/data/oracle/<case>, or
 * any folder they wrote), run through the engine on the CPU backend as
 * kiln edit --strength / --mask runs them: kiln_request_resolve, the image
 * prepared (engine/inpaint.h: resized, not cropped), the mask at the
 * family's grid, the image encoded, the noise, the denoise loop, the VAE
 * decode.
 *
 * Checked: prompt embeddings, the image's latents (klein; Z-Image: its
 * posterior's mean and log-variance) and the final latents to a relative
 * error < 1e-4 (the latents: or twice diffusers' own fp32 error in the
 * image latents, meta.json image_latents_fp32_vs_fp64, where that is
 * larger: large images), the mask and the noise bit for bit (Z-Image's
 * noise comes after each row's posterior sample draw), the steps run, and
 * the 8-bit image >= 50 dB PSNR against diffusers'.
 *
 * Usage: test_edit_oracle CASE   (a folder; a bare name is looked up in
 * $KILN_SOURCE_ROOT/tests/data/oracle) */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "common/json.h"
#include "engine/decode_stage.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "engine/inpaint.h"
#include "engine/request.h"
#include "models/latents.h"
#include "oracle_check.h"
#include "oracle_util.h"
#include "tests/test.h"

static kiln_backend *be;
static char dir[PATH_MAX];

static const char *in_case(const char *file)
{
    static char path[PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    return path;
}

/* Z-Image's reference tensors are the VAE's latents (1, z, 2h, 2w): its
 * patch tokens (h*w, 4z) as kiln hands them on; NULL for klein (tokens). */
static const int64_t *zgrid; /* {z, h, w} */

/* `key` of ref, as tokens: Z-Image latents patchified.  n gets the count. */
static float *ref_tokens(const kiln_st *ref, const char *key, int64_t *n)
{
    float *want = oracle_check_f32(ref, key, n);
    if (!want || !zgrid || *n != zgrid[0] * 4 * zgrid[1] * zgrid[2])
        return want;
    float *t = malloc((size_t)*n * sizeof *t);
    if (t)
        kiln_latents_zimage_patchify(want, t, 1, zgrid[0], 2, zgrid[1], zgrid[2]);
    free(want);
    return t;
}

/* Downloads t and checks it against `ref` (relative error < tol). */
static void check_dev(const kiln_tensor *t, const kiln_st *ref, const char *key, double tol)
{
    int64_t n = kiln_tensor_numel(t), m = 0;
    float *want = ref_tokens(ref, key, &m);
    CHECKF(!want || m == n, "%s: kiln has %lld values, the reference %lld", key, (long long)n,
           (long long)m);
    float *host = malloc((size_t)n * sizeof *host);
    kiln_be_download(be, t, host);
    if (want && m == n)
        oracle_check_close(key, host, want, (size_t)n, tol);
    free(host), free(want);
}

static void run_case(cJSON *meta)
{
    kiln_err err = {0};
    const char *mode = cJSON_GetObjectItem(meta, "mode")->valuestring;
    int inpaint = !strcmp(mode, "inpaint");
    const char *prompt = cJSON_GetObjectItem(meta, "prompt")->valuestring;
    int steps = cJSON_GetObjectItem(meta, "steps")->valueint;
    int max_seq = cJSON_GetObjectItem(meta, "max_seq")->valueint;
    int steps_run = cJSON_GetObjectItem(meta, "steps_run")->valueint;
    double strength = cJSON_GetObjectItem(meta, "strength")->valuedouble;
    uint64_t seed = (uint64_t)cJSON_GetObjectItem(meta, "seed")->valuedouble;
    cJSON *wh = cJSON_GetObjectItem(meta, "output_wh");
    int W = cJSON_GetArrayItem(wh, 0)->valueint, H = cJSON_GetArrayItem(wh, 1)->valueint;
    fprintf(stderr, "  %s %dx%d, strength %g, %d of %d steps\n", mode, W, H, strength, steps_run,
            steps);

    kiln_checkpoint *ck = kiln_checkpoint_open(
        oracle_path(cJSON_GetObjectItem(meta, "checkpoint")->valuestring), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (!ck)
        return;
    kiln_st *ref = kiln_st_open(in_case("ref.safetensors"), "ref.safetensors", &err);
    CHECKF(ref != NULL, "%s", err.msg);
    if (!ref) {
        kiln_checkpoint_close(ck);
        return;
    }

    /* The request as kiln edit makes it: the size is the image's prepared
     * one, the strength given. */
    kiln_image img = {0}, mask = {0};
    CHECKF(kiln_image_read_file(in_case("input.png"), NULL, &img, &err) == KILN_OK, "%s", err.msg);
    if (inpaint)
        CHECKF(kiln_image_read_mask_file(in_case("mask.png"), NULL, &mask, &err) == KILN_OK, "%s",
               err.msg);
    kiln_model_traits traits = kiln_model_traits_of(ck);
    int zimage = traits.no_references;
    cJSON *lc = cJSON_GetObjectItem(meta, "latent_channels");
    static int64_t z_hw[3];
    z_hw[0] = lc ? lc->valueint : 0, z_hw[1] = H / 16, z_hw[2] = W / 16;
    zgrid = zimage ? z_hw : NULL;
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_request req;
    kiln_request_init(&req);
    req.prompt = prompt, req.refs = &img, req.n_refs = 1, req.mask = inpaint ? &mask : NULL;
    req.strength = strength, req.steps = steps, req.seed = seed, req.max_sequence_length = max_seq;
    CHECKF(kiln_request_resolve(&req, &traits, &lim, &err) == KILN_OK, "%s", err.msg);
    CHECKF(req.width == W && req.height == H, "kiln resolves %dx%d", req.width, req.height);
    CHECKF(steps - kiln_denoise_first_step(steps, strength) == steps_run,
           "kiln runs %d steps, diffusers %d", steps - kiln_denoise_first_step(steps, strength),
           steps_run);

    kiln_encode_opts eo = {.with_references = 1};
    cJSON *layer;
    cJSON_ArrayForEach(layer, cJSON_GetObjectItem(meta, "text_encoder_out_layers"))
        eo.out_layers[eo.n_out_layers++] = layer->valueint;
    kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &eo, &err);
    CHECKF(enc != NULL, "%s", err.msg);
    kiln_tensor emb = {0}, tokens = {0}, lat = {0};
    int32_t *ids = NULL;
    int64_t R = 0, N = (int64_t)(W / 16) * (H / 16);
    int txt_len = 0;
    CHECKF(kiln_encode_prompts(enc, &prompt, 1, max_seq, &emb, NULL, &txt_len, &err) == KILN_OK,
           "%s", err.msg);
    if (zimage) { /* the real rows only, as ZImagePipeline hands them on */
        int64_t m = 0;
        free(oracle_check_f32(ref, "prompt_embeds", &m));
        int64_t T = m / emb.shape[2];
        CHECKF(txt_len == T, "kiln has %d prompt tokens, diffusers %lld", txt_len, (long long)T);
        kiln_tensor real = emb;
        real.shape[1] = txt_len;
        check_dev(&real, ref, "prompt_embeds", 1e-4);
    } else {
        check_dev(&emb, ref, "prompt_embeds", 1e-4);
    }
    /* The latents' bar: 1e-4, or twice the reference's own fp32 error in
     * the image latents where that is larger (the tiny random VAE is
     * ill-conditioned on large images: 6e-4 at 1072x976). */
    cJSON *drift = cJSON_GetObjectItem(meta, "image_latents_fp32_vs_fp64");
    double lat_tol = drift && 2 * drift->valuedouble > 1e-4 ? 2 * drift->valuedouble : 1e-4;
    if (drift)
        fprintf(stderr, "  diffusers' own fp32 error in the image latents %.3g: bar %.3g\n",
                drift->valuedouble, lat_tol);

    /* Both modes start from the image resized (not cropped) to W x H. */
    CHECKF(kiln_inpaint_prepare_image(&img, &traits, &err) == KILN_OK, "%s", err.msg);
    CHECK(img.width == W && img.height == H);
    float *grid = NULL;
    if (inpaint) {
        int64_t n = 0, m = 0;
        CHECKF(kiln_encode_mask(enc, &mask, W, H, &grid, &n, &err) == KILN_OK, "%s", err.msg);
        float *want = oracle_check_f32(ref, zimage ? "mask" : "mask_packed", &m);
        CHECKF(m == n, "kiln's mask has %lld values, diffusers' %lld", (long long)n, (long long)m);
        for (int64_t i = 0; want && grid && i < n && i < m; i++)
            CHECKF(grid[i] == want[i], "mask value %lld: kiln %g, diffusers %g", (long long)i,
                   grid[i], want[i]);
        free(want);
    }
    CHECKF(kiln_encode_references(enc, &img, 1, &tokens, &ids, &R, &err) == KILN_OK, "%s", err.msg);
    CHECK(R == N);
    if (zimage) { /* each token: its mean's features, then its log-variance's */
        int64_t C = tokens.shape[2] / 2;
        float *all = malloc((size_t)(N * 2 * C) * sizeof *all);
        float *half = malloc((size_t)(N * C) * sizeof *half);
        kiln_be_download(be, &tokens, all);
        static const char *const keys[2] = {"posterior_mean", "posterior_logvar"};
        for (int k = 0; k < 2; k++) {
            for (int64_t t = 0; t < N; t++)
                memcpy(half + t * C, all + (t * 2 + k) * C, (size_t)C * sizeof *half);
            int64_t m = 0;
            float *want = ref_tokens(ref, keys[k], &m);
            CHECKF(want && m == N * C, "%s: %lld values", keys[k], (long long)m);
            if (want && m == N * C)
                oracle_check_close(keys[k], half, want, (size_t)m, lat_tol);
            free(want);
        }
        free(all), free(half);
    } else {
        check_dev(&tokens, ref, "image_latents_packed", lat_tol);
    }

    kiln_denoise_stage *den = kiln_denoise_stage_create(be, ck, &err);
    CHECKF(den != NULL, "%s", err.msg);
    /* img2img: the image is the start only; inpainting: also the
     * reference the DiT sees (ids t = 10), as the pipeline conditions on it. */
    kiln_denoise_job job = {.B = 1, .embeds = &emb, .txt_len = &txt_len, .width = W,
                            .height = H, .steps = steps, .guidance = req.guidance,
                            .seeds = &seed};
    kiln_denoise_job_image(den, &job, &tokens, ids, R, req.strength, inpaint ? grid : NULL);
    CHECK(job.R == (inpaint && !zimage ? R : 0));
    int64_t C = kiln_denoise_stage_channels(den), n = 0;
    float *noise = malloc((size_t)(N * C) * sizeof *noise);
    CHECK(kiln_denoise_noise(den, &job, noise, &err) == KILN_OK);
    float *want = ref_tokens(ref, zimage ? "noise" : "noise_packed", &n);
    CHECKF(want && n == N * C && !memcmp(noise, want, (size_t)n * sizeof *noise),
           "the noise is not diffusers' draw bit for bit");
    free(want), free(noise);
    CHECKF(kiln_denoise_run(den, &job, &lat, &err) == KILN_OK, "%s", err.msg);
    check_dev(&lat, ref, "latents_final", lat_tol);

    kiln_decode_stage *dec = kiln_decode_stage_create(be, ck, &err);
    CHECKF(dec != NULL, "%s", err.msg);
    kiln_image out = {0}, png = {0};
    zgrid = NULL; /* the decode takes kiln's tokens as they are */
    CHECKF(kiln_decode_run(dec, &lat, W, H, &out, NULL, &err) == KILN_OK, "%s", err.msg);
    CHECKF(kiln_image_read_file(in_case("image.png"), NULL, &png, &err) == KILN_OK, "%s", err.msg);
    if (out.pixels && png.pixels && png.width == W && png.height == H) {
        double psnr = oracle_psnr_u8(out.pixels, png.pixels, (size_t)W * H * 3);
        fprintf(stderr, "  image PSNR %.2f dB\n", psnr);
        CHECK(psnr >= 50.0);
    } else
        CHECKF(0, "no image to compare");

    kiln_image_free(&out), kiln_image_free(&png), kiln_image_free(&img), kiln_image_free(&mask);
    kiln_be_free(be, &emb), kiln_be_free(be, &tokens), kiln_be_free(be, &lat);
    free(ids), free(grid);
    kiln_decode_stage_destroy(dec);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_edit_oracle CASE_DIR\n");
        return 2;
    }
    const char *root = getenv("KILN_SOURCE_ROOT");
    if (strchr(argv[1], '/') || !root)
        snprintf(dir, sizeof dir, "%s", argv[1]);
    else
        snprintf(dir, sizeof dir, "%s/tests/data/oracle/%s", root, argv[1]);
    kiln_err err = {0};
    cJSON *meta = kiln_json_load(in_case("meta.json"), "meta.json", &err);
    if (!meta) {
        fprintf(stderr, "test_edit_oracle: %s\n", err.msg);
        return 2;
    }
    be = oracle_cpu_backend();
    run_case(meta);
    cJSON_Delete(meta);
    kiln_backend_destroy(be);
    return test_finish();
}
