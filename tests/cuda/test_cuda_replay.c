/* Recorded DiT steps (models/flux2_dit_replay.c) against the same steps run
 * op by op: two instances of the tiny klein DiT on one CUDA backend, one
 * loaded with KILN_GRAPHS=0, fed the same sequence of inputs (new latents,
 * text and time every call, as a denoise loop and CFG do, two batch sizes
 * and two image sizes interleaved so the recordings share the slots).  Every
 * output must be bit-identical, including after the backend's scratch
 * memory moved under existing recordings.  The same for the Z-Image DiT
 * (models/zimage_dit_replay.c) on the tiny Z-Image checkpoint, with batches
 * whose captions pad to different lengths (per-item RoPE rows and
 * attention) and captions that change length between calls.  The klein
 * comparison runs again in the FP8 mode (kiln_flux2_dit_quantize_fp8).
 *
 * Needs $KILN_SHARED/oracle; skipped (exit 77) without a CUDA device unless
 * KILN_REQUIRE_GPU=1. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "models/flux2_dit.h"
#include "models/latents.h"
#include "models/rng.h"
#include "models/zimage_dit.h"
#include "tests/oracle/oracle_util.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

typedef struct shape {
    int64_t B, h, w, T;
} shape;

/* One forward of `m` on inputs drawn from `seed`; the output downloaded
 * into a malloc'd array of *n floats (NULL on failure, reported). */
static float *forward(kiln_backend *be, kiln_flux2_dit *m, shape s, uint64_t seed, int64_t *n)
{
    const kiln_flux2_dit_config *c = kiln_flux2_dit_get_config(m);
    int64_t N = s.h * s.w;
    size_t nx = (size_t)(s.B * N * c->in_channels), nt = (size_t)(s.B * s.T * c->joint_dim);
    float *hx = malloc(nx * sizeof *hx), *ht = malloc(nt * sizeof *ht);
    int32_t *img_ids = malloc((size_t)N * 4 * sizeof *img_ids);
    int32_t *txt_ids = malloc((size_t)s.T * 4 * sizeof *txt_ids);
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(seed, &err);
    float *out = NULL;
    kiln_tensor x = {0}, txt = {0}, v = {0};
    if (!hx || !ht || !img_ids || !txt_ids || !g || kiln_randn(g, hx, nx, KILN_F32, &err) ||
        kiln_randn(g, ht, nt, KILN_F32, &err)) {
        CHECKF(0, "setup: %s", err.msg[0] ? err.msg : "out of memory");
        goto done;
    }
    kiln_latents_image_ids(img_ids, s.h, s.w);
    kiln_latents_text_ids(txt_ids, s.T);
    float t[8];
    for (int64_t b = 0; b < s.B; b++)
        t[b] = (float)(seed % 1000) + 0.5f * (float)b;
    kiln_be_from_host(be, &x, 3, (int64_t[]){s.B, N, c->in_channels}, hx, KILN_F32);
    kiln_be_from_host(be, &txt, 3, (int64_t[]){s.B, s.T, c->joint_dim}, ht, KILN_F32);
    kiln_be_alloc(be, &v, be->act_dtype, 3, (int64_t[]){s.B, N, c->out_channels});
    if (kiln_be_check(be, &err)) {
        CHECKF(0, "inputs: %s", err.msg);
        goto done;
    }
    kiln_flux2_dit_input in = {.x = &x, .txt = &txt, .t = t, .img_ids = img_ids,
                               .txt_ids = txt_ids};
    *n = kiln_tensor_numel(&v);
    out = malloc((size_t)*n * sizeof *out);
    if (!out || kiln_flux2_dit_forward(m, &in, &v, &err)) {
        CHECKF(0, "forward: %s", out ? err.msg : "out of memory");
        free(out);
        out = NULL;
        goto done;
    }
    kiln_be_download(be, &v, out);
    if (kiln_be_check(be, &err)) {
        CHECKF(0, "download: %s", err.msg);
        free(out);
        out = NULL;
    }
done:
    kiln_be_free(be, &x), kiln_be_free(be, &txt), kiln_be_free(be, &v);
    kiln_rng_destroy(g);
    free(hx), free(ht), free(img_ids), free(txt_ids);
    return out;
}

