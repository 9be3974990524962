"""A server on a free loopback port for the tests, in a thread of the test process."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from decoding.serve import create_app

START_TIMEOUT_S = 60.0


@contextlib.contextmanager
def running_server(engine, tokenizer, *, model_name: str, max_queue: int = 256):
    """Yields ``(base_url, app)`` of a uvicorn server on 127.0.0.1 (a port the OS picked); stops
    it (and its engine worker) on exit. Waits for ``/health``, bounded by START_TIMEOUT_S."""
    app = create_app(engine, tokenizer, model_name=model_name, max_queue=max_queue)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not become healthy in {START_TIMEOUT_S} s")
        time.sleep(0.05)
    try:
        yield url, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
