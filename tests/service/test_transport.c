/* Tensor transports: shm range allocation, reuse and merging, the consumer
 * mapping cache (in this process and another one), slab usage that stays
 * flat over many cycles, hostile references, generations (stale frees
 * and reads of ranges handed out again), unlinking, slab names unique per
 * process instance, mappings of gone incarnations dropped, slabs that lose
 * their name retired, the owner-lock (flock) cleanup of dead processes'
 * slabs that ignores pids; the inline transport's ownership checks. */
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
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

static int shm_create_locked(const char *name, int lock)
{
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0 && lock && flock(fd, LOCK_EX)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A slab's owner holds an flock on it for its life; the cleanup removes
 * exactly the slabs whose lock it can take, whatever the pid in the name
 * says (in another PID namespace that pid means nothing here). */
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
    /* Another namespace's owner, alive, whose pid is dead here; and a dead
     * owner whose pid is alive here (ours). */
    char held[64], dead[64];
    snprintf(held, sizeof held, "/kiln-test-00000000000000aa-%ld-0", (long)pid);
    snprintf(dead, sizeof dead, "/kiln-test-00000000000000bb-%ld-0", (long)getpid());
    int held_fd = shm_create_locked(held, 1);
    int dead_fd = shm_create_locked(dead, 0);
    CHECK(held_fd >= 0 && dead_fd >= 0);
    if (dead_fd >= 0)
        close(dead_fd);
    CHECK(slab_exists(name));
    CHECK(kiln_transport_shm_clean_stale(&err) >= 2);
    CHECK(!slab_exists(name) && !slab_exists(dead));
    CHECK(slab_exists(r.slab) && slab_exists(held));
    /* Its owner gone, the held one goes too. */
    if (held_fd >= 0)
        close(held_fd);
    CHECK(kiln_transport_shm_clean_stale(&err) >= 1);
    CHECK(!slab_exists(held) && slab_exists(r.slab));
    /* A name of another form (an older kiln's: pid only) proves nothing
     * about its owner: left alone. */
    char legacy[64];
    snprintf(legacy, sizeof legacy, "/kiln-test-%ld-0", (long)pid);
    int legacy_fd = shm_create_locked(legacy, 0);
    CHECK(legacy_fd >= 0);
    if (legacy_fd >= 0)
        close(legacy_fd);
    kiln_transport_shm_clean_stale(&err);
    CHECK(slab_exists(legacy));
    shm_unlink(legacy);
    kiln_transport_destroy(mine);
    CHECK(!slab_exists(r.slab));
}

/* Slab names are unique per process instance, not per pid: two
 * incarnations of one replica id in one process (as two processes that
 * share a pid number in two PID namespaces) never share a name, and a
 * consumer keys its mappings by name and owner epoch; a gone incarnation's
 * mappings are dropped, the one still in use when it closes. */
