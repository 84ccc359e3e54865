/* The whole pipeline (engine stages) on the CUDA backend against every
 * klein and Z-Image case of the diffusers oracle, run twice per case:
 *   fp32 noise: the case's fp32 draw (bit for bit its latents_init_packed),
 *     final image PSNR >= 40 dB against the fp32 reference PNG; diffusers'
 *     own bf16 pipeline fed the same noise lands at meta.json
 *     bf16_fp32noise.psnr_vs_fp32_image_db (47-49 dB).  Also reported: the
 *     PSNR against that diffusers bf16 image.
 *   bf16 noise: the GPU pipeline's own draw, which must equal ref_bf16's
 *     packed noise bit for bit, and an image PSNR >= 40 dB against
 *     ref_bf16's image_uint8 (diffusers' bf16 run with the same draw).
 *   Z-Image draws fp32 noise in both pipelines (z-image-turbo.md §4 item 2),
 *     so both runs draw the same noise, bit for bit the oracle's `noise`,
 *     and ref_bf16 is diffusers' bf16 pipeline on it (its PSNR against the
 *     fp32 image: meta.json bf16.psnr_vs_fp32_image_db, about 52 dB).
 * Prints a table (stdout) and the details (stderr).
 *
 * Usage: test_cuda_pipeline [CASE...]   (default: every klein case)
 * Needs $KILN_SHARED/oracle.  Without a CUDA device the test is skipped
 * (exit 77) unless KILN_REQUIRE_GPU=1 (tools/gpu/check.sh). */
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
#include "tests/oracle/oracle_util.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

#define MIN_PSNR 40.0

static const char *const all_cases[] = {"klein_t2i_256",      "klein_t2i_batch2",
                                        "klein_edit_1ref",    "klein_kv_edit_1ref",
                                        "klein_base_cfg_256", "zimage_t2i_256",
                                        "zimage_batch2_160x96"};

static kiln_backend *be;

/* Everything one case's runs share: stages, embeddings, references. */
typedef struct case_ctx {
    const char *name;
    cJSON *meta;
    kiln_st *fp32, *bf16, *bf16_fp32noise;
    kiln_encode_stage *enc;
    kiln_denoise_stage *den;
    kiln_decode_stage *dec;
    kiln_tensor emb, neg, ref_tokens;
    int32_t *ref_ids;
    int64_t R;
    int P, width, height, steps, cfg;
    float guidance;
    uint64_t seeds[8];
    int zimage;   /* ZImagePipeline case: latents are patch tokens */
    int lens[16]; /* real tokens per prompt row, then the negative's */
} case_ctx;

static int meta_int(const cJSON *m, const char *key) { return cJSON_GetObjectItem(m, key)->valueint; }

static const uint8_t *st_u8(const kiln_st *st, const char *name, size_t n)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    return t && t->dtype == KILN_U8 && t->nbytes == n ? t->data : NULL;
}

/* Rel err of a backend tensor against reference tensor `key` of `st`. */
static double rel_err(const kiln_tensor *t, const kiln_st *st, const char *key)
{
    int64_t n = kiln_tensor_numel(t), m = 0;
    float *want = oracle_f32(st, key, &m), *got = malloc((size_t)n * sizeof *got);
    double e = INFINITY;
    if (want && got && m == n) {
        kiln_be_download(be, t, got);
        e = test_rel_err(got, want, (size_t)n);
    }
    free(want), free(got);
    return e;
}

/* The same for the final latents: Z-Image's stage holds them as patch
 * tokens (B, N, 64), the oracle as (B, 16, 2h, 2w). */
static double lat_err(const case_ctx *c, const kiln_tensor *t, const kiln_st *st, const char *key)
{
    if (!c->zimage)
        return rel_err(t, st, key);
    int64_t n = kiln_tensor_numel(t), m = 0;
    float *want = oracle_f32(st, key, &m), *tok = malloc((size_t)n * sizeof *tok);
    float *got = malloc((size_t)n * sizeof *got);
    double e = INFINITY;
    if (want && tok && got && m == n) {
        kiln_latents_zimage_patchify(want, tok, c->P, t->shape[2] / 4, 2, c->height / 16,
                                     c->width / 16);
        kiln_be_download(be, t, got);
        e = test_rel_err(got, tok, (size_t)n);
    }
    free(want), free(tok), free(got);
    return e;
}

