/* Latent layouts, ids, normalisation and 8-bit conversion against the oracle
 * tensors of every case (fp32 and bf16 references), bit for bit. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "models/latents.h"
#include "tests/oracle/oracle_check.h"
#include "tests/test.h"

static void check_same_f32(const char *what, const float *got, const float *want, int64_t n)
{
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (oracle_bits(got[i]) != oracle_bits(want[i])) {
            if (first < 0)
                first = i;
            bad++;
        }
    CHECKF(bad == 0, "%s: %lld of %lld differ, first [%lld] %.9g vs %.9g", what, (long long)bad,
           (long long)n, (long long)first, first >= 0 ? (double)got[first] : 0.0,
           first >= 0 ? (double)want[first] : 0.0);
}

static void check_ids(const char *what, const kiln_st_tensor *t, const int32_t *want, int64_t rows)
{
    CHECKF(t && t->dtype == KILN_I64 && t->ndim == 3 && t->shape[1] == rows && t->shape[2] == 4,
           "%s: bad shape", what);
    if (!t || t->dtype != KILN_I64 || t->ndim != 3 || t->shape[1] != rows || t->shape[2] != 4)
        return;
    /* Every batch row carries the same ids. */
    for (int64_t b = 0; b < t->shape[0]; b++) {
        const int64_t *row = (const int64_t *)t->data + b * rows * 4;
        int64_t i = 0;
        while (i < rows * 4 && row[i] == want[i])
            i++;
        CHECKF(i == rows * 4, "%s: batch row %lld differs", what, (long long)b);
    }
}

/* The checkpoint's BN statistics (bf16 in the file) and batch_norm_eps. */
typedef struct bn_stats {
    float *mean, *var;
    int64_t channels;
    double eps;
} bn_stats;

static int load_bn(const char *ckpt, bn_stats *bn)
{
    memset(bn, 0, sizeof(*bn));
    kiln_checkpoint *ck = oracle_check_ckpt(ckpt);
    if (!ck)
        return -1;
    kiln_err err = {0};
    const cJSON *cfg = kiln_checkpoint_config(ck, "vae", &err);
    kiln_st *st = kiln_checkpoint_weights(ck, "vae", &err);
    CHECKF(cfg && st, "%s", err.msg);
    int rc = -1;
    if (cfg && st && !kiln_json_double(cfg, "batch_norm_eps", 1, 0, &bn->eps, &err)) {
        bn->mean = oracle_check_f32(st, "bn.running_mean", &bn->channels);
        bn->var = oracle_check_f32(st, "bn.running_var", NULL);
        rc = bn->mean && bn->var ? 0 : -1;
    }
    CHECK(bn->eps == 1e-4);
    kiln_st_close(st);
    kiln_checkpoint_close(ck);
    return rc;
}

/* latents_step.<last> (B, N, 4C) -> unpack -> x*std+mean -> unpatchify ==
 * vae_decode_in (B, C, 2h, 2w), in the file's dtype. */
static void check_decode_in(const char *what, const kiln_st *ref, int steps, const bn_stats *bn,
                            kiln_dtype dt)
{
    char name[64];
    snprintf(name, sizeof(name), "latents_step.%d", steps - 1);
    const kiln_st_tensor *lt = kiln_st_find(ref, name), *vt = kiln_st_find(ref, "vae_decode_in");
    float *lat = oracle_check_f32(ref, name, NULL);
    float *want = oracle_check_f32(ref, "vae_decode_in", NULL);
    if (lat && want && lt->ndim == 3 && vt->ndim == 4 && lt->shape[2] == bn->channels) {
        int64_t B = vt->shape[0], C = vt->shape[1], h = vt->shape[2] / 2, w = vt->shape[3] / 2;
        CHECK(lt->shape[1] == h * w && 4 * C == bn->channels);
        float *grid = malloc((size_t)oracle_numel(lt) * sizeof(float));
        float *z = malloc((size_t)oracle_numel(vt) * sizeof(float));
        CHECK(grid && z);
        if (grid && z) {
            kiln_latents_unpack(lat, grid, B, 4 * C, h, w);
            kiln_latents_bn_denormalize(grid, B, 4 * C, h * w, bn->mean, bn->var, bn->eps, dt);
            kiln_latents_unpatchify(grid, z, B, C, h, w);
            check_same_f32(what, z, want, oracle_numel(vt));
        }
        free(grid);
        free(z);
    } else {
        CHECKF(0, "%s: missing or misshapen latents/vae_decode_in", what);
    }
    free(lat);
    free(want);
}

/* Edit reference: vae_latent_mean -> patchify -> (x-mean)/std ==
 * latents_bn_normalized, then pack == image_latents_packed, ids t = 10. */
