/* The cuda_ipc transport between two processes on one GPU: a producer
 * fills device ranges through its CUDA backend, syncs, and sends the
 * references in msgpack frames (as on the bus) over a pipe; a consumer
 * process maps the slabs (cached), reads them through its own backend and
 * answers with content hashes.  Also: ranges returned to the pool and
 * reused under a cached mapping (the old reference to it refused by its
 * device range header), slabs of the consumer's own process,
 * bad references and frees, and (with two GPUs) a consumer on the other
 * GPU mapping the slab through peer access.
 *
 * Without a CUDA device the test is skipped (exit 77), unless
 * KILN_REQUIRE_GPU=1 (tools/gpu/check.sh).  Fork happens before either
 * process touches CUDA. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/proto.h"
#include "common/transport.h"
#include "kernels/backend.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

#define MAX_REFS 8

typedef struct reply {
    int n; /* -1: the consumer has no such GPU */
    kiln_status code[MAX_REFS];
    uint64_t hash[MAX_REFS];
    int mapped, open_after_close;
    double first_open_ms, cached_open_ms;
} reply;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int write_all(int fd, const void *p, size_t n)
{
    for (const char *c = p; n;) {
        ssize_t k = write(fd, c, n);
        if (k <= 0)
            return -1;
        c += k, n -= (size_t)k;
    }
    return 0;
}

static int read_all(int fd, void *p, size_t n)
{
    for (char *c = p; n;) {
        ssize_t k = read(fd, c, n);
        if (k <= 0)
            return -1;
        c += k, n -= (size_t)k;
    }
    return 0;
}

