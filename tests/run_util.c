#include "run_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

const char *test_build_path(const char *rel)
{
    static char buf[4096];
    const char *root = getenv("KILN_BUILD_ROOT");
    snprintf(buf, sizeof buf, "%s/%s", root ? root : ".", rel);
    return buf;
}

/* An unlinked temporary file to catch one of the child's streams. */
static int capture_file(void)
{
    char path[] = "/tmp/kiln-test-log-XXXXXX";
    int fd = mkstemp(path);
    if (fd >= 0)
        unlink(path);
    return fd;
}

/* What the child wrote to fd, NUL-terminated, into buf (truncated to len). */
static void read_back(int fd, char *buf, size_t len)
{
    if (!buf || !len)
        return;
    ssize_t n = pread(fd, buf, len - 1, 0);
    buf[n > 0 ? n : 0] = '\0';
}

int test_run_capture(const char *exe, const char **argv, char *out, size_t out_len, char *log,
                     size_t len)
{
    int fd = capture_file(), out_fd = out ? capture_file() : -1;
    if (fd < 0 || (out && out_fd < 0)) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        if (dup2(fd, 2) < 0 || (out_fd >= 0 && dup2(out_fd, 1) < 0))
            _exit(127);
        argv[0] = exe;
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    int ok = pid > 0 && waitpid(pid, &status, 0) == pid;
    read_back(fd, log, len);
    close(fd);
    if (out_fd >= 0) {
        read_back(out_fd, out, out_len);
        close(out_fd);
    }
    if (!ok)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int test_run(const char *exe, const char **argv, char *log, size_t len)
{
    return test_run_capture(exe, argv, NULL, 0, log, len);
}
