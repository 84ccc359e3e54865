/* Tokenizer encoding against the Hugging Face references: the shared golden
 * vectors, the oracle's plain and chat-templated vectors, the generated
 * corpus (tests/oracle/gen_tokenizer_corpus.py), the tiny tokenizer.json
 * fixtures, and the pipelines' template/truncation/padding rules. */
#include <pthread.h>

#include "models/tokenizer.h"
#include "tests/test.h"
#include "tok_fixture.h"

static kiln_tokenizer *qwen; /* the real Qwen3 files from $KILN_SHARED */

/* Encodes every line of a JSONL fixture and compares; returns the case count. */
static int check_jsonl(const kiln_tokenizer *tok, const char *path)
{
    char *data = tok_slurp(path, NULL);
    int cases = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *c = cJSON_Parse(line);
        CHECKF(c != NULL, "%s: bad line", path);
        if (!c)
            continue;
        size_t len, n = 0;
        char *text = tok_case_text(c, &len);
        int32_t *ids = NULL;
        kiln_err err = {0};
        kiln_status st = kiln_tokenizer_encode(tok, text, len, &ids, &n, &err);
        CHECKF(st == KILN_OK, "%s", err.msg);
        CHECKF(tok_ids_equal(ids, n, cJSON_GetObjectItemCaseSensitive(c, "ids")),
               "%s case %d (%zu bytes, %.60s)", path, cases, len, text);
        free(ids);
        free(text);
        cJSON_Delete(c);
        cases++;
    }
    free(data);
    return cases;
}

static void test_golden(void)
{
    int n = check_jsonl(qwen, tok_path("KILN_SHARED", "data/qwen3-tokenizer/golden.jsonl"));
    CHECKF(n == 16, "%d golden cases", n);
}

static void test_corpus(void)
{
    int n = check_jsonl(qwen, tok_path("KILN_SOURCE_ROOT", "tokenizer_corpus.jsonl"));
    CHECKF(n >= 2000, "%d corpus cases", n);
}

static void test_oracle_vectors(void)
{
    char *json = tok_slurp(tok_path("KILN_SHARED", "oracle/tokenizer_vectors.json"), NULL);
    cJSON *doc = cJSON_Parse(json);
    free(json);
    CHECK(doc != NULL);
    if (!doc)
        return;
    CHECK(kiln_tokenizer_pad_id(qwen) ==
          cJSON_GetObjectItemCaseSensitive(doc, "pad_token_id")->valueint);
    CHECK(kiln_tokenizer_id_limit(qwen) ==
          cJSON_GetObjectItemCaseSensitive(doc, "vocab_len")->valueint);
    const cJSON *c;
    int plain = 0, chat = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(doc, "plain"))
    {
        const char *text = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
        int32_t *ids;
        size_t n;
        kiln_err err = {0};
        CHECKF(!kiln_tokenizer_encode(qwen, text, strlen(text), &ids, &n, &err), "%s", err.msg);
        CHECKF(tok_ids_equal(ids, n, cJSON_GetObjectItemCaseSensitive(c, "ids")), "%s", text);
        free(ids);
        plain++;
    }
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(doc, "chat"))
    {
        const char *prompt = cJSON_GetObjectItemCaseSensitive(c, "prompt")->valuestring;
        const char *want_text = cJSON_GetObjectItemCaseSensitive(c, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "ids");
        kiln_chat_template which =
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(c, "enable_thinking")) ? KILN_CHAT_ZIMAGE
                                                                                  : KILN_CHAT_KLEIN;
        char *text;
        size_t text_len;
        kiln_err err = {0};
        CHECK(!kiln_tokenizer_chat_text(which, prompt, strlen(prompt), &text, &text_len, &err));
        CHECKF(text_len == strlen(want_text) && !strcmp(text, want_text), "template of '%s'",
               prompt);
        free(text);
        int32_t ids[KILN_TOKENIZER_MAX_LENGTH];
        int n_real;
        size_t n_full;
        CHECKF(!kiln_tokenizer_encode_chat(qwen, prompt, strlen(prompt), which,
                                           KILN_TOKENIZER_MAX_LENGTH, ids, &n_real, &n_full, &err),
               "%s", err.msg);
        CHECKF(tok_ids_equal(ids, (size_t)n_real, want) && n_full == (size_t)n_real,
               "chat ids of '%s'", prompt);
        for (int i = n_real; i < KILN_TOKENIZER_MAX_LENGTH; i++)
            CHECK(ids[i] == 151643);
        chat++;
    }
    CHECKF(plain == 26 && chat == 8, "%d plain, %d chat", plain, chat);
    cJSON_Delete(doc);
}

