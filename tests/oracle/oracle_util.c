#include "oracle_util.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common/json.h"

static void die(const char *what, const kiln_err *err)
{
    fprintf(stderr, "oracle: %s: %s\n", what, err ? err->msg : "missing");
    exit(2);
}

const char *oracle_path(const char *rel)
{
    static char bufs[8][4096];
    static int next;
    char *buf = bufs[next++ % 8];
    const char *shared = getenv("KILN_SHARED");
    snprintf(buf, sizeof bufs[0], "%s/oracle/%s", shared ? shared : "../shared", rel);
    return buf;
}

const char *oracle_case_path(const char *case_name, const char *file)
{
    char rel[512];
    snprintf(rel, sizeof rel, "cases/%s/%s", case_name, file);
    return oracle_path(rel);
}

cJSON *oracle_meta(const char *case_name)
{
    kiln_err err = {0};
    cJSON *meta = kiln_json_load(oracle_case_path(case_name, "meta.json"), "meta.json", &err);
    if (!meta)
        die(case_name, &err);
    return meta;
}

kiln_st *oracle_open(const char *case_name, const char *file)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(oracle_case_path(case_name, file), file, &err);
    if (!st)
        die(case_name, &err);
    return st;
}

int64_t oracle_numel(const kiln_st_tensor *t)
{
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

float *oracle_tensor_f32(const kiln_st_tensor *t)
{
    int64_t n = oracle_numel(t);
    float *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    if (out && kiln_convert_to_f32(out, t->data, t->dtype, (size_t)n)) {
        free(out);
        return NULL;
    }
    return out;
}

float oracle_value(const kiln_st_tensor *t, size_t i)
{
    float v;
    const char *p = (const char *)t->data + i * kiln_dtype_size(t->dtype);
    return kiln_convert_to_f32(&v, p, t->dtype, 1) ? NAN : v;
}

float *oracle_f32(const kiln_st *st, const char *name, int64_t *numel)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    if (!t)
        return NULL;
    float *out = oracle_tensor_f32(t);
    if (!out)
        die(name, NULL);
    if (numel)
        *numel = oracle_numel(t);
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

kiln_backend *oracle_cpu_backend(void)
{
    if (!getenv("KILN_SHARED")) {
        fprintf(stderr, "KILN_SHARED is not set\n");
        exit(1);
    }
    kiln_err err = {0};
    kiln_backend *be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        exit(1);
    }
    return be;
}

static const char *const kv_parts[] = {"text_encoder", "tokenizer", "transformer", "vae",
                                       "scheduler", "model_index.json"};
enum { KV_LINKED = 5 }; /* the first five are links, the index is written */

const char *oracle_kv_checkpoint(const char *src, char *dir)
{
    /* The links live in /tmp: a relative KILN_SHARED (tools/gpu/bench.sh
     * once passed .devdata) would leave them dangling. */
    char abs[PATH_MAX];
    if (!realpath(src, abs))
        return NULL;
    snprintf(dir, PATH_MAX, "/tmp/kiln-kv-ckpt-XXXXXX");
    if (!mkdtemp(dir))
        return NULL;
    char a[PATH_MAX], b[PATH_MAX];
    for (int i = 0; i < KV_LINKED; i++) {
        if (snprintf(a, sizeof a, "%s/%s", abs, kv_parts[i]) >= (int)sizeof a ||
            snprintf(b, sizeof b, "%s/%s", dir, kv_parts[i]) >= (int)sizeof b || symlink(a, b))
            return NULL;
    }
    if (snprintf(b, sizeof b, "%s/model_index.json", dir) >= (int)sizeof b)
        return NULL;
    FILE *f = fopen(b, "w");
    if (!f)
        return NULL;
    fputs("{\"_class_name\": \"Flux2KleinKVPipeline\", \"scheduler\": [\"diffusers\", "
          "\"FlowMatchEulerDiscreteScheduler\"], \"text_encoder\": [\"transformers\", "
          "\"Qwen3ForCausalLM\"], \"tokenizer\": [\"transformers\", \"Qwen2TokenizerFast\"], "
          "\"transformer\": [\"diffusers\", \"Flux2Transformer2DModel\"], \"vae\": "
          "[\"diffusers\", \"AutoencoderKLFlux2\"]}\n", f);
    return fclose(f) ? NULL : dir;
}

void oracle_kv_checkpoint_remove(const char *dir)
{
    char p[PATH_MAX];
    for (size_t i = 0; i < sizeof kv_parts / sizeof *kv_parts; i++)
        if (snprintf(p, sizeof p, "%s/%s", dir, kv_parts[i]) < (int)sizeof p)
            unlink(p);
    rmdir(dir);
}
