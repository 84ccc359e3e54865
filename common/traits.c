#include "traits.h"

#include <string.h>

int kiln_model_traits_equal(const kiln_model_traits *a, const kiln_model_traits *b)
{
    /* Field by field: the struct's padding is not compared. */
    return !strncmp(a->family, b->family, sizeof a->family) && a->cfg == b->cfg &&
           a->cfg_above_zero == b->cfg_above_zero && a->kv_cache == b->kv_cache &&
           a->no_references == b->no_references && a->shrink_images == b->shrink_images &&
           !memcmp(&a->img2img_strength, &b->img2img_strength, sizeof a->img2img_strength) &&
           !memcmp(&a->inpaint_strength, &b->inpaint_strength, sizeof a->inpaint_strength) &&
           a->default_steps == b->default_steps &&
           !memcmp(&a->default_guidance, &b->default_guidance, sizeof a->default_guidance) &&
           a->text_width == b->text_width && a->latent_channels == b->latent_channels;
}
