"""Headless Chromium for tests (the Debian package; nothing is downloaded).

``render`` opens a page over the DevTools protocol on a pipe (``--remote-debugging-pipe``, so no
websocket library is needed) and returns the page's console errors: ``console.error`` calls,
uncaught exceptions, failed loads and a failed navigation. Tests that need it carry the
``requires_chromium`` marker, which skips them, with the reason, when no chromium is installed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser")
SETTLE_S = 3.0      # after the load event: time for a script-built page to render and fetch
TIMEOUT_S = 60.0    # the whole render, start to close


def chromium_path() -> str | None:
    """The installed chromium executable, or None."""
    return next((path for path in map(shutil.which, NAMES) if path), None)


requires_chromium = pytest.mark.skipif(
    chromium_path() is None,
    reason="headless Chromium not installed (apt-get install -y chromium; .ci/run does it as root)",
)


class _Pipe:
    """DevTools protocol messages (JSON, NUL-terminated) over the two pipes chromium was given."""

    def __init__(self, to_browser: int, from_browser: int, deadline: float):
        self.to_browser, self.from_browser, self.deadline = to_browser, from_browser, deadline
        self.buffer, self.next_id, self.events = b"", 0, []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Send a command and return its result; events read meanwhile are kept in ``events``."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.read(self.deadline)
            if reply is None:
                raise TimeoutError(f"chromium did not answer {method} in time")
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"chromium: {method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def read(self, until: float) -> dict | None:
        """The next message, or None when ``until`` passes first."""
        while b"\0" not in self.buffer:
            left = min(until, self.deadline) - time.monotonic()
            if left <= 0 or not select.select([self.from_browser], [], [], left)[0]:
                return None
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def drain(self, seconds: float) -> None:
        """Collect events for ``seconds``."""
        until = time.monotonic() + seconds
        while (event := self.read(until)) is not None:
            self.events.append(event)


def _console_error(event: dict) -> str | None:
    method, params = event.get("method"), event.get("params", {})
    if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
        return " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
    if method == "Runtime.exceptionThrown":
        details = params.get("exceptionDetails", {})
        return details.get("exception", {}).get("description") or details.get("text", "exception")
    if method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
        entry = params["entry"]
        return f"{entry.get('text', '')} {entry.get('url', '')}".strip()
    return None


def render(url_or_file: str | Path, screenshot: Path | None = None) -> list[str]:
    """Open a URL (or a local file) in headless Chromium and return its console errors; with
    ``screenshot``, save a PNG of the rendered page there."""
    executable = chromium_path()
    if executable is None:
        raise RuntimeError("chromium is not installed")
    url = str(url_or_file)
    if "://" not in url:
        url = Path(url_or_file).resolve().as_uri()
    to_read, to_browser = os.pipe()
    from_browser, to_write = os.pipe()
    with tempfile.TemporaryDirectory(prefix="ccr-chromium-") as profile:
        args = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1280,1000"]
        # the DevTools pipe must be file descriptors 3 (commands in) and 4 (replies out); bash, as
        # dash redirects only single-digit descriptors
        process = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_read} 4>&{to_write}', *args, "about:blank"],
            pass_fds=(to_read, to_write), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_read)
        os.close(to_write)
        try:
            pipe = _Pipe(to_browser, from_browser, time.monotonic() + TIMEOUT_S)
            target = pipe.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                pipe.send(f"{domain}.enable", session=session)
            errors = []
            navigation = pipe.send("Page.navigate", {"url": url}, session=session)
            if navigation.get("errorText"):
                errors.append(f"navigation to {url} failed: {navigation['errorText']}")
            pipe.drain(SETTLE_S)
            errors += [text for text in map(_console_error, pipe.events) if text is not None]
            if screenshot is not None:
                shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session=session)
                Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
            pipe.send("Browser.close")
            process.wait(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            os.close(to_browser)
            os.close(from_browser)
    return errors