static void test_identity(void)
{
    kiln_err err = {0};
    kiln_transport *a = kiln_transport_shm_create("denoise-same-1", EPOCH, "test", 4096, 0, &err);
    kiln_transport *b = kiln_transport_shm_create("denoise-same-1", EPOCH + 1, "test", 4096, 0,
                                                  &err);
    kiln_transport *rx = kiln_transport_shm_create("decode-test-13", EPOCH + 2, "test", 0, 0, &err);
    if (!a || !b || !rx)
        return;
    kiln_tensor_ref ra, rb;
    uint8_t *pa, *pb;
    CHECK(kiln_transport_alloc(a, KILN_U8, 1, (int64_t[]){8}, &ra, (void **)&pa, &err) == KILN_OK);
    CHECK(kiln_transport_alloc(b, KILN_U8, 1, (int64_t[]){8}, &rb, (void **)&pb, &err) == KILN_OK);
    char epoch_a[20];
    snprintf(epoch_a, sizeof epoch_a, "-%016llx-", (unsigned long long)EPOCH);
    CHECK(strcmp(ra.slab, rb.slab) && strstr(ra.slab, epoch_a) && !strstr(rb.slab, epoch_a));
    pa[0] = 1, pb[0] = 2;
    const uint8_t *qa, *qb;
    CHECK(kiln_transport_open(rx, &ra, (const void **)&qa, &err) == KILN_OK && qa[0] == 1);
    CHECK(kiln_transport_open(rx, &rb, (const void **)&qb, &err) == KILN_OK && qb[0] == 2);
    kiln_transport_close(rx, &rb);
    kiln_transport_stats st;
    kiln_transport_stats_get(rx, &st);
    CHECK(st.mapped == 2);
    /* A reference naming a's slab under b's epoch is neither of them. */
    kiln_tensor_ref mixed = ra;
    mixed.epoch = rb.epoch;
    const uint8_t *qm;
    CHECK(kiln_transport_open(rx, &mixed, (const void **)&qm, &err) == KILN_ERR_NOT_FOUND);
    kiln_transport_forget(rx, EPOCH + 1);
    kiln_transport_forget(rx, EPOCH);
    kiln_transport_stats_get(rx, &st);
    CHECK(st.mapped == 1 && st.open == 1); /* a's is still open */
    CHECK(qa[0] == 1);
    kiln_transport_close(rx, &ra);
    kiln_transport_stats_get(rx, &st);
    CHECK(st.mapped == 0 && st.open == 0);
    CHECK(kiln_transport_free(a, &ra, &err) == KILN_OK && kiln_transport_free(b, &rb, &err) == KILN_OK);
    kiln_transport_destroy(rx);
    kiln_transport_destroy(a);
    kiln_transport_destroy(b);
}

/* A slab whose name disappears from /dev/shm (a cleaner, systemd-logind's
 * RemoveIPC) hands out nothing more: the next range comes from a new slab,
 * a consumer that mapped the old one still reads it, one that had not
 * cannot open it, and the old slab goes once its ranges came back. */
static void test_lost_slab(void)
{
    kiln_err err = {0};
    kiln_transport *tx = kiln_transport_shm_create("encode-test-14", EPOCH, "test", 4096, 0, &err);
    kiln_transport *rx = kiln_transport_shm_create("denoise-test-15", EPOCH + 1, "test", 0, 0, &err);
    kiln_transport *late = kiln_transport_shm_create("denoise-test-16", EPOCH + 2, "test", 0, 0, &err);
    if (!tx || !rx || !late)
        return;
    kiln_tensor_ref r1, r2, r3;
    uint8_t *p;
    const uint8_t *q;
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8}, &r1, (void **)&p, &err) == KILN_OK);
    p[0] = 7;
    CHECK(kiln_transport_open(rx, &r1, (const void **)&q, &err) == KILN_OK && q[0] == 7);
    CHECK(shm_unlink(r1.slab) == 0);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8}, &r2, (void **)&p, &err) == KILN_OK);
    CHECK(strcmp(r1.slab, r2.slab) != 0 && slab_exists(r2.slab));
    kiln_transport_stats st;
    kiln_transport_stats_get(tx, &st);
    CHECK(st.lost == 1 && st.slabs == 2 && st.live == 2);
    CHECK(q[0] == 7 && kiln_transport_verify(rx, &r1, &err) == KILN_OK);
    CHECK(kiln_transport_open(late, &r1, (const void **)&q, &err) == KILN_ERR_NOT_FOUND);
    kiln_transport_close(rx, &r1);
    CHECK(kiln_transport_free(tx, &r1, &err) == KILN_OK);
    kiln_transport_stats_get(tx, &st);
    CHECK(st.slabs == 1 && st.live == 1);
    CHECK(kiln_transport_alloc(tx, KILN_U8, 1, (int64_t[]){8}, &r3, (void **)&p, &err) == KILN_OK);
    CHECK(!strcmp(r3.slab, r2.slab));
    CHECK(kiln_transport_free(tx, &r2, &err) == KILN_OK && kiln_transport_free(tx, &r3, &err) == KILN_OK);
    kiln_transport_destroy(late);
    kiln_transport_destroy(rx);
    kiln_transport_destroy(tx);
    CHECK(!slab_exists(r2.slab));
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
    RUN(test_identity);
    RUN(test_lost_slab);
    RUN(test_inline);
    return test_finish();
}
