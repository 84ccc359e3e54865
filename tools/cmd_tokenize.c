/* `kiln tokenize`: prints the Qwen3 token ids of a text, space-separated on
 * one line, exactly as tokenizer(text)["input_ids"] gives them (no chat
 * template, no padding). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "commands.h"
#include "models/tokenizer.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kiln tokenize --model DIR --text TEXT\n"
               "  --model DIR   checkpoint folder (its tokenizer/ is used) or a tokenizer folder\n"
               "  --text TEXT   the text to encode, as is (no chat template)\n");
}

int kiln_cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *text = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--model") && i + 1 < argc) {
            model = argv[++i];
        } else if (!strcmp(argv[i], "--text") && i + 1 < argc) {
            text = argv[++i];
        } else {
            fprintf(stderr, "kiln tokenize: unexpected argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (!model || !text) {
        fprintf(stderr, "kiln tokenize: --model and --text are required\n");
        usage(stderr);
        return 2;
    }
    char dir[4096];
    struct stat sb;
    if ((size_t)snprintf(dir, sizeof dir, "%s/tokenizer", model) >= sizeof dir ||
        stat(dir, &sb) || !S_ISDIR(sb.st_mode))
        snprintf(dir, sizeof dir, "%s", model);

    kiln_err err = {0};
    kiln_tokenizer *tok = kiln_tokenizer_load(dir, &err);
    if (!tok) {
        fprintf(stderr, "kiln tokenize: %s\n", err.msg);
        return 1;
    }
    int32_t *ids;
    size_t n;
    kiln_status st = kiln_tokenizer_encode(tok, text, strlen(text), &ids, &n, &err);
    kiln_tokenizer_free(tok);
    if (st) {
        fprintf(stderr, "kiln tokenize: %s\n", err.msg);
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        printf(i ? " %d" : "%d", (int)ids[i]);
    putchar('\n');
    free(ids);
    if (fflush(stdout)) {
        perror("kiln tokenize: stdout");
        return 1;
    }
    return 0;
}
