/* FLUX.2 klein DiT against the fp32 oracle (shared/oracle/cases) on the CPU
 * backend with the klein-tiny checkpoints.
 *
 *   test_flux2_dit host        time projection, RoPE tables, config and input errors
 *   test_flux2_dit debug       every sub-module of klein_t2i_256's first forward
 *   test_flux2_dit batch_rows  a row's output does not depend on its batch
 *   test_flux2_dit <case>      transformer_out.<k> of every DiT call of a klein case
 *
 * Inputs of call k are rebuilt the way the pipeline does (spec/pipeline.md
 * §6, §7, §9): the latents before step i are latents_init_packed or
 * latents_step.<i-1>, edit cases append (or, in the KV case's first step,
 * prepend) image_latents_packed, the CFG case runs the prompt and the empty
 * negative prompt, and the time is the fp32 chain of the case's timesteps. */
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/flux2_dit.h"
#include "models/scheduler.h"
#include "oracle_check.h"
#include "tests/test.h"

#define TOL 1e-4

static kiln_backend *be;

/* --- helpers ------------------------------------------------------------- */

static kiln_flux2_dit *load_dit(const char *ckpt)
{
    kiln_checkpoint *ck = oracle_check_ckpt(ckpt);
    if (!ck)
        return NULL;
    kiln_err err = {0};
    kiln_flux2_dit *m = kiln_flux2_dit_load(be, ck, &err);
    CHECKF(m, "%s: %s", ckpt, err.msg);
    kiln_checkpoint_close(ck);
    return m;
}

static const kiln_st_tensor *find(const kiln_st *st, const char *name)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    CHECKF(t, "tensor %s missing", name);
    return t;
}

/* Uploads host floats as a (B, S, C) backend tensor. */
static void upload3(kiln_tensor *t, int64_t B, int64_t S, int64_t C, const float *data)
{
    kiln_err err = {0};
    kiln_status rc = kiln_be_from_host(be, t, 3, (int64_t[]){B, S, C}, data, KILN_F32);
    CHECKF(!rc, "upload: %s", (kiln_be_check(be, &err), err.msg));
}

/* Downloads t and compares it with reference `ref` (numel floats);
 * prints the error. */
static void compare(const kiln_tensor *t, const float *ref, int64_t numel, const char *what)
{
    int64_t n = kiln_tensor_numel(t);
    CHECKF(n == numel, "%s: %lld elements, reference has %lld", what, (long long)n,
           (long long)numel);
    if (n != numel)
        return;
    float *got = malloc((size_t)n * sizeof(float));
    kiln_be_download(be, t, got);
    oracle_check_close(what, got, ref, (size_t)n, TOL);
    free(got);
}

/* --- host helpers ---------------------------------------------------------- */

static void test_time_proj(void)
{
    float e[256];
    kiln_flux2_time_proj(0.0f, 256, e);
    CHECK(e[0] == 1.0f && e[127] == 1.0f && e[128] == 0.0f && e[255] == 0.0f);
    kiln_flux2_time_proj(1000.0f, 256, e);
    CHECK_NEAR(e[0], cosf(1000.0f), 1e-6);
    CHECK_NEAR(e[128], sinf(1000.0f), 1e-6);
    /* The lowest frequency is exp(-ln(1e4) * 127/128). */
    CHECK_NEAR(e[127], cosf(1000.0f * expf(-9.21034037f * 127.0f / 128.0f)), 1e-6);
}

