/* Tensor transports: shm range allocation, reuse and merging, the consumer
 * mapping cache (in this process and another one), slab usage that stays
 * flat over many cycles, hostile references, generations (stale frees
 * and reads of ranges handed out again), unlinking and stale-slab
 * cleanup; the inline transport's ownership checks. */
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/transport.h"
#include "tests/test.h"

#define EPOCH 0x5eed0000cafe0001ull

static int slab_exists(const char *name)
{
    int fd = shm_open(name, O_RDONLY, 0);
    if (fd >= 0)
        close(fd);
    return fd >= 0;
}

static void test_alloc_free_reuse(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("encode-test-1", EPOCH, "test", 1 << 16, 0, &err);
    CHECKF(tx != NULL, "%s", err.msg);
    if (!tx)
        return;
    kiln_tensor_ref a, b, c, d;
    void *pa, *pb, *pc, *pd;
    CHECK(kiln_transport_alloc(tx, KILN_F32, 2, (int64_t[]){3, 5}, &a, &pa, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_BF16, 1, (int64_t[]){1000}, &b, &pb, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){1}, &c, &pc, &err) == KILN_OK);
    CHECK(a.kind == KILN_REF_SHM && a.len == 60 && a.ndim == 2 && a.shape[1] == 5);
    CHECK(!strcmp(a.owner, "encode-test-1") && kiln_slab_name_valid(a.slab));
    CHECK(a.epoch == EPOCH && a.gen && b.gen > a.gen && c.gen > b.gen);
    /* Each range follows its 64-byte header. */
    CHECK(a.off == 64 && b.off == 128 + 64 && c.off == 128 + 2112 + 64);
    CHECK(kiln_tensor_ref_check(&b, &err) == KILN_OK);
    kiln_transport_stats st;
    kiln_transport_stats_get(tx, &st);
    CHECK(st.slabs == 1 && st.slab_bytes == 1 << 16 && st.live == 3 &&
          st.used_bytes == 128 + 2112 + 128);

    /* A freed range is reused first-fit; freeing neighbours merges them. */
    CHECK(kiln_transport_free(tx, &b, &err) == KILN_OK);
    CHECK(kiln_transport_free(tx, &b, &err) == KILN_ERR_INVALID); /* double free */
    CHECK(kiln_transport_alloc(tx, KILN_F32, 1, (int64_t[]){100}, &d, &pd, &err) == KILN_OK);
    CHECK(d.off == b.off && d.gen > c.gen);
    CHECK(kiln_transport_free(tx, &d, &err) == KILN_OK);
    CHECK(kiln_transport_free(tx, &a, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){2048 + 64}, &d, &pd, &err) == KILN_OK);
    CHECK(d.off == 64);
    CHECK(kiln_transport_free(tx, &d, &err) == KILN_OK);
    CHECK(kiln_transport_free(tx, &c, &err) == KILN_OK);

    /* Frees of ranges that are not ours are refused. */
    kiln_tensor_ref bad = c;
    snprintf(bad.owner, sizeof bad.owner, "encode-other-2");
    CHECK(kiln_transport_free(tx, &bad, &err) == KILN_ERR_INVALID);
    bad = c, bad.off += 64;
    CHECK(kiln_transport_free(tx, &bad, &err) == KILN_ERR_INVALID);
    bad = c, bad.epoch ^= 1; /* another incarnation's range of the same name */
    CHECK(kiln_transport_free(tx, &bad, &err) == KILN_ERR_INVALID);
    kiln_transport_stats_get(tx, &st);
    CHECK(st.live == 0 && st.used_bytes == 0 && st.slabs == 1 && st.refused == 4);

    /* A tensor bigger than the slab size gets a slab of its own. */
    CHECK(kiln_transport_alloc(tx, KILN_F32, 1, (int64_t[]){100000}, &a, &pa, &err) == KILN_OK);
    kiln_transport_stats_get(tx, &st);
    CHECK(st.slabs == 2 && st.slab_bytes == (1 << 16) + (1 << 20));
    CHECK(kiln_transport_free(tx, &a, &err) == KILN_OK);
    kiln_transport_destroy(tx);
    CHECK(!slab_exists(a.slab) && !slab_exists(b.slab));
}

/* Thousands of mixed alloc/free cycles: the pool never grows after the
 * first round and ends with everything free. */
