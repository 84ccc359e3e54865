/* Z-Image DiT against the fp32 oracle (shared/oracle/cases) on the CPU
 * backend with the zimage-tiny checkpoint.
 *
 *   test_zimage_dit host     RoPE tables, patch layout, config and input errors
 *   test_zimage_dit debug    every sub-module of zimage_t2i_256's first forward
 *   test_zimage_dit dims     another configuration (dim 288, 3 heads of 96, A = 256
 *                            unlike D, one refiner block, random weights): a batch
 *                            of two captions of different padded lengths gives each
 *                            row the bytes it gets alone
 *   test_zimage_dit <case>   transformer_out.<k> of every DiT call of a case
 *                            (zimage_batch2_160x96: two captions of 10 and 75
 *                            tokens, so padded lengths 32 and 96, and 60 image
 *                            tokens padded to 64)
 *
 * Call k's input is the latents before step k (transformer_in0.x, then
 * latents_step.<k-1>), patchified, with the case's caption features and the
 * time (1000 - tau_k) / 1000 (spec/z-image-turbo.md §4 item 4). */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/latents.h"
#include "models/scheduler.h"
#include "models/zimage_dit.h"
#include "oracle_check.h"
#include "tests/test.h"
#include "tools/ckpt_write.h"

#define TOL 1e-4

static kiln_backend *be;

static kiln_zimage_dit *load_dit(const char *ckpt)
{
    kiln_checkpoint *ck = oracle_check_ckpt(ckpt);
    if (!ck)
        return NULL;
    kiln_err err = {0};
    kiln_zimage_dit *m = kiln_zimage_dit_load(be, ck, &err);
    CHECKF(m, "%s: %s", ckpt, err.msg);
    kiln_checkpoint_close(ck);
    return m;
}

static void upload3(kiln_tensor *t, int64_t B, int64_t S, int64_t C, const float *data)
{
    kiln_err err = {0};
    kiln_status rc = kiln_be_from_host(be, t, 3, (int64_t[]){B, S, C}, data, KILN_F32);
    CHECKF(!rc, "upload: %s", (kiln_be_check(be, &err), err.msg));
}

/* One case's DiT inputs: patch tokens of latents (B, C, 2h, 2w) and the
 * caption features padded to the longest. */
typedef struct inputs {
    int64_t B, C, h, w, T, cap_len[4];
    kiln_tensor x, cap, out;
    float t[4];
} inputs;

static void set_latents(inputs *in, const float *lat)
{
    const int64_t P = in->C * 4, N = in->h * in->w;
    float *tok = malloc((size_t)(in->B * N * P) * sizeof(float));
    kiln_latents_zimage_patchify(lat, tok, in->B, in->C, 2, in->h, in->w);
    kiln_be_free(be, &in->x);
    upload3(&in->x, in->B, N, P, tok);
    free(tok);
}

static int load_inputs(inputs *in, const kiln_st *ref, int64_t B, int64_t C, int64_t h,
                       int64_t w, int64_t Cc)
{
    memset(in, 0, sizeof *in);
    in->B = B, in->C = C, in->h = h, in->w = w;
    float *caps[4] = {0};
    for (int64_t b = 0; b < B; b++) {
        char name[64];
        int64_t n = 0;
        snprintf(name, sizeof name, "transformer_in0.cap_feats.%lld", (long long)b);
        caps[b] = oracle_check_f32(ref, name, &n);
        if (!caps[b])
            return 0;
        in->cap_len[b] = n / Cc;
        if (in->cap_len[b] > in->T)
            in->T = in->cap_len[b];
    }
    float *cap = calloc((size_t)(B * in->T * Cc), sizeof(float));
    for (int64_t b = 0; b < B; b++) {
        memcpy(cap + b * in->T * Cc, caps[b], (size_t)(in->cap_len[b] * Cc) * sizeof(float));
        free(caps[b]);
    }
    upload3(&in->cap, B, in->T, Cc, cap);
    free(cap);
    float *x = oracle_check_f32(ref, "transformer_in0.x", NULL);
    if (!x)
        return 0;
    set_latents(in, x);
    free(x);
    kiln_be_alloc(be, &in->out, be->act_dtype, 3, (int64_t[]){B, h * w, C * 4});
    return 1;
}

static void free_inputs(inputs *in)
{
    kiln_be_free(be, &in->x), kiln_be_free(be, &in->cap), kiln_be_free(be, &in->out);
}

