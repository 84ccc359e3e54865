/* Request plans (engine/plan.h) and the family tables (engine/family.h,
 * family_stages.h):
 * the traits of the oracle's tiny klein, klein base and Z-Image
 * checkpoints, and what a plan makes of a request for each (defaults, rows
 * and their prompts and seeds, CFG and its negative prompt, refusals, the
 * steps img2img runs, cost), and the row layout helpers the CLI and the
 * denoiser share (text lengths per row, embeddings expanded on the CPU
 * backend). */
#include <string.h>

#include "engine/denoise_stage.h"
#include "engine/family.h"
#include "engine/family_stages.h"
#include "engine/plan.h"
#include "tests/oracle/oracle_util.h"
#include "tests/test.h"

static kiln_model_traits traits_of_ckpt(const char *name)
{
    char rel[64];
    snprintf(rel, sizeof rel, "ckpt/%s", name);
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path(rel), &err);
    CHECKF(ck != NULL, "%s: %s", name, err.msg);
    kiln_model_traits t = {0};
    if (ck)
        t = kiln_model_traits_of(ck);
    kiln_checkpoint_close(ck);
    return t;
}

/* The family table's encode-stage entries and the seam's (chat template,
 * VAE), by the checkpoint's class. */
static void check_family(const char *name, const char *family, kiln_chat_template chat,
                         kiln_vae_kind vae, int layer0, int n)
{
    char rel[64];
    snprintf(rel, sizeof rel, "ckpt/%s", name);
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path(rel), &err);
    CHECKF(ck != NULL, "%s: %s", name, err.msg);
    if (!ck)
        return;
    const kiln_family *f = kiln_family_of(ck);
    const kiln_family_stages *fs = kiln_family_stages_of(ck);
    CHECKF(!strcmp(f->name, family) && fs->chat == chat && fs->vae_kind == vae &&
               f->n_default_layers == n && f->default_layers[0] == layer0,
           "%s: family %s", name, f->name);
    kiln_checkpoint_close(ck);
}

static void test_family_traits(void)
{
    check_family("klein-tiny", "flux2", KILN_CHAT_KLEIN, KILN_VAE_FLUX2, 9, 3);
    check_family("klein-base-tiny", "flux2", KILN_CHAT_KLEIN, KILN_VAE_FLUX2, 9, 3);
    check_family("zimage-tiny", "zimage", KILN_CHAT_ZIMAGE, KILN_VAE_KL, -2, 1);
    kiln_model_traits k = traits_of_ckpt("klein-tiny");
    CHECK(!strcmp(k.family, "flux2") && !k.cfg && !k.kv_cache && !k.no_references);
    CHECK(k.shrink_images && k.img2img_strength == 0.0 && k.inpaint_strength == 0.8);
    CHECK(k.default_steps == 4 && k.default_guidance == 1.0f);
    CHECK(k.text_width > 0 && k.text_width <= KILN_TRAITS_WIDEST_TEXT && k.latent_channels > 0);
    kiln_model_traits b = traits_of_ckpt("klein-base-tiny");
    CHECK(!strcmp(b.family, "flux2") && b.cfg && !b.cfg_above_zero);
    CHECK(b.default_steps == 50 && b.default_guidance == 4.0f);
    kiln_model_traits z = traits_of_ckpt("zimage-tiny");
    CHECK(!strcmp(z.family, "zimage") && z.cfg && z.cfg_above_zero && z.no_references);
    CHECK(!z.shrink_images && z.img2img_strength == 0.6 && z.inpaint_strength == 1.0);
    CHECK(z.default_steps == 9 && z.default_guidance == 0.0f);
    CHECK(!kiln_model_traits_equal(&k, &z) && kiln_model_traits_equal(&z, &z));
    /* The rule, once: klein base above 1, Z-Image above 0, never without CFG. */
    CHECK(!kiln_model_cfg_runs(&b, 1.0f) && kiln_model_cfg_runs(&b, 1.01f));
    CHECK(!kiln_model_cfg_runs(&z, 0.0f) && kiln_model_cfg_runs(&z, 0.01f));
    CHECK(!kiln_model_cfg_runs(&k, 7.0f));
}

static const kiln_model_traits distilled = {.family = "flux2", .default_steps = 4,
                                            .default_guidance = 1.0f, .text_width = 7680,
                                            .latent_channels = 128, .shrink_images = 1,
                                            .inpaint_strength = 0.8};