static void test_flat_usage(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("denoise-test-1", EPOCH, "test", 1 << 20, 0, &err);
    if (!tx)
        return;
    kiln_tensor_ref live[8];
    void *p;
    uint32_t x = 7;
    kiln_transport_stats st;
    size_t after_first = 0;
    for (int round = 0; round < 500; round++) {
        for (int i = 0; i < 8; i++) {
            x = x * 1664525u + 1013904223u;
            int64_t n = 1 + (x >> 16) % 20000;
            CHECK(kiln_transport_alloc(tx, KILN_F32, 1, &n, &live[i], &p, &err) == KILN_OK);
            memset(p, i, (size_t)live[i].len);
        }
        for (int i = 0; i < 8; i++) /* free in a scrambled order */
            CHECK(kiln_transport_free(tx, &live[(i * 5 + round) % 8], &err) == KILN_OK);
        kiln_transport_stats_get(tx, &st);
        if (round == 0)
            after_first = st.slab_bytes;
    }
    CHECK(st.slab_bytes == after_first && st.slabs == 1);
    CHECK(st.live == 0 && st.used_bytes == 0);
    kiln_transport_destroy(tx);
}

static void test_consumer(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("encode-test-3", EPOCH, "test", 4096, 0, &err);
    kiln_transport *rx = kiln_transport_shm_create("denoise-test-4", EPOCH, "test", 0, 0, &err);
    if (!tx || !rx)
        return;
    kiln_tensor_ref r;
    float *p;
    CHECK(kiln_transport_alloc(tx, KILN_F32, 2, (int64_t[]){4, 8}, &r, (void **)&p, &err) == KILN_OK);
    for (int i = 0; i < 32; i++)
        p[i] = (float)i * 0.5f;
    const float *q;
    CHECK(kiln_transport_open(rx, &r, (const void **)&q, &err) == KILN_OK);
    CHECK(q && q != p && q[31] == 15.5f);
    const float *q2;
    CHECK(kiln_transport_open(rx, &r, (const void **)&q2, &err) == KILN_OK && q2 == q);
    kiln_transport_stats st;
    kiln_transport_stats_get(rx, &st);
    CHECK(st.mapped == 1 && st.open == 2 && st.slabs == 0);

    /* Another process sees the same bytes through its own mapping. */
    pid_t pid = fork();
    if (pid == 0) {
        kiln_transport *c = kiln_transport_shm_create("decode-test-5", EPOCH, "test", 0, 0, NULL);
        const float *v = NULL;
        int ok = c && !kiln_transport_open(c, &r, (const void **)&v, NULL) && v[7] == 3.5f;
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
          WEXITSTATUS(status) == 0);

    /* Hostile references are refused before any memory is touched. */
    kiln_tensor_ref bad = r;
    bad.off = 4096; /* past the end of the 4096-byte slab */
    CHECK(kiln_transport_open(rx, &bad, (const void **)&q2, &err) == KILN_ERR_INVALID);
    bad = r;
    snprintf(bad.slab, sizeof bad.slab, "/etc-passwd");
    CHECK(kiln_transport_open(rx, &bad, (const void **)&q2, &err) == KILN_ERR_INVALID);
    bad = r;
    snprintf(bad.slab, sizeof bad.slab, "/kiln-test-999999999-0");
    CHECK(kiln_transport_open(rx, &bad, (const void **)&q2, &err) == KILN_ERR_NOT_FOUND);
    bad = r, bad.len += 4;
    CHECK(kiln_transport_open(rx, &bad, (const void **)&q2, &err) == KILN_ERR_INVALID);
    bad = r, bad.kind = KILN_REF_INLINE, bad.data = p;
    CHECK(kiln_transport_open(rx, &bad, (const void **)&q2, &err) == KILN_ERR_INVALID);

    /* The producer going away unlinks the slab; the consumer's mapping of
     * it stays readable until closed. */
    kiln_transport_destroy(tx);
    CHECK(!slab_exists(r.slab));
    CHECK(q[31] == 15.5f);
    kiln_transport_close(rx, &r);
    kiln_transport_close(rx, &r);
    kiln_transport_stats_get(rx, &st);
    CHECK(st.open == 0);
    kiln_transport_destroy(rx);
}

