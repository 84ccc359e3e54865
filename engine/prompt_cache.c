#include "prompt_cache.h"

#include <stdlib.h>
#include <string.h>

typedef struct entry {
    struct entry *prev, *next; /* LRU list: head is the most recently used */
    struct entry *chain;       /* next entry of the same bucket */
    uint64_t hash;
    size_t len, value_len, cost;
    void *value;
    int max_seq;
    char key[]; /* the prompt's bytes */
} entry;

/* The admission filter ("doorkeeper"): hashes of recently missed keys in
 * SEEN_SETS sets of SEEN_WAYS, each set ordered by last miss, so it
 * remembers roughly the last SEEN_SETS * SEEN_WAYS distinct keys missed in
 * a constant 40 KiB, however many prompts a service sees.  Only 64-bit
 * hashes are kept: keys sharing one (or hashing to 0 and 1, merged below)
 * let a key in on its first miss, which costs an unneeded copy and never a
 * wrong value, since the cache itself compares whole keys. */
enum { SEEN_SET_BITS = 10, SEEN_SETS = 1 << SEEN_SET_BITS, SEEN_WAYS = 4 };

typedef struct seen_set {
    uint64_t hash[SEEN_WAYS]; /* 0: empty way */
    uint8_t again[SEEN_WAYS]; /* missed again since it was recorded: admitted */
} seen_set;

struct kiln_prompt_cache {
    entry **buckets;
    size_t n_buckets; /* a power of two */
    entry *head, *tail;
    kiln_prompt_cache_stats stats;
    seen_set seen[SEEN_SETS];
};

enum { INITIAL_BUCKETS = 64 };

/* 64-bit FNV-1a over the prompt, then the four bytes of max_seq: one pass,
 * no tables, and good enough spread for a table whose chains are checked
 * with a full key comparison anyway. */
static uint64_t key_hash(const char *prompt, size_t len, int max_seq)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)prompt[i]) * 0x100000001b3ull;
    uint32_t m = (uint32_t)max_seq;
    for (int i = 0; i < 4; i++, m >>= 8)
        h = (h ^ (m & 0xffu)) * 0x100000001b3ull;
    return h;
}

