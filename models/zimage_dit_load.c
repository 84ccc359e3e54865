/* Z-Image DiT config parsing, weight loading and teardown
 * (spec/z-image-turbo.md §1 and §5). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "dit_util.h"
#include "zimage_dit_internal.h"

/* diffusers ADALN_EMBED_DIM: the adaLN input is min(dim, 256) wide. */
#define ADALN_MAX 256
/* TimestepEmbedder(mid_size=1024) and its 256 sinusoid channels. */
#define T_HIDDEN 1024
#define T_FREQ 256

static kiln_status single_int(const cJSON *cfg, const char *key, int64_t def, int64_t *out,
                              kiln_err *err)
{
    int64_t v[4];
    int n = 0;
    if (kiln_json_int_array(cfg, key, 0, v, 4, &n, err))
        return kiln_err_wrap(err, "transformer/config.json");
    if (n == 0) {
        *out = def;
        return KILN_OK;
    }
    if (n != 1)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: %s has %d entries; one patch size is "
                            "supported", key, n);
    *out = v[0];
    return KILN_OK;
}

static kiln_status axes(const cJSON *cfg, const char *key, const int64_t *def, int64_t *out,
                        kiln_err *err)
{
    int64_t v[8];
    int n = 0;
    if (kiln_json_int_array(cfg, key, 0, v, 8, &n, err))
        return kiln_err_wrap(err, "transformer/config.json");
    if (n == 0) {
        memcpy(out, def, KILN_ZIMAGE_ROPE_AXES * sizeof *out);
        return KILN_OK;
    }
    if (n != KILN_ZIMAGE_ROPE_AXES)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: %s has %d axes, expected %d", key, n,
                            KILN_ZIMAGE_ROPE_AXES);
    for (int a = 0; a < n; a++) {
        if (v[a] < 1 || v[a] > KILN_DIT_CFG_MAX)
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "transformer/config.json: %s[%d] = %lld is out of range", key, a,
                                (long long)v[a]);
        out[a] = v[a];
    }
    return KILN_OK;
}

