"""Headless Chromium driven over the DevTools protocol (no Selenium, no Playwright): open a page,
wait for what its JavaScript renders, read it, take a screenshot. For the dashboard test."""

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.requirements import skip_unless_ci


def chromium_binary() -> str:
    """Debian's chromium (`./dev test` installs it); skip, or fail under CI=true, without it."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    skip_unless_ci("no chromium: `./dev test` installs it (apt-get install chromium)")
    raise AssertionError("unreachable")


class Browser:
    """One headless Chromium process and one page, over a DevTools websocket."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self.profile = tempfile.TemporaryDirectory(prefix="iterserve-chromium-")
        self.process: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.socket: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)

    async def __aenter__(self) -> "Browser":
        self.process = subprocess.Popen(
            [chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile.name}", f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)  # its own process group: its helper processes go with it
        port = await asyncio.wait_for(asyncio.to_thread(self._devtools_port), 60)
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as response:
            pages = [target for target in await response.json() if target["type"] == "page"]
        self.socket = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        await self.call("Page.enable")
        await self.call("Runtime.enable")
        return self

    def _devtools_port(self) -> int:
        for line in self.process.stderr:
            match = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if match:
                return int(match.group(1))
        raise RuntimeError("chromium exited without opening its DevTools port")

    async def __aexit__(self, *exc_info) -> None:
        if self.socket is not None:
            await self.socket.close()
        if self.session is not None:
            await self.session.close()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # the browser and its helpers, which write the profile
            self.process.wait(timeout=30)
            self.process.stderr.close()
        deadline = time.monotonic() + 10
        while True:  # a helper killed with the group may still be exiting, its last files being written
            try:
                self.profile.cleanup()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    async def call(self, method: str, **params) -> dict:
        message_id = next(self._ids)
        await self.socket.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            message = await asyncio.wait_for(self.socket.receive(), 60)
            if message.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"DevTools connection ended: {message.type}")
            reply = json.loads(message.data)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    async def open(self, url: str) -> None:
        """Navigate, and return once the page has loaded."""
        await self.call("Page.navigate", url=url)
        await self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
                            what=f"{url} loaded")

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0, what: str = ""):
        """Until the expression is truthy in the page; its value."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"the page never showed {what or expression}")
            await asyncio.sleep(0.25)

    async def screenshot(self, path: Path) -> None:
        result = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(result["data"]))
