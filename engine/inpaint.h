/* Inpainting inputs as diffusers' Flux2KleinInpaintPipeline prepares them:
 * the image resized (not cropped) to its multiple-of-16 size, and the mask
 * at the packed latent grid.  Shared by kiln edit --mask and kiln-encoder.
 *
 *   kiln_image img, mask;                         // decoded; mask: kiln_image_decode_mask
 *   kiln_inpaint_prepare_image(&img, &err);       // in place: W x H, multiples of 16
 *   float *m = malloc((W / 16) * (H / 16) * sizeof *m);
 *   kiln_inpaint_mask(&mask, img.width, img.height, m, &err);  // 1 repaint, 0 keep
 *   ... kiln_encode_references(enc, &img, 1, ...) -> the start and the condition image
 *
 * Pure host code; thread-safe on distinct images. */
#ifndef KILN_ENGINE_INPAINT_H
#define KILN_ENGINE_INPAINT_H

#include "common/error.h"
#include "common/image.h"

/* diffusers' Flux2KleinInpaintPipeline default strength. */
#define KILN_INPAINT_DEFAULT_STRENGTH 0.8

/* In place: the >1024^2 LANCZOS downscale of a reference
 * (kiln_image_flux2_ref_shrink), then a LANCZOS resize to the floored
 * multiple-of-16 size (VaeImageProcessor.preprocess, resize_mode
 * "default": no crop, unlike edit references).  Encoding the result as a
 * reference (no crop left to do) gives the pipeline's image latents.
 * Errors: KILN_ERR_INVALID (kiln_image_flux2_ref_size's limits), _NOMEM. */
kiln_status kiln_inpaint_prepare_image(kiln_image *img, kiln_err *err);

/* The mask at the packed latent grid, (height/16) x (width/16) floats in
 * `out`, row-major: the mask image (channel 0, 255 = repaint) LANCZOS-resized
 * to width x height, /255 and binarized at 0.5 (diffusers' mask processor:
 * grayscale, no normalisation, do_binarize), then torch's bilinear
 * interpolation (align_corners=False, no antialiasing) to the grid, as
 * prepare_mask_latents does.  Values are 0, 0.5, 1 (and in between at
 * edges). */
kiln_status kiln_inpaint_mask(const kiln_image *mask, int width, int height, float *out,
                              kiln_err *err);

#endif