static kiln_status forward(kiln_zimage_dit *m, inputs *in, kiln_zimage_probe_fn probe,
                           void *user, kiln_err *err)
{
    kiln_zimage_dit_input di = {.x = &in->x, .h = in->h, .w = in->w, .cap = &in->cap,
                                .cap_len = in->cap_len, .t = in->t, .probe = probe,
                                .probe_user = user};
    return kiln_zimage_dit_forward(m, &di, &in->out, err);
}

/* Compares the output (B, N, P) with a reference latent-shaped tensor. */
static void compare_out(const inputs *in, const float *ref_lat, const char *what, double tol)
{
    const int64_t n = in->B * in->h * in->w * in->C * 4;
    float *want = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
    kiln_latents_zimage_patchify(ref_lat, want, in->B, in->C, 2, in->h, in->w);
    kiln_be_download(be, &in->out, got);
    oracle_check_close(what, got, want, (size_t)n, tol);
    free(want), free(got);
}

/* --- host helpers ----------------------------------------------------------- */

static void test_rope_table(void)
{
    const int64_t dims[3] = {16, 24, 24};
    int32_t ids[6] = {0, 0, 0, 1000, 7, 300};
    float c[2 * 64], s[2 * 64];
    kiln_zimage_rope_table(ids, 2, dims, 256.0, c, s);
    CHECK(c[0] == 1.0f && s[0] == 0.0f && c[63] == 1.0f && s[63] == 0.0f);
    /* Pairs repeat; the angle is rounded to fp32 before cosf: 1000 * 1 is
     * exact, and axis 1's second frequency is 256^(-2/24). */
    CHECK(c[64] == c[65] && c[64] == cosf(1000.0f) && s[64] == sinf(1000.0f));
    double om = 1.0 / pow(256.0, 2.0 / 24.0);
    CHECK(c[64 + 16 + 2] == cosf((float)(7.0 * om)));
    CHECK(s[64 + 40 + 2] == sinf((float)(300.0 * om)));
}

static void test_patch_layout(void)
{
    /* B 1, C 2, h 1, w 2: latent (2, 2, 4). */
    float lat[16], tok[16], back[16];
    for (int i = 0; i < 16; i++)
        lat[i] = (float)i;
    kiln_latents_zimage_patchify(lat, tok, 1, 2, 2, 1, 2);
    /* token 1 (x = 1), feature (py*2 + px)*C + c for py 1, px 0, c 1:
     * latent[1, 1, 2] = 8 + 4 + 2. */
    CHECK(tok[8 + (2 + 0) * 2 + 1] == 14.0f);
    CHECK(tok[0] == 0.0f && tok[1] == 8.0f && tok[2] == 1.0f);
    kiln_latents_zimage_unpatchify(tok, back, 1, 2, 2, 1, 2);
    CHECK(!memcmp(lat, back, sizeof lat));
}

static kiln_status parse(const char *json, kiln_zimage_dit_config *c, kiln_err *err)
{
    cJSON *doc = cJSON_Parse(json);
    kiln_status st = kiln_zimage_dit_config_parse(doc, c, err);
    cJSON_Delete(doc);
    return st;
}

static void test_config(void)
{
    kiln_zimage_dit_config c;
    kiln_err err = {0};
    const char *base = "\"dim\": 3840, \"n_layers\": 30, \"n_heads\": 30, \"cap_feat_dim\": 2560, "
                       "\"in_channels\": 16";
    char doc[512];
    snprintf(doc, sizeof doc, "{%s, \"axes_lens\": [1536, 512, 512]}", base);
    CHECK(parse(doc, &c, &err) == KILN_OK);
    CHECK(c.head_dim == 128 && c.adaln_dim == 256 && c.ffn_hidden == 10240 &&
          c.patch_features == 64 && c.n_refiner_layers == 2 && c.axes_lens[0] == 1536 &&
          c.axes_dims[1] == 48 && c.rope_theta == 256.0 && c.qk_norm);
    snprintf(doc, sizeof doc, "{%s, \"siglip_feat_dim\": 1152}", base);
    CHECK(parse(doc, &c, &err) == KILN_ERR_UNSUPPORTED);
    snprintf(doc, sizeof doc, "{%s, \"all_patch_size\": [2, 4]}", base);
    CHECK(parse(doc, &c, &err) == KILN_ERR_UNSUPPORTED);
    snprintf(doc, sizeof doc, "{%s, \"n_kv_heads\": 10}", base);
    CHECK(parse(doc, &c, &err) == KILN_ERR_UNSUPPORTED);
    snprintf(doc, sizeof doc, "{%s, \"axes_dims\": [32, 48, 50]}", base);
    CHECK(parse(doc, &c, &err) == KILN_ERR_FORMAT && strstr(err.msg, "axes_dims"));
    CHECK(parse("{\"dim\": 128, \"n_layers\": 2, \"n_heads\": 2, \"in_channels\": 4}", &c, &err) ==
          KILN_ERR_FORMAT && strstr(err.msg, "cap_feat_dim"));
}