static double min_psnr(kiln_image *imgs, int P, const uint8_t *const *refs)
{
    double worst = INFINITY;
    for (int b = 0; b < P; b++) {
        double p = refs[b] ? oracle_psnr_u8(imgs[b].pixels, refs[b],
                                            (size_t)imgs[b].width * imgs[b].height * 3)
                           : 0.0;
        worst = p < worst ? p : worst;
    }
    return worst;
}

static void row(const char *name, const char *noise, const char *ref, const char *bits,
                double lat, double psnr, double own, const char *pass)
{
    char own_s[16] = "-";
    if (own > 0)
        snprintf(own_s, sizeof own_s, "%.2f", own);
    printf("%-19s | %-5s | %-22s | %-10s | %-9.3g | %8.2f | %-14s | %s\n", name, noise, ref, bits,
           lat, psnr, own_s, pass);
}

/* Denoises with the fp32 or the bf16 draw and decodes into imgs. */
static int run_once(case_ctx *c, int fp32_noise, const kiln_st *noise_ref, kiln_tensor *lat,
                    kiln_image *imgs, int *noise_exact)
{
    kiln_err err = {0};
    kiln_denoise_job job = {.B = c->P, .embeds = &c->emb, .neg_embeds = c->cfg ? &c->neg : NULL,
                            .txt_len = c->lens, .neg_len = c->lens + 8,
                            .width = c->width, .height = c->height, .steps = c->steps,
                            .guidance = c->guidance, .seeds = c->seeds, .batch_noise = 1,
                            .fp32_noise = fp32_noise, .ref_tokens = c->R ? &c->ref_tokens : NULL,
                            .ref_ids = c->ref_ids, .R = c->R};
    int64_t N = (int64_t)(c->height / 16) * (c->width / 16);
    int64_t n = c->P * N * kiln_denoise_stage_channels(c->den), m = 0;
    float *noise = malloc((size_t)n * sizeof *noise);
    float *want = oracle_f32(noise_ref, c->zimage ? "noise" : "latents_init_packed", &m);
    CHECK(noise && want && m == n);
    if (c->zimage && want && m == n) {
        float *grid = want;
        want = malloc((size_t)n * sizeof *want);
        if (want)
            kiln_latents_zimage_patchify(grid, want, c->P, n / c->P / N / 4, 2, c->height / 16,
                                         c->width / 16);
        free(grid);
    }
    if (!noise || !want || m != n)
        return -1;
    CHECKF(kiln_denoise_noise(c->den, &job, noise, &err) == KILN_OK, "%s", err.msg);
    *noise_exact = !memcmp(noise, want, (size_t)n * sizeof *noise);
    CHECKF(*noise_exact, "%s: %s initial noise is not bit-identical to the reference", c->name,
           fp32_noise ? "fp32" : "bf16");
    free(noise), free(want);
    kiln_status st = kiln_denoise_run(c->den, &job, lat, &err);
    CHECKF(st == KILN_OK, "%s", err.msg);
    if (!st) {
        st = kiln_decode_run(c->dec, lat, c->width, c->height, imgs, NULL, &err);
        CHECKF(st == KILN_OK, "%s", err.msg);
    }
    return st ? -1 : 0;
}

static void run_fp32(case_ctx *c)
{
    kiln_tensor lat = {0};
    kiln_image imgs[8] = {{0}};
    int exact = 0;
    if (!run_once(c, 1, c->fp32, &lat, imgs, &exact)) {
        kiln_image png[8] = {{0}};
        const uint8_t *want[8], *dbf16[8];
        size_t plane = (size_t)c->width * c->height * 3;
        /* Z-Image's bf16 reference already ran on the fp32 draw. */
        const uint8_t *all = st_u8(c->zimage ? c->bf16 : c->bf16_fp32noise, "image_uint8",
                                   plane * (size_t)c->P);
        for (int b = 0; b < c->P; b++) {
            char rel[256];
            kiln_err err = {0};
            snprintf(rel, sizeof rel, "cases/%s/image_fp32_%d.png", c->name, b);
            CHECKF(kiln_image_read_file(oracle_path(rel), NULL, &png[b], &err) == KILN_OK, "%s",
                   err.msg);
            want[b] = png[b].pixels;
            dbf16[b] = all ? all + plane * (size_t)b : NULL;
        }
        char key[64];
        snprintf(key, sizeof key, "latents_step.%d", c->steps - 1);
        const cJSON *own = cJSON_GetObjectItem(c->meta, c->zimage ? "bf16" : "bf16_fp32noise");
        double psnr = min_psnr(imgs, c->P, want);
        int ok = exact && psnr >= MIN_PSNR;
        CHECKF(psnr >= MIN_PSNR, "%s fp32 noise: PSNR %.2f dB < %.0f", c->name, psnr, MIN_PSNR);
        row(c->name, "fp32", "fp32 reference", exact ? "exact" : "DIFFERENT",
            lat_err(c, &lat, c->fp32, key), psnr,
            cJSON_GetObjectItem(own, "psnr_vs_fp32_image_db")->valuedouble, ok ? "ok" : "FAIL");
        row(c->name, "fp32", "diffusers bf16, same", "-",
            lat_err(c, &lat, c->zimage ? c->bf16 : c->bf16_fp32noise, key),
            min_psnr(imgs, c->P, dbf16), -1, "(info)");
        for (int b = 0; b < c->P; b++)
            kiln_image_free(&png[b]);
    }
    for (int b = 0; b < c->P; b++)
        kiln_image_free(&imgs[b]);
    kiln_be_free(be, &lat);
}

