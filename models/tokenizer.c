/* Tokenizer entry points: loading, added-token splitting, encoding and the
 * pipelines' chat templates. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

kiln_tokenizer *kiln_tokenizer_load(const char *dir, kiln_err *err)
{
    kiln_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) {
        kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
        return NULL;
    }
    tok->pad_id = -1;
    cJSON *config = NULL;
    kiln_status st = KILN_OK;
    /* transformers' fast tokenizer prefers tokenizer.json when both exist. */
    int use_json = kiln_tok_file_exists(dir, "tokenizer.json");
    if (!use_json || kiln_tok_file_exists(dir, "tokenizer_config.json"))
        st = kiln_tok_read_json(dir, "tokenizer_config.json", &config, err);
    if (!st)
        st = use_json ? kiln_tok_load_json(tok, dir, err)
                      : kiln_tok_load_vocab_merges(tok, dir, config, err);
    if (!st)
        st = kiln_tok_load_pad(tok, config, err);
    if (!st)
        st = kiln_tok_finish(tok, err);
    cJSON_Delete(config);
    if (st) {
        kiln_tokenizer_free(tok);
        return NULL;
    }
    return tok;
}

void kiln_tokenizer_free(kiln_tokenizer *tok)
{
    if (!tok)
        return;
    kiln_tok_maps_free(tok);
    free(tok);
}

int32_t kiln_tokenizer_pad_id(const kiln_tokenizer *tok)
{
    return tok->pad_id;
}

int32_t kiln_tokenizer_id_limit(const kiln_tokenizer *tok)
{
    return tok->id_limit;
}

/* The longest added token at text[i..len), or NULL. */
static const tok_added *added_at(const kiln_tokenizer *tok, const char *text, size_t i, size_t len)
{
    const tok_added *best = NULL;
    for (size_t k = 0; k < tok->n_added; k++) {
        const tok_added *a = &tok->added[k];
        if (a->len <= len - i && (!best || a->len > best->len) && !memcmp(text + i, a->text, a->len))
            best = a;
    }
    return best;
}

/* Added tokens are found in the raw text first, leftmost then longest (the
 * LeftmostLongest automaton of tokenizers' AddedVocabulary); only the text
 * between them is normalised and BPE-encoded.  Tokens are whole UTF-8
 * sequences, so a byte-wise match always starts on a character boundary. */
static kiln_status encode_all(const kiln_tokenizer *tok, const char *text, size_t len,
                              tok_ids *out, kiln_err *err)
{
    kiln_status st = kiln_tok_utf8_check(text, len, err);
    if (st)
        return st;
    tok_scratch scratch = {0};
    size_t start = 0;
    for (size_t i = 0; !st && i < len; i++) {
        if (!tok->added_first[(uint8_t)text[i]])
            continue;
        const tok_added *a = added_at(tok, text, i, len);
        if (!a)
            continue;
        st = kiln_tok_encode_segment(tok, text + start, i - start, &scratch, out, err);
        if (!st)
            st = kiln_tok_ids_push(out, a->id, err);
        start = i + a->len;
        i = start - 1;
    }
    if (!st)
        st = kiln_tok_encode_segment(tok, text + start, len - start, &scratch, out, err);
    kiln_tok_scratch_free(&scratch);
    return st;
}

kiln_status kiln_tokenizer_encode(const kiln_tokenizer *tok, const char *text, size_t len,
                                  int32_t **ids, size_t *n, kiln_err *err)
{
    tok_ids out = {0};
    kiln_status st = encode_all(tok, text, len, &out, err);
    if (st) {
        free(out.v);
        out = (tok_ids){0};
    }
    *ids = out.v;
    *n = out.n;
    return st;
}

/* The Qwen3 chat template rendered for one user message with
 * add_generation_prompt=True (tokenizer_config.json's chat_template; diffusers
 * Flux2KleinPipeline passes enable_thinking=False, ZImagePipeline True). */
static const char chat_head[] = "<|im_start|>user\n";
static const char chat_tail_zimage[] = "<|im_end|>\n<|im_start|>assistant\n";
static const char chat_tail_klein[] = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

kiln_status kiln_tokenizer_chat_text(kiln_chat_template which, const char *prompt, size_t len,
                                     char **out, size_t *out_len, kiln_err *err)
{
    *out = NULL;
    *out_len = 0;
    const char *tail;
    switch (which) {
    case KILN_CHAT_KLEIN: tail = chat_tail_klein; break;
    case KILN_CHAT_ZIMAGE: tail = chat_tail_zimage; break;
    default: return kiln_err_set(err, KILN_ERR_INVALID, "unknown chat template %d", (int)which);
    }
    size_t head_len = sizeof chat_head - 1, tail_len = strlen(tail);
    if (len > SIZE_MAX - head_len - tail_len - 1)
        return kiln_err_set(err, KILN_ERR_TOO_LARGE, "prompt too long");
    char *s = malloc(head_len + len + tail_len + 1);
    if (!s)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory for a %zu-byte prompt",
                            len);
    memcpy(s, chat_head, head_len);
    if (len)
        memcpy(s + head_len, prompt, len);
    memcpy(s + head_len + len, tail, tail_len + 1);
    *out = s;
    *out_len = head_len + len + tail_len;
    return KILN_OK;
}

kiln_status kiln_tokenizer_encode_chat(const kiln_tokenizer *tok, const char *prompt, size_t len,
                                       kiln_chat_template which, int max_len, int32_t *ids_out,
                                       int *n_real, size_t *n_full, kiln_err *err)
{
    *n_real = 0;
    if (n_full)
        *n_full = 0;
    if (max_len < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "max_length must be at least 1, not %d",
                            max_len);
    if (tok->pad_id < 0)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "the tokenizer defines no pad_token (tokenizer_config.json)");
    char *text;
    size_t text_len;
    kiln_status st = kiln_tokenizer_chat_text(which, prompt, len, &text, &text_len, err);
    if (st)
        return st;
    tok_ids ids = {0};
    st = encode_all(tok, text, text_len, &ids, err);
    free(text);
    if (st) {
        free(ids.v);
        return st;
    }
    /* padding="max_length", truncation=True: keep the first max_len ids. */
    size_t real = ids.n < (size_t)max_len ? ids.n : (size_t)max_len;
    if (real)
        memcpy(ids_out, ids.v, real * sizeof *ids_out);
    for (size_t i = real; i < (size_t)max_len; i++)
        ids_out[i] = tok->pad_id;
    *n_real = (int)real;
    if (n_full)
        *n_full = ids.n;
    free(ids.v);
    return KILN_OK;
}
