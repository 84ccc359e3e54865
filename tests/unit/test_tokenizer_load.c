/* Tokenizer loading: symbolic links, and clear refusals of missing, corrupt
 * or unsupported files.  Each case builds a folder in a temporary directory
 * from the real Qwen3 files (linked) and the tiny tokenizer.json fixture,
 * with one file broken. */
#include <errno.h>
#include <stdarg.h>
#include <unistd.h>

#include "models/tokenizer.h"
#include "tests/test.h"
#include "tok_fixture.h"

static char tmp[64];

static const char *qwen_file(const char *name)
{
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/data/qwen3-tokenizer/%s", getenv("KILN_SHARED"), name);
    return buf;
}

static void write_file(const char *name, const char *data, size_t len)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f)) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
}

static void link_file(const char *name, const char *target)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    if (symlink(target, path)) {
        fprintf(stderr, "cannot link %s: %s\n", path, strerror(errno));
        exit(2);
    }
}

static void clear_dir(void)
{
    static const char *names[] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                                  "tokenizer.json", "real_vocab.json"};
    char path[256];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", tmp, names[i]);
        unlink(path);
    }
}

/* The three vocab.json-mode files, linked to the real ones. */
static void qwen_folder(void)
{
    clear_dir();
    link_file("vocab.json", qwen_file("vocab.json"));
    link_file("merges.txt", qwen_file("merges.txt"));
    link_file("tokenizer_config.json", qwen_file("tokenizer_config.json"));
}

static void replace(const char *name, const char *data)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    unlink(path);
    write_file(name, data, strlen(data));
}

/* Loading must fail with `code` and a message containing every `needle`. */
static void expect_fail(const char *what, kiln_status code, ...)
{
    kiln_err err = {0};
    kiln_tokenizer *tok = kiln_tokenizer_load(tmp, &err);
    CHECKF(tok == NULL && err.code == code, "%s: got %s (%s)", what, kiln_status_name(err.code),
           err.msg);
    kiln_tokenizer_free(tok);
    va_list ap;
    va_start(ap, code);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        CHECKF(strstr(err.msg, needle) != NULL, "%s: '%s' lacks '%s'", what, err.msg, needle);
    va_end(ap);
    CHECKF(strstr(err.msg, tmp) == NULL, "%s: message leaks the path: %s", what, err.msg);
}

static void expect_ok(const char *what)
{
    kiln_err err = {0};
    kiln_tokenizer *tok = kiln_tokenizer_load(tmp, &err);
    CHECKF(tok != NULL, "%s: %s", what, err.msg);
    if (tok) {
        int32_t *ids;
        size_t n;
        CHECK(!kiln_tokenizer_encode(tok, "Hello world", 11, &ids, &n, &err));
        CHECKF(n == 2 && ids[0] == 9707 && ids[1] == 1879, "%s", what);
        free(ids);
    }
    kiln_tokenizer_free(tok);
}

static void test_links(void)
{
    qwen_folder();
    expect_ok("symbolic links");
    /* A git link stand-in: a file holding the relative target. */
    replace("vocab.json", "real_vocab.json");
    link_file("real_vocab.json", qwen_file("vocab.json"));
    expect_ok("link stand-in");
}

static void test_missing(void)
{
    kiln_err err = {0};
    CHECK(!kiln_tokenizer_load("/nonexistent/kiln-tokenizer", &err) &&
          err.code == KILN_ERR_NOT_FOUND && strstr(err.msg, "tokenizer_config.json"));
    static const char *files[] = {"vocab.json", "merges.txt", "tokenizer_config.json"};
    for (int i = 0; i < 3; i++) {
        qwen_folder();
        char path[256];
        snprintf(path, sizeof path, "%s/%s", tmp, files[i]);
        unlink(path);
        expect_fail(files[i], KILN_ERR_NOT_FOUND, files[i], NULL);
    }
    qwen_folder();
    char path[256];
    snprintf(path, sizeof path, "%s/merges.txt", tmp);
    unlink(path);
    link_file("merges.txt", "does-not-exist.txt");
    expect_fail("dangling link", KILN_ERR_NOT_FOUND, "merges.txt", NULL);
}

