/* tokenizer.json (the Hugging Face tokenizers serialisation).  Only the
 * vocabulary, merges and added tokens are taken from it; the normalizer,
 * pre-tokenizer and model options are checked to be Qwen2's, because those
 * are implemented in code here and anything else would encode differently. */
#include <string.h>

#include "tokenizer_internal.h"

/* transformers models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX. */
static const char qwen2_regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

static const cJSON *get(const cJSON *obj, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(obj, key);
}

static int is_type(const cJSON *obj, const char *type)
{
    const cJSON *t = get(obj, "type");
    return cJSON_IsObject(obj) && cJSON_IsString(t) && !strcmp(t->valuestring, type);
}

/* An option that must be absent, null, false or the empty string. */
static int off(const cJSON *obj, const char *key)
{
    const cJSON *v = get(obj, key);
    return !v || cJSON_IsNull(v) || cJSON_IsFalse(v) ||
           (cJSON_IsString(v) && !v->valuestring[0]);
}

static kiln_status unsupported(kiln_err *err, const char *what)
{
    return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                        "%s differs from the Qwen2 tokenizer's, the only one kiln implements",
                        what);
}

/* Sequence[Split(Regex(PRETOKENIZE_REGEX), Isolated), ByteLevel(no prefix space, no regex)] */
static int qwen2_pre_tokenizer(const cJSON *pre)
{
    const cJSON *seq = get(pre, "pretokenizers");
    if (!is_type(pre, "Sequence") || cJSON_GetArraySize(seq) != 2)
        return 0;
    const cJSON *split = cJSON_GetArrayItem(seq, 0), *bytes = cJSON_GetArrayItem(seq, 1);
    const cJSON *regex = get(get(split, "pattern"), "Regex");
    const cJSON *behavior = get(split, "behavior");
    return is_type(split, "Split") && cJSON_IsString(regex) &&
           !strcmp(regex->valuestring, qwen2_regex) && cJSON_IsString(behavior) &&
           !strcmp(behavior->valuestring, "Isolated") && off(split, "invert") &&
           is_type(bytes, "ByteLevel") && off(bytes, "add_prefix_space") &&
           off(bytes, "use_regex");
}

static kiln_status check_pipeline(const cJSON *root, const cJSON *model, kiln_err *err)
{
    if (!is_type(get(root, "normalizer"), "NFC"))
        return unsupported(err, "the normalizer");
    if (!qwen2_pre_tokenizer(get(root, "pre_tokenizer")))
        return unsupported(err, "the pre_tokenizer");
    const cJSON *post = get(root, "post_processor");
    if (post && !cJSON_IsNull(post) && !is_type(post, "ByteLevel"))
        return unsupported(err, "the post_processor");
    if (!is_type(model, "BPE"))
        return unsupported(err, "model.type");
    static const char *const opts[] = {"dropout", "byte_fallback", "ignore_merges",
                                       "continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++)
        if (!off(model, opts[i]))
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                                "model.%s is set; kiln supports only the Qwen2 BPE options",
                                opts[i]);
    return KILN_OK;
}

/* model.merges: "a b" strings (tokenizers < 0.20) or ["a", "b"] pairs. */
static kiln_status load_merges(kiln_tokenizer *tok, const cJSON *merges, kiln_err *err)
{
    if (!cJSON_IsArray(merges) || !merges->child)
        return kiln_err_set(err, KILN_ERR_FORMAT, "model.merges is not a non-empty array");
    int32_t rank = 0;
    for (const cJSON *m = merges->child; m; m = m->next, rank++) {
        kiln_status st;
        if (cJSON_IsString(m)) {
            st = kiln_tok_merge_from_text(tok, m->valuestring, strlen(m->valuestring), rank, err);
        } else {
            const cJSON *a = cJSON_GetArrayItem(m, 0), *b = cJSON_GetArrayItem(m, 1);
            if (!cJSON_IsArray(m) || cJSON_GetArraySize(m) != 2 || !cJSON_IsString(a) ||
                !cJSON_IsString(b))
                return kiln_err_set(err, KILN_ERR_FORMAT,
                                    "model.merges[%d] is neither \"a b\" nor [\"a\", \"b\"]", rank);
            st = kiln_tok_merge_add(tok, a->valuestring, strlen(a->valuestring), b->valuestring,
                                    strlen(b->valuestring), rank, err);
        }
        if (st)
            return err ? kiln_err_wrap(err, "model.merges[%d]", rank) : st;
    }
    return KILN_OK;
}

static kiln_status load_added(kiln_tokenizer *tok, const cJSON *added, kiln_err *err)
{
    if (!added || cJSON_IsNull(added))
        return KILN_OK;
    if (!cJSON_IsArray(added))
        return kiln_err_set(err, KILN_ERR_FORMAT, "added_tokens is not an array");
    for (const cJSON *a = added->child; a; a = a->next) {
        const cJSON *id = get(a, "id");
        if (!cJSON_IsNumber(id))
            return kiln_err_set(err, KILN_ERR_FORMAT, "an added token has no numeric id");
        kiln_status st = kiln_tok_added_from_json(tok, a, id->valuedouble, err);
        if (st)
            return st;
    }
    return KILN_OK;
}

kiln_status kiln_tok_load_json(kiln_tokenizer *tok, const char *dir, kiln_err *err)
{
    cJSON *root;
    kiln_status st = kiln_tok_read_json(dir, "tokenizer.json", &root, err);
    if (st)
        return st;
    const cJSON *model = get(root, "model");
    st = check_pipeline(root, model, err);
    if (!st)
        st = kiln_tok_vocab_from_json(tok, get(model, "vocab"), err);
    if (!st)
        st = load_merges(tok, get(model, "merges"), err);
    if (!st)
        st = load_added(tok, get(root, "added_tokens"), err);
    cJSON_Delete(root);
    if (st && err)
        kiln_err_wrap(err, "tokenizer/tokenizer.json");
    return st;
}
