#!/usr/bin/env python3
"""The playground page (GET /) in a real browser: `kiln serve` on a tiny
checkpoint, then headless Chromium (Debian's `chromium` package) opens
/?prompt=...&size=256x256&steps=2&seed=42&run=1, which fills the form and
presses Generate; the page must show one image (a PNG data URL) with its
seed and its time.  A second run takes a screenshot of the result
(--screenshot FILE: docs/playground.png is one).

Skipped (exit 77) where no Chromium is installed, unless
KILN_REQUIRE_CHROMIUM=1 (CI installs it: scripts/install-deps.sh --test).
Environment: KILN_BUILD_ROOT (meson test sets it).  Exit 0 when it passed."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("KILN_BUILD_ROOT", "build")


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port_pair():
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            pass
    raise SystemExit("no free port pair")


def browser(exe, url, extra, timeout_s=300):
    # --virtual-time-budget lets the page run until it is idle (pending
    # fetches hold virtual time), then --dump-dom prints the DOM.
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--virtual-time-budget=600000"] + extra + [url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)


def main():
    screenshot = None
    if "--screenshot" in sys.argv:
        screenshot = os.path.abspath(sys.argv[sys.argv.index("--screenshot") + 1])
    exe = chromium()
    if not exe:
        if os.environ.get("KILN_REQUIRE_CHROMIUM") == "1":
            print("no chromium installed, and KILN_REQUIRE_CHROMIUM=1")
            return 1
        print("skipped: no chromium installed (apt-get install chromium)")
        return 77
    kiln = os.path.join(BUILD, "tools", "kiln")
    work = tempfile.mkdtemp(prefix="kiln-playground-")
    ckpt = os.path.join(work, "tiny")
    subprocess.run([kiln, "make-checkpoint", "--preset", "tiny", "--out", ckpt], check=True,
                   capture_output=True)
    port = free_port_pair()
    log = open(os.path.join(work, "serve.log"), "w")
    serve = subprocess.Popen([kiln, "serve", "--model", ckpt, "--port", str(port)], stdout=log,
                             stderr=subprocess.STDOUT)
    failed = 0
    try:
        deadline = time.time() + 300
        while "ready: http://" not in open(log.name).read():
            if serve.poll() is not None or time.time() > deadline:
                print("kiln serve did not get ready:\n" + open(log.name).read()[-3000:])
                return 1
            time.sleep(0.2)
        url = (f"http://127.0.0.1:{port}/?prompt=a%20kiln%20at%20night&size=256x256&steps=2"
               "&seed=42&run=1")
        t0 = time.time()
        r = browser(exe, url, ["--dump-dom"])
        dom = r.stdout
        print(f"chromium exited {r.returncode} after {time.time() - t0:.1f} s")
        checks = {
            "an image": '<img src="data:image/png;base64,iVBORw0KGgo' in dom,
            "its seed": "seed 42" in dom,
            "its time": "1 image(s) in" in dom,
            "the server's stage times": "server " in dom and ", denoise " in dom,
            "no error": 'class="error"' not in dom,
            "the model": ">tiny<" in dom,
        }
        for what, ok in checks.items():
            print(("ok  : " if ok else "FAIL: ") + what)
            failed += not ok
        if failed:
            print(dom[-3000:] or r.stderr[-3000:])
        if screenshot and not failed:
            r = browser(exe, url.replace("seed=42", "seed=7"),
                        [f"--screenshot={screenshot}", "--window-size=1100,700"])
            ok = os.path.exists(screenshot) and os.path.getsize(screenshot) > 0
            print(("ok  : " if ok else "FAIL: ") + "screenshot " + screenshot)
            failed += not ok
        # the gateway served it: the page, the models list and one generation each time
        access = open(log.name).read()
        ok = " GET / 200 " in access and " POST /v1/images/generations 200 " in access
        print(("ok  : " if ok else "FAIL: ") + "the gateway's access log shows the page's requests")
        failed += not ok
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=120)
        except subprocess.TimeoutExpired:
            serve.kill()
        log.close()
    if not failed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print("kept", work)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
