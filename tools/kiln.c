/* kiln: the single-process command line (tokenize, encode, generate, edit,
 * make-checkpoint, serve, keygen).  Each command is implemented in tools/cmd_*.c. */
#include <stdio.h>
#include <string.h>

#include "commands.h"

const kiln_command kiln_commands[] = {
    {"make-checkpoint", "write a random-weight checkpoint with the real layout", kiln_cmd_make_checkpoint},
    {"generate", "text-to-image with a FLUX.2 klein checkpoint", kiln_cmd_generate},
    {"edit", "edit images with a FLUX.2 klein checkpoint", kiln_cmd_edit},
    {"tokenize", "print the Qwen3 token ids of a text", kiln_cmd_tokenize},
    {"encode", "prompt embeddings (Qwen3 text encoder) to a safetensors file", kiln_cmd_encode},
    {"serve", "run the HTTP service: gateway and stage replicas, supervised", kiln_cmd_serve},
    {"keygen", "write a CURVE keypair for the service bus", kiln_cmd_keygen},
    {0},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kiln <command> [options]\n\ncommands:\n");
    for (const kiln_command *c = kiln_commands; c->name; c++)
        fprintf(f, "  %-16s %s\n", c->name, c->summary);
    fprintf(f, "\nkiln <command> --help shows a command's options.\n");
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (const kiln_command *c = kiln_commands; c->name; c++)
        if (!strcmp(argv[1], c->name))
            return c->run(argc - 1, argv + 1);
    fprintf(stderr, "kiln: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