kiln_status kiln_zimage_dit_config_parse(const cJSON *cfg, kiln_zimage_dit_config *out,
                                         kiln_err *err)
{
    kiln_zimage_dit_config c = {0};
    int64_t f_patch = 0, kv_heads = 0;
    static const int64_t def_dims[] = {32, 48, 48}, def_lens[] = {1024, 512, 512};
    if (kiln_dit_cfg_int(cfg, "dim", KILN_JSON_REQUIRED, &c.dim, err) ||
        kiln_dit_cfg_int(cfg, "n_layers", KILN_JSON_REQUIRED, &c.n_layers, err) ||
        kiln_dit_cfg_int(cfg, "n_refiner_layers", 2, &c.n_refiner_layers, err) ||
        kiln_dit_cfg_int(cfg, "n_heads", KILN_JSON_REQUIRED, &c.n_heads, err) ||
        kiln_dit_cfg_int(cfg, "n_kv_heads", 0, &kv_heads, err) ||
        kiln_dit_cfg_int(cfg, "cap_feat_dim", KILN_JSON_REQUIRED, &c.cap_feat_dim, err) ||
        kiln_dit_cfg_int(cfg, "in_channels", KILN_JSON_REQUIRED, &c.in_channels, err))
        return err->code;
    if (single_int(cfg, "all_patch_size", 2, &c.patch, err) ||
        single_int(cfg, "all_f_patch_size", 1, &f_patch, err) ||
        axes(cfg, "axes_dims", def_dims, c.axes_dims, err) ||
        axes(cfg, "axes_lens", def_lens, c.axes_lens, err))
        return err->code;
    if (kiln_json_double(cfg, "norm_eps", 0, 1e-5, &c.norm_eps, err) ||
        kiln_json_double(cfg, "rope_theta", 0, 256.0, &c.rope_theta, err) ||
        kiln_json_double(cfg, "t_scale", 0, 1000.0, &c.t_scale, err) ||
        kiln_json_bool(cfg, "qk_norm", 0, 1, &c.qk_norm, err))
        return kiln_err_wrap(err, "transformer/config.json");
    const cJSON *siglip = cJSON_GetObjectItemCaseSensitive(cfg, "siglip_feat_dim");
    if (siglip && !cJSON_IsNull(siglip))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: siglip_feat_dim is set (the omni mode is "
                            "not supported)");
    if (f_patch != 1)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: all_f_patch_size %lld (only 1 is supported)",
                            (long long)f_patch);
    if (c.patch < 1 || c.patch > 16 || c.dim < 1 || c.n_heads < 1 || c.dim % c.n_heads ||
        c.cap_feat_dim < 1 || c.in_channels < 1 || c.dim < 3)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: dim, n_heads (dividing dim), cap_feat_dim, "
                            "in_channels and all_patch_size must be positive");
    c.head_dim = c.dim / c.n_heads;
    int64_t rope_dim = 0;
    for (int a = 0; a < KILN_ZIMAGE_ROPE_AXES; a++) {
        if (c.axes_dims[a] % 2)
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "transformer/config.json: axes_dims[%d] = %lld is odd", a,
                                (long long)c.axes_dims[a]);
        rope_dim += c.axes_dims[a];
    }
    if (rope_dim != c.head_dim)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: axes_dims sum to %lld, but the head dim "
                            "(dim / n_heads) is %lld", (long long)rope_dim, (long long)c.head_dim);
    /* diffusers ignores n_kv_heads (k and v have all heads); a config that
     * asks for grouped heads describes another model. */
    if (kv_heads && kv_heads != c.n_heads)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "transformer/config.json: n_kv_heads %lld differs from n_heads %lld",
                            (long long)kv_heads, (long long)c.n_heads);
    if (!(c.norm_eps > 0 && c.norm_eps < 1) || !(c.rope_theta > 0) || !(c.t_scale > 0))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: norm_eps, rope_theta or t_scale out of range");
    c.patch_features = c.in_channels * c.patch * c.patch;
    c.adaln_dim = c.dim < ADALN_MAX ? c.dim : ADALN_MAX;
    /* diffusers FeedForward(dim, int(dim / 3 * 8)): Python float, truncated. */
    c.ffn_hidden = (int64_t)((double)c.dim / 3.0 * 8.0);
    c.t_hidden = T_HIDDEN;
    *out = c;
    return KILN_OK;
}

/* --- weights --------------------------------------------------------------- */

static kiln_status load_block(kiln_dit_loader *l, const kiln_zimage_dit_config *c,
                              const char *kind, int i, int modulated, zimage_block_w *w)
{
    const int64_t D = c->dim, F = c->ffn_hidden, d = c->head_dim, A = c->adaln_dim;
    char p[64], n[160], attn[96], ff[96];
    snprintf(p, sizeof p, "%s.%d", kind, i);
    snprintf(attn, sizeof attn, "%s.attention", p);
    snprintf(ff, sizeof ff, "%s.feed_forward", p);
#define NAME(suffix) (snprintf(n, sizeof n, "%s.%s", p, suffix), n)
    if (kiln_dit_load_fused(l, &w->qkv, D, D, attn, (const char *const[]){"to_q", "to_k", "to_v"},
                            3) ||
        kiln_dit_load2(l, &w->out, D, D, NAME("attention.to_out.0.weight")) ||
        (c->qk_norm && (kiln_dit_load1(l, &w->norm_q, d, NAME("attention.norm_q.weight")) ||
                        kiln_dit_load1(l, &w->norm_k, d, NAME("attention.norm_k.weight")))) ||
        kiln_dit_load1(l, &w->norm1, D, NAME("attention_norm1.weight")) ||
        kiln_dit_load1(l, &w->norm2, D, NAME("attention_norm2.weight")) ||
        kiln_dit_load1(l, &w->ffn_norm1, D, NAME("ffn_norm1.weight")) ||
        kiln_dit_load1(l, &w->ffn_norm2, D, NAME("ffn_norm2.weight")) ||
        kiln_dit_load_fused(l, &w->w13, F, D, ff, (const char *const[]){"w1", "w3"}, 2) ||
        kiln_dit_load2(l, &w->w2, D, F, NAME("feed_forward.w2.weight")))
        return l->err->code;
    if (modulated && (kiln_dit_load2(l, &w->ada, 4 * D, A, NAME("adaLN_modulation.0.weight")) ||
                      kiln_dit_load1(l, &w->ada_b, 4 * D, NAME("adaLN_modulation.0.bias"))))
        return l->err->code;
#undef NAME
    return KILN_OK;
}

