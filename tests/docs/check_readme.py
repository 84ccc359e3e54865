#!/usr/bin/env python3
"""Runs every command of README.md's ```sh blocks, in order, as a new user
would after building: in an empty folder, with the build under test's
tools/ on PATH.  A command that fails fails the test, and so does a command
this script neither runs nor lists below with the reason it is skipped, so
the quick start cannot rot silently.

A line ending in `&` (kiln serve) starts in the background; the next line
runs once its log says `ready: http://` (every stage has loaded), and the
process is stopped with SIGINT at the end (it must exit 0).  The README's
port 8080 is replaced by a free one, so the test does not collide with
another service on the machine.  Every PNG the commands wrote must be one,
and every file a `> FILE` redirect wrote must be non-empty.

Environment: KILN_SOURCE_ROOT, KILN_BUILD_ROOT (meson test sets both).
Exit 0 when every command ran."""
import os
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time

SRC = os.environ.get("KILN_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KILN_BUILD_ROOT", os.path.join(SRC, "build"))

# Build steps the harness has done already (it tests the build it runs in).
SKIPPED = {
    "scripts/install-deps.sh": "installs Debian packages; the test machine has them",
    "meson": "the build under test is already configured",
    "ninja": "the build under test is already built",
    "export": "the build under test's tools/ is put on PATH instead",
}
RUN = {"kiln", "curl"}


def sh_commands(text):
    """The commands of the ```sh blocks, continuation lines joined."""
    cmds, block, pending = [], False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            block = line.strip() == "```sh" if not block else False
            continue
        if not block:
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line and not line.startswith("#"):
            cmds.append(line)
    return cmds


def free_port_pair():
    """A port P with P and P + 1 free (kiln serve's bus is on P + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65534:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            pass
    raise SystemExit("no free port pair")


def wait_ready(proc, log_path, timeout_s=300):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(log_path, errors="replace") as f:
            if "ready: http://" in f.read():
                return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def bad_pngs(work):
    """How many .png files in work are not PNGs (each named in a FAIL line)."""
    bad = 0
    for name in sorted(os.listdir(work)):
        if name.endswith(".png"):
            with open(os.path.join(work, name), "rb") as f:
                if f.read(8) != b"\x89PNG\r\n\x1a\n":
                    print(f"FAIL: {name} is not a PNG")
                    bad += 1
    return bad


def main():
    with open(os.path.join(SRC, "README.md")) as f:
        cmds = sh_commands(f.read())
    if not any(c.startswith("kiln serve") for c in cmds) or not any(
            c.startswith("curl") for c in cmds):
        print("README.md: the quick start lost its kiln serve or curl example")
        return 1
    port = free_port_pair()
    env = dict(os.environ)
    env["PATH"] = os.path.join(BUILD, "tools") + os.pathsep + env.get("PATH", "")
    failed, background = 0, []
    work = tempfile.mkdtemp(prefix="kiln-readme-")
    print("working in", work)
    for cmd in cmds:
        word = shlex.split(cmd, comments=True)[0]
        if word not in RUN:
            if word not in SKIPPED:
                print(f"FAIL: README command neither run nor skipped with a reason: {cmd}")
                failed += 1
            else:
                print(f"skip: {cmd}  ({SKIPPED[word]})")
            continue
        line = cmd.replace("8080", str(port))
        if line.endswith("&"):
            log = os.path.join(work, f"background-{len(background)}.log")
            with open(log, "w") as out:
                proc = subprocess.Popen(["bash", "-c", "exec " + line[:-1]], cwd=work, env=env,
                                        stdout=out, stderr=subprocess.STDOUT)
            background.append((cmd, proc, log))
            t0 = time.time()
            if not wait_ready(proc, log):
                print(f"FAIL: {cmd}: no ready line\n" + open(log, errors="replace").read()[-4000:])
                failed += 1
                break
            print(f"ok  : {cmd}  (ready after {time.time() - t0:.1f} s)")
            continue
        t0 = time.time()
        r = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=work, env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            print(f"FAIL: {cmd}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
            failed += 1
        else:
            print(f"ok  : {cmd}  ({time.time() - t0:.1f} s)")
        m = re.search(r">\s*(\S+)\s*$", line)
        if m and not r.returncode:
            path = os.path.join(work, m.group(1))
            if not os.path.exists(path) or os.path.getsize(path) == 0:
                print(f"FAIL: {cmd}: wrote nothing to {m.group(1)}")
                failed += 1
    for cmd, proc, log in background:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed after 120 s"
        if rc != 0:
            print(f"FAIL: {cmd}: exit {rc} after SIGINT\n" +
                  open(log, errors="replace").read()[-4000:])
            failed += 1
    failed += bad_pngs(work)
    print(f"{len(cmds)} commands, {failed} failed")
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
