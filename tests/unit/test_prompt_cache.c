/* The prompt-embedding cache (engine/prompt_cache.h): hits and misses, the
 * key (prompt bytes and max_seq), LRU order under the byte bound,
 * oversize entries, a zero bound, replacement and table growth. */
#include <stdlib.h>
#include <string.h>

#include "engine/prompt_cache.h"
#include "tests/test.h"

/* A malloc'd value of n bytes, each `fill`. */
static void *value(size_t n, int fill)
{
    void *v = malloc(n);
    if (!v) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    memset(v, fill, n);
    return v;
}

static int put(kiln_prompt_cache *c, const char *p, int max_seq, size_t n, int fill)
{
    kiln_err err = {0};
    return kiln_prompt_cache_put(c, p, strlen(p), max_seq, value(n, fill), n, &err);
}

/* 1 when (p, max_seq) is cached with n bytes of `fill`. */
static int has(kiln_prompt_cache *c, const char *p, int max_seq, size_t n, int fill)
{
    size_t len = 0;
    const unsigned char *v = kiln_prompt_cache_get(c, p, strlen(p), max_seq, &len);
    if (!v || len != n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (v[i] != fill)
            return 0;
    return 1;
}

static kiln_prompt_cache_stats stats(const kiln_prompt_cache *c)
{
    kiln_prompt_cache_stats st;
    kiln_prompt_cache_get_stats(c, &st);
    return st;
}

static kiln_prompt_cache *create(size_t max_bytes)
{
    kiln_err err = {0};
    kiln_prompt_cache *c = kiln_prompt_cache_create(max_bytes, &err);
    if (!c) {
        fprintf(stderr, "%s\n", err.msg);
        exit(1);
    }
    return c;
}

/* The per-entry cost: one entry of a known size fills a fresh cache by
 * exactly this many bytes. */
static size_t cost_of(size_t key_len, size_t value_len)
{
    kiln_prompt_cache *c = create(1 << 20);
    char key[64];
    memset(key, 'k', key_len), key[key_len] = '\0';
    put(c, key, 1, value_len, 0);
    size_t bytes = stats(c).bytes;
    kiln_prompt_cache_destroy(c);
    return bytes;
}

static void test_hit_miss_and_key(void)
{
    kiln_prompt_cache *c = create(1 << 20);
    CHECK(!has(c, "a fox", 512, 100, 1));
    CHECK(put(c, "a fox", 512, 100, 1) == KILN_OK);
    CHECK(has(c, "a fox", 512, 100, 1));
    CHECK(!has(c, "a fox", 256, 100, 1)); /* max_seq is part of the key */
    CHECK(!has(c, "a fo", 512, 100, 1));  /* so is every byte of the prompt */
    CHECK(!has(c, "a fox ", 512, 100, 1));
    CHECK(!has(c, "a Fox", 512, 100, 1));
    CHECK(put(c, "a fox", 256, 50, 2) == KILN_OK);
    CHECK(has(c, "a fox", 256, 50, 2));
    CHECK(has(c, "a fox", 512, 100, 1));
    /* The prompt is bytes, not a C string: an embedded NUL counts. */
    kiln_err err = {0};
    CHECK(kiln_prompt_cache_put(c, "x\0y", 3, 8, value(4, 3), 4, &err) == KILN_OK);
    size_t len = 0;
    CHECK(kiln_prompt_cache_get(c, "x\0y", 3, 8, &len) != NULL && len == 4);
    CHECK(kiln_prompt_cache_get(c, "x\0z", 3, 8, &len) == NULL);
    CHECK(kiln_prompt_cache_get(c, "x", 1, 8, &len) == NULL);
    /* The empty prompt (the usual negative prompt) is a key like any other. */
    CHECK(put(c, "", 512, 10, 4) == KILN_OK);
    CHECK(has(c, "", 512, 10, 4));
    kiln_prompt_cache_stats st = stats(c);
    CHECKF(st.hits == 5 && st.misses == 7, "hits %llu misses %llu", (unsigned long long)st.hits,
           (unsigned long long)st.misses);
    CHECK(st.entries == 4 && st.evictions == 0 && st.rejected == 0);
    kiln_prompt_cache_destroy(c);
}

static void test_lru_eviction(void)
{
    size_t unit = cost_of(1, 1000);
    CHECK(unit >= 1001);
    kiln_prompt_cache *c = create(3 * unit); /* room for exactly three */
    put(c, "a", 7, 1000, 'a');
    put(c, "b", 7, 1000, 'b');
    put(c, "c", 7, 1000, 'c');
    CHECK(stats(c).bytes == 3 * unit && stats(c).entries == 3);
    CHECK(has(c, "a", 7, 1000, 'a')); /* a is now the most recently used: b goes first */
    put(c, "d", 7, 1000, 'd');
    CHECK(!has(c, "b", 7, 1000, 'b'));
    CHECK(has(c, "a", 7, 1000, 'a') && has(c, "c", 7, 1000, 'c') && has(c, "d", 7, 1000, 'd'));
    CHECK(stats(c).evictions == 1 && stats(c).entries == 3 && stats(c).bytes == 3 * unit);
    /* Order now (most recent first): d, c, a.  A bigger entry evicts as
     * many of the oldest as it needs: a and c. */
    size_t big = cost_of(1, 1500);
    CHECK(big <= 2 * unit);
    put(c, "e", 7, 1500, 'e');
    CHECK(!has(c, "a", 7, 1000, 'a') && !has(c, "c", 7, 1000, 'c'));
    CHECK(has(c, "d", 7, 1000, 'd') && has(c, "e", 7, 1500, 'e'));
    CHECK(stats(c).evictions == 3 && stats(c).entries == 2 && stats(c).bytes == unit + big);
    kiln_prompt_cache_destroy(c);
}

static void test_bounds(void)
{
    size_t unit = cost_of(1, 1000);
    kiln_prompt_cache *c = create(unit);
    CHECK(kiln_prompt_cache_accepts(c, 1, 1000));
    CHECK(!kiln_prompt_cache_accepts(c, 1, 1001));
    CHECK(!kiln_prompt_cache_accepts(c, 2, 1000));
    CHECK(!kiln_prompt_cache_accepts(c, SIZE_MAX, SIZE_MAX)); /* no overflow */
    put(c, "a", 1, 1000, 'a');
    CHECK(has(c, "a", 1, 1000, 'a'));
    /* Larger than the bound: not stored, and nothing evicted for it. */
    CHECK(put(c, "b", 1, 1001, 'b') == KILN_OK);
    CHECK(!has(c, "b", 1, 1001, 'b'));
    CHECK(has(c, "a", 1, 1000, 'a'));
    CHECK(stats(c).rejected == 1 && stats(c).evictions == 0 && stats(c).bytes == unit);
    kiln_prompt_cache_destroy(c);

    /* A zero bound stores nothing. */
    c = create(0);
    CHECK(!kiln_prompt_cache_accepts(c, 0, 0));
    CHECK(put(c, "a", 1, 1, 'a') == KILN_OK);
    CHECK(!has(c, "a", 1, 1, 'a'));
    kiln_prompt_cache_stats st = stats(c);
    CHECK(st.entries == 0 && st.bytes == 0 && st.rejected == 1 && st.misses == 1 &&
          st.max_bytes == 0);
    kiln_prompt_cache_destroy(c);
}

static void test_replace(void)
{
    size_t unit = cost_of(1, 1000);
    kiln_prompt_cache *c = create(2 * unit);
    put(c, "a", 1, 1000, 'a');
    put(c, "b", 1, 1000, 'b');
    /* Same key again: the old value goes, the other entry stays. */
    put(c, "a", 1, 1000, 'A');
    CHECK(has(c, "a", 1, 1000, 'A') && has(c, "b", 1, 1000, 'b'));
    CHECK(stats(c).entries == 2 && stats(c).evictions == 0 && stats(c).bytes == 2 * unit);
    kiln_prompt_cache_destroy(c);
}

/* Many entries: the bucket array grows and every entry stays reachable;
 * destroy frees them all (the ASan build checks). */
static void test_many(void)
{
    kiln_prompt_cache *c = create(1 << 20);
    char key[32];
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof key, "prompt %d", i);
        put(c, key, 64, 8, i & 0xff);
    }
    int found = 0;
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof key, "prompt %d", i);
        found += has(c, key, 64, 8, i & 0xff);
    }
    CHECKF(found == 1000, "%d of 1000", found);
    CHECK(stats(c).entries == 1000 && stats(c).evictions == 0);
    kiln_prompt_cache_destroy(c);
    kiln_prompt_cache_destroy(NULL);
}

int main(void)
{
    RUN(test_hit_miss_and_key);
    RUN(test_lru_eviction);
    RUN(test_bounds);
    RUN(test_replace);
    RUN(test_many);
    return test_finish();
}
