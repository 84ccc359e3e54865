/* Loading checkpoint tensors into a backend, with shape checks.
 *
 *   kiln_tensor w;
 *   if (kiln_weight_load(be, st, &w, 2, (int64_t[]){D, D}, &err,
 *                        "transformer_blocks.%d.attn.to_q.weight", i)) return err.code;
 *
 * The tensor is converted from its stored dtype (BF16, F16 or F32) to
 * be->act_dtype and uploaded once; the caller frees it with kiln_be_free.
 * A missing tensor or wrong shape fails with a message naming the tensor.
 */
#ifndef KILN_MODELS_WEIGHTS_H
#define KILN_MODELS_WEIGHTS_H

#include "common/safetensors.h"
#include "kernels/backend.h"

kiln_status kiln_weight_load(kiln_backend *be, const kiln_st *st, kiln_tensor *out, int ndim,
                             const int64_t *shape, kiln_err *err, const char *name_fmt, ...)
    __attribute__((format(printf, 7, 8)));

/* Like kiln_weight_load but concatenates several tensors along dim 0 (e.g.
 * q, k, v projections into one fused [3D, D] matrix).  All must share the
 * trailing dims; `names` has n entries. */
kiln_status kiln_weight_load_concat(kiln_backend *be, const kiln_st *st, kiln_tensor *out,
                                    const char *const *names, int n, kiln_err *err);

#endif
