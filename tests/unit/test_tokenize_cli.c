/* `kiln tokenize` end to end: the built binary, its stdout, exit codes and
 * error messages. */
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/test.h"
#include "tok_fixture.h"

static char kiln_bin[4096], tmpdir[] = "/tmp/kiln-tokcli-XXXXXX";
static char out_text[65536], err_text[4096];

static void read_back(const char *path, char *buf, size_t len)
{
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    size_t n = fread(buf, 1, len - 1, f);
    buf[n] = '\0';
    fclose(f);
}

/* Runs `kiln tokenize` with the given arguments (NULL-terminated); returns
 * the exit status, with stdout and stderr in out_text and err_text. */
static int tokenize(const char *a0, const char *a1, const char *a2, const char *a3)
{
    char out_path[128], err_path[128];
    snprintf(out_path, sizeof out_path, "%s/out", tmpdir);
    snprintf(err_path, sizeof err_path, "%s/err", tmpdir);
    const char *argv[] = {kiln_bin, "tokenize", a0, a1, a2, a3, NULL};
    pid_t pid = fork();
    if (pid == 0) {
        int o = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        int e = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0)
            _exit(127);
        execv(kiln_bin, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
        return -1;
    read_back(out_path, out_text, sizeof out_text);
    read_back(err_path, err_text, sizeof err_text);
    unlink(out_path);
    unlink(err_path);
    return WEXITSTATUS(status);
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
    const char *build = getenv("KILN_BUILD_ROOT");
    if (!build || !mkdtemp(tmpdir)) {
        fprintf(stderr, "needs KILN_BUILD_ROOT and a temporary folder\n");
        return 2;
    }
    snprintf(kiln_bin, sizeof kiln_bin, "%s/tools/kiln", build);
    RUN(test_prints_ids);
    RUN(test_errors);
    rmdir(tmpdir);
    return test_finish();
}
