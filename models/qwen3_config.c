/* text_encoder/config.json -> kiln_qwen3_config (transformers Qwen3Config). */
#include "qwen3.h"

#include <string.h>

#include "common/json.h"

/* Sizes beyond this are a corrupt file, not a model (Qwen3-235B has H 4096,
 * I 12288); the bound keeps every product below in int64 range. */
#define QWEN3_MAX_DIM (1 << 20)

static kiln_status positive(const char *key, int64_t v, kiln_err *err)
{
    if (v < 1 || v > QWEN3_MAX_DIM)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "text_encoder/config.json: %s = %lld is out of range", key,
                            (long long)v);
    return KILN_OK;
}

/* An optional string key: *out is NULL when absent or null. */
static kiln_status opt_string(const cJSON *obj, const char *key, const char **out, kiln_err *err)
{
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (!item || cJSON_IsNull(item))
        return KILN_OK;
    *out = kiln_json_string(obj, key, 1, err);
    return *out ? KILN_OK : err->code;
}

/* transformers 5 moved rope_theta into rope_parameters; older configs keep it
 * at the top level.  Qwen3Config's default is 10000 when neither is given. */
static kiln_status parse_rope(const cJSON *cfg, kiln_qwen3_config *out, kiln_err *err)
{
    const cJSON *rp = cJSON_GetObjectItemCaseSensitive(cfg, "rope_parameters");
    if (rp && !cJSON_IsNull(rp)) {
        if (!cJSON_IsObject(rp))
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "text_encoder/config.json: rope_parameters is not an object");
        const char *type;
        if (opt_string(rp, "rope_type", &type, err))
            return err->code;
        if (type && strcmp(type, "default"))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                                "text_encoder: rope_type '%s' is not supported (only default)",
                                type);
        if (cJSON_GetObjectItemCaseSensitive(rp, "rope_theta"))
            return kiln_json_double(rp, "rope_theta", 1, 0, &out->rope_theta, err);
    }
    return kiln_json_double(cfg, "rope_theta", 0, 10000.0, &out->rope_theta, err);
}

static kiln_status check_unsupported(const cJSON *cfg, kiln_err *err)
{
    int flag;
    if (kiln_json_bool(cfg, "attention_bias", 0, 0, &flag, err))
        return err->code;
    if (flag)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "text_encoder: attention_bias = true is not supported");
    if (kiln_json_bool(cfg, "use_sliding_window", 0, 0, &flag, err))
        return err->code;
    if (flag)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "text_encoder: use_sliding_window = true is not supported");
    const char *act;
    if (opt_string(cfg, "hidden_act", &act, err))
        return err->code;
    if (act && strcmp(act, "silu"))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "text_encoder: hidden_act '%s' is not supported (only silu)", act);
    return KILN_OK;
}

kiln_status kiln_qwen3_config_parse(const cJSON *cfg, kiln_qwen3_config *out, kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(cfg))
        return kiln_err_set(err, KILN_ERR_FORMAT, "text_encoder/config.json is not an object");
    if (kiln_json_int(cfg, "hidden_size", KILN_JSON_REQUIRED, &out->hidden_size, err) ||
        kiln_json_int(cfg, "num_hidden_layers", KILN_JSON_REQUIRED, &out->num_hidden_layers,
                      err) ||
        kiln_json_int(cfg, "num_attention_heads", KILN_JSON_REQUIRED,
                      &out->num_attention_heads, err) ||
        kiln_json_int(cfg, "intermediate_size", KILN_JSON_REQUIRED, &out->intermediate_size,
                      err) ||
        kiln_json_int(cfg, "vocab_size", KILN_JSON_REQUIRED, &out->vocab_size, err))
        return err->code;
    /* Qwen3Config: num_key_value_heads None -> num_attention_heads, head_dim
     * None -> hidden_size / num_attention_heads. */
    if (positive("num_attention_heads", out->num_attention_heads, err) ||
        positive("hidden_size", out->hidden_size, err))
        return err->code;
    if (kiln_json_int(cfg, "num_key_value_heads", out->num_attention_heads,
                      &out->num_key_value_heads, err) ||
        kiln_json_int(cfg, "head_dim", out->hidden_size / out->num_attention_heads,
                      &out->head_dim, err) ||
        kiln_json_double(cfg, "rms_norm_eps", 0, 1e-6, &out->rms_norm_eps, err) ||
        kiln_json_bool(cfg, "tie_word_embeddings", 0, 0, &out->tie_word_embeddings, err) ||
        parse_rope(cfg, out, err) || check_unsupported(cfg, err))
        return err->code;
    if (positive("num_hidden_layers", out->num_hidden_layers, err) ||
        positive("num_key_value_heads", out->num_key_value_heads, err) ||
        positive("head_dim", out->head_dim, err) ||
        positive("intermediate_size", out->intermediate_size, err) ||
        positive("vocab_size", out->vocab_size, err))
        return err->code;
    if (out->num_attention_heads % out->num_key_value_heads)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "text_encoder/config.json: num_attention_heads (%lld) is not a "
                            "multiple of num_key_value_heads (%lld)",
                            (long long)out->num_attention_heads,
                            (long long)out->num_key_value_heads);
    if (out->head_dim % 2)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "text_encoder/config.json: head_dim (%lld) must be even for RoPE",
                            (long long)out->head_dim);
    if (!(out->rms_norm_eps > 0) || !(out->rope_theta > 1))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "text_encoder/config.json: rms_norm_eps and rope_theta must be "
                            "positive (rope_theta > 1)");
    return KILN_OK;
}
