/* Reading the tokenizer folder: files (through links and git's link
 * stand-ins), vocab.json + merges.txt + tokenizer_config.json, and the pad
 * token.  Messages name "tokenizer/<file>", never a path on disk. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer_internal.h"

#define TOK_FILE_MAX ((size_t)64 << 20) /* tokenizer.json is ~11 MB */
#define TOK_PATH_MAX 4096

static kiln_status slurp(const char *path, const char *name, size_t max, char **buf, size_t *len,
                         kiln_err *err)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "tokenizer/%s: %s", name, strerror(errno));
    struct stat sb;
    kiln_status st = KILN_OK;
    if (fstat(fileno(f), &sb) || !S_ISREG(sb.st_mode))
        st = kiln_err_set(err, KILN_ERR_IO, "tokenizer/%s is not a readable file", name);
    else if ((uint64_t)sb.st_size > max)
        st = kiln_err_set(err, KILN_ERR_FORMAT, "tokenizer/%s is larger than %zu MiB", name,
                          max >> 20);
    char *data = NULL;
    size_t n = st ? 0 : (size_t)sb.st_size;
    if (!st && !(data = malloc(n + 1)))
        st = kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer/%s: out of memory", name);
    if (!st && fread(data, 1, n, f) != n)
        st = kiln_err_set(err, KILN_ERR_IO, "tokenizer/%s: read failed", name);
    fclose(f);
    if (st) {
        free(data);
        return st;
    }
    data[n] = '\0';
    *buf = data;
    *len = n;
    return KILN_OK;
}

/* Where git cannot make a symbolic link (core.symlinks=false, some copies of
 * a repository) it writes a small file holding the link's relative target;
 * the oracle checkpoints ship their tokenizer files that way.  Such a file is
 * short, one line, and names an existing file next to it. */
static int stand_in_target(const char *path, const char *data, size_t n, char *out, size_t cap)
{
    if (n == 0 || n > 1024 || data[0] == '/' || memchr(data, '\n', n) || memchr(data, '\r', n) ||
        strlen(data) != n)
        return 0;
    const char *slash = strrchr(path, '/');
    int dir_len = slash ? (int)(slash - path) : 1;
    if ((size_t)snprintf(out, cap, "%.*s/%s", dir_len, slash ? path : ".", data) >= cap)
        return 0;
    struct stat sb;
    return !stat(out, &sb) && S_ISREG(sb.st_mode);
}

kiln_status kiln_tok_read_file(const char *dir, const char *name, size_t max, char **buf,
                               size_t *len, kiln_err *err)
{
    char path[TOK_PATH_MAX], next[TOK_PATH_MAX];
    if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, name) >= sizeof path)
        return kiln_err_set(err, KILN_ERR_INVALID, "tokenizer folder path too long");
    for (int hops = 0;; hops++) {
        kiln_status st = slurp(path, name, max, buf, len, err);
        if (st)
            return st;
        if (hops < 8 && stand_in_target(path, *buf, *len, next, sizeof next)) {
            free(*buf);
            memcpy(path, next, sizeof path);
            continue;
        }
        if (!strncmp(*buf, "version https://git-lfs", 23)) {
            free(*buf);
            *buf = NULL;
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "tokenizer/%s is a Git LFS pointer, not the file itself", name);
        }
        return KILN_OK;
    }
}

int kiln_tok_file_exists(const char *dir, const char *name)
{
    char path[TOK_PATH_MAX];
    struct stat sb;
    /* lstat: a dangling link still counts, so its failure is reported, not skipped. */
    return (size_t)snprintf(path, sizeof path, "%s/%s", dir, name) < sizeof path &&
           !lstat(path, &sb);
}

kiln_status kiln_tok_read_json(const char *dir, const char *name, cJSON **out, kiln_err *err)
{
    char *text;
    size_t len;
    *out = NULL;
    kiln_status st = kiln_tok_read_file(dir, name, TOK_FILE_MAX, &text, &len, err);
    if (st)
        return st;
    const char *end = NULL;
    *out = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!*out)
        st = kiln_err_set(err, KILN_ERR_FORMAT, "tokenizer/%s is not valid JSON (near byte %zu)",
                          name, end ? (size_t)(end - text) : (size_t)0);
    free(text);
    return st;
}

kiln_status kiln_tok_vocab_from_json(kiln_tokenizer *tok, const cJSON *vocab, kiln_err *err)
{
    if (!cJSON_IsObject(vocab) || !vocab->child)
        return kiln_err_set(err, KILN_ERR_FORMAT, "the vocabulary is not a non-empty JSON object");
    for (const cJSON *e = vocab->child; e; e = e->next) {
        if (!cJSON_IsNumber(e))
            return kiln_err_set(err, KILN_ERR_FORMAT, "vocabulary entry '%.64s' has no numeric id",
                                e->string);
        kiln_status st = kiln_tok_vocab_add(tok, e->string, strlen(e->string), e->valuedouble, err);
        if (st)
            return st;
    }
    return KILN_OK;
}

