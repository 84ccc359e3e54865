/* A deflate encoder (RFC 1951) for filtered PNG rows that looks for runs
 * only, as zlib's Z_RLE does: at each position, a match at distance 1 of 3
 * to 258 bytes, else a literal.  Blocks of 16384 symbols (zlib's at its
 * default memLevel) each get their own Huffman codes, or are stored when
 * that is smaller (noise-like images).  It exists because zlib 1.2.13's
 * deflate_rle, a byte-at-a-time loop with per-symbol bookkeeping, was about
 * two thirds of the striped encoder's CPU (perf), and neither zlib-ng nor a
 * joinable libdeflate stream is available on Debian 12: here a run is found
 * 8 bytes at a time and the symbols are coded from tables in one pass.  The
 * parse equals zlib's Z_RLE, so files are within a few bytes of zlib's.
 * docs/PERFORMANCE.md (PNG encoder options) has the measurements. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "image_impl.h"

#define BLOCK_SYMS 16384
#define MAX_BITS 15
#define MAX_CL_BITS 7

/* ---- bits, least significant first ---- */

typedef struct bits {
    uint8_t *p;
    uint64_t acc;
    int n;
} bits;

static inline void put(bits *w, uint32_t v, int n)
{
    w->acc |= (uint64_t)v << w->n;
    w->n += n;
    if (w->n >= 32) {
        w->p[0] = (uint8_t)w->acc, w->p[1] = (uint8_t)(w->acc >> 8);
        w->p[2] = (uint8_t)(w->acc >> 16), w->p[3] = (uint8_t)(w->acc >> 24);
        w->p += 4;
        w->acc >>= 32;
        w->n -= 32;
    }
}

/* Pads with zero bits to a byte boundary and writes out what is pending. */
static void align(bits *w)
{
    while (w->n > 0) {
        *w->p++ = (uint8_t)w->acc;
        w->acc >>= 8;
        w->n -= 8;
    }
    w->n = 0;
    w->acc = 0;
}

/* ---- Huffman codes ---- */

typedef struct sym_freq {
    uint32_t f;
    uint16_t s;
} sym_freq;

/* Sorts by frequency: an LSD radix sort on the frequency bytes that differ,
 * stable (ties keep the input order, so the result is fully determined),
 * and cheaper than qsort's callbacks for a block's ~286 symbols. */
static void sort_syms(sym_freq *a, int m)
{
    sym_freq tmp[288];
    uint32_t all_or = 0, all_and = ~0u;
    for (int i = 0; i < m; i++)
        all_or |= a[i].f, all_and &= a[i].f;
    for (int shift = 0; shift < 32; shift += 8) {
        if (!(((all_or ^ all_and) >> shift) & 0xff))
            continue; /* every key has the same byte here */
        int count[257] = {0};
        for (int i = 0; i < m; i++)
            count[((a[i].f >> shift) & 0xff) + 1]++;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (int i = 0; i < m; i++)
            tmp[count[(a[i].f >> shift) & 0xff]++] = a[i];
        memcpy(a, tmp, sizeof a[0] * (size_t)m);
    }
}

/* Code lengths of at most max_bits for freq[0..n) (n <= 288): a Huffman
 * tree, lengths over max_bits clamped, then the Kraft sum repaired (longer
 * codes for the rarest of the longest symbols until it fits, shorter ones
 * for the longest until the code is complete, as inflate requires).  At
 * least two symbols get a length, as zlib's trees.c makes sure. */
static void build_lengths(uint32_t *freq, int n, int max_bits, uint8_t *len)
{
    sym_freq leaf[288];
    int m = 0;
    memset(len, 0, (size_t)n);
    for (int i = 0; i < n; i++)
        if (freq[i])
            leaf[m++] = (sym_freq){freq[i], (uint16_t)i};
    for (int i = 0; m < 2 && i < n; i++) /* pad to two symbols */
        if (!freq[i])
            freq[i] = 1, leaf[m++] = (sym_freq){1, (uint16_t)i};
    sort_syms(leaf, m);
    /* Two queues: the sorted leaves, and the internal nodes in the order made
     * (their weights never decrease).  Nodes 0..m-1 are leaves. */
    uint64_t w[576];
    int parent[576], depth[576];
    for (int i = 0; i < m; i++)
        w[i] = leaf[i].f;
    int next_leaf = 0, next_int = m, made = m;
    for (int k = 0; k < m - 1; k++) {
        int pick[2];
        for (int j = 0; j < 2; j++) {
            if (next_leaf < m && (next_int >= made || w[next_leaf] <= w[next_int]))
                pick[j] = next_leaf++;
            else
                pick[j] = next_int++;
        }
        w[made] = w[pick[0]] + w[pick[1]];
        parent[pick[0]] = parent[pick[1]] = made;
        made++;
    }
    depth[made - 1] = 0;
    for (int i = made - 2; i >= 0; i--)
        depth[i] = depth[parent[i]] + 1;
    long kraft = 0, full = 1L << max_bits;
    for (int i = 0; i < m; i++) {
        int d = depth[i] > max_bits ? max_bits : depth[i];
        len[leaf[i].s] = (uint8_t)d;
        kraft += 1L << (max_bits - d);
    }
    while (kraft > full) { /* lengthen the rarest symbol of the longest length < max */
        int best = -1;
        for (int i = 0; i < m; i++) {
            int l = len[leaf[i].s];
            if (l < max_bits && (best < 0 || l > len[leaf[best].s]))
                best = i; /* leaves ascend by frequency: the first is the rarest */
        }
        kraft -= 1L << (max_bits - len[leaf[best].s] - 1);
        len[leaf[best].s]++;
    }
    while (kraft < full) { /* shorten the most frequent symbol of the longest length that fits */
        int best = -1;
        for (int i = m - 1; i >= 0; i--) {
            int l = len[leaf[i].s];
            if (l > 1 && (1L << (max_bits - l)) <= full - kraft &&
                (best < 0 || l > len[leaf[best].s]))
                best = i;
        }
        kraft += 1L << (max_bits - len[leaf[best].s]);
        len[leaf[best].s]--;
    }
}

