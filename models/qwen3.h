/* The Qwen3 text encoder (shared/spec/qwen3-encoder.md): token ids in,
 * stacked hidden states out, written once against kernels/backend.h.
 *
 *   int layers[] = {9, 18, 27};                    // FLUX.2 klein
 *   kiln_qwen3 *enc = kiln_qwen3_load(be, ck, layers, 3, &err);
 *   if (!enc) die(err.msg);
 *   kiln_tensor out;                               // (B, T, 3 * H)
 *   kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){B, T, kiln_qwen3_out_width(enc)});
 *   if (kiln_qwen3_encode(enc, ids, lens, B, T, &out, &err)) die(err.msg);
 *   ...
 *   kiln_qwen3_destroy(enc);
 *
 * Hidden-state indices follow transformers' `output_hidden_states`: index 0
 * is the token embedding, index k (1 <= k < num_hidden_layers) the raw output
 * of layer k, index num_hidden_layers the final-normed output.  Negative
 * indices count from the end as in Python (-2 is Z-Image's choice,
 * num_hidden_layers - 1).  Only the layers up to the deepest requested index
 * are loaded and run, and the final norm only when that index is requested.
 *
 * The encoder feature of token t for requested index j is channel c of that
 * hidden state at column j*H + c (diffusers' stack -> permute -> reshape in
 * Flux2KleinPipeline._get_qwen3_prompt_embeds).
 *
 * Input is right-padded: row b holds lens[b] real tokens then padding.
 * Position ids are 0..T-1 for every row and key j is visible to query i iff
 * j <= i and j < lens[b], as transformers does for this mask (padding rows
 * attend to the real tokens; FLUX.2 uses those rows).
 *
 * Thread-safety: a kiln_qwen3 uses its backend and owns scratch memory, so it
 * belongs to the backend's thread; separate instances are independent.
 */
#ifndef KILN_MODELS_QWEN3_H
#define KILN_MODELS_QWEN3_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/checkpoint.h"
#include "common/error.h"
#include "kernels/backend.h"

/* Most hidden-state indices one encoder returns. */
#define KILN_QWEN3_MAX_OUT 16

typedef struct kiln_qwen3 kiln_qwen3;

/* The fields of text_encoder/config.json that the forward uses. */
typedef struct kiln_qwen3_config {
    int64_t hidden_size;
    int64_t num_hidden_layers;
    int64_t num_attention_heads;
    int64_t num_key_value_heads;
    int64_t head_dim;
    int64_t intermediate_size;
    int64_t vocab_size;
    double rms_norm_eps;
    double rope_theta;
    int tie_word_embeddings;
} kiln_qwen3_config;

/* Parses a Qwen3 config.json document with transformers' Qwen3Config
 * defaults for absent optional keys.  Unsupported variants (attention
 * biases, sliding windows, a non-default RoPE type, an activation other than
 * silu) are KILN_ERR_UNSUPPORTED; inconsistent sizes KILN_ERR_FORMAT. */
kiln_status kiln_qwen3_config_parse(const cJSON *cfg, kiln_qwen3_config *out, kiln_err *err);

/* Loads the checkpoint's text_encoder/ component (Qwen3ForCausalLM with the
 * `model.` prefix, or Qwen3Model without it) into `be` for the given
 * hidden-state indices (n in 1..KILN_QWEN3_MAX_OUT, negative ones counted
 * from the end).  An index out of range, a missing component or tensor, or a
 * tensor of the wrong shape fails with a message naming it.  Returns NULL
 * with err set.  The caller owns the result; `be` must outlive it, `ck` is
 * only used during the call (the encoder keeps its own mapping of the
 * weights, from which embedding rows are gathered per request). */
kiln_qwen3 *kiln_qwen3_load(kiln_backend *be, const kiln_checkpoint *ck, const int *layers,
                            int n_layers, kiln_err *err);
void kiln_qwen3_destroy(kiln_qwen3 *m);

const kiln_qwen3_config *kiln_qwen3_get_config(const kiln_qwen3 *m);
/* Number of requested indices times hidden_size: the feature width of the
 * encode outputs. */
int64_t kiln_qwen3_out_width(const kiln_qwen3 *m);
/* Number of transformer layers loaded and run per forward. */
int kiln_qwen3_depth(const kiln_qwen3 *m);
/* Bytes of backend scratch memory held for activations (stable after the
 * first call of a shape: later calls of that shape allocate nothing). */
size_t kiln_qwen3_scratch_bytes(const kiln_qwen3 *m);

/* FLUX.2 klein: ids (B, T) row-major host array, lens[B] real-token counts
 * (1..T); out is a caller-allocated backend tensor of be->act_dtype with
 * B * T * out_width elements, viewed as (B, T, out_width), padding rows
 * included.  Ids outside the embedding table or bad lengths are
 * KILN_ERR_INVALID; a backend failure is reported with the layer it happened
 * in.  Scratch memory is reused between calls. */
kiln_status kiln_qwen3_encode(kiln_qwen3 *m, const int32_t *ids, const int *lens, int64_t B,
                              int64_t T, kiln_tensor *out, kiln_err *err);

/* Z-Image: the same features for real tokens only, rows of all B prompts
 * packed one after the other: out has (lens[0] + ... + lens[B-1]) *
 * out_width elements.  Only max(lens) positions are run (right padding and
 * the causal mask mean real tokens never see padding).  Errors as above. */
kiln_status kiln_qwen3_encode_real(kiln_qwen3 *m, const int32_t *ids, const int *lens, int64_t B,
                                   int64_t T, kiln_tensor *out, kiln_err *err);

#endif
