/* VAE against the fp32 oracle (shared/oracle/cases): every case's
 * vae_decode_in -> vae_decode_out, the decoder's stage outputs of the two
 * debug cases, the encoder mean of every edit reference, the exposed latent
 * statistics, and clear failures for bad inputs and bad configs. */
#include <dirent.h>
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

/* Compares a decoder stage with the debug file's dbg.vae_decoder.<stage>. */
static void tap_compare(void *ctx, const char *stage, const kiln_tensor *t)
{
    tap_ctx *c = ctx;
    char key[128], what[400];
    snprintf(key, sizeof key, "dbg.vae_decoder.%s", stage);
    const kiln_st_tensor *ref = kiln_st_find(c->dbg, key);
    if (!ref)
        return;
    snprintf(what, sizeof what, "%s %s", c->cs, key);
    compare(what, t, ref);
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
            kiln_status st = kiln_vae_encode_mean(vae, &x, &m, NULL, &err);
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

/* --- tiled decoding --------------------------------------------------------- */

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

/* diffusers' AutoencoderKL.tiled_decode written out on the host: tiles of T
 * latents every S, blend_v then blend_h over E pixels with already-blended
 * neighbours, the top-left L x L of each tile kept.  Each tile is decoded in
 * one piece by `vae`. */
static float *reference_tiled(kiln_vae *vae, const float *z, int64_t B, int64_t zc, int64_t h,
                              int64_t w, int64_t T, int64_t S, int64_t E, int64_t L)
{
    int64_t nr = (h + S - 1) / S, nc = (w + S - 1) / S, H = 8 * h, W = 8 * w, P = B * 3;
    float **tiles = calloc((size_t)(nr * nc), sizeof *tiles);
    int64_t *th = calloc((size_t)nr, sizeof *th), *tw = calloc((size_t)nc, sizeof *tw);
    float *out = calloc((size_t)(P * H * W), sizeof *out);
    int ok = tiles && th && tw && out;
    for (int64_t r = 0; ok && r < nr; r++)
        for (int64_t c = 0; ok && c < nc; c++) {
            th[r] = h - r * S < T ? h - r * S : T;
            tw[c] = w - c * S < T ? w - c * S : T;
            float *sub = malloc(sizeof(float) * (size_t)(B * zc * th[r] * tw[c]));
            ok = sub != NULL;
            for (int64_t p = 0; ok && p < B * zc; p++)
                for (int64_t y = 0; y < th[r]; y++)
                    memcpy(sub + (p * th[r] + y) * tw[c], z + (p * h + r * S + y) * w + c * S,
                           sizeof(float) * (size_t)tw[c]);
            ok = ok && (tiles[r * nc + c] = decode_host(vae, sub, B, zc, th[r], tw[c]));
            free(sub);
        }
    for (int64_t r = 0; ok && r < nr; r++)
        for (int64_t c = 0; c < nc; c++) {
            float *b = tiles[r * nc + c];
            int64_t hb = 8 * th[r], wb = 8 * tw[c];
            if (r > 0) {
                const float *a = tiles[(r - 1) * nc + c];
                int64_t ha = 8 * th[r - 1], e = ha < hb ? ha : hb;
                e = e < E ? e : E;
                for (int64_t p = 0; p < P; p++)
                    for (int64_t y = 0; y < e; y++)
                        for (int64_t x = 0; x < wb; x++) {
                            float ta = (float)(1.0 - (double)y / e), tb = (float)((double)y / e);
                            float *bv = &b[(p * hb + y) * wb + x];
                            *bv = a[(p * ha + ha - e + y) * wb + x] * ta + *bv * tb;
                        }
            }
            if (c > 0) {
                const float *a = tiles[r * nc + c - 1];
                int64_t wa = 8 * tw[c - 1], e = wa < wb ? wa : wb;
                e = e < E ? e : E;
                for (int64_t p = 0; p < P; p++)
                    for (int64_t y = 0; y < hb; y++)
                        for (int64_t x = 0; x < e; x++) {
                            float ta = (float)(1.0 - (double)x / e), tb = (float)((double)x / e);
                            float *bv = &b[(p * hb + y) * wb + x];
                            *bv = a[(p * hb + y) * wa + wa - e + x] * ta + *bv * tb;
                        }
            }
            int64_t lr = hb < L ? hb : L, lc = wb < L ? wb : L;
            for (int64_t p = 0; p < P; p++)
                for (int64_t y = 0; y < lr; y++)
                    memcpy(out + (p * H + r * L + y) * W + c * L, b + (p * hb + y) * wb,
                           sizeof(float) * (size_t)lc);
        }
    for (int64_t i = 0; tiles && i < nr * nc; i++)
        free(tiles[i]);
    free(tiles);
    free(th);
    free(tw);
    if (!ok) {
        free(out);
        return NULL;
    }
    return out;
}

/* With sample_size 64 the tiny VAE tiles 8x8 latents every 6 and blends 16
 * pixels.  A latent of 13x24 gives rows of 8, 7 and 1 latents and columns of
 * 8, 8, 8 and 6: short tiles in the middle and at both edges.  (The
 * reference differs from an untiled decode, so matching it shows that the
 * tiles were decoded separately.) */
static void test_tiled_decode(void)
{
    kiln_err err = {0};
    kiln_vae *vae = load_modified("sample_size", cJSON_CreateNumber(64), KILN_VAE_DECODER, &err);
    CHECKF(vae, "%s", err.msg);
    kiln_st *ref = oracle_check_open("klein_t2i_batch2", "ref_fp32.safetensors");
    const kiln_st_tensor *in = ref ? kiln_st_find(ref, "vae_decode_in") : NULL;
    CHECK(in && in->shape[0] == 2 && in->shape[2] == 16 && in->shape[3] == 24);
    if (!vae || !in || in->shape[2] != 16 || in->shape[3] != 24) {
        kiln_vae_free(vae);
        kiln_st_close(ref);
        return;
    }
    int64_t B = 1, zc = 8, h = 13, w = 24, n = B * 3 * 64 * h * w;
    float *z = malloc(sizeof(float) * (size_t)(B * zc * h * w));
    for (int64_t p = 0; z && p < B * zc; p++)
        memcpy(z + p * h * w, (const float *)in->data + p * 16 * w, sizeof(float) * (size_t)(h * w));
    float *want = z ? reference_tiled(vae, z, B, zc, h, w, 8, 6, 16, 48) : NULL;
    CHECKF(!kiln_vae_set_tiling(vae, 1, &err), "%s", err.msg);
    float *tiled = z ? decode_host(vae, z, B, zc, h, w) : NULL;
    CHECK(want && tiled);
    if (want && tiled)
        oracle_check_close("tiled decode vs host tiling", tiled, want, (size_t)n, 1e-5);
    /* A latent within one tile decodes in one piece, unchanged. */
    float *one = z ? decode_host(vae, z, B, zc, 8, 8) : NULL;
    CHECKF(!kiln_vae_set_tiling(vae, 0, &err), "%s", err.msg);
    float *one_plain = z ? decode_host(vae, z, B, zc, 8, 8) : NULL;
    CHECK(one && one_plain && !memcmp(one, one_plain, sizeof(float) * (size_t)(B * 3 * 64 * 64)));
    free(z);
    free(want);
    free(tiled);
    free(one);
    free(one_plain);
    kiln_st_close(ref);
    kiln_vae_free(vae);

    /* Memory: with tiling, decoder scratch no longer grows with the area. */
    vae = load_vae("ckpt/klein-tiny", KILN_VAE_DECODER);
    if (vae) {
        size_t plain = kiln_vae_scratch_bytes(vae, KILN_VAE_DECODER, 1, 1024, 1024);
        CHECKF(!kiln_vae_set_tiling(vae, 1, &err), "%s", err.msg);
        size_t small = kiln_vae_scratch_bytes(vae, KILN_VAE_DECODER, 1, 256, 256);
        size_t t1k = kiln_vae_scratch_bytes(vae, KILN_VAE_DECODER, 1, 1024, 1024);
        size_t t2k = kiln_vae_scratch_bytes(vae, KILN_VAE_DECODER, 1, 2048, 2048);
        CHECKF(small > 0 && t1k < plain / 4 && t2k < 3 * t1k, "scratch: untiled %zu, tiled "
               "256^2 %zu, 1024^2 %zu, 2048^2 %zu", plain, small, t1k, t2k);
    }
    kiln_vae_free(vae);
    /* sample_size 100: tiles of 12 latents every 9 keep 75 pixels, not 72. */
    vae = load_modified("sample_size", cJSON_CreateNumber(100), KILN_VAE_DECODER, &err);
    if (vae)
        CHECK(kiln_vae_set_tiling(vae, 1, &err) == KILN_ERR_UNSUPPORTED);
    kiln_vae_free(vae);
    vae = load_vae("ckpt/klein-tiny", KILN_VAE_ENCODER);
    if (vae)
        CHECK(kiln_vae_set_tiling(vae, 1, &err) == KILN_ERR_INVALID);
    kiln_vae_free(vae);
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
        st = kiln_vae_encode_mean(vae, &x, &m, NULL, err);
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
    RUN(test_tiled_decode);
    RUN(test_bad_inputs);
    RUN(test_bad_configs);
    kiln_backend_destroy(be);
    return test_finish();
}
