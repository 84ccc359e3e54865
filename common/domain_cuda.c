/* The GPUs of a transport domain (common/domain.h): their UUIDs as the
 * CUDA runtime reports them, in nvidia-smi's "GPU-..." form.  Built for
 * real only with the CUDA backend (KILN_HAVE_CUDA). */
#include <stdio.h>

#include "domain.h"

#ifdef KILN_HAVE_CUDA
#include <cuda_runtime_api.h>

kiln_status kiln_domain_add_gpus(kiln_domain *d, int device, kiln_err *err)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return kiln_err_set(err, KILN_ERR_DEVICE, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
    }
    d->n_gpus = 0;
    d->gpu = -1;
    for (int i = 0; i < n && d->n_gpus < KILN_DOMAIN_MAX_GPUS; i++) {
        struct cudaDeviceProp p;
        if ((e = cudaGetDeviceProperties(&p, i)) != cudaSuccess) {
            cudaGetLastError();
            return kiln_err_set(err, KILN_ERR_DEVICE, "cudaGetDeviceProperties(%d): %s", i,
                                cudaGetErrorString(e));
        }
        const unsigned char *u = (const unsigned char *)p.uuid.bytes;
        snprintf(d->gpus[d->n_gpus], KILN_DOMAIN_GPU_MAX,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                 u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                 u[14], u[15]);
        if (i == device)
            d->gpu = d->n_gpus;
        d->n_gpus++;
    }
    return KILN_OK;
}

#else /* !KILN_HAVE_CUDA */

kiln_status kiln_domain_add_gpus(kiln_domain *d, int device, kiln_err *err)
{
    (void)d, (void)device;
    return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this build has no CUDA backend");
}

#endif