/* A range freed and handed out again keeps its place but not its
 * generation: the old reference can neither free the new allocation nor
 * be opened, and a consumer that had it open finds out when it verifies
 * (the header in the slab is the arbiter). */
static void test_generations(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("encode-test-11", EPOCH, "test", 4096, 0, &err);
    kiln_transport *rx = kiln_transport_shm_create("denoise-test-12", EPOCH + 1, "test", 0, 0, &err);
    if (!tx || !rx)
        return;
    kiln_tensor_ref old, fresh;
    float *p;
    const float *q;
    CHECK(kiln_transport_alloc(tx, KILN_F32, 1, (int64_t[]){8}, &old, (void **)&p, &err) == KILN_OK);
    p[0] = 1.0f;
    CHECK(kiln_transport_open(rx, &old, (const void **)&q, &err) == KILN_OK && q[0] == 1.0f);
    CHECK(kiln_transport_verify(rx, &old, &err) == KILN_OK);
    /* Freed while the consumer reads it (a stale release, a fenced
     * consumer): the consumer's verify refuses it. */
    CHECK(kiln_transport_free(tx, &old, &err) == KILN_OK);
    CHECK(kiln_transport_verify(rx, &old, &err) == KILN_ERR_NOT_FOUND);
    /* ...and handed out again at the same place. */
    CHECK(kiln_transport_alloc(tx, KILN_F32, 1, (int64_t[]){8}, &fresh, (void **)&p, &err) ==
          KILN_OK);
    CHECK(fresh.off == old.off && fresh.gen != old.gen);
    p[0] = 2.0f;
    CHECK(kiln_transport_verify(rx, &old, &err) == KILN_ERR_NOT_FOUND);
    kiln_transport_close(rx, &old);
    const float *q2;
    CHECK(kiln_transport_open(rx, &old, (const void **)&q2, &err) == KILN_ERR_NOT_FOUND);
    kiln_tensor_ref longer = fresh;
    longer.shape[0] = 16, longer.len = 64; /* the right generation, the wrong length */
    CHECK(kiln_transport_open(rx, &longer, (const void **)&q2, &err) == KILN_ERR_NOT_FOUND);
    CHECK(kiln_transport_open(rx, &fresh, (const void **)&q2, &err) == KILN_OK && q2[0] == 2.0f);
    kiln_transport_close(rx, &fresh);
    /* The stale free changes nothing: the new allocation stays live. */
    CHECK(kiln_transport_free(tx, &old, &err) == KILN_ERR_INVALID);
    kiln_transport_stats st;
    kiln_transport_stats_get(tx, &st);
    CHECK(st.live == 1 && st.refused == 1);
    CHECK(kiln_transport_open(rx, &fresh, (const void **)&q2, &err) == KILN_OK);
    CHECK(kiln_transport_verify(rx, &fresh, &err) == KILN_OK);
    kiln_transport_close(rx, &fresh);
    CHECK(kiln_transport_free(tx, &fresh, &err) == KILN_OK);
    kiln_transport_destroy(rx);
    kiln_transport_destroy(tx);
}

/* At most 64 idle mappings stay cached; one in use is never unmapped. */
static void test_mapping_cache(void)
{
    kiln_err err = {0};
    kiln_transport *rx = kiln_transport_shm_create("denoise-test-6", EPOCH, "test", 0, 0, &err);
    kiln_transport *tx[80];
    kiln_tensor_ref r[80];
    for (int i = 0; i < 80; i++) {
        tx[i] = kiln_transport_shm_create("encode-test-7", EPOCH, "test", 4096, 0, &err);
        uint8_t *p;
        CHECK(tx[i] && kiln_transport_alloc(tx[i], KILN_U8, 1, (int64_t[]){16}, &r[i], (void **)&p,
                                            &err) == KILN_OK);
        memset(p, i, 16);
    }
    const uint8_t *pinned, *q;
    CHECK(kiln_transport_open(rx, &r[0], (const void **)&pinned, &err) == KILN_OK);
    for (int i = 1; i < 80; i++) {
        CHECK(kiln_transport_open(rx, &r[i], (const void **)&q, &err) == KILN_OK && q[15] == i);
        kiln_transport_close(rx, &r[i]);
    }
    kiln_transport_stats st;
    kiln_transport_stats_get(rx, &st);
    CHECK(st.mapped == 65 && st.open == 1);
    CHECK(pinned[0] == 0 && pinned[15] == 0);
    kiln_transport_close(rx, &r[0]);
    for (int i = 0; i < 80; i++)
        kiln_transport_destroy(tx[i]);
    kiln_transport_destroy(rx);
}