/* pos_embed.call0 is the image ids' (cos, sin), call1 the text ids'. */
static void test_rope_tables(void)
{
    kiln_st *dbg = oracle_check_open("klein_t2i_256", "debug_fp32.safetensors");
    kiln_st *ref = oracle_check_open("klein_t2i_256", "ref_fp32.safetensors");
    if (!dbg || !ref)
        goto out;
    const int64_t axes[4] = {16, 16, 16, 16};
    const char *ids_key[2] = {"transformer_in0.img_ids", "transformer_in0.txt_ids"};
    for (int call = 0; call < 2; call++) {
        int64_t S, n;
        int32_t *ids = oracle_check_ids(ref, ids_key[call], &S);
        float *cs = malloc((size_t)S * 64 * sizeof(float)), *sn = malloc((size_t)S * 64 * 4);
        kiln_flux2_rope_table(ids, S, axes, 2000.0, cs, sn);
        char key[96];
        snprintf(key, sizeof key, "dbg.transformer.pos_embed.call%d.0", call);
        float *rc = oracle_check_f32(dbg, key, &n);
        snprintf(key, sizeof key, "dbg.transformer.pos_embed.call%d.1", call);
        float *rs = oracle_check_f32(dbg, key, &n);
        if (rc && rs && n == S * 64) {
            double ec = test_rel_err(cs, rc, (size_t)n), es = test_rel_err(sn, rs, (size_t)n);
            CHECKF(ec < 1e-7 && es < 1e-7, "rope call%d: cos %.3g sin %.3g", call, ec, es);
        } else {
            CHECKF(0, "rope call%d: reference shape", call);
        }
        free(ids);
        free(cs);
        free(sn);
        free(rc);
        free(rs);
    }
out:
    kiln_st_close(dbg);
    kiln_st_close(ref);
}

static void expect_config_error(const char *json, kiln_status want, const char *what)
{
    cJSON *cfg = cJSON_Parse(json);
    kiln_flux2_dit_config c;
    kiln_err err = {0};
    kiln_status rc = kiln_flux2_dit_config_parse(cfg, &c, &err);
    CHECKF(rc == want, "%s: got %s (%s)", what, kiln_status_name(rc), err.msg);
    cJSON_Delete(cfg);
}

#define CFG_BASE                                                                               \
    "\"num_layers\": 2, \"num_single_layers\": 2, \"num_attention_heads\": 2, "               \
    "\"attention_head_dim\": 64, \"joint_attention_dim\": 48, \"in_channels\": 32"

static void test_config(void)
{
    cJSON *cfg = cJSON_Parse("{" CFG_BASE ", \"out_channels\": null, \"axes_dims_rope\": "
                             "[16, 16, 16, 16], \"guidance_embeds\": false}");
    kiln_flux2_dit_config c;
    kiln_err err = {0};
    CHECKF(!kiln_flux2_dit_config_parse(cfg, &c, &err), "%s", err.msg);
    CHECK(c.hidden == 128 && c.mlp_hidden == 384 && c.out_channels == 32 &&
          c.time_channels == 256 && c.rope_theta == 2000.0 && c.eps == 1e-6);
    cJSON_Delete(cfg);
    expect_config_error("{" CFG_BASE ", \"axes_dims_rope\": [16,16,16,16], \"guidance_embeds\": "
                        "true}", KILN_ERR_UNSUPPORTED, "guidance_embeds");
    expect_config_error("{" CFG_BASE ", \"axes_dims_rope\": [16,16,16,8]}", KILN_ERR_FORMAT,
                        "axes sum");
    expect_config_error("{" CFG_BASE ", \"axes_dims_rope\": [32,32]}", KILN_ERR_UNSUPPORTED,
                        "two axes");
    expect_config_error("{" CFG_BASE ", \"axes_dims_rope\": [16,16,16,16], \"patch_size\": 2}",
                        KILN_ERR_UNSUPPORTED, "patch size");
    expect_config_error("{\"num_layers\": 2}", KILN_ERR_FORMAT, "missing keys");
}

