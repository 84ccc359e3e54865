/* CUDA linear layer through cuBLASLt: bf16 x and w, fp32 accumulation, bias
 * added in the GEMM epilogue, bf16 (or f32) output.
 *
 * Row-major y (M, N) = x (M, K) * w (N, K)^T is, in cuBLAS's column-major
 * terms, y^T (N x M) = op_T(w^T as K x N) * x^T (K x M): A = w with lda = K
 * transposed, B = x with ldb = K, C = D = y with ldc = N.  The bias vector
 * runs along cuBLAS's rows (N), which is what CUBLASLT_EPILOGUE_BIAS adds.
 *
 * Descriptors and the heuristic's choice are cached per shape, so a steady
 * denoising loop makes no planning calls.
 *
 * FP8 (an F8E4M3 weight, the FP8 mode of kernels/backend.h): x is first
 * quantised into the scratch buffer, each batch entry alone with its scale
 * on the device (cuda_fp8.cu), then one GEMM per entry runs with A = the
 * weight's E4M3 codes (transposed, as cuBLASLt's FP8 GEMMs require: "TN"),
 * B = the entry's codes, A and B scale pointers at the two tensors' scales
 * (so D = sw * sx * acc, all on the device: no host sync, graph-capturable),
 * fp32 accumulation (CUBLAS_COMPUTE_32F), bf16 (or f32) D and the bias
 * epilogue.  Per-tensor scales: cuBLAS 13's per-row ("outer vector")
 * scales have a single, slower kernel with the default accumulation
 * (docs/PERFORMANCE.md run X, kiln-fp8probe).  KILN_FP8_FAST_ACCUM=1
 * in the environment at backend creation turns on Hopper's faster,
 * less precise FP8 accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM), for
 * measuring; the op test's tolerance assumes it off. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.cuh"

extern "C" {
#include "common/fp8.h"
}

#define LINEAR_CACHE_SIZE 128

typedef struct linear_key {
    int64_t m, n, k;
    int ydt, bdt; /* bdt: -1 without bias */
    int align;    /* smallest alignment of the four pointers, bytes (<= 256) */
    int fp8;      /* E4M3 A and B with scale pointers */
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
    int8_t fp8_fast_accum; /* KILN_FP8_FAST_ACCUM=1 at creation */
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
    const char *fast = getenv("KILN_FP8_FAST_ACCUM");
    cuda_of(be)->linear_cache->fp8_fast_accum = fast && !strcmp(fast, "1");
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

/* a_scale, b_scale: the FP8 scale pointers of the call that builds the
 * plan (set again by every call); NULL otherwise. */
static linear_plan *plan_build(kiln_backend *be, linear_plan *p, const linear_key *key,
                               const void *a_scale, const void *b_scale)
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
    if (ok && key->fp8) {
        int8_t fast = c->linear_cache->fp8_fast_accum;
        ok = lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &a_scale, sizeof a_scale), "A_SCALE_POINTER") &&
             lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &b_scale, sizeof b_scale), "B_SCALE_POINTER") &&
             lt_ok(be, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                                      sizeof fast), "FAST_ACCUM");
    }
    cudaDataType_t abt = key->fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    ok = ok &&
         lt_ok(be, cublasLtMatrixLayoutCreate(&p->a, abt, key->k, key->n, key->k), "layout A") &&
         lt_ok(be, cublasLtMatrixLayoutCreate(&p->b, abt, key->k, key->m, key->k), "layout B") &&
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
                     "cublasLt has no algorithm for %slinear M=%lld N=%lld K=%lld",
                     key->fp8 ? "fp8 " : "", (long long)key->m, (long long)key->n,
                     (long long)key->k);
    if (!ok || !found) {
        plan_release(p);
        return NULL;
    }
    p->algo = res.algo;
    p->used = 1;
    return p;
}

static linear_plan *plan_get(kiln_backend *be, const linear_key *key, const void *a_scale,
                             const void *b_scale)
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
    return plan_build(be, victim, key, a_scale, b_scale);
}

static void set_pointer(kiln_backend *be, cublasLtMatmulDesc_t op,
                        cublasLtMatmulDescAttributes_t attr, const void *ptr, const char *what,
                        int *ok)
{
    *ok = *ok && lt_ok(be, cublasLtMatmulDescSetAttribute(op, attr, &ptr, sizeof ptr), what);
}

/* The plan key of a GEMM of m x k by n x k into y (alignment and fp8
 * left to the caller).  Filled in place, not returned: the key is compared
 * bytewise, padding included, and a struct copy need not keep padding. */
static void key_init(linear_key *key, int64_t m, int64_t n, int64_t k, const kiln_tensor *y,
                     const kiln_tensor *bias)
{
    memset(key, 0, sizeof *key);
    key->m = m;
    key->n = n;
    key->k = k;
    key->ydt = y->dtype;
    key->bdt = bias ? (int)bias->dtype : -1;
}