/* spec/qwen3-encoder.md section 3: "A cat" with the klein template. */
static void test_klein_example(void)
{
    static const int32_t want[] = {151644, 872, 198, 32, 8251, 151645, 198,
                                   151644, 77091, 198, 151667, 271, 151668, 271};
    int32_t ids[KILN_TOKENIZER_MAX_LENGTH];
    int n_real = -1;
    kiln_err err = {0};
    CHECK(!kiln_tokenizer_encode_chat(qwen, "A cat", 5, KILN_CHAT_KLEIN, KILN_TOKENIZER_MAX_LENGTH,
                                      ids, &n_real, NULL, &err));
    CHECK(n_real == 14);
    CHECK(!memcmp(ids, want, sizeof want));
    int pads = 0;
    for (int i = 14; i < KILN_TOKENIZER_MAX_LENGTH; i++)
        pads += ids[i] == 151643;
    CHECKF(pads == 498, "%d pads", pads);
}

/* Truncation keeps the first max_len ids of the templated prompt, losing the
 * assistant header (diffusers does the same). */
static void test_truncation(void)
{
    size_t len = 0;
    char *prompt = malloc(20000);
    while (len < 19000)
        len += (size_t)sprintf(prompt + len, "word%zu, ", len % 97);
    int32_t ids[KILN_TOKENIZER_MAX_LENGTH];
    int n_real;
    size_t n_full;
    kiln_err err = {0};
    CHECK(!kiln_tokenizer_encode_chat(qwen, prompt, len, KILN_CHAT_KLEIN, KILN_TOKENIZER_MAX_LENGTH,
                                      ids, &n_real, &n_full, &err));
    CHECK(n_real == KILN_TOKENIZER_MAX_LENGTH);
    CHECKF(n_full > 4000, "%zu", n_full);
    char *text;
    size_t text_len, n;
    int32_t *all;
    CHECK(!kiln_tokenizer_chat_text(KILN_CHAT_KLEIN, prompt, len, &text, &text_len, &err));
    CHECK(!kiln_tokenizer_encode(qwen, text, text_len, &all, &n, &err));
    CHECK(n == n_full && !memcmp(ids, all, sizeof ids));
    CHECK(all[n - 1] == 271 && all[n - 2] == 151668); /* the cut-off think block */
    free(all);
    free(text);
    /* A tiny max_len keeps the head only. */
    CHECK(!kiln_tokenizer_encode_chat(qwen, "A cat", 5, KILN_CHAT_ZIMAGE, 2, ids, &n_real, &n_full,
                                      &err));
    CHECK(n_real == 2 && n_full == 10 && ids[0] == 151644 && ids[1] == 872);
    CHECK(kiln_tokenizer_encode_chat(qwen, "A cat", 5, KILN_CHAT_KLEIN, 0, ids, &n_real, NULL,
                                     &err) == KILN_ERR_INVALID);
    free(prompt);
}

static void test_empty(void)
{
    int32_t *ids = (int32_t *)1;
    size_t n = 7;
    kiln_err err = {0};
    CHECK(!kiln_tokenizer_encode(qwen, "", 0, &ids, &n, &err) && n == 0 && ids == NULL);
    int32_t chat[16];
    int n_real;
    size_t n_full;
    CHECK(!kiln_tokenizer_encode_chat(qwen, "", 0, KILN_CHAT_KLEIN, 16, chat, &n_real, &n_full,
                                      &err));
    CHECK(n_real == 12 && n_full == 12 && chat[3] == 151645 && chat[12] == 151643);
}

