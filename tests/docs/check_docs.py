#!/usr/bin/env python3
"""Every command of docs/*.md, as written: each line of their code blocks
(```sh blocks and indented blocks; continuation lines joined) is run on
the CPU, checked, or named below as not runnable here with the reason, and
a line this script does not know fails the test, so a new command in the
docs cannot go untested silently.  README.md's indented blocks are taken
too (its ```sh quick start has its own test, check_readme.py).

What each kind of line gets:
- run: executed with bash in one work folder, in document order, with the
  build under test's tools/ and services on PATH, against `kiln serve` on
  the tiny checkpoint started by this script (the docs' examples assume a
  running service, as the README's quick start leaves one) with port 8000
  replaced by a free one.  Fixtures the docs name (the README's cat.png, a
  hat.jpg) are made with `kiln generate` first.  Port 8080 (the README's)
  is replaced as 8000 is.  It must exit 0, a `> FILE`
  must be non-empty, every PNG written must be one, and every request the
  commands made must have been answered 2xx (the gateway's access log).
- synopsis: a usage line with placeholders (DIR, [...]): every option it
  names must be in the program's --help.
- GPU: needs a CUDA GPU (tools/gpu/, benchmarks, --device cuda): printed as
  "gpu :" with the reason, never silently dropped; docs/GPU_CHECKS.md says
  how those run.
- skip: not runnable in a test for the reason printed (build steps the
  harness did, containers, a cluster, a network download).
- text: output, diagrams and configuration shown in code blocks.

Environment: KILN_SOURCE_ROOT, KILN_BUILD_ROOT (meson test sets both).
Exit 0 when every line passed."""
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_readme import bad_pngs, free_port_pair, wait_ready  # noqa: E402

