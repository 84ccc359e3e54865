/* kiln model traits: what a request needs to know about the served
 * checkpoint (defaults, limits of its pipeline, the sizes its stages hand
 * on), and nothing of how it runs.  Filled from a checkpoint by its family
 * in engine/ (engine/family.h, kiln_model_traits_of), sent by every replica
 * in its bus `hello` (common/proto.h), and read by the request plan
 * (engine/plan.h) in the CLI and the gateway, which learns them from the
 * replicas instead of opening the checkpoint itself.
 *
 *   kiln_model_traits t = kiln_model_traits_of(ck);      // a replica, the CLI
 *   if (kiln_model_traits_equal(&t, &from_hello)) ...    // the gateway
 *
 * A plain value: no ownership, no state; thread-safe.
 */
#ifndef KILN_COMMON_TRAITS_H
#define KILN_COMMON_TRAITS_H

#define KILN_TRAITS_FAMILY_MAX 16 /* a family's name, with the NUL */

/* The largest supported widths (klein-9B's 3 x 4096 text features, 128
 * latent channels): for configs that do not say, and for the gateway's
 * bus frame bound, set before any replica says which model it serves. */
#define KILN_TRAITS_WIDEST_TEXT 12288
#define KILN_TRAITS_WIDEST_LATENT 128

typedef struct kiln_model_traits {
    /* The family's name in engine/family.c's table ("flux2", "zimage"):
     * for logs and for telling replicas apart, never branched on outside
     * the engine. */
    char family[KILN_TRAITS_FAMILY_MAX];
    int cfg;            /* classifier-free guidance with a negative prompt is possible, */
    int cfg_above_zero; /* ... running when guidance > 0 (Z-Image), else > 1
                           (kiln_model_cfg_runs, engine/plan.h) */
    int kv_cache;       /* Flux2KleinKVPipeline: references computed once */
    /* Input images.  no_references: an image never conditions the run as
     * a reference; an edit is image-to-image or inpainting of its one
     * image (Z-Image: ZImageImg2ImgPipeline, ZImageInpaintPipeline).
     * img2img_strength: the strength of an edit that gives none and no
     * mask (0: such an edit uses its images as references, klein; 0.6
     * Z-Image, the img2img pipeline's default).  inpaint_strength: with a
     * mask (0.8 Flux2KleinInpaintPipeline, 1.0 ZImageInpaintPipeline).
     * shrink_images: an image over 1024 x 1024 pixels is first scaled down
     * (the FLUX.2 pipelines; Z-Image's keep every size); either way the
     * prepared size is then floored to multiples of 16. */
    int no_references;
    double img2img_strength, inpaint_strength; /* doubles: steps x 0.6f is not steps x 0.6 */
    int shrink_images;
    int default_steps;  /* 4 distilled/kv, 50 base, 9 Z-Image-Turbo */
    float default_guidance;
    /* Features per text token the DiT takes and per (packed) latent token:
     * the sizes of the tensors the stages hand on. */
    int text_width, latent_channels;
} kiln_model_traits;

/* 1 when a and b describe the same model (every field). */
int kiln_model_traits_equal(const kiln_model_traits *a, const kiln_model_traits *b);

#endif