static const kiln_model_traits base = {.family = "flux2", .cfg = 1, .default_steps = 50,
                                       .default_guidance = 4.0f, .text_width = 7680,
                                       .latent_channels = 128, .shrink_images = 1,
                                       .inpaint_strength = 0.8};
static const kiln_model_traits kv = {.family = "flux2", .kv_cache = 1, .default_steps = 4,
                                     .default_guidance = 1.0f, .text_width = 12288,
                                     .latent_channels = 128, .shrink_images = 1,
                                     .inpaint_strength = 0.8};
static const kiln_model_traits zimage = {.family = "zimage", .cfg = 1, .cfg_above_zero = 1,
                                         .no_references = 1, .img2img_strength = 0.6,
                                         .inpaint_strength = 1.0, .default_steps = 9,
                                         .text_width = 2560, .latent_channels = 64};

static kiln_status plan(kiln_plan *p, kiln_request *q, const char *const *prompts, int P,
                        const kiln_model_traits *t, kiln_err *err)
{
    kiln_limits lim = KILN_LIMITS_SERVICE;
    lim.min_side = 64;
    return kiln_plan_make(p, q, prompts, P, t, &lim, err);
}

static void test_rows_and_seeds(void)
{
    const char *prompts[] = {"a cat", "a dog"};
    kiln_request q;
    kiln_request_init(&q);
    q.n = 3, q.seed = UINT64_MAX - 1, q.width = 64, q.height = 128;
    kiln_plan p;
    kiln_err err = {0};
    CHECKF(plan(&p, &q, prompts, 2, &distilled, &err) == KILN_OK, "%s", err.msg);
    CHECK(p.n_prompts == 2 && p.rows == 6 && p.req.n == 3 && !strcmp(p.req.prompt, "a cat"));
    CHECK(p.req.steps == 4 && p.req.guidance == 1.0f && !p.cfg && !p.negative);
    CHECK(p.first_step == 0 && p.run_steps == 4);
    for (int64_t b = 0; b < p.rows; b++)
        CHECK(kiln_plan_row_prompt(b, p.req.n) == b / 3);
    CHECK(kiln_plan_row_seed(&p, 0) == UINT64_MAX - 1 && kiln_plan_row_seed(&p, 1) == UINT64_MAX);
    CHECK(kiln_plan_row_seed(&p, 2) == 0); /* wraps as uint64 */
    kiln_request one = q;
    one.prompt = "a cat";
    kiln_plan p1;
    CHECK(plan(&p1, &one, NULL, 1, &distilled, &err) == KILN_OK);
    CHECK_NEAR(p.cost, 2 * p1.cost, 1e-12);
    CHECK_NEAR(p1.cost, kiln_request_cost(&p1.req, &distilled, 0), 1e-12);
    /* Each prompt is validated. */
    const char *bad[] = {"fine", "\xff"};
    CHECK(plan(&p, &q, bad, 2, &distilled, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "UTF-8"));
    q.negative_prompt = "blurry"; /* no CFG on a distilled checkpoint */
    CHECK(plan(&p, &q, prompts, 2, &distilled, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "negative_prompt"));
}

