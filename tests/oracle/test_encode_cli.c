/* End to end: the real `kiln encode` binary on the oracle cases' prompts
 * (tokenizer + chat template + Qwen3), compared with diffusers' input_ids,
 * attention_mask and prompt embeddings; and its handling of bad input. */
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/safetensors.h"
#include "oracle_check.h"
#include "tests/run_util.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"

static const char *kiln_bin;
static char out_path[512];
static char log_text[8192];

/* Runs kiln with argv (NULL-terminated, argv[0] ignored); returns the exit
 * status and leaves its stderr in log_text. */
static int run_kiln(const char **argv)
{
    return test_run(kiln_bin, argv, log_text, sizeof log_text);
}

static kiln_st *open_st(const char *path)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(path, NULL, &err);
    CHECKF(st, "%s", err.msg);
    return st;
}

/* got[name] equals want[want_name] exactly (ids, masks), over the first
 * `cols` columns of each row of want (cols = its width when 0). */
static void check_same_i64(const kiln_st *got, const char *name, const kiln_st *want,
                           const char *want_name, int64_t cols)
{
    const kiln_st_tensor *g = kiln_st_find(got, name), *w = kiln_st_find(want, want_name);
    CHECKF(g && w && g->dtype == KILN_I64 && w->dtype == KILN_I64 && g->ndim == 2 &&
               w->ndim == 2 && g->shape[0] == w->shape[0],
           "%s", name);
    if (!g || !w || g->ndim != 2 || w->ndim != 2 || g->shape[0] != w->shape[0])
        return;
    if (!cols)
        cols = w->shape[1];
    CHECKF(g->shape[1] == cols, "%s: %lld columns, want %lld", name, (long long)g->shape[1],
           (long long)cols);
    if (g->shape[1] != cols)
        return;
    const int64_t *pg = g->data, *pw = w->data;
    int same = 1;
    for (int64_t b = 0; b < w->shape[0]; b++)
        same &= !memcmp(pg + b * cols, pw + b * w->shape[1], (size_t)cols * sizeof *pg);
    CHECKF(same, "%s differs from the oracle's %s", name, want_name);
}

static void check_embeds(const kiln_st *got, const kiln_st *ref, const char *ref_name)
{
    const kiln_st_tensor *g = kiln_st_find(got, "prompt_embeds"), *w = kiln_st_find(ref, ref_name);
    CHECKF(g && w && g->dtype == KILN_F32 && g->nbytes == w->nbytes, "prompt_embeds vs %s",
           ref_name);
    if (!g || !w || g->nbytes != w->nbytes)
        return;
    oracle_check_close(ref_name, g->data, w->data, g->nbytes / sizeof(float), 1e-4);
}

/* Encodes the case's prompts (meta.json `prompts`, or `""` for the
 * negative) with klein-tiny's layers and compares with ref_fp32. */
static void check_klein_case(const char *cs, int negative)
{
    cJSON *meta = oracle_check_meta(cs);
    kiln_st *ref = oracle_check_open(cs, "ref_fp32.safetensors");
    const cJSON *prompts = meta ? cJSON_GetObjectItemCaseSensitive(meta, "prompts") : NULL;
    const char *ck = meta ? cJSON_GetStringValue(cJSON_GetObjectItem(meta, "checkpoint")) : NULL;
    CHECK(cJSON_IsArray(prompts) && ck);
    if (!ref || !cJSON_IsArray(prompts) || !ck)
        goto done;
    char model[1200];
    snprintf(model, sizeof model, "%s", oracle_path(ck));
    const char *argv[32] = {"kiln", "encode", "--model", model, "--out", out_path,
                            "--text-encoder-out-layers", "1,2,3"};
    int argc = 8;
    const cJSON *p;
    cJSON_ArrayForEach(p, prompts)
    {
        argv[argc++] = "--prompt";
        argv[argc++] = negative ? "" : cJSON_GetStringValue(p);
    }
    int rc = run_kiln(argv);
    CHECKF(rc == 0, "kiln encode exited %d: %s", rc, log_text);
    kiln_st *got = rc == 0 ? open_st(out_path) : NULL;
    if (got) {
        const char *pre = negative ? "neg_" : "";
        char ids[64], mask[64], emb[64];
        snprintf(ids, sizeof ids, "%sinput_ids", pre);
        snprintf(mask, sizeof mask, "%sattention_mask", pre);
        snprintf(emb, sizeof emb, "%sprompt_embeds", pre);
        check_same_i64(got, "input_ids", ref, ids, 0);
        check_same_i64(got, "attention_mask", ref, mask, 0);
        check_embeds(got, ref, emb);
        kiln_st_close(got);
    }
done:
    kiln_st_close(ref);
    cJSON_Delete(meta);
}

