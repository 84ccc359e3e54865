/* Loading checkpoint tensors into a backend: conversion from the stored
 * dtype, shape checks that name the tensor, and dim-0 concatenation. */
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "models/weights.h"
#include "tests/oracle/oracle_util.h"
#include "tests/test.h"
#include "tests/unit/io_helpers.h"

static kiln_backend *be;
static kiln_st *st;

/* A file with BF16, F16 and F32 tensors of known values, plus an I64. */
static void make_file(void)
{
    static uint16_t q[6], k[4], h[4];
    static float v[4], bad[6];
    static int64_t counter = 3;
    for (int i = 0; i < 6; i++)
        q[i] = kiln_f32_to_bf16(0.5f * (float)i - 1.0f);
    for (int i = 0; i < 4; i++) {
        k[i] = kiln_f32_to_bf16(10.0f + (float)i);
        v[i] = -0.25f * (float)i;
    }
    h[0] = 0x3c00; /* F16 1.0 */
    h[1] = 0xc000; /* -2.0 */
    h[2] = 0x3800; /* 0.5 */
    h[3] = 0x0000;
    kiln_st_entry e[] = {
        {"blk.0.q.weight", KILN_BF16, 2, {3, 2}, q},
        {"blk.0.k.weight", KILN_BF16, 2, {2, 2}, k},
        {"blk.0.v.weight", KILN_F32, 2, {2, 2}, v},
        {"blk.0.h.weight", KILN_F16, 1, {4}, h},
        {"blk.0.bad.weight", KILN_F32, 2, {2, 3}, bad},
        {"counter", KILN_I64, 0, {0}, &counter},
    };
    kiln_err err = {0};
    CHECK(kiln_st_write(io_path("w.safetensors"), e, 6, &err) == KILN_OK);
    st = kiln_st_open(io_path("w.safetensors"), "transformer", &err);
    CHECKF(st != NULL, "%s", err.msg);
}

static void download(const kiln_tensor *t, float *out)
{
    kiln_be_download(be, t, out);
    kiln_be_sync(be);
}

static void test_load(void)
{
    kiln_err err = {0};
    kiln_tensor t;
    CHECKF(kiln_weight_load(be, st, &t, 2, (int64_t[]){3, 2}, &err, "blk.%d.q.weight", 0) ==
               KILN_OK, "%s", err.msg);
    CHECK(t.dtype == be->act_dtype && t.ndim == 2 && t.shape[0] == 3 && t.shape[1] == 2);
    float out[6];
    download(&t, out);
    for (int i = 0; i < 6; i++)
        CHECK_NEAR(out[i], 0.5f * (float)i - 1.0f, 0);
    kiln_be_free(be, &t);

    CHECKF(kiln_weight_load(be, st, &t, 1, (int64_t[]){4}, &err, "blk.0.h.weight") == KILN_OK,
           "%s", err.msg);
    download(&t, out);
    CHECK(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f && out[3] == 0.0f);
    kiln_be_free(be, &t);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
}

static void test_load_errors(void)
{
    kiln_err err = {0};
    kiln_tensor t;
    CHECK(kiln_weight_load(be, st, &t, 2, (int64_t[]){2, 3}, &err, "blk.%d.q.weight", 0) ==
          KILN_ERR_FORMAT);
    CHECKF(strstr(err.msg, "blk.0.q.weight") && strstr(err.msg, "[3, 2]") &&
               strstr(err.msg, "[2, 3]") && strstr(err.msg, "transformer"),
           "%s", err.msg);
    CHECK(t.data == NULL);
    CHECK(kiln_weight_load(be, st, &t, 1, (int64_t[]){6}, &err, "blk.0.q.weight") ==
          KILN_ERR_FORMAT);
    CHECK(kiln_weight_load(be, st, &t, 2, (int64_t[]){3, 2}, &err, "blk.%d.q.weight", 7) ==
          KILN_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "blk.7.q.weight"), "%s", err.msg);
    CHECK(kiln_weight_load(be, st, &t, 0, NULL, &err, "counter") == KILN_ERR_UNSUPPORTED);
    CHECKF(strstr(err.msg, "counter") && strstr(err.msg, "I64"), "%s", err.msg);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
}

