/* kiln generate: FLUX.2 klein text-to-image in one process. */
#include "cli_pipeline.h"
#include "commands.h"

int kiln_cmd_generate(int argc, char **argv)
{
    cli_gen_opts o;
    int rc = cli_parse_gen_args(argc, argv, 0, &o);
    return rc ? rc : cli_run_pipeline("generate", &o);
}
