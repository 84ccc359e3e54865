/* Qwen3 text encoder against the fp32 oracle (shared/oracle/cases): the
 * stacked klein prompt embeddings of every klein case, every hidden state of
 * klein_t2i_256, Z-Image's real-token features, and clear failures for bad
 * layer indices, a missing component and a tampered checkpoint. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/qwen3.h"
#include "oracle_check.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"

static kiln_backend *be;

/* --- helpers ------------------------------------------------------------- */

/* The case's meta.json: its checkpoint folder (oracle-relative) and encoder
 * layers. */
static int case_meta(const char *cs, char *ckpt, size_t len, int *layers, int *n)
{
    kiln_err err = {0};
    cJSON *meta = oracle_check_meta(cs);
    if (!meta)
        return -1;
    const char *ck = kiln_json_string(meta, "checkpoint", 1, &err);
    int64_t l[KILN_QWEN3_MAX_OUT];
    int ok = ck && !kiln_json_int_array(meta, "text_encoder_out_layers", 1, l,
                                        KILN_QWEN3_MAX_OUT, n, &err);
    CHECKF(ok, "%s: %s", cs, err.msg);
    if (ok) {
        snprintf(ckpt, len, "%s", ck);
        for (int i = 0; i < *n; i++)
            layers[i] = (int)l[i];
    }
    cJSON_Delete(meta);
    return ok ? 0 : -1;
}

typedef struct tokens {
    int32_t *ids;
    int *lens;
    int64_t B, T;
} tokens;

/* ids and right-padding lengths from `<prefix>input_ids` and
 * `<prefix>attention_mask` (I64, (B, T)). */
static int read_tokens(const kiln_st *st, const char *prefix, tokens *tk)
{
    char name[128];
    snprintf(name, sizeof name, "%sinput_ids", prefix);
    const kiln_st_tensor *ids = kiln_st_find(st, name);
    snprintf(name, sizeof name, "%sattention_mask", prefix);
    const kiln_st_tensor *mask = kiln_st_find(st, name);
    CHECKF(ids && mask && ids->dtype == KILN_I64 && ids->ndim == 2 && mask->nbytes == ids->nbytes,
           "%sinput_ids / attention_mask", prefix);
    if (!ids || !mask)
        return -1;
    tk->B = ids->shape[0];
    tk->T = ids->shape[1];
    tk->ids = malloc((size_t)(tk->B * tk->T) * sizeof *tk->ids);
    tk->lens = calloc((size_t)tk->B, sizeof *tk->lens);
    const int64_t *pi = ids->data, *pm = mask->data;
    for (int64_t b = 0; b < tk->B; b++) {
        for (int64_t t = 0; t < tk->T; t++) {
            tk->ids[b * tk->T + t] = (int32_t)pi[b * tk->T + t];
            if (pm[b * tk->T + t]) {
                CHECKF(tk->lens[b] == t, "mask is not right-padded in row %lld", (long long)b);
                tk->lens[b]++;
            }
        }
    }
    return 0;
}

static void free_tokens(tokens *tk)
{
    free(tk->ids);
    free(tk->lens);
}

/* Runs the stacked encoder and returns the host copy (B * T * width). */
static float *encode(kiln_qwen3 *enc, const tokens *tk)
{
    kiln_err err = {0};
    int64_t W = kiln_qwen3_out_width(enc);
    kiln_tensor out;
    if (kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){tk->B, tk->T, W})) {
        kiln_be_check(be, &err);
        CHECKF(0, "alloc: %s", err.msg);
        return NULL;
    }
    float *host = malloc((size_t)kiln_tensor_numel(&out) * sizeof *host);
    kiln_status st = kiln_qwen3_encode(enc, tk->ids, tk->lens, tk->B, tk->T, &out, &err);
    CHECKF(st == KILN_OK, "encode: %s", err.msg);
    kiln_be_download(be, &out, host);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    kiln_be_free(be, &out);
    if (st) {
        free(host);
        return NULL;
    }
    return host;
}

