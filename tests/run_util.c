#include "run_util.h"

#include <fcntl.h>
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

int test_run(const char *exe, const char **argv, char *log, size_t len)
{
    char log_path[] = "/tmp/kiln-test-log-XXXXXX";
    int fd = mkstemp(log_path);
    if (fd < 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        if (dup2(fd, 2) < 0)
            _exit(127);
        argv[0] = exe;
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    int ok = pid > 0 && waitpid(pid, &status, 0) == pid;
    if (log && len) {
        ssize_t n = pread(fd, log, len - 1, 0);
        log[n > 0 ? n : 0] = '\0';
    }
    close(fd);
    unlink(log_path);
    if (!ok)
        return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
