/* VAE against the fp32 oracle (shared/oracle/cases): every case's
 * vae_decode_in -> vae_decode_out, the decoder's stage outputs of the two
 * debug cases, the encoder mean of every edit reference, the exposed latent
 * statistics, and clear failures for bad inputs and bad configs. */
#include <dirent.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/checkpoint.h"
#include "common/json.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/vae.h"
#include "oracle_check.h"
#include "tests/test.h"

static kiln_backend *be;

/* --- helpers ------------------------------------------------------------- */

/* Loads the VAE halves `parts` of an oracle checkpoint ("ckpt/klein-tiny"). */
static kiln_vae *load_vae(const char *ckname, unsigned parts)
{
    kiln_checkpoint *ck = oracle_check_ckpt(ckname);
    if (!ck)
        return NULL;
    kiln_err err = {0};
    kiln_vae *vae = NULL;
    const cJSON *cfg = kiln_checkpoint_config(ck, "vae", &err);
    kiln_st *st = cfg ? kiln_checkpoint_weights(ck, "vae", &err) : NULL;
    if (st)
        vae = kiln_vae_load(be, cfg, st, parts, &err);
    CHECKF(vae, "%s vae: %s", ckname, err.msg);
    kiln_st_close(st);
    kiln_checkpoint_close(ck);
    return vae;
}

/* Uploads an fp32 reference tensor into a backend tensor. */
static int upload_ref(const kiln_st_tensor *r, kiln_tensor *t)
{
    kiln_err err = {0};
    if (kiln_be_from_host(be, t, r->ndim, r->shape, r->data, r->dtype)) {
        kiln_be_check(be, &err);
        CHECKF(0, "upload %s: %s", r->name, err.msg);
        return -1;
    }
    return 0;
}

