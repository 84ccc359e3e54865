#!/usr/bin/env python3
"""The playground page (GET /) in a real browser: `kiln serve` on a tiny
checkpoint, then headless Chromium (Debian's `chromium` package) opens
/?prompt=...&size=256x256&steps=3&seed=42&previews=2&run=1, which fills the
form and presses Generate; the page streams the request (stream=true,
partial_images=2: live previews from the 2 steps before the last) and must
show one image (a PNG data URL) with its seed, the 2 previews it showed
before it, and its time.  A second run takes a screenshot of the result
(--screenshot FILE: docs/playground.png is one).

The page runs in real time under the DevTools protocol (a minimal
WebSocket client below: the standard library has none), not under
--virtual-time-budget: Chromium stops counting a fetch as pending once its
response starts, so a streamed body would be cut off when the virtual
budget runs out.

Skipped (exit 77) where no Chromium is installed, unless
KILN_REQUIRE_CHROMIUM=1 (CI installs it: scripts/install-deps.sh --test).
Environment: KILN_BUILD_ROOT (meson test sets it).  Exit 0 when it passed."""
import base64
import json
import os
import re
import shutil
import struct
import urllib.request
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


class DevTools:
    """Just enough of the Chrome DevTools protocol over a WebSocket
    (RFC 6455: masked text frames out, unmasked frames in) to evaluate
    expressions in a page."""

    def __init__(self, ws_url):
        hostport, path = ws_url[len("ws://"):].split("/", 1)
        host, port = hostport.rsplit(":", 1)
        self.s = socket.create_connection((host, int(port)), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.s.sendall(("GET /%s HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\n"
                        "Connection: Upgrade\r\nSec-WebSocket-Key: %s\r\n"
                        "Sec-WebSocket-Version: 13\r\n\r\n" % (path, hostport, key)).encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError("no WebSocket: %r" % head[:200])
        self.n = 0

    def _recv(self):
        d = self.s.recv(1 << 16)
        if not d:
            raise EOFError("DevTools closed the connection")
        return d

    def _take(self, n):
        while len(self.buf) < n:
            self.buf += self._recv()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _send(self, op, payload):
        mask, n = os.urandom(4), len(payload)
        head = bytes([0x80 | op])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _message(self):
        data = b""
        while True:
            h = self._take(2)
            op, n = h[0] & 0x0F, h[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._take(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._take(8))[0]
            mask = self._take(4) if h[1] & 0x80 else None
            part = self._take(n)
            if mask:
                part = bytes(b ^ mask[i % 4] for i, b in enumerate(part))
            if op == 9:  # ping
                self._send(10, part)
                continue
            data += part
            if h[0] & 0x80:
                return data

    def eval(self, expr):
        self.n += 1
        self._send(1, json.dumps({"id": self.n, "method": "Runtime.evaluate",
                                  "params": {"expression": expr, "returnByValue": True}}).encode())
        while True:
            m = json.loads(self._message())
            if m.get("id") == self.n:
                return m.get("result", {}).get("result", {}).get("value")


def run_page(exe, url, work, timeout_s=300):
    """Opens url in headless Chromium in real time, waits until the page's
    status says it is done (images or an error), and returns its DOM and
    whether a preview was seen on the page while the request ran."""
    dport = free_port_pair()
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--remote-debugging-port=%d" % dport,
            "--user-data-dir=" + os.path.join(work, "chromium-profile"), url]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout_s
        ws = None
        while not ws and time.time() < deadline:
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/json/list" % dport,
                                            timeout=5) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                ws = pages[0]["webSocketDebuggerUrl"] if pages else None
            except OSError:
                pass
            if not ws:
                time.sleep(0.2)
        if not ws:
            return "", False
        dt = DevTools(ws)
        live = False
        while time.time() < deadline:
            status = dt.eval("document.getElementById('status').textContent") or ""
            caps = dt.eval("[...document.querySelectorAll('figcaption')]"
                           ".map((c) => c.textContent).join('|')") or ""
            live = live or "preview" in caps
            if "image(s) in" in status and "server " in status or "Error" in status:
                break
            time.sleep(0.3)
        return dt.eval("document.documentElement.outerHTML") or "", live
    finally:
        proc.kill()
        proc.wait()


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
        url = (f"http://127.0.0.1:{port}/?prompt=a%20kiln%20at%20night&size=256x256&steps=3"
               "&seed=42&previews=2&run=1")
        t0 = time.time()
        dom, live = run_page(exe, url, work)
        print(f"page done after {time.time() - t0:.1f} s; a preview was seen while it ran: {live}")
        checks = {
            "an image": re.search(r'<img [^>]*src="data:image/png;base64,iVBORw0KGgo', dom)
                        is not None,
            "its seed": "seed 42" in dom,
            "its live previews": "(after 2 previews)" in dom and 'data-previews="2"' in dom,
            "its time": "1 image(s) in" in dom,
            "the server's stage times": "server " in dom and ", denoise " in dom,
            "no error": 'class="error"' not in dom,
            "the model": ">tiny<" in dom,
        }
        for what, ok in checks.items():
            print(("ok  : " if ok else "FAIL: ") + what)
            failed += not ok
        if failed:
            print(dom[-3000:])
        if screenshot and not failed:
            # without previews: the virtual-time run would stop mid-stream
            r = browser(exe, url.replace("seed=42", "seed=7").replace("previews=2", "previews=0"),
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
