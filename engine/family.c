#include "family.h"

#include <stdio.h>

#include "common/json.h"

static int config_int(const cJSON *cfg, const char *key)
{
    int64_t v = 0;
    kiln_err err = {0};
    if (!cfg || kiln_json_int(cfg, key, 0, &v, &err) || v < 0 || v > (1 << 20))
        return 0;
    return (int)v;
}

static void widths(const kiln_checkpoint *ck, kiln_model_traits *t)
{
    kiln_err err = {0};
    const cJSON *cfg = kiln_checkpoint_config(ck, "transformer", &err);
    t->text_width = config_int(cfg, "joint_attention_dim");
    if (!t->text_width)
        t->text_width = config_int(cfg, "cap_feat_dim");
    int patch = config_int(cfg, "patch_size");
    const cJSON *patches = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "all_patch_size") : NULL;
    if (!patch && cJSON_IsArray(patches) && cJSON_IsNumber(cJSON_GetArrayItem(patches, 0)))
        patch = cJSON_GetArrayItem(patches, 0)->valueint;
    if (patch < 1 || patch > 16)
        patch = 1;
    t->latent_channels = config_int(cfg, "in_channels") * patch * patch;
    if (!t->text_width || t->text_width > KILN_TRAITS_WIDEST_TEXT)
        t->text_width = KILN_TRAITS_WIDEST_TEXT;
    if (!t->latent_channels || t->latent_channels > KILN_TRAITS_WIDEST_LATENT)
        t->latent_channels = KILN_TRAITS_WIDEST_LATENT;
}

static int flux2_matches(const kiln_checkpoint *ck)
{
    kiln_pipeline_kind p = kiln_checkpoint_pipeline(ck);
    return p == KILN_PIPE_FLUX2_KLEIN || p == KILN_PIPE_FLUX2_KLEIN_KV;
}

static void flux2_traits(const kiln_checkpoint *ck, kiln_model_traits *t)
{
    t->kv_cache = kiln_checkpoint_pipeline(ck) == KILN_PIPE_FLUX2_KLEIN_KV;
    t->cfg = !t->kv_cache && !kiln_checkpoint_is_distilled(ck);
    t->default_steps = t->cfg ? 50 : 4;
    t->default_guidance = t->cfg ? 4.0f : 1.0f;
    t->inpaint_strength = 0.8; /* Flux2KleinInpaintPipeline's default */
    t->shrink_images = 1;
}

static int zimage_matches(const kiln_checkpoint *ck)
{
    return kiln_checkpoint_pipeline(ck) == KILN_PIPE_ZIMAGE;
}

static void zimage_traits(const kiln_checkpoint *ck, kiln_model_traits *t)
{
    (void)ck;
    t->cfg = 1;
    t->cfg_above_zero = 1;
    t->no_references = 1;
    /* ZImageImg2ImgPipeline's and ZImageInpaintPipeline's defaults. */
    t->img2img_strength = 0.6;
    t->inpaint_strength = 1.0;
    t->default_steps = 9;
    t->default_guidance = 0.0f;
}

static const kiln_family families[] = {
    /* Flux2KleinPipeline: hidden states 9, 18, 27 concatenated. */
    {KILN_FAMILY_FLUX2, "flux2", flux2_matches, flux2_traits, 3, {9, 18, 27}},
    /* ZImagePipeline: hidden_states[-2]. */
    {KILN_FAMILY_ZIMAGE, "zimage", zimage_matches, zimage_traits, 1, {-2}},
};

const kiln_family *kiln_family_of(const kiln_checkpoint *ck)
{
    for (size_t i = 0; i < sizeof families / sizeof families[0]; i++)
        if (families[i].matches(ck))
            return &families[i];
    return &families[0]; /* unreachable: the checkpoint knows no other class */
}

kiln_model_traits kiln_model_traits_of(const kiln_checkpoint *ck)
{
    kiln_model_traits t = {0};
    const kiln_family *f = kiln_family_of(ck);
    snprintf(t.family, sizeof t.family, "%s", f->name);
    f->traits(ck, &t);
    widths(ck, &t);
    return t;
}
