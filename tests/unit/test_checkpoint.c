/* Checkpoint folders: the oracle checkpoints open with the right pipeline
 * and configs, broken folders are refused naming the component (never a
 * path), and `kiln make-checkpoint` writes exactly the oracle's layout. */
#include <limits.h>
#include <sys/wait.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "engine/encode_stage.h"
#include "tests/oracle/oracle_util.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"
#include "tools/ckpt_presets.h"
#include "tools/ckpt_write.h"

static const char *components[] = {"transformer", "text_encoder", "vae", "scheduler",
                                   "tokenizer"};

static int64_t cfg_int(const kiln_checkpoint *ck, const char *comp, const char *key)
{
    kiln_err err = {0};
    int64_t v = -1;
    const cJSON *c = kiln_checkpoint_config(ck, comp, &err);
    CHECKF(c && kiln_json_int(c, key, KILN_JSON_REQUIRED, &v, &err) == KILN_OK, "%s.%s: %s",
           comp, key, err.msg);
    return v;
}

static void test_open_oracle(void)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (!ck)
        return;
    CHECK(kiln_checkpoint_pipeline(ck) == KILN_PIPE_FLUX2_KLEIN);
    CHECK(kiln_checkpoint_is_distilled(ck) == 1);
    CHECK(cfg_int(ck, "transformer", "num_layers") == 2);
    CHECK(cfg_int(ck, "transformer", "joint_attention_dim") == 48);
    CHECK(cfg_int(ck, "text_encoder", "hidden_size") == 16);
    CHECK(cfg_int(ck, "vae", "latent_channels") == 8);
    CHECK(cfg_int(ck, "scheduler", "num_train_timesteps") == 1000);
    int dyn = 0;
    CHECK(kiln_json_bool(kiln_checkpoint_config(ck, "scheduler", &err), "use_dynamic_shifting",
                         1, 0, &dyn, &err) == KILN_OK && dyn == 1);
    const char *tc = kiln_json_string(kiln_checkpoint_config(ck, "tokenizer", &err),
                                      "tokenizer_class", 1, &err);
    CHECK(tc && !strcmp(tc, "Qwen2Tokenizer"));
    CHECK(kiln_checkpoint_config(ck, "unet", &err) == NULL && err.code == KILN_ERR_NOT_FOUND);
    const cJSON *idx = kiln_checkpoint_index(ck);
    CHECK(cJSON_IsString(cJSON_GetObjectItem(idx, "_class_name")));

    kiln_st *w = kiln_checkpoint_weights(ck, "transformer", &err);
    CHECKF(w && kiln_st_count(w) == 49, "%s", err.msg);
    CHECK(w && kiln_st_expect(w, "proj_out.weight", 2, (int64_t[]){32, 128}, &err));
    kiln_st_close(w);
    w = kiln_checkpoint_weights(ck, "text_encoder", &err);
    CHECKF(w && kiln_st_find(w, "model.embed_tokens.weight"), "%s", err.msg);
    kiln_st_close(w);
    CHECK(kiln_checkpoint_weights(ck, "tokenizer", &err) == NULL &&
          err.code == KILN_ERR_NOT_FOUND && strstr(err.msg, "tokenizer"));

    char path[PATH_MAX];
    CHECK(kiln_checkpoint_path(ck, "tokenizer", path, sizeof path, &err) == KILN_OK &&
          path[0] == '/' && strstr(path, "klein-tiny/tokenizer"));
    CHECK(kiln_checkpoint_path(ck, "tokenizer", path, 8, &err) != KILN_OK);
    /* vocab.json is a symlink (or a stub standing for one) to the shared
     * tokenizer data: the resolved file is the real 2.7 MB vocabulary */
    CHECKF(kiln_checkpoint_file(ck, "tokenizer", "vocab.json", path, sizeof path, &err) ==
               KILN_OK, "%s", err.msg);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && sb.st_size > 1000000);
    CHECK(kiln_checkpoint_file(ck, "tokenizer", "nope.json", path, sizeof path, &err) ==
              KILN_ERR_NOT_FOUND && strstr(err.msg, "tokenizer/") && !strstr(err.msg, "/work"));
    kiln_checkpoint_close(ck);

    /* base: not distilled; its text encoder and VAE are links to klein-tiny's */
    ck = kiln_checkpoint_open(oracle_path("ckpt/klein-base-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (ck) {
        CHECK(kiln_checkpoint_pipeline(ck) == KILN_PIPE_FLUX2_KLEIN);
        CHECK(kiln_checkpoint_is_distilled(ck) == 0);
        kiln_st *v = kiln_checkpoint_weights(ck, "vae", &err);
        CHECKF(v && kiln_st_count(v) == 251, "%s", err.msg);
        kiln_st_close(v);
        v = kiln_checkpoint_weights(ck, "text_encoder", &err);
        CHECKF(v && kiln_st_count(v) == 46, "%s", err.msg);
        kiln_st_close(v);
        kiln_checkpoint_close(ck);
    }

    ck = kiln_checkpoint_open(oracle_path("ckpt/zimage-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (ck) {
        CHECK(kiln_checkpoint_pipeline(ck) == KILN_PIPE_ZIMAGE);
        CHECK(kiln_checkpoint_is_distilled(ck) == 0);
        CHECK(cfg_int(ck, "transformer", "dim") == 128);
        CHECK(cfg_int(ck, "vae", "latent_channels") == 4);
        kiln_st *t = kiln_checkpoint_weights(ck, "text_encoder", &err);
        CHECKF(t && kiln_st_find(t, "embed_tokens.weight") && !kiln_st_find(t, "lm_head.weight"),
               "%s", err.msg);
        kiln_st_close(t);
        kiln_checkpoint_close(ck);
    }
}

/* Copies a checkpoint's model_index.json and component configs (no
 * weights) into the temporary folder, skipping one component. */
static const char *copy_configs(const char *src, const char *name, const char *skip)
{
    const char *dst = io_path(name);
    CHECK(mkdir(dst, 0755) == 0);
    char from[PATH_MAX], to[PATH_MAX];
    snprintf(from, sizeof from, "%s/model_index.json", src);
    snprintf(to, sizeof to, "%s/model_index.json", dst);
    kiln_err err = {0};
    cJSON *doc = kiln_json_load(from, "model_index.json", &err);
    CHECKF(doc && kiln_ckpt_write_json(to, doc, &err) == KILN_OK, "%s", err.msg);
    cJSON_Delete(doc);
    for (size_t i = 0; i < sizeof components / sizeof components[0]; i++) {
        const char *c = components[i];
        if (skip && !strcmp(c, skip))
            continue;
        const char *file = !strcmp(c, "scheduler") ? "scheduler_config.json"
                           : !strcmp(c, "tokenizer") ? "tokenizer_config.json"
                                                     : "config.json";
        snprintf(to, sizeof to, "%s/%s", dst, c);
        CHECK(mkdir(to, 0755) == 0);
        snprintf(from, sizeof from, "%s/%s/%s", src, c, file);
        snprintf(to, sizeof to, "%s/%s/%s", dst, c, file);
        doc = kiln_json_load(from, file, &err);
        CHECKF(doc && kiln_ckpt_write_json(to, doc, &err) == KILN_OK, "%s", err.msg);
        cJSON_Delete(doc);
    }
    return dst;
}

static void expect_open_fails(const char *dir, kiln_status code, const char *needle)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(dir, &err);
    CHECKF(ck == NULL, "%s opened", dir);
    kiln_checkpoint_close(ck);
    CHECKF(err.code == code, "got %s (%s)", kiln_status_name(err.code), err.msg);
    CHECKF(strstr(err.msg, needle) != NULL, "message '%s' lacks '%s'", err.msg, needle);
    CHECKF(!strstr(err.msg, "/work") && !strstr(err.msg, io_tmpdir()) && !strstr(err.msg, "/tmp"),
           "message leaks a path: %s", err.msg);
}