SRC = os.environ.get("KILN_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("KILN_BUILD_ROOT", os.path.join(SRC, "build"))

GPU_HOST = "runs on the GPU machine (docs/GPU_CHECKS.md; tools/gpu/check.sh sections)"
# (pattern on the joined line, kind, reason); the first match decides.
RULES = [
    (r"^tools/gpu/build\.sh\b", "gpu", "the CUDA build for the GPU machine (nvcc, minutes)"),
    (r"^tools/gpu/", "gpu", GPU_HOST),
    (r"^tar -xJf tmp/devpack\.tar\.xz", "gpu",
     "unpacks tools/gpu/pack.sh's archive on the GPU machine"),
    (r"^(KILN_BENCH_\w+=|export KILN_BENCH_|export KILN_BUILD=)", "gpu",
     "GPU benchmark runs (tools/gpu/bench.sh)"),
    (r"^(KILN_\w+=\S+ )+tools/gpu/", "gpu", GPU_HOST),
    (r"^ncu ", "gpu", "Nsight Compute kernel profile on the GPU"),
    (r"^(meson setup build-bench-cuda|ninja -C build-bench-cuda|\.\./shared/device/|"
     r"pip download )", "gpu", "prepares the GPU benchmark's bundle (CUDA build)"),
    (r"^KILN_FAULT_INJECT=.*--device cuda", "gpu",
     "a device fault on a CUDA replica (tools/gpu/check.sh devicefault)"),
    (r"(^|\s)(dir=\$\()?huggingface-cli download", "skip",
     "downloads a published checkpoint (8-18 GB from the Hugging Face hub)"),
    (r"^kiln serve .*--device cuda", "gpu", "serves a published checkpoint on a GPU"),
    (r"^kiln (generate|edit|encode) .*--device cuda", "gpu",
     "runs a published checkpoint on a GPU"),
    (r"^scripts/install-deps\.sh", "skip", "installs Debian packages; the test machine has them"),
    (r"^scripts/run\.sh$", "skip",
     "installs, builds and serves until stopped; check_readme.py runs the quick start's steps"),
    (r"^scripts/test\.sh$", "skip", "the test suite this test runs in"),
    (r"^sudo deploy/test\.sh", "skip",
     "the container end-to-end test: root and Podman, 15-30 minutes, run by hand"),
    (r"^(T=\$\(mktemp -d /var/tmp/ct\.|sudo KILN_CT_DIR=\S+ .*deploy/test\.sh|"
     r"sudo env CONTAINERS_CONF=\S+ .*podman system reset|sudo rm -rf \"\$T\")", "skip",
     "the container test from nothing in a Podman storage of its own: root and Podman, run "
     "by hand"),
    (r"^[a-z]+/ {2,}\S", "text", "the source tree's layout"),
    (r"^meson setup build ", "skip", "the build under test is already configured"),
    (r"^ninja -C build$", "skip", "the build under test is already built"),
    (r"^ninja -C build tools/bench/kiln-handoffbench", "skip",
     "rebuilds build/ and runs a benchmark (not a check)"),
    (r"^(meson setup build-rel |ninja -C build-rel |apt-get download |build-rel/tools/bench/)",
     "skip", "the PNG encoder benchmark: a release build and Debian's wallpapers (a "
     "measurement, not a check)"),
    (r"^(podman|podman-compose|KILN_MODEL=\S+ podman-compose|deploy/make-keys\.sh) ", "skip",
     "container deployment: root and Podman; `sudo deploy/test.sh` runs the compose stack by "
     "hand, deploy_check validates the files"),
    (r"^kubectl ", "skip",
     "needs a Kubernetes cluster; deploy_check validates the manifests offline"),
    (r"/v1/traces/req_0123456789abcdef", "skip",
     "its id is the one the line before printed; the two lines after it do the same with a "
     "client-chosen id and run"),
    (r"^\d\d:\d\d:\d\d\.\d+ \[", "text", "log output"),
    (r"^(externalRules:|- seriesQuery:|resources:|metricsQuery:)", "text",
     "configuration (prometheus-adapter rules)"),
    (r"^(kiln [a-z-]+|kiln-[a-z]+) .*(\bDIR\b|\[|\.\.\.|\bTEXT\b)", "synopsis", ""),
    (r"^(kiln |curl |cat |\(printf )", "run", ""),
]


def blocks(path, fenced=True):
    """(line number, kind, text, block number) per logical line of the
    file's code blocks; kind is the fence's language ("sh", "json",
    "python", "" for a plain fence) or "indented".  fenced=False: indented
    blocks only."""
    out, lines = [], open(path).read().splitlines()
    n_block = 0
    i, prev_blank = 0, True
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("```"):
            lang = line.strip()[3:].strip()
            i += 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append((i + 1, lines[i]))
                i += 1
            i += 1
            n_block += 1
            if fenced:
                out += [(n, lang, t, n_block) for n, t in join(body, lang == "sh")]
            prev_blank = False
            continue
        if line.startswith("    ") and line.strip() and prev_blank:
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                if lines[i].strip():
                    body.append((i + 1, lines[i][4:]))
                i += 1
            n_block += 1
            out += [(n, "indented", t, n_block) for n, t in join(body, True)]
            prev_blank = False
            continue
        prev_blank = not line.strip()
        i += 1
    return out


def join(body, shell):
    """Logical lines: a trailing backslash, or (outside ```sh) a line
    indented past the first, continues the line before."""
    out, pending, start = [], None, 0
    for n, t in body:
        if pending is not None and pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " " + t.strip()
        elif pending is not None and shell and t.startswith(" ") and not t.strip().startswith("#"):
            pending += " " + t.strip()
        else:
            if pending is not None:
                out.append((start, pending))
            pending, start = t.rstrip(), n
    if pending is not None:
        out.append((start, pending))
    return [(n, t.strip()) for n, t in out if t.strip() and not t.strip().startswith("#")]


def classify(lang, text):
    if lang in ("json", ""):
        return "text", "output or a diagram"
    if lang == "python":
        return "skip", ("the openai Python SDK (from PyPI, not installed here); tools/sdk_check.py "
                        "runs the same calls against a service")
    for pat, kind, why in RULES:
        if re.search(pat, text):
            return kind, why
    return None, None


def program(text, env):
    """The argv prefix whose --help documents a synopsis line."""
    words = text.split()
    if words[0] == "kiln":
        return [shutil.which("kiln", path=env["PATH"]), words[1]]
    return [shutil.which(words[0], path=env["PATH"]) or words[0]]


def check_synopsis(text, env):
    argv = program(text, env)
    r = subprocess.run(argv + ["--help"], capture_output=True, text=True, env=env, timeout=60)
    helptext = r.stdout + r.stderr
    opts = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*|-[nq])\b", text)) - {"--help"}
    missing = sorted(o for o in opts if not re.search(r"(?<![\w-])" + re.escape(o) + r"\b",
                                                      helptext))
    return missing, r.returncode


def run_fixture(argv, work, env, what):
    t0 = time.time()
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    print(f"fixture: {what}: {' '.join(argv[1:])}  ({time.time() - t0:.1f} s)")
    if r.returncode:
        raise SystemExit(f"FAIL: fixture {what}: exit {r.returncode}\n{r.stderr[-3000:]}")