static void test_corrupt_vocab(void)
{
    size_t len;
    char *vocab = tok_slurp(qwen_file("vocab.json"), &len);
    clear_dir();
    link_file("merges.txt", qwen_file("merges.txt"));
    link_file("tokenizer_config.json", qwen_file("tokenizer_config.json"));
    write_file("vocab.json", vocab, 4000); /* truncated */
    expect_fail("truncated vocab", KILN_ERR_FORMAT, "vocab.json", "JSON", NULL);
    replace("vocab.json", "[1, 2, 3]");
    expect_fail("vocab array", KILN_ERR_FORMAT, "vocab.json", NULL);
    replace("vocab.json", "{\"a\": \"1\"}");
    expect_fail("vocab string id", KILN_ERR_FORMAT, "vocab.json", "numeric", NULL);
    replace("vocab.json", "{\"a\": -1}");
    expect_fail("negative id", KILN_ERR_FORMAT, "vocab.json", "-1", NULL);
    replace("vocab.json", "{\"a\": 1.5}");
    expect_fail("fractional id", KILN_ERR_FORMAT, "vocab.json", "1.5", NULL);
    replace("vocab.json", "{\"a\": 1, \"a\": 2}");
    expect_fail("duplicate", KILN_ERR_FORMAT, "twice", NULL);
    /* Valid JSON, but the byte symbols that every merge needs are missing. */
    replace("vocab.json", "{\"a\": 0, \"b\": 1}");
    expect_fail("small vocab", KILN_ERR_FORMAT, "merges.txt", "not in the vocabulary", NULL);
    replace("vocab.json", "version https://git-lfs.github.com/spec/v1\noid sha256:00\n");
    expect_fail("LFS pointer", KILN_ERR_FORMAT, "vocab.json", "LFS", NULL);
    free(vocab);
}

static void test_corrupt_merges(void)
{
    size_t len;
    char *merges = tok_slurp(qwen_file("merges.txt"), &len);
    char *third = merges;
    for (int i = 0; i < 4; i++)
        third = strchr(third, '\n') + 1; /* after the header and three merges */
    size_t keep = (size_t)(third - merges);
    char *buf = malloc(keep + 64);
    static const char *bad[] = {"a b c\n", "lonely\n", " x\n", "\xC4\xA0\xC4\xA0 \xE2\x82\xAC\n"};
    static const char *needle[] = {"line 5", "line 5", "line 5", "not in the vocabulary"};
    for (int i = 0; i < 4; i++) {
        qwen_folder();
        memcpy(buf, merges, keep);
        strcpy(buf + keep, bad[i]);
        replace("merges.txt", buf);
        expect_fail(bad[i], KILN_ERR_FORMAT, "merges.txt", needle[i], NULL);
    }
    qwen_folder();
    replace("merges.txt", "#version: 0.2\n");
    expect_fail("no merges", KILN_ERR_FORMAT, "merges.txt", NULL);
    /* CRLF line ends and a missing header are fine. */
    memcpy(buf, merges, keep);
    buf[keep] = '\0';
    char *crlf = malloc(2 * keep + 1), *o = crlf;
    for (const char *p = strchr(buf, '\n') + 1; *p; p++) {
        if (*p == '\n')
            *o++ = '\r';
        *o++ = *p;
    }
    *o = '\0';
    replace("merges.txt", crlf);
    kiln_err err = {0};
    kiln_tokenizer *tok = kiln_tokenizer_load(tmp, &err);
    CHECKF(tok != NULL, "CRLF merges: %s", err.msg);
    kiln_tokenizer_free(tok);
    free(crlf);
    free(buf);
    free(merges);
}

static void test_bad_config(void)
{
    qwen_folder();
    replace("tokenizer_config.json", "{\"added_tokens_decoder\": {\"x1\": {\"content\": \"<a>\"}}}");
    expect_fail("id key", KILN_ERR_FORMAT, "tokenizer_config.json", "x1", NULL);
    replace("tokenizer_config.json",
            "{\"added_tokens_decoder\": {\"200000\": {\"content\": \"<a>\", \"lstrip\": true}}}");
    expect_fail("lstrip", KILN_ERR_UNSUPPORTED, "lstrip", NULL);
    replace("tokenizer_config.json", "{\"added_tokens_decoder\": {\"200000\": {\"content\": \"\"}}}");
    expect_fail("empty token", KILN_ERR_FORMAT, "empty", NULL);
    replace("tokenizer_config.json", "{\"pad_token\": \"<|nope|>\"}");
    expect_fail("unknown pad", KILN_ERR_FORMAT, "pad_token", NULL);
    replace("tokenizer_config.json", "{\"added_tokens_decoder\": [1]}");
    expect_fail("decoder array", KILN_ERR_FORMAT, "added_tokens_decoder", NULL);
}

