/* CUDA backend memory and data movement: alloc/free, host transfers with dtype
 * conversion or as bytes through page-locked staging, copies, row/column
 * slices, batched transpose, nearest 2x upsampling.  Copies are byte moves,
 * so they take tensors of any dtype. */
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.cuh"

extern "C" {
#include "common/fp8.h"
}

kiln_status cuda_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                       const int64_t *shape)
{
    memset(t, 0, sizeof *t);
    if (ndim < 0 || ndim > KILN_MAX_DIMS || !kiln_dtype_size(dt)) {
        kiln_be_fail(be, KILN_ERR_INTERNAL, "cuda backend: bad tensor spec (ndim %d, dtype %d)",
                     ndim, (int)dt);
        return KILN_ERR_INTERNAL;
    }
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (shape[i] && n > INT64_MAX / 8 / shape[i])) {
            kiln_be_fail(be, KILN_ERR_INVALID, "cuda backend: bad tensor shape");
            return KILN_ERR_INVALID;
        }
        n *= shape[i];
    }
    kiln_tensor_set_shape(t, dt, ndim, shape);
    t->on_device = 1;
    size_t bytes = kiln_tensor_nbytes(t);
    if (!bytes || !cuda_enter(be))
        return be->error.code;
    cudaError_t e = cudaMalloc(&t->data, bytes);
    if (e == cudaErrorMemoryAllocation) {
        t->data = NULL;
        cudaGetLastError(); /* an allocation failure is not sticky in the runtime */
        kiln_be_fail(be, KILN_ERR_NOMEM, "cuda: cudaMalloc(%zu bytes): %s", bytes,
                     cudaGetErrorString(e));
        return be->error.code;
    }
    if (!cuda_ok(be, e, "cudaMalloc")) { /* an earlier fault may surface here */
        t->data = NULL;
        return be->error.code;
    }
    return cuda_poison(be, t->data, bytes) ? KILN_OK : be->error.code;
}

int cuda_poison(kiln_backend *be, void *ptr, size_t bytes)
{
    cuda_impl *c = cuda_of(be);
    /* Synchronous: uploads that follow an allocation may not go through the
     * stream. */
    return !c->poison ||
           (cuda_ok(be, cudaMemsetAsync(ptr, 0xFF, bytes, c->stream), "cudaMemsetAsync(poison)") &&
            cuda_ok(be, cudaStreamSynchronize(c->stream), "cudaStreamSynchronize(poison)"));
}

void cuda_free(kiln_backend *be, kiln_tensor *t)
{
    if (t->data && cuda_enter(be))
        cuda_ok(be, cudaFree(t->data), "cudaFree");
    t->data = NULL;
}

/* Host data is converted on the host into dst's dtype, then copied.  Uploads
 * are weights and request inputs, off the per-step path, so they wait for
 * the copy (which also lets the staging buffer go at once). */
void cuda_upload(kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype host_dtype)
{
    size_t n = (size_t)kiln_tensor_numel(dst), bytes = kiln_tensor_nbytes(dst);
    if (!n || !cuda_enter(be))
        return;
    const void *src = host;
    void *staging = NULL;
    if (host_dtype != dst->dtype) {
        if (CUDA_REQUIRE(be, is_act(dst)))
            return;
        float *f = (float *)malloc(n * sizeof(float));
        if (!f) {
            kiln_be_fail(be, KILN_ERR_NOMEM, "cuda upload: out of host memory");
            return;
        }
        if (kiln_convert_to_f32(f, host, host_dtype, n)) {
            free(f);
            kiln_be_fail(be, KILN_ERR_INTERNAL, "cuda upload: cannot convert from %s",
                         kiln_dtype_name(host_dtype));
            return;
        }
        if (dst->dtype == KILN_BF16) {
            uint16_t *h = (uint16_t *)f; /* in place: element i is read before it is written */
            for (size_t i = 0; i < n; i++)
                h[i] = kiln_f32_to_bf16(f[i]);
        }
        staging = f;
        src = f;
    }
    if (cuda_ok(be, cudaMemcpyAsync(dst->data, src, bytes, cudaMemcpyHostToDevice, cuda_stream(be)),
                "cudaMemcpyAsync(upload)"))
        cuda_ok(be, cudaStreamSynchronize(cuda_stream(be)), "cudaStreamSynchronize(upload)");
    free(staging);
}