static void test_bad_inputs(void)
{
    kiln_zimage_dit *m = load_dit("ckpt/zimage-tiny");
    if (!m)
        return;
    inputs in = {.B = 1, .C = 4, .h = 2, .w = 2, .T = 3, .cap_len = {3}, .t = {0.5f}};
    float zeros[4 * 16 * 3] = {0};
    upload3(&in.x, 1, 4, 16, zeros);
    upload3(&in.cap, 1, 3, 16, zeros);
    kiln_be_alloc(be, &in.out, be->act_dtype, 3, (int64_t[]){1, 4, 16});
    kiln_err err = {0};
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_OK);
    in.cap_len[0] = 4;
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_ERR_INVALID && strstr(err.msg, "caption"));
    in.cap_len[0] = 0;
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_ERR_INVALID);
    in.cap_len[0] = 3;
    in.t[0] = NAN;
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_ERR_INVALID && strstr(err.msg, "timestep"));
    in.t[0] = 0.5f;
    in.w = 1; /* 2 tokens, x has 4 */
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_ERR_INVALID && strstr(err.msg, "x has"));
    in.h = 1, in.w = 600; /* outside axes_lens */
    CHECK(forward(m, &in, NULL, NULL, &err) == KILN_ERR_INVALID && strstr(err.msg, "RoPE"));
    free_inputs(&in);
    kiln_zimage_dit_destroy(m);
}

/* --- debug tensors of the first forward ---------------------------------------- */

typedef struct probe_ctx {
    const kiln_st *dbg;
    int64_t N, L; /* real image and caption rows */
    int seen;
} probe_ctx;

static void on_probe(void *user, const char *module, const kiln_tensor *t)
{
    probe_ctx *p = user;
    char name[96];
    snprintf(name, sizeof name, "dbg.transformer.%s.call0", module);
    int64_t n = 0;
    float *want = oracle_check_f32(p->dbg, name, &n);
    if (!want)
        return;
    int64_t rows = kiln_tensor_rows(t), cols = kiln_tensor_cols(t);
    float *got = malloc((size_t)(rows * cols) * sizeof(float));
    kiln_be_download(be, t, got);
    /* The embedders' outputs are compared on real rows (the oracle's hook
     * may have seen the pad tokens written over its output or not); the
     * final layer's oracle output has every row of [image ; caption], ours
     * the image rows. */
    int64_t use = rows;
    if (!strcmp(module, "cap_embedder"))
        use = p->L;
    CHECKF(use * cols <= n, "%s: %lld x %lld, oracle has %lld values", module, (long long)use,
           (long long)cols, (long long)n);
    if (use * cols <= n)
        oracle_check_close(name, got, want, (size_t)(use * cols), TOL);
    p->seen++;
    free(got);
    free(want);
}

static void test_debug_tensors(void)
{
    kiln_st *ref = oracle_check_open("zimage_t2i_256", "ref_fp32.safetensors");
    kiln_st *dbg = oracle_check_open("zimage_t2i_256", "debug_fp32.safetensors");
    kiln_zimage_dit *m = load_dit("ckpt/zimage-tiny");
    inputs in;
    if (ref && dbg && m && load_inputs(&in, ref, 1, 4, 16, 16, 16)) {
        float *t = oracle_check_f32(ref, "transformer_in0.t", NULL);
        in.t[0] = t ? t[0] : 0;
        free(t);
        probe_ctx p = {dbg, 256, in.cap_len[0], 0};
        kiln_err err = {0};
        CHECKF(!forward(m, &in, on_probe, &p, &err), "forward: %s", err.msg);
        /* t_embedder, both embedders, 2 + 2 refiners, 2 layers, final */
        CHECKF(p.seen == 10, "%d probes", p.seen);
        float *want = oracle_check_f32(ref, "transformer_out.0", NULL);
        if (want)
            compare_out(&in, want, "transformer_out.0", TOL);
        free(want);
        free_inputs(&in);
    }
    kiln_zimage_dit_destroy(m);
    kiln_st_close(dbg);
    kiln_st_close(ref);
}

