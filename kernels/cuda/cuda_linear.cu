/* CUDA linear layer through cuBLASLt: bf16 x and w, fp32 accumulation, bias
 * added in the GEMM epilogue, bf16 (or f32) output.
 *
 * Row-major y (M, N) = x (M, K) * w (N, K)^T is, in cuBLAS's column-major
 * terms, y^T (N x M) = op_T(w^T as K x N) * x^T (K x M): A = w with lda = K
 * transposed, B = x with ldb = K, C = D = y with ldc = N.  The bias vector
 * runs along cuBLAS's rows (N), which is what CUBLASLT_EPILOGUE_BIAS adds.
 *
 * Descriptors and the heuristic's choice are cached per shape, so a steady
 * denoising loop makes no planning calls. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.cuh"

#define LINEAR_CACHE_SIZE 128

typedef struct linear_key {
    int64_t m, n, k;
    int ydt, bdt; /* bdt: -1 without bias */
    int align;    /* smallest alignment of the four pointers, bytes (<= 256) */
} linear_key;

typedef struct linear_plan {
    linear_key key;
    int used;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} linear_plan;

struct cuda_linear_cache {
    linear_plan plans[LINEAR_CACHE_SIZE];
    int next; /* round-robin victim once full */
};

static int lt_ok(kiln_backend *be, cublasStatus_t s, const char *what)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return 1;
    cuda_check_context(be, what);
    kiln_be_fail(be, KILN_ERR_DEVICE, "cublasLt: %s: %s", what, cublasLtGetStatusString(s));
    return 0;
}

static void plan_release(linear_plan *p)
{
    if (p->op)
        cublasLtMatmulDescDestroy(p->op);
    if (p->a)
        cublasLtMatrixLayoutDestroy(p->a);
    if (p->b)
        cublasLtMatrixLayoutDestroy(p->b);
    if (p->c)
        cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

int cuda_linear_init(kiln_backend *be)
{
    cuda_of(be)->linear_cache = (struct cuda_linear_cache *)calloc(1, sizeof(struct cuda_linear_cache));
    if (!cuda_of(be)->linear_cache) {
        kiln_be_fail(be, KILN_ERR_NOMEM, "out of memory");
        return 0;
    }
    return 1;
}

void cuda_linear_fini(kiln_backend *be)
{
    struct cuda_linear_cache *lc = cuda_of(be)->linear_cache;
    if (!lc)
        return;
    for (int i = 0; i < LINEAR_CACHE_SIZE; i++)
        plan_release(&lc->plans[i]);
    free(lc);
    cuda_of(be)->linear_cache = NULL;
}

static cudaDataType_t lt_type(kiln_dtype dt) { return dt == KILN_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

static int ptr_align(const void *p)
{
    uintptr_t v = (uintptr_t)p;
    int a = 256;
    while (a > 1 && (v & (uintptr_t)(a - 1)))
        a >>= 1;
    return a;
}

static linear_plan *plan_build(kiln_backend *be, linear_plan *p, const linear_key *key)
{
    cuda_impl *c = cuda_of(be);
    memset(p, 0, sizeof *p);
    p->key = *key;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtEpilogue_t epi = key->bdt >= 0 ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    cudaDataType_t ydt = lt_type((kiln_dtype)key->ydt);
    uint32_t align = (uint32_t)key->align;
    uint64_t ws = c->lt_workspace_bytes;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    int ok = lt_ok(be, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                   "MatmulDescCreate") &&
             lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                      sizeof ta), "TRANSA") &&
             lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                      sizeof tb), "TRANSB") &&
             lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                                      sizeof epi), "EPILOGUE");
    if (ok && key->bdt >= 0) {
        cudaDataType_t bdt = lt_type((kiln_dtype)key->bdt);
        ok = lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                      &bdt, sizeof bdt), "BIAS_DATA_TYPE");
    }
    ok = ok &&
         lt_ok(be, cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, key->k, key->n, key->k),
               "layout A") &&
         lt_ok(be, cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, key->k, key->m, key->k),
               "layout B") &&
         lt_ok(be, cublasLtMatrixLayoutCreate(&p->c, ydt, key->n, key->m, key->n), "layout C") &&
         lt_ok(be, cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate") &&
         lt_ok(be, cublasLtMatmulPreferenceSetAttribute(
                       pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
               "MAX_WORKSPACE");
    /* Every operand gets the smallest alignment of the call's four pointers. */
    static const cublasLtMatmulPreferenceAttributes_t align_attrs[] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (size_t i = 0; ok && i < sizeof align_attrs / sizeof *align_attrs; i++)
        ok = lt_ok(be, cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &align,
                                                            sizeof align),
                   "MIN_ALIGNMENT");
    ok = ok && lt_ok(be, cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c,
                                                        pref, 1, &res, &found),
                     "AlgoGetHeuristic");
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    if (ok && !found)
        kiln_be_fail(be, KILN_ERR_UNSUPPORTED,
                     "cublasLt has no algorithm for linear M=%lld N=%lld K=%lld",
                     (long long)key->m, (long long)key->n, (long long)key->k);
    if (!ok || !found) {
        plan_release(p);
        return NULL;
    }
    p->algo = res.algo;
    p->used = 1;
    return p;
}