/* Downloads t and compares it with the reference (same shape required). */
static void compare(const char *what, const kiln_tensor *t, const kiln_st_tensor *ref)
{
    int same = ref && ref->dtype == KILN_F32 && ref->ndim == t->ndim &&
               !memcmp(ref->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
    CHECKF(same, "%s: shape or dtype differs from the reference", what);
    if (!same)
        return;
    size_t n = (size_t)kiln_tensor_numel(t);
    float *host = malloc(n * sizeof(float));
    CHECK(host);
    if (!host)
        return;
    kiln_be_download(be, t, host);
    kiln_err err = {0};
    CHECKF(!kiln_be_check(be, &err), "%s download: %s", what, err.msg);
    oracle_check_close(what, host, ref->data, n, 1e-4);
    free(host);
}

/* The case's checkpoint folder from meta.json ("ckpt/klein-tiny"). */
static int case_ckpt(const char *cs, char *out, size_t len)
{
    kiln_err err = {0};
    cJSON *meta = kiln_json_load(oracle_case_path(cs, "meta.json"), "meta.json", &err);
    const char *ck = meta ? kiln_json_string(meta, "checkpoint", 1, &err) : NULL;
    CHECKF(ck, "%s: %s", cs, err.msg);
    if (ck)
        snprintf(out, len, "%s", ck);
    cJSON_Delete(meta);
    return ck ? 0 : -1;
}

typedef struct tap_ctx {
    const kiln_st *dbg;
    const char *cs;
    int seen;
} tap_ctx;

/* Compares a decoder stage, channels-last (B, H, W, C), with the debug
 * file's dbg.vae_decoder.<stage>, (B, C, H, W) as diffusers has it. */
static void tap_compare(void *ctx, const char *stage, const kiln_tensor *t)
{
    tap_ctx *c = ctx;
    char key[128], what[400];
    snprintf(key, sizeof key, "dbg.vae_decoder.%s", stage);
    const kiln_st_tensor *ref = kiln_st_find(c->dbg, key);
    if (!ref)
        return;
    snprintf(what, sizeof what, "%s %s", c->cs, key);
    int64_t B = t->shape[0], H = t->shape[1], W = t->shape[2], C = t->shape[3];
    kiln_tensor planes;
    CHECK(!kiln_be_alloc(be, &planes, t->dtype, 4, (int64_t[]){B, C, H, W}));
    kiln_tensor src = *t, dst = planes;
    kiln_tensor_set_shape(&src, t->dtype, 3, (int64_t[]){B, H * W, C});
    kiln_tensor_set_shape(&dst, t->dtype, 3, (int64_t[]){B, C, H * W});
    kiln_be_transpose(be, &dst, &src);
    compare(what, &planes, ref);
    kiln_be_free(be, &planes);
    c->seen++;
}

/* Decodes vae_decode_in and checks vae_decode_out, and the decoder stages
 * where the case has a debug file.  Returns 1 when the case was decoded. */
static int decode_case(kiln_vae *vae, const char *cs, const kiln_st *ref)
{
    const kiln_st_tensor *in = kiln_st_find(ref, "vae_decode_in");
    const kiln_st_tensor *out = kiln_st_find(ref, "vae_decode_out");
    const char *dbg_file = "debug_fp32.safetensors";
    kiln_st *dbg =
        access(oracle_case_path(cs, dbg_file), R_OK) ? NULL : oracle_check_open(cs, dbg_file);
    tap_ctx ctx = {.dbg = dbg, .cs = cs};
    kiln_vae_tap tap = {.fn = tap_compare, .ctx = &ctx};
    int done = 0;
    kiln_tensor z = {0}, img = {0};
    if (in && out && !upload_ref(in, &z) &&
        !kiln_be_alloc(be, &img, be->act_dtype, out->ndim, out->shape)) {
        kiln_err err = {0};
        kiln_status st = kiln_vae_decode(vae, &z, &img, dbg ? &tap : NULL, &err);
        CHECKF(st == KILN_OK, "%s decode: %s", cs, err.msg);
        char what[400];
        snprintf(what, sizeof what, "%s vae_decode_out", cs);
        if (st == KILN_OK)
            compare(what, &img, out);
        CHECKF(!dbg || ctx.seen == 3, "%s: compared %d decoder stages, expected conv_in, "
               "mid_block, up_blocks.0", cs, ctx.seen);
        done = 1;
    }
    kiln_be_free(be, &z);
    kiln_be_free(be, &img);
    kiln_st_close(dbg);
    return done;
}

/* Encodes every ref<i>.image_preprocessed and checks ref<i>.vae_latent_mean;
 * returns the number of references. */
static int encode_refs(kiln_vae *vae, const char *cs, const kiln_st *ref)
{
    int i = 0;
    for (;; i++) {
        char kin[64], kmean[64];
        snprintf(kin, sizeof kin, "ref%d.image_preprocessed", i);
        snprintf(kmean, sizeof kmean, "ref%d.vae_latent_mean", i);
        const kiln_st_tensor *in = kiln_st_find(ref, kin);
        const kiln_st_tensor *mean = kiln_st_find(ref, kmean);
        if (!in)
            break;
        CHECKF(mean, "%s: %s missing", cs, kmean);
        kiln_tensor x = {0}, m = {0};
        if (mean && !upload_ref(in, &x) &&
            !kiln_be_alloc(be, &m, be->act_dtype, mean->ndim, mean->shape)) {
            kiln_err err = {0};
            kiln_status st = kiln_vae_encode(vae, &x, &m, NULL, &err);
            CHECKF(st == KILN_OK, "%s encode: %s", cs, err.msg);
            char what[400];
            snprintf(what, sizeof what, "%s %s", cs, kmean);
            if (st == KILN_OK)
                compare(what, &m, mean);
        }
        kiln_be_free(be, &x);
        kiln_be_free(be, &m);
    }
    return i;
}

/* --- oracle parity ------------------------------------------------------- */

/* Every case, each with its checkpoint's VAE: the decode, the decoder
 * stages of the debug cases and the encoder mean of each edit reference.
 * A VAE is reused across cases of different sizes and batches, which also
 * exercises the reuse of its scratch slots. */
static void test_all_cases(void)
{
    struct dirent **list = NULL;
    int n = scandir(oracle_path("cases"), &list, NULL, alphasort);
    CHECKF(n > 0, "no cases in %s", oracle_path("cases"));
    char loaded[256] = "";
    kiln_vae *vae = NULL;
    int decoded = 0, encoded = 0;
    for (int i = 0; i < n; i++) {
        char ck[256];
        const char *cs = list[i]->d_name;
        if (cs[0] != '.' && !case_ckpt(cs, ck, sizeof ck)) {
            if (strcmp(ck, loaded)) {
                kiln_vae_free(vae);
                vae = load_vae(ck, KILN_VAE_DECODER | KILN_VAE_ENCODER);
                snprintf(loaded, sizeof loaded, "%s", ck);
            }
            kiln_st *ref = vae ? oracle_check_open(cs, "ref_fp32.safetensors") : NULL;
            if (ref) {
                decoded += decode_case(vae, cs, ref);
                encoded += encode_refs(vae, cs, ref);
            }
            kiln_st_close(ref);
        }
        free(list[i]);
    }
    free(list);
    kiln_vae_free(vae);
    CHECKF(decoded == 7, "decoded %d cases, the oracle has 7", decoded);
    CHECKF(encoded == 2, "encoded %d references, the oracle has 2", encoded);
}

/* --- exposed configuration ------------------------------------------------ */

static void test_info(void)
{
    kiln_vae *k = load_vae("ckpt/klein-tiny", KILN_VAE_DECODER);
    kiln_vae *zi = load_vae("ckpt/zimage-tiny", KILN_VAE_DECODER | KILN_VAE_ENCODER);
    if (k) {
        const kiln_vae_info *in = kiln_vae_get_info(k);
        CHECK(in->kind == KILN_VAE_FLUX2);
        CHECK(in->latent_channels == 8 && in->downscale == 8);
        CHECK(in->parts == KILN_VAE_DECODER);
        CHECK(in->bn_channels == 32 && in->patch_h == 2 && in->patch_w == 2);
        CHECK_NEAR(in->bn_eps, 1e-4, 0);
        /* The statistics equal the stored buffers (random in the oracle). */
        kiln_err err = {0};
        kiln_st *st = kiln_st_open(oracle_path("ckpt/klein-tiny/vae"), "vae", &err);
        CHECKF(st, "%s", err.msg);
        const kiln_st_tensor *m = st ? kiln_st_find(st, "bn.running_mean") : NULL;
        const kiln_st_tensor *v = st ? kiln_st_find(st, "bn.running_var") : NULL;
        CHECK(m && v && in->bn_mean && in->bn_var);
        if (m && v && in->bn_mean && in->bn_var) {
            float hm[32], hv[32];
            kiln_convert_to_f32(hm, m->data, m->dtype, 32);
            kiln_convert_to_f32(hv, v->data, v->dtype, 32);
            CHECK(!memcmp(hm, in->bn_mean, sizeof hm) && !memcmp(hv, in->bn_var, sizeof hv));
            CHECK(hv[0] > 0 && hm[0] != 0);
        }
        kiln_st_close(st);
        CHECK(kiln_vae_scratch_bytes(k, KILN_VAE_ENCODER, 1, 256, 256) == 0);
        size_t big = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 256, 256);
        size_t small = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 128, 128);
        CHECKF(small > 0 && big > 3 * small, "scratch %zu vs %zu", big, small);
        /* 3 slots of 16 ch x 256 x 256 f32 (up_blocks.2's upsample output)
         * plus 4 token buffers of 32 ch x 32 x 32. */
        CHECKF(big == 3 * 16 * 256 * 256 * 4 + 4 * 32 * 32 * 32 * 4, "scratch %zu", big);
        CHECK(kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 260, 256) == 0);
    }
    if (zi) {
        const kiln_vae_info *in = kiln_vae_get_info(zi);
        CHECK(in->kind == KILN_VAE_KL);
        CHECK(in->latent_channels == 4 && in->downscale == 8);
        CHECK(in->bn_channels == 0 && !in->bn_mean && !in->bn_var);
        CHECK_NEAR(in->scaling_factor, 0.3611, 1e-12);
        CHECK_NEAR(in->shift_factor, 0.1159, 1e-12);
        CHECK(kiln_vae_scratch_bytes(zi, KILN_VAE_ENCODER, 2, 64, 64) > 0);
    }
    kiln_vae_free(k);
    kiln_vae_free(zi);
}