/* The Z-Image DiT: inputs drawn from `seed`, captions of cap_len rows. */
typedef struct zshape {
    int64_t B, h, w, T, cap_len[2];
} zshape;

static float *zforward(kiln_backend *be, kiln_zimage_dit *m, zshape s, uint64_t seed, int64_t *n)
{
    const kiln_zimage_dit_config *c = kiln_zimage_dit_get_config(m);
    const int64_t N = s.h * s.w, P = c->patch_features;
    size_t nx = (size_t)(s.B * N * P), nt = (size_t)(s.B * s.T * c->cap_feat_dim);
    float *hx = malloc(nx * sizeof *hx), *ht = malloc(nt * sizeof *ht), *out = NULL;
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(seed, &err);
    kiln_tensor x = {0}, cap = {0}, v = {0};
    if (!hx || !ht || !g || kiln_randn(g, hx, nx, KILN_F32, &err) ||
        kiln_randn(g, ht, nt, KILN_F32, &err)) {
        CHECKF(0, "setup: %s", err.msg[0] ? err.msg : "out of memory");
        goto done;
    }
    float t[2] = {(float)(seed % 1000) / 1000.0f, 0.5f};
    kiln_be_from_host(be, &x, 3, (int64_t[]){s.B, N, P}, hx, KILN_F32);
    kiln_be_from_host(be, &cap, 3, (int64_t[]){s.B, s.T, c->cap_feat_dim}, ht, KILN_F32);
    kiln_be_alloc(be, &v, be->act_dtype, 3, (int64_t[]){s.B, N, P});
    if (kiln_be_check(be, &err)) {
        CHECKF(0, "inputs: %s", err.msg);
        goto done;
    }
    kiln_zimage_dit_input in = {.x = &x, .h = s.h, .w = s.w, .cap = &cap, .cap_len = s.cap_len,
                                .t = t};
    *n = kiln_tensor_numel(&v);
    out = malloc((size_t)*n * sizeof *out);
    if (!out || kiln_zimage_dit_forward(m, &in, &v, &err)) {
        CHECKF(0, "forward: %s", out ? err.msg : "out of memory");
        free(out);
        out = NULL;
        goto done;
    }
    kiln_be_download(be, &v, out);
    if (kiln_be_check(be, &err)) {
        CHECKF(0, "download: %s", err.msg);
        free(out);
        out = NULL;
    }
done:
    kiln_be_free(be, &x), kiln_be_free(be, &cap), kiln_be_free(be, &v);
    kiln_rng_destroy(g);
    free(hx), free(ht);
    return out;
}

static void zimage_replay(kiln_backend *be)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/zimage-tiny"), &err);
    CHECKF(ck != NULL, "checkpoint: %s", err.msg);
    if (!ck)
        return;
    setenv("KILN_GRAPHS", "0", 1);
    kiln_zimage_dit *plain = kiln_zimage_dit_load(be, ck, &err);
    unsetenv("KILN_GRAPHS");
    kiln_zimage_dit *rec = plain ? kiln_zimage_dit_load(be, ck, &err) : NULL;
    CHECKF(plain && rec, "load: %s", err.msg);
    /* one item; two of ragged captions (32 and 96 rows); the same with the
     * lengths swapped (the RoPE tables rewritten in place); another grid */
    const zshape shapes[] = {{1, 16, 16, 20, {20, 0}}, {2, 10, 6, 75, {10, 75}},
                             {2, 10, 6, 75, {75, 10}}, {1, 8, 12, 40, {33, 0}}};
    int compared = 0, identical = 0;
    for (int round = 0; round < 5 && plain && rec; round++)
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            uint64_t seed = 1000 * (uint64_t)round + k;
            int64_t n1 = 0, n2 = 0;
            float *a = zforward(be, plain, shapes[k], seed, &n1);
            float *b = zforward(be, rec, shapes[k], seed, &n2);
            if (a && b && n1 == n2) {
                compared++;
                int same = !memcmp(a, b, (size_t)n1 * sizeof *a);
                identical += same;
                CHECKF(same, "zimage round %d shape %zu: recorded forward differs", round, k);
            }
            free(a), free(b);
        }
    printf("recorded vs op-by-op Z-Image DiT forwards: %d of %d bit-identical\n", identical,
           compared);
    CHECK(compared == 20);
    kiln_zimage_dit_destroy(rec);
    kiln_zimage_dit_destroy(plain);
    kiln_checkpoint_close(ck);
}

