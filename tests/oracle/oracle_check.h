/* The oracle read as test checks: where oracle_util.h aborts on a missing
 * or malformed oracle, these count a failed CHECK (tests/test.h), say what
 * was missing and return NULL (or INFINITY), so one run reports every
 * broken expectation.  Static inline because the check counters belong to
 * the test program that includes this.
 *
 *   kiln_st *ref = oracle_check_open("klein_t2i_256", "ref_fp32.safetensors");
 *   float *want = ref ? oracle_check_f32(ref, "prompt_embeds", &n) : NULL;
 *   if (want)
 *       oracle_check_close("prompt_embeds", got, want, (size_t)n, 1e-4);
 */
#ifndef KILN_TESTS_ORACLE_CHECK_H
#define KILN_TESTS_ORACLE_CHECK_H

#include <stdint.h>
#include <string.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "oracle_util.h"
#include "tests/test.h"

/* The bits of a float, for bit-for-bit comparisons with the oracle (which
 * tell -0 from 0 and compare NaNs). */
static inline uint32_t oracle_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* cases/<case_name>/<file> opened as safetensors (caller closes). */
static inline kiln_st *oracle_check_open(const char *case_name, const char *file)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(oracle_case_path(case_name, file), file, &err);
    CHECKF(st, "%s/%s: %s", case_name, file, err.msg);
    return st;
}

/* cases/<case_name>/meta.json (caller frees with cJSON_Delete). */
static inline cJSON *oracle_check_meta(const char *case_name)
{
    kiln_err err = {0};
    cJSON *meta = kiln_json_load(oracle_case_path(case_name, "meta.json"), "meta.json", &err);
    CHECKF(meta, "%s: %s", case_name, err.msg);
    return meta;
}

/* The checkpoint folder at oracle-relative `rel` ("ckpt/klein-tiny", as a
 * case's meta.json names it); caller closes. */
static inline kiln_checkpoint *oracle_check_ckpt(const char *rel)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path(rel), &err);
    CHECKF(ck, "%s: %s", rel, err.msg);
    return ck;
}

/* A stored tensor as f32 (malloc'd, caller frees): one check that it is
 * there, one that it converts.  numel, when not NULL, receives its size. */
static inline float *oracle_check_f32(const kiln_st *st, const char *name, int64_t *numel)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    CHECKF(t, "tensor %s missing", name);
    if (!t)
        return NULL;
    float *p = oracle_tensor_f32(t);
    CHECKF(p, "cannot read %s (%s) as f32", name, kiln_dtype_name(t->dtype));
    if (p && numel)
        *numel = oracle_numel(t);
    return p;
}

/* Row 0 of an I64 position-ids tensor (B, S, 4) as int32 (malloc'd, caller
 * frees), the form the DiT takes; *rows receives S. */
static inline int32_t *oracle_check_ids(const kiln_st *st, const char *name, int64_t *rows)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    CHECKF(t && t->dtype == KILN_I64 && t->ndim == 3 && t->shape[2] == 4, "ids %s", name);
    if (!t || t->dtype != KILN_I64 || t->ndim != 3)
        return NULL;
    int64_t S = t->shape[1];
    int32_t *ids = malloc((size_t)S * 4 * sizeof(int32_t));
    const int64_t *src = t->data;
    for (int64_t i = 0; ids && i < S * 4; i++)
        ids[i] = (int32_t)src[i];
    *rows = S;
    return ids;
}

/* Checks ||got - want|| / ||want|| < tol over n floats and prints the
 * error beside `what`; returns it.  A NULL want (a missing reference) is
 * a failed check. */
static inline double oracle_check_close(const char *what, const float *got, const float *want,
                                        size_t n, double tol)
{
    if (!want) {
        CHECKF(0, "%s: no reference", what);
        return INFINITY;
    }
    double e = test_rel_err(got, want, n);
    CHECKF(e < tol, "%s: relative error %.3g (tolerance %g)", what, e, tol);
    fprintf(stderr, "     %-44s rel err %.3g\n", what, e);
    return e;
}

#endif