def main():
    docs = sorted(glob.glob(os.path.join(SRC, "docs", "*.md")))
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.join(BUILD, "tools"), os.path.join(BUILD, "services"),
                                   os.path.join(BUILD, "services", "gateway"),
                                   os.path.join(BUILD, "tools", "bench"), env.get("PATH", "")])
    plan, failed = [], 0
    for path in [os.path.join(SRC, "README.md")] + docs:
        gpu_block = None
        for n, lang, text, block in blocks(path, fenced=not path.endswith("README.md")):
            kind, why = classify(lang, text)
            if kind == "gpu" and text.startswith("kiln serve "):
                gpu_block = block
            elif kind == "run" and gpu_block == block and text.startswith("curl "):
                # it talks to the GPU service the block started above
                kind, why = "gpu", "asks the GPU service the lines above started"
            where = f"{os.path.relpath(path, SRC)}:{n}"
            if kind is None:
                print(f"FAIL: {where}: neither run, checked nor listed with a reason: {text}")
                failed += 1
            plan.append((where, kind, why, text))
    work = tempfile.mkdtemp(prefix="kiln-docs-")
    print("working in", work)
    kiln = shutil.which("kiln", path=env["PATH"])
    run_fixture([kiln, "make-checkpoint", "--preset", "tiny", "--out", "ckpt/tiny"], work, env,
                "the tiny checkpoint (the docs' DIR)")
    run_fixture([kiln, "generate", "--model", "ckpt/tiny", "--prompt", "a cat", "--seed", "42",
                 "--width", "256", "--height", "256", "-q", "--out", "cat.png"], work, env,
                "the README's cat.png")
    run_fixture([kiln, "generate", "--model", "ckpt/tiny", "--prompt", "a hat", "--seed", "7",
                 "--width", "128", "--height", "128", "-q", "--out", "hat.jpg"], work, env,
                "a hat.jpg reference")
    port = free_port_pair()
    log = os.path.join(work, "serve.log")
    with open(log, "w") as out:
        serve = subprocess.Popen([kiln, "serve", "--model", "ckpt/tiny", "--port", str(port)],
                                 cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    print(f"fixture: kiln serve --model ckpt/tiny --port {port} (the docs' service on 8000)")
    try:
        t0 = time.time()
        if not wait_ready(serve, log):
            print("FAIL: kiln serve: no ready line\n" + open(log, errors="replace").read()[-4000:])
            return 1
        print(f"ok  : kiln serve ready after {time.time() - t0:.1f} s")
        for where, kind, why, text in plan:
            if kind in ("gpu", "skip"):
                print(f"{kind:4}: {where}: {text[:100]}  ({why})")
            elif kind == "synopsis":
                missing, rc = check_synopsis(text, env)
                bad = missing or rc
                print(f"{'FAIL' if bad else 'ok  '}: {where}: synopsis of {text.split()[0]}"
                      f"{' ' + text.split()[1] if text.startswith('kiln ') else ''}"
                      f"{': --help exit %d' % rc if rc else ''}"
                      f"{': not in --help: ' + ' '.join(missing) if missing else ''}")
                failed += bool(bad)
            elif kind == "run":
                line = re.sub(r"(localhost|127\.0\.0\.1):80[08]0\b", rf"\g<1>:{port}", text)
                t0 = time.time()
                r = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=work, env=env,
                                   capture_output=True, text=True, timeout=600)
                ok = r.returncode == 0
                m = re.search(r">\s*(\S+)\s*$", line)
                if ok and m:
                    target = os.path.join(work, m.group(1))
                    ok = os.path.exists(target) and os.path.getsize(target) > 0
                print(f"{'ok  ' if ok else 'FAIL'}: {where}: {text[:100]}  ({time.time() - t0:.1f} s)")
                if not ok:
                    print(f"  exit {r.returncode}\n{r.stdout[-1500:]}{r.stderr[-3000:]}")
                failed += not ok
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            rc = serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
            rc = "killed"
    if rc != 0:
        print(f"FAIL: kiln serve exit {rc} after SIGINT")
        failed += 1
    access = [l for l in open(log, errors="replace").read().splitlines() if "access: " in l]
    errors = [l for l in access if not re.search(r" (GET|POST) \S+ 2\d\d ", l)]
    for l in errors:
        print("FAIL: answered with an error: " + l)
    failed += len(errors)
    print(f"ok  : the service answered {len(access)} requests, all 2xx" if not errors else "")
    failed += bad_pngs(work)
    kinds = {}
    for _, kind, _, _ in plan:
        kinds[kind] = kinds.get(kind, 0) + 1
    print("lines: " + ", ".join(f"{k or 'unknown'} {v}" for k, v in sorted(kinds.items(),
                                                                           key=str)))
    print(f"{len(plan)} lines, {failed} failed")
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
