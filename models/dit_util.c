/* Shared DiT helpers (dit_util.h). */
#include "dit_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/fp8.h"
#include "common/json.h"
#include "weights.h"

kiln_status kiln_dit_cfg_int(const cJSON *cfg, const char *key, int64_t def, int64_t *out,
                             kiln_err *err)
{
    if (kiln_json_int(cfg, key, def, out, err))
        return kiln_err_wrap(err, "transformer/config.json");
    if (*out < 0 || *out > KILN_DIT_CFG_MAX)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "transformer/config.json: %s = %lld is out of range", key,
                            (long long)*out);
    return KILN_OK;
}

kiln_status kiln_dit_load2(kiln_dit_loader *l, kiln_tensor *t, int64_t rows, int64_t cols,
                           const char *name)
{
    return kiln_weight_load(l->be, l->st, t, 2, (int64_t[]){rows, cols}, l->err, "%s", name);
}

kiln_status kiln_dit_load1(kiln_dit_loader *l, kiln_tensor *t, int64_t n, const char *name)
{
    return kiln_weight_load(l->be, l->st, t, 1, (int64_t[]){n}, l->err, "%s", name);
}

#define FUSED_MAX 4

kiln_status kiln_dit_load_fused(kiln_dit_loader *l, kiln_tensor *t, int64_t rows, int64_t cols,
                                const char *prefix, const char *const *names, int n)
{
    char full[FUSED_MAX][192];
    const char *ptrs[FUSED_MAX];
    if (n < 1 || n > FUSED_MAX)
        return kiln_err_set(l->err, KILN_ERR_INTERNAL, "fusing %d tensors", n);
    for (int i = 0; i < n; i++) {
        snprintf(full[i], sizeof full[i], "%s.%s.weight", prefix, names[i]);
        if (!kiln_st_expect(l->st, full[i], 2, (int64_t[]){rows, cols}, l->err))
            return l->err->code;
        ptrs[i] = full[i];
    }
    return kiln_weight_load_concat(l->be, l->st, t, ptrs, n, l->err);
}

kiln_tensor kiln_dit_heads(const kiln_tensor *t, int64_t heads, int64_t head_dim)
{
    kiln_tensor v = *t;
    kiln_tensor_set_shape(&v, t->dtype, 4, (int64_t[]){t->shape[0], t->shape[1], heads, head_dim});
    return v;
}

kiln_tensor kiln_dit_rows_view(const kiln_tensor *t, int64_t row0, int64_t n)
{
    kiln_tensor v = *t;
    v.shape[1] = n;
    v.data = (char *)t->data + (size_t)(row0 * t->shape[2]) * kiln_dtype_size(t->dtype);
    return v;
}

kiln_status kiln_dit_host_reserve(float **buf, size_t *cap, size_t floats, kiln_err *err)
{
    if (floats <= *cap)
        return KILN_OK;
    float *p = realloc(*buf, floats * sizeof(float));
    if (!p)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    *buf = p;
    *cap = floats;
    return KILN_OK;
}

kiln_status kiln_dit_runtime_init(kiln_backend *be, kiln_arena **fwd, kiln_arena **blk,
                                  int *replay_enabled, kiln_err *err)
{
    *fwd = kiln_arena_create(be, 0, err);
    if (!*fwd)
        return err && err->code ? err->code : KILN_ERR_NOMEM;
    *blk = kiln_arena_create(be, 0, err);
    if (!*blk)
        return err && err->code ? err->code : KILN_ERR_NOMEM;
    const char *graphs = getenv("KILN_GRAPHS");
    *replay_enabled = be->ops->graph_begin && !(graphs && !strcmp(graphs, "0"));
    return KILN_OK;
}

void kiln_dit_rope_reserve(kiln_backend *be, kiln_tensor *cos, kiln_tensor *sin, int64_t *cap,
                           uint64_t *epoch, int64_t rows, int64_t d)
{
    if (rows <= *cap)
        return;
    kiln_be_free(be, cos);
    kiln_be_free(be, sin);
    *cap = 0;
    (*epoch)++;
    const int64_t shape[2] = {rows, d};
    if (!kiln_be_alloc(be, cos, KILN_F32, 2, shape) && !kiln_be_alloc(be, sin, KILN_F32, 2, shape))
        *cap = rows;
}

void kiln_dit_free_blocks(kiln_backend *be, void *blocks, int64_t n, size_t block_bytes)
{
    if (!blocks)
        return;
    for (int64_t i = 0; i < n; i++) {
        kiln_tensor *t = (kiln_tensor *)((char *)blocks + (size_t)i * block_bytes);
        for (size_t k = 0; k < block_bytes / sizeof(kiln_tensor); k++)
            kiln_be_free(be, &t[k]);
    }
    free(blocks);
}

kiln_status kiln_dit_quantize_fp8(kiln_backend *be, kiln_tensor *const *ws, int n, int *converted)
{
    if (!be->ops->quantize_fp8) {
        kiln_be_fail(be, KILN_ERR_UNSUPPORTED, "the %s backend has no fp8 mode", be->name);
        return be->error.code;
    }
    for (int i = 0; i < n && !be->error.code; i++) {
        kiln_tensor *w = ws[i], q;
        if (!w->data || w->ndim != 2 || w->dtype == KILN_F8E4M3 ||
            !kiln_f8_linear_ok(w->shape[0], w->shape[1]))
            continue;
        if (kiln_be_alloc(be, &q, KILN_F8E4M3, 2, w->shape))
            break;
        kiln_be_quantize_fp8(be, &q, w);
        if (be->error.code) {
            kiln_be_free(be, &q);
            break;
        }
        kiln_be_free(be, w);
        *w = q;
        if (converted)
            (*converted)++;
    }
    return be->error.code;
}
