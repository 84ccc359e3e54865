/* FLUX.2 DiT config parsing, weight loading and teardown
 * (spec/flux2-klein.md §1 and §7). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "flux2_dit_internal.h"
#include "dit_util.h"

kiln_status kiln_flux2_dit_config_parse(const cJSON *cfg, kiln_flux2_dit_config *out,
                                        kiln_err *err)
{
    kiln_flux2_dit_config c = {0};
    int64_t patch = 0, out_ch = 0;
    double mlp_ratio = 0;
    int guidance = 0;
    if (kiln_dit_cfg_int(cfg, "num_layers", KILN_JSON_REQUIRED, &c.num_layers, err) ||
        kiln_dit_cfg_int(cfg, "num_single_layers", KILN_JSON_REQUIRED, &c.num_single_layers, err) ||
        kiln_dit_cfg_int(cfg, "num_attention_heads", KILN_JSON_REQUIRED, &c.num_heads, err) ||
        kiln_dit_cfg_int(cfg, "attention_head_dim", KILN_JSON_REQUIRED, &c.head_dim, err) ||
        kiln_dit_cfg_int(cfg, "joint_attention_dim", KILN_JSON_REQUIRED, &c.joint_dim, err) ||
        kiln_dit_cfg_int(cfg, "in_channels", KILN_JSON_REQUIRED, &c.in_channels, err) ||
        kiln_dit_cfg_int(cfg, "out_channels", 0, &out_ch, err) ||
        kiln_dit_cfg_int(cfg, "patch_size", 1, &patch, err) ||
        kiln_dit_cfg_int(cfg, "timestep_guidance_channels", 256, &c.time_channels, err))
        return err->code;
    if (kiln_json_double(cfg, "mlp_ratio", 0, 3.0, &mlp_ratio, err) ||
        kiln_json_double(cfg, "rope_theta", 0, 2000.0, &c.rope_theta, err) ||
        kiln_json_double(cfg, "eps", 0, 1e-6, &c.eps, err) ||
        kiln_json_bool(cfg, "guidance_embeds", 0, 0, &guidance, err))
        return kiln_err_wrap(err, "transformer/config.json");
    int naxes = 0;
    int64_t axes[8];
    if (kiln_json_int_array(cfg, "axes_dims_rope", 0, axes, 8, &naxes, err))
        return kiln_err_wrap(err, "transformer/config.json");
    if (naxes == 0) {
        naxes = KILN_FLUX2_ROPE_AXES;
        for (int a = 0; a < naxes; a++)
            axes[a] = 32;
    }

    if (guidance)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: guidance_embeds is true; FLUX.2 klein "
                            "checkpoints have no guidance embedder");
    if (patch != 1)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: patch_size %lld (only 1 is supported)",
                            (long long)patch);
    if (naxes != KILN_FLUX2_ROPE_AXES)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: axes_dims_rope has %d axes, expected %d",
                            naxes, KILN_FLUX2_ROPE_AXES);
    int64_t rope_dim = 0;
    for (int a = 0; a < naxes; a++) {
        if (axes[a] <= 0 || axes[a] % 2 || axes[a] > KILN_DIT_CFG_MAX)
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "transformer/config.json: axes_dims_rope[%d] = %lld must be a "
                                "positive even number", a, (long long)axes[a]);
        c.axes_dims[a] = axes[a];
        rope_dim += axes[a];
    }
    if (c.num_heads < 1 || c.head_dim < 2 || c.joint_dim < 1 || c.in_channels < 1 ||
        c.time_channels < 2 || c.time_channels % 2)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: heads, head dim, joint_attention_dim, "
                            "in_channels and an even timestep_guidance_channels must be positive");
    if (rope_dim != c.head_dim)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: axes_dims_rope sums to %lld, but "
                            "attention_head_dim is %lld", (long long)rope_dim,
                            (long long)c.head_dim);
    if (!(mlp_ratio > 0 && mlp_ratio <= 64) || !(c.rope_theta > 0) || !(c.eps > 0 && c.eps < 1))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: mlp_ratio, rope_theta or eps out of range");
    c.hidden = c.num_heads * c.head_dim;
    /* diffusers: int(dim * mlp_ratio), truncating. */
    c.mlp_hidden = (int64_t)((double)c.hidden * mlp_ratio);
    c.out_channels = out_ch ? out_ch : c.in_channels;
    if (c.mlp_hidden < 1)
        return kiln_err_set(err, KILN_ERR_FORMAT, "transformer/config.json: mlp_ratio too small");
    *out = c;
    return KILN_OK;
}

/* --- weights --------------------------------------------------------------- */

typedef kiln_dit_loader loader;

static kiln_status load2(loader *l, kiln_tensor *t, int64_t rows, int64_t cols, const char *name)
{
    return kiln_dit_load2(l, t, rows, cols, name);
}

static kiln_status load1(loader *l, kiln_tensor *t, int64_t n, const char *name)
{
    return kiln_dit_load1(l, t, n, name);
}