/* tokenizers splits each merge at ' ' and wants exactly two parts. */
kiln_status kiln_tok_merge_from_text(kiln_tokenizer *tok, const char *line, size_t len,
                                     int32_t rank, kiln_err *err)
{
    const char *space = memchr(line, ' ', len);
    if (!space || space == line || space == line + len - 1 ||
        memchr(space + 1, ' ', len - (size_t)(space + 1 - line)))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "merge '%.*s' is not two symbols separated by one space",
                            (int)(len > 64 ? 64 : len), line);
    return kiln_tok_merge_add(tok, line, (size_t)(space - line), space + 1,
                              len - (size_t)(space + 1 - line), rank, err);
}

static kiln_status load_merges_txt(kiln_tokenizer *tok, const char *dir, kiln_err *err)
{
    char *text;
    size_t len;
    kiln_status st = kiln_tok_read_file(dir, "merges.txt", TOK_FILE_MAX, &text, &len, err);
    if (st)
        return st;
    int32_t rank = 0;
    size_t line_no = 0;
    for (size_t i = 0; !st && i < len;) {
        const char *line = text + i, *nl = memchr(line, '\n', len - i);
        size_t n = nl ? (size_t)(nl - line) : len - i;
        i += n + 1;
        line_no++;
        if (n && line[n - 1] == '\r')
            n--;
        if (n == 0 || (n >= 8 && !memcmp(line, "#version", 8)))
            continue;
        if (rank == INT32_MAX)
            st = kiln_err_set(err, KILN_ERR_FORMAT, "too many merges");
        else if ((st = kiln_tok_merge_from_text(tok, line, n, rank++, err)) && err)
            kiln_err_wrap(err, "tokenizer/merges.txt line %zu", line_no);
    }
    if (!st && rank == 0)
        st = kiln_err_set(err, KILN_ERR_FORMAT, "tokenizer/merges.txt has no merges");
    free(text);
    return st;
}

/* added_tokens_decoder: {"151643": {"content": "<|endoftext|>", ...}, ...} */
static kiln_status load_added_decoder(kiln_tokenizer *tok, const cJSON *config, kiln_err *err)
{
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(config, "added_tokens_decoder");
    if (!dec || cJSON_IsNull(dec))
        return KILN_OK;
    if (!cJSON_IsObject(dec))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "tokenizer/tokenizer_config.json: added_tokens_decoder is not an object");
    for (const cJSON *e = dec->child; e; e = e->next) {
        char *end;
        errno = 0;
        unsigned long id = strtoul(e->string, &end, 10);
        if (!*e->string || *end || errno || e->string[0] < '0' || e->string[0] > '9')
            return kiln_err_set(err, KILN_ERR_FORMAT,
                                "tokenizer/tokenizer_config.json: added token id '%.32s' is not "
                                "a number", e->string);
        kiln_status st = kiln_tok_added_from_json(tok, e, (double)id, err);
        if (st)
            return err ? kiln_err_wrap(err, "tokenizer/tokenizer_config.json") : st;
    }
    return KILN_OK;
}

kiln_status kiln_tok_load_vocab_merges(kiln_tokenizer *tok, const char *dir,
                                       const cJSON *config, kiln_err *err)
{
    cJSON *vocab;
    kiln_status st = kiln_tok_read_json(dir, "vocab.json", &vocab, err);
    if (st)
        return st;
    st = kiln_tok_vocab_from_json(tok, vocab, err);
    cJSON_Delete(vocab);
    if (st)
        return err ? kiln_err_wrap(err, "tokenizer/vocab.json") : st;
    if ((st = load_merges_txt(tok, dir, err)))
        return st;
    return load_added_decoder(tok, config, err);
}

/* transformers takes pad_token_id = convert_tokens_to_ids(pad_token): the
 * token string looked up as is, added tokens first. */
kiln_status kiln_tok_load_pad(kiln_tokenizer *tok, const cJSON *config, kiln_err *err)
{
    const cJSON *pad = cJSON_GetObjectItemCaseSensitive(config, "pad_token");
    if (cJSON_IsObject(pad))
        pad = cJSON_GetObjectItemCaseSensitive(pad, "content");
    if (!pad || cJSON_IsNull(pad))
        return KILN_OK;
    if (!cJSON_IsString(pad))
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "tokenizer/tokenizer_config.json: pad_token is not a string");
    for (size_t i = 0; i < tok->n_added; i++)
        if (!strcmp(tok->added[i].text, pad->valuestring)) {
            tok->pad_id = tok->added[i].id;
            return KILN_OK;
        }
    tok->pad_id = kiln_tok_vocab_get(tok, pad->valuestring, strlen(pad->valuestring));
    if (tok->pad_id < 0)
        return kiln_err_set(err, KILN_ERR_FORMAT,
                            "tokenizer/tokenizer_config.json: pad_token '%.64s' is not a token",
                            pad->valuestring);
    return KILN_OK;
}
