/* Byte-level BPE of one pre-token.
 *
 * The order of merges is the one tokenizers' BPE model uses (models/bpe/word.rs,
 * merge_all): always apply the applicable merge of lowest rank, the leftmost
 * one among equal ranks, with a min-heap of candidate pairs whose stale entries
 * are skipped when popped.  That is O(n log n), so a 30 kB run of CJK letters
 * (one pre-token) costs milliseconds, where rescanning all pairs per merge
 * would take seconds. */
#include <stdlib.h>

#include "tokenizer_internal.h"

struct tok_heap_item {
    int32_t rank, pos, id;
};

static int item_before(const struct tok_heap_item *a, const struct tok_heap_item *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(struct tok_heap_item *h, size_t *n, struct tok_heap_item it)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!item_before(&it, &h[parent]))
            break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = it;
}

static struct tok_heap_item heap_pop(struct tok_heap_item *h, size_t *n)
{
    struct tok_heap_item top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && item_before(&h[c + 1], &h[c]))
            c++;
        if (!item_before(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void push_pair(const kiln_tokenizer *tok, const tok_scratch *s, size_t *hn, int32_t pos)
{
    const tok_pair_slot *m = kiln_tok_merge_get(tok, s->sym[pos], s->sym[s->next[pos]]);
    if (m)
        heap_push(s->heap, hn, (struct tok_heap_item){m->rank, pos, m->id});
}

static kiln_status reserve(tok_scratch *s, size_t n, kiln_err *err)
{
    if (n > INT32_MAX / 4)
        return kiln_err_set(err, KILN_ERR_TOO_LARGE, "a single word of %zu bytes is too long", n);
    if (n > s->sym_cap) {
        size_t cap = n < 256 ? 256 : n;
        int32_t *sym = realloc(s->sym, cap * sizeof *sym);
        if (sym)
            s->sym = sym;
        int32_t *prev = realloc(s->prev, cap * sizeof *prev);
        if (prev)
            s->prev = prev;
        int32_t *next = realloc(s->next, cap * sizeof *next);
        if (next)
            s->next = next;
        if (!sym || !prev || !next)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
        s->sym_cap = cap;
    }
    /* n - 1 initial pairs, then at most two new ones per merge. */
    if (3 * n > s->heap_cap) {
        struct tok_heap_item *heap = realloc(s->heap, 3 * n * sizeof *heap);
        if (!heap)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
        s->heap = heap;
        s->heap_cap = 3 * n;
    }
    return KILN_OK;
}

kiln_status kiln_tok_bpe(const kiln_tokenizer *tok, const uint8_t *bytes, size_t n,
                         tok_scratch *s, tok_ids *out, kiln_err *err)
{
    if (n == 1)
        return kiln_tok_ids_push(out, tok->byte_id[bytes[0]], err);
    kiln_status st = reserve(s, n, err);
    if (st)
        return st;
    for (size_t i = 0; i < n; i++) {
        s->sym[i] = tok->byte_id[bytes[i]];
        s->prev[i] = (int32_t)i - 1;
        s->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++)
        push_pair(tok, s, &hn, (int32_t)i);
    while (hn) {
        struct tok_heap_item top = heap_pop(s->heap, &hn);
        int32_t pos = top.pos, right = s->next[pos];
        if (s->sym[pos] < 0 || right < 0)
            continue; /* merged away, or now the last symbol */
        const tok_pair_slot *m = kiln_tok_merge_get(tok, s->sym[pos], s->sym[right]);
        if (!m || m->id != top.id)
            continue; /* a neighbour changed since this pair was queued */
        s->sym[pos] = top.id;
        s->sym[right] = -1;
        s->next[pos] = s->next[right];
        if (s->next[pos] >= 0)
            s->prev[s->next[pos]] = pos;
        if (s->prev[pos] >= 0)
            push_pair(tok, s, &hn, s->prev[pos]);
        if (s->next[pos] >= 0)
            push_pair(tok, s, &hn, pos);
    }
    /* Symbol 0 is never merged away: merges only remove the right symbol. */
    for (int32_t i = 0; i >= 0; i = s->next[i])
        if ((st = kiln_tok_ids_push(out, s->sym[i], err)))
            return st;
    return KILN_OK;
}
