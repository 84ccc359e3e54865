/* `kiln serve --precision fp8` (the FP8 mode, docs/OPERATIONS.md) on the
 * tiny klein checkpoint (CPU backend): the flag reaches the denoiser (its
 * log says how many weights it quantised), and two requests sent together
 * (so they may share a batch) each get exactly `kiln generate --precision
 * fp8`'s image for them, not the exact one. */
#include <stdio.h>
#include <string.h>

#include "common/buf.h"

#include "tests/service/svc_util.h"
#include "tests/test.h"

static int port;

static void test_served_is_cli_fp8(void)
{
    svc_client cs[2];
    char json[2][256], ref[2][64];
    for (int i = 0; i < 2; i++) {
        snprintf(json[i], sizeof json[i],
                 "{\"prompt\":\"fp8 %d\",\"size\":\"64x64\",\"seed\":%d,"
                 "\"num_inference_steps\":2,\"max_sequence_length\":32}", i, 40 + i);
        snprintf(ref[i], sizeof ref[i], "fp8-%d.png", i);
        char seed[16], prompt[16];
        snprintf(seed, sizeof seed, "%d", 40 + i);
        snprintf(prompt, sizeof prompt, "fp8 %d", i);
        const char *args[] = {"--prompt", prompt, "--seed", seed, "--width", "64", "--height",
                              "64", "--steps", "2", "--max-sequence-length", "32",
                              "--precision", "fp8", NULL};
        CHECK(svc_cli("generate", args, svc_tmp(ref[i])) == 0);
    }
    const char *exact[] = {"--prompt", "fp8 0", "--seed", "40", "--width", "64", "--height", "64",
                           "--steps", "2", "--max-sequence-length", "32", NULL};
    CHECK(svc_cli("generate", exact, svc_tmp("exact-0.png")) == 0);
    for (int i = 0; i < 2; i++)
        svc_client_send(&cs[i], port, json[i], ref[i]);
    CHECK(svc_clients_wait(cs, 2, SVC_T_REQ) == 0);
    for (int i = 0; i < 2; i++)
        CHECKF(cs[i].verdict == SVC_IMAGE, "request %d: %d %s", i, (int)cs[i].verdict, cs[i].why);
    kiln_buf a = {0};
    CHECK(svc_read_file(svc_tmp("fp8-0.png"), &a) == 0);
    CHECKF(!svc_same_file(svc_tmp("exact-0.png"), &a), "fp8 gave the exact image");
    kiln_buf_free(&a);
}

int main(void)
{
    if (svc_init("fp8"))
        return 1;
    const char *extra[] = {"--precision", "fp8", NULL};
    pid_t serve = svc_serve(1, extra, NULL, &port);
    CHECKF(serve > 0, "kiln serve --precision fp8 did not come up (logs in %s)", svc.tmpdir);
    if (serve > 0) {
        /* klein-tiny: 2 double blocks of 8 linear weights, 2 single of 3. */
        CHECK(svc_log_count(svc_tmp("serve.log"), "fp8 mode: 22 transformer block weights") == 1);
        RUN(test_served_is_cli_fp8);
        CHECKF(svc_stop(serve, 60000) == 0, "kiln serve did not stop cleanly");
    }
    int rc = test_finish();
    svc_cleanup(rc != 0);
    return rc;
}