/* A (1, D) pad token repeated into a (1, 32, D) block. */
static kiln_status load_pad(kiln_dit_loader *l, kiln_tensor *out, int64_t D, const char *name)
{
    kiln_backend *be = l->be;
    kiln_tensor tok;
    if (kiln_dit_load2(l, &tok, 1, D, name))
        return l->err->code;
    kiln_tensor_set_shape(&tok, tok.dtype, 3, (int64_t[]){1, 1, D});
    kiln_be_alloc(be, out, be->act_dtype, 3, (int64_t[]){1, KILN_ZIMAGE_SEQ_MULTIPLE, D});
    for (int r = 0; r < KILN_ZIMAGE_SEQ_MULTIPLE; r++)
        kiln_be_copy_rows(be, out, r, &tok, 0, 1);
    kiln_be_free(be, &tok);
    if (kiln_be_check(be, l->err))
        return kiln_err_wrap(l->err, "placing '%s'", name);
    return KILN_OK;
}

static kiln_status load_all(kiln_zimage_dit *m, const kiln_st *st, kiln_err *err)
{
    const kiln_zimage_dit_config *c = &m->cfg;
    const int64_t D = c->dim, A = c->adaln_dim, P = c->patch_features;
    kiln_dit_loader l = {m->be, st, err};
    char xe[64], fl[64], n[128];
    snprintf(xe, sizeof xe, "all_x_embedder.%lld-1", (long long)c->patch);
    snprintf(fl, sizeof fl, "all_final_layer.%lld-1", (long long)c->patch);
#define NAME(p, suffix) (snprintf(n, sizeof n, "%s.%s", p, suffix), n)
    if (kiln_dit_load2(&l, &m->x_emb, D, P, NAME(xe, "weight")) ||
        kiln_dit_load1(&l, &m->x_emb_b, D, NAME(xe, "bias")) ||
        kiln_dit_load1(&l, &m->cap_norm, c->cap_feat_dim, "cap_embedder.0.weight") ||
        kiln_dit_load2(&l, &m->cap_emb, D, c->cap_feat_dim, "cap_embedder.1.weight") ||
        kiln_dit_load1(&l, &m->cap_emb_b, D, "cap_embedder.1.bias") ||
        kiln_dit_load2(&l, &m->t_lin1, c->t_hidden, T_FREQ, "t_embedder.mlp.0.weight") ||
        kiln_dit_load1(&l, &m->t_lin1_b, c->t_hidden, "t_embedder.mlp.0.bias") ||
        kiln_dit_load2(&l, &m->t_lin2, A, c->t_hidden, "t_embedder.mlp.2.weight") ||
        kiln_dit_load1(&l, &m->t_lin2_b, A, "t_embedder.mlp.2.bias") ||
        kiln_dit_load2(&l, &m->final_ada, D, A, NAME(fl, "adaLN_modulation.1.weight")) ||
        kiln_dit_load1(&l, &m->final_ada_b, D, NAME(fl, "adaLN_modulation.1.bias")) ||
        kiln_dit_load2(&l, &m->final_lin, P, D, NAME(fl, "linear.weight")) ||
        kiln_dit_load1(&l, &m->final_lin_b, P, NAME(fl, "linear.bias")) ||
        load_pad(&l, &m->x_pad, D, "x_pad_token") || load_pad(&l, &m->cap_pad, D, "cap_pad_token"))
        return err->code;
#undef NAME
    for (int i = 0; i < c->n_refiner_layers; i++)
        if (load_block(&l, c, "noise_refiner", i, 1, &m->noise_ref[i]) ||
            load_block(&l, c, "context_refiner", i, 0, &m->ctx_ref[i]))
            return err->code;
    for (int i = 0; i < c->n_layers; i++)
        if (load_block(&l, c, "layers", i, 1, &m->layers[i]))
            return err->code;
    return KILN_OK;
}