static void test_klein_t2i_256(void) { check_klein_case("klein_t2i_256", 0); }
static void test_klein_batch2(void) { check_klein_case("klein_t2i_batch2", 0); }
static void test_klein_base_negative(void) { check_klein_case("klein_base_cfg_256", 1); }

/* Z-Image: default template and layer (-2) from the pipeline; the real rows
 * of each prompt are the oracle's cap_feats. */
static void test_zimage_defaults(void)
{
    cJSON *meta = oracle_check_meta("zimage_batch2_160x96");
    kiln_st *ref = oracle_check_open("zimage_batch2_160x96", "ref_fp32.safetensors");
    const cJSON *prompts = meta ? cJSON_GetObjectItemCaseSensitive(meta, "prompts") : NULL;
    if (!ref || cJSON_GetArraySize(prompts) != 2)
        goto done;
    char model[1200];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/zimage-tiny"));
    const char *argv[] = {"kiln", "encode", "--model", model, "--out", out_path,
                          "--prompt", cJSON_GetStringValue(cJSON_GetArrayItem(prompts, 0)),
                          "--prompt", cJSON_GetStringValue(cJSON_GetArrayItem(prompts, 1)),
                          NULL};
    int rc = run_kiln(argv);
    CHECKF(rc == 0, "kiln encode exited %d: %s", rc, log_text);
    kiln_st *got = rc == 0 ? open_st(out_path) : NULL;
    if (!got)
        goto done;
    check_same_i64(got, "input_ids", ref, "input_ids", 0);
    const kiln_st_tensor *e = kiln_st_find(got, "prompt_embeds");
    CHECK(e && e->ndim == 3 && e->shape[0] == 2 && e->shape[1] == 512 && e->shape[2] == 16);
    for (int b = 0; e && e->ndim == 3 && b < 2; b++) {
        char name[32];
        snprintf(name, sizeof name, "cap_feats.%d", b);
        const kiln_st_tensor *w = kiln_st_find(ref, name);
        CHECK(w && w->ndim == 2 && w->shape[1] == 16);
        if (!w)
            continue;
        const float *row0 = (const float *)e->data + (size_t)b * 512 * 16;
        oracle_check_close(name, row0, w->data, (size_t)(w->shape[0] * 16), 1e-4);
    }
    kiln_st_close(got);
done:
    kiln_st_close(ref);
    cJSON_Delete(meta);
}

/* An over-long prompt is cut to --max-sequence-length with a warning and
 * keeps the first ids, as diffusers' truncation does. */