static void run_bf16(case_ctx *c)
{
    kiln_tensor lat = {0};
    kiln_image imgs[8] = {{0}};
    int exact = 0;
    if (!run_once(c, 0, c->bf16, &lat, imgs, &exact)) {
        size_t plane = (size_t)c->width * c->height * 3;
        const uint8_t *all = st_u8(c->bf16, "image_uint8", plane * (size_t)c->P), *want[8];
        CHECKF(all != NULL, "%s: ref_bf16 image_uint8 missing or mis-shaped", c->name);
        for (int b = 0; b < c->P; b++)
            want[b] = all ? all + plane * (size_t)b : NULL;
        char key[64];
        snprintf(key, sizeof key, "latents_step.%d", c->steps - 1);
        double psnr = min_psnr(imgs, c->P, want);
        int ok = exact && psnr >= MIN_PSNR;
        CHECKF(psnr >= MIN_PSNR, "%s bf16 noise: PSNR %.2f dB < %.0f", c->name, psnr, MIN_PSNR);
        row(c->name, "bf16", "diffusers bf16, same", exact ? "exact" : "DIFFERENT",
            lat_err(c, &lat, c->bf16, key), psnr, -1, ok ? "ok" : "FAIL");
    }
    for (int b = 0; b < c->P; b++)
        kiln_image_free(&imgs[b]);
    kiln_be_free(be, &lat);
}

/* Loads the stages and encodes the prompts and references once. */
static int setup(case_ctx *c, const kiln_checkpoint *ck)
{
    kiln_err err = {0};
    const cJSON *m = c->meta, *prompts = cJSON_GetObjectItem(m, "prompts");
    c->P = cJSON_GetArraySize(prompts);
    if (c->P < 1 || c->P > 8)
        return -1;
    const char *texts[8];
    for (int i = 0; i < c->P; i++) {
        texts[i] = cJSON_GetArrayItem(prompts, i)->valuestring;
        c->seeds[i] = (uint64_t)cJSON_GetObjectItem(m, "seed")->valuedouble;
    }
    c->height = cJSON_GetObjectItem(m, "output_hw")->child->valueint;
    c->width = cJSON_GetObjectItem(m, "output_hw")->child->next->valueint;
    c->steps = meta_int(m, "steps");
    const cJSON *g = cJSON_GetObjectItem(m, "guidance");
    c->guidance = g && cJSON_IsNumber(g) ? (float)g->valuedouble : 1.0f;
    const cJSON *refs_wh = cJSON_GetObjectItem(m, "ref_sizes_wh");
    int n_refs = refs_wh ? cJSON_GetArraySize(refs_wh) : 0;

    kiln_encode_opts eo = {.with_references = n_refs > 0};
    const cJSON *layer;
    cJSON_ArrayForEach(layer, cJSON_GetObjectItem(m, "text_encoder_out_layers"))
        eo.out_layers[eo.n_out_layers++] = layer->valueint;
    c->enc = kiln_encode_stage_create(be, ck, &eo, &err);
    CHECKF(c->enc != NULL, "%s", err.msg);
    c->den = c->enc ? kiln_denoise_stage_create(be, ck, &err) : NULL;
    CHECKF(c->den != NULL, "%s", err.msg);
    c->dec = c->den ? kiln_decode_stage_create(be, ck, &err) : NULL;
    CHECKF(c->dec != NULL, "%s", err.msg);
    if (!c->dec)
        return -1;
    kiln_model_traits traits = kiln_denoise_stage_traits(c->den);
    c->cfg = kiln_model_cfg_runs(&traits, c->guidance);
    int max_seq = meta_int(m, "max_seq");
    if (kiln_encode_prompts(c->enc, texts, c->P, max_seq, &c->emb, NULL, c->lens, &err)) {
        CHECKF(0, "%s", err.msg);
        return -1;
    }
    if (!c->zimage)
        fprintf(stderr, "  prompt_embeds rel err vs fp32 %.3g\n",
                rel_err(&c->emb, c->fp32, "prompt_embeds"));
    if (c->cfg) {
        const char *empty = "";
        if (kiln_encode_prompts(c->enc, &empty, 1, max_seq, &c->neg, NULL, c->lens + 8, &err)) {
            CHECKF(0, "%s", err.msg);
            return -1;
        }
    }
    kiln_image images[8] = {{0}};
    int loaded = 0, st = 0;
    for (; loaded < n_refs && loaded < 8 && !st; loaded++) {
        char rel[256];
        snprintf(rel, sizeof rel, "cases/%s/input_ref%d.png", c->name, loaded);
        st = kiln_image_read_file(oracle_path(rel), NULL, &images[loaded], &err);
        CHECKF(st == KILN_OK, "%s", err.msg);
    }
    if (n_refs && !st) {
        st = kiln_encode_references(c->enc, images, n_refs, &c->ref_tokens, &c->ref_ids, &c->R,
                                    &err);
        CHECKF(st == KILN_OK, "%s", err.msg);
        if (!st)
            fprintf(stderr, "  image_latents_packed rel err vs fp32 %.3g\n",
                    rel_err(&c->ref_tokens, c->fp32, "image_latents_packed"));
    }
    for (int k = 0; k < loaded; k++)
        kiln_image_free(&images[k]);
    return st ? -1 : 0;
}

