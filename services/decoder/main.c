/* kiln-decoder: the decode stage alone in its process (services/decoder/decoder.c). */
#include "services/common/worker.h"

int main(int argc, char **argv)
{
    const kiln_stage_ops *ops[] = {&kiln_decoder_ops};
    return kiln_worker_main(argc, argv, "kiln-decoder", ops, 1);
}
