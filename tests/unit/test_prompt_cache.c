/* The prompt-embedding cache (engine/prompt_cache.h): admission on a key's
 * second miss and the bounded filter behind it, hits and misses, the key
 * (prompt bytes and max_seq), LRU order under the byte bound, oversize
 * entries, a zero bound, replacement and table growth. */
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

/* 1 when (p, max_seq) misses (which the admission filter records). */
static int miss(kiln_prompt_cache *c, const char *p, int max_seq)
{
    size_t len = 0;
    return kiln_prompt_cache_get(c, p, strlen(p), max_seq, &len) == NULL;
}

static int accepts(const kiln_prompt_cache *c, const char *p, int max_seq, size_t n)
{
    return kiln_prompt_cache_accepts(c, p, strlen(p), max_seq, n);
}

/* Misses (p, max_seq) twice, which admits it. */
static void admit(kiln_prompt_cache *c, const char *p, int max_seq)
{
    CHECK(miss(c, p, max_seq) && miss(c, p, max_seq));
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
    admit(c, key, 1);
    put(c, key, 1, value_len, 0);
    size_t bytes = stats(c).bytes;
    kiln_prompt_cache_destroy(c);
    return bytes;
}

/* A key's first miss does not admit it, its second does, the next get
 * hits; every counter says so. */
static void test_admission(void)
{
    kiln_prompt_cache *c = create(1 << 20);
    CHECK(!accepts(c, "a fox", 512, 100)); /* never seen */
    CHECK(miss(c, "a fox", 512));
    CHECK(!accepts(c, "a fox", 512, 100)); /* seen once */
    CHECK(put(c, "a fox", 512, 100, 1) == KILN_OK); /* refused, like accepts */
    CHECK(stats(c).entries == 0 && stats(c).rejected == 1 && stats(c).deferred == 1);
    CHECK(miss(c, "a fox", 512)); /* second miss: admitted */
    CHECK(stats(c).deferred == 1);
    CHECK(accepts(c, "a fox", 512, 100));
    CHECK(!accepts(c, "a fox", 256, 100)); /* max_seq is part of the key */
    CHECK(!accepts(c, "a fox ", 512, 100));
    CHECK(!accepts(c, "a fox", 512, 2u << 20)); /* admitted, but too big */
    CHECK(put(c, "a fox", 512, 100, 1) == KILN_OK);
    CHECK(has(c, "a fox", 512, 100, 1));
    /* The same prompt at another max_seq is a new key: deferred once. */
    CHECK(miss(c, "a fox", 256));
    CHECK(!accepts(c, "a fox", 256, 100));
    CHECK(miss(c, "a fox", 256));
    CHECK(accepts(c, "a fox", 256, 100));
    /* Misses of other keys in between do not make a key forgotten. */
    CHECK(miss(c, "a cat", 512));
    CHECK(miss(c, "a dog", 512));
    CHECK(miss(c, "a cat", 512));
    CHECK(accepts(c, "a cat", 512, 100) && !accepts(c, "a dog", 512, 100));
    kiln_prompt_cache_stats st = stats(c);
    CHECKF(st.hits == 1 && st.misses == 7 && st.deferred == 4, "hits %llu misses %llu "
           "deferred %llu", (unsigned long long)st.hits, (unsigned long long)st.misses,
           (unsigned long long)st.deferred);
    CHECK(st.entries == 1 && st.rejected == 1);
    kiln_prompt_cache_destroy(c);
}

/* The filter holds a few thousand keys: 100 keys missed once are all
 * admitted on their second miss, while a key followed by 16384 other
 * missed keys is forgotten, so its next miss counts as a first again. */
static void test_filter_bounded(void)
{
    kiln_prompt_cache *c = create(1 << 20);
    char key[32];
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < 100; i++) {
            snprintf(key, sizeof key, "recent %d", i);
            CHECK(miss(c, key, 64));
        }
    int admitted = 0;
    for (int i = 0; i < 100; i++) {
        snprintf(key, sizeof key, "recent %d", i);
        admitted += accepts(c, key, 64, 8);
    }
    CHECKF(admitted == 100, "%d of 100 admitted", admitted);
    CHECK(stats(c).deferred == 100);

    CHECK(miss(c, "old", 64));
    for (int i = 0; i < 16384; i++) {
        snprintf(key, sizeof key, "flood %d", i);
        miss(c, key, 64);
    }
    uint64_t deferred = stats(c).deferred;
    CHECK(miss(c, "old", 64));
    CHECK(stats(c).deferred == deferred + 1);
    CHECK(!accepts(c, "old", 64, 8));
    CHECK(miss(c, "old", 64));
    CHECK(accepts(c, "old", 64, 8));
    kiln_prompt_cache_destroy(c);
}

