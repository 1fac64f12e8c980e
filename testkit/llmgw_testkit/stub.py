"""Stub HTTP servers on loopback (stub replicas, tokenizers): a handler base and a threaded server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 (keep-alive), silent, with `reply`."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without this, Nagle plus delayed ACKs add 40 ms
    # to every answer.
    disable_nagle_algorithm = True

    def log_message(self, *a):
        pass

    def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # connections a load generator closed at the end of a run


class StubServer:
    """Serves `handler` (a StubHandler subclass) on 127.0.0.1:port from a thread until stop();
    with `quiet_errors`, connections the client broke are not reported."""

    def __init__(self, port: int, handler: type[BaseHTTPRequestHandler], quiet_errors: bool = False):
        self.server = (_QuietServer if quiet_errors else ThreadingHTTPServer)(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Decoy:
    """A server a client names where it must not be sent (e.g. in x-gateway-destination-endpoint):
    it answers every POST with `{}` and counts them in `hits`. `close()` stops it."""

    def __init__(self):
        self.hits = 0
        decoy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                decoy.hits += 1
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
