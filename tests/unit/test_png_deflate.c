/* kiln's run-only deflate (common/image_png_deflate.c): zlib's inflate
 * reads back exactly the input, for one stream and for streams of several
 * calls concatenated (sync flushes, then a final block), on inputs that
 * reach every path: empty and tiny inputs, runs at and over the 258-byte
 * match limit, blocks past 16384 symbols, incompressible data (stored
 * blocks, also over 65535 bytes), and a Fibonacci-distributed alphabet
 * whose Huffman tree is deeper than 15 bits (the length limit); and 300
 * random mixtures of these.  The output
 * stays within kiln_image_png_deflate_bound, and is as small as zlib's
 * Z_RLE stream within 1% + 64 bytes on data with runs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "common/image_impl.h"
#include "tests/test.h"

static uint32_t rng_state = 2463534242u;

static uint32_t rng(void)
{
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 17, rng_state ^= rng_state << 5;
    return rng_state;
}

/* Inflates raw deflate data; returns the bytes out, or (size_t)-1 on a
 * stream error or a stream that does not end. */
static size_t inflate_all(const uint8_t *z, size_t n, uint8_t *out, size_t cap)
{
    z_stream s;
    memset(&s, 0, sizeof s);
    if (inflateInit2(&s, -15) != Z_OK)
        return (size_t)-1;
    s.next_in = (uint8_t *)z;
    s.avail_in = (uInt)n;
    s.next_out = out;
    s.avail_out = (uInt)cap;
    int rc = inflate(&s, Z_FINISH);
    size_t got = cap - s.avail_out;
    int left = (int)s.avail_in;
    inflateEnd(&s);
    return rc == Z_STREAM_END && left == 0 ? got : (size_t)-1;
}

/* Deflates `in` cut into `parts` calls, inflates the concatenation, compares. */
static size_t round_trip(const char *what, const uint8_t *in, size_t n, int parts)
{
    size_t cap = 0;
    for (int p = 0; p < parts; p++)
        cap += kiln_image_png_deflate_bound(n / parts + n % parts);
    uint8_t *z = malloc(cap + 1), *back = malloc(n + 16);
    size_t zn = 0;
    for (int p = 0; p < parts; p++) {
        size_t a = n * p / parts, b = n * (p + 1) / parts;
        size_t got = kiln_image_png_deflate_rle(in + a, b - a, p == parts - 1, z + zn);
        CHECKF(got <= kiln_image_png_deflate_bound(b - a), "%s: %zu bytes over the bound %zu",
               what, got, kiln_image_png_deflate_bound(b - a));
        zn += got;
    }
    size_t got = inflate_all(z, zn, back, n + 16);
    CHECKF(got == n && !memcmp(back, in, n), "%s (%zu bytes, %d parts): inflate gave %zd bytes",
           what, n, parts, (ssize_t)got);
    free(z);
    free(back);
    return zn;
}

/* zlib's raw Z_RLE stream of the same data, for the size comparison. */
static size_t zlib_rle_size(const uint8_t *in, size_t n)
{
    z_stream s;
    memset(&s, 0, sizeof s);
    CHECK(deflateInit2(&s, 1, Z_DEFLATED, -15, 8, Z_RLE) == Z_OK);
    size_t cap = deflateBound(&s, (uLong)n);
    uint8_t *z = malloc(cap);
    s.next_in = (uint8_t *)in;
    s.avail_in = (uInt)n;
    s.next_out = z;
    s.avail_out = (uInt)cap;
    CHECK(deflate(&s, Z_FINISH) == Z_STREAM_END);
    size_t len = cap - s.avail_out;
    deflateEnd(&s);
    free(z);
    return len;
}

static void test_small(void)
{
    static const uint8_t a[] = {7, 7, 7, 7, 7, 1, 2, 2, 2, 2, 2, 2, 9};
    for (size_t n = 0; n <= sizeof a; n++)
        for (int parts = 1; parts <= 3 && (size_t)parts <= (n ? n : 1); parts++)
            round_trip("small", a, n, parts);
}

