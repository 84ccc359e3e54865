/* Image-to-image and inpainting inputs as diffusers' pipelines prepare
 * them (Flux2KleinInpaintPipeline and FluxImg2ImgPipeline's algorithm for
 * klein, ZImageImg2ImgPipeline and ZImageInpaintPipeline): the image
 * resized (not cropped) to its multiple-of-16 size, and the mask at the
 * grid the family blends on.  Shared by kiln edit and kiln-encoder.
 *
 *   kiln_image img, mask;                             // mask: kiln_image_decode_mask
 *   kiln_inpaint_prepare_image(&img, &traits, &err);  // in place: W x H, multiples of 16
 *   float *m = malloc((W / 16) * (H / 16) * sizeof *m);
 *   kiln_inpaint_mask(&mask, img.width, img.height, m, &err);  // klein: 1 repaint, 0 keep
 *   ... kiln_encode_references(enc, &img, 1, ...) -> the start (and klein's condition image)
 *
 * Pure host code; thread-safe on distinct images. */
#ifndef KILN_ENGINE_INPAINT_H
#define KILN_ENGINE_INPAINT_H

#include "common/error.h"
#include "common/image.h"

#include "common/traits.h"
#include "request.h"

/* In place: with traits->shrink_images the >1024^2 LANCZOS downscale of a
 * reference (kiln_image_flux2_ref_shrink), then a LANCZOS resize to the
 * kiln_request_image_size (VaeImageProcessor.preprocess, resize_mode
 * "default": no crop, unlike edit references).  Encoding the result as a
 * reference (no crop left to do) gives the pipeline's image latents.
 * Errors: KILN_ERR_INVALID (kiln_request_image_size's limits), _NOMEM. */
kiln_status kiln_inpaint_prepare_image(kiln_image *img, const kiln_model_traits *traits,
                                       kiln_err *err);

/* The mask at the packed latent grid, (height/16) x (width/16) floats in
 * `out`, row-major: the mask image (channel 0, 255 = repaint) LANCZOS-resized
 * to width x height, /255 and binarized at 0.5 (diffusers' mask processor:
 * grayscale, no normalisation, do_binarize), then torch's bilinear
 * interpolation (align_corners=False, no antialiasing) to the grid, as
 * prepare_mask_latents does.  Values are 0, 0.5, 1 (and in between at
 * edges). */
kiln_status kiln_inpaint_mask(const kiln_image *mask, int width, int height, float *out,
                              kiln_err *err);

/* The mask at the VAE's latent pixels, (height/8) x (width/8) floats, as
 * ZImageInpaintPipeline prepares it: binarized at width x height as above,
 * then torch's nearest interpolation (pixel (8y, 8x)).  Values 0 or 1. */
kiln_status kiln_inpaint_mask_latent(const kiln_image *mask, int width, int height, float *out,
                                     kiln_err *err);

#endif