static void test_pool_limit(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("encode-test-8", EPOCH, "test", 8192, 16384, &err);
    kiln_tensor_ref r[3];
    void *p;
    /* 8128 bytes and a 64-byte header fill a slab. */
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8128}, &r[0], &p, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8128}, &r[1], &p, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8128}, &r[2], &p, &err) == KILN_ERR_BUSY);
    CHECK(p == NULL);
    CHECK(kiln_transport_free(tx, &r[0], &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8128}, &r[2], &p, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(tx, KILN_F32, 0, NULL, &r[0], &p, &err) == KILN_ERR_INVALID);
    CHECK(kiln_transport_alloc(tx, KILN_F32, 1, (int64_t[]){-1}, &r[0], &p, &err) == KILN_ERR_INVALID);
    kiln_transport_destroy(tx);
    CHECK(kiln_transport_shm_create("bad id", EPOCH, "Test!", 0, 0, &err) == NULL);
}

/* A replica that dies without cleaning up leaves slabs named with its pid;
 * the cleaner removes those and leaves live processes' slabs alone. */
static void test_stale_cleanup(void)
{
    kiln_err err = {0};
    int fds[2];
    CHECK(pipe(fds) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        kiln_transport *t = kiln_transport_shm_create("encode-test-9", EPOCH, "test", 4096, 0, NULL);
        kiln_tensor_ref r;
        void *p;
        if (t && !kiln_transport_alloc(t, KILN_U8, 1, (int64_t[]){1}, &r, &p, NULL))
            (void)!write(fds[1], r.slab, sizeof r.slab);
        _exit(0); /* "crash": no destroy */
    }
    char name[KILN_PROTO_SLAB_MAX] = {0};
    CHECK(read(fds[0], name, sizeof name) == (ssize_t)sizeof name);
    close(fds[0]), close(fds[1]);
    waitpid(pid, NULL, 0);
    kiln_transport *mine = kiln_transport_shm_create("encode-test-10", EPOCH, "test", 4096, 0, &err);
    kiln_tensor_ref r;
    void *p;
    CHECK(kiln_transport_alloc(mine, KILN_U8, 1, (int64_t[]){1}, &r, &p, &err) == KILN_OK);
    CHECK(slab_exists(name));
    CHECK(kiln_transport_shm_clean_stale(&err) >= 1);
    CHECK(!slab_exists(name));
    CHECK(slab_exists(r.slab));
    kiln_transport_destroy(mine);
}

static void test_inline(void)
{
    kiln_err err = {0};
    kiln_transport *t = kiln_transport_inline_create(&err);
    kiln_tensor_ref r, other;
    int32_t *p;
    CHECK(kiln_transport_alloc(t, KILN_I32, 2, (int64_t[]){3, 4}, &r, (void **)&p, &err) == KILN_OK);
    CHECK(r.kind == KILN_REF_INLINE && r.len == 48 && r.data == p);
    for (int i = 0; i < 12; i++)
        p[i] = i;
    const int32_t *q;
    CHECK(kiln_transport_open(t, &r, (const void **)&q, &err) == KILN_OK && q == p && q[11] == 11);
    kiln_transport_close(t, &r);
    other = r, other.data = &err;
    CHECK(kiln_transport_free(t, &other, &err) == KILN_ERR_INVALID);
    kiln_transport_stats st;
    kiln_transport_stats_get(t, &st);
    CHECK(st.live == 1 && st.open == 0);
    CHECK(kiln_transport_free(t, &r, &err) == KILN_OK);
    CHECK(kiln_transport_free(t, &r, &err) == KILN_ERR_INVALID);
    kiln_transport_destroy(t);
}

int main(void)
{
    RUN(test_alloc_free_reuse);
    RUN(test_flat_usage);
    RUN(test_consumer);
    RUN(test_generations);
    RUN(test_mapping_cache);
    RUN(test_pool_limit);
    RUN(test_stale_cleanup);
    RUN(test_inline);
    return test_finish();
}