/* Wrong shapes and modes fail cleanly, and the model still works after. */
static void test_bad_inputs(void)
{
    kiln_flux2_dit *m = load_dit("ckpt/klein-tiny");
    if (!m)
        return;
    kiln_flux2_kv_cache *kv = kiln_flux2_kv_cache_create(m, &(kiln_err){0});
    const int64_t T = 3, N = 4;
    float *zeros = calloc(2 * T * 48 + 2 * N * 32, sizeof(float));
    int32_t ids[(3 + 4) * 4] = {0};
    float t[2] = {500.0f, 500.0f};
    kiln_tensor x, x_bad, txt, out, out_bad;
    upload3(&x, 1, N, 32, zeros);
    upload3(&x_bad, 1, N, 16, zeros);
    upload3(&txt, 1, T, 48, zeros);
    upload3(&out, 1, N, 32, zeros);
    upload3(&out_bad, 1, N - 1, 32, zeros);
    kiln_flux2_dit_input in = {.x = &x, .txt = &txt, .t = t, .img_ids = ids, .txt_ids = ids};
    kiln_err err = {0};
    kiln_flux2_dit_input bad = in;
    bad.x = &x_bad;
    CHECK(kiln_flux2_dit_forward(m, &bad, &out, &err) == KILN_ERR_INVALID);
    CHECK(kiln_flux2_dit_forward(m, &in, &out_bad, &err) == KILN_ERR_INVALID);
    bad = in;
    bad.kv_mode = KILN_FLUX2_KV_CACHED;
    bad.kv = kv;
    CHECKF(kiln_flux2_dit_forward(m, &bad, &out, &err) == KILN_ERR_INVALID, "empty cache");
    bad.kv_mode = KILN_FLUX2_KV_EXTRACT;
    bad.num_ref = N;
    CHECKF(kiln_flux2_dit_forward(m, &bad, &out, &err) == KILN_ERR_INVALID, "all rows refs");
    bad.num_ref = 1;
    CHECKF(kiln_flux2_dit_forward(m, &bad, &out, &err) == KILN_ERR_INVALID, "extract out rows");
    float nan_t = NAN;
    bad = in;
    bad.t = &nan_t;
    CHECK(kiln_flux2_dit_forward(m, &bad, &out, &err) == KILN_ERR_INVALID);
    CHECKF(kiln_flux2_dit_forward(m, &in, &out, &err) == KILN_OK, "%s", err.msg);
    kiln_be_free(be, &x);
    kiln_be_free(be, &x_bad);
    kiln_be_free(be, &txt);
    kiln_be_free(be, &out);
    kiln_be_free(be, &out_bad);
    free(zeros);
    kiln_flux2_kv_cache_destroy(kv);
    kiln_flux2_dit_destroy(m);
}

/* --- debug tensors of the first forward -------------------------------------- */

typedef struct probe_ctx {
    kiln_st *dbg;
    int seen;
} probe_ctx;

static void on_probe(void *user, const char *module, int part, const kiln_tensor *t)
{
    probe_ctx *p = user;
    char key[160];
    if (part < 0)
        snprintf(key, sizeof key, "dbg.transformer.%s.call0", module);
    else
        snprintf(key, sizeof key, "dbg.transformer.%s.call0.%d", module, part);
    int64_t n;
    float *ref = oracle_check_f32(p->dbg, key, &n);
    if (!ref)
        return;
    compare(t, ref, n, key);
    free(ref);
    p->seen++;
}

static void test_debug_tensors(void)
{
    kiln_st *dbg = oracle_check_open("klein_t2i_256", "debug_fp32.safetensors");
    kiln_st *ref = oracle_check_open("klein_t2i_256", "ref_fp32.safetensors");
    kiln_flux2_dit *m = load_dit("ckpt/klein-tiny");
    if (!dbg || !ref || !m)
        goto out;
    int64_t nx, ntxt, N, T, nt;
    float *x = oracle_check_f32(ref, "transformer_in0.hidden_states", &nx);
    float *txt = oracle_check_f32(ref, "transformer_in0.encoder_hidden_states", &ntxt);
    float *sigma = oracle_check_f32(ref, "transformer_in0.timestep", &nt);
    int32_t *img_ids = oracle_check_ids(ref, "transformer_in0.img_ids", &N);
    int32_t *txt_ids = oracle_check_ids(ref, "transformer_in0.txt_ids", &T);
    if (x && txt && sigma && img_ids && txt_ids) {
        kiln_tensor xt, tt, out;
        upload3(&xt, 1, N, 32, x);
        upload3(&tt, 1, T, 48, txt);
        kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){1, N, 32});
        /* fp32 pipeline: the network multiplies the fp32 sigma by 1000. */
        float t = sigma[0] * 1000.0f;
        probe_ctx pc = {dbg, 0};
        kiln_flux2_dit_input in = {.x = &xt, .txt = &tt, .t = &t, .img_ids = img_ids,
                                   .txt_ids = txt_ids, .probe = on_probe, .probe_user = &pc};
        kiln_err err = {0};
        CHECKF(!kiln_flux2_dit_forward(m, &in, &out, &err), "%s", err.msg);
        /* embedders 2, temb, modulations 3, 2 x 2 double streams, 2 single,
         * norm_out, proj_out */
        CHECKF(pc.seen == 14, "%d probes compared", pc.seen);
        int64_t no;
        float *want = oracle_check_f32(ref, "transformer_out.0", &no);
        if (want)
            compare(&out, want, no, "transformer_out.0");
        free(want);
        kiln_be_free(be, &xt);
        kiln_be_free(be, &tt);
        kiln_be_free(be, &out);
    }
    free(x);
    free(txt);
    free(sigma);
    free(img_ids);
    free(txt_ids);