kiln_zimage_dit *kiln_zimage_dit_load(kiln_backend *be, const kiln_checkpoint *ck, kiln_err *err)
{
    const cJSON *cfg = kiln_checkpoint_config(ck, "transformer", err);
    if (!cfg)
        return NULL;
    kiln_zimage_dit *m = calloc(1, sizeof *m);
    if (!m) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    m->be = be;
    if (kiln_zimage_dit_config_parse(cfg, &m->cfg, err))
        goto fail;
    m->noise_ref = calloc((size_t)m->cfg.n_refiner_layers + 1, sizeof *m->noise_ref);
    m->ctx_ref = calloc((size_t)m->cfg.n_refiner_layers + 1, sizeof *m->ctx_ref);
    m->layers = calloc((size_t)m->cfg.n_layers + 1, sizeof *m->layers);
    if (!m->noise_ref || !m->ctx_ref || !m->layers) {
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
    kiln_zimage_dit_destroy(m);
    return NULL;
}

void kiln_zimage_dit_destroy(kiln_zimage_dit *m)
{
    if (!m)
        return;
    kiln_backend *be = m->be;
    zimage_replay_release(m);
    kiln_tensor *top[] = {&m->x_emb,     &m->x_emb_b,     &m->cap_norm,  &m->cap_emb,
                          &m->cap_emb_b, &m->t_lin1,      &m->t_lin1_b,  &m->t_lin2,
                          &m->t_lin2_b,  &m->final_ada,   &m->final_ada_b, &m->final_lin,
                          &m->final_lin_b, &m->x_pad,     &m->cap_pad,   &m->rope_cos,
                          &m->rope_sin};
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        kiln_be_free(be, top[i]);
    kiln_dit_free_blocks(be, m->noise_ref, m->cfg.n_refiner_layers, sizeof *m->noise_ref);
    kiln_dit_free_blocks(be, m->ctx_ref, m->cfg.n_refiner_layers, sizeof *m->ctx_ref);
    kiln_dit_free_blocks(be, m->layers, m->cfg.n_layers, sizeof *m->layers);
    kiln_arena_destroy(m->fwd);
    kiln_arena_destroy(m->blk);
    free(m->rope_caps);
    free(m->host);
    free(m);
}

kiln_status kiln_zimage_dit_quantize_fp8(kiln_zimage_dit *m, int *converted, kiln_err *err)
{
    kiln_backend *be = m->be;
    zimage_block_w *const sets[] = {m->noise_ref, m->ctx_ref, m->layers};
    const int64_t counts[] = {m->cfg.n_refiner_layers, m->cfg.n_refiner_layers, m->cfg.n_layers};
    int n = 0;
    for (int s = 0; s < 3; s++)
        for (int64_t i = 0; i < counts[s] && !be->error.code; i++) {
            zimage_block_w *w = &sets[s][i];
            kiln_tensor *const ws[] = {&w->qkv, &w->out, &w->w13, &w->w2};
            kiln_dit_quantize_fp8(be, ws, 4, &n);
        }
    if (converted)
        *converted = n;
    if (kiln_be_check(be, err))
        return kiln_err_wrap(err, "zimage dit: quantising the block weights to fp8");
    return KILN_OK;
}

const kiln_zimage_dit_config *kiln_zimage_dit_get_config(const kiln_zimage_dit *m)
{
    return &m->cfg;
}

size_t kiln_zimage_dit_scratch_bytes(const kiln_zimage_dit *m)
{
    return kiln_arena_capacity(m->fwd) + kiln_arena_capacity(m->blk);
}
