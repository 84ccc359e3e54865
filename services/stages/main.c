/* kiln-stages: several stages of the pipeline as threads of one process
 * (--stages, default all three), each a replica of its own to the gateway.
 * On one GPU they share a CUDA context, so their kernels overlap on their
 * own streams instead of time-slicing between processes
 * (services/common/worker_group.c, docs/ARCHITECTURE.md). */
#include "services/common/worker.h"

int main(int argc, char **argv)
{
    const kiln_stage_ops *ops[] = {&kiln_encoder_ops, &kiln_denoiser_ops, &kiln_decoder_ops};
    return kiln_worker_main(argc, argv, "kiln-stages", ops, 3);
}
