/* Tensor tables of the published checkpoints, for the checkpoint maker:
 * the diffusers/transformers state_dict names and shapes of each network,
 * computed from its dimensions (shared/spec/flux2-klein.md §7,
 * qwen3-encoder.md §6, vae.md §6, z-image-turbo.md §5).
 *
 *   kiln_arch_list l = {0};
 *   kiln_arch_flux2(&l, &(kiln_flux2_dims){.layers = 5, ...});
 *   if (l.oom) ...;  for (size_t i = 0; i < l.n; i++) l.t[i].name ...
 *   kiln_arch_list_free(&l);
 *
 * Appending never fails loudly: an allocation failure sets `oom` and later
 * appends do nothing, so callers check once.  Not thread-safe per list.
 */
#ifndef KILN_TOOLS_CKPT_ARCH_H
#define KILN_TOOLS_CKPT_ARCH_H

#include <stddef.h>
#include <stdint.h>

#include "common/tensor.h"

/* How the maker fills a tensor with random values (see ckpt_write.c). */
typedef enum kiln_arch_init {
    KILN_INIT_WEIGHT, /* linear / conv / embedding: N(0, 0.02) */
    KILN_INIT_BIAS,   /* N(0, 0.02) */
    KILN_INIT_NORM,   /* norm scales: 1 + N(0, 0.1) */
    KILN_INIT_MEAN,   /* batch-norm running mean: N(0, 0.1) */
    KILN_INIT_VAR,    /* batch-norm running var: 1 + |N(0, 0.5)|, always positive */
    KILN_INIT_ZERO,   /* counters (bn.num_batches_tracked) */
} kiln_arch_init;

typedef struct kiln_arch_tensor {
    char name[128];
    kiln_dtype dtype;
    int ndim;
    int64_t shape[4];
    kiln_arch_init init;
} kiln_arch_tensor;

typedef struct kiln_arch_list {
    kiln_arch_tensor *t;
    size_t n, cap;
    int oom;
} kiln_arch_list;

void kiln_arch_list_free(kiln_arch_list *l);
/* Bytes of all tensors in the list. */
uint64_t kiln_arch_list_bytes(const kiln_arch_list *l);

typedef struct kiln_qwen3_dims {
    int hidden, layers, heads, kv_heads, head_dim, intermediate, vocab;
    int causal_lm; /* Qwen3ForCausalLM ("model." prefix) vs Qwen3Model */
    int tied;      /* tie_word_embeddings: no lm_head.weight */
} kiln_qwen3_dims;

typedef struct kiln_flux2_dims {
    int layers, single_layers, heads, head_dim, joint_dim, in_channels, timestep_channels;
    double mlp_ratio;
    int axes[4];
} kiln_flux2_dims;

typedef struct kiln_zimage_dims {
    int dim, heads, layers, refiner_layers, in_channels, cap_feat_dim, patch, f_patch;
    int axes[3], axes_lens[3];
} kiln_zimage_dims;

typedef struct kiln_vae_dims {
    int channels[4], latent, groups, layers_per_block, sample_size;
    int flux2; /* AutoencoderKLFlux2 (quant convs + batch norm) vs AutoencoderKL */
    double scaling, shift; /* AutoencoderKL only */
} kiln_vae_dims;

void kiln_arch_qwen3(kiln_arch_list *l, const kiln_qwen3_dims *d);
void kiln_arch_flux2(kiln_arch_list *l, const kiln_flux2_dims *d);
void kiln_arch_zimage(kiln_arch_list *l, const kiln_zimage_dims *d);
void kiln_arch_vae(kiln_arch_list *l, const kiln_vae_dims *d);

#endif