static void test_broken_folders(void)
{
    const char *src = oracle_path("ckpt/klein-tiny");
    const char *novae = copy_configs(src, "novae", "vae");
    expect_open_fails(novae, KILN_ERR_NOT_FOUND, "missing its vae/ component");

    /* the configs alone open; weights are only looked for on demand */
    const char *full = copy_configs(src, "configs-only", NULL);
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(full, &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (ck) {
        kiln_st *w = kiln_checkpoint_weights(ck, "vae", &err);
        CHECK(w == NULL && err.code == KILN_ERR_NOT_FOUND && strstr(err.msg, "vae") &&
              !strstr(err.msg, "/tmp"));
        kiln_checkpoint_close(ck);
    }

    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/transformer/config.json", full);
    CHECK(remove(p) == 0);
    expect_open_fails(full, KILN_ERR_NOT_FOUND, "transformer/ component has no config.json");
    CHECK(io_write_str(p, "{\"num_layers\": ") == 0);
    expect_open_fails(full, KILN_ERR_FORMAT, "transformer/config.json");

    const char *odd = io_path("odd");
    CHECK(mkdir(odd, 0755) == 0);
    expect_open_fails(odd, KILN_ERR_NOT_FOUND, "model_index.json");
    CHECK(io_write_str(io_path("odd/model_index.json"),
                       "{\"_class_name\": \"StableDiffusionPipeline\"}") == 0);
    expect_open_fails(odd, KILN_ERR_UNSUPPORTED, "StableDiffusionPipeline");
    CHECK(io_write_str(io_path("odd/model_index.json"), "{\"is_distilled\": true}") == 0);
    expect_open_fails(odd, KILN_ERR_FORMAT, "_class_name");
    CHECK(io_write_str(io_path("odd/model_index.json"),
                       "{\"_class_name\": \"ZImagePipeline\", \"vae\": [\"diffusers\", 3]}") == 0);
    expect_open_fails(odd, KILN_ERR_FORMAT, "vae");
    CHECK(io_write_str(io_path("odd/model_index.json"),
                       "{\"_class_name\": \"ZImagePipeline\", \"../etc\": [\"a\", \"b\"]}") == 0);
    expect_open_fails(odd, KILN_ERR_FORMAT, "plain folder name");
    /* optional components diffusers leaves out are [null, null] */
    CHECK(io_write_str(io_path("odd/model_index.json"),
                       "{\"_class_name\": \"Flux2KleinKVPipeline\", \"feature_extractor\": "
                       "[null, null]}") == 0);
    ck = kiln_checkpoint_open(odd, &err);
    CHECKF(ck && kiln_checkpoint_pipeline(ck) == KILN_PIPE_FLUX2_KLEIN_KV, "%s", err.msg);
    kiln_checkpoint_close(ck);
    /* a component kiln does not run may keep its settings elsewhere */
    CHECK(mkdir(io_path("odd/image_processor"), 0755) == 0);
    CHECK(io_write_str(io_path("odd/model_index.json"),
                       "{\"_class_name\": \"ZImagePipeline\", \"image_processor\": "
                       "[\"transformers\", \"CLIPImageProcessor\"]}") == 0);
    ck = kiln_checkpoint_open(odd, &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (ck) {
        CHECK(kiln_checkpoint_config(ck, "image_processor", &err) == NULL &&
              err.code == KILN_ERR_NOT_FOUND);
        CHECK(kiln_checkpoint_path(ck, "image_processor", p, sizeof p, &err) == KILN_OK);
        kiln_checkpoint_close(ck);
    }
    expect_open_fails(io_path("no-such-dir"), KILN_ERR_NOT_FOUND, "not found");
}

/* Every component of `a` has the same tensors (names, dtypes, shapes) and
 * the same config as in `b`. */
static void compare_checkpoints(const char *a, const char *b)
{
    kiln_err err = {0};
    kiln_checkpoint *ca = kiln_checkpoint_open(a, &err);
    CHECKF(ca != NULL, "%s", err.msg);
    kiln_checkpoint *cb = kiln_checkpoint_open(b, &err);
    CHECKF(cb != NULL, "%s", err.msg);
    if (!ca || !cb)
        goto out;
    CHECK(kiln_checkpoint_pipeline(ca) == kiln_checkpoint_pipeline(cb));
    CHECK(kiln_checkpoint_is_distilled(ca) == kiln_checkpoint_is_distilled(cb));
    /* kiln's tiny checkpoints also record the hidden states their DiT
     * takes (kiln_encode_layers_of); the oracle's do not */
    cJSON *ia = cJSON_Duplicate(kiln_checkpoint_index(ca), 1);
    cJSON_DeleteItemFromObjectCaseSensitive(ia, "text_encoder_out_layers");
    CHECK(cJSON_Compare(ia, kiln_checkpoint_index(cb), 1));
    cJSON_Delete(ia);
    for (size_t c = 0; c < sizeof components / sizeof components[0]; c++) {
        const char *comp = components[c];
        CHECKF(cJSON_Compare(kiln_checkpoint_config(ca, comp, &err),
                             kiln_checkpoint_config(cb, comp, &err), 1),
               "%s config differs", comp);
        if (!strcmp(comp, "scheduler") || !strcmp(comp, "tokenizer"))
            continue;
        kiln_st *sa = kiln_checkpoint_weights(ca, comp, &err);
        CHECKF(sa != NULL, "%s", err.msg);
        kiln_st *sb = kiln_checkpoint_weights(cb, comp, &err);
        CHECKF(sb != NULL, "%s", err.msg);
        if (sa && sb) {
            CHECKF(kiln_st_count(sa) == kiln_st_count(sb), "%s: %zu vs %zu tensors", comp,
                   kiln_st_count(sa), kiln_st_count(sb));
            for (size_t i = 0; i < kiln_st_count(sb); i++) {
                const kiln_st_tensor *tb = kiln_st_at(sb, i);
                const kiln_st_tensor *ta = kiln_st_find(sa, tb->name);
                CHECKF(ta && ta->dtype == tb->dtype && ta->ndim == tb->ndim &&
                           !memcmp(ta->shape, tb->shape, sizeof ta->shape),
                       "%s: tensor %s differs", comp, tb->name);
            }
        }
        kiln_st_close(sa);
        kiln_st_close(sb);
    }
    char pa[PATH_MAX], pb[PATH_MAX];
    static const char *tok[] = {"vocab.json", "merges.txt", "chat_template.jinja"};
    for (int i = 0; i < 3; i++) {
        struct stat s1, s2;
        CHECK(kiln_checkpoint_file(ca, "tokenizer", tok[i], pa, sizeof pa, &err) == KILN_OK);
        CHECK(kiln_checkpoint_file(cb, "tokenizer", tok[i], pb, sizeof pb, &err) == KILN_OK);
        CHECKF(stat(pa, &s1) == 0 && stat(pb, &s2) == 0 && s1.st_size == s2.st_size,
               "tokenizer %s differs", tok[i]);
    }
out:
    kiln_checkpoint_close(ca);
    kiln_checkpoint_close(cb);
}

/* The served name of a folder: its own name, or ORG/NAME for a Hugging
 * Face cache snapshot. */
static void test_model_name(void)
{
    char out[128];
    kiln_checkpoint_model_name("/models/FLUX.2-klein-4B/", out, sizeof out);
    CHECKF(!strcmp(out, "FLUX.2-klein-4B"), "%s", out);
    kiln_checkpoint_model_name("/x/hub/models--black-forest-labs--FLUX.2-klein-4B/snapshots/"
                               "0123456789abcdef0123456789abcdef01234567", out, sizeof out);
    CHECKF(!strcmp(out, "black-forest-labs/FLUX.2-klein-4B"), "%s", out);
    kiln_checkpoint_model_name("models--Tongyi-MAI--Z-Image-Turbo/snapshots/abc", out, sizeof out);
    CHECKF(!strcmp(out, "Tongyi-MAI/Z-Image-Turbo"), "%s", out);
    /* not a snapshot folder: the name as is; odd characters replaced */
    kiln_checkpoint_model_name("/x/snapshots/abc", out, sizeof out);
    CHECKF(!strcmp(out, "abc"), "%s", out);
    kiln_checkpoint_model_name("/x/my model\"", out, sizeof out);
    CHECKF(!strcmp(out, "my_model_"), "%s", out);
    kiln_checkpoint_model_name("/", out, sizeof out);
    CHECKF(!strcmp(out, "model"), "%s", out);
    kiln_checkpoint_model_name("/models/FLUX.2-klein-4B", out, 6);
    CHECKF(!strcmp(out, "FLUX."), "%s", out);
}

static int run_maker(const char *preset, const char *out, const char *seed)
{
    const char *build = getenv("KILN_BUILD_ROOT");
    const char *shared = getenv("KILN_SHARED");
    char cmd[3 * PATH_MAX];
    snprintf(cmd, sizeof cmd,
             "'%s/tools/kiln' make-checkpoint --preset %s --out '%s' --seed %s "
             "--tokenizer '%s/data/qwen3-tokenizer' 2>/dev/null",
             build ? build : ".", preset, out, seed, shared ? shared : "../shared");
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void test_make_checkpoint(void)
{
    CHECK(run_maker("tiny", io_path("made-tiny"), "7") == 0);
    compare_checkpoints(io_path("made-tiny"), oracle_path("ckpt/klein-tiny"));
    /* the tiny text encoder has 4 layers: the checkpoint names 1, 2, 3 so no
     * command needs --text-encoder-out-layers; the oracle's falls back to
     * diffusers' 9, 18, 27, as published checkpoints do */
    kiln_err lerr = {0};
    kiln_checkpoint *made = kiln_checkpoint_open(io_path("made-tiny"), &lerr);
    kiln_checkpoint *orc = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &lerr);
    int layers[KILN_MAX_OUT_LAYERS], n = 0;
    CHECK(made && kiln_encode_layers_of(made, layers, &n, &lerr) == KILN_OK && n == 3 &&
          layers[0] == 1 && layers[1] == 2 && layers[2] == 3);
    CHECK(orc && kiln_encode_layers_of(orc, layers, &n, &lerr) == KILN_OK && n == 3 &&
          layers[0] == 9 && layers[1] == 18 && layers[2] == 27);
    kiln_checkpoint_close(made);
    kiln_checkpoint_close(orc);
    CHECK(run_maker("zimage-tiny", io_path("made-zimage"), "7") == 0);
    compare_checkpoints(io_path("made-zimage"), oracle_path("ckpt/zimage-tiny"));
    made = kiln_checkpoint_open(io_path("made-zimage"), &lerr);
    CHECK(made && kiln_encode_layers_of(made, layers, &n, &lerr) == KILN_OK && n == 1 &&
          layers[0] == -2);
    kiln_checkpoint_close(made);

    /* same seed, same bytes; another seed, other values */
    CHECK(run_maker("tiny", io_path("made-tiny-b"), "7") == 0);
    CHECK(run_maker("tiny", io_path("made-tiny-c"), "8") == 0);
    kiln_err err = {0};
    kiln_st *a = kiln_st_open(io_path("made-tiny/vae"), "a", &err);
    kiln_st *b = kiln_st_open(io_path("made-tiny-b/vae"), "b", &err);
    kiln_st *c = kiln_st_open(io_path("made-tiny-c/vae"), "c", &err);
    CHECK(a && b && c);
    if (a && b && c) {
        const kiln_st_tensor *ta = kiln_st_find(a, "decoder.conv_in.weight");
        const kiln_st_tensor *tb = kiln_st_find(b, "decoder.conv_in.weight");
        const kiln_st_tensor *tc = kiln_st_find(c, "decoder.conv_in.weight");
        CHECK(ta && tb && tc && !memcmp(ta->data, tb->data, ta->nbytes) &&
              memcmp(ta->data, tc->data, ta->nbytes));
        /* batch-norm variances must be positive: the VAE divides by them */
        const kiln_st_tensor *var = kiln_st_find(a, "bn.running_var");
        int positive = var != NULL;
        for (int64_t i = 0; var && i < var->shape[0]; i++)
            positive &= kiln_bf16_to_f32(((const uint16_t *)var->data)[i]) > 0;
        CHECK(positive);
    }
    kiln_st_close(a);
    kiln_st_close(b);
    kiln_st_close(c);

    CHECK(run_maker("no-such-preset", io_path("x"), "1") == 2);
    CHECK(run_maker("tiny", io_path("y"), "-1") == 2);
}

/* Large components are written as shards plus an index; the reader must
 * see the same tensors as in one file. */
static void test_sharded_writer(void)
{
    kiln_arch_list l = {0};
    kiln_arch_flux2(&l, &(kiln_flux2_dims){2, 2, 2, 64, 48, 32, 256, 3.0, {16, 16, 16, 16}});
    CHECK(!l.oom && l.n == 49);
    const char *dir = io_path("shards");
    CHECK(mkdir(dir, 0755) == 0);
    kiln_err err = {0};
    CHECK(kiln_ckpt_write_weights(dir, "diffusion_pytorch_model", &l, 1, 1u << 20, &err) ==
          KILN_OK);
    CHECK(access(io_path("shards/diffusion_pytorch_model.safetensors.index.json"), F_OK) == 0);
    CHECK(access(io_path("shards/diffusion_pytorch_model.safetensors"), F_OK) != 0);
    kiln_st *st = kiln_st_open(dir, "transformer", &err);
    CHECKF(st && kiln_st_count(st) == l.n, "%s", err.msg);
    for (size_t i = 0; st && i < l.n; i++) {
        const kiln_st_tensor *t = kiln_st_expect(st, l.t[i].name, l.t[i].ndim, l.t[i].shape, &err);
        CHECKF(t && t->dtype == KILN_BF16, "%s", err.msg);
    }
    kiln_st_close(st);
    kiln_arch_list_free(&l);
}

/* The full-size Z-Image preset has the published transformer: 521
 * tensors, 6,154,908,736 parameters (z-image-turbo.md §1, §5). */
static void test_zimage_turbo_preset(void)
{
    const kiln_ckpt_preset *p = kiln_ckpt_preset_find("zimage-turbo");
    CHECK(p && p->zimage && !strcmp(p->pipeline, "ZImagePipeline") && !p->text.causal_lm);
    if (!p)
        return;
    kiln_arch_list l = {0};
    kiln_arch_zimage(&l, &p->zdit);
    CHECK(!l.oom && l.n == 521);
    CHECKF(kiln_arch_list_bytes(&l) == 2ull * 6154908736ull, "%llu bytes",
           (unsigned long long)kiln_arch_list_bytes(&l));
    kiln_arch_list_free(&l);
}

int main(void)
{
    RUN(test_open_oracle);
    RUN(test_broken_folders);
    RUN(test_make_checkpoint);
    RUN(test_model_name);
    RUN(test_sharded_writer);
    RUN(test_zimage_turbo_preset);
    return test_finish();
}
