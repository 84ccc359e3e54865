/* Internals shared by the tokenizer's source files; not a public header.
 *
 *   tokenizer.c          load/free, added-token splitting, encode, chat template
 *   tokenizer_maps.c     vocab (string -> id) and merge ((a, b) -> rank) tables
 *   tokenizer_bpe.c      the rank-ordered BPE merge of one pre-token
 *   tokenizer_split.c    UTF-8 check, the Qwen2 pre-tokenizer split
 *   tokenizer_nfc.c      NFC normalisation
 *   tokenizer_files.c    reading files; vocab.json + merges.txt + tokenizer_config.json
 *   tokenizer_json.c     tokenizer.json
 *   tokenizer_unicode.c  generated character classes
 */
#ifndef KILN_MODELS_TOKENIZER_INTERNAL_H
#define KILN_MODELS_TOKENIZER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "tokenizer.h"

/* Character classes of the pre-tokenizer regex (\p{L}, \p{N}, \s). */
enum { TOK_U_OTHER = 0, TOK_U_LETTER, TOK_U_NUMBER, TOK_U_SPACE };
int kiln_tok_uclass(uint32_t cp);

/* Ids above this are refused at load: they would not fit an embedding table. */
#define TOK_MAX_ID (1 << 24)

typedef struct tok_str_slot {
    uint32_t hash;
    uint32_t len;
    uint32_t off; /* into tok_strmap.arena */
    int32_t id;   /* -1: empty slot */
} tok_str_slot;

typedef struct tok_strmap {
    tok_str_slot *slots;
    size_t mask, count;
    char *arena;
    size_t arena_len, arena_cap;
} tok_strmap;

typedef struct tok_pair_slot {
    uint64_t key; /* (left id << 32) | right id */
    int32_t rank; /* -1: empty slot */
    int32_t id;   /* the merged token */
} tok_pair_slot;

typedef struct tok_pairmap {
    tok_pair_slot *slots;
    size_t mask, count;
} tok_pairmap;

typedef struct tok_added {
    char *text;
    size_t len;
    int32_t id;
} tok_added;

struct kiln_tokenizer {
    tok_strmap vocab;
    tok_pairmap merges;
    int32_t byte_id[256]; /* id of each byte's bytes_to_unicode symbol */
    tok_added *added;
    size_t n_added, cap_added;
    uint8_t added_first[256]; /* 1 when some added token starts with the byte */
    int32_t pad_id;           /* -1: none */
    int32_t id_limit;
};

/* Growable id list. */
typedef struct tok_ids {
    int32_t *v;
    size_t n, cap;
} tok_ids;
kiln_status kiln_tok_ids_push(tok_ids *ids, int32_t id, kiln_err *err);

/* Per-call work buffers, reused across the pieces of one encode call. */
typedef struct tok_scratch {
    int32_t *sym, *prev, *next; /* BPE symbols as a linked list */
    struct tok_heap_item *heap;
    size_t sym_cap, heap_cap;
    uint32_t *cp_off; /* byte offset of each code point of a segment, plus the end */
    uint8_t *cp_cls;  /* its class (TOK_C_*, tokenizer_split.c) */
    size_t cp_cap;
} tok_scratch;
void kiln_tok_scratch_free(tok_scratch *s);

/* Building (load time only). */
kiln_status kiln_tok_vocab_add(kiln_tokenizer *tok, const char *s, size_t len, double id,
                               kiln_err *err);
/* Adds merge `rank`: a + b -> the vocab entry spelled a‖b.  Every symbol must be
 * in the vocabulary (KILN_ERR_FORMAT otherwise).  A repeated pair keeps the
 * later rank, as tokenizers' BPE builder does. */
kiln_status kiln_tok_merge_add(kiln_tokenizer *tok, const char *a, size_t alen, const char *b,
                               size_t blen, int32_t rank, kiln_err *err);
kiln_status kiln_tok_added_add(kiln_tokenizer *tok, const char *s, double id, kiln_err *err);
/* Validates one added-token description (tokenizer.json's added_tokens entry
 * or tokenizer_config.json's added_tokens_decoder value) and adds it. */
kiln_status kiln_tok_added_from_json(kiln_tokenizer *tok, const cJSON *entry, double id,
                                     kiln_err *err);
/* Checks the byte symbols and builds the lookup tables; call after adding. */
kiln_status kiln_tok_finish(kiln_tokenizer *tok, kiln_err *err);

/* Lookups (thread-safe: read only). */
int32_t kiln_tok_vocab_get(const kiln_tokenizer *tok, const char *s, size_t len);
const tok_pair_slot *kiln_tok_merge_get(const kiln_tokenizer *tok, int32_t a, int32_t b);
void kiln_tok_maps_free(kiln_tokenizer *tok);

/* Appends the ids of one pre-token (raw bytes, before the byte-level mapping). */
kiln_status kiln_tok_bpe(const kiln_tokenizer *tok, const uint8_t *bytes, size_t n,
                         tok_scratch *s, tok_ids *out, kiln_err *err);

/* NFC of valid UTF-8 text into a malloc'd buffer (caller frees *out). */
kiln_status kiln_tok_nfc(const uint8_t *text, size_t len, uint8_t **out, size_t *out_len,
                         kiln_err *err);
/* KILN_ERR_INVALID with the byte offset unless text is strict UTF-8. */
kiln_status kiln_tok_utf8_check(const char *text, size_t len, kiln_err *err);
/* NFC-normalises, splits and BPE-encodes one stretch of text between added
 * tokens (already checked to be valid UTF-8). */
kiln_status kiln_tok_encode_segment(const kiln_tokenizer *tok, const char *text, size_t len,
                                    tok_scratch *s, tok_ids *out, kiln_err *err);

/* Loaders.  `config` is the parsed tokenizer_config.json or NULL. */
kiln_status kiln_tok_load_json(kiln_tokenizer *tok, const char *dir, kiln_err *err);
kiln_status kiln_tok_load_vocab_merges(kiln_tokenizer *tok, const char *dir,
                                       const cJSON *config, kiln_err *err);
kiln_status kiln_tok_load_pad(kiln_tokenizer *tok, const cJSON *config, kiln_err *err);
/* Adds every "token": id pair of a vocabulary object. */
kiln_status kiln_tok_vocab_from_json(kiln_tokenizer *tok, const cJSON *vocab, kiln_err *err);
/* Adds merge `rank` written as "left right" (one space). */
kiln_status kiln_tok_merge_from_text(kiln_tokenizer *tok, const char *line, size_t len,
                                     int32_t rank, kiln_err *err);

/* Reads dir/name (at most max bytes) into a malloc'd NUL-terminated buffer,
 * following symbolic links and git's link stand-in files.  Messages name
 * "tokenizer/<name>", never the path.  KILN_ERR_NOT_FOUND when absent. */
kiln_status kiln_tok_read_file(const char *dir, const char *name, size_t max, char **buf,
                               size_t *len, kiln_err *err);
/* 1 when dir/name exists (after following links and stand-ins). */
int kiln_tok_file_exists(const char *dir, const char *name);
/* Parses dir/name as JSON into *out (caller deletes). */
kiln_status kiln_tok_read_json(const char *dir, const char *name, cJSON **out, kiln_err *err);

#endif
