/* kiln checkpoints: a diffusers pipeline folder as published.
 *
 *   kiln_checkpoint *ck = kiln_checkpoint_open("/models/FLUX.2-klein-4B", &err);
 *   const cJSON *tcfg = kiln_checkpoint_config(ck, "transformer", &err);
 *   kiln_st *w = kiln_checkpoint_weights(ck, "transformer", &err);
 *   ... kiln_st_close(w); kiln_checkpoint_close(ck);
 *
 * Layout: model_index.json at the root (its `_class_name` picks the pipeline:
 * Flux2KleinPipeline, Flux2KleinKVPipeline, ZImagePipeline), and one folder
 * per component (text_encoder/, tokenizer/, transformer/, vae/, scheduler/)
 * with its config.json (scheduler: scheduler_config.json) and weights
 * (one .safetensors file or a sharded set with its index).  Components are
 * opened lazily so each service stage reads only its own part.  A component
 * named in model_index.json but missing on disk is a KILN_ERR_NOT_FOUND error
 * naming the component, never the absolute path.
 *
 * A kiln_checkpoint is immutable after open and safe to share between threads
 * (configs are parsed at open; weights are opened per call).
 */
#ifndef KILN_CHECKPOINT_H
#define KILN_CHECKPOINT_H

#include <cjson/cJSON.h>

#include "error.h"
#include "safetensors.h"

typedef struct kiln_checkpoint kiln_checkpoint;

typedef enum kiln_pipeline_kind {
    KILN_PIPE_FLUX2_KLEIN,    /* Flux2KleinPipeline (distilled or base, see is_distilled) */
    KILN_PIPE_FLUX2_KLEIN_KV, /* Flux2KleinKVPipeline (9B-kv) */
    KILN_PIPE_ZIMAGE,         /* ZImagePipeline */
} kiln_pipeline_kind;

/* Opens the folder and parses model_index.json and every present component's
 * config.  Returns NULL with err set. */
kiln_checkpoint *kiln_checkpoint_open(const char *dir, kiln_err *err);
void kiln_checkpoint_close(kiln_checkpoint *ck);

/* The model name a checkpoint folder is served and labelled under: for a
 * Hugging Face cache snapshot (.../models--ORG--NAME/snapshots/<commit>,
 * what `huggingface-cli download` without --local-dir leaves) "ORG/NAME",
 * else the folder's own name ("FLUX.2-klein-4B" for a --local-dir copy).
 * The folder need not be a checkpoint (symlinks are resolved when it
 * exists).  Characters outside [A-Za-z0-9._/-] become '_'; "model" when
 * nothing is left.  Thread-safe. */
void kiln_checkpoint_model_name(const char *dir, char *out, size_t cap);

kiln_pipeline_kind kiln_checkpoint_pipeline(const kiln_checkpoint *ck);
/* model_index.json's is_distilled (diffusers' default: false). */
int kiln_checkpoint_is_distilled(const kiln_checkpoint *ck);
/* The whole model_index.json document (owned by ck). */
const cJSON *kiln_checkpoint_index(const kiln_checkpoint *ck);

/* The component's parsed config (owned by ck), or NULL with KILN_ERR_NOT_FOUND. */
const cJSON *kiln_checkpoint_config(const kiln_checkpoint *ck, const char *component,
                                    kiln_err *err);
/* Opens the component's weights (caller closes).  NULL with err set. */
kiln_st *kiln_checkpoint_weights(const kiln_checkpoint *ck, const char *component,
                                 kiln_err *err);
/* Absolute path of the component folder, for loaders of non-weight files
 * (the tokenizer).  Writes into buf; returns KILN_ERR_NOT_FOUND when absent. */
kiln_status kiln_checkpoint_path(const kiln_checkpoint *ck, const char *component, char *buf,
                                 size_t len, kiln_err *err);

/* Path to open for `file` inside the component folder ("vocab.json"),
 * following symlink stubs (see common/linkstub.h) so checkpoints copied
 * without symlink support still work.  KILN_ERR_NOT_FOUND (naming
 * "component/file", never the path) when the component or file is absent. */
kiln_status kiln_checkpoint_file(const kiln_checkpoint *ck, const char *component,
                                 const char *file, char *buf, size_t len, kiln_err *err);

#endif
