"""A small HTTP proxy between the S3 client and the test's SeaweedFS that adds what real stores
do: latency on every request, 503 SlowDown answers, connections reset without an answer.

Requests are forwarded unchanged (their Host header too, so SigV4 signatures still hold);
``faults(n503=, resets=)`` makes the next requests fail that way, ``outage(seconds)`` resets
every request for a while (the endpoint gone), ``latency_s`` delays each one.
``requests`` and ``faulted`` count what went through, ``max_in_flight`` the most requests it held
at once; ``log`` holds each answered request's method, path, Range header and body size,
``refused`` each faulted request's path. ``deny(suffix)`` answers 403 AccessDenied to every read
(GET, HEAD) of an object whose key ends so, while listings answer: an object's own ACL.
``list_status`` (0: none) answers every listing with that status while reads answer: a gateway
that does not implement ListObjectsV2 (501), or refuses its arguments (400).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultProxy:
    def __init__(self, upstream_port: int, latency_s: float = 0.0):
        self.upstream_port = upstream_port
        self.latency_s = latency_s
        self.requests = 0
        self.log: list[tuple[str, str, str | None, int]] = []  # (method, path, Range header, body bytes) answered
        self.faulted = 0
        self.refused: list[str] = []  # the path of each request answered with a fault
        self.in_flight = self.max_in_flight = 0
        self._plan: list[str] = []  # "503", "403" or "reset", one per coming request
        self._armed: tuple[int, list[str]] | None = None  # (after this many requests, that plan)
        self._outage: tuple[int, float] | None = None  # (after this many requests, down this long)
        self._down_until = 0.0
        self._denied: tuple[str, ...] = ()  # key suffixes whose objects refuse reads (``deny``)
        self.list_status = 0  # every listing answered with this status (0: forwarded)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # TCP_NODELAY: the headers and the body go out as two writes; with Nagle on, the body
            # waits for the client's delayed ACK of the headers (40 ms on Linux), which added ~43 ms
            # to every request on top of ``latency_s``
            disable_nagle_algorithm = True

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.requests += 1
                    if proxy._armed is not None and proxy.requests >= proxy._armed[0]:
                        proxy._plan, proxy._armed = proxy._armed[1], None
                    if proxy._outage is not None and proxy.requests >= proxy._outage[0]:
                        proxy._down_until, proxy._outage = time.monotonic() + proxy._outage[1], None
                    fault = proxy._plan.pop(0) if proxy._plan else None
                    key = self.path.split("?", 1)[0]
                    if fault is None and "?" not in self.path and key.endswith(proxy._denied or ("\0",)):
                        fault = "denied"  # the object's ACL: a listing (a query string) still answers
                    if fault is None and proxy.list_status and "list-type=" in self.path:
                        fault = "list"
                    if fault is None and time.monotonic() < proxy._down_until:
                        fault = "reset"  # the endpoint gone: every connection reset
                    proxy.faulted += fault is not None
                    if fault is not None:
                        proxy.refused.append(self.path)
                if proxy.latency_s:
                    threading.Event().wait(proxy.latency_s)
                if fault == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.connection.close()
                    self.close_connection = True
                    return
                if fault == "list":
                    msg = b"<Error><Code>NotImplemented</Code><Message>Not implemented here.</Message></Error>"
                    self.send_response(proxy.list_status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if fault in ("503", "403", "denied"):
                    msg = (b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                           if fault == "503" else
                           b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>" if fault == "denied"
                           else b"<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>")
                    self.send_response(403 if fault == "denied" else int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD's answer has no body: one sent is read as the next answer
                        self.wfile.write(msg)
                    return
                up = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    up.request(self.command, self.path, body=body or None, headers=headers)
                    resp = up.getresponse()
                    data = resp.read()
                finally:
                    up.close()
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                # a HEAD's length is the object's (its body is empty): obstore's head() reads its size there
                self.send_header("Content-Length", resp.getheader("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                with proxy._lock:
                    proxy.log.append((self.command, self.path, self.headers.get("Range"), len(data)))

            def _counted(self):  # the requests in flight at once: what fetching together is seen by
                with proxy._lock:
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._any()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _counted

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def faults(self, n503: int = 0, resets: int = 0, after_requests: int = 0, n403: int = 0) -> None:
        """The next ``n503 + resets`` requests (from request number ``after_requests`` on) fail:
        503s and resets, interleaved; then ``n403`` answered 403 ExpiredToken (a key that expired)."""
        plan = []
        for i in range(max(n503, resets)):
            plan += (["503"] if i < n503 else []) + (["reset"] if i < resets else [])
        plan += ["403"] * n403
        with self._lock:
            if after_requests > self.requests:
                self._armed = (after_requests, plan)
            else:
                self._plan = plan

    def deny(self, *suffixes: str) -> None:
        """Reads of the objects whose keys end with one of ``suffixes`` answer 403 AccessDenied from now
        on (none: all answer again); listings are not refused."""
        with self._lock:
            self._denied = tuple(suffixes)

    @contextlib.contextmanager
    def denying(self, *suffixes: str):
        """``deny(*suffixes)`` for the ``with`` block; every object answers again after it."""
        self.deny(*suffixes)
        try:
            yield self
        finally:
            self.deny()

    def outage(self, seconds: float, after_requests: int = 0) -> None:
        """From request number ``after_requests`` on, every request for ``seconds`` is reset."""
        with self._lock:
            self._outage = (max(after_requests, self.requests + 1), seconds)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
