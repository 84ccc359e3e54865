#include "weights.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define W_NAME_MAX 256

static int uploadable(kiln_dtype dt)
{
    return dt == KILN_BF16 || dt == KILN_F16 || dt == KILN_F32;
}

/* Allocates `out` in be->act_dtype and uploads host data into it; a backend
 * failure is taken out of the sticky slot so it reaches the caller's err. */
static kiln_status upload(kiln_backend *be, kiln_tensor *out, int ndim, const int64_t *shape,
                          const void *host, kiln_dtype dt, const char *name, kiln_err *err)
{
    if (kiln_be_from_host(be, out, ndim, shape, host, dt) == KILN_OK)
        return KILN_OK;
    kiln_be_check(be, err);
    kiln_be_free(be, out);
    memset(out, 0, sizeof *out);
    return kiln_err_wrap(err, "loading '%s'", name);
}

kiln_status kiln_weight_load(kiln_backend *be, const kiln_st *st, kiln_tensor *out, int ndim,
                             const int64_t *shape, kiln_err *err, const char *name_fmt, ...)
{
    memset(out, 0, sizeof *out);
    char name[W_NAME_MAX];
    va_list ap;
    va_start(ap, name_fmt);
    int len = vsnprintf(name, sizeof name, name_fmt, ap);
    va_end(ap);
    if (len < 0 || len >= (int)sizeof name)
        return kiln_err_set(err, KILN_ERR_INVALID, "tensor name too long");
    const kiln_st_tensor *t = kiln_st_expect(st, name, ndim, shape, err);
    if (!t)
        return err ? err->code : KILN_ERR_FORMAT;
    if (!uploadable(t->dtype))
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "tensor '%s' is stored as %s; weights must be BF16, F16 or F32",
                            name, kiln_dtype_name(t->dtype));
    /* Headers that are not padded to 8 bytes (other writers) can leave the
     * data unaligned for its element type; backends read it as typed
     * arrays, so such a tensor goes through an aligned copy. */
    size_t es = kiln_dtype_size(t->dtype);
    if ((uintptr_t)t->data % es == 0)
        return upload(be, out, ndim, shape, t->data, t->dtype, name, err);
    void *copy = malloc(t->nbytes ? t->nbytes : 1);
    if (!copy)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory loading '%s'", name);
    memcpy(copy, t->data, t->nbytes);
    kiln_status rc = upload(be, out, ndim, shape, copy, t->dtype, name, err);
    free(copy);
    return rc;
}

/* Checks that every part exists, is uploadable and agrees with the first on
 * rank and trailing dims; fills the fused shape and the common dtype (F32
 * when the parts disagree, so the host copy is converted once). */
static kiln_status check_parts(const kiln_st *st, const char *const *names, int n,
                               const kiln_st_tensor **parts, int64_t *shape, kiln_dtype *dt,
                               kiln_err *err)
{
    for (int i = 0; i < n; i++) {
        const kiln_st_tensor *t = kiln_st_find(st, names[i]);
        if (!t)
            return kiln_err_set(err, KILN_ERR_NOT_FOUND, "tensor '%s' is missing", names[i]);
        if (!uploadable(t->dtype))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                                "tensor '%s' is stored as %s; weights must be BF16, F16 or F32",
                                names[i], kiln_dtype_name(t->dtype));
        const kiln_st_tensor *f = parts[0] ? parts[0] : t;
        int ok = t->ndim == f->ndim && t->ndim >= 1;
        for (int d = 1; ok && d < t->ndim; d++)
            ok = t->shape[d] == f->shape[d];
        if (!ok) {
            kiln_tensor a = {.ndim = t->ndim}, b = {.ndim = f->ndim};
            memcpy(a.shape, t->shape, sizeof a.shape);
            memcpy(b.shape, f->shape, sizeof b.shape);
            char sa[128], sb[128];
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "tensor '%s' has shape %s, which cannot be stacked on '%s' %s",
                                names[i], kiln_tensor_shape_str(&a, sa, sizeof sa), names[0],
                                kiln_tensor_shape_str(&b, sb, sizeof sb));
        }
        parts[i] = t;
        if (i == 0) {
            memcpy(shape, t->shape, sizeof(int64_t) * KILN_MAX_DIMS);
            shape[0] = 0;
            *dt = t->dtype;
        } else if (t->dtype != *dt) {
            *dt = KILN_F32;
        }
        shape[0] += t->shape[0];
    }
    return KILN_OK;
}

kiln_status kiln_weight_load_concat(kiln_backend *be, const kiln_st *st, kiln_tensor *out,
                                    const char *const *names, int n, kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (n < 1 || n > 64)
        return kiln_err_set(err, KILN_ERR_INVALID, "concat needs 1 to 64 tensors, got %d", n);
    const kiln_st_tensor *parts[64] = {0};
    int64_t shape[KILN_MAX_DIMS];
    kiln_dtype dt = KILN_F32;
    kiln_status rc = check_parts(st, names, n, parts, shape, &dt, err);
    if (rc)
        return rc;
    size_t es = kiln_dtype_size(dt), total = 0;
    for (int i = 0; i < n; i++)
        total += parts[i]->nbytes / kiln_dtype_size(parts[i]->dtype) * es;
    /* Stacking along dim 0 of row-major tensors is plain concatenation of
     * their bytes. */
    uint8_t *host = malloc(total ? total : 1);
    if (!host)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory fusing '%s'", names[0]);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t numel = parts[i]->nbytes / kiln_dtype_size(parts[i]->dtype);
        if (parts[i]->dtype == dt)
            memcpy(host + off, parts[i]->data, parts[i]->nbytes);
        else
            kiln_convert_to_f32((float *)(host + off), parts[i]->data, parts[i]->dtype, numel);
        off += numel * es;
    }
    rc = upload(be, out, parts[0]->ndim, shape, host, dt, names[0], err);
    free(host);
    return rc;
}