void cuda_download(kiln_backend *be, const kiln_tensor *src, float *host)
{
    size_t n = (size_t)kiln_tensor_numel(src), bytes = kiln_tensor_nbytes(src);
    if (!n || !cuda_enter(be))
        return;
    void *raw = src->dtype == KILN_F32 ? (void *)host : malloc(bytes);
    if (!raw) {
        kiln_be_fail(be, KILN_ERR_NOMEM, "cuda download: out of host memory");
        return;
    }
    int copied =
        cuda_ok(be, cudaMemcpyAsync(raw, src->data, bytes, cudaMemcpyDeviceToHost, cuda_stream(be)),
                "cudaMemcpyAsync(download)") &&
        cuda_ok(be, cudaStreamSynchronize(cuda_stream(be)), "cudaStreamSynchronize(download)");
    if (copied && src->dtype == KILN_F8E4M3) { /* dequantised, as the CPU's */
        kiln_tensor h = *src;
        h.data = raw;
        for (size_t i = 0; i < n; i++)
            host[i] = kiln_e4m3_to_f32(((const uint8_t *)raw)[i]) * kiln_f8_scale(&h);
    } else if (copied && raw != host && kiln_convert_to_f32(host, raw, src->dtype, n))
        kiln_be_fail(be, KILN_ERR_INTERNAL, "cuda download: cannot convert from %s",
                     kiln_dtype_name(src->dtype));
    if (raw != host)
        free(raw);
}

/* Page-locked staging of at least `bytes` (rounded up to 1 MiB, so sizes
 * that vary a little do not regrow it each time); NULL with no error when
 * the host has no page-locked memory to give (download_bytes then copies
 * into pageable memory, slower but correct), NULL with the sticky error set
 * on any other failure. */
static void *cuda_pinned(kiln_backend *be, size_t bytes)
{
    cuda_impl *c = cuda_of(be);
    if (bytes <= c->pinned_bytes)
        return c->pinned;
    /* Every download waits for its copy, so nothing still writes the old one.
     * Page-locking and unpinning are not stream-ordered: kept out of
     * another backend's graph capture (cuda_exclusive_begin), like the
     * teardown. */
    int held = cuda_exclusive_begin();
    cudaError_t f = c->pinned ? cudaFreeHost(c->pinned) : cudaSuccess;
    cudaError_t e = cudaSuccess;
    size_t want = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
    if (f == cudaSuccess) {
        c->pinned = NULL;
        c->pinned_bytes = 0;
        e = cudaHostAlloc(&c->pinned, want, cudaHostAllocDefault);
    }
    cuda_exclusive_end(held);
    if (!cuda_ok(be, f, "cudaFreeHost(staging)"))
        return NULL;
    if (e == cudaErrorMemoryAllocation) {
        c->pinned = NULL;
        cudaGetLastError(); /* not sticky: the pageable copy below goes on */
        return NULL;
    }
    if (!cuda_ok(be, e, "cudaHostAlloc(staging)")) {
        c->pinned = NULL;
        return NULL;
    }
    c->pinned_bytes = want;
    return c->pinned;
}

/* The bytes as they are through the staging buffer: a copy from the device
 * into pageable memory is staged by the driver in pieces at a fraction of
 * the bus speed; into page-locked memory it is one DMA.  The memcpy out of
 * the staging is host memory speed (3 MB, a 1024x1024 RGB image: ~0.3 ms). */