out:
    kiln_flux2_dit_destroy(m);
    kiln_st_close(dbg);
    kiln_st_close(ref);
}

/* --- every DiT call of a case -------------------------------------------------- */

typedef struct case_info {
    const char *name;
    const char *ckpt;
    int cfg; /* two calls per step: prompt, then "" */
    int kv;  /* KV pipeline: extract at step 0, cached after */
} case_info;

static const case_info cases[] = {
    {"klein_t2i_256", "ckpt/klein-tiny", 0, 0},
    {"klein_t2i_batch2", "ckpt/klein-tiny", 0, 0},
    {"klein_edit_1ref", "ckpt/klein-tiny", 0, 0},
    {"klein_base_cfg_256", "ckpt/klein-base-tiny", 1, 0},
    {"klein_kv_edit_1ref", "ckpt/klein-tiny", 0, 1},
};

/* Everything a case's calls share, read once. */
typedef struct case_data {
    int64_t B, N, T, R, steps;
    float *taus;
    float *lat_init;             /* (B, N, C) */
    float *ref_tokens;           /* (B, R, C) or NULL */
    int32_t *lat_ids, *ref_ids;  /* (N, 4), (R, 4) */
    int32_t *txt_ids[2];         /* prompt, negative */
    kiln_tensor txt[2];          /* (B, T, J) */
} case_data;

static int read_case(const case_info *ci, const kiln_st *st, case_data *cd)
{
    int64_t n;
    const kiln_st_tensor *lat = find(st, "latents_init_packed");
    if (!lat)
        return -1;
    cd->B = lat->shape[0];
    cd->N = lat->shape[1];
    cd->lat_init = oracle_check_f32(st, "latents_init_packed", &n);
    cd->taus = oracle_check_f32(st, "timesteps", &cd->steps);
    cd->lat_ids = oracle_check_ids(st, "latent_ids", &n);
    if (kiln_st_find(st, "image_latents_packed")) {
        cd->ref_tokens = oracle_check_f32(st, "image_latents_packed", &n);
        cd->ref_ids = oracle_check_ids(st, "image_latent_ids", &cd->R);
    }
    for (int neg = 0; neg <= ci->cfg; neg++) {
        char key[64];
        snprintf(key, sizeof key, "%sprompt_embeds", neg ? "neg_" : "");
        float *e = oracle_check_f32(st, key, &n);
        snprintf(key, sizeof key, "%stext_ids", neg ? "neg_" : "");
        cd->txt_ids[neg] = oracle_check_ids(st, key, &cd->T);
        if (!e || !cd->txt_ids[neg])
            return -1;
        upload3(&cd->txt[neg], cd->B, cd->T, 48, e);
        free(e);
    }
    return cd->lat_init && cd->taus && cd->lat_ids ? 0 : -1;
}

static void free_case(case_data *cd)
{
    free(cd->taus);
    free(cd->lat_init);
    free(cd->ref_tokens);
    free(cd->lat_ids);
    free(cd->ref_ids);
    for (int i = 0; i < 2; i++) {
        free(cd->txt_ids[i]);
        kiln_be_free(be, &cd->txt[i]);
    }
}

/* Rows [a ; b] of two (B, Sa, C) and (B, Sb, C) host arrays. */
static float *cat_tokens(const float *a, int64_t Sa, const float *b, int64_t Sb, int64_t B,
                         int64_t C)
{
    float *o = malloc((size_t)(B * (Sa + Sb) * C) * sizeof(float));
    for (int64_t i = 0; o && i < B; i++) {
        memcpy(o + i * (Sa + Sb) * C, a + i * Sa * C, (size_t)(Sa * C) * sizeof(float));
        memcpy(o + (i * (Sa + Sb) + Sa) * C, b + i * Sb * C, (size_t)(Sb * C) * sizeof(float));
    }
    return o;
}