kiln_prompt_cache *kiln_prompt_cache_create(size_t max_bytes, kiln_err *err)
{
    kiln_prompt_cache *c = calloc(1, sizeof *c);
    entry **b = calloc(INITIAL_BUCKETS, sizeof *b);
    if (!c || !b) {
        free(c), free(b);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->buckets = b;
    c->n_buckets = INITIAL_BUCKETS;
    c->stats.max_bytes = max_bytes;
    return c;
}

void kiln_prompt_cache_destroy(kiln_prompt_cache *c)
{
    if (!c)
        return;
    for (entry *e = c->head, *next; e; e = next) {
        next = e->next;
        free(e->value);
        free(e);
    }
    free(c->buckets);
    free(c);
}

/* 0 marks an empty way, so a hash of 0 is taken as 1. */
static uint64_t seen_tag(uint64_t h) { return h ? h : 1; }

/* FNV-1a's low bits depend only on the low bits of the input bytes, its
 * top bits on all of them, so sets are picked by the top bits. */
static size_t seen_index(uint64_t tag) { return (size_t)(tag >> (64 - SEEN_SET_BITS)); }

/* Records a miss of the key hashing to h as its set's latest, dropping the
 * set's oldest when the key is new to it; returns 1 when it was there. */
static int seen_record(kiln_prompt_cache *c, uint64_t h)
{
    uint64_t t = seen_tag(h);
    seen_set *s = &c->seen[seen_index(t)];
    int i = 0;
    while (i < SEEN_WAYS - 1 && s->hash[i] != t)
        i++;
    int found = s->hash[i] == t;
    for (; i > 0; i--) {
        s->hash[i] = s->hash[i - 1];
        s->again[i] = s->again[i - 1];
    }
    s->hash[0] = t;
    s->again[0] = (uint8_t)found;
    return found;
}

static int seen_admitted(const kiln_prompt_cache *c, uint64_t h)
{
    uint64_t t = seen_tag(h);
    const seen_set *s = &c->seen[seen_index(t)];
    for (int i = 0; i < SEEN_WAYS; i++)
        if (s->hash[i] == t)
            return s->again[i];
    return 0;
}

static entry **find_slot(kiln_prompt_cache *c, uint64_t h, const char *prompt, size_t len,
                         int max_seq)
{
    entry **p = &c->buckets[h & (c->n_buckets - 1)];
    for (; *p; p = &(*p)->chain) {
        const entry *e = *p;
        if (e->hash == h && e->max_seq == max_seq && e->len == len && !memcmp(e->key, prompt, len))
            break;
    }
    return p;
}

static void lru_unlink(kiln_prompt_cache *c, entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        c->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        c->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_front(kiln_prompt_cache *c, entry *e)
{
    e->prev = NULL;
    e->next = c->head;
    if (c->head)
        c->head->prev = e;
    c->head = e;
    if (!c->tail)
        c->tail = e;
}

/* Unlinks e from its bucket and the LRU list and frees it. */
static void remove_entry(kiln_prompt_cache *c, entry *e)
{
    entry **p = find_slot(c, e->hash, e->key, e->len, e->max_seq);
    *p = e->chain;
    lru_unlink(c, e);
    c->stats.entries--;
    c->stats.bytes -= e->cost;
    free(e->value);
    free(e);
}

/* Doubles the bucket array once entries outnumber buckets.  When that
 * allocation fails the table keeps working with longer chains. */
static void maybe_grow(kiln_prompt_cache *c)
{
    if (c->stats.entries <= c->n_buckets || c->n_buckets > SIZE_MAX / 2 / sizeof(entry *))
        return;
    size_t n = c->n_buckets * 2;
    entry **b = calloc(n, sizeof *b);
    if (!b)
        return;
    for (entry *e = c->head; e; e = e->next) {
        entry **slot = &b[e->hash & (n - 1)];
        e->chain = *slot;
        *slot = e;
    }
    free(c->buckets);
    c->buckets = b;
    c->n_buckets = n;
}

const void *kiln_prompt_cache_get(kiln_prompt_cache *c, const char *prompt, size_t len,
                                  int max_seq, size_t *value_len)
{
    uint64_t h = key_hash(prompt, len, max_seq);
    entry *e = *find_slot(c, h, prompt, len, max_seq);
    if (!e) {
        c->stats.misses++;
        /* A cache that stores nothing has nothing to admit. */
        if (c->stats.max_bytes && !seen_record(c, h))
            c->stats.deferred++;
        return NULL;
    }
    c->stats.hits++;
    lru_unlink(c, e);
    lru_push_front(c, e);
    *value_len = e->value_len;
    return e->value;
}

int kiln_prompt_cache_accepts(const kiln_prompt_cache *c, const char *prompt, size_t len,
                              int max_seq, size_t value_len)
{
    size_t fixed = sizeof(entry);
    return len <= c->stats.max_bytes && value_len <= c->stats.max_bytes - len &&
           fixed <= c->stats.max_bytes - len - value_len &&
           seen_admitted(c, key_hash(prompt, len, max_seq));
}

kiln_status kiln_prompt_cache_put(kiln_prompt_cache *c, const char *prompt, size_t len,
                                  int max_seq, void *value, size_t value_len, kiln_err *err)
{
    if (!kiln_prompt_cache_accepts(c, prompt, len, max_seq, value_len)) {
        free(value);
        c->stats.rejected++;
        return KILN_OK;
    }
    entry *e = malloc(sizeof *e + len);
    if (!e) {
        free(value);
        c->stats.rejected++;
        return kiln_err_set(err, KILN_ERR_NOMEM, "prompt cache: out of memory");
    }
    uint64_t h = key_hash(prompt, len, max_seq);
    entry *old = *find_slot(c, h, prompt, len, max_seq);
    if (old)
        remove_entry(c, old);
    size_t cost = sizeof *e + len + value_len; /* no overflow: accepted */
    while (c->tail && c->stats.bytes > c->stats.max_bytes - cost) {
        remove_entry(c, c->tail);
        c->stats.evictions++;
    }
    *e = (entry){.hash = h, .len = len, .value_len = value_len, .cost = cost, .value = value,
                 .max_seq = max_seq};
    memcpy(e->key, prompt, len);
    entry **slot = &c->buckets[h & (c->n_buckets - 1)];
    e->chain = *slot;
    *slot = e;
    lru_push_front(c, e);
    c->stats.entries++;
    c->stats.bytes += cost;
    maybe_grow(c);
    return KILN_OK;
}

void kiln_prompt_cache_get_stats(const kiln_prompt_cache *c, kiln_prompt_cache_stats *out)
{
    *out = c->stats;
}