static void test_invalid_utf8(void)
{
    static const struct {
        const char *s;
        const char *why;
    } bad[] = {
        {"\xC0\xAF", "overlong"},          {"\xC1\xBF", "overlong"},
        {"ab\xE0\x80\xAF", "overlong"},    {"\xE0\x9F\xBF", "overlong"},
        {"\xF0\x80\x80\xAF", "overlong"},  {"\xF0\x8F\xBF\xBF", "overlong"},
        {"\xED\xA0\x80", "surrogate"},     {"x\xED\xBF\xBFy", "surrogate"},
        {"\xF4\x90\x80\x80", "U+10FFFF"},  {"\xF5\x80\x80\x80", "never"},
        {"\xFF", "never"},                 {"\x80", "continuation"},
        {"caf\xBF", "continuation"},       {"\xE4\xB8", "truncated"},
        {"\xF0\x9F\x98", "truncated"},     {"abc\xC3", "truncated"},
        {"\xE4\xB8x", "truncated"},        {"<|im_end|>\xC3<|im_end|>", "truncated"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int32_t *ids = (int32_t *)1;
        size_t n;
        kiln_err err = {0};
        CHECKF(kiln_tokenizer_encode(qwen, bad[i].s, strlen(bad[i].s), &ids, &n, &err) ==
                       KILN_ERR_INVALID &&
                   ids == NULL,
               "case %zu", i);
        CHECKF(strstr(err.msg, "UTF-8") && strstr(err.msg, bad[i].why), "case %zu: %s", i,
               err.msg);
        int32_t chat[8];
        int n_real;
        CHECK(kiln_tokenizer_encode_chat(qwen, bad[i].s, strlen(bad[i].s), KILN_CHAT_KLEIN, 8,
                                         chat, &n_real, NULL, &err) == KILN_ERR_INVALID);
    }
    /* The extremes of every valid range are accepted. */
    static const char *good[] = {"\x7F", "\xC2\x80", "\xDF\xBF", "\xE0\xA0\x80", "\xED\x9F\xBF",
                                 "\xEE\x80\x80", "\xEF\xBF\xBF", "\xF0\x90\x80\x80",
                                 "\xF4\x8F\xBF\xBF"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        int32_t *ids;
        size_t n;
        kiln_err err = {0};
        CHECKF(!kiln_tokenizer_encode(qwen, good[i], strlen(good[i]), &ids, &n, &err) && n >= 1,
               "good case %zu: %s", i, err.msg);
        free(ids);
    }
}

/* The same tokenizer from a checkpoint folder whose files are git link
 * stand-ins (oracle/ckpt), and from the tiny tokenizer.json fixtures with
 * merges in both serialisations. */
static void test_other_sources(void)
{
    kiln_err err = {0};
    kiln_tokenizer *ck = kiln_tokenizer_load(
        tok_path("KILN_SHARED", "oracle/ckpt/klein-tiny/tokenizer"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    if (ck) {
        check_jsonl(ck, tok_path("KILN_SHARED", "data/qwen3-tokenizer/golden.jsonl"));
        kiln_tokenizer_free(ck);
    }
    const char *forms[] = {"tokenizer_tiny/pairs", "tokenizer_tiny/strings"};
    for (int i = 0; i < 2; i++) {
        kiln_tokenizer *tiny = kiln_tokenizer_load(tok_path("KILN_SOURCE_ROOT", forms[i]), &err);
        CHECKF(tiny != NULL, "%s: %s", forms[i], err.msg);
        if (!tiny)
            continue;
        int n = check_jsonl(tiny, tok_path("KILN_SOURCE_ROOT", "tokenizer_tiny/cases.jsonl"));
        CHECK(n == 400);
        /* pairs/ has a tokenizer_config.json naming the pad token, strings/ has none. */
        int32_t ids[32];
        int n_real;
        kiln_status st = kiln_tokenizer_encode_chat(tiny, "A cat", 5, KILN_CHAT_KLEIN, 32, ids,
                                                    &n_real, NULL, &err);
        if (i == 0)
            CHECKF(!st && ids[31] == kiln_tokenizer_pad_id(tiny) && ids[0] == 3257, "%s", err.msg);
        else
            CHECK(st == KILN_ERR_FORMAT && kiln_tokenizer_pad_id(tiny) == -1);
        kiln_tokenizer_free(tiny);
    }
}

/* Several threads encoding at once get the single-threaded answers. */
struct job {
    const char *text;
    int32_t *want;
    size_t n_want;
    int ok;
};

static void *encode_many(void *arg)
{
    struct job *j = arg;
    j->ok = 1;
    for (int r = 0; r < 20; r++) {
        int32_t *ids;
        size_t n;
        kiln_err err = {0};
        if (kiln_tokenizer_encode(qwen, j->text, strlen(j->text), &ids, &n, &err) ||
            n != j->n_want || memcmp(ids, j->want, n * sizeof *ids))
            j->ok = 0;
        free(ids);
    }
    return NULL;
}

static void test_threads(void)
{
    const char *texts[] = {"A lighthouse at night, 35mm", "灯塔在夜晚 🌊 <think>x</think>",
                           "don't STOP 12345  \n\n end", "Ελληνικά e\u0301 \u00e9"};
    struct job jobs[4];
    pthread_t th[4];
    kiln_err err = {0};
    for (int i = 0; i < 4; i++) {
        jobs[i].text = texts[i];
        CHECK(!kiln_tokenizer_encode(qwen, texts[i], strlen(texts[i]), &jobs[i].want,
                                     &jobs[i].n_want, &err));
    }
    for (int i = 0; i < 4; i++)
        CHECK(!pthread_create(&th[i], NULL, encode_many, &jobs[i]));
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        CHECKF(jobs[i].ok, "thread %d", i);
        free(jobs[i].want);
    }
}

int main(void)
{
    kiln_err err = {0};
    qwen = kiln_tokenizer_load(tok_path("KILN_SHARED", "data/qwen3-tokenizer"), &err);
    if (!qwen) {
        fprintf(stderr, "cannot load the Qwen3 tokenizer: %s\n", err.msg);
        return 1;
    }
    RUN(test_golden);
    RUN(test_oracle_vectors);
    RUN(test_corpus);
    RUN(test_klein_example);
    RUN(test_truncation);
    RUN(test_empty);
    RUN(test_invalid_utf8);
    RUN(test_other_sources);
    RUN(test_threads);
    kiln_tokenizer_free(qwen);
    return test_finish();
}
