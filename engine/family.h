/* kiln model families: the one table that maps a checkpoint's pipeline
 * class to its family and the request traits it implies.  Nothing
 * branches on a family: front ends (the CLI, the gateway, the bench) read
 * traits and plans (engine/plan.h); the encode stage reads the default
 * hidden states here; the stages reach the family's models/ code through
 * engine/family_stages.h (the seam, which says how to add a family).
 *
 *   const kiln_family *f = kiln_family_of(ck);       // never NULL
 *   kiln_model_traits t = kiln_model_traits_of(ck);  // f->traits filled in
 *
 * The table is constant: thread-safe.
 */
#ifndef KILN_ENGINE_FAMILY_H
#define KILN_ENGINE_FAMILY_H

#include "common/checkpoint.h"
#include "common/traits.h"

typedef enum kiln_model_family {
    KILN_FAMILY_FLUX2,  /* Flux2KleinPipeline, Flux2KleinKVPipeline */
    KILN_FAMILY_ZIMAGE, /* ZImagePipeline */
    KILN_FAMILY_COUNT,  /* not a family: how many there are */
} kiln_model_family;

typedef struct kiln_family {
    kiln_model_family id;
    const char *name; /* kiln_model_traits.family */
    /* 1 when the checkpoint's pipeline class belongs to this family. */
    int (*matches)(const kiln_checkpoint *ck);
    /* The request defaults and rules of a checkpoint of this family
     * (everything but the name and the widths, which the table fills). */
    void (*traits)(const kiln_checkpoint *ck, kiln_model_traits *t);
    /* The hidden states the pipeline takes by default (the encode stage's
     * kiln_encode_layers_of, when model_index.json does not record
     * text_encoder_out_layers); its chat template is engine/family_stages.h's. */
    int n_default_layers;
    int default_layers[3];
} kiln_family;

/* The family of a checkpoint that opened (kiln_checkpoint_open knows only
 * the pipeline classes of the table).  Never NULL. */
const kiln_family *kiln_family_of(const kiln_checkpoint *ck);

/* The traits a checkpoint implies.  FLUX.2 klein: the KV pipeline always
 * runs without CFG; distilled and base checkpoints differ by
 * model_index.json's is_distilled; steps follow the model cards, 4 for the
 * distilled models, 50 (with diffusers' guidance 4.0) for base.  Z-Image
 * (ZImagePipeline) takes the Turbo recipe of its model card, 9 steps and
 * guidance 0 (no CFG), not diffusers' call defaults (50 steps, guidance 5,
 * which are wrong for Turbo); a caller's guidance > 0 runs CFG as
 * diffusers does.  Widths from the transformer config: FLUX.2's
 * joint_attention_dim and in_channels x patch_size^2, Z-Image's
 * cap_feat_dim and in_channels x all_patch_size[0]^2 (the widest supported
 * when the config does not say).  Thread-safe. */
kiln_model_traits kiln_model_traits_of(const kiln_checkpoint *ck);

#endif
