#include "oracle_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/json.h"

static void die(const char *what, const kiln_err *err)
{
    fprintf(stderr, "oracle: %s: %s\n", what, err ? err->msg : "missing");
    exit(2);
}

const char *oracle_path(const char *rel)
{
    static char buf[4096];
    const char *shared = getenv("KILN_SHARED");
    snprintf(buf, sizeof buf, "%s/oracle/%s", shared ? shared : "../shared", rel);
    return buf;
}

cJSON *oracle_meta(const char *case_name)
{
    char rel[512];
    snprintf(rel, sizeof rel, "cases/%s/meta.json", case_name);
    kiln_err err = {0};
    cJSON *meta = kiln_json_load(oracle_path(rel), "meta.json", &err);
    if (!meta)
        die(rel, &err);
    return meta;
}

kiln_st *oracle_open(const char *case_name, const char *file)
{
    char rel[512];
    snprintf(rel, sizeof rel, "cases/%s/%s", case_name, file);
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(oracle_path(rel), file, &err);
    if (!st)
        die(rel, &err);
    return st;
}

float *oracle_f32(const kiln_st *st, const char *name, int64_t *numel)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    if (!t)
        return NULL;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    float *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    if (!out || kiln_convert_to_f32(out, t->data, t->dtype, (size_t)n))
        die(name, NULL);
    if (numel)
        *numel = n;
    return out;
}

double oracle_psnr_u8(const uint8_t *a, const uint8_t *b, size_t n)
{
    double se = 0;
    for (size_t i = 0; i < n; i++)
        se += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
    if (se == 0)
        return INFINITY;
    return 10.0 * log10(255.0 * 255.0 / (se / (double)n));
}
