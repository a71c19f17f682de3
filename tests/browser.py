"""Headless Chromium for tests: open a page, collect its console errors, take a screenshot.

Uses the Debian ``chromium`` package (no browser download) and talks the DevTools protocol over
``--remote-debugging-pipe`` (file descriptors 3 and 4, NUL-separated JSON), so no Python package
is needed. API for every test that renders a page:

    chromium_path() -> str | None          # the browser binary, or None when it is not installed
    render(url_or_file, screenshot=None) -> list[str]   # console errors, uncaught exceptions,
                                                        # failed loads; [] for a clean page
    requires_chromium                      # pytest mark: skip with a reason when it is absent
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

BINARIES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    """The headless-capable Chromium binary (``$CHROMIUM`` first), or None."""
    candidates = [os.environ.get("CHROMIUM"), *BINARIES]
    return next((shutil.which(c) for c in candidates if c and shutil.which(c)), None)


requires_chromium = pytest.mark.skipif(
    chromium_path() is None,
    reason="headless Chromium not installed (Debian: apt-get install -y chromium; "
    "or set CHROMIUM=/path/to/chromium)",
)


class _Pipe:
    """The DevTools protocol over Chromium's pipe: numbered commands, events kept in order."""

    def __init__(self, to_browser: int, from_browser: int, timeout_s: float):
        self.to_browser, self.from_browser = to_browser, from_browser
        self.deadline = time.monotonic() + timeout_s
        self.buffer, self.events, self.next_id = b"", [], 0

    def _read_message(self) -> dict:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self.from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read_message()
            self.events.append(event)
            if event.get("method") == method:
                return event

    def drain(self, seconds: float) -> None:
        """Keep collecting events for ``seconds`` (scripts that run after the load event)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not select.select([self.from_browser], [], [], left)[0]:
                return
            self.buffer += os.read(self.from_browser, 1 << 20)
            while b"\0" in self.buffer:
                message, self.buffer = self.buffer.split(b"\0", 1)
                self.events.append(json.loads(message))


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed loads, one line each."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])
            )
            errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            description = details.get("exception", {}).get("description") or details.get("text")
            errors.append(f"uncaught: {description}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            errors.append(
                f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()
            )
    return errors


def _high_pipe() -> tuple[int, int]:
    """A pipe whose ends are numbered 10 or more, so moving them to 3 and 4 clobbers neither."""
    ends = os.pipe()
    high = tuple(fcntl.fcntl(end, fcntl.F_DUPFD_CLOEXEC, 10) for end in ends)
    for end in ends:
        os.close(end)
    return high


def render(
    url_or_file: str | Path,
    screenshot: Path | None = None,
    *,
    wait_s: float = 0.5,
    timeout_s: float = 60.0,
    width: int = 1280,
) -> list[str]:
    """Open a URL (or a local file) in headless Chromium; return its console errors.

    Waits for the load event plus ``wait_s`` for late scripts. With ``screenshot``, writes a PNG
    of the whole page (``width`` pixels wide). Raises when Chromium is missing or hangs.
    """
    binary = chromium_path()
    if binary is None:
        raise RuntimeError("chromium is not installed")
    url = str(url_or_file)
    if "://" not in url:
        url = Path(url).resolve().as_uri()
    to_browser_r, to_browser_w = _high_pipe()
    from_browser_r, from_browser_w = _high_pipe()
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    log = open(Path(profile) / "chromium.log", "w+b")  # noqa: SIM115 (closed in finally)

    # Chromium reads commands on fd 3 and writes replies on fd 4: bash moves the pipes there.
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--remote-debugging-pipe",
        f"--user-data-dir={profile}",
        f"--window-size={width},900",
        "about:blank",
    ]
    process = subprocess.Popen(
        ["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}', "bash", *command],
        stdout=subprocess.DEVNULL,
        stderr=log,
        pass_fds=(to_browser_r, from_browser_w),
    )
    os.close(to_browser_r)
    os.close(from_browser_w)
    pipe = _Pipe(to_browser_w, from_browser_r, timeout_s)
    try:
        target = pipe.send("Target.createTarget", url="about:blank")["targetId"]
        session = pipe.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            pipe.send(f"{domain}.enable", session)
        pipe.send("Page.navigate", session, url=url)
        pipe.wait_for("Page.loadEventFired")
        pipe.drain(wait_s)
        if screenshot is not None:
            size = pipe.send("Page.getLayoutMetrics", session)["cssContentSize"]
            shot = pipe.send(
                "Page.captureScreenshot",
                session,
                format="png",
                captureBeyondViewport=True,
                clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1},
            )
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        return _errors(pipe.events)
    except (RuntimeError, TimeoutError) as err:
        log.seek(0)
        lines = [
            line
            for line in log.read().decode(errors="replace").splitlines()
            if line.strip() and "dbus" not in line
        ]
        raise RuntimeError(
            f"{err} (chromium's last log line: {lines[-1] if lines else 'none'})"
        ) from None
    finally:
        try:
            pipe.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        process.kill()
        process.wait()
        os.close(to_browser_w)
        os.close(from_browser_r)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)