static int32_t *cat_ids(const int32_t *a, int64_t Sa, const int32_t *b, int64_t Sb)
{
    int32_t *o = malloc((size_t)(Sa + Sb) * 4 * sizeof(int32_t));
    if (o) {
        memcpy(o, a, (size_t)Sa * 4 * sizeof(int32_t));
        memcpy(o + Sa * 4, b, (size_t)Sb * 4 * sizeof(int32_t));
    }
    return o;
}

static void run_case(const case_info *ci)
{
    kiln_st *st = oracle_check_open(ci->name, "ref_fp32.safetensors");
    kiln_flux2_dit *m = load_dit(ci->ckpt);
    kiln_flux2_kv_cache *kv = m ? kiln_flux2_kv_cache_create(m, &(kiln_err){0}) : NULL;
    case_data cd = {0};
    if (!st || !m || !kv || read_case(ci, st, &cd))
        goto out;
    const int64_t B = cd.B, N = cd.N, R = cd.R, C = 32;
    int call = 0;
    size_t scratch = 0;
    for (int64_t i = 0; i < cd.steps; i++) {
        float *lat = cd.lat_init;
        char key[64];
        if (i > 0) {
            snprintf(key, sizeof key, "latents_step.%lld", (long long)(i - 1));
            lat = oracle_check_f32(st, key, NULL);
        }
        /* Model input and ids for this step's calls. */
        float *xin = lat;
        int32_t *ids = cd.lat_ids;
        int64_t rows = N, num_ref = 0;
        kiln_flux2_kv_mode mode = KILN_FLUX2_KV_OFF;
        if (R && !ci->kv) {
            xin = cat_tokens(lat, N, cd.ref_tokens, R, B, C);
            ids = cat_ids(cd.lat_ids, N, cd.ref_ids, R);
            rows = N + R;
        } else if (R && i == 0) {
            xin = cat_tokens(cd.ref_tokens, R, lat, N, B, C);
            ids = cat_ids(cd.ref_ids, R, cd.lat_ids, N);
            rows = N + R;
            num_ref = R;
            mode = KILN_FLUX2_KV_EXTRACT;
        } else if (R) {
            mode = KILN_FLUX2_KV_CACHED;
        }
        float t[2];
        for (int64_t b = 0; b < B; b++)
            t[b] = kiln_sched_flux2_dit_time(cd.taus[i], KILN_F32);
        kiln_tensor x, out;
        upload3(&x, B, rows, C, xin);
        int64_t out_rows = mode == KILN_FLUX2_KV_EXTRACT ? N : rows;
        kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){B, out_rows, C});
        for (int neg = 0; neg <= ci->cfg; neg++, call++) {
            kiln_flux2_dit_input in = {.x = &x, .txt = &cd.txt[neg], .t = t, .img_ids = ids,
                                       .txt_ids = cd.txt_ids[neg], .kv_mode = mode,
                                       .num_ref = num_ref, .kv = kv};
            kiln_err err = {0};
            kiln_status rc = kiln_flux2_dit_forward(m, &in, &out, &err);
            CHECKF(!rc, "%s call %d: %s", ci->name, call, err.msg);
            snprintf(key, sizeof key, "transformer_out.%d", call);
            int64_t n;
            float *want = oracle_check_f32(st, key, &n);
            if (!rc && want) {
                char what[96];
                snprintf(what, sizeof what, "%s %s", ci->name, key);
                compare(&out, want, n, what);
            }
            free(want);
            /* Calls after the second find their scratch memory in place
             * (the first reset after a first forward merges its blocks). */
            size_t now = kiln_flux2_dit_scratch_bytes(m);
            CHECKF(call < 2 || now == scratch, "call %d: scratch %zu -> %zu bytes", call,
                   scratch, now);
            scratch = now;
        }
        if (mode == KILN_FLUX2_KV_EXTRACT)
            CHECK(kiln_flux2_kv_cache_tokens(kv) == R);
        kiln_be_free(be, &x);
        kiln_be_free(be, &out);
        if (xin != lat)
            free(xin);
        if (ids != cd.lat_ids)
            free(ids);
        if (lat != cd.lat_init)
            free(lat);
    }
    CHECKF(call > 0, "%s: no DiT calls", ci->name);
