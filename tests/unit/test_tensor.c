#include "common/tensor.h"
#include "tests/test.h"

static void test_bf16_round_trip(void)
{
    CHECK(kiln_bf16_to_f32(kiln_f32_to_bf16(1.0f)) == 1.0f);
    /* 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0). */
    CHECK(kiln_round_bf16(1.0f + 1.0f / 256) == 1.0f);
    CHECK(kiln_round_bf16(1.0f + 3.0f / 256) == 1.0f + 4.0f / 256);
    CHECK(kiln_round_bf16(NAN) != kiln_round_bf16(NAN));
}

static void test_alloc_and_shape(void)
{
    kiln_err err = {0};
    kiln_tensor t;
    CHECK(kiln_tensor_host_alloc(&t, KILN_F32, 3, (int64_t[]){2, 3, 4}, &err) == KILN_OK);
    CHECK(kiln_tensor_numel(&t) == 24);
    CHECK(kiln_tensor_rows(&t) == 6 && kiln_tensor_cols(&t) == 4);
    CHECK(kiln_tensor_nbytes(&t) == 96);
    char buf[64];
    CHECK(!strcmp(kiln_tensor_shape_str(&t, buf, sizeof buf), "[2, 3, 4]"));
    kiln_tensor_host_free(&t);
    CHECK(kiln_tensor_host_alloc(&t, KILN_F32, 2, (int64_t[]){-1, 3}, &err) == KILN_ERR_INVALID);
    CHECK(kiln_tensor_host_alloc(&t, KILN_F32, 2, (int64_t[]){INT64_MAX / 2, 4}, &err) ==
          KILN_ERR_INVALID);
}

static void test_dtype_names(void)
{
    kiln_dtype dt;
    CHECK(kiln_dtype_parse("BF16", &dt) == 0 && dt == KILN_BF16);
    CHECK(kiln_dtype_parse("Q4", &dt) == -1);
    CHECK(kiln_dtype_size(KILN_I64) == 8);
}

int main(void)
{
    RUN(test_bf16_round_trip);
    RUN(test_alloc_and_shape);
    RUN(test_dtype_names);
    return test_finish();
}
