/* The `kiln serve` supervisor with real child processes (small sh
 * scripts): a crashing child is restarted with a growing backoff, SIGTERM
 * stops the front child before the back ones, and the supervisor exits 0
 * with no child left behind. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/test.h"
#include "tools/supervisor.h"

static char dir[128];

static int count_lines(const char *name, char *content, size_t cap)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(content, 1, cap - 1, f);
    content[n] = '\0';
    fclose(f);
    int lines = 0;
    for (size_t i = 0; i < n; i++)
        lines += content[i] == '\n';
    return lines;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts))
        ;
}

static void test_restart_and_ordered_stop(void)
{
    char crash[256], front[512], back[512];
    snprintf(crash, sizeof crash, "echo start >> %s/crash; exit 3", dir);
    /* The front child takes a moment to drain; the back child must still
     * be running then, and hear its TERM only afterwards. */
    snprintf(front, sizeof front,
             "trap 'echo front >> %s/order; sleep 0.3; echo front-done >> %s/order; exit 0' TERM;"
             " while :; do sleep 0.05; done", dir, dir);
    snprintf(back, sizeof back,
             "echo $$ > %s/back.pid; trap 'echo back >> %s/order; exit 0' TERM;"
             " while :; do sleep 0.05; done", dir, dir);
    kiln_err err = {0};
    kiln_supervisor *s = kiln_supervisor_create(&err);
    CHECK(s != NULL);
    if (!s)
        return;
    kiln_supervisor_set_grace(s, 10);
    CHECK(kiln_supervisor_add(s, "crasher", KILN_CHILD_BACK,
                              (const char *[]){"/bin/sh", "-c", crash, NULL}, &err) == KILN_OK);
    CHECK(kiln_supervisor_add(s, "front", KILN_CHILD_FRONT,
                              (const char *[]){"/bin/sh", "-c", front, NULL}, &err) == KILN_OK);
    CHECK(kiln_supervisor_add(s, "back", KILN_CHILD_BACK,
                              (const char *[]){"/bin/sh", "-c", back, NULL}, &err) == KILN_OK);
    CHECK(kiln_supervisor_add(s, "missing", KILN_CHILD_BACK,
                              (const char *[]){"/nonexistent/kiln-x", NULL}, &err) ==
          KILN_ERR_NOT_FOUND);

    pid_t pid = fork();
    if (pid == 0)
        _exit(kiln_supervisor_run(s));
    /* Starts at 0, 0.25, 0.75, 1.75 s: four in 2 s, not hundreds. */
    sleep_ms(2000);
    CHECK(kill(pid, SIGTERM) == 0);
    int status = -1;
    double t0 = (double)time(NULL);
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK((double)time(NULL) - t0 < 8);
    char buf[4096];
    int starts = count_lines("crash", buf, sizeof buf);
    CHECKF(starts >= 3 && starts <= 5, "crasher started %d times in 2 s", starts);
    int lines = count_lines("order", buf, sizeof buf);
    CHECKF(lines == 3 && !strcmp(buf, "front\nfront-done\nback\n"), "stop order: %s", buf);
    /* The back child was stopped and reaped, not left running. */
    CHECK(count_lines("back.pid", buf, sizeof buf) == 1);
    long back_pid = strtol(buf, NULL, 10);
    CHECK(back_pid > 0 && kill((pid_t)back_pid, 0) != 0);
    kiln_supervisor_destroy(s);
}

/* A child that reports a configuration error (EX_CONFIG) is not restarted:
 * the supervisor stops the others and returns 1 by itself. */
static void test_config_error(void)
{
    char bad[512], other[256];
    /* Fails once the other child is surely up. */
    CHECK(snprintf(bad, sizeof bad,
                   "echo start >> %s/bad; while [ ! -s %s/other.pid ]; do sleep 0.01; done; "
                   "exit 78",
                   dir, dir) < (int)sizeof bad);
    CHECK(snprintf(other, sizeof other, "echo $$ > %s/other.pid; exec sleep 30", dir) <
          (int)sizeof other);
    kiln_err err = {0};
    kiln_supervisor *s = kiln_supervisor_create(&err);
    if (!s)
        return;
    kiln_supervisor_set_grace(s, 10);
    CHECK(kiln_supervisor_add(s, "other", KILN_CHILD_BACK,
                              (const char *[]){"/bin/sh", "-c", other, NULL}, &err) == KILN_OK);
    CHECK(kiln_supervisor_add(s, "bad", KILN_CHILD_BACK,
                              (const char *[]){"/bin/sh", "-c", bad, NULL}, &err) == KILN_OK);
    pid_t pid = fork();
    if (pid == 0)
        _exit(kiln_supervisor_run(s));
    int status = -1;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    char buf[256];
    CHECK(count_lines("bad", buf, sizeof buf) == 1);
    CHECK(count_lines("other.pid", buf, sizeof buf) == 1);
    long other_pid = strtol(buf, NULL, 10);
    CHECK(other_pid > 0 && kill((pid_t)other_pid, 0) != 0);
    kiln_supervisor_destroy(s);
}

static void test_find_exe(void)
{
    char out[4096];
    kiln_err err = {0};
    CHECK(kiln_supervisor_find_exe("kiln-no-such-binary", out, sizeof out, &err) ==
          KILN_ERR_NOT_FOUND);
    CHECK(strstr(err.msg, "kiln-no-such-binary") != NULL);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln-test-supervisor-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_restart_and_ordered_stop);
    RUN(test_config_error);
    RUN(test_find_exe);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd))
        fprintf(stderr, "could not remove %s\n", dir);
    return test_finish();
}
