/* The whole pipeline (engine stages on the CPU backend) against every klein
 * and Z-Image case of the diffusers fp32 oracle: prompt embeddings,
 * reference tokens, initial noise (bit for bit), final latents (relative
 * error < 1e-4) and the 8-bit image (PSNR >= 50 dB against the reference
 * PNG).  Usage: test_pipeline CASE */
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
#include "models/latents.h"
#include "oracle_check.h"
#include "oracle_util.h"
#include "tests/test.h"

static kiln_backend *be;

/* Downloads t and checks it against `ref` (relative error < 1e-4). */
static void check_dev(const kiln_tensor *t, const float *ref, const char *what)
{
    int64_t n = kiln_tensor_numel(t);
    float *host = malloc((size_t)n * sizeof *host);
    kiln_be_download(be, t, host);
    oracle_check_close(what, host, ref, (size_t)n, 1e-4);
    free(host);
}

/* The case's request resolved as kiln generate resolves it (engine/plan.h):
 * its size, steps, guidance (when given), text length and seed, the
 * oracle's single-generator draw (batch_noise). */
static kiln_plan plan_of(cJSON *meta, const char *const *texts, int P,
                         const kiln_model_traits *traits, const kiln_image *refs, int n_refs)
{
    kiln_request q;
    kiln_request_init(&q);
    q.height = cJSON_GetObjectItem(meta, "output_hw")->child->valueint;
    q.width = cJSON_GetObjectItem(meta, "output_hw")->child->next->valueint;
    q.steps = cJSON_GetObjectItem(meta, "steps")->valueint;
    cJSON *g = cJSON_GetObjectItem(meta, "guidance");
    if (cJSON_IsNumber(g))
        q.guidance = (float)g->valuedouble;
    q.max_sequence_length = cJSON_GetObjectItem(meta, "max_seq")->valueint;
    q.seed = (uint64_t)cJSON_GetObjectItem(meta, "seed")->valuedouble;
    q.batch_noise = 1;
    q.refs = n_refs ? refs : NULL, q.n_refs = n_refs;
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_plan plan;
    kiln_err err = {0};
    CHECKF(kiln_plan_make(&plan, &q, texts, P, traits, &lim, &err) == KILN_OK, "%s", err.msg);
    return plan;
}

/* Decodes the P final latents and compares each image with the case's
 * image_fp32_<b>.png (PSNR >= 50 dB). */
static void check_images(const kiln_checkpoint *ck, const kiln_tensor *lat, int width, int height,
                         const char *name, int P)
{
    kiln_err err = {0};
    kiln_decode_stage *dec = kiln_decode_stage_create(be, ck, &err);
    CHECKF(dec != NULL, "%s", err.msg);
    kiln_image out[8] = {{0}};
    CHECKF(kiln_decode_run(dec, lat, width, height, out, NULL, &err) == KILN_OK, "%s", err.msg);
    for (int b = 0; b < P; b++) {
        char rel[256];
        snprintf(rel, sizeof rel, "cases/%s/image_fp32_%d.png", name, b);
        kiln_image png = {0};
        CHECK(kiln_image_read_file(oracle_path(rel), NULL, &png, &err) == KILN_OK);
        double psnr = oracle_psnr_u8(out[b].pixels, png.pixels, (size_t)width * height * 3);
        fprintf(stderr, "  image %d PSNR %.2f dB\n", b, psnr);
        CHECK(psnr >= 50.0);
        kiln_image_free(&png);
        kiln_image_free(&out[b]);
    }
    kiln_decode_stage_destroy(dec);
}