static linear_plan *plan_get(kiln_backend *be, const linear_key *key)
{
    struct cuda_linear_cache *lc = cuda_of(be)->linear_cache;
    for (int i = 0; i < LINEAR_CACHE_SIZE; i++) {
        linear_plan *p = &lc->plans[i];
        if (p->used && !memcmp(&p->key, key, sizeof *key))
            return p;
    }
    linear_plan *victim = NULL;
    for (int i = 0; i < LINEAR_CACHE_SIZE && !victim; i++)
        if (!lc->plans[i].used)
            victim = &lc->plans[i];
    if (!victim) {
        victim = &lc->plans[lc->next];
        lc->next = (lc->next + 1) % LINEAR_CACHE_SIZE;
    }
    plan_release(victim);
    return plan_build(be, victim, key);
}

void cuda_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                 const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x);
    int64_t n = w->ndim == 2 ? w->shape[0] : -1;
    if (CUDA_REQUIRE(be, w->ndim == 2 && w->shape[1] == k && kiln_tensor_cols(y) == n &&
                             kiln_tensor_rows(y) == rows &&
                             (!bias || kiln_tensor_numel(bias) == n) && y->data != x->data) ||
        CUDA_REQUIRE(be, x->dtype == KILN_BF16 && w->dtype == KILN_BF16 && is_act(y) &&
                             (!bias || is_act(bias))) ||
        !rows || !n || !cuda_enter(be))
        return;
    linear_key key;
    memset(&key, 0, sizeof key); /* the key is compared bytewise, padding included */
    key.m = rows;
    key.n = n;
    key.k = k;
    key.ydt = y->dtype;
    key.bdt = bias ? (int)bias->dtype : -1;
    key.align = ptr_align(x->data);
    if (ptr_align(w->data) < key.align)
        key.align = ptr_align(w->data);
    if (ptr_align(y->data) < key.align)
        key.align = ptr_align(y->data);
    if (cuda_of(be)->lt_max_align < key.align)
        key.align = cuda_of(be)->lt_max_align;
    linear_plan *p = plan_get(be, &key);
    if (!p)
        return;
    if (bias && !lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                          &bias->data, sizeof bias->data),
                       "BIAS_POINTER"))
        return;
    cuda_impl *c = cuda_of(be);
    const float alpha = 1.0f, beta = 0.0f;
    lt_ok(be, cublasLtMatmul(c->lt, p->op, &alpha, w->data, p->a, x->data, p->b, &beta, y->data,
                             p->c, y->data, p->c, &p->algo, c->lt_workspace,
                             c->lt_workspace_bytes, c->stream),
          "Matmul");
}