static void test_cfg(void)
{
    kiln_request q;
    kiln_plan p;
    kiln_err err = {0};
    kiln_request_init(&q);
    q.prompt = "a cat";
    CHECK(plan(&p, &q, NULL, 1, &base, &err) == KILN_OK);
    CHECK(p.req.steps == 50 && p.req.guidance == 4.0f && p.cfg && !strcmp(p.negative, ""));
    CHECK_NEAR(p.cost, kiln_request_cost(&p.req, &base, 1), 1e-12);
    q.guidance = 1.0f;
    CHECK(plan(&p, &q, NULL, 1, &base, &err) == KILN_OK && !p.cfg && !p.negative);
    q.guidance = 1.5f, q.negative_prompt = "blurry";
    CHECK(plan(&p, &q, NULL, 1, &base, &err) == KILN_OK && p.cfg &&
          p.negative == q.negative_prompt);
    q.guidance = 7.0f, q.negative_prompt = NULL;
    CHECK(plan(&p, &q, NULL, 1, &kv, &err) == KILN_OK && !p.cfg && !p.negative);
    /* Z-Image: the Turbo recipe by default, CFG from any guidance above 0. */
    kiln_request_init(&q);
    q.prompt = "a lighthouse";
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_OK);
    CHECK(p.req.steps == 9 && p.req.guidance == 0.0f && !p.cfg && !p.negative);
    CHECK(p.req.width == 1024 && p.req.height == 1024 && p.run_steps == 9);
    q.guidance = 0.5f;
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_OK && p.cfg && !strcmp(p.negative, ""));
    /* An edit is image-to-image at ZImageImg2ImgPipeline's strength 0.6,
     * exactly: 9 x 0.6 leaves int(9 - 5.4) = 3 steps out (a float 0.6
     * would not, in general: 5 x 0.6f is 3.0000001). */
    kiln_image ref = {.width = 120, .height = 88}, refs[2] = {ref, ref};
    q.guidance = -1.0f, q.refs = &ref, q.n_refs = 1, q.steps = 5;
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_OK && p.req.strength == 0.6 &&
          p.run_steps == 3 && p.req.width == 112 && p.req.height == 80);
    /* Inpainting at its 1.0; a given strength wins. */
    kiln_image mask = ref;
    q.mask = &mask, q.strength = 0;
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_OK && p.req.strength == 1.0 &&
          p.run_steps == 5);
    q.strength = 0.8;
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_OK && p.run_steps == 4);
    /* No references; large images are not shrunk (klein's are). */
    q.mask = NULL, q.strength = 0, q.refs = refs, q.n_refs = 2;
    CHECK(plan(&p, &q, NULL, 1, &zimage, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "not 2 references"));
    kiln_image big = {.width = 1500, .height = 1000};
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &big, q.n_refs = 1;
    CHECK(kiln_plan_make(&p, &q, NULL, 1, &zimage, &lim, &err) == KILN_OK &&
          p.req.width == 1488 && p.req.height == 992);
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &big, q.n_refs = 1, q.strength = 0.5;
    CHECK(kiln_plan_make(&p, &q, NULL, 1, &distilled, &lim, &err) == KILN_OK &&
          p.req.width == 1248 && p.req.height == 832);
}

static void test_img2img_steps(void)
{
    kiln_image ref = {.width = 128, .height = 128};
    kiln_request q;
    kiln_request_init(&q);
    q.prompt = "a cat", q.refs = &ref, q.n_refs = 1, q.strength = 0.5, q.steps = 4;
    kiln_plan p;
    kiln_err err = {0};
    CHECKF(plan(&p, &q, NULL, 1, &distilled, &err) == KILN_OK, "%s", err.msg);
    CHECK(p.first_step == kiln_request_first_step(4, 0.5) && p.first_step == 2);
    CHECK(p.run_steps == 2 && p.req.width == 128 && p.req.height == 128);
}

static void test_row_lens_and_expand(void)
{
    int prompt_lens[2] = {7, 11}, rows[6], negs[6];
    kiln_plan_row_lens(6, 3, prompt_lens, 5, rows, negs);
    for (int b = 0; b < 6; b++)
        CHECK(rows[b] == (b < 3 ? 7 : 11) && negs[b] == 5);

    kiln_err err = {0};
    kiln_backend *be = kiln_backend_create("cpu", 0, &err);
    CHECKF(be != NULL, "%s", err.msg);
    if (!be)
        return;
    float src_host[2 * 2 * 3];
    for (int i = 0; i < 12; i++)
        src_host[i] = (float)i;
    kiln_tensor src = {0}, dst = {0};
    CHECK(!kiln_be_from_host(be, &src, 3, (int64_t[]){2, 2, 3}, src_host, KILN_F32));
    CHECK(!kiln_be_alloc(be, &dst, KILN_F32, 3, (int64_t[]){7, 2, 3}));
    /* rows 1..6 of dst: two prompts of three images; row 0 untouched */
    kiln_denoise_expand_rows(be, &dst, 1, &src, 6, 3);
    float out[7 * 6];
    kiln_be_download(be, &dst, out);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    for (int b = 0; b < 6; b++)
        CHECKF(!memcmp(out + (1 + b) * 6, src_host + (b / 3) * 6, 6 * sizeof(float)),
               "row %d", b);
    /* the one negative on every row */
    kiln_denoise_expand_rows(be, &dst, 0, &src, 7, 7);
    kiln_be_download(be, &dst, out);
    for (int b = 0; b < 7; b++)
        CHECK(!memcmp(out + b * 6, src_host, 6 * sizeof(float)));
    kiln_be_free(be, &src), kiln_be_free(be, &dst);
    kiln_backend_destroy(be);
}

int main(void)
{
    RUN(test_family_traits);
    RUN(test_rows_and_seeds);
    RUN(test_cfg);
    RUN(test_img2img_steps);
    RUN(test_row_lens_and_expand);
    return test_finish();
}
