#include "ckpt_arch.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kiln_arch_list_free(kiln_arch_list *l)
{
    free(l->t);
    memset(l, 0, sizeof *l);
}

uint64_t kiln_arch_list_bytes(const kiln_arch_list *l)
{
    uint64_t total = 0;
    for (size_t i = 0; i < l->n; i++) {
        uint64_t n = kiln_dtype_size(l->t[i].dtype);
        for (int d = 0; d < l->t[i].ndim; d++)
            n *= (uint64_t)l->t[i].shape[d];
        total += n;
    }
    return total;
}

static void add(kiln_arch_list *l, kiln_arch_init init, int ndim, const int64_t *shape,
                const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void add(kiln_arch_list *l, kiln_arch_init init, int ndim, const int64_t *shape,
                const char *fmt, ...)
{
    if (l->oom)
        return;
    if (l->n == l->cap) {
        size_t ncap = l->cap ? l->cap * 2 : 256;
        kiln_arch_tensor *nt = realloc(l->t, ncap * sizeof *nt);
        if (!nt) {
            l->oom = 1;
            return;
        }
        l->t = nt;
        l->cap = ncap;
    }
    kiln_arch_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->dtype = init == KILN_INIT_ZERO ? KILN_I64 : KILN_BF16;
    t->ndim = ndim;
    memcpy(t->shape, shape, sizeof(int64_t) * (size_t)ndim);
    t->init = init;
}

#define W2(a, b, ...) add(l, KILN_INIT_WEIGHT, 2, (int64_t[]){a, b}, __VA_ARGS__)
#define W4(a, b, c, d, ...) add(l, KILN_INIT_WEIGHT, 4, (int64_t[]){a, b, c, d}, __VA_ARGS__)
#define B1(a, ...) add(l, KILN_INIT_BIAS, 1, (int64_t[]){a}, __VA_ARGS__)
#define N1(a, ...) add(l, KILN_INIT_NORM, 1, (int64_t[]){a}, __VA_ARGS__)

void kiln_arch_qwen3(kiln_arch_list *l, const kiln_qwen3_dims *d)
{
    const char *p = d->causal_lm ? "model." : "";
    int64_t H = d->hidden, q = (int64_t)d->heads * d->head_dim,
            kv = (int64_t)d->kv_heads * d->head_dim;
    W2(d->vocab, H, "%sembed_tokens.weight", p);
    for (int n = 0; n < d->layers; n++) {
        N1(H, "%slayers.%d.input_layernorm.weight", p, n);
        W2(q, H, "%slayers.%d.self_attn.q_proj.weight", p, n);
        W2(kv, H, "%slayers.%d.self_attn.k_proj.weight", p, n);
        W2(kv, H, "%slayers.%d.self_attn.v_proj.weight", p, n);
        W2(H, q, "%slayers.%d.self_attn.o_proj.weight", p, n);
        N1(d->head_dim, "%slayers.%d.self_attn.q_norm.weight", p, n);
        N1(d->head_dim, "%slayers.%d.self_attn.k_norm.weight", p, n);
        N1(H, "%slayers.%d.post_attention_layernorm.weight", p, n);
        W2(d->intermediate, H, "%slayers.%d.mlp.gate_proj.weight", p, n);
        W2(d->intermediate, H, "%slayers.%d.mlp.up_proj.weight", p, n);
        W2(H, d->intermediate, "%slayers.%d.mlp.down_proj.weight", p, n);
    }
    N1(H, "%snorm.weight", p);
    if (d->causal_lm && !d->tied)
        W2(d->vocab, H, "lm_head.weight");
}

void kiln_arch_flux2(kiln_arch_list *l, const kiln_flux2_dims *d)
{
    int64_t D = (int64_t)d->heads * d->head_dim, F = (int64_t)(D * d->mlp_ratio),
            hd = d->head_dim;
    W2(D, d->in_channels, "x_embedder.weight");
    W2(D, d->joint_dim, "context_embedder.weight");
    W2(D, d->timestep_channels, "time_guidance_embed.timestep_embedder.linear_1.weight");
    W2(D, D, "time_guidance_embed.timestep_embedder.linear_2.weight");
    W2(6 * D, D, "double_stream_modulation_img.linear.weight");
    W2(6 * D, D, "double_stream_modulation_txt.linear.weight");
    W2(3 * D, D, "single_stream_modulation.linear.weight");
    static const char *const sq[] = {"to_q", "to_k", "to_v", "to_out.0",
                                     "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"};
    static const char *const norms[] = {"norm_q", "norm_k", "norm_added_q", "norm_added_k"};
    for (int i = 0; i < d->layers; i++) {
        for (int k = 0; k < 8; k++)
            W2(D, D, "transformer_blocks.%d.attn.%s.weight", i, sq[k]);
        for (int k = 0; k < 4; k++)
            N1(hd, "transformer_blocks.%d.attn.%s.weight", i, norms[k]);
        W2(2 * F, D, "transformer_blocks.%d.ff.linear_in.weight", i);
        W2(D, F, "transformer_blocks.%d.ff.linear_out.weight", i);
        W2(2 * F, D, "transformer_blocks.%d.ff_context.linear_in.weight", i);
        W2(D, F, "transformer_blocks.%d.ff_context.linear_out.weight", i);
    }
    for (int j = 0; j < d->single_layers; j++) {
        W2(3 * D + 2 * F, D, "single_transformer_blocks.%d.attn.to_qkv_mlp_proj.weight", j);
        W2(D, D + F, "single_transformer_blocks.%d.attn.to_out.weight", j);
        N1(hd, "single_transformer_blocks.%d.attn.norm_q.weight", j);
        N1(hd, "single_transformer_blocks.%d.attn.norm_k.weight", j);
    }
    W2(2 * D, D, "norm_out.linear.weight");
    W2(d->in_channels, D, "proj_out.weight"); /* out_channels null = in_channels */
}

static void zimage_block(kiln_arch_list *l, const char *kind, int i, int64_t D, int64_t A,
                         int64_t hd, int modulated)
{
    int64_t Fz = D * 8 / 3; /* int(dim / 3 * 8) in diffusers */
    if (modulated) {
        W2(4 * D, A, "%s.%d.adaLN_modulation.0.weight", kind, i);
        B1(4 * D, "%s.%d.adaLN_modulation.0.bias", kind, i);
    }
    static const char *const proj[] = {"to_q", "to_k", "to_v", "to_out.0"};
    for (int k = 0; k < 4; k++)
        W2(D, D, "%s.%d.attention.%s.weight", kind, i, proj[k]);
    N1(hd, "%s.%d.attention.norm_q.weight", kind, i);
    N1(hd, "%s.%d.attention.norm_k.weight", kind, i);
    static const char *const norms[] = {"attention_norm1", "attention_norm2", "ffn_norm1",
                                        "ffn_norm2"};
    for (int k = 0; k < 4; k++)
        N1(D, "%s.%d.%s.weight", kind, i, norms[k]);
    W2(Fz, D, "%s.%d.feed_forward.w1.weight", kind, i);
    W2(D, Fz, "%s.%d.feed_forward.w2.weight", kind, i);
    W2(Fz, D, "%s.%d.feed_forward.w3.weight", kind, i);
}

void kiln_arch_zimage(kiln_arch_list *l, const kiln_zimage_dims *d)
{
    int64_t D = d->dim, A = D < 256 ? D : 256, hd = D / d->heads;
    int64_t patch_in = (int64_t)d->in_channels * d->patch * d->patch * d->f_patch;
    int p = d->patch, fp = d->f_patch;
    W2(D, patch_in, "all_x_embedder.%d-%d.weight", p, fp);
    B1(D, "all_x_embedder.%d-%d.bias", p, fp);
    W2(D, A, "all_final_layer.%d-%d.adaLN_modulation.1.weight", p, fp);
    B1(D, "all_final_layer.%d-%d.adaLN_modulation.1.bias", p, fp);
    W2(patch_in, D, "all_final_layer.%d-%d.linear.weight", p, fp);
    B1(patch_in, "all_final_layer.%d-%d.linear.bias", p, fp);
    /* TimestepEmbedder(min(dim, 256), mid_size=1024) over 256 frequencies. */
    W2(1024, 256, "t_embedder.mlp.0.weight");
    B1(1024, "t_embedder.mlp.0.bias");
    W2(A, 1024, "t_embedder.mlp.2.weight");
    B1(A, "t_embedder.mlp.2.bias");
    N1(d->cap_feat_dim, "cap_embedder.0.weight");
    W2(D, d->cap_feat_dim, "cap_embedder.1.weight");
    B1(D, "cap_embedder.1.bias");
    W2(1, D, "x_pad_token");
    W2(1, D, "cap_pad_token");
    for (int i = 0; i < d->refiner_layers; i++)
        zimage_block(l, "noise_refiner", i, D, A, hd, 1);
    for (int i = 0; i < d->refiner_layers; i++)
        zimage_block(l, "context_refiner", i, D, A, hd, 0);
    for (int i = 0; i < d->layers; i++)
        zimage_block(l, "layers", i, D, A, hd, 1);
}

static void conv(kiln_arch_list *l, int64_t cout, int64_t cin, int64_t k, const char *prefix)
{
    W4(cout, cin, k, k, "%s.weight", prefix);
    B1(cout, "%s.bias", prefix);
}

static void group_norm(kiln_arch_list *l, int64_t c, const char *prefix)
{
    N1(c, "%s.weight", prefix);
    B1(c, "%s.bias", prefix);
}

static void resnet(kiln_arch_list *l, const char *p, int64_t cin, int64_t cout)
{
    char n[128];
    snprintf(n, sizeof n, "%s.norm1", p), group_norm(l, cin, n);
    snprintf(n, sizeof n, "%s.conv1", p), conv(l, cout, cin, 3, n);
    snprintf(n, sizeof n, "%s.norm2", p), group_norm(l, cout, n);
    snprintf(n, sizeof n, "%s.conv2", p), conv(l, cout, cout, 3, n);
    if (cin != cout)
        snprintf(n, sizeof n, "%s.conv_shortcut", p), conv(l, cout, cin, 1, n);
}

static void mid_block(kiln_arch_list *l, const char *p, int64_t c)
{
    char n[128];
    for (int r = 0; r < 2; r++)
        snprintf(n, sizeof n, "%s.resnets.%d", p, r), resnet(l, n, c, c);
    snprintf(n, sizeof n, "%s.attentions.0.group_norm", p), group_norm(l, c, n);
    static const char *const proj[] = {"to_q", "to_k", "to_v", "to_out.0"};
    for (int k = 0; k < 4; k++) {
        W2(c, c, "%s.attentions.0.%s.weight", p, proj[k]);
        B1(c, "%s.attentions.0.%s.bias", p, proj[k]);
    }
}

void kiln_arch_vae(kiln_arch_list *l, const kiln_vae_dims *d)
{
    const int *ch = d->channels;
    int64_t z = d->latent;
    char n[128];
    conv(l, ch[0], 3, 3, "encoder.conv_in");
    for (int b = 0; b < 4; b++) {
        for (int r = 0; r < d->layers_per_block; r++) {
            snprintf(n, sizeof n, "encoder.down_blocks.%d.resnets.%d", b, r);
            resnet(l, n, r ? ch[b] : ch[b ? b - 1 : 0], ch[b]);
        }
        if (b < 3) {
            snprintf(n, sizeof n, "encoder.down_blocks.%d.downsamplers.0.conv", b);
            conv(l, ch[b], ch[b], 3, n);
        }
    }
    mid_block(l, "encoder.mid_block", ch[3]);
    group_norm(l, ch[3], "encoder.conv_norm_out");
    conv(l, 2 * z, ch[3], 3, "encoder.conv_out");

    conv(l, ch[3], z, 3, "decoder.conv_in");
    mid_block(l, "decoder.mid_block", ch[3]);
    int64_t prev = ch[3];
    for (int b = 0; b < 4; b++) {
        int64_t out = ch[3 - b];
        for (int r = 0; r <= d->layers_per_block; r++) {
            snprintf(n, sizeof n, "decoder.up_blocks.%d.resnets.%d", b, r);
            resnet(l, n, r ? out : prev, out);
        }
        if (b < 3) {
            snprintf(n, sizeof n, "decoder.up_blocks.%d.upsamplers.0.conv", b);
            conv(l, out, out, 3, n);
        }
        prev = out;
    }
    group_norm(l, ch[0], "decoder.conv_norm_out");
    conv(l, 3, ch[0], 3, "decoder.conv_out");

    if (d->flux2) {
        conv(l, 2 * z, 2 * z, 1, "quant_conv");
        conv(l, z, z, 1, "post_quant_conv");
        add(l, KILN_INIT_MEAN, 1, (int64_t[]){4 * z}, "bn.running_mean");
        add(l, KILN_INIT_VAR, 1, (int64_t[]){4 * z}, "bn.running_var");
        add(l, KILN_INIT_ZERO, 0, (int64_t[]){0}, "bn.num_batches_tracked");
    }
}