void cuda_download_bytes(kiln_backend *be, const kiln_tensor *src, void *host)
{
    size_t bytes = kiln_tensor_nbytes(src);
    if (!bytes || !cuda_enter(be))
        return;
    void *stage = cuda_pinned(be, bytes);
    if (!stage && be->error.code)
        return;
    cudaStream_t s = cuda_stream(be);
    void *dst = stage ? stage : host;
    if (cuda_ok(be, cudaMemcpyAsync(dst, src->data, bytes, cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync(download_bytes)") &&
        cuda_ok(be, cudaStreamSynchronize(s), "cudaStreamSynchronize(download_bytes)") && stage)
        memcpy(host, stage, bytes);
}

/* An activation converted (F32 <-> BF16, round to nearest even as torch's
 * .to()): Z-Image keeps fp32 latents and feeds the DiT their bf16 cast. */
__global__ void convert_kernel(void *dst, int dbf, const void *src, int sbf, int64_t n)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        st_act(dst, i, ld_act(src, i, sbf), dbf);
}

void cuda_copy(kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src)
{
    int64_t n = kiln_tensor_numel(src);
    if (dst->dtype != src->dtype) {
        if (CUDA_REQUIRE(be, is_act(dst) && is_act(src) && kiln_tensor_numel(dst) == n) || !n ||
            !cuda_enter(be))
            return;
        convert_kernel<<<cuda_blocks(be, n), 256, 0, cuda_stream(be)>>>(dst->data, is_bf16(dst),
                                                                        src->data, is_bf16(src), n);
        cuda_launched(be, "copy (convert)");
        return;
    }
    if (CUDA_REQUIRE(be, kiln_tensor_numel(dst) == n) || !kiln_tensor_nbytes(src) ||
        !cuda_enter(be))
        return;
    cuda_ok(be, cudaMemcpyAsync(dst->data, src->data, kiln_tensor_nbytes(src),
                                cudaMemcpyDeviceToDevice, cuda_stream(be)),
            "cudaMemcpyAsync(copy)");
}

void cuda_sync(kiln_backend *be)
{
    if (cuda_enter(be))
        cuda_ok(be, cudaStreamSynchronize(cuda_stream(be)), "cudaStreamSynchronize");
}

/* Both slices are strided 2-D blocks, which is what cudaMemcpy2DAsync moves. */
void cuda_copy_rows(kiln_backend *be, kiln_tensor *dst, int64_t dst_row0, const kiln_tensor *src,
                    int64_t src_row0, int64_t n)
{
    if (CUDA_REQUIRE(be, dst->ndim == 3 && src->ndim == 3 && dst->dtype == src->dtype &&
                             dst->shape[0] == src->shape[0] && dst->shape[2] == src->shape[2] &&
                             dst_row0 >= 0 && src_row0 >= 0 && n >= 0 &&
                             dst_row0 + n <= dst->shape[1] && src_row0 + n <= src->shape[1]))
        return;
    size_t es = kiln_dtype_size(dst->dtype), row = (size_t)dst->shape[2] * es;
    if (!n || !row || !dst->shape[0] || !cuda_enter(be))
        return;
    cuda_ok(be, cudaMemcpy2DAsync((char *)dst->data + dst_row0 * row, dst->shape[1] * row,
                                  (const char *)src->data + src_row0 * row, src->shape[1] * row,
                                  n * row, dst->shape[0], cudaMemcpyDeviceToDevice,
                                  cuda_stream(be)),
            "cudaMemcpy2DAsync(copy_rows)");
}

/* Column slices in 16-byte pieces: cudaMemcpy2DAsync moves thousands of
 * short rows (the DiT's attention output into the single blocks' [attn |
 * mlp] input: 4608 rows of 6 KB) well below memory speed. */
__global__ void copy_cols_vec_kernel(uint4 *__restrict__ dst, int64_t dst_ld,
                                     const uint4 *__restrict__ src, int64_t src_ld, int64_t rows,
                                     int64_t n)
{
    int64_t total = rows * n;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, j = i % n;
        dst[r * dst_ld + j] = src[r * src_ld + j];
    }
}

void cuda_copy_cols(kiln_backend *be, kiln_tensor *dst, int64_t dst_col0, const kiln_tensor *src,
                    int64_t src_col0, int64_t n)
{
    int64_t rows = kiln_tensor_rows(dst), dc = kiln_tensor_cols(dst), sc = kiln_tensor_cols(src);
    if (CUDA_REQUIRE(be, dst->dtype == src->dtype && rows == kiln_tensor_rows(src) &&
                             dst_col0 >= 0 && src_col0 >= 0 && n >= 0 && dst_col0 + n <= dc &&
                             src_col0 + n <= sc))
        return;
    size_t es = kiln_dtype_size(dst->dtype);
    if (!n || !rows || !cuda_enter(be))
        return;
    char *d = (char *)dst->data + dst_col0 * es;
    const char *s = (const char *)src->data + src_col0 * es;
    if (((uintptr_t)d | (uintptr_t)s | (n * es) | (dc * es) | (sc * es)) % 16 == 0) {
        int64_t n16 = (int64_t)(n * es / 16);
        copy_cols_vec_kernel<<<cuda_blocks(be, rows * n16), 256, 0, cuda_stream(be)>>>(
            (uint4 *)d, (int64_t)(dc * es / 16), (const uint4 *)s, (int64_t)(sc * es / 16), rows,
            n16);
        cuda_launched(be, "copy_cols");
        return;
    }
    cuda_ok(be, cudaMemcpy2DAsync((char *)dst->data + dst_col0 * es, dc * es,
                                  (const char *)src->data + src_col0 * es, sc * es, n * es, rows,
                                  cudaMemcpyDeviceToDevice, cuda_stream(be)),
            "cudaMemcpy2DAsync(copy_cols)");
}

/* 32x32 tiles through shared memory so both the read and the write are
 * coalesced; the +1 column keeps the column reads free of bank conflicts. */
template <typename T>
__global__ void transpose_kernel(T *__restrict__ y, const T *__restrict__ x, int64_t batch,
                                 int64_t m, int64_t n)
{
    __shared__ T tile[32][33];
    int64_t j0 = (int64_t)blockIdx.x * 32, mtiles = (m + 31) / 32;
    for (int64_t b = blockIdx.z; b < batch; b += gridDim.z)
        for (int64_t ty = blockIdx.y; ty < mtiles; ty += gridDim.y) {
            const T *xs = x + b * m * n;
            T *ys = y + b * m * n;
            int64_t i0 = ty * 32;
            for (int r = threadIdx.y; r < 32; r += blockDim.y) {
                int64_t i = i0 + r, j = j0 + threadIdx.x;
                if (i < m && j < n)
                    tile[r][threadIdx.x] = xs[i * n + j];
            }
            __syncthreads();
            for (int r = threadIdx.y; r < 32; r += blockDim.y) {
                int64_t j = j0 + r, i = i0 + threadIdx.x;
                if (i < m && j < n)
                    ys[j * m + i] = tile[threadIdx.x][r];
            }
            __syncthreads();
        }
}