static void check_reference(const char *what, const kiln_st *ref, const bn_stats *bn,
                            kiln_dtype dt)
{
    const kiln_st_tensor *mt = kiln_st_find(ref, "ref0.vae_latent_mean");
    const kiln_st_tensor *nt = kiln_st_find(ref, "ref0.latents_bn_normalized");
    const kiln_st_tensor *pt = kiln_st_find(ref, "image_latents_packed");
    float *mean = oracle_check_f32(ref, "ref0.vae_latent_mean", NULL);
    float *want = oracle_check_f32(ref, "ref0.latents_bn_normalized", NULL);
    float *packed = oracle_check_f32(ref, "image_latents_packed", NULL);
    if (mean && want && packed && mt->ndim == 4 && nt->ndim == 4) {
        int64_t C = mt->shape[1], h = mt->shape[2] / 2, w = mt->shape[3] / 2;
        CHECK(nt->shape[1] == 4 * C && nt->shape[2] == h && nt->shape[3] == w);
        float *p = malloc((size_t)oracle_numel(mt) * sizeof(float));
        float *tok = malloc((size_t)oracle_numel(mt) * sizeof(float));
        int32_t *ids = malloc((size_t)(h * w * 4) * sizeof(int32_t));
        CHECK(p && tok && ids);
        if (p && tok && ids) {
            kiln_latents_patchify(mean, p, 1, C, h, w);
            kiln_latents_bn_normalize(p, 1, 4 * C, h * w, bn->mean, bn->var, bn->eps, dt);
            check_same_f32(what, p, want, oracle_numel(nt));
            kiln_latents_pack(p, tok, 1, 4 * C, h, w);
            CHECK(oracle_numel(pt) == h * w * 4 * C);
            if (oracle_numel(pt) == h * w * 4 * C)
                check_same_f32(what, tok, packed, oracle_numel(pt));
            kiln_latents_ref_ids(ids, 0, h, w);
            check_ids(what, kiln_st_find(ref, "image_latent_ids"), ids, h * w);
        }
        free(p);
        free(tok);
        free(ids);
    } else {
        CHECKF(0, "%s: missing or misshapen reference tensors", what);
    }
    free(mean);
    free(want);
    free(packed);
}

/* vae_decode_out (B, 3, H, W) -> image_uint8 (B, H, W, 3), fp32 pipeline. */
static void check_image(const char *what, const kiln_st *ref)
{
    const kiln_st_tensor *ot = kiln_st_find(ref, "vae_decode_out");
    const kiln_st_tensor *it = kiln_st_find(ref, "image_uint8");
    float *out = oracle_check_f32(ref, "vae_decode_out", NULL);
    CHECK(it && it->dtype == KILN_U8);
    if (out && it && ot->ndim == 4 && oracle_numel(ot) == oracle_numel(it)) {
        int64_t B = ot->shape[0], H = ot->shape[2], W = ot->shape[3];
        uint8_t *rgb = malloc((size_t)oracle_numel(it));
        CHECK(rgb != NULL);
        if (rgb) {
            kiln_latents_to_rgb8(out, rgb, B, H, W, KILN_F32);
            int64_t bad = 0;
            for (int64_t i = 0; i < oracle_numel(it); i++)
                bad += rgb[i] != ((const uint8_t *)it->data)[i];
            CHECKF(bad == 0, "%s: %lld bytes differ", what, (long long)bad);
        }
        free(rgb);
    }
    free(out);
}

static void klein_case(const char *name, const char *ckpt, int steps, int edit)
{
    bn_stats bn;
    kiln_st *f32 = oracle_check_open(name, "ref_fp32.safetensors");
    kiln_st *b16 = oracle_check_open(name, "ref_bf16.safetensors");
    if (load_bn(ckpt, &bn) == 0 && f32 && b16) {
        /* noise (B, 4C, h, w) packs into latents_init_packed; ids. */
        for (int f = 0; f < 2; f++) {
            const kiln_st *ref = f ? b16 : f32;
            const kiln_st_tensor *nt = kiln_st_find(ref, "noise");
            float *noise = oracle_check_f32(ref, "noise", NULL);
            float *want = oracle_check_f32(ref, "latents_init_packed", NULL);
            if (noise && want && nt->ndim == 4) {
                int64_t B = nt->shape[0], C = nt->shape[1], h = nt->shape[2], w = nt->shape[3];
                float *tok = malloc((size_t)oracle_numel(nt) * sizeof(float));
                float *back = malloc((size_t)oracle_numel(nt) * sizeof(float));
                int32_t *ids = malloc((size_t)(h * w * 4) * sizeof(int32_t));
                const kiln_st_tensor *tt = kiln_st_find(ref, "text_ids");
                int64_t T = tt && tt->ndim == 3 ? tt->shape[1] : 0;
                int32_t *tids = malloc((size_t)(T * 4 + 1) * sizeof(int32_t));
                CHECK(tok && back && ids && tids && T > 0);
                if (tok && back && ids && tids && T > 0) {
                    kiln_latents_pack(noise, tok, B, C, h, w);
                    check_same_f32(name, tok, want, oracle_numel(nt));
                    kiln_latents_unpack(tok, back, B, C, h, w);
                    check_same_f32(name, back, noise, oracle_numel(nt));
                    kiln_latents_image_ids(ids, h, w);
                    check_ids(name, kiln_st_find(ref, "latent_ids"), ids, h * w);
                    kiln_latents_text_ids(tids, T);
                    check_ids(name, tt, tids, T);
                }
                free(tok);
                free(back);
                free(ids);
                free(tids);
            }
            free(noise);
            free(want);
        }
        check_decode_in(name, f32, steps, &bn, KILN_F32);
        check_decode_in(name, b16, steps, &bn, KILN_BF16);
        if (edit) {
            check_reference(name, f32, &bn, KILN_F32);
            check_reference(name, b16, &bn, KILN_BF16);
        }
        check_image(name, f32);
    }
    free(bn.mean);
    free(bn.var);
    kiln_st_close(f32);
    kiln_st_close(b16);
}