/* --- every call of a case --------------------------------------------------------- */

static void run_case(const char *name, int64_t B, int64_t h, int64_t w)
{
    cJSON *meta = oracle_check_meta(name);
    kiln_st *ref = oracle_check_open(name, "ref_fp32.safetensors");
    kiln_zimage_dit *m = load_dit("ckpt/zimage-tiny");
    inputs in;
    if (meta && ref && m && load_inputs(&in, ref, B, 4, h, w, 16)) {
        int64_t steps = 0;
        float *tau = oracle_check_f32(ref, "timesteps", &steps);
        for (int64_t k = 0; tau && k < steps; k++) {
            char what[64];
            if (k > 0) {
                snprintf(what, sizeof what, "latents_step.%lld", (long long)(k - 1));
                float *lat = oracle_check_f32(ref, what, NULL);
                if (!lat)
                    break;
                set_latents(&in, lat);
                free(lat);
            }
            for (int64_t b = 0; b < B; b++)
                in.t[b] = kiln_sched_zimage_dit_input(tau[k]);
            if (k == 0) {
                float *t0 = oracle_check_f32(ref, "transformer_in0.t", NULL);
                CHECKF(t0 && t0[0] == in.t[0], "call 0 time %g vs oracle %g", in.t[0],
                       t0 ? t0[0] : NAN);
                free(t0);
            }
            kiln_err err = {0};
            CHECKF(!forward(m, &in, NULL, NULL, &err), "call %lld: %s", (long long)k, err.msg);
            snprintf(what, sizeof what, "transformer_out.%lld", (long long)k);
            float *want = oracle_check_f32(ref, what, NULL);
            if (want)
                compare_out(&in, want, what, TOL);
            free(want);
        }
        free(tau);
        free_inputs(&in);
    }
    kiln_zimage_dit_destroy(m);
    kiln_st_close(ref);
    cJSON_Delete(meta);
}

/* --- another configuration --------------------------------------------------- */

static const char *const linked[] = {"model_index.json", "scheduler", "text_encoder", "tokenizer",
                                     "vae"};

/* A checkpoint folder in /tmp: zimage-tiny's other components linked, a
 * transformer of other dimensions with random weights.  dir gets its path. */
static int make_dims_checkpoint(char *dir)
{
    char src[PATH_MAX], a[PATH_MAX + 64], b[PATH_MAX + 64];
    if (!realpath(oracle_path("ckpt/zimage-tiny"), src))
        return -1;
    snprintf(dir, PATH_MAX, "/tmp/kiln-zdims-XXXXXX");
    if (!mkdtemp(dir))
        return -1;
    for (size_t i = 0; i < sizeof linked / sizeof *linked; i++) {
        snprintf(a, sizeof a, "%s/%s", src, linked[i]);
        snprintf(b, sizeof b, "%s/%s", dir, linked[i]);
        if (symlink(a, b))
            return -1;
    }
    snprintf(b, sizeof b, "%s/transformer", dir);
    if (mkdir(b, 0755))
        return -1;
    kiln_zimage_dims d = {288, 3, 2, 1, 4, 16, 2, 1, {32, 32, 32}, {1536, 512, 512}};
    kiln_arch_list l = {0};
    kiln_arch_zimage(&l, &d);
    kiln_err err = {0};
    cJSON *cfg = cJSON_Parse(
        "{\"_class_name\": \"ZImageTransformer2DModel\", \"all_patch_size\": [2], "
        "\"all_f_patch_size\": [1], \"in_channels\": 4, \"dim\": 288, \"n_layers\": 2, "
        "\"n_refiner_layers\": 1, \"n_heads\": 3, \"n_kv_heads\": 3, \"norm_eps\": 1e-05, "
        "\"qk_norm\": true, \"cap_feat_dim\": 16, \"rope_theta\": 256.0, \"t_scale\": 1000.0, "
        "\"axes_dims\": [32, 32, 32], \"axes_lens\": [1536, 512, 512], "
        "\"siglip_feat_dim\": null}");
    int rc = l.oom || !cfg ||
             kiln_ckpt_write_weights(b, "diffusion_pytorch_model", &l, 11, 1ull << 40, &err);
    char path[2 * PATH_MAX];
    snprintf(path, sizeof path, "%s/transformer/config.json", dir);
    rc = rc || kiln_ckpt_write_json(path, cfg, &err);
    CHECKF(!rc, "%s", err.msg);
    cJSON_Delete(cfg);
    kiln_arch_list_free(&l);
    return rc ? -1 : 0;
}

