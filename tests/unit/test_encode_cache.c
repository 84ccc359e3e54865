/* kiln_encode_prompts with the prompt cache (engine/encode_stage.h) on the
 * tiny klein checkpoint and the CPU backend: every row of every batch
 * (first and second misses, hits, a mix of them, a prompt repeated in one
 * batch, another max_seq, a cache too small for a row) has the bytes and
 * token ids the prompt gets encoded alone by a stage without a cache, and
 * the cache's counters say which rows it served and which it admitted: a
 * prompt enters the cache on its second miss, never on its first. */
#include <stdlib.h>
#include <string.h>

#include "common/checkpoint.h"
#include "engine/encode_stage.h"
#include "tests/oracle/oracle_util.h"
#include "tests/test.h"

static kiln_backend *be;
static kiln_checkpoint *ck;
static kiln_encode_stage *plain; /* no cache: the reference */

static const char *const P[] = {
    "a red fox sitting in fresh snow, soft winter light",
    "",
    "ein Fuchs im Schnee \xe2\x80\x94 \xe9\x9b\xaa\xe3\x81\xae\xe4\xb8\xad\xe3\x81\xae\xe7\x8b\x90",
    "a very long prompt that the tokenizer has to cut at the sequence length, with many words: "
    "mountains, rivers, forests, clouds, birds, boats, bridges, lanterns, and a small red house",
    "a lighthouse at dusk",
    "two cats on a windowsill",
};

static kiln_encode_stage *stage(size_t cache_bytes)
{
    kiln_err err = {0};
    kiln_encode_opts o = {.out_layers = {1, 2, 3}, .n_out_layers = 3,
                          .prompt_cache_bytes = cache_bytes};
    kiln_encode_stage *s = kiln_encode_stage_create(be, ck, &o, &err);
    if (!s) {
        fprintf(stderr, "encode stage: %s\n", err.msg);
        exit(1);
    }
    return s;
}

/* Encodes prompts[B] on s and checks each row and its ids against the
 * prompt encoded alone by the stage without a cache. */
static void check_batch(kiln_encode_stage *s, const char *const *prompts, int B, int max_seq)
{
    kiln_err err = {0};
    int64_t J = kiln_encode_stage_width(s);
    size_t row = (size_t)max_seq * (size_t)J;
    float *got = malloc((size_t)B * row * sizeof *got), *want = malloc(row * sizeof *want);
    int32_t *ids = malloc((size_t)B * max_seq * sizeof *ids);
    int32_t *want_ids = malloc((size_t)max_seq * sizeof *want_ids);
    kiln_tensor out = {0}, one = {0};
    if (!got || !want || !ids || !want_ids) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    CHECKF(kiln_encode_prompts(s, prompts, B, max_seq, &out, ids, NULL, &err) == KILN_OK, "%s", err.msg);
    CHECK(out.ndim == 3 && out.shape[0] == B && out.shape[1] == max_seq && out.shape[2] == J);
    kiln_be_download(be, &out, got);
    for (int b = 0; b < B; b++) {
        CHECKF(kiln_encode_prompts(plain, &prompts[b], 1, max_seq, &one, want_ids, NULL, &err) ==
                   KILN_OK, "%s", err.msg);
        kiln_be_download(be, &one, want);
        kiln_be_free(be, &one);
        CHECKF(!memcmp(got + b * row, want, row * sizeof *want), "row %d of %d (max_seq %d)", b,
               B, max_seq);
        CHECKF(!memcmp(ids + (size_t)b * max_seq, want_ids, (size_t)max_seq * sizeof *ids),
               "ids of row %d of %d", b, B);
    }
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    kiln_be_free(be, &out);
    free(got), free(want), free(ids), free(want_ids);
}

static kiln_prompt_cache_stats stats(const kiln_encode_stage *s)
{
    kiln_prompt_cache_stats st;
    kiln_encode_stage_cache_stats(s, &st);
    return st;
}

#define CHECK_STATS(s, h, m, d, n)                                                              \
    do {                                                                                        \
        kiln_prompt_cache_stats st_ = stats(s);                                                 \
        CHECKF(st_.hits == (h) && st_.misses == (m) && st_.deferred == (d) &&                   \
                   st_.entries == (n),                                                          \
               "hits %llu misses %llu deferred %llu entries %zu",                              \
               (unsigned long long)st_.hits, (unsigned long long)st_.misses,                    \
               (unsigned long long)st_.deferred, st_.entries);                                  \
    } while (0)