/* Loads klein-tiny's VAE with one config key replaced (value is consumed);
 * NULL with err set on failure. */
static kiln_vae *load_modified(const char *key, cJSON *value, unsigned parts, kiln_err *err)
{
    cJSON *cfg = kiln_json_load(oracle_path("ckpt/klein-tiny/vae/config.json"), "config.json", err);
    kiln_st *st = kiln_st_open(oracle_path("ckpt/klein-tiny/vae"), "vae", err);
    CHECK(cfg && st);
    kiln_vae *vae = NULL;
    if (cfg && st) {
        if (!cJSON_ReplaceItemInObjectCaseSensitive(cfg, key, value))
            cJSON_AddItemToObject(cfg, key, value);
        value = NULL;
        vae = kiln_vae_load(be, cfg, st, parts, err);
    }
    cJSON_Delete(value);
    cJSON_Delete(cfg);
    kiln_st_close(st);
    return vae;
}

static kiln_status load_with(const char *key, cJSON *value, kiln_err *err)
{
    kiln_vae *vae = load_modified(key, value, KILN_VAE_DECODER | KILN_VAE_ENCODER, err);
    kiln_vae_free(vae);
    return vae ? KILN_OK : err->code;
}

/* --- banded passes -------------------------------------------------------- */

/* Decodes a host latent (B, zc, h, w) into a new host image (B, 3, 8h, 8w). */
static float *decode_host(kiln_vae *vae, const float *z, int64_t B, int64_t zc, int64_t h,
                          int64_t w)
{
    kiln_tensor zt = {0}, img = {0};
    float *out = malloc(sizeof(float) * (size_t)(B * 3 * 64 * h * w));
    kiln_err err = {0};
    int ok = out && !kiln_be_from_host(be, &zt, 4, (int64_t[]){B, zc, h, w}, z, KILN_F32) &&
             !kiln_be_alloc(be, &img, be->act_dtype, 4, (int64_t[]){B, 3, 8 * h, 8 * w}) &&
             !kiln_vae_decode(vae, &zt, &img, NULL, &err);
    if (ok)
        kiln_be_download(be, &img, out);
    kiln_be_check(be, ok ? &err : NULL);
    CHECKF(ok, "decode %lldx%lld: %s", (long long)h, (long long)w, err.msg);
    kiln_be_free(be, &zt);
    kiln_be_free(be, &img);
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}