static kiln_status load_qkv(loader *l, kiln_tensor *t, int64_t D, const char *prefix,
                            const char *const names[3])
{
    return kiln_dit_load_fused(l, t, D, D, prefix, names, 3);
}

static kiln_status load_double(loader *l, const kiln_flux2_dit_config *c, int i,
                               flux2_double_w *w)
{
    const int64_t D = c->hidden, F = c->mlp_hidden, d = c->head_dim;
    char p[96], n[160];
    snprintf(p, sizeof p, "transformer_blocks.%d", i);
#define NAME(suffix) (snprintf(n, sizeof n, "%s.%s", p, suffix), n)
    char attn[112];
    snprintf(attn, sizeof attn, "%s.attn", p);
    if (load_qkv(l, &w->qkv, D, attn, (const char *const[]){"to_q", "to_k", "to_v"}) ||
        load_qkv(l, &w->add_qkv, D, attn,
                 (const char *const[]){"add_q_proj", "add_k_proj", "add_v_proj"}) ||
        load2(l, &w->out, D, D, NAME("attn.to_out.0.weight")) ||
        load2(l, &w->add_out, D, D, NAME("attn.to_add_out.weight")) ||
        load1(l, &w->norm_q, d, NAME("attn.norm_q.weight")) ||
        load1(l, &w->norm_k, d, NAME("attn.norm_k.weight")) ||
        load1(l, &w->norm_add_q, d, NAME("attn.norm_added_q.weight")) ||
        load1(l, &w->norm_add_k, d, NAME("attn.norm_added_k.weight")) ||
        load2(l, &w->ff_in, 2 * F, D, NAME("ff.linear_in.weight")) ||
        load2(l, &w->ff_out, D, F, NAME("ff.linear_out.weight")) ||
        load2(l, &w->ffc_in, 2 * F, D, NAME("ff_context.linear_in.weight")) ||
        load2(l, &w->ffc_out, D, F, NAME("ff_context.linear_out.weight")))
        return l->err->code;
#undef NAME
    return KILN_OK;
}

/* to_qkv_mlp_proj is stored fused (rows q, k, v, gate, up); it is split into
 * an attention part and an MLP part so the SwiGLU reads the GEMM output
 * directly instead of a column copy of its widest slice. */
static kiln_status load_single(loader *l, const kiln_flux2_dit_config *c, int j,
                               flux2_single_w *w)
{
    const int64_t D = c->hidden, F = c->mlp_hidden, d = c->head_dim;
    kiln_backend *be = l->be;
    char n[160];
    snprintf(n, sizeof n, "single_transformer_blocks.%d.attn.to_qkv_mlp_proj.weight", j);
    kiln_tensor fused;
    if (load2(l, &fused, 3 * D + 2 * F, D, n))
        return l->err->code;
    kiln_tensor src = fused;
    kiln_tensor_set_shape(&src, fused.dtype, 3, (int64_t[]){1, 3 * D + 2 * F, D});
    kiln_tensor qkv3, mlp3;
    kiln_be_alloc(be, &w->qkv, be->act_dtype, 2, (int64_t[]){3 * D, D});
    kiln_be_alloc(be, &w->mlp_in, be->act_dtype, 2, (int64_t[]){2 * F, D});
    qkv3 = w->qkv;
    mlp3 = w->mlp_in;
    kiln_tensor_set_shape(&qkv3, w->qkv.dtype, 3, (int64_t[]){1, 3 * D, D});
    kiln_tensor_set_shape(&mlp3, w->mlp_in.dtype, 3, (int64_t[]){1, 2 * F, D});
    kiln_be_copy_rows(be, &qkv3, 0, &src, 0, 3 * D);
    kiln_be_copy_rows(be, &mlp3, 0, &src, 3 * D, 2 * F);
    kiln_be_free(be, &fused);
    if (kiln_be_check(be, l->err))
        return kiln_err_wrap(l->err, "splitting '%s'", n);
    snprintf(n, sizeof n, "single_transformer_blocks.%d.attn.to_out.weight", j);
    if (load2(l, &w->out, D, D + F, n))
        return l->err->code;
    snprintf(n, sizeof n, "single_transformer_blocks.%d.attn.norm_q.weight", j);
    if (load1(l, &w->norm_q, d, n))
        return l->err->code;
    snprintf(n, sizeof n, "single_transformer_blocks.%d.attn.norm_k.weight", j);
    return load1(l, &w->norm_k, d, n);
}

