"""A server in a thread of this process on a free loopback port: for tests and benchmarks."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn

from decoding.serve.app import create_app

START_TIMEOUT_S = 60.0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(engine, tokenizer, *, model_name: str, max_queue: int = 256):
    """Yields ``(base_url, app)`` of a uvicorn server on 127.0.0.1 (a port the OS picked) serving
    ``engine``; stops it (and its engine worker) on exit. Waits for ``/health``, at most
    ``START_TIMEOUT_S``."""
    app = create_app(engine, tokenizer, model_name=model_name, max_queue=max_queue)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT_S} s")
            time.sleep(0.05)
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