/* Encodes a host image (B, 3, H, W) into a new host mean (B, zc, H/8, W/8). */
static float *encode_host(kiln_vae *vae, const float *x, int64_t B, int64_t zc, int64_t H,
                          int64_t W)
{
    kiln_tensor xt = {0}, m = {0};
    float *out = malloc(sizeof(float) * (size_t)(B * zc * (H / 8) * (W / 8)));
    kiln_err err = {0};
    int ok = out && !kiln_be_from_host(be, &xt, 4, (int64_t[]){B, 3, H, W}, x, KILN_F32) &&
             !kiln_be_alloc(be, &m, be->act_dtype, 4, (int64_t[]){B, zc, H / 8, W / 8}) &&
             !kiln_vae_encode(vae, &xt, &m, NULL, &err);
    if (ok)
        kiln_be_download(be, &m, out);
    kiln_be_check(be, ok ? &err : NULL);
    CHECKF(ok, "encode %lldx%lld: %s", (long long)H, (long long)W, err.msg);
    kiln_be_free(be, &xt);
    kiln_be_free(be, &m);
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}

static float *random_host(size_t n, uint32_t seed)
{
    float *p = malloc(sizeof(float) * n);
    for (size_t i = 0; p && i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
    }
    CHECK(p);
    return p;
}

/* PSNR in dB of `got` against `want` over the reference's own range
 * (INFINITY when identical). */