static void test_hit_miss_and_key(void)
{
    kiln_prompt_cache *c = create(1 << 20);
    admit(c, "a fox", 512);
    CHECK(put(c, "a fox", 512, 100, 1) == KILN_OK);
    CHECK(has(c, "a fox", 512, 100, 1));
    CHECK(!has(c, "a fox", 256, 100, 1)); /* max_seq is part of the key */
    CHECK(!has(c, "a fo", 512, 100, 1));  /* so is every byte of the prompt */
    CHECK(!has(c, "a fox ", 512, 100, 1));
    CHECK(!has(c, "a Fox", 512, 100, 1));
    CHECK(miss(c, "a fox", 256)); /* its second miss */
    CHECK(put(c, "a fox", 256, 50, 2) == KILN_OK);
    CHECK(has(c, "a fox", 256, 50, 2));
    CHECK(has(c, "a fox", 512, 100, 1));
    /* The prompt is bytes, not a C string: an embedded NUL counts. */
    kiln_err err = {0};
    size_t len = 0;
    for (int i = 0; i < 2; i++)
        CHECK(kiln_prompt_cache_get(c, "x\0y", 3, 8, &len) == NULL);
    CHECK(!kiln_prompt_cache_accepts(c, "x\0z", 3, 8, 4));
    CHECK(kiln_prompt_cache_put(c, "x\0y", 3, 8, value(4, 3), 4, &err) == KILN_OK);
    CHECK(kiln_prompt_cache_get(c, "x\0y", 3, 8, &len) != NULL && len == 4);
    CHECK(kiln_prompt_cache_get(c, "x\0z", 3, 8, &len) == NULL);
    CHECK(kiln_prompt_cache_get(c, "x", 1, 8, &len) == NULL);
    /* The empty prompt (the usual negative prompt) is a key like any other. */
    admit(c, "", 512);
    CHECK(put(c, "", 512, 10, 4) == KILN_OK);
    CHECK(has(c, "", 512, 10, 4));
    kiln_prompt_cache_stats st = stats(c);
    CHECKF(st.hits == 5 && st.misses == 13 && st.deferred == 9, "hits %llu misses %llu "
           "deferred %llu", (unsigned long long)st.hits, (unsigned long long)st.misses,
           (unsigned long long)st.deferred);
    CHECK(st.entries == 4 && st.evictions == 0 && st.rejected == 0);
    kiln_prompt_cache_destroy(c);
}

static void test_lru_eviction(void)
{
    size_t unit = cost_of(1, 1000);
    CHECK(unit >= 1001);
    kiln_prompt_cache *c = create(3 * unit); /* room for exactly three */
    for (const char *k = "abcde"; *k; k++)
        admit(c, (char[]){*k, '\0'}, 7);
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
    admit(c, "a", 1);
    admit(c, "bb", 1);
    CHECK(accepts(c, "a", 1, 1000));
    CHECK(!accepts(c, "a", 1, 1001));
    CHECK(!accepts(c, "bb", 1, 1000));
    CHECK(!accepts(c, "a", 1, SIZE_MAX)); /* no overflow */
    put(c, "a", 1, 1000, 'a');
    CHECK(has(c, "a", 1, 1000, 'a'));
    /* Larger than the bound: not stored, and nothing evicted for it. */
    admit(c, "b", 1);
    CHECK(put(c, "b", 1, 1001, 'b') == KILN_OK);
    CHECK(!has(c, "b", 1, 1001, 'b'));
    CHECK(has(c, "a", 1, 1000, 'a'));
    CHECK(stats(c).rejected == 1 && stats(c).evictions == 0 && stats(c).bytes == unit);
    /* Not admitted (missed once): not stored, nothing evicted for it. */
    CHECK(miss(c, "c", 1));
    CHECK(put(c, "c", 1, 1000, 'c') == KILN_OK);
    CHECK(has(c, "a", 1, 1000, 'a'));
    CHECK(stats(c).rejected == 2 && stats(c).evictions == 0 && stats(c).entries == 1);
    kiln_prompt_cache_destroy(c);

    /* A zero bound stores nothing, and its filter records nothing. */
    c = create(0);
    admit(c, "a", 1);
    CHECK(!accepts(c, "a", 1, 0));
    CHECK(put(c, "a", 1, 1, 'a') == KILN_OK);
    CHECK(!has(c, "a", 1, 1, 'a'));
    kiln_prompt_cache_stats st = stats(c);
    CHECK(st.entries == 0 && st.bytes == 0 && st.rejected == 1 && st.misses == 3 &&
          st.deferred == 0 && st.max_bytes == 0);
    kiln_prompt_cache_destroy(c);
}

static void test_replace(void)
{
    size_t unit = cost_of(1, 1000);
    kiln_prompt_cache *c = create(2 * unit);
    admit(c, "a", 1);
    admit(c, "b", 1);
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
        admit(c, key, 64);
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
    RUN(test_admission);
    RUN(test_filter_bounded);
    RUN(test_hit_miss_and_key);
    RUN(test_lru_eviction);
    RUN(test_bounds);
    RUN(test_replace);
    RUN(test_many);
    return test_finish();
}
