/* `kiln tokenize` end to end: the built binary, its stdout, exit codes and
 * error messages. */
#include "tests/run_util.h"
#include "tests/test.h"
#include "tok_fixture.h"

static const char *kiln_bin;
static char out_text[65536], err_text[4096];

/* Runs `kiln tokenize` with the given arguments (NULL-terminated); returns
 * the exit status, with stdout and stderr in out_text and err_text. */
static int tokenize(const char *a0, const char *a1, const char *a2, const char *a3)
{
    const char *argv[] = {NULL, "tokenize", a0, a1, a2, a3, NULL};
    return test_run_capture(kiln_bin, argv, out_text, sizeof out_text, err_text, sizeof err_text);
}

static void test_prints_ids(void)
{
    /* A checkpoint folder: its tokenizer/ holds git link stand-ins. */
    const char *ckpt = tok_path("KILN_SHARED", "oracle/ckpt/klein-tiny");
    CHECK(tokenize("--model", ckpt, "--text", "A cat") == 0);
    CHECKF(!strcmp(out_text, "32 8251\n"), "'%s' %s", out_text, err_text);
    /* A tokenizer folder; special tokens in the text are recognised. */
    const char *dir = tok_path("KILN_SHARED", "data/qwen3-tokenizer");
    CHECK(tokenize("--text", "<|im_start|>user\nA cat<|im_end|>", "--model", dir) == 0);
    CHECKF(!strcmp(out_text, "151644 872 198 32 8251 151645\n"), "'%s'", out_text);
    CHECK(tokenize("--model", dir, "--text", "") == 0 && !strcmp(out_text, "\n"));
}

static void test_errors(void)
{
    const char *dir = tok_path("KILN_SHARED", "data/qwen3-tokenizer");
    CHECK(tokenize("--model", dir, "--text", "bad \xC0\xAF") == 1);
    CHECKF(out_text[0] == '\0' && strstr(err_text, "kiln tokenize: ") && strstr(err_text, "UTF-8"),
           "%s", err_text);
    CHECK(tokenize("--model", "/nonexistent/kiln", "--text", "x") == 1);
    CHECKF(strstr(err_text, "tokenizer_config.json") != NULL, "%s", err_text);
    CHECK(tokenize("--model", dir, NULL, NULL) == 2 && strstr(err_text, "usage"));
    CHECK(tokenize("--model", dir, "--bogus", "x") == 2 && strstr(err_text, "--bogus"));
    CHECK(tokenize("--help", NULL, NULL, NULL) == 0 && strstr(out_text, "--text"));
}

int main(void)
{
    if (!getenv("KILN_BUILD_ROOT")) {
        fprintf(stderr, "needs KILN_BUILD_ROOT\n");
        return 2;
    }
    kiln_bin = test_build_path("tools/kiln");
    RUN(test_prints_ids);
    RUN(test_errors);
    return test_finish();
}