template <typename T>
static void launch_transpose(kiln_backend *be, void *y, const void *x, int64_t batch, int64_t m,
                             int64_t n)
{
    int64_t mtiles = (m + 31) / 32;
    dim3 grid((unsigned)((n + 31) / 32), (unsigned)(mtiles < 65535 ? mtiles : 65535),
              (unsigned)(batch < 65535 ? batch : 65535));
    transpose_kernel<T><<<grid, dim3(32, 8), 0, cuda_stream(be)>>>((T *)y, (const T *)x, batch, m,
                                                                   n);
    cuda_launched(be, "transpose");
}

void cuda_transpose(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    if (CUDA_REQUIRE(be, x->ndim >= 2 && y->ndim == x->ndim && y->dtype == x->dtype &&
                             y->data != x->data))
        return;
    int64_t m = x->shape[x->ndim - 2], n = x->shape[x->ndim - 1];
    if (CUDA_REQUIRE(be, y->shape[y->ndim - 2] == n && y->shape[y->ndim - 1] == m &&
                             kiln_tensor_numel(y) == kiln_tensor_numel(x)))
        return;
    int64_t batch = m && n ? kiln_tensor_numel(x) / (m * n) : 0;
    if (!batch || !cuda_enter(be))
        return;
    switch (kiln_dtype_size(x->dtype)) {
    case 1: launch_transpose<uint8_t>(be, y->data, x->data, batch, m, n); break;
    case 2: launch_transpose<uint16_t>(be, y->data, x->data, batch, m, n); break;
    case 4: launch_transpose<uint32_t>(be, y->data, x->data, batch, m, n); break;
    default: launch_transpose<uint64_t>(be, y->data, x->data, batch, m, n); break;
    }
}

/* Nearest 2x upsampling, channels last: each input pixel's c elements (of
 * type T) are copied to its four output pixels.  One thread per element of
 * x, so a warp's loads and each of its four stores are contiguous. */
template <typename T>
__global__ void upsample2x_kernel(T *__restrict__ y, const T *__restrict__ x, int64_t rows,
                                  int64_t w, int64_t c)
{
    int64_t total = rows * w * c;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t ch = i % c, px = i / c, xx = px % w, r = px / w; /* r: input row (b, yy) */
        T v = x[i];
        T *o = y + ((2 * r) * (2 * w) + 2 * xx) * c + ch; /* output rows 2r, 2r + 1 */
        o[0] = v;
        o[c] = v;
        o[2 * w * c] = v;
        o[2 * w * c + c] = v;
    }
}

template <typename T>
static void launch_upsample(kiln_backend *be, void *y, const void *x, int64_t rows, int64_t w,
                            int64_t c)
{
    upsample2x_kernel<T><<<cuda_blocks(be, rows * w * c), 256, 0, cuda_stream(be)>>>(
        (T *)y, (const T *)x, rows, w, c);
    cuda_launched(be, "upsample_nearest2x");
}

void cuda_upsample_nearest2x(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x)
{
    if (CUDA_REQUIRE(be, x->ndim == 4 && y->ndim == 4 && y->dtype == x->dtype &&
                             y->shape[0] == x->shape[0] && y->shape[1] == 2 * x->shape[1] &&
                             y->shape[2] == 2 * x->shape[2] && y->shape[3] == x->shape[3] &&
                             y->data != x->data))
        return;
    int64_t rows = x->shape[0] * x->shape[1], w = x->shape[2], c = x->shape[3];
    size_t es = kiln_dtype_size(x->dtype);
    if (!rows || !w || !c || !cuda_enter(be))
        return;
    /* A pixel's channels in whole 16-byte vectors: copy those. */
    if ((size_t)c * es % 16 == 0 && ((uintptr_t)x->data | (uintptr_t)y->data) % 16 == 0) {
        launch_upsample<uint4>(be, y->data, x->data, rows, w, c * (int64_t)es / 16);
        return;
    }
    switch (es) {
    case 1: launch_upsample<uint8_t>(be, y->data, x->data, rows, w, c); break;
    case 2: launch_upsample<uint16_t>(be, y->data, x->data, rows, w, c); break;
    case 4: launch_upsample<uint32_t>(be, y->data, x->data, rows, w, c); break;
    default: launch_upsample<uint64_t>(be, y->data, x->data, rows, w, c); break;
    }
}
