/* The tokenizer's lookup tables: vocabulary (byte-level string -> id), merges
 * ((left id, right id) -> rank and merged id) and added tokens.  Open
 * addressing with linear probing at most half full, so lookups during encoding
 * touch one or two cache lines. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

#define FNV_OFFSET 1469598103934665603ULL
#define FNV_PRIME 1099511628211ULL

static uint64_t fnv_more(uint64_t h, const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        h = (h ^ (uint8_t)s[i]) * FNV_PRIME;
    return h;
}

static uint32_t fold(uint64_t h)
{
    return (uint32_t)(h ^ (h >> 32));
}

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

kiln_status kiln_tok_ids_push(tok_ids *ids, int32_t id, kiln_err *err)
{
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory for %zu ids", cap);
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return KILN_OK;
}

/* ---- vocabulary ---------------------------------------------------------- */

/* Finds the slot of the string a‖b, or the empty slot where it would go. */
static tok_str_slot *str_find(const tok_strmap *m, uint32_t hash, const char *a, size_t alen,
                              const char *b, size_t blen)
{
    for (size_t i = hash & m->mask;; i = (i + 1) & m->mask) {
        tok_str_slot *s = &m->slots[i];
        if (s->id < 0)
            return s;
        if (s->hash == hash && s->len == alen + blen &&
            !memcmp(m->arena + s->off, a, alen) && !memcmp(m->arena + s->off + alen, b, blen))
            return s;
    }
}

static kiln_status str_grow(tok_strmap *m, kiln_err *err)
{
    size_t n = m->slots ? (m->mask + 1) * 2 : 1024;
    tok_str_slot *slots = malloc(n * sizeof *slots);
    if (!slots)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory for the vocabulary");
    for (size_t i = 0; i < n; i++)
        slots[i].id = -1;
    for (size_t i = 0; m->slots && i <= m->mask; i++) {
        if (m->slots[i].id < 0)
            continue;
        size_t j = m->slots[i].hash & (n - 1);
        while (slots[j].id >= 0)
            j = (j + 1) & (n - 1);
        slots[j] = m->slots[i];
    }
    free(m->slots);
    m->slots = slots;
    m->mask = n - 1;
    return KILN_OK;
}

static kiln_status check_id(double id, const char *what, kiln_err *err)
{
    if (!(id >= 0 && id < TOK_MAX_ID) || id != floor(id))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s has id %g, not an integer in [0, %d)",
                            what, id, TOK_MAX_ID);
    return KILN_OK;
}

kiln_status kiln_tok_vocab_add(kiln_tokenizer *tok, const char *s, size_t len, double id,
                               kiln_err *err)
{
    tok_strmap *m = &tok->vocab;
    kiln_status st = check_id(id, "a vocabulary entry", err);
    if (st)
        return st;
    if (len == 0 || len > UINT32_MAX / 2)
        return kiln_err_set(err, KILN_ERR_FORMAT, "vocabulary entry %g has an empty or huge name",
                            id);
    if ((m->count + 1) * 2 > (m->slots ? m->mask + 1 : 0) && (st = str_grow(m, err)))
        return st;
    uint32_t hash = fold(fnv_more(FNV_OFFSET, s, len));
    tok_str_slot *slot = str_find(m, hash, s, len, "", 0);
    if (slot->id >= 0)
        return kiln_err_set(err, KILN_ERR_FORMAT, "vocabulary entry '%.*s' appears twice",
                            (int)(len > 64 ? 64 : len), s);
    if (m->arena_len + len > m->arena_cap) {
        size_t cap = m->arena_cap ? m->arena_cap : 1 << 20;
        while (cap < m->arena_len + len)
            cap *= 2;
        if (cap > UINT32_MAX)
            return kiln_err_set(err, KILN_ERR_FORMAT, "vocabulary over 4 GiB");
        char *arena = realloc(m->arena, cap);
        if (!arena)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory for the vocabulary");
        m->arena = arena;
        m->arena_cap = cap;
    }
    memcpy(m->arena + m->arena_len, s, len);
    *slot = (tok_str_slot){.hash = hash, .len = (uint32_t)len, .off = (uint32_t)m->arena_len,
                           .id = (int32_t)id};
    m->arena_len += len;
    m->count++;
    if ((int32_t)id >= tok->id_limit)
        tok->id_limit = (int32_t)id + 1;
    return KILN_OK;
}