static void test_runs(void)
{
    size_t n = 300000;
    uint8_t *in = malloc(n);
    /* runs of 1..600 bytes (so 258, 259, 516 and longer occur) between literals */
    for (size_t i = 0; i < n;) {
        size_t r = 1 + rng() % 600;
        uint8_t v = (uint8_t)(rng() % 5);
        for (size_t k = 0; k < r && i < n; k++)
            in[i++] = v;
        if (i < n)
            in[i++] = (uint8_t)rng();
    }
    size_t ours = round_trip("runs", in, n, 1);
    round_trip("runs", in, n, 7);
    size_t zl = zlib_rle_size(in, n);
    CHECKF(ours <= zl + zl / 100 + 64, "runs: %zu bytes, zlib Z_RLE %zu", ours, zl);
    memset(in, 42, n); /* one long run */
    round_trip("one run", in, n, 1);
    round_trip("one run", in, n, 4);
    free(in);
}

/* Mostly literals with a skewed histogram, like filtered photo rows: many
 * blocks of 16384 symbols. */
static void test_literals(void)
{
    size_t n = 200000;
    uint8_t *in = malloc(n);
    for (size_t i = 0; i < n; i++) {
        int v = (int)(rng() % 9) - 4 + (int)(rng() % 3 == 0 ? (rng() % 41) - 20 : 0);
        in[i] = (uint8_t)v;
    }
    size_t ours = round_trip("literals", in, n, 1);
    round_trip("literals", in, n, 16);
    size_t zl = zlib_rle_size(in, n);
    CHECKF(ours <= zl + zl / 100 + 64, "literals: %zu bytes, zlib Z_RLE %zu", ours, zl);
    free(in);
}

static void test_noise(void)
{
    size_t n = 200003;
    uint8_t *in = malloc(n);
    for (size_t i = 0; i < n; i++)
        in[i] = (uint8_t)rng();
    size_t ours = round_trip("noise", in, n, 1);
    round_trip("noise", in, n, 3);
    CHECKF(ours <= n + n / 1000 + 64, "noise: %zu bytes for %zu (stored blocks expected)", ours, n);
    free(in);
}

/* Symbol k occurs F(k + 2) times (1, 2, 3, 5, ...; k = 0..18, 17710 bytes,
 * 16384 symbols in the first block), never twice in a row (so no runs):
 * with the end-of-block symbol's 1, the first block's unlimited Huffman code
 * is 16 bits deep, so the 15-bit limit must act. */
static void test_deep_tree(void)
{
    uint32_t left[19] = {1, 2};
    size_t n = 3;
    for (int k = 2; k < 19; k++)
        left[k] = left[k - 1] + left[k - 2], n += left[k];
    uint8_t *in = malloc(n);
    int prev = -1;
    for (size_t i = 0; i < n; i++) { /* the most frequent symbol left, not the previous one */
        int best = -1;
        for (int k = 0; k < 19; k++)
            if (k != prev && left[k] && (best < 0 || left[k] > left[best]))
                best = k;
        CHECK(best >= 0);
        if (best < 0)
            break;
        left[best]--;
        in[i] = (uint8_t)(best * 11);
        prev = best;
    }
    round_trip("deep tree", in, n, 1);
    round_trip("deep tree", in, n, 2);
    free(in);
}

/* 300 random inputs of 0..70000 bytes mixing runs of random lengths,
 * skewed literals and noise, cut into 1..5 calls. */
static void test_random(void)
{
    uint8_t *in = malloc(70000);
    for (int t = 0; t < 300; t++) {
        size_t n = rng() % 70001;
        for (size_t i = 0; i < n;) {
            uint32_t kind = rng() % 3, len = 1 + rng() % (kind == 0 ? 700 : 300);
            uint8_t v = (uint8_t)rng();
            for (uint32_t k = 0; k < len && i < n; k++, i++)
                in[i] = kind == 0 ? v : kind == 1 ? (uint8_t)(v + rng() % 4) : (uint8_t)rng();
        }
        int parts = 1 + (int)(rng() % 5);
        round_trip("random", in, n, n ? parts : 1);
    }
    free(in);
}

int main(void)
{
    RUN(test_small);
    RUN(test_runs);
    RUN(test_literals);
    RUN(test_noise);
    RUN(test_deep_tree);
    RUN(test_random);
    return test_finish();
}