static void run_case(const char *name)
{
    case_ctx c = {.name = name, .meta = oracle_meta(name)};
    fprintf(stderr, "%s\n", name);
    c.fp32 = oracle_open(name, "ref_fp32.safetensors");
    c.bf16 = oracle_open(name, "ref_bf16.safetensors");
    c.zimage = !strcmp(cJSON_GetObjectItem(c.meta, "family")->valuestring, "zimage");
    if (!c.zimage)
        c.bf16_fp32noise = oracle_open(name, "ref_bf16_fp32noise.safetensors");
    char src[PATH_MAX], kv_dir[PATH_MAX];
    snprintf(src, sizeof src, "%s", oracle_path(cJSON_GetObjectItem(c.meta, "checkpoint")->valuestring));
    int kv = !strcmp(cJSON_GetObjectItem(c.meta, "pipeline")->valuestring, "klein_kv");
    const char *dir = kv ? oracle_kv_checkpoint(src, kv_dir) : src;
    kiln_err err = {0};
    kiln_checkpoint *ck = dir ? kiln_checkpoint_open(dir, &err) : NULL;
    CHECKF(ck != NULL, "%s: %s", name, dir ? err.msg : "cannot make the KV checkpoint");
    if (ck && !setup(&c, ck)) {
        run_fp32(&c);
        run_bf16(&c);
    }
    fflush(stdout);
    kiln_be_free(be, &c.emb), kiln_be_free(be, &c.neg), kiln_be_free(be, &c.ref_tokens);
    free(c.ref_ids);
    kiln_decode_stage_destroy(c.dec);
    kiln_denoise_stage_destroy(c.den);
    kiln_encode_stage_destroy(c.enc);
    kiln_checkpoint_close(ck);
    kiln_st_close(c.fp32), kiln_st_close(c.bf16), kiln_st_close(c.bf16_fp32noise);
    cJSON_Delete(c.meta);
    if (kv && dir)
        oracle_kv_checkpoint_remove(kv_dir);
}

int main(int argc, char **argv)
{
    kiln_err err = {0};
    be = kiln_backend_create("cuda", 0, &err);
    if (!be)
        return gpu_test_unavailable("cuda backend", &err);
    printf("%-19s | %-5s | %-22s | %-10s | %-9s | %8s | %-14s | %s\n", "case", "noise",
           "image compared with", "noise bits", "lat. err", "PSNR dB", "diffusers' own", "pass");
    printf("--------------------+-------+------------------------+------------+-----------+"
           "----------+----------------+-----\n");
    if (argc > 1)
        for (int i = 1; i < argc; i++)
            run_case(argv[i]);
    else
        for (size_t i = 0; i < sizeof all_cases / sizeof *all_cases; i++)
            run_case(all_cases[i]);
    kiln_backend_destroy(be);
    return test_finish();
}
