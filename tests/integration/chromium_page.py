"""A page in real headless Chromium (Debian's `chromium`), driven over the DevTools protocol.

    with ChromiumPage(url, work_dir) as page:
        page.wait_for("document.body.dataset.state === 'live'", timeout_s=30)
        page.evaluate("document.title")
        page.screenshot(path)

Chromium runs with --headless --no-sandbox --disable-gpu, its own profile directory and
--remote-debugging-port=0; the port it picked is read from DevToolsActivePort. The
protocol is spoken over a websocket with aiohttp, on a private event loop.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp
from up_process import terminate

PACKAGE_HINT = ("Chromium is not installed: `apt-get install chromium` (Debian's package; "
                ".ci/run and `make test` install it when run as root)")


class ChromiumPage:
    def __init__(self, url: str, work_dir: Path, width: int = 1400, height: int = 1000,
                 start_timeout_s: float = 60.0) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            raise RuntimeError(PACKAGE_HINT)
        profile = work_dir / "chromium-profile"
        self.log_path = work_dir / "chromium.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [binary, "--headless", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                 f"--user-data-dir={profile}", "--remote-debugging-port=0",
                 "--remote-debugging-address=127.0.0.1", f"--window-size={width},{height}",
                 url], stdout=log, stderr=subprocess.STDOUT)
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        try:
            port = self._debug_port(profile / "DevToolsActivePort", start_timeout_s)
            target = self._page_target(port, url, start_timeout_s)
            self._session = self._loop.run_until_complete(self._open())
            self._ws = self._loop.run_until_complete(
                self._session.ws_connect(target, max_msg_size=64 << 20))
        except BaseException:
            self.close()
            raise

    def _debug_port(self, path: Path, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited:\n{self.log_path.read_text()[-3000:]}")
            if path.exists() and (lines := path.read_text().split()):
                return int(lines[0])
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not open its DevTools port:\n"
                           f"{self.log_path.read_text()[-3000:]}")

    def _page_target(self, port: int, url: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as a:
                pages = [t for t in json.loads(a.read()) if t.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.2)
        raise RuntimeError(f"chromium opened no page for {url}")

    async def _open(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    async def _call(self, method: str, params: dict, timeout_s: float) -> dict:
        call_id = next(self._ids)
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        async with asyncio.timeout(timeout_s):
            while True:
                message = await self._ws.receive()
                if message.type != aiohttp.WSMsgType.TEXT:
                    raise RuntimeError(f"DevTools connection ended: {message.type}")
                answer = json.loads(message.data)
                if answer.get("id") == call_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]

    def call(self, method: str, timeout_s: float = 30.0, **params: object) -> dict:
        return self._loop.run_until_complete(self._call(method, params, timeout_s))

    def evaluate(self, expression: str) -> object:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # While the page loads, `document.body` may still be null: that is "not yet".
        probe = f"(() => {{ try {{ return Boolean({expression}); }} catch (e) {{ return false; }} }})()"
        while not self.evaluate(probe):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never satisfied {expression!r}")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        if hasattr(self, "_ws"):
            self._loop.run_until_complete(self._ws.close())
        if hasattr(self, "_session"):
            self._loop.run_until_complete(self._session.close())
        terminate(self.process)
        self._loop.close()

    def __enter__(self) -> ChromiumPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