static int32_t vocab_get2(const kiln_tokenizer *tok, const char *a, size_t alen, const char *b,
                          size_t blen)
{
    const tok_strmap *m = &tok->vocab;
    if (!m->slots)
        return -1;
    uint32_t hash = fold(fnv_more(fnv_more(FNV_OFFSET, a, alen), b, blen));
    return str_find(m, hash, a, alen, b, blen)->id;
}

int32_t kiln_tok_vocab_get(const kiln_tokenizer *tok, const char *s, size_t len)
{
    return vocab_get2(tok, s, len, "", 0);
}

/* ---- merges -------------------------------------------------------------- */

static tok_pair_slot *pair_find(const tok_pairmap *m, uint64_t key)
{
    for (size_t i = mix64(key) & m->mask;; i = (i + 1) & m->mask) {
        tok_pair_slot *s = &m->slots[i];
        if (s->rank < 0 || s->key == key)
            return s;
    }
}

static kiln_status pair_grow(tok_pairmap *m, kiln_err *err)
{
    size_t n = m->slots ? (m->mask + 1) * 2 : 1024;
    tok_pair_slot *slots = malloc(n * sizeof *slots);
    if (!slots)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory for the merges");
    for (size_t i = 0; i < n; i++)
        slots[i].rank = -1;
    tok_pairmap grown = {.slots = slots, .mask = n - 1, .count = m->count};
    for (size_t i = 0; m->slots && i <= m->mask; i++)
        if (m->slots[i].rank >= 0)
            *pair_find(&grown, m->slots[i].key) = m->slots[i];
    free(m->slots);
    *m = grown;
    return KILN_OK;
}

kiln_status kiln_tok_merge_add(kiln_tokenizer *tok, const char *a, size_t alen, const char *b,
                               size_t blen, int32_t rank, kiln_err *err)
{
    int32_t left = vocab_get2(tok, a, alen, "", 0);
    int32_t right = vocab_get2(tok, b, blen, "", 0);
    int32_t merged = vocab_get2(tok, a, alen, b, blen);
    if (left < 0 || right < 0 || merged < 0)
        return kiln_err_set(err, KILN_ERR_FORMAT, "merge '%.*s %.*s': %s is not in the vocabulary",
                            (int)(alen > 64 ? 64 : alen), a, (int)(blen > 64 ? 64 : blen), b,
                            left < 0 ? "the left symbol" : right < 0 ? "the right symbol"
                                                                     : "the merged symbol");
    tok_pairmap *m = &tok->merges;
    kiln_status st;
    if ((m->count + 1) * 2 > (m->slots ? m->mask + 1 : 0) && (st = pair_grow(m, err)))
        return st;
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    tok_pair_slot *slot = pair_find(m, key);
    if (slot->rank < 0)
        m->count++;
    *slot = (tok_pair_slot){.key = key, .rank = rank, .id = merged};
    return KILN_OK;
}

const tok_pair_slot *kiln_tok_merge_get(const kiln_tokenizer *tok, int32_t a, int32_t b)
{
    const tok_pairmap *m = &tok->merges;
    if (!m->slots)
        return NULL;
    const tok_pair_slot *s = pair_find(m, (uint64_t)(uint32_t)a << 32 | (uint32_t)b);
    return s->rank < 0 ? NULL : s;
}

/* ---- added tokens -------------------------------------------------------- */