/* FNV-1a over the f32 values a backend reads from a device tensor. */
static uint64_t device_hash(kiln_backend *be, const kiln_tensor *t)
{
    size_t n = (size_t)kiln_tensor_numel(t);
    float *host = malloc(n * sizeof *host);
    if (!host)
        return 0;
    kiln_be_download(be, t, host);
    uint64_t h = 1469598103934665603ull;
    const uint8_t *b = (const uint8_t *)host;
    for (size_t i = 0; i < n * sizeof *host; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    free(host);
    return kiln_be_check(be, NULL) ? 0 : h;
}

static kiln_tensor view_of(const kiln_tensor_ref *ref, const void *ptr)
{
    kiln_tensor t = {0};
    kiln_tensor_set_shape(&t, ref->dtype, ref->ndim, ref->shape);
    t.data = (void *)ptr;
    t.on_device = 1;
    return t;
}

/* ---- consumer process ---- */

static int consumer(int in_fd, int out_fd, int device)
{
    kiln_backend *be = NULL;
    kiln_transport *rx = NULL;
    kiln_err err = {0};
    for (;;) {
        uint32_t len;
        if (read_all(in_fd, &len, sizeof len) || !len)
            break;
        uint8_t *frame = malloc(len);
        if (!frame || read_all(in_fd, frame, len))
            return 1;
        if (!be) {
            be = kiln_backend_create("cuda", device, &err);
            rx = be ? kiln_transport_cuda_ipc_create("decode-test", 2, "decode", device, 0, 0, &err)
                    : NULL;
            if (!rx) {
                fprintf(stderr, "consumer on GPU %d: %s\n", device, err.msg);
                free(frame);
                reply none = {.n = -1};
                int absent = device > 0 && (err.code == KILN_ERR_INVALID ||
                                            err.code == KILN_ERR_UNAVAILABLE);
                if (!absent || write_all(out_fd, &none, sizeof none))
                    return 1;
                kiln_backend_destroy(be);
                be = NULL;
                continue;
            }
        }
        kiln_msg *m = kiln_msg_decode(frame, len, &err);
        free(frame);
        if (!m) {
            fprintf(stderr, "consumer: %s\n", err.msg);
            return 1;
        }
        reply r = {.n = m->refs.n};
        const void *ptr[MAX_REFS];
        for (int i = 0; i < r.n && i < MAX_REFS; i++) {
            double t0 = now_ms();
            r.code[i] = kiln_transport_open(rx, &m->refs.refs[i], &ptr[i], &err);
            if (i == 0)
                r.first_open_ms = now_ms() - t0;
            if (!r.code[i]) {
                kiln_tensor t = view_of(&m->refs.refs[i], ptr[i]);
                r.hash[i] = device_hash(be, &t);
            }
        }
        if (r.n && !r.code[0]) {
            const void *again;
            double t0 = now_ms();
            if (!kiln_transport_open(rx, &m->refs.refs[0], &again, &err)) {
                r.cached_open_ms = now_ms() - t0;
                kiln_transport_close(rx, &m->refs.refs[0]);
            }
        }
        /* Our reads are complete (download waits) before the release; the
         * range headers still name what we read. */
        for (int i = 0; i < r.n && i < MAX_REFS; i++)
            if (!r.code[i]) {
                r.code[i] = kiln_transport_verify(rx, &m->refs.refs[i], &err);
                kiln_transport_close(rx, &m->refs.refs[i]);
            }
        kiln_transport_stats st;
        kiln_transport_stats_get(rx, &st);
        r.mapped = st.mapped, r.open_after_close = st.open;
        kiln_msg_free(m);
        if (write_all(out_fd, &r, sizeof r))
            return 1;
    }
    kiln_transport_destroy(rx);
    kiln_backend_destroy(be);
    return 0;
}

/* ---- producer process ---- */

/* A consumer process and its pipes. */
typedef struct child {
    pid_t pid;
    int to, from;
} child;

static child consumers[2]; /* on GPU 0 and GPU 1 */
static kiln_backend *be;
static kiln_transport *tx;

/* Sends refs as a msgpack frame to consumer c and waits for its reply. */
static int exchange(const child *c, const kiln_tensor_ref *refs, int n, reply *r)
{
    kiln_msg m = {.type = KILN_MSG_RELEASE, .epoch = 1, .refs.n = n};
    memcpy(m.refs.refs, refs, (size_t)n * sizeof *refs);
    kiln_buf b = {0};
    kiln_err err = {0};
    if (kiln_msg_encode(&m, &b, &err)) {
        fprintf(stderr, "encode: %s\n", err.msg);
        return -1;
    }
    uint32_t len = (uint32_t)b.len;
    int rc = write_all(c->to, &len, sizeof len) || write_all(c->to, b.data, b.len) ||
             read_all(c->from, r, sizeof *r);
    kiln_buf_free(&b);
    return rc ? -1 : 0;
}

static uint32_t rng = 12345;
static float frand(void)
{
    rng = rng * 1664525u + 1013904223u;
    return (float)(rng >> 8) / 16777216.0f * 2.0f - 1.0f;
}

/* A tensor in the pool filled with random values through the backend; the
 * stream is synced before the reference may be sent.  Returns its hash. */
static uint64_t fill(kiln_dtype dt, int ndim, const int64_t *shape, kiln_tensor_ref *ref,
                     void **ptr)
{
    kiln_err err = {0};
    if (kiln_transport_alloc(tx, dt, ndim, shape, ref, ptr, &err)) {
        fprintf(stderr, "alloc: %s\n", err.msg);
        return 0;
    }
    kiln_tensor t = view_of(ref, *ptr);
    size_t n = (size_t)kiln_tensor_numel(&t);
    float *host = malloc(n * sizeof *host);
    if (!host)
        return 0;
    for (size_t i = 0; i < n; i++)
        host[i] = frand();
    kiln_be_upload(be, &t, host, KILN_F32);
    kiln_be_sync(be);
    free(host);
    return device_hash(be, &t);
}

static void test_two_processes(void)
{
    kiln_tensor_ref refs[3];
    void *ptr[3];
    uint64_t want[3];
    /* Two fit one 2 MiB slab; the third (4 MiB) gets a slab of its own. */
    want[0] = fill(KILN_BF16, 3, (int64_t[]){2, 300, 128}, &refs[0], &ptr[0]);
    want[1] = fill(KILN_F32, 1, (int64_t[]){1000}, &refs[1], &ptr[1]);
    want[2] = fill(KILN_F32, 2, (int64_t[]){1024, 1024}, &refs[2], &ptr[2]);
    CHECK(want[0] && want[1] && want[2]);
    CHECK(!strcmp(refs[0].slab, refs[1].slab) && strcmp(refs[0].slab, refs[2].slab));
    CHECK(refs[0].kind == KILN_REF_CUDA_IPC && refs[0].device == 0);
    kiln_transport_stats st;
    kiln_transport_stats_get(tx, &st);
    CHECK(st.slabs == 2 && st.live == 3);

    reply r;
    CHECK(exchange(&consumers[0], refs, 3, &r) == 0);
    for (int i = 0; i < 3; i++)
        CHECKF(r.code[i] == KILN_OK && r.hash[i] == want[i], "ref %d: code %d, hash %s", i,
               r.code[i], r.hash[i] == want[i] ? "equal" : "different");
    CHECK(r.mapped == 2 && r.open_after_close == 0);
    printf("cuda_ipc: first cudaIpcOpenMemHandle %.3f ms, cached open %.4f ms\n", r.first_open_ms,
           r.cached_open_ms);

    /* The consumer released: ranges go back to the pool and are reused;
     * the consumer sees the new bytes through its cached mapping. */
    kiln_err err = {0};
    for (int i = 0; i < 3; i++)
        CHECK(kiln_transport_free(tx, &refs[i], &err) == KILN_OK);
    kiln_transport_stats_get(tx, &st);
    CHECK(st.live == 0 && st.used_bytes == 0 && st.slabs == 2);
    kiln_tensor_ref again;
    void *p;
    uint64_t h = fill(KILN_BF16, 3, (int64_t[]){2, 300, 128}, &again, &p);
    CHECK(!strcmp(again.slab, refs[0].slab) && again.off == refs[0].off && p == ptr[0]);
    CHECK(h != want[0]);
    CHECK(exchange(&consumers[0], &again, 1, &r) == 0);
    CHECK(r.code[0] == KILN_OK && r.hash[0] == h && r.mapped == 2);
    /* The old reference to the same place names an allocation that is
     * gone: its device header says so, and the consumer refuses it. */
    CHECK(again.gen != refs[0].gen);
    CHECK(exchange(&consumers[0], &refs[0], 1, &r) == 0);
    CHECK(r.code[0] == KILN_ERR_NOT_FOUND && r.mapped == 2);

    /* Bad references are refused before any mapping. */
    kiln_tensor_ref bad[2] = {again, again};
    bad[0].off = 3u << 20; /* beyond the 2 MiB slab */
    snprintf(bad[1].slab, sizeof bad[1].slab, "/kiln-cuda-decode-1-0-xx");
    CHECK(exchange(&consumers[0], bad, 2, &r) == 0);
    CHECK(r.code[0] == KILN_ERR_INVALID && r.code[1] == KILN_ERR_INVALID && r.mapped == 2);

    /* Frees the producer refuses: double, foreign owner, unknown range. */
    CHECK(kiln_transport_free(tx, &again, &err) == KILN_OK);
    CHECK(kiln_transport_free(tx, &again, &err) == KILN_ERR_INVALID);
    kiln_tensor_ref foreign = again;
    snprintf(foreign.owner, sizeof foreign.owner, "someone-else");
    CHECK(kiln_transport_free(tx, &foreign, &err) == KILN_ERR_INVALID);
}

/* A consumer in the producer's own process uses the slab directly. */
static void test_same_process(void)
{
    kiln_err err = {0};
    kiln_transport *rx = kiln_transport_cuda_ipc_create("local-test", 3, "decode", 0, 0, 0, &err);
    CHECKF(rx != NULL, "%s", err.msg);
    if (!rx)
        return;
    kiln_tensor_ref ref;
    void *ptr;
    uint64_t h = fill(KILN_F32, 2, (int64_t[]){64, 64}, &ref, &ptr);
    const void *got;
    CHECK(kiln_transport_open(rx, &ref, &got, &err) == KILN_OK && got == ptr);
    kiln_tensor t = view_of(&ref, got);
    CHECK(device_hash(be, &t) == h);
    kiln_transport_stats st;
    kiln_transport_stats_get(rx, &st);
    CHECK(st.open == 1 && st.mapped == 0);
    kiln_transport_close(rx, &ref);
    kiln_transport_stats_get(rx, &st);
    CHECK(st.open == 0);
    CHECK(kiln_transport_free(tx, &ref, &err) == KILN_OK);
    kiln_transport_destroy(rx);
    CHECK(kiln_transport_cuda_ipc_reachable(0, 0) == 1);
    printf("cuda_ipc: every GPU pair of this host reachable: %s\n",
           kiln_transport_cuda_ipc_all_reachable() ? "yes" : "no");
}

/* A consumer on the second GPU opens a slab of the first through peer
 * access; skipped on a one-GPU host. */
static void test_peer_gpu(void)
{
    kiln_tensor_ref ref;
    void *ptr;
    uint64_t h = fill(KILN_BF16, 2, (int64_t[]){512, 384}, &ref, &ptr);
    reply r;
    CHECK(exchange(&consumers[1], &ref, 1, &r) == 0);
    if (r.n < 0) {
        printf("cuda_ipc: no second GPU, peer mapping not tried\n");
    } else {
        CHECKF(r.code[0] == KILN_OK && r.hash[0] == h, "GPU 1 reading GPU 0's slab: code %d",
               r.code[0]);
        printf("cuda_ipc: GPU 1 read a slab of GPU 0 (peer access %s): %s\n",
               kiln_transport_cuda_ipc_reachable(1, 0) ? "available" : "unavailable",
               r.code[0] == KILN_OK && r.hash[0] == h ? "same bytes" : "FAILED");
    }
    kiln_err err = {0};
    CHECK(kiln_transport_free(tx, &ref, &err) == KILN_OK);
}

int main(void)
{
    /* Both consumers are forked before this process touches CUDA. */
    for (int d = 0; d < 2; d++) {
        int down[2], up[2];
        if (pipe(down) || pipe(up))
            return 1;
        pid_t pid = fork();
        if (pid < 0)
            return 1;
        if (pid == 0) {
            close(down[1]), close(up[0]);
            for (int e = 0; e < d; e++)
                close(consumers[e].to), close(consumers[e].from);
            _exit(consumer(down[0], up[1], d));
        }
        close(down[0]), close(up[1]);
        consumers[d] = (child){.pid = pid, .to = down[1], .from = up[0]};
    }

    kiln_err err = {0};
    be = kiln_backend_create("cuda", 0, &err);
    tx = be ? kiln_transport_cuda_ipc_create("denoise-test", 1, "denoise", 0, 2u << 20,
                                             64u << 20, &err)
            : NULL;
    int skip = 0;
    if (!tx) {
        skip = gpu_test_unavailable("cuda", &err) == 77;
        CHECK(skip);
    } else {
        RUN(test_two_processes);
        RUN(test_same_process);
        RUN(test_peer_gpu);
    }
    for (int d = 0; d < 2; d++) {
        uint32_t zero = 0;
        write_all(consumers[d].to, &zero, sizeof zero);
        close(consumers[d].to);
        int status = 0;
        CHECK(waitpid(consumers[d].pid, &status, 0) == consumers[d].pid && WIFEXITED(status) &&
              !WEXITSTATUS(status));
        close(consumers[d].from);
    }
    kiln_transport_destroy(tx);
    kiln_backend_destroy(be);
    if (skip)
        return 77;
    return test_finish();
}