static double psnr_range(const float *got, const float *want, size_t n)
{
    double lo = want[0], hi = want[0], se = 0;
    for (size_t i = 0; i < n; i++) {
        lo = want[i] < lo ? want[i] : lo;
        hi = want[i] > hi ? want[i] : hi;
        se += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
    }
    if (se == 0)
        return INFINITY;
    return 10 * log10((hi - lo) * (hi - lo) / (se / (double)n));
}

/* One size: the whole pass, then banded passes with each band height; each
 * banded result must be the whole one to >= 50 dB (fp32 lands far above:
 * only GroupNorm's summation order differs). */
static void band_case(kiln_vae *vae, int decode, int64_t B, int64_t zc, int64_t H, int64_t W,
                      const int64_t *rows, int nrows, double *worst)
{
    kiln_err err = {0};
    int64_t h = H / 8, w = W / 8;
    size_t n_in = (size_t)(decode ? B * zc * h * w : B * 3 * H * W);
    size_t n_out = (size_t)(decode ? B * 3 * H * W : B * zc * h * w);
    float *in = random_host(n_in, (uint32_t)(H * 131 + W * 7 + B));
    CHECK(!kiln_vae_set_banding(vae, KILN_VAE_BAND_NEVER, 64, &err));
    float *whole = !in ? NULL : decode ? decode_host(vae, in, B, zc, h, w)
                                       : encode_host(vae, in, B, zc, H, W);
    for (int i = 0; whole && i < nrows; i++) {
        CHECK(!kiln_vae_set_banding(vae, 0, rows[i], &err));
        float *band = decode ? decode_host(vae, in, B, zc, h, w)
                             : encode_host(vae, in, B, zc, H, W);
        if (!band)
            continue;
        double p = psnr_range(band, whole, n_out);
        fprintf(stderr, "  %s B=%lld %lldx%lld bands of %lld rows: %.1f dB\n",
                decode ? "decode" : "encode", (long long)B, (long long)W, (long long)H,
                (long long)rows[i], p);
        CHECKF(p >= 50.0, "banded %s %lldx%lld rows %lld: %.1f dB", decode ? "decode" : "encode",
               (long long)W, (long long)H, (long long)rows[i], p);
        *worst = p < *worst ? p : *worst;
        free(band);
    }
    free(in);
    free(whole);
}

/* Banded decode and encode against the whole-image passes of the same VAE:
 * square and non-square sizes, batch 2, band heights that split every
 * resolution unevenly (down to one row), one band over the whole image;
 * klein-tiny (quant convs, mid attention) and zimage-tiny (neither quant
 * conv). */
static void test_banded(void)
{
    kiln_vae *k = load_vae("ckpt/klein-tiny", KILN_VAE_DECODER | KILN_VAE_ENCODER);
    kiln_vae *zi = load_vae("ckpt/zimage-tiny", KILN_VAE_DECODER | KILN_VAE_ENCODER);
    double worst = INFINITY;
    if (k) {
        band_case(k, 1, 1, 8, 104, 72, (int64_t[]){24, 3}, 2, &worst);
        band_case(k, 1, 2, 8, 48, 88, (int64_t[]){9}, 1, &worst);
        band_case(k, 0, 1, 8, 104, 72, (int64_t[]){7, 1}, 2, &worst);
        band_case(k, 0, 2, 8, 64, 136, (int64_t[]){13}, 1, &worst);
    }
    if (zi) {
        band_case(zi, 1, 2, 4, 72, 56, (int64_t[]){17, 1000}, 2, &worst);
        band_case(zi, 0, 2, 4, 56, 72, (int64_t[]){11}, 1, &worst);
    }
    fprintf(stderr, "  banded vs whole, worst: %.1f dB\n", worst);

    /* The default: whole up to 1024x1024, banded above; banded scratch grows
     * with two activations of a stage, not three of the widest, and bands
     * bound it further.  The sizes follow from the config alone. */
    if (k) {
        kiln_err err = {0};
        CHECK(!kiln_vae_set_banding(k, KILN_VAE_BAND_ABOVE_DEFAULT, 128, &err));
        size_t w1k = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 1024, 1024);
        size_t b2k = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 2048, 2048);
        size_t e2k = kiln_vae_scratch_bytes(k, KILN_VAE_ENCODER, 1, 2048, 2048);
        CHECK(!kiln_vae_set_banding(k, KILN_VAE_BAND_NEVER, 128, &err));
        size_t w2k = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 2048, 2048);
        size_t we2k = kiln_vae_scratch_bytes(k, KILN_VAE_ENCODER, 1, 2048, 2048);
        CHECK(kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 1024, 1024) == w1k);
        /* Decode: two activations of a stage (the widest pair: the last
         * upsampler's output and the next resnet's, 16 + 8 channels here)
         * instead of three of the widest (16); encode: two of conv_in's
         * width instead of three.  Band buffers on top. */
        CHECKF(b2k < w2k * 2 / 3 && e2k < we2k * 5 / 6, "2048^2 scratch: decode banded %zu vs "
               "whole %zu, encode %zu vs %zu", b2k, w2k, e2k, we2k);
        CHECK(!kiln_vae_set_banding(k, 0, 32, &err));
        size_t b2k32 = kiln_vae_scratch_bytes(k, KILN_VAE_DECODER, 1, 2048, 2048);
        CHECKF(b2k32 < b2k, "bands of 32 rows %zu, of 128 %zu", b2k32, b2k);
        CHECK(kiln_vae_set_banding(k, -1, 32, &err) == KILN_ERR_INVALID);
        CHECK(kiln_vae_set_banding(k, 0, 0, &err) == KILN_ERR_INVALID);
        CHECK(kiln_vae_set_banding(k, 0, 65537, &err) == KILN_ERR_INVALID);
    }
    kiln_vae_free(k);
    kiln_vae_free(zi);
}

