/* kiln-encoder: the encode stage alone in its process (services/encoder/encoder.c). */
#include "services/common/worker.h"

int main(int argc, char **argv)
{
    const kiln_stage_ops *ops[] = {&kiln_encoder_ops};
    return kiln_worker_main(argc, argv, "kiln-encoder", ops, 1);
}