static kiln_status load_all(kiln_flux2_dit *m, const kiln_st *st, kiln_err *err)
{
    const kiln_flux2_dit_config *c = &m->cfg;
    const int64_t D = c->hidden;
    loader l = {m->be, st, err};
    /* A guidance embedder would be added to temb; klein has none, and
     * silently dropping one would give wrong images. */
    if (kiln_st_find(st, "time_guidance_embed.guidance_embedder.linear_1.weight"))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer has a guidance embedder (not a FLUX.2 klein model)");
    if (load2(&l, &m->x_embedder, D, c->in_channels, "x_embedder.weight") ||
        load2(&l, &m->context_embedder, D, c->joint_dim, "context_embedder.weight") ||
        load2(&l, &m->time_lin1, D, c->time_channels,
              "time_guidance_embed.timestep_embedder.linear_1.weight") ||
        load2(&l, &m->time_lin2, D, D, "time_guidance_embed.timestep_embedder.linear_2.weight") ||
        load2(&l, &m->mod_img, 6 * D, D, "double_stream_modulation_img.linear.weight") ||
        load2(&l, &m->mod_txt, 6 * D, D, "double_stream_modulation_txt.linear.weight") ||
        load2(&l, &m->mod_single, 3 * D, D, "single_stream_modulation.linear.weight") ||
        load2(&l, &m->norm_out, 2 * D, D, "norm_out.linear.weight") ||
        load2(&l, &m->proj_out, c->out_channels, D, "proj_out.weight"))
        return err->code;
    for (int i = 0; i < c->num_layers; i++)
        if (load_double(&l, c, i, &m->dbl[i]))
            return err->code;
    for (int j = 0; j < c->num_single_layers; j++)
        if (load_single(&l, c, j, &m->sgl[j]))
            return err->code;
    return KILN_OK;
}

kiln_flux2_dit *kiln_flux2_dit_load(kiln_backend *be, const kiln_checkpoint *ck, kiln_err *err)
{
    const cJSON *cfg = kiln_checkpoint_config(ck, "transformer", err);
    if (!cfg)
        return NULL;
    kiln_flux2_dit *m = calloc(1, sizeof *m);
    if (!m) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    m->be = be;
    if (kiln_flux2_dit_config_parse(cfg, &m->cfg, err))
        goto fail;
    m->dbl = calloc((size_t)m->cfg.num_layers + 1, sizeof *m->dbl);
    m->sgl = calloc((size_t)m->cfg.num_single_layers + 1, sizeof *m->sgl);
    if (!m->dbl || !m->sgl) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (kiln_dit_runtime_init(be, &m->fwd, &m->blk, &m->replay_enabled, err))
        goto fail;
    kiln_st *st = kiln_checkpoint_weights(ck, "transformer", err);
    if (!st)
        goto fail;
    kiln_status rc = load_all(m, st, err);
    kiln_st_close(st);
    if (rc)
        goto fail;
    return m;
fail:
    kiln_flux2_dit_destroy(m);
    return NULL;
}

void kiln_flux2_dit_destroy(kiln_flux2_dit *m)
{
    if (!m)
        return;
    kiln_backend *be = m->be;
    flux2_replay_release(m);
    kiln_tensor *top[] = {&m->x_embedder, &m->context_embedder, &m->time_lin1, &m->time_lin2,
                          &m->mod_img,    &m->mod_txt,          &m->mod_single, &m->norm_out,
                          &m->proj_out,   &m->rope_cos,         &m->rope_sin};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        kiln_be_free(be, top[i]);
    kiln_dit_free_blocks(be, m->dbl, m->cfg.num_layers, sizeof *m->dbl);
    kiln_dit_free_blocks(be, m->sgl, m->cfg.num_single_layers, sizeof *m->sgl);
    kiln_arena_destroy(m->fwd);
    kiln_arena_destroy(m->blk);
    free(m->rope_ids);
    free(m->host);
    free(m);
}

kiln_status kiln_flux2_dit_quantize_fp8(kiln_flux2_dit *m, int *converted, kiln_err *err)
{
    kiln_backend *be = m->be;
    int n = 0;
    for (int64_t i = 0; i < m->cfg.num_layers; i++) {
        flux2_double_w *w = &m->dbl[i];
        kiln_tensor *const ws[] = {&w->qkv, &w->add_qkv, &w->out,    &w->add_out,
                                   &w->ff_in, &w->ffc_in, &w->ff_out, &w->ffc_out};
        if (kiln_dit_quantize_fp8(be, ws, 8, &n))
            break;
    }
    for (int64_t j = 0; j < m->cfg.num_single_layers && !be->error.code; j++) {
        flux2_single_w *w = &m->sgl[j];
        kiln_tensor *const ws[] = {&w->qkv, &w->mlp_in, &w->out};
        if (kiln_dit_quantize_fp8(be, ws, 3, &n))
            break;
    }
    if (converted)
        *converted = n;
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "flux2 dit: quantising the block weights to fp8");
    return KILN_OK;
}

const kiln_flux2_dit_config *kiln_flux2_dit_get_config(const kiln_flux2_dit *m)
{
    return &m->cfg;
}

size_t kiln_flux2_dit_scratch_bytes(const kiln_flux2_dit *m)
{
    return kiln_arena_capacity(m->fwd) + kiln_arena_capacity(m->blk);
}