/* --- bad inputs ------------------------------------------------------------ */

static kiln_status try_decode(kiln_vae *vae, const int64_t zs[4], const int64_t is[4],
                              kiln_err *err)
{
    kiln_tensor z = {0}, img = {0};
    kiln_status st = kiln_be_alloc(be, &z, be->act_dtype, 4, zs);
    if (!st)
        st = kiln_be_alloc(be, &img, be->act_dtype, 4, is);
    if (!st)
        st = kiln_vae_decode(vae, &z, &img, NULL, err);
    kiln_be_free(be, &z);
    kiln_be_free(be, &img);
    return st;
}

static kiln_status try_encode(kiln_vae *vae, const int64_t xs[4], const int64_t ms[4],
                              kiln_err *err)
{
    kiln_tensor x = {0}, m = {0};
    kiln_status st = kiln_be_alloc(be, &x, be->act_dtype, 4, xs);
    if (!st)
        st = kiln_be_alloc(be, &m, be->act_dtype, 4, ms);
    if (!st)
        st = kiln_vae_encode(vae, &x, &m, NULL, err);
    kiln_be_free(be, &x);
    kiln_be_free(be, &m);
    return st;
}

static void test_bad_inputs(void)
{
    kiln_vae *vae = load_vae("ckpt/klein-tiny", KILN_VAE_DECODER | KILN_VAE_ENCODER);
    if (!vae)
        return;
    kiln_err err = {0};
    CHECK(try_decode(vae, (int64_t[]){1, 4, 8, 8}, (int64_t[]){1, 3, 64, 64}, &err) ==
          KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "4 channels") && strstr(err.msg, "decodes 8"), "%s", err.msg);
    CHECK(try_decode(vae, (int64_t[]){1, 8, 8, 8}, (int64_t[]){1, 3, 64, 60}, &err) ==
          KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "[1, 3, 64, 60]") && strstr(err.msg, "[1, 3, 64, 64]"), "%s",
           err.msg);
    CHECK(try_decode(vae, (int64_t[]){2, 8, 8, 8}, (int64_t[]){1, 3, 64, 64}, &err) ==
          KILN_ERR_INVALID);
    CHECK(try_encode(vae, (int64_t[]){1, 3, 130, 64}, (int64_t[]){1, 8, 16, 8}, &err) ==
          KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "130x64") && strstr(err.msg, "multiples of 8"), "%s", err.msg);
    CHECK(try_encode(vae, (int64_t[]){1, 3, 60, 64}, (int64_t[]){1, 8, 7, 8}, &err) ==
          KILN_ERR_INVALID);
    CHECK(try_encode(vae, (int64_t[]){1, 4, 64, 64}, (int64_t[]){1, 8, 8, 8}, &err) ==
          KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "4 channels"), "%s", err.msg);
    CHECK(try_encode(vae, (int64_t[]){1, 3, 64, 64}, (int64_t[]){1, 16, 8, 8}, &err) ==
          KILN_ERR_INVALID);

    /* A 3-D latent and a dtype the backend does not compute in. */
    kiln_tensor z = {0}, img = {0};
    if (!kiln_be_alloc(be, &z, be->act_dtype, 3, (int64_t[]){8, 8, 8}) &&
        !kiln_be_alloc(be, &img, be->act_dtype, 4, (int64_t[]){1, 3, 64, 64})) {
        CHECK(kiln_vae_decode(vae, &z, &img, NULL, &err) == KILN_ERR_INVALID);
        CHECKF(strstr(err.msg, "4 dims"), "%s", err.msg);
    }
    kiln_be_free(be, &z);
    if (!kiln_be_alloc(be, &z, KILN_I32, 4, (int64_t[]){1, 8, 8, 8})) {
        CHECK(kiln_vae_decode(vae, &z, &img, NULL, &err) == KILN_ERR_INVALID);
        CHECKF(strstr(err.msg, "dtype"), "%s", err.msg);
    }
    kiln_be_free(be, &z);
    kiln_be_free(be, &img);
    kiln_be_check(be, NULL); /* a backend refusing I32 must not linger */

    /* A valid call still works after the refusals. */
    CHECK(try_decode(vae, (int64_t[]){1, 8, 3, 5}, (int64_t[]){1, 3, 24, 40}, &err) == KILN_OK);
    kiln_vae_free(vae);

    /* The half that was not loaded. */
    vae = load_vae("ckpt/zimage-tiny", KILN_VAE_DECODER);
    if (vae) {
        CHECK(try_encode(vae, (int64_t[]){1, 3, 64, 64}, (int64_t[]){1, 4, 8, 8}, &err) ==
              KILN_ERR_INVALID);
        CHECKF(strstr(err.msg, "encoder was not loaded"), "%s", err.msg);
    }
    kiln_vae_free(vae);
}