static void test_hits_and_misses(void)
{
    kiln_encode_stage *s = stage(1 << 20);
    const char *first[] = {P[0], P[1]};
    check_batch(s, first, 2, 64); /* both computed, neither cached: first sight */
    CHECK_STATS(s, 0, 2, 2, 0);
    /* P[1] again: computed again and cached; P[4], P[5] seen once. */
    const char *again[] = {P[1], P[4], P[5]};
    check_batch(s, again, 3, 64);
    CHECK_STATS(s, 0, 5, 4, 1);
    /* A hit ahead of two second misses: each computed row moves up by one,
     * and both enter the cache. */
    const char *shifted[] = {P[1], P[4], P[0]};
    check_batch(s, shifted, 3, 64);
    CHECK_STATS(s, 1, 7, 4, 3);
    /* Hits (P[0], P[1]) among first misses, one of them (P[2]) twice in the
     * batch: one miss, still not cached. */
    const char *mixed[] = {P[2], P[0], P[2], P[1], P[3]};
    check_batch(s, mixed, 5, 64);
    CHECK_STATS(s, 3, 9, 6, 3);
    const char *seconds[] = {P[2], P[5], P[2], P[3]};
    check_batch(s, seconds, 4, 64);
    CHECK_STATS(s, 3, 12, 6, 6);
    /* Only hits: nothing runs through Qwen3. */
    const char *hits[] = {P[3], P[2], P[3]};
    check_batch(s, hits, 3, 64);
    CHECK_STATS(s, 5, 12, 6, 6);
    /* max_seq is part of the key: P[0] at 32 is a first sight. */
    check_batch(s, &P[0], 1, 32);
    CHECK_STATS(s, 5, 13, 7, 6);
    check_batch(s, (const char *[]){P[3], P[0]}, 2, 32);
    CHECK_STATS(s, 5, 15, 8, 7);
    check_batch(s, (const char *[]){P[3], P[0]}, 2, 32);
    CHECK_STATS(s, 6, 16, 8, 8);
    /* cache_row asks before downloading, so no row is produced only to be
     * refused by put. */
    kiln_prompt_cache_stats st = stats(s);
    CHECK(st.evictions == 0 && st.rejected == 0 && st.bytes <= st.max_bytes);
    kiln_encode_stage_destroy(s);
}

/* A bad prompt fails the call as it does without a cache, hits or not. */
static void test_bad_prompt(void)
{
    kiln_encode_stage *s = stage(1 << 20);
    check_batch(s, &P[0], 1, 32);
    check_batch(s, &P[0], 1, 32);
    kiln_err err = {0};
    kiln_tensor out = {0};
    const char *bad[] = {P[0], "bad \xff utf-8"};
    CHECK(kiln_encode_prompts(s, bad, 2, 32, &out, NULL, NULL, &err) == KILN_ERR_INVALID);
    CHECK(out.data == NULL);
    CHECK(stats(s).entries == 1);
    kiln_encode_stage_destroy(s);
}

/* A bound below one row caches nothing, even a prompt it admits (its
 * second miss), and a stage without a cache still computes a repeated
 * prompt once; the rows are the same either way. */
static void test_no_room(void)
{
    kiln_encode_stage *s = stage(1000);
    const char *rows[] = {P[0], P[0], P[1]};
    check_batch(s, rows, 3, 64);
    check_batch(s, rows, 3, 64);
    kiln_prompt_cache_stats st = stats(s);
    CHECK(st.hits == 0 && st.misses == 4 && st.deferred == 2 && st.entries == 0 &&
          st.bytes == 0 && st.rejected == 0);
    kiln_encode_stage_destroy(s);
    check_batch(plain, rows, 3, 64);
    CHECK(stats(plain).max_bytes == 0 && stats(plain).entries == 0);
}

int main(void)
{
    be = oracle_cpu_backend();
    kiln_err err = {0};
    ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    if (!ck) {
        fprintf(stderr, "checkpoint: %s\n", err.msg);
        return 1;
    }
    plain = stage(0);
    RUN(test_hits_and_misses);
    RUN(test_bad_prompt);
    RUN(test_no_room);
    kiln_encode_stage_destroy(plain);
    kiln_checkpoint_close(ck);
    kiln_backend_destroy(be);
    return test_finish();
}