/* Canonical codes (RFC 1951 3.2.2), bit-reversed for LSB-first output. */
static void make_codes(const uint8_t *len, int n, uint16_t *code)
{
    int count[MAX_BITS + 1] = {0}, next[MAX_BITS + 1] = {0};
    for (int i = 0; i < n; i++)
        count[len[i]]++;
    count[0] = 0;
    for (int b = 1, c = 0; b <= MAX_BITS; b++) {
        c = (c + count[b - 1]) << 1;
        next[b] = c;
    }
    for (int i = 0; i < n; i++) {
        int l = len[i];
        if (!l)
            continue;
        unsigned v = (unsigned)next[l]++, r = 0;
        for (int k = 0; k < l; k++)
            r = r << 1 | ((v >> k) & 1);
        code[i] = (uint16_t)r;
    }
}

/* ---- symbols ---- */

/* Length codes 257..285: base lengths and extra bits (RFC 1951 3.2.5). */
static const uint16_t len_base[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                      31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
static const uint8_t len_extra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                      2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
/* The order in which the code-length code's lengths are sent. */
static const uint8_t cl_order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15};

/* Length - 3 -> length code - 257; 258 takes code 285, as zlib sends it. */
static void length_codes(uint8_t t[256])
{
    for (int c = 0; c < 28; c++)
        for (int l = len_base[c]; l < len_base[c] + (1 << len_extra[c]) && l <= 257; l++)
            t[l - 3] = (uint8_t)c;
    t[255] = 28;
}

/* How many of p[0..max) equal b. */
static inline size_t run_length(const uint8_t *p, uint8_t b, size_t max)
{
    size_t j = 0;
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t pat = 0x0101010101010101ull * b;
    while (j + 8 <= max) {
        uint64_t x;
        memcpy(&x, p + j, 8);
        x ^= pat;
        if (x)
            return j + (size_t)(__builtin_ctzll(x) >> 3);
        j += 8;
    }
#endif
    while (j < max && p[j] == b)
        j++;
    return j;
}

/* ---- blocks ---- */

typedef struct block {
    const uint16_t *sym; /* < 256: a literal; 0x100 | (length - 3): a run */
    int n_sym, n_runs;
    uint32_t lf[286];   /* literal/length frequencies (256 included) */
    const uint8_t *raw; /* the bytes the block covers */
    size_t raw_n;
} block;

static void put_stored(bits *w, const uint8_t *raw, size_t n, int final)
{
    do {
        size_t k = n < 65535 ? n : 65535;
        put(w, final && k == n, 1);
        put(w, 0, 2);
        align(w);
        uint8_t h[4] = {(uint8_t)k, (uint8_t)(k >> 8), (uint8_t)~k, (uint8_t)(~k >> 8)};
        memcpy(w->p, h, 4);
        memcpy(w->p + 4, raw, k);
        w->p += 4 + k;
        raw += k;
        n -= k;
    } while (n);
}