/* The klein DiT recorded and op by op, exact or in the FP8 mode (whose
 * activation quantisation keeps its scales on the device and its codes in
 * the backend's scratch, so recordings must replay it bit for bit too). */
static void klein_replay(kiln_backend *be, kiln_checkpoint *ck, int fp8)
{
    kiln_err err = {0};
    setenv("KILN_GRAPHS", "0", 1);
    kiln_flux2_dit *plain = kiln_flux2_dit_load(be, ck, &err);
    unsetenv("KILN_GRAPHS");
    kiln_flux2_dit *rec = plain ? kiln_flux2_dit_load(be, ck, &err) : NULL;
    CHECKF(plain && rec, "load: %s", err.msg);
    if (fp8 && plain && rec) {
        int n1 = 0, n2 = 0;
        CHECKF(!kiln_flux2_dit_quantize_fp8(plain, &n1, &err) &&
                   !kiln_flux2_dit_quantize_fp8(rec, &n2, &err),
               "fp8: %s", err.msg);
        CHECK(n1 > 0 && n1 == n2);
    }

    /* Seven calls per shape: a key runs op by op twice while the arenas
     * settle, then is recorded and replayed. */
    const shape shapes[] = {{1, 16, 16, 32}, {2, 16, 16, 32}, {1, 8, 24, 16}};
    int compared = 0, identical = 0;
    for (int round = 0; round < 7 && plain && rec; round++) {
        for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
            uint64_t seed = 1000 * (uint64_t)round + k;
            int64_t n1 = 0, n2 = 0;
            float *a = forward(be, plain, shapes[k], seed, &n1);
            float *b = forward(be, rec, shapes[k], seed, &n2);
            if (a && b && n1 == n2) {
                compared++;
                int same = !memcmp(a, b, (size_t)n1 * sizeof *a);
                identical += same;
                CHECKF(same, "round %d shape %zu: recorded forward differs", round, k);
            }
            free(a), free(b);
        }
        if (round == 4) {
            /* Scratch regrowth (forced here by a wide single-head
             * attention, as the VAE decoder's mid-block on the same backend
             * does: it runs as GEMMs through tens of MB of scratch) must
             * retire recordings that point into the old scratch. */
            kiln_tensor q = {0}, o = {0};
            const int64_t shape[4] = {1, 4096, 1, 512};
            kiln_be_alloc(be, &q, be->act_dtype, 4, shape);
            kiln_be_alloc(be, &o, be->act_dtype, 4, shape);
            kiln_attn_opts opts = {.scale = 0.044f};
            kiln_be_attention(be, &o, &q, &q, &q, &opts);
            CHECKF(!kiln_be_check(be, &err), "attention: %s", err.msg);
            kiln_be_free(be, &q), kiln_be_free(be, &o);
        }
    }
    printf("recorded vs op-by-op DiT forwards%s: %d of %d bit-identical\n",
           fp8 ? " (fp8)" : "", identical, compared);
    CHECK(compared == 21);
    kiln_flux2_dit_destroy(rec);
    kiln_flux2_dit_destroy(plain);
}

int main(void)
{
    kiln_err err = {0};
    kiln_backend *be = kiln_backend_create("cuda", 0, &err);
    if (!be)
        return gpu_test_unavailable("cuda backend", &err);
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    CHECKF(ck != NULL, "checkpoint: %s", err.msg);
    if (!ck)
        return test_finish();
    klein_replay(be, ck, 0);
    klein_replay(be, ck, 1);
    kiln_checkpoint_close(ck);
    zimage_replay(be);
    kiln_backend_destroy(be);
    return test_finish();
}