/* The FP8 path (see the top of the file); arguments checked by the caller. */
static void linear_fp8(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                       const kiln_tensor *w, const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x), n = w->shape[0];
    if (CUDA_REQUIRE(be, kiln_f8_linear_ok(n, k)))
        return;
    /* cuBLASLt's FP8 GEMMs take a BF16 bias only (E4M3 x E4M3 with a BF16
     * or F32 D: bias CUDA_R_16BF, cublasLt.h CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE
     * and the cublasLtMatmul type table); an F32 bias would fail in the
     * heuristic as "no algorithm", so say why instead. */
    if (bias && bias->dtype != KILN_BF16) {
        kiln_be_fail(be, KILN_ERR_UNSUPPORTED,
                     "cuda backend: fp8 linear N=%lld K=%lld: the bias must be BF16 (cuBLASLt's "
                     "FP8 bias epilogue), got %s",
                     (long long)n, (long long)k, kiln_dtype_name(bias->dtype));
        return;
    }
    const int64_t entries = x->ndim >= 3 ? x->shape[0] : 1, per = rows / entries;
    /* Each entry's codes and scale at a 256-byte boundary of the scratch. */
    const size_t stride = (kiln_f8_scale_offset(per * k) + 16 + 255) & ~(size_t)255;
    char *x8 = (char *)cuda_scratch(be, stride * (size_t)entries);
    if (!x8 || !cuda_fp8_quantize(be, x->data, is_bf16(x), per * k, (int)entries, x8, stride))
        return;
    const size_t ybytes = (size_t)(per * n) * kiln_dtype_size(y->dtype);
    const float *sw = (const float *)((const char *)w->data + kiln_f8_scale_offset(n * k));
    linear_key key;
    key_init(&key, per, n, k, y, bias);
    key.fp8 = 1;
    /* The smallest alignment of any operand of the entries' GEMMs: the
     * scratch entries are 256-aligned, y's entries ybytes apart (n a
     * multiple of 16, so at least 32 bytes for bf16).  cuBLASLt's FP8
     * GEMMs want 16. */
    int align = ptr_align(w->data);
    int ya = ptr_align(y->data), sa = ptr_align((const void *)(uintptr_t)ybytes);
    align = ya < align ? ya : align;
    align = entries > 1 && sa < align ? sa : align;
    /* KILN_CUBLASLT_MAX_ALIGN's cap (a diagnostic) applies down to 16,
     * below which cuBLASLt has no FP8 kernel. */
    int cap = cuda_of(be)->lt_max_align < 16 ? 16 : cuda_of(be)->lt_max_align;
    key.align = align < cap ? align : cap;
    if (CUDA_REQUIRE(be, key.align >= 16))
        return;
    linear_plan *p = plan_get(be, &key, sw, x8 + kiln_f8_scale_offset(per * k));
    if (!p)
        return;
    cuda_impl *c = cuda_of(be);
    const float alpha = 1.0f, beta = 0.0f;
    int ok = 1;
    set_pointer(be, p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sw, "A_SCALE_POINTER", &ok);
    if (bias)
        set_pointer(be, p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->data, "BIAS_POINTER", &ok);
    for (int64_t e = 0; ok && e < entries; e++) {
        const char *xe = x8 + (size_t)e * stride;
        char *ye = (char *)y->data + (size_t)e * ybytes;
        set_pointer(be, p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                    xe + kiln_f8_scale_offset(per * k), "B_SCALE_POINTER", &ok);
        ok = ok && lt_ok(be, cublasLtMatmul(c->lt, p->op, &alpha, w->data, p->a, xe, p->b, &beta,
                                            ye, p->c, ye, p->c, &p->algo, c->lt_workspace,
                                            c->lt_workspace_bytes, c->stream),
                         "Matmul (fp8)");
    }
}

void cuda_linear(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                 const kiln_tensor *bias)
{
    int64_t rows = kiln_tensor_rows(x), k = kiln_tensor_cols(x);
    int64_t n = w->ndim == 2 ? w->shape[0] : -1;
    if (CUDA_REQUIRE(be, w->ndim == 2 && w->shape[1] == k && kiln_tensor_cols(y) == n &&
                             kiln_tensor_rows(y) == rows &&
                             (!bias || kiln_tensor_numel(bias) == n) && y->data != x->data) ||
        CUDA_REQUIRE(be, x->dtype == KILN_BF16 &&
                             (w->dtype == KILN_BF16 || w->dtype == KILN_F8E4M3) && is_act(y) &&
                             (!bias || is_act(bias))) ||
        !rows || !n || !cuda_enter(be))
        return;
    if (w->dtype == KILN_F8E4M3) {
        linear_fp8(be, y, x, w, bias);
        return;
    }
    linear_key key;
    key_init(&key, rows, n, k, y, bias);
    key.align = ptr_align(x->data);
    if (ptr_align(w->data) < key.align)
        key.align = ptr_align(w->data);
    if (ptr_align(y->data) < key.align)
        key.align = ptr_align(y->data);
    if (cuda_of(be)->lt_max_align < key.align)
        key.align = cuda_of(be)->lt_max_align;
    linear_plan *p = plan_get(be, &key, NULL, NULL);
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