/* Writes the block with its own Huffman codes, or stored if that is smaller. */
static void put_block(bits *w, block *b, const uint8_t *lcode, int final)
{
    uint8_t ll[286], dl[2], cll[19];
    uint16_t lc[286], dc[2], clc[19];
    uint32_t df[2] = {(uint32_t)b->n_runs, 0}; /* only distance 1 (code 0) occurs */
    b->lf[256] = 1;
    build_lengths(b->lf, 286, MAX_BITS, ll);
    build_lengths(df, 2, MAX_BITS, dl);
    int hlit = 286;
    while (hlit > 257 && !ll[hlit - 1])
        hlit--;
    /* The code lengths, run-length coded with 16 (repeat the previous 3-6
     * times), 17 (3-10 zeros) and 18 (11-138 zeros). */
    uint8_t lens[288], cl_sym[288], cl_extra[288];
    int n_lens = 0, n_cl = 0;
    memcpy(lens, ll, (size_t)hlit);
    memcpy(lens + hlit, dl, 2);
    n_lens = hlit + 2;
    uint32_t clf[19] = {0};
    for (int i = 0; i < n_lens;) {
        int l = lens[i], run = 1;
        while (i + run < n_lens && lens[i + run] == l)
            run++;
        i += run;
        if (l == 0) {
            while (run >= 11) {
                int r = run < 138 ? run : 138;
                cl_sym[n_cl] = 18, cl_extra[n_cl++] = (uint8_t)(r - 11);
                run -= r;
            }
            if (run >= 3) {
                cl_sym[n_cl] = 17, cl_extra[n_cl++] = (uint8_t)(run - 3);
                run = 0;
            }
        } else {
            cl_sym[n_cl] = (uint8_t)l, cl_extra[n_cl++] = 0;
            run--;
            while (run >= 3) {
                int r = run < 6 ? run : 6;
                cl_sym[n_cl] = 16, cl_extra[n_cl++] = (uint8_t)(r - 3);
                run -= r;
            }
        }
        while (run-- > 0)
            cl_sym[n_cl] = (uint8_t)l, cl_extra[n_cl++] = 0;
    }
    for (int i = 0; i < n_cl; i++)
        clf[cl_sym[i]]++;
    build_lengths(clf, 19, MAX_CL_BITS, cll);
    int hclen = 19;
    while (hclen > 4 && !cll[cl_order[hclen - 1]])
        hclen--;

    /* Sizes in bits: the dynamic block against stored pieces (each at most
     * 3 header bits, 7 of padding, LEN and NLEN). */
    uint64_t dyn = 3 + 14 + 3 * (uint64_t)hclen;
    for (int i = 0; i < n_cl; i++)
        dyn += cll[cl_sym[i]] + (cl_sym[i] == 16 ? 2 : cl_sym[i] == 17 ? 3 : cl_sym[i] == 18 ? 7 : 0);
    for (int s = 0; s < 286; s++)
        dyn += (uint64_t)b->lf[s] * ll[s];
    for (int c = 0; c < 29; c++)
        dyn += (uint64_t)b->lf[257 + c] * len_extra[c];
    dyn += (uint64_t)b->n_runs * dl[0];
    uint64_t stored = (b->raw_n / 65535 + 1) * 42 + 8 * (uint64_t)b->raw_n;
    if (stored < dyn) {
        put_stored(w, b->raw, b->raw_n, final);
        return;
    }

    make_codes(ll, 286, lc);
    make_codes(dl, 2, dc);
    make_codes(cll, 19, clc);
    put(w, (uint32_t)final, 1);
    put(w, 2, 2); /* dynamic Huffman codes */
    put(w, (uint32_t)(hlit - 257), 5);
    put(w, 2 - 1, 5);
    put(w, (uint32_t)(hclen - 4), 4);
    for (int k = 0; k < hclen; k++)
        put(w, cll[cl_order[k]], 3);
    for (int i = 0; i < n_cl; i++) {
        int s = cl_sym[i];
        put(w, clc[s], cll[s]);
        if (s >= 16)
            put(w, cl_extra[i], s == 16 ? 2 : s == 17 ? 3 : 7);
    }
    for (int i = 0; i < b->n_sym; i++) {
        unsigned t = b->sym[i];
        if (t < 256) {
            put(w, lc[t], ll[t]);
        } else {
            unsigned l3 = t & 0xff, c = lcode[l3];
            put(w, (uint32_t)lc[257 + c] | (uint32_t)(l3 + 3 - len_base[c]) << ll[257 + c],
                ll[257 + c] + len_extra[c]);
            put(w, dc[0], dl[0]);
        }
    }
    put(w, lc[256], ll[256]);
}

size_t kiln_image_png_deflate_bound(size_t n)
{
    return n + 6 * (n / 65535 + n / BLOCK_SYMS + 2) + 16;
}

size_t kiln_image_png_deflate_rle(const uint8_t *in, size_t n, int last, uint8_t *out)
{
    uint8_t lcode[256];
    uint16_t sym[BLOCK_SYMS];
    length_codes(lcode);
    bits w = {out, 0, 0};
    size_t i = 0;
    do {
        block b = {.sym = sym, .raw = in + i};
        size_t start = i;
        while (i < n && b.n_sym < BLOCK_SYMS) {
            size_t r = 0;
            if (i > 0 && in[i] == in[i - 1])
                r = run_length(in + i, in[i - 1], n - i < 258 ? n - i : 258);
            if (r >= 3) {
                sym[b.n_sym++] = (uint16_t)(0x100 | (r - 3));
                b.lf[257 + lcode[r - 3]]++;
                b.n_runs++;
                i += r;
            } else {
                sym[b.n_sym++] = in[i];
                b.lf[in[i]]++;
                i++;
            }
        }
        b.raw_n = i - start;
        put_block(&w, &b, lcode, last && i == n);
    } while (i < n);
    if (!last) { /* a sync flush: an empty stored block ends the stream on a byte */
        put(&w, 0, 3);
        align(&w);
        memcpy(w.p, "\0\0\xff\xff", 4);
        w.p += 4;
    } else {
        align(&w);
    }
    return (size_t)(w.p - out);
}
