/* A job's encoded images arrive from the decoder's pool threads, several
 * rows at once (services/decoder/decoder.c): kiln_worker_output_image must
 * keep every row, whichever thread allocates the job's row array.  The
 * first GPU soak with n = 4 lost row 0 this way ("image 0 missing", 500). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "services/common/worker_impl.h"
#include "tests/test.h"

enum { ROWS = 8, ROUNDS = 2000 };

typedef struct appender {
    kiln_worker_job *job;
    pthread_barrier_t *go;
    int row;
    kiln_status st;
} appender;

static void *append_row(void *arg)
{
    appender *a = arg;
    kiln_buf img = {0};
    kiln_err err = {0};
    char byte = (char)('a' + a->row);
    if (kiln_buf_append(&img, &byte, 1, &err)) {
        a->st = KILN_ERR_NOMEM;
        return NULL;
    }
    pthread_barrier_wait(a->go);
    a->st = kiln_worker_output_image(a->job, a->row, &img, &err);
    kiln_buf_free(&img);
    return NULL;
}

static void test_rows_from_threads(void)
{
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, ROWS);
    int lost = 0;
    for (int round = 0; round < ROUNDS; round++) {
        kiln_worker_job *job = calloc(1, sizeof *job);
        pthread_t th[ROWS];
        appender a[ROWS];
        for (int r = 0; r < ROWS; r++) {
            a[r] = (appender){job, &go, r, KILN_OK};
            CHECK(pthread_create(&th[r], NULL, append_row, &a[r]) == 0);
        }
        for (int r = 0; r < ROWS; r++)
            pthread_join(th[r], NULL);
        kiln_buf *images = atomic_load(&job->images);
        for (int r = 0; r < ROWS; r++) {
            CHECK(a[r].st == KILN_OK);
            lost += !images || images[r].len != 1 || images[r].data[0] != 'a' + r;
        }
        worker_job_free(job);
    }
    CHECKF(lost == 0, "%d of %d rows lost", lost, ROWS * ROUNDS);
    pthread_barrier_destroy(&go);
}

int main(void)
{
    RUN(test_rows_from_threads);
    return test_finish();
}
