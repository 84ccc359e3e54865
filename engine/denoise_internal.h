/* Private parts of the denoise stage, shared by denoise_stage.c (family
 * dispatch, FLUX.2 klein loop) and denoise_zimage.c (Z-Image loop). */
#ifndef KILN_ENGINE_DENOISE_INTERNAL_H
#define KILN_ENGINE_DENOISE_INTERNAL_H

#include "denoise_stage.h"
#include "models/flux2_dit.h"
#include "models/scheduler.h"
#include "models/zimage_dit.h"

struct kiln_denoise_stage {
    kiln_backend *be;
    kiln_flux2_dit *dit;      /* FLUX.2 klein, or */
    kiln_zimage_dit *zdit;    /* Z-Image */
    kiln_flux2_kv_cache *kv;
    kiln_sched_config sched;
    kiln_model_traits traits;
    kiln_model_family family;
    int64_t channels;
};

/* Image plus text tokens per DiT forward: a batch of large images runs a
 * few rows at a time (see denoise_stage.c). */
#define DENOISE_PASS_TOKENS 8192

/* The Z-Image loop (ZImagePipeline.__call__ from the noise to the last
 * latents); the job was checked by kiln_denoise_run. */
kiln_status denoise_zimage_run(kiln_denoise_stage *s, const kiln_denoise_job *job,
                               kiln_tensor *out, kiln_err *err);

#endif
