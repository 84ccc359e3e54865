#include "traits.h"

#include <string.h>

int kiln_model_traits_equal(const kiln_model_traits *a, const kiln_model_traits *b)
{
    /* Field by field: the struct's padding is not compared. */
    return !strncmp(a->family, b->family, sizeof a->family) && a->cfg == b->cfg &&
           a->cfg_above_zero == b->cfg_above_zero && a->kv_cache == b->kv_cache &&
           a->no_edits == b->no_edits && a->default_steps == b->default_steps &&
           !memcmp(&a->default_guidance, &b->default_guidance, sizeof a->default_guidance) &&
           a->text_width == b->text_width && a->latent_channels == b->latent_channels;
}