static void compare(const char *what, const float *got, const kiln_st_tensor *ref, size_t n)
{
    CHECKF(ref && ref->dtype == KILN_F32 && ref->nbytes == n * sizeof(float), "%s: reference",
           what);
    if (!got || !ref || ref->nbytes != n * sizeof(float))
        return;
    oracle_check_close(what, got, ref->data, n, 1e-4);
}

/* --- oracle parity ------------------------------------------------------- */

static void check_klein_case(const char *cs, const char *prefix)
{
    char ckname[256];
    int layers[KILN_QWEN3_MAX_OUT], n = 0;
    if (case_meta(cs, ckname, sizeof ckname, layers, &n))
        return;
    kiln_checkpoint *ck = oracle_check_ckpt(ckname);
    kiln_st *ref = oracle_check_open(cs, "ref_fp32.safetensors");
    kiln_err err = {0};
    kiln_qwen3 *enc = ck ? kiln_qwen3_load(be, ck, layers, n, &err) : NULL;
    CHECKF(enc, "%s: load: %s", cs, err.msg);
    tokens tk = {0};
    if (enc && ref && !read_tokens(ref, prefix, &tk)) {
        float *got = encode(enc, &tk);
        char name[128], what[256];
        snprintf(name, sizeof name, "%sprompt_embeds", prefix);
        snprintf(what, sizeof what, "%s %s", cs, name);
        compare(what, got, kiln_st_find(ref, name),
                (size_t)(tk.B * tk.T * kiln_qwen3_out_width(enc)));
        free(got);
        free_tokens(&tk);
    }
    kiln_qwen3_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

static void test_klein_t2i_256(void) { check_klein_case("klein_t2i_256", ""); }
static void test_klein_t2i_batch2(void) { check_klein_case("klein_t2i_batch2", ""); }
static void test_klein_edit_1ref(void) { check_klein_case("klein_edit_1ref", ""); }
static void test_klein_kv_edit_1ref(void) { check_klein_case("klein_kv_edit_1ref", ""); }

static void test_klein_base_cfg_256(void)
{
    check_klein_case("klein_base_cfg_256", "");
    check_klein_case("klein_base_cfg_256", "neg_"); /* the empty negative prompt */
}

/* Every hidden state 0..4 of klein_t2i_256 (embedding, layers 1-3, final
 * norm), asked for at once and by negative index. */
static void test_all_hidden_states(void)
{
    kiln_checkpoint *ck = oracle_check_ckpt("ckpt/klein-tiny");
    kiln_st *ref = oracle_check_open("klein_t2i_256", "ref_fp32.safetensors");
    kiln_st *dbg = oracle_check_open("klein_t2i_256", "debug_fp32.safetensors");
    const kiln_st_tensor *all = dbg ? kiln_st_find(dbg, "dbg.text_hidden_states_all") : NULL;
    CHECK(all && all->ndim == 4 && all->shape[0] == 5 && all->dtype == KILN_F32);
    tokens tk = {0};
    if (!ck || !ref || !all || all->ndim != 4 || read_tokens(ref, "", &tk))
        goto done;
    int64_t H = all->shape[3], L = all->shape[0];
    size_t per = (size_t)(tk.B * tk.T * H);
    kiln_err err = {0};

    kiln_qwen3 *enc = kiln_qwen3_load(be, ck, (int[]){0, 1, 2, 3, 4}, 5, &err);
    CHECKF(enc, "load: %s", err.msg);
    float *got = enc ? encode(enc, &tk) : NULL;
    for (int64_t k = 0; got && k < L; k++) {
        /* got is (B*T, 5H); gather slot k into a contiguous copy */
        float *slot = malloc(per * sizeof *slot);
        for (size_t r = 0; r < per / (size_t)H; r++)
            memcpy(slot + r * (size_t)H, got + (r * 5 + (size_t)k) * (size_t)H,
                   (size_t)H * sizeof *slot);
        kiln_st_tensor view = *all;
        view.data = (const float *)all->data + (size_t)k * per;
        view.nbytes = per * sizeof(float);
        char what[64];
        snprintf(what, sizeof what, "hidden_states[%lld]", (long long)k);
        compare(what, slot, &view, per);
        free(slot);
    }
    free(got);
    kiln_qwen3_destroy(enc);

    /* -1 is the final-normed state, -5 the embedding */
    enc = kiln_qwen3_load(be, ck, (int[]){-1, -5}, 2, &err);
    CHECKF(enc, "load: %s", err.msg);
    if (enc) {
        CHECK(kiln_qwen3_depth(enc) == 4);
        got = encode(enc, &tk);
        float *last = got ? malloc(per * sizeof *last) : NULL;
        for (size_t r = 0; last && r < per / (size_t)H; r++)
            memcpy(last + r * (size_t)H, got + r * 2 * (size_t)H, (size_t)H * sizeof *last);
        kiln_st_tensor view = *all;
        view.data = (const float *)all->data + 4 * per;
        view.nbytes = per * sizeof(float);
        compare("hidden_states[-1]", last, &view, per);
        free(last);
        free(got);
        kiln_qwen3_destroy(enc);
    }
    free_tokens(&tk);
done:
    kiln_st_close(dbg);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

/* Z-Image: hidden_states[-2] of the real tokens = the oracle's cap_feats. */
static void check_zimage_case(const char *cs)
{
    kiln_checkpoint *ck = oracle_check_ckpt("ckpt/zimage-tiny");
    kiln_st *ref = oracle_check_open(cs, "ref_fp32.safetensors");
    kiln_err err = {0};
    kiln_qwen3 *enc = ck ? kiln_qwen3_load(be, ck, (int[]){-2}, 1, &err) : NULL;
    CHECKF(enc, "load: %s", err.msg);
    tokens tk = {0};
    if (!enc || !ref || read_tokens(ref, "", &tk))
        goto done;
    CHECK(kiln_qwen3_depth(enc) == 3);
    int64_t H = kiln_qwen3_out_width(enc), total = 0;
    for (int64_t b = 0; b < tk.B; b++)
        total += tk.lens[b];
    kiln_tensor out;
    float *host = malloc((size_t)(total * H) * sizeof *host);
    kiln_be_alloc(be, &out, be->act_dtype, 2, (int64_t[]){total, H});
    kiln_status st = kiln_qwen3_encode_real(enc, tk.ids, tk.lens, tk.B, tk.T, &out, &err);
    CHECKF(st == KILN_OK, "encode_real: %s", err.msg);
    kiln_be_download(be, &out, host);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    int64_t off = 0;
    for (int64_t b = 0; b < tk.B && !st; b++) {
        char name[64], what[128];
        snprintf(name, sizeof name, "cap_feats.%lld", (long long)b);
        snprintf(what, sizeof what, "%s %s", cs, name);
        compare(what, host + off * H, kiln_st_find(ref, name), (size_t)(tk.lens[b] * H));
        off += tk.lens[b];
    }
    free(host);
    kiln_be_free(be, &out);
    free_tokens(&tk);
done:
    kiln_qwen3_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

static void test_zimage_t2i_256(void) { check_zimage_case("zimage_t2i_256"); }
static void test_zimage_batch2(void) { check_zimage_case("zimage_batch2_160x96"); }

/* A row's result does not depend on the rows batched with it, and a second
 * call of the same shape reuses the scratch memory of the first. */
static void test_batch_invariance_and_reuse(void)
{
    kiln_checkpoint *ck = oracle_check_ckpt("ckpt/klein-tiny");
    kiln_st *ref = oracle_check_open("klein_t2i_batch2", "ref_fp32.safetensors");
    kiln_err err = {0};
    kiln_qwen3 *enc = ck ? kiln_qwen3_load(be, ck, (int[]){1, 2, 3}, 3, &err) : NULL;
    CHECKF(enc, "load: %s", err.msg);
    tokens tk = {0};
    if (enc && ref && !read_tokens(ref, "", &tk) && tk.B == 2) {
        CHECK(kiln_qwen3_scratch_bytes(enc) == 0);
        float *both = encode(enc, &tk);
        size_t scratch = kiln_qwen3_scratch_bytes(enc);
        float *again = encode(enc, &tk);
        CHECK(kiln_qwen3_scratch_bytes(enc) == scratch && scratch > 0);
        tokens one = {tk.ids + tk.T, tk.lens + 1, 1, tk.T};
        float *row1 = encode(enc, &one);
        size_t n = (size_t)(tk.T * kiln_qwen3_out_width(enc));
        if (both && again && row1) {
            CHECK(!memcmp(both, again, 2 * n * sizeof *both));
            oracle_check_close("row 1 alone vs in batch", row1, both + n, n, 1e-6);
        }
        free(both);
        free(again);
        free(row1);
        free_tokens(&tk);
    }
    kiln_qwen3_destroy(enc);
    kiln_st_close(ref);
    kiln_checkpoint_close(ck);
}

/* --- bad inputs ---------------------------------------------------------- */

static void test_bad_layers_and_tokens(void)
{
    kiln_checkpoint *ck = oracle_check_ckpt("ckpt/klein-tiny");
    if (!ck)
        return;
    kiln_err err = {0};
    CHECK(!kiln_qwen3_load(be, ck, (int[]){1, 5}, 2, &err) && err.code == KILN_ERR_INVALID &&
          strstr(err.msg, "out of range") && strstr(err.msg, "index 5"));
    CHECK(!kiln_qwen3_load(be, ck, (int[]){-6}, 1, &err) && err.code == KILN_ERR_INVALID);
    CHECK(!kiln_qwen3_load(be, ck, (int[]){1}, 0, &err) && err.code == KILN_ERR_INVALID);

    kiln_qwen3 *enc = kiln_qwen3_load(be, ck, (int[]){2}, 1, &err);
    CHECKF(enc, "load: %s", err.msg);
    if (enc) {
        CHECK(kiln_qwen3_depth(enc) == 2);
        kiln_tensor out;
        kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){1, 4, 16});
        int32_t ids[4] = {1, 2, 151936, 3};
        CHECK(kiln_qwen3_encode(enc, ids, (int[]){4}, 1, 4, &out, &err) == KILN_ERR_INVALID &&
              strstr(err.msg, "151936"));
        ids[2] = 7;
        CHECK(kiln_qwen3_encode(enc, ids, (int[]){0}, 1, 4, &out, &err) == KILN_ERR_INVALID);
        CHECK(kiln_qwen3_encode(enc, ids, (int[]){4}, 1, 3, &out, &err) == KILN_ERR_INVALID);
        CHECKF(kiln_qwen3_encode(enc, ids, (int[]){2}, 1, 4, &out, &err) == KILN_OK, "%s",
               err.msg);
        kiln_be_free(be, &out);
        kiln_qwen3_destroy(enc);
    }
    kiln_checkpoint_close(ck);
}

static int copy_file(const char *from, const char *to)
{
    FILE *f = fopen(from, "rb");
    if (!f)
        return -1;
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    buf[n < sizeof buf ? n : sizeof buf - 1] = 0;
    return io_write_str(to, buf);
}

static void test_missing_component_and_bad_shapes(void)
{
    char dir[] = "/tmp/kiln-qwen3-XXXXXX", path[256];
    CHECK(mkdtemp(dir) != NULL);
    kiln_err err = {0};

    /* a klein checkpoint without a text encoder */
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    CHECK(!io_write_str(path, "{\"_class_name\": \"Flux2KleinPipeline\"}"));
    kiln_checkpoint *ck = kiln_checkpoint_open(dir, &err);
    CHECKF(ck, "%s", err.msg);
    if (ck) {
        CHECK(!kiln_qwen3_load(be, ck, (int[]){1}, 1, &err) &&
              err.code == KILN_ERR_NOT_FOUND && strstr(err.msg, "text_encoder"));
        kiln_checkpoint_close(ck);
    }

    /* klein-tiny's text encoder with layer 1's down_proj stored transposed */
    CHECK(!io_write_str(path, "{\"_class_name\": \"Flux2KleinPipeline\", "
                              "\"text_encoder\": [\"transformers\", \"Qwen3ForCausalLM\"]}"));
    snprintf(path, sizeof path, "%s/text_encoder", dir);
    CHECK(mkdir(path, 0700) == 0);
    snprintf(path, sizeof path, "%s/text_encoder/config.json", dir);
    CHECK(!copy_file(oracle_path("ckpt/klein-tiny/text_encoder/config.json"), path));
    kiln_st *orig =
        kiln_st_open(oracle_path("ckpt/klein-tiny/text_encoder/model.safetensors"), "orig", &err);
    CHECKF(orig, "%s", err.msg);
    size_t n = orig ? kiln_st_count(orig) : 0;
    kiln_st_entry *e = calloc(n ? n : 1, sizeof *e);
    for (size_t i = 0; i < n; i++) {
        const kiln_st_tensor *t = kiln_st_at(orig, i);
        e[i] = (kiln_st_entry){.name = t->name, .dtype = t->dtype, .ndim = t->ndim,
                               .data = t->data};
        memcpy(e[i].shape, t->shape, sizeof e[i].shape);
        if (!strcmp(t->name, "model.layers.1.mlp.down_proj.weight")) {
            e[i].shape[0] = t->shape[1];
            e[i].shape[1] = t->shape[0];
        }
    }
    snprintf(path, sizeof path, "%s/text_encoder/model.safetensors", dir);
    CHECKF(kiln_st_write(path, e, n, &err) == KILN_OK, "%s", err.msg);
    free(e);
    kiln_st_close(orig);
    ck = kiln_checkpoint_open(dir, &err);
    CHECKF(ck, "%s", err.msg);
    if (ck) {
        CHECK(!kiln_qwen3_load(be, ck, (int[]){1, 2, 3}, 3, &err) &&
              err.code == KILN_ERR_FORMAT && strstr(err.msg, "layers.1.mlp.down_proj.weight"));
        /* only layer 0 is loaded for hidden state 1, so the bad tensor is never read */
        kiln_qwen3 *enc = kiln_qwen3_load(be, ck, (int[]){1}, 1, &err);
        CHECKF(enc, "%s", err.msg);
        kiln_qwen3_destroy(enc);
        kiln_checkpoint_close(ck);
    }
    unlink(path);
    snprintf(path, sizeof path, "%s/text_encoder/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/text_encoder", dir);
    rmdir(path);
    snprintf(path, sizeof path, "%s/model_index.json", dir);
    unlink(path);
    CHECK(rmdir(dir) == 0);
}

int main(void)
{
    be = oracle_cpu_backend();
    RUN(test_klein_t2i_256);
    RUN(test_klein_t2i_batch2);
    RUN(test_klein_edit_1ref);
    RUN(test_klein_kv_edit_1ref);
    RUN(test_klein_base_cfg_256);
    RUN(test_all_hidden_states);
    RUN(test_zimage_t2i_256);
    RUN(test_zimage_batch2);
    RUN(test_batch_invariance_and_reuse);
    RUN(test_bad_layers_and_tokens);
    RUN(test_missing_component_and_bad_shapes);
    kiln_backend_destroy(be);
    return test_finish();
}