/* tokenizer.json: the tiny fixture with one field changed at a time. */
static void write_json_variant(cJSON *doc)
{
    char *text = cJSON_PrintUnformatted(doc);
    clear_dir();
    write_file("tokenizer.json", text, strlen(text));
    free(text);
}

static void test_tokenizer_json(void)
{
    const char *good = tok_slurp(tok_path("KILN_SOURCE_ROOT", "tokenizer_tiny/pairs/tokenizer.json"),
                                 NULL);
    struct {
        const char *what, *path, *value; /* path: dotted keys; value: JSON */
        kiln_status code;
        const char *needle;
    } cases[] = {
        {"normalizer", "normalizer", "{\"type\": \"NFKC\"}", KILN_ERR_UNSUPPORTED, "normalizer"},
        {"no normalizer", "normalizer", "null", KILN_ERR_UNSUPPORTED, "normalizer"},
        {"regex", "pre_tokenizer", "{\"type\": \"ByteLevel\"}", KILN_ERR_UNSUPPORTED,
         "pre_tokenizer"},
        {"template", "post_processor", "{\"type\": \"TemplateProcessing\"}", KILN_ERR_UNSUPPORTED,
         "post_processor"},
        {"dropout", "model.dropout", "0.1", KILN_ERR_UNSUPPORTED, "dropout"},
        {"byte_fallback", "model.byte_fallback", "true", KILN_ERR_UNSUPPORTED, "byte_fallback"},
        {"wordpiece", "model.type", "\"WordPiece\"", KILN_ERR_UNSUPPORTED, "model.type"},
        {"vocab", "model.vocab", "[]", KILN_ERR_FORMAT, "vocabulary"},
        {"merges", "model.merges", "[[\"a\"]]", KILN_ERR_FORMAT, "merges[0]"},
        {"merge string", "model.merges", "[\"\\u0120 \\u0120\", \"a  b\"]", KILN_ERR_FORMAT,
         "merges[1]"},
        {"merge symbol", "model.merges", "[[\"\\u0120\", \"zzzz\"]]", KILN_ERR_FORMAT,
         "not in the vocabulary"},
        {"added", "added_tokens", "[{\"id\": 5000, \"content\": \"<x>\", \"rstrip\": true}]",
         KILN_ERR_UNSUPPORTED, "rstrip"},
        {"added id", "added_tokens", "[{\"content\": \"<x>\"}]", KILN_ERR_FORMAT, "id"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *doc = cJSON_Parse(good);
        cJSON *parent = doc;
        char key[64];
        snprintf(key, sizeof key, "%s", cases[i].path);
        char *dot = strchr(key, '.');
        if (dot) {
            *dot = '\0';
            parent = cJSON_GetObjectItemCaseSensitive(doc, key);
            memmove(key, dot + 1, strlen(dot + 1) + 1);
        }
        cJSON_ReplaceItemInObjectCaseSensitive(parent, key, cJSON_Parse(cases[i].value));
        write_json_variant(doc);
        cJSON_Delete(doc);
        expect_fail(cases[i].what, cases[i].code, "tokenizer.json", cases[i].needle, NULL);
    }
    clear_dir();
    write_file("tokenizer.json", good, 5000);
    expect_fail("truncated tokenizer.json", KILN_ERR_FORMAT, "tokenizer.json", "JSON", NULL);
    free((char *)good);
}

int main(void)
{
    snprintf(tmp, sizeof tmp, "/tmp/kiln-tok-XXXXXX");
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 2;
    }
    RUN(test_links);
    RUN(test_missing);
    RUN(test_corrupt_vocab);
    RUN(test_corrupt_merges);
    RUN(test_bad_config);
    RUN(test_tokenizer_json);
    clear_dir();
    rmdir(tmp);
    return test_finish();
}
