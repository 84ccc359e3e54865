#include "vae_config.h"

#include <string.h>

#include "common/json.h"

#define LABEL "vae/config.json"

/* An optional array of block type names must name `want` for every block. */
static kiln_status check_block_types(const cJSON *json, const char *key, const char *want,
                                     int nblocks, kiln_err *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(json, key);
    if (!v || cJSON_IsNull(v))
        return KILN_OK;
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != nblocks)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": '%s' must list %d block types", key,
                            nblocks);
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsString(e))
            return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": '%s' must hold strings", key);
        if (strcmp(e->valuestring, want))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED, LABEL ": block type '%s' in '%s' is "
                                "not supported (only %s)", e->valuestring, key, want);
    }
    return KILN_OK;
}

static kiln_status parse_kind(const cJSON *json, vae_config *c, kiln_err *err)
{
    const char *cls = kiln_json_string(json, "_class_name", 1, err);
    if (!cls)
        return kiln_err_wrap(err, LABEL);
    if (!strcmp(cls, "AutoencoderKLFlux2"))
        c->kind = KILN_VAE_FLUX2;
    else if (!strcmp(cls, "AutoencoderKL"))
        c->kind = KILN_VAE_KL;
    else
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, LABEL ": VAE class '%s' is not supported "
                            "(AutoencoderKLFlux2 or AutoencoderKL)", cls);
    return KILN_OK;
}

static kiln_status parse_channels(const cJSON *json, vae_config *c, kiln_err *err)
{
    int64_t v;
    if (kiln_json_int(json, "norm_num_groups", 32, &v, err))
        return kiln_err_wrap(err, LABEL);
    if (v < 1 || v > 1024)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": norm_num_groups %lld out of range",
                            (long long)v);
    c->groups = (int)v;
    if (kiln_json_int_array(json, "block_out_channels", 1, c->channels, VAE_MAX_BLOCKS,
                            &c->nblocks, err))
        return kiln_err_wrap(err, LABEL);
    if (c->nblocks < 1)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": block_out_channels is empty");
    for (int i = 0; i < c->nblocks; i++)
        if (c->channels[i] < 1 || c->channels[i] > 8192 || c->channels[i] % c->groups)
            return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": block_out_channels[%d] = %lld "
                                "must be a positive multiple of norm_num_groups (%d)", i,
                                (long long)c->channels[i], c->groups);
    /* diffusers' AutoencoderKLFlux2 may decode with other channels than it
     * encodes; no published checkpoint does, so only the shared list is
     * implemented. */
    int64_t dec[VAE_MAX_BLOCKS];
    int ndec;
    if (kiln_json_int_array(json, "decoder_block_out_channels", 0, dec, VAE_MAX_BLOCKS, &ndec,
                            err))
        return kiln_err_wrap(err, LABEL);
    if (ndec && (ndec != c->nblocks || memcmp(dec, c->channels, sizeof(int64_t) * ndec)))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, LABEL ": decoder_block_out_channels "
                            "different from block_out_channels is not supported");

    if (kiln_json_int(json, "layers_per_block", KILN_JSON_REQUIRED, &v, err))
        return kiln_err_wrap(err, LABEL);
    if (v < 1 || v > VAE_MAX_LAYERS)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": layers_per_block %lld out of range "
                            "[1, %d]", (long long)v, VAE_MAX_LAYERS);
    c->layers = (int)v;
    if (kiln_json_int(json, "latent_channels", KILN_JSON_REQUIRED, &c->latent, err) ||
        kiln_json_int(json, "in_channels", 3, &c->in_channels, err) ||
        kiln_json_int(json, "out_channels", 3, &c->out_channels, err))
        return kiln_err_wrap(err, LABEL);
    if (c->latent < 1 || c->latent > 1024 || c->in_channels < 1 || c->in_channels > 64 ||
        c->out_channels < 1 || c->out_channels > 64)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": latent/in/out channel counts out of "
                            "range");
    return KILN_OK;
}

static kiln_status parse_latent_norm(const cJSON *json, vae_config *c, kiln_err *err)
{
    c->patch_h = c->patch_w = 0;
    c->bn_eps = 0;
    c->scaling = 1;
    c->shift = 0;
    if (c->kind == KILN_VAE_KL) {
        /* Defaults of diffusers' AutoencoderKL: 0.18215 and no shift. */
        if (kiln_json_double(json, "scaling_factor", 0, 0.18215, &c->scaling, err) ||
            kiln_json_double(json, "shift_factor", 0, 0.0, &c->shift, err))
            return kiln_err_wrap(err, LABEL);
        if (!(c->scaling != 0))
            return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": scaling_factor must not be 0");
        return KILN_OK;
    }
    if (kiln_json_double(json, "batch_norm_eps", 0, 1e-4, &c->bn_eps, err))
        return kiln_err_wrap(err, LABEL);
    if (!(c->bn_eps >= 0))
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": batch_norm_eps must be >= 0");
    int64_t patch[2];
    int n;
    if (kiln_json_int_array(json, "patch_size", 0, patch, 2, &n, err))
        return kiln_err_wrap(err, LABEL);
    if (n == 0)
        patch[0] = patch[1] = 2, n = 2;
    if (n != 2 || patch[0] < 1 || patch[1] < 1 || patch[0] > 8 || patch[1] > 8)
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": patch_size must be two sizes in "
                            "[1, 8]");
    c->patch_h = (int)patch[0];
    c->patch_w = (int)patch[1];
    return KILN_OK;
}

kiln_status vae_config_parse(const cJSON *json, vae_config *c, kiln_err *err)
{
    memset(c, 0, sizeof *c);
    if (!cJSON_IsObject(json))
        return kiln_err_set(err, KILN_ERR_FORMAT, LABEL ": not a JSON object");
    if (parse_kind(json, c, err) || parse_channels(json, c, err))
        return err->code;
    if (check_block_types(json, "down_block_types", "DownEncoderBlock2D", c->nblocks, err) ||
        check_block_types(json, "up_block_types", "UpDecoderBlock2D", c->nblocks, err))
        return err->code;
    const cJSON *actv = cJSON_GetObjectItemCaseSensitive(json, "act_fn");
    const char *act = kiln_json_string(json, "act_fn", 0, err);
    if (actv && !cJSON_IsNull(actv) && !act)
        return kiln_err_wrap(err, LABEL);
    if (act && strcmp(act, "silu"))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, LABEL ": act_fn '%s' is not supported "
                            "(silu)", act);
    if (kiln_json_bool(json, "mid_block_add_attention", 0, 1, &c->mid_attn, err) ||
        kiln_json_bool(json, "use_quant_conv", 0, 1, &c->quant, err) ||
        kiln_json_bool(json, "use_post_quant_conv", 0, 1, &c->post_quant, err))
        return kiln_err_wrap(err, LABEL);
    return parse_latent_norm(json, c, err);
}
