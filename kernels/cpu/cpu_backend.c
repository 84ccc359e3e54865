/* The CPU reference backend: fp32 activations and weights, no threads. */
#include <stdlib.h>

#include "cpu_ops.h"
#include "kernels/backend_impl.h"

static void cpu_destroy(kiln_backend *be) { free(be); }

static const kiln_backend_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .download_bytes = cpu_download_bytes,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .linear = cpu_linear,
    .quantize_fp8 = cpu_quantize_fp8,
    .rms_norm = cpu_rms_norm,
    .layer_norm_mod = cpu_layer_norm_mod,
    .group_norm = cpu_group_norm,
    .group_norm_stats = cpu_group_norm_stats,
    .group_norm_apply = cpu_group_norm_apply,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .silu = cpu_silu,
    .tanh = cpu_tanh,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .gated_add = cpu_gated_add,
    .euler_step = cpu_euler_step,
    .cfg = cpu_cfg,
    .copy_rows = cpu_copy_rows,
    .copy_cols = cpu_copy_cols,
    .transpose = cpu_transpose,
    .conv2d = cpu_conv2d,
    .upsample_nearest2x = cpu_upsample_nearest2x,
    .to_rgb8 = cpu_to_rgb8,
    .qkv_split = cpu_qkv_split,
    .swiglu_cols = cpu_swiglu_cols,
    .destroy = cpu_destroy,
};

kiln_backend *kiln_cpu_backend_create(kiln_err *err)
{
    kiln_backend *be = calloc(1, sizeof *be);
    if (!be) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    be->ops = &cpu_ops;
    be->name = "cpu";
    be->act_dtype = KILN_F32;
    return be;
}
