/* kiln tokenizer: the Qwen2/Qwen3 byte-level BPE tokenizer, matching the
 * Hugging Face fast tokenizer that diffusers loads for FLUX.2 klein and
 * Z-Image (spec/qwen3-encoder.md section 3).
 *
 *   kiln_err err = {0};
 *   kiln_tokenizer *tok = kiln_tokenizer_load("/models/klein-4B/tokenizer", &err);
 *   if (!tok) { fprintf(stderr, "kiln: %s\n", err.msg); return err.code; }
 *   int32_t ids[KILN_TOKENIZER_MAX_LENGTH];
 *   int n_real;
 *   if (kiln_tokenizer_encode_chat(tok, prompt, strlen(prompt), KILN_CHAT_KLEIN,
 *                                  KILN_TOKENIZER_MAX_LENGTH, ids, &n_real, NULL, &err))
 *       ...;  // ids[0..n_real) are real tokens (mask 1), the rest padding (mask 0)
 *   kiln_tokenizer_free(tok);
 *
 * Pipeline (what transformers' Qwen2TokenizerFast does): added tokens such as
 * <|im_start|> are cut out of the raw text first (leftmost, then longest
 * match); each piece between them is NFC-normalised, split by the Qwen2
 * pre-tokenizer regex, mapped to GPT-2 byte symbols and merged by BPE rank.
 * No BOS/EOS is added.
 *
 * Known divergence: NFC uses utf8proc (Unicode 15), while tokenizers' NFC
 * tables predate Unicode 10, so the ~110 combining marks added since then
 * are reordered/composed here and not there.  Text whose NFC form differs
 * between the two yields different ids; tests/oracle/gen_tokenizer_corpus.py
 * counts such strings.
 *
 * A loaded tokenizer is immutable: every function taking a const
 * kiln_tokenizer * may run concurrently from any number of threads.
 */
#ifndef KILN_MODELS_TOKENIZER_H
#define KILN_MODELS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct kiln_tokenizer kiln_tokenizer;

/* diffusers' default max_sequence_length for klein and Z-Image prompts. */
#define KILN_TOKENIZER_MAX_LENGTH 512

typedef enum kiln_chat_template {
    /* FLUX.2 klein: Qwen3 template with enable_thinking=False (empty think block). */
    KILN_CHAT_KLEIN,
    /* Z-Image: Qwen3 template with enable_thinking=True (no think block). */
    KILN_CHAT_ZIMAGE,
} kiln_chat_template;

/* Loads the tokenizer folder `dir` (a checkpoint's tokenizer/).  Reads
 * tokenizer.json when present (model.vocab, model.merges, added_tokens),
 * otherwise vocab.json + merges.txt + tokenizer_config.json (added tokens from
 * added_tokens_decoder).  tokenizer_config.json's pad_token, when present,
 * names the padding token.  Files may be symbolic links, or the small text
 * files holding a relative path that git writes for links where it cannot
 * create them.  Returns NULL with err set: KILN_ERR_NOT_FOUND for a missing
 * file, KILN_ERR_FORMAT for a corrupt one, KILN_ERR_UNSUPPORTED for a
 * tokenizer.json whose pipeline is not Qwen2's.  The caller owns the result. */
kiln_tokenizer *kiln_tokenizer_load(const char *dir, kiln_err *err);

/* Frees everything; NULL is a no-op. */
void kiln_tokenizer_free(kiln_tokenizer *tok);

/* Encodes len bytes of UTF-8 `text` (no template, no padding).  On success
 * *ids is a malloc'd array of *n ids that the caller frees (NULL when *n is 0).
 * Invalid UTF-8 (overlong forms, surrogates, code points over U+10FFFF,
 * truncated or stray bytes) fails with KILN_ERR_INVALID naming the byte
 * offset; *ids is then NULL. */
kiln_status kiln_tokenizer_encode(const kiln_tokenizer *tok, const char *text, size_t len,
                                  int32_t **ids, size_t *n, kiln_err *err);

/* Writes the chat-templated text for one user message into a malloc'd,
 * NUL-terminated string (*out, caller frees) of *out_len bytes.  The prompt is
 * inserted verbatim, as the Jinja template does. */
kiln_status kiln_tokenizer_chat_text(kiln_chat_template which, const char *prompt, size_t len,
                                     char **out, size_t *out_len, kiln_err *err);

/* Templates and encodes `prompt` the way the pipelines do: keeps the first
 * max_len ids (an over-long prompt loses the assistant header, as in diffusers)
 * and right-pads ids_out[0..max_len) with the pad token.  *n_real receives the
 * number of real tokens (the attention mask is 1 for i < *n_real); n_full,
 * when not NULL, the templated length before truncation, so callers can refuse
 * what they must.  An empty prompt is valid (klein base's negative prompt).
 * Fails with KILN_ERR_INVALID for bad UTF-8 or max_len < 1, KILN_ERR_FORMAT
 * when the tokenizer has no pad token. */
kiln_status kiln_tokenizer_encode_chat(const kiln_tokenizer *tok, const char *prompt, size_t len,
                                       kiln_chat_template which, int max_len, int32_t *ids_out,
                                       int *n_real, size_t *n_full, kiln_err *err);

/* The padding id (tokenizer_config.json's pad_token), or -1 when none. */
int32_t kiln_tokenizer_pad_id(const kiln_tokenizer *tok);

/* One more than the largest id the tokenizer can produce, so an encoder can
 * check that its embedding table covers every id. */
int32_t kiln_tokenizer_id_limit(const kiln_tokenizer *tok);

#endif