static void test_truncation(void)
{
    cJSON *meta = oracle_check_meta("klein_t2i_batch2");
    kiln_st *ref = oracle_check_open("klein_t2i_batch2", "ref_fp32.safetensors");
    const cJSON *prompts = meta ? cJSON_GetObjectItemCaseSensitive(meta, "prompts") : NULL;
    if (!ref || cJSON_GetArraySize(prompts) != 2)
        goto done;
    char model[1200];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    const char *argv[] = {"kiln", "encode", "--model", model, "--out", out_path,
                          "--text-encoder-out-layers", "1,2,3", "--max-sequence-length", "20",
                          "--prompt", cJSON_GetStringValue(cJSON_GetArrayItem(prompts, 0)),
                          "--prompt", cJSON_GetStringValue(cJSON_GetArrayItem(prompts, 1)),
                          NULL};
    int rc = run_kiln(argv);
    CHECKF(rc == 0, "kiln encode exited %d: %s", rc, log_text);
    CHECKF(strstr(log_text, "warning") && strstr(log_text, "prompt 2") &&
               !strstr(log_text, "prompt 1 "),
           "stderr: %s", log_text);
    kiln_st *got = rc == 0 ? open_st(out_path) : NULL;
    if (got) {
        check_same_i64(got, "input_ids", ref, "input_ids", 20);
        const kiln_st_tensor *m = kiln_st_find(got, "attention_mask");
        CHECK(m && m->ndim == 2 && m->shape[1] == 20 && ((const int64_t *)m->data)[19] == 0 &&
              ((const int64_t *)m->data)[39] == 1);
        kiln_st_close(got);
    }
done:
    kiln_st_close(ref);
    cJSON_Delete(meta);
}

static void test_bad_input(void)
{
    char model[1200];
    snprintf(model, sizeof model, "%s", oracle_path("ckpt/klein-tiny"));
    const char *bad_layer[] = {"kiln", "encode", "--model", model, "--out", out_path,
                               "--prompt", "a cat", "--text-encoder-out-layers", "1,2,9", NULL};
    CHECK(run_kiln(bad_layer) == 2);
    CHECKF(strstr(log_text, "index 9 is out of range"), "stderr: %s", log_text);
    /* the oracle's tiny checkpoint records no layers: diffusers' 9, 18, 27
     * do not fit its 4-layer Qwen3, and the error says which flag helps */
    const char *default_layers[] = {"kiln", "encode", "--model", model, "--out", out_path,
                                    "--prompt", "a cat", NULL};
    CHECK(run_kiln(default_layers) == 2);
    CHECKF(strstr(log_text, "out of range") && strstr(log_text, "--text-encoder-out-layers"),
           "stderr: %s", log_text);

    const char *bad_utf8[] = {"kiln", "encode", "--model", model, "--out", out_path,
                              "--prompt", "caf\xc3", "--text-encoder-out-layers", "1", NULL};
    CHECK(run_kiln(bad_utf8) == 2);
    CHECKF(strstr(log_text, "prompt 1") && strstr(log_text, "UTF-8"), "stderr: %s", log_text);

    const char *bad_layers_arg[] = {"kiln", "encode", "--model", model, "--out", out_path,
                                    "--prompt", "x", "--text-encoder-out-layers", "1,,x", NULL};
    CHECK(run_kiln(bad_layers_arg) == 2);
    CHECKF(strstr(log_text, "--text-encoder-out-layers"), "stderr: %s", log_text);

    const char *no_prompt[] = {"kiln", "encode", "--model", model, "--out", out_path, NULL};
    CHECK(run_kiln(no_prompt) == 2);

    const char *bad_len[] = {"kiln", "encode", "--model", model, "--out", out_path, "--prompt",
                             "x", "--max-sequence-length", "0", NULL};
    CHECK(run_kiln(bad_len) == 2);

    const char *missing[] = {"kiln", "encode", "--model", io_path("no-such-checkpoint"), "--out",
                             out_path, "--prompt", "x", NULL};
    CHECK(run_kiln(missing) == 1);
    CHECKF(strstr(log_text, "not found") && !strstr(log_text, io_tmpdir()), "stderr: %s",
           log_text);
}

int main(void)
{
    if (!getenv("KILN_SHARED") || !getenv("KILN_BUILD_ROOT")) {
        fprintf(stderr, "needs KILN_SHARED and KILN_BUILD_ROOT\n");
        return 1;
    }
    kiln_bin = test_build_path("tools/kiln");
    snprintf(out_path, sizeof out_path, "%s", io_path("out.safetensors"));
    RUN(test_klein_t2i_256);
    RUN(test_klein_batch2);
    RUN(test_klein_base_negative);
    RUN(test_zimage_defaults);
    RUN(test_truncation);
    RUN(test_bad_input);
    return test_finish();
}