static void remove_dims_checkpoint(const char *dir)
{
    char p[PATH_MAX + 64];
    for (size_t i = 0; i < sizeof linked / sizeof *linked; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, linked[i]);
        unlink(p);
    }
    snprintf(p, sizeof p, "%s/transformer/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/transformer/diffusion_pytorch_model.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/transformer", dir);
    rmdir(p);
    rmdir(dir);
}

static void test_other_dims(void)
{
    char dir[PATH_MAX];
    if (make_dims_checkpoint(dir)) {
        CHECKF(0, "cannot make the checkpoint");
        return;
    }
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(dir, &err);
    kiln_zimage_dit *m = ck ? kiln_zimage_dit_load(be, ck, &err) : NULL;
    CHECKF(m, "%s", err.msg);
    kiln_checkpoint_close(ck);
    if (m) {
        const kiln_zimage_dit_config *c = kiln_zimage_dit_get_config(m);
        CHECK(c->adaln_dim == 256 && c->head_dim == 96 && c->ffn_hidden == 768 &&
              c->patch_features == 16);
        /* 3 x 4 tokens (padded to 32), captions of 5 and 40 tokens (32 and 64) */
        const int64_t h = 3, w = 4, N = h * w, T = 40, P = 16, Cc = 16;
        float *x = malloc((size_t)(2 * N * P) * sizeof *x);
        float *cap = malloc((size_t)(2 * T * Cc) * sizeof *cap);
        for (int64_t i = 0; i < 2 * N * P; i++)
            x[i] = sinf(0.37f * (float)i);
        for (int64_t i = 0; i < 2 * T * Cc; i++)
            cap[i] = cosf(0.11f * (float)i);
        inputs two = {.B = 2, .C = 4, .h = h, .w = w, .T = T, .cap_len = {5, 40}, .t = {0.25f, 0.8f}};
        upload3(&two.x, 2, N, P, x);
        upload3(&two.cap, 2, T, Cc, cap);
        kiln_be_alloc(be, &two.out, be->act_dtype, 3, (int64_t[]){2, N, P});
        CHECKF(!forward(m, &two, NULL, NULL, &err), "%s", err.msg);
        float *both = malloc((size_t)(2 * N * P) * sizeof *both);
        kiln_be_download(be, &two.out, both);
        int finite = 1;
        for (int64_t i = 0; i < 2 * N * P; i++)
            finite &= isfinite(both[i]) != 0;
        CHECK(finite);
        for (int b = 0; b < 2; b++) {
            inputs one = {.B = 1, .C = 4, .h = h, .w = w, .T = T, .cap_len = {two.cap_len[b]},
                          .t = {two.t[b]}};
            upload3(&one.x, 1, N, P, x + b * N * P);
            upload3(&one.cap, 1, T, Cc, cap + b * T * Cc);
            kiln_be_alloc(be, &one.out, be->act_dtype, 3, (int64_t[]){1, N, P});
            CHECKF(!forward(m, &one, NULL, NULL, &err), "%s", err.msg);
            float *alone = malloc((size_t)(N * P) * sizeof *alone);
            kiln_be_download(be, &one.out, alone);
            CHECKF(!memcmp(alone, both + b * N * P, (size_t)(N * P) * sizeof *alone),
                   "row %d differs from its run alone", b);
            free(alone);
            free_inputs(&one);
        }
        free(both), free(x), free(cap);
        free_inputs(&two);
    }
    kiln_zimage_dit_destroy(m);
    remove_dims_checkpoint(dir);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: KILN_SHARED=... %s host|debug|dims|<zimage case>\n", argv[0]);
        return 2;
    }
    be = oracle_cpu_backend();
    const char *what = argv[1];
    if (!strcmp(what, "host")) {
        RUN(test_rope_table);
        RUN(test_patch_layout);
        RUN(test_config);
        RUN(test_bad_inputs);
    } else if (!strcmp(what, "debug")) {
        RUN(test_debug_tensors);
    } else if (!strcmp(what, "dims")) {
        RUN(test_other_dims);
    } else if (!strcmp(what, "zimage_t2i_256")) {
        run_case(what, 1, 16, 16);
    } else if (!strcmp(what, "zimage_batch2_160x96")) {
        run_case(what, 2, 10, 6);
    } else {
        CHECKF(0, "unknown test '%s'", what);
    }
    kiln_backend_destroy(be);
    return test_finish();
}