static void test_bad_configs(void)
{
    kiln_err err = {0};
    CHECK(load_with("_class_name", cJSON_CreateString("AutoencoderTiny"), &err) ==
          KILN_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "AutoencoderTiny"), "%s", err.msg);
    CHECK(load_with("norm_num_groups", cJSON_CreateNumber(3), &err) == KILN_ERR_FORMAT);
    CHECKF(strstr(err.msg, "norm_num_groups"), "%s", err.msg);
    CHECK(load_with("act_fn", cJSON_CreateString("gelu"), &err) == KILN_ERR_UNSUPPORTED);
    CHECK(load_with("layers_per_block", cJSON_CreateString("2"), &err) == KILN_ERR_FORMAT);
    CHECKF(strstr(err.msg, "vae/config.json") && strstr(err.msg, "layers_per_block"), "%s",
           err.msg);
    /* A config that does not match the weights names the first wrong tensor. */
    CHECK(load_with("latent_channels", cJSON_CreateNumber(16), &err) == KILN_ERR_FORMAT);
    CHECKF(strstr(err.msg, "bn.running_mean"), "%s", err.msg);
    CHECK(load_with("layers_per_block", cJSON_CreateNumber(3), &err) == KILN_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "resnets.3"), "%s", err.msg);
    /* Without the mid attention its weights are simply not read. */
    kiln_err ok = {0};
    CHECKF(load_with("mid_block_add_attention", cJSON_CreateFalse(), &ok) == KILN_OK, "%s",
           ok.msg);
}

int main(void)
{
    be = oracle_cpu_backend();
    RUN(test_all_cases);
    RUN(test_info);
    RUN(test_banded);
    RUN(test_bad_inputs);
    RUN(test_bad_configs);
    kiln_backend_destroy(be);
    return test_finish();
}
