/* kiln-denoiser: the denoise stage alone in its process (services/denoiser/denoiser.c). */
#include "services/common/worker.h"

int main(int argc, char **argv)
{
    const kiln_stage_ops *ops[] = {&kiln_denoiser_ops};
    return kiln_worker_main(argc, argv, "kiln-denoiser", ops, 1);
}