out:
    free_case(&cd);
    kiln_flux2_kv_cache_destroy(kv);
    kiln_flux2_dit_destroy(m);
    kiln_st_close(st);
}

/* --- batch invariance --------------------------------------------------------- */

/* A row's output does not depend on the other rows of its batch, even when
 * the rows are at different steps: klein_t2i_batch2's two prompts at two
 * different times, batched and alone, give the same bits on this backend. */
static void test_batch_rows(void)
{
    kiln_st *st = oracle_check_open("klein_t2i_batch2", "ref_fp32.safetensors");
    kiln_flux2_dit *m = load_dit("ckpt/klein-tiny");
    int64_t n, N, T, steps;
    float *lat = st ? oracle_check_f32(st, "latents_step.0", &n) : NULL;
    float *txt = st ? oracle_check_f32(st, "prompt_embeds", &n) : NULL;
    float *taus = st ? oracle_check_f32(st, "timesteps", &steps) : NULL;
    int32_t *img_ids = st ? oracle_check_ids(st, "latent_ids", &N) : NULL;
    int32_t *txt_ids = st ? oracle_check_ids(st, "text_ids", &T) : NULL;
    if (!m || !lat || !txt || !taus || !img_ids || !txt_ids || steps < 3)
        goto out;
    const int64_t C = 32, J = 48;
    float t[2] = {kiln_sched_flux2_dit_time(taus[1], KILN_F32),
                  kiln_sched_flux2_dit_time(taus[2], KILN_F32)};
    float *both = malloc((size_t)(2 * N * C) * sizeof(float));
    float *one = malloc((size_t)(N * C) * sizeof(float));
    for (int64_t b = -1; b < 2; b++) {
        /* b = -1: the batch of two; then each row alone. */
        int64_t B = b < 0 ? 2 : 1, r0 = b < 0 ? 0 : b;
        kiln_tensor x, tt, out;
        upload3(&x, B, N, C, lat + r0 * N * C);
        upload3(&tt, B, T, J, txt + r0 * T * J);
        kiln_be_alloc(be, &out, be->act_dtype, 3, (int64_t[]){B, N, C});
        kiln_flux2_dit_input in = {.x = &x, .txt = &tt, .t = t + r0, .img_ids = img_ids,
                                   .txt_ids = txt_ids};
        kiln_err err = {0};
        CHECKF(!kiln_flux2_dit_forward(m, &in, &out, &err), "%s", err.msg);
        kiln_be_download(be, &out, b < 0 ? both : one);
        if (b >= 0) {
            double md = 0;
            for (int64_t i = 0; i < N * C; i++)
                md = fmax(md, fabs((double)one[i] - both[b * N * C + i]));
            CHECKF(md == 0, "row %lld alone differs from its batched result by %.3g",
                   (long long)b, md);
        }
        kiln_be_free(be, &x);
        kiln_be_free(be, &tt);
        kiln_be_free(be, &out);
    }
    free(both);
    free(one);
out:
    free(lat);
    free(txt);
    free(taus);
    free(img_ids);
    free(txt_ids);
    kiln_flux2_dit_destroy(m);
    kiln_st_close(st);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: KILN_SHARED=... %s host|debug|batch_rows|<klein case>\n",
                argv[0]);
        return 2;
    }
    be = oracle_cpu_backend();
    const char *what = argv[1];
    int known = 1;
    if (!strcmp(what, "host")) {
        RUN(test_time_proj);
        RUN(test_rope_tables);
        RUN(test_config);
        RUN(test_bad_inputs);
    } else if (!strcmp(what, "debug")) {
        RUN(test_debug_tensors);
    } else if (!strcmp(what, "batch_rows")) {
        RUN(test_batch_rows);
    } else {
        known = 0;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (!strcmp(what, cases[i].name)) {
                fprintf(stderr, "%s\n", what);
                run_case(&cases[i]);
                known = 1;
            }
    }
    CHECKF(known, "unknown test '%s'", what);
    kiln_backend_destroy(be);
    return test_finish();
}