static void run_case(const char *name)
{
    cJSON *meta = oracle_meta(name);
    kiln_err err = {0};
    char ckpt_src[PATH_MAX], kv_dir[PATH_MAX];
    snprintf(ckpt_src, sizeof ckpt_src, "%s",
             oracle_path(cJSON_GetObjectItem(meta, "checkpoint")->valuestring));
    int kv = !strcmp(cJSON_GetObjectItem(meta, "pipeline")->valuestring, "klein_kv");
    const char *ckpt = kv ? oracle_kv_checkpoint(ckpt_src, kv_dir) : ckpt_src;
    CHECK(ckpt != NULL);
    kiln_checkpoint *ck = kiln_checkpoint_open(ckpt, &err);
    CHECKF(ck != NULL, "%s", err.msg);
    kiln_st *ref = oracle_open(name, "ref_fp32.safetensors");

    cJSON *prompts = cJSON_GetObjectItem(meta, "prompts");
    int P = cJSON_GetArraySize(prompts);
    const char *texts[8];
    for (int i = 0; i < P && i < 8; i++)
        texts[i] = cJSON_GetArrayItem(prompts, i)->valuestring;
    int height = cJSON_GetObjectItem(meta, "output_hw")->child->valueint;
    int width = cJSON_GetObjectItem(meta, "output_hw")->child->next->valueint;
    int steps = cJSON_GetObjectItem(meta, "steps")->valueint;
    cJSON *g = cJSON_GetObjectItem(meta, "guidance");
    float guidance = g ? (float)g->valuedouble : 1.0f;
    int max_seq = cJSON_GetObjectItem(meta, "max_seq")->valueint;
    cJSON *refs_wh = cJSON_GetObjectItem(meta, "ref_sizes_wh");
    int n_refs = refs_wh ? cJSON_GetArraySize(refs_wh) : 0;

    kiln_encode_opts eo = {.with_references = n_refs > 0};
    cJSON *layer;
    cJSON_ArrayForEach(layer, cJSON_GetObjectItem(meta, "text_encoder_out_layers"))
        eo.out_layers[eo.n_out_layers++] = layer->valueint;
    kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &eo, &err);
    CHECKF(enc != NULL, "%s", err.msg);
    kiln_model_traits traits = kiln_model_traits_of(ck);
    CHECK(traits.kv_cache == kv && !strcmp(traits.family, "flux2"));
    kiln_image images[8] = {{0}};
    int32_t *ref_ids = NULL;
    int64_t R = 0;
    for (int k = 0; k < n_refs; k++) {
        char rel[256];
        snprintf(rel, sizeof rel, "cases/%s/input_ref%d.png", name, k);
        CHECK(kiln_image_read_file(oracle_path(rel), NULL, &images[k], &err) == KILN_OK);
    }
    kiln_plan plan = plan_of(meta, texts, P, &traits, images, n_refs);
    CHECK(plan.rows == P && plan.req.guidance == guidance);

    kiln_tensor emb = {0}, neg = {0}, ref_tokens = {0}, lat = {0};
    CHECKF(kiln_encode_prompts(enc, texts, P, max_seq, &emb, NULL, NULL, &err) == KILN_OK, "%s", err.msg);
    float *want = oracle_f32(ref, "prompt_embeds", NULL);
    check_dev(&emb, want, "prompt_embeds");
    free(want);
    int cfg = plan.cfg;
    /* The base case runs CFG with diffusers' default negative prompt "". */
    CHECK(cfg == (guidance > 1 && !kv && traits.cfg) && (!cfg || !strcmp(plan.negative, "")));
    if (cfg) {
        CHECK(kiln_encode_prompts(enc, &plan.negative, 1, max_seq, &neg, NULL, NULL, &err) ==
              KILN_OK);
        want = oracle_f32(ref, "neg_prompt_embeds", NULL);
        check_dev(&neg, want, "neg_prompt_embeds");
        free(want);
    }

    if (n_refs) {
        CHECKF(kiln_encode_references(enc, images, n_refs, &ref_tokens, &ref_ids, &R, &err) ==
                   KILN_OK, "%s", err.msg);
        want = oracle_f32(ref, "image_latents_packed", NULL);
        check_dev(&ref_tokens, want, "image_latents_packed");
        free(want);
        float *ids = oracle_f32(ref, "image_latent_ids", NULL);
        for (int64_t i = 0; i < R * 4; i++)
            CHECK(ids[i] == (float)ref_ids[i]);
        free(ids);
    }

    kiln_denoise_stage *den = kiln_denoise_stage_create(be, ck, &err);
    CHECKF(den != NULL, "%s", err.msg);
    uint64_t seeds[8];
    for (int b = 0; b < P; b++)
        seeds[b] = kiln_plan_row_seed(&plan, b);
    /* The oracle draws the batch from one generator (seeds[0]). */
    kiln_denoise_job job = {.B = P, .embeds = &emb, .neg_embeds = cfg ? &neg : NULL,
                            .width = width, .height = height, .steps = steps,
                            .guidance = guidance, .seeds = seeds, .batch_noise = 1,
                            .ref_tokens = R ? &ref_tokens : NULL, .ref_ids = ref_ids, .R = R};
    int64_t N = (int64_t)(height / 16) * (width / 16), C = kiln_denoise_stage_channels(den);
    float *noise = malloc((size_t)(P * N * C) * sizeof *noise);
    CHECK(kiln_denoise_noise(den, &job, noise, &err) == KILN_OK);
    want = oracle_f32(ref, "latents_init_packed", NULL);
    CHECKF(memcmp(noise, want, (size_t)(P * N * C) * sizeof *noise) == 0,
           "initial noise is not bit-identical");
    free(want), free(noise);

    CHECKF(kiln_denoise_run(den, &job, &lat, &err) == KILN_OK, "%s", err.msg);
    char key[64];
    snprintf(key, sizeof key, "latents_step.%d", steps - 1);
    want = oracle_f32(ref, key, NULL);
    check_dev(&lat, want, "final latents");
    free(want);

    check_images(ck, &lat, width, height, name, P);

    for (int k = 0; k < n_refs; k++)
        kiln_image_free(&images[k]);
    kiln_be_free(be, &emb), kiln_be_free(be, &neg), kiln_be_free(be, &ref_tokens);
    kiln_be_free(be, &lat);
    free(ref_ids);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
    cJSON_Delete(meta);
    if (kv)
        oracle_kv_checkpoint_remove(kv_dir);
}

