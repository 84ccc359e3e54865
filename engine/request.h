/* kiln generation requests: the parameters of one text-to-image or edit
 * request, their defaults from the model's traits (common/traits.h) and
 * their validation.  Front ends resolve a request through the plan
 * (engine/plan.h), which calls kiln_request_resolve, so the CLI and the
 * HTTP gateway accept and refuse the same things.
 *
 *   kiln_request req;
 *   kiln_request_init(&req);
 *   req.prompt = "a cat"; req.width = 512; req.height = 512;
 *   kiln_limits lim = KILN_LIMITS_SERVICE;
 *   if (kiln_request_resolve(&req, &model, &lim, &err)) -> 400 with err.msg
 *
 * A kiln_request borrows its strings and reference images; it owns nothing.
 * Resolution is pure (no I/O), thread-safe on distinct requests.
 */
#ifndef KILN_ENGINE_REQUEST_H
#define KILN_ENGINE_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "common/checkpoint.h"
#include "common/error.h"
#include "common/image.h"
#include "common/traits.h"

#define KILN_MAX_OUT_LAYERS 8
#define KILN_MAX_REFS 8

/* Bounds a request must respect. */
typedef struct kiln_limits {
    int min_side, max_side; /* pixels, multiples of 16 */
    int max_n;              /* images per request */
    int max_steps;
    int max_refs;
    size_t max_prompt_bytes;
} kiln_limits;

/* The CLI accepts 64..4096 per side; the service's default range is
 * 256..2048 (configurable with --min-size / --max-size). */
#define KILN_LIMITS_CLI ((kiln_limits){64, 4096, 64, 1000, KILN_MAX_REFS, 1u << 20})
#define KILN_LIMITS_SERVICE ((kiln_limits){256, 2048, 10, 200, KILN_MAX_REFS, 1u << 16})

typedef struct kiln_request {
    const char *prompt;
    const char *negative_prompt; /* base checkpoints; NULL = "" as diffusers */
    int n;                       /* images; 0 = 1 */
    int width, height;           /* 0 = default (1024, or the first reference's size) */
    uint64_t seed;               /* image i uses seed + i */
    int steps;                   /* 0 = the model's default */
    float guidance;              /* < 0 = the model's default */
    int max_sequence_length;     /* 0 = 512 */
    int batch_noise;             /* draw one noise tensor for the batch, as diffusers does
                                    with a single generator */
    /* Image-to-image (diffusers' FluxImg2ImgPipeline algorithm on klein,
     * ZImageImg2ImgPipeline; engine/denoise_stage.h): in (0, 1], the one
     * image is the starting point, noised to this fraction of the
     * schedule, instead of a reference; 0: not img2img (on a model without
     * references, traits.img2img_strength). */
    double strength;
    /* Inpainting (Flux2KleinInpaintPipeline, ZImageInpaintPipeline): the
     * decoded mask (kiln_image_decode_mask) of the one image, of its size;
     * strength defaults to traits.inpaint_strength.  NULL: none. */
    const kiln_image *mask;
    const kiln_image *refs;      /* edits: decoded references, 1..max_refs */
    int n_refs;
    kiln_image_format format;
    int compression;             /* 0..100, OpenAI output_compression; -1 = default */
} kiln_request;

void kiln_request_init(kiln_request *req);

/* The size an edit's image (klein: a reference too) of width x height is prepared to: with
 * traits->shrink_images kiln_image_flux2_ref_size (scaled down above
 * 1024^2 pixels, its side and aspect limits), else the size floored to
 * multiples of 16 (VaeImageProcessor.get_default_height_width with
 * ZImage's vae_scale_factor x 2), sides of at least 16.
 * KILN_ERR_INVALID otherwise. */
kiln_status kiln_request_image_size(const kiln_model_traits *traits, int width, int height,
                                    int *out_width, int *out_height, kiln_err *err);

/* Fills defaults and validates against the model and the limits: sizes
 * multiples of 16 inside the limits, n, steps, guidance, sequence length,
 * prompt present, valid UTF-8 and within max_prompt_bytes, references within
 * the limits.  For an edit without a size the output size is the first
 * reference's prepared size (shared/spec/pipeline.md section 8,
 * kiln_request_image_size).  On a model without references (Z-Image) an
 * edit has one image and is image-to-image at traits.img2img_strength
 * unless it gives a strength or a mask.  With a strength: exactly one
 * image, the output at its prepared size (diffusers' img2img latents are
 * the image's).  With a mask: one image of the mask's size, strength
 * traits.inpaint_strength unless given, not on the reference K/V cache
 * checkpoints (diffusers has no such pipeline).  Returns KILN_ERR_INVALID with a message naming
 * the field. */
kiln_status kiln_request_resolve(kiln_request *req, const kiln_model_traits *model,
                                 const kiln_limits *lim, kiln_err *err);

/* The work a resolved request asks of the DiT, the dominant cost of a
 * request, in millions of attention-weighted token-forwards ("Mtok"): the
 * sum over the n rows, the steps and the forwards of each step (two under
 * CFG) of L x (1 + K / KILN_COST_ATTN_TOKENS), where L is the tokens the
 * forward computes (image (W/16)(H/16), text max_sequence_length, and
 * reference tokens) and K the tokens its attention reads.  The linear
 * layers cost per token; attention grows with L x K, and at klein's widths
 * it matches the linear layers near 16K tokens, hence the constant.  With
 * the reference K/V cache (9B-kv) the references are computed on the
 * first step only and read (K) on every step.  Examples: 1024x1024, 4
 * steps: 0.024; 2048x2048, 50 steps with CFG: 3.4; 2048x2048, n = 10, 200
 * steps: 69, with eight 1 MP references: 400.  `refs` as in the request
 * (decoded sizes), or n_refs = 0.  `cfg`: classifier-free guidance runs. */
#define KILN_COST_ATTN_TOKENS 16384.0
double kiln_request_cost(const kiln_request *req, const kiln_model_traits *model, int cfg);

/* The schedule step image-to-image and inpainting start at, as diffusers'
 * get_timesteps of FluxImg2ImgPipeline and Flux2KleinInpaintPipeline (both
 * copies of StableDiffusion3Img2ImgPipeline's) computes it in Python
 * floats: int(max(steps - min(steps x strength, steps), 0)); 0 when
 * strength <= 0.  steps - this many steps run: at least one for any
 * strength > 0 (4 steps: 0.6 runs 3, 0.1 runs 1). */
int kiln_request_first_step(int steps, double strength);

/* 1 when s[0..len) is well-formed UTF-8 (no overlongs, surrogates or code
 * points past U+10FFFF). */
int kiln_utf8_valid(const char *s, size_t len);

#endif