static void test_klein_cases(void)
{
    klein_case("klein_t2i_256", "ckpt/klein-tiny", 4, 0);
    klein_case("klein_t2i_batch2", "ckpt/klein-tiny", 4, 0);
    klein_case("klein_edit_1ref", "ckpt/klein-tiny", 4, 1);
    klein_case("klein_kv_edit_1ref", "ckpt/klein-tiny", 4, 1);
    klein_case("klein_base_cfg_256", "ckpt/klein-base-tiny", 6, 0);
}

/* Z-Image: fp32 latents / 0.3611 + 0.1159 == vae_decode_in (fp32 and bf16). */
static void zimage_case(const char *name)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/zimage-tiny"), &err);
    const cJSON *cfg = ck ? kiln_checkpoint_config(ck, "vae", &err) : NULL;
    double scaling = 0, shift = 0;
    CHECKF(cfg && !kiln_json_double(cfg, "scaling_factor", 1, 0, &scaling, &err) &&
               !kiln_json_double(cfg, "shift_factor", 1, 0, &shift, &err),
           "%s", err.msg);
    kiln_checkpoint_close(ck);
    for (int f = 0; f < 2; f++) {
        const char *file = f ? "ref_bf16.safetensors" : "ref_fp32.safetensors";
        kiln_st *ref = oracle_check_open(name, file);
        if (!ref)
            continue;
        int64_t nl = 0, nv = 0;
        float *lat = oracle_check_f32(ref, "latents_step.7", &nl);
        float *want = oracle_check_f32(ref, "vae_decode_in", &nv);
        CHECK(lat && want && nl == nv);
        if (lat && want && nl == nv) {
            kiln_latents_kl_unscale(lat, nl, scaling, shift, f ? KILN_BF16 : KILN_F32);
            check_same_f32(name, lat, want, nv);
        }
        free(lat);
        free(want);
        if (!f)
            check_image(name, ref);
        kiln_st_close(ref);
    }
}

static void test_zimage_cases(void)
{
    zimage_case("zimage_t2i_256");
    zimage_case("zimage_batch2_160x96");
}

/* The patchified channel 4c + 2dy + dx holds latent[c, 2y+dy, 2x+dx]. */
static void test_patchify_layout(void)
{
    enum { B = 2, C = 3, h = 2, w = 3 };
    float full[B * C * 2 * h * 2 * w], p[B * 4 * C * h * w], back[B * C * 2 * h * 2 * w];
    for (int i = 0; i < B * C * 2 * h * 2 * w; i++)
        full[i] = (float)i;
    kiln_latents_patchify(full, p, B, C, h, w);
    for (int b = 0; b < B; b++)
        for (int c = 0; c < C; c++)
            for (int dy = 0; dy < 2; dy++)
                for (int dx = 0; dx < 2; dx++)
                    for (int y = 0; y < h; y++)
                        for (int x = 0; x < w; x++) {
                            float src = full[((b * C + c) * 2 * h + 2 * y + dy) * 2 * w + 2 * x + dx];
                            float dst = p[((b * 4 * C + 4 * c + 2 * dy + dx) * h + y) * w + x];
                            CHECK(src == dst);
                        }
    kiln_latents_unpatchify(p, back, B, C, h, w);
    CHECK(memcmp(full, back, sizeof(full)) == 0);
}

static void test_ids_and_image_edges(void)
{
    int32_t ids[2 * 3 * 4];
    kiln_latents_ref_ids(ids, 2, 2, 3);
    CHECK(ids[0] == 30 && ids[4 * 5 + 0] == 30 && ids[4 * 5 + 1] == 1 && ids[4 * 5 + 2] == 2 &&
          ids[4 * 5 + 3] == 0);
    /* Clamping, and NaN (a broken decode) -> 0 rather than undefined. */
    const float x[3] = {-3.0f, 3.0f, NAN};
    uint8_t rgb[3];
    kiln_latents_to_rgb8(x, rgb, 1, 1, 1, KILN_F32);
    CHECK(rgb[0] == 0 && rgb[1] == 255 && rgb[2] == 0);
    /* numpy rounds half to even: these give v * 255 = 64.5 and 65.5 exactly. */
    const float half[3] = {-0.494117618f, -0.486274481f, 0.0f};
    kiln_latents_to_rgb8(half, rgb, 1, 1, 1, KILN_F32);
    CHECK(rgb[0] == 64 && rgb[1] == 66 && rgb[2] == 128);
}

int main(void)
{
    RUN(test_klein_cases);
    RUN(test_zimage_cases);
    RUN(test_patchify_layout);
    RUN(test_ids_and_image_edges);
    return test_finish();
}