static void test_concat(void)
{
    kiln_err err = {0};
    kiln_tensor t;
    /* mixed BF16/F32 parts go through an F32 staging copy */
    const char *names[] = {"blk.0.q.weight", "blk.0.k.weight", "blk.0.v.weight"};
    CHECKF(kiln_weight_load_concat(be, st, &t, names, 3, &err) == KILN_OK, "%s", err.msg);
    CHECK(t.ndim == 2 && t.shape[0] == 7 && t.shape[1] == 2);
    float out[14];
    download(&t, out);
    for (int i = 0; i < 6; i++)
        CHECK_NEAR(out[i], 0.5f * (float)i - 1.0f, 0);
    for (int i = 0; i < 4; i++) {
        CHECK_NEAR(out[6 + i], 10.0f + (float)i, 0);
        CHECK_NEAR(out[10 + i], -0.25f * (float)i, 0);
    }
    kiln_be_free(be, &t);

    /* same-dtype parts are stacked as stored */
    const char *qk[] = {"blk.0.k.weight", "blk.0.q.weight"};
    CHECKF(kiln_weight_load_concat(be, st, &t, qk, 2, &err) == KILN_OK, "%s", err.msg);
    CHECK(t.shape[0] == 5 && t.shape[1] == 2);
    download(&t, out);
    CHECK(out[0] == 10.0f && out[4] == -1.0f && out[9] == 1.5f);
    kiln_be_free(be, &t);

    const char *bad[] = {"blk.0.q.weight", "blk.0.bad.weight"};
    CHECK(kiln_weight_load_concat(be, st, &t, bad, 2, &err) == KILN_ERR_FORMAT);
    CHECKF(strstr(err.msg, "blk.0.bad.weight") && strstr(err.msg, "[2, 3]"), "%s", err.msg);
    const char *rank[] = {"blk.0.q.weight", "blk.0.h.weight"};
    CHECK(kiln_weight_load_concat(be, st, &t, rank, 2, &err) == KILN_ERR_FORMAT);
    const char *missing[] = {"blk.0.q.weight", "blk.1.q.weight"};
    CHECK(kiln_weight_load_concat(be, st, &t, missing, 2, &err) == KILN_ERR_NOT_FOUND);
    CHECKF(strstr(err.msg, "blk.1.q.weight"), "%s", err.msg);
    CHECK(kiln_weight_load_concat(be, st, &t, names, 0, &err) == KILN_ERR_INVALID);
    CHECK(t.data == NULL);
}

/* The oracle's bf16 weights reach the backend bit-exactly as f32. */
static void test_oracle_tensor(void)
{
    kiln_err err = {0};
    kiln_st *o = kiln_st_open(oracle_path("ckpt/klein-tiny/transformer"), "transformer", &err);
    CHECKF(o != NULL, "%s", err.msg);
    if (!o)
        return;
    kiln_tensor t;
    CHECKF(kiln_weight_load(be, o, &t, 2, (int64_t[]){32, 128}, &err, "proj_out.weight") ==
               KILN_OK, "%s", err.msg);
    const kiln_st_tensor *raw = kiln_st_find(o, "proj_out.weight");
    static float out[32 * 128];
    download(&t, out);
    int same = raw != NULL;
    for (int i = 0; raw && i < 32 * 128; i++)
        same &= out[i] == kiln_bf16_to_f32(((const uint16_t *)raw->data)[i]);
    CHECK(same);
    kiln_be_free(be, &t);
    kiln_st_close(o);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 1;
    }
    make_file();
    if (st) {
        RUN(test_load);
        RUN(test_load_errors);
        RUN(test_concat);
    }
    RUN(test_oracle_tensor);
    kiln_st_close(st);
    kiln_backend_destroy(be);
    return test_finish();
}