/* Z-Image (ZImagePipeline): the stages as kiln generate runs them, with the
 * pipeline's own defaults for the template and hidden state. */
static void run_zimage_case(const char *name, cJSON *meta)
{
    kiln_err err = {0};
    kiln_checkpoint *ck =
        kiln_checkpoint_open(oracle_path(cJSON_GetObjectItem(meta, "checkpoint")->valuestring), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    kiln_st *ref = oracle_open(name, "ref_fp32.safetensors");
    cJSON *prompts = cJSON_GetObjectItem(meta, "prompts");
    int P = cJSON_GetArraySize(prompts);
    const char *texts[8];
    for (int i = 0; i < P && i < 8; i++)
        texts[i] = cJSON_GetArrayItem(prompts, i)->valuestring;
    int height = cJSON_GetObjectItem(meta, "output_hw")->child->valueint;
    int width = cJSON_GetObjectItem(meta, "output_hw")->child->next->valueint;
    int steps = cJSON_GetObjectItem(meta, "steps")->valueint;
    float guidance = (float)cJSON_GetObjectItem(meta, "guidance")->valuedouble;
    int max_seq = cJSON_GetObjectItem(meta, "max_seq")->valueint;
    kiln_model_traits traits = kiln_model_traits_of(ck);
    CHECK(!strcmp(traits.family, "zimage") && traits.default_steps == 9 &&
          traits.default_guidance == 0.0f && traits.no_references);
    kiln_plan plan = plan_of(meta, texts, P, &traits, NULL, 0);
    CHECK(plan.rows == P && !plan.cfg && !plan.negative && plan.run_steps == steps);
    /* Without steps and guidance the request takes the Turbo defaults. */
    kiln_request dq;
    kiln_request_init(&dq);
    dq.prompt = texts[0];
    kiln_plan dplan;
    kiln_limits lim = KILN_LIMITS_CLI;
    CHECK(kiln_plan_make(&dplan, &dq, NULL, 1, &traits, &lim, &err) == KILN_OK &&
          dplan.req.steps == 9 && dplan.req.guidance == 0.0f && !dplan.cfg);

    kiln_encode_opts eo = KILN_ENCODE_DEFAULTS;
    eo.with_references = 0;
    kiln_encode_stage *enc = kiln_encode_stage_create(be, ck, &eo, &err);
    CHECKF(enc != NULL, "%s", err.msg);
    kiln_tensor emb = {0}, lat = {0};
    int lens[8] = {0};
    CHECKF(kiln_encode_prompts(enc, texts, P, max_seq, &emb, NULL, lens, &err) == KILN_OK, "%s",
           err.msg);
    /* cap_feats.b: the real rows of row b (hidden_states[-2]) */
    int64_t J = kiln_encode_stage_width(enc);
    float *host = malloc((size_t)(P * max_seq * J) * sizeof *host);
    kiln_be_download(be, &emb, host);
    for (int b = 0; b < P; b++) {
        char key[32];
        int64_t n = 0;
        snprintf(key, sizeof key, "cap_feats.%d", b);
        float *want = oracle_f32(ref, key, &n);
        CHECKF(n == lens[b] * J, "%s: %lld values, kiln has %d tokens", key, (long long)n, lens[b]);
        if (n == lens[b] * J)
            oracle_check_close(key, host + (size_t)b * max_seq * J, want, (size_t)n, 1e-4);
        free(want);
    }
    free(host);

    kiln_denoise_stage *den = kiln_denoise_stage_create(be, ck, &err);
    CHECKF(den != NULL, "%s", err.msg);
    uint64_t seeds[8];
    for (int b = 0; b < P; b++)
        seeds[b] = kiln_plan_row_seed(&plan, b);
    /* The oracle draws the batch from one generator (seeds[0]). */
    kiln_denoise_job job = {.B = P, .embeds = &emb, .txt_len = lens, .width = width,
                            .height = height, .steps = steps, .guidance = guidance,
                            .seeds = seeds, .batch_noise = 1};
    const int64_t h = height / 16, w = width / 16, N = h * w;
    const int64_t C = kiln_denoise_stage_channels(den), z = C / 4;
    const size_t n_lat = (size_t)(P * N * C);
    float *noise = malloc(n_lat * sizeof *noise), *want_tok = malloc(n_lat * sizeof *want_tok);
    CHECK(kiln_denoise_noise(den, &job, noise, &err) == KILN_OK);
    float *want = oracle_f32(ref, "noise", NULL);
    kiln_latents_zimage_patchify(want, want_tok, P, z, 2, h, w);
    CHECKF(memcmp(noise, want_tok, n_lat * sizeof *noise) == 0, "initial noise is not bit-identical");
    free(want), free(noise);

    CHECKF(kiln_denoise_run(den, &job, &lat, &err) == KILN_OK, "%s", err.msg);
    char key[64];
    snprintf(key, sizeof key, "latents_step.%d", steps - 1);
    want = oracle_f32(ref, key, NULL);
    kiln_latents_zimage_patchify(want, want_tok, P, z, 2, h, w);
    check_dev(&lat, want_tok, "final latents");
    /* The last DiT call cannot be skipped: its Euler step moves the
     * latents (dt = -sigma_{N-1} is not 0), as the oracle shows. */
    snprintf(key, sizeof key, "latents_step.%d", steps - 2);
    float *before = oracle_f32(ref, key, NULL);
    double moved = 0, size = 0;
    for (size_t i = 0; i < n_lat; i++) {
        moved += ((double)want[i] - before[i]) * ((double)want[i] - before[i]);
        size += (double)want[i] * want[i];
    }
    fprintf(stderr, "  last step moves the latents by %.3g (relative)\n", sqrt(moved / size));
    CHECK(moved > 1e-6 * size);
    free(before), free(want), free(want_tok);

    check_images(ck, &lat, width, height, name, P);
    kiln_be_free(be, &emb), kiln_be_free(be, &lat);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: test_pipeline CASE\n");
        return 2;
    }
    be = oracle_cpu_backend();
    cJSON *meta = oracle_meta(argv[1]);
    if (!strcmp(cJSON_GetObjectItem(meta, "family")->valuestring, "zimage"))
        run_zimage_case(argv[1], meta);
    else
        run_case(argv[1]);
    cJSON_Delete(meta);
    kiln_backend_destroy(be);
    return test_finish();
}