kiln_status kiln_tok_added_add(kiln_tokenizer *tok, const char *s, double id, kiln_err *err)
{
    size_t len = strlen(s);
    kiln_status st = check_id(id, "an added token", err);
    if (st)
        return st;
    if (len == 0)
        return kiln_err_set(err, KILN_ERR_FORMAT, "added token %g is empty", id);
    if ((st = kiln_tok_utf8_check(s, len, err)))
        return err ? kiln_err_wrap(err, "added token %g", id) : st;
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].len == len && !memcmp(tok->added[i].text, s, len))
            return kiln_err_set(err, KILN_ERR_FORMAT, "added token '%.64s' appears twice", s);
    if (tok->n_added == tok->cap_added) {
        size_t cap = tok->cap_added ? tok->cap_added * 2 : 32;
        tok_added *v = realloc(tok->added, cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
        tok->added = v;
        tok->cap_added = cap;
    }
    char *copy = malloc(len + 1);
    if (!copy)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
    memcpy(copy, s, len + 1);
    tok->added[tok->n_added++] = (tok_added){.text = copy, .len = len, .id = (int32_t)id};
    if ((int32_t)id >= tok->id_limit)
        tok->id_limit = (int32_t)id + 1;
    return KILN_OK;
}

/* The stripping and word-boundary options change how tokenizers matches an
 * added token, and `normalized` tokens are matched in NFC text; Qwen's tokens
 * use none of them, so rather than half-support them we refuse them. */
kiln_status kiln_tok_added_from_json(kiln_tokenizer *tok, const cJSON *entry, double id,
                                     kiln_err *err)
{
    if (!cJSON_IsObject(entry))
        return kiln_err_set(err, KILN_ERR_FORMAT, "added token %g is not an object", id);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(entry, "content");
    if (!cJSON_IsString(content))
        return kiln_err_set(err, KILN_ERR_FORMAT, "added token %g has no string 'content'", id);
    static const char *const flags[] = {"lstrip", "rstrip", "single_word", "normalized"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(entry, flags[i]);
        if (f && !cJSON_IsBool(f) && !cJSON_IsNull(f))
            return kiln_err_set(err, KILN_ERR_FORMAT, "added token '%.64s': '%s' is not a boolean",
                                content->valuestring, flags[i]);
        if (cJSON_IsTrue(f))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                                "added token '%.64s' sets '%s', which kiln does not support",
                                content->valuestring, flags[i]);
    }
    return kiln_tok_added_add(tok, content->valuestring, id, err);
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
 * other 68 bytes map in order to U+0100.. so every byte has a visible symbol. */
static uint32_t byte_symbol(int b, int *next_extra)
{
    if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))
        return (uint32_t)b;
    return 256 + (uint32_t)(*next_extra)++;
}

kiln_status kiln_tok_finish(kiln_tokenizer *tok, kiln_err *err)
{
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_symbol(b, &extra);
        char s[2];
        size_t n = 1;
        if (cp < 0x80) {
            s[0] = (char)cp;
        } else {
            s[0] = (char)(0xC0 | (cp >> 6));
            s[1] = (char)(0x80 | (cp & 0x3F));
            n = 2;
        }
        tok->byte_id[b] = kiln_tok_vocab_get(tok, s, n);
        if (tok->byte_id[b] < 0)
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "the vocabulary lacks the byte-level symbol U+%04X of byte 0x%02X",
                                (unsigned)cp, (unsigned)b);
    }
    memset(tok->added_first, 0, sizeof tok->added_first);
    for (size_t i = 0; i < tok->n_added; i++)
        tok->added_first[(uint8_t)tok->added[i].text[0]] = 1;
    return KILN_OK;
}

void kiln_tok_maps_free(kiln_tokenizer *tok)
{
    free(tok->vocab.slots);
    free(tok->vocab.arena);
    free(tok->merges.slots);
    for (size_t i = 0; i < tok->n_added; i++)
        free(tok->added[i].text);
    free(tok->added);
}
