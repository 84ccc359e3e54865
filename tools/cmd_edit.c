/* kiln edit: FLUX.2 klein image editing with 1..8 reference images. */
#include "cli_pipeline.h"
#include "commands.h"

int kiln_cmd_edit(int argc, char **argv)
{
    cli_gen_opts o;
    int rc = cli_parse_gen_args(argc, argv, 1, &o);
    return rc ? rc : cli_run_pipeline("edit", &o);
}
