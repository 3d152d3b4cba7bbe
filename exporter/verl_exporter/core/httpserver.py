"""The one small HTTP server of the sidecar and the relay: a WSGI app with bounded connections and app slots.

wsgiref alone starts a thread per connection, has no timeouts and a listen backlog of 5: clients that sent
half a request each held a thread for ever, and 50 concurrent scrapers overflowed the backlog (the kernel's
SYN retry then cost a scrape a second). Here:

- the listen backlog is BACKLOG;
- at most ``max_connections`` connections are open, each read by a thread of its own (blocked on a slow
  client it costs no CPU); one more is answered 503 at once and closed, so threads and memory stay bounded;
- at most ``workers`` requests run the app at a time: a request waits for a slot only once it has
  arrived whole, so slow clients never hold one;
- requests under ``slow_paths`` (the sidecar's /control/: a stack capture runs for seconds to a minute, and
  requests queue behind it) run in ``slow_workers`` slots of their own, never in those /metrics needs; at most
  SLOW_WAITING more wait for one, and beyond that one is answered 503 at once (kind "overload");
- the whole request (line, headers, body) must arrive within ``request_timeout`` seconds, and each write of
  the answer must progress within it: a client that sends half a header, drips a byte at a time or stops
  reading holds its connection's thread that long at most;
- a request whose body framing is ambiguous (two Content-Length headers, one that is not a number, a
  Transfer-Encoding beside it) gets 400, and one with a Transfer-Encoding alone 501: bodies are read by
  Content-Length only, and two parties that read one request differently are how requests get smuggled;
- HEAD gets the headers GET would get (Content-Length included) and no body, whatever the app returns.

Connections dropped for these reasons are reported to ``on_problem(kind, message)``: kind is "timeout",
"overload", "bad_request" or "error" (the caller counts them in its own metrics; only "error" may be a bug).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

if TYPE_CHECKING:
    from _typeshed import OptExcInfo, ReadableBuffer, WriteableBuffer
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger(__name__)

BACKLOG = 512  # the kernel caps it at net.core.somaxconn
WORKERS = 8  # apps running at once: rendering is CPU-bound, so more only share the GIL thinner
MAX_CONNECTIONS = 512
SLOW_WORKERS = 2  # slots of the slow paths' own: one request waits in a capture, another can still be refused
SLOW_WAITING = 32  # slow requests waiting for a slot (each holds a connection) beyond which one gets 503
REQUEST_TIMEOUT_S = 10.0
_BUSY = b"busy: too many requests of this kind are waiting.\n"
_OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n"
               b"Retry-After: 1\r\nConnection: close\r\n\r\noverloaded.\n")

ProblemFn = Callable[[str, str], None]
_DIGITS = re.compile(r"[0-9]+")


class ListenError(OSError):
    """The address cannot be bound (in use, not ours, unknown host): the one OSError that means "cannot listen"."""


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT, :PORT (all interfaces) or [v6]:PORT."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class _DeadlineReader(io.RawIOBase):
    """Socket reads that must all be done by one deadline (a per-read timeout alone lets a client drip)."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Writer(io.BufferedIOBase):
    """Unbuffered socket writes, each with the full timeout again (the reads may have used up the deadline)."""

    def __init__(self, sock: socket.socket, timeout: float):
        self._sock = sock
        self._timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        self._sock.settimeout(self._timeout)
        self._sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


class _Handler(WSGIRequestHandler):
    # An error about the request line itself (HTTP/2.0, a bad version) would otherwise be answered the
    # HTTP/0.9 way, a bare HTML body without a status line; nothing speaks 0.9 any more.
    default_request_version = "HTTP/1.0"
    server: _BoundedServer

    def setup(self) -> None:
        timeout = self.server.request_timeout
        self.connection = self.request
        self.rfile = io.BufferedReader(_DeadlineReader(self.request, time.monotonic() + timeout))
        self.wfile = _Writer(self.request, timeout)

    def handle(self) -> None:
        """wsgiref's handle(), with a ServerHandler that reports failures instead of printing tracebacks."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            self.server._problem("bad_request", "a request line over 64 KiB got 414")
            return
        if not self.raw_requestline.strip():  # connected and closed (a TCP probe): nothing to answer
            return
        if not self.parse_request():  # an error was sent
            self.server._problem("bad_request", "a malformed HTTP request got an error answer")
            return
        if (refused := self._framing_problem()) is not None:
            code, why = refused
            self.close_connection = True
            self.send_error(code, why)
            self.server._problem("bad_request", f"a request got {code}: {why}")
            return
        # wsgiref's stubs ask for an IO[bytes]; it only writes to and flushes the stream, as _Writer does
        handler = _ServerHandler(self.rfile, self.wfile,  # type: ignore[arg-type]
                                 self.get_stderr(), self.get_environ(), multithread=False)
        handler.request_handler = self
        handler.run(self.server.get_app())

    def _framing_problem(self) -> tuple[int, str] | None:
        """(code, why) when the body of the request cannot be delimited without guessing; None when it can."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get_all("Transfer-Encoding"):
            if lengths:
                return 400, "both Transfer-Encoding and Content-Length"
            return 501, "Transfer-Encoding is not supported; send a Content-Length"
        if len(lengths) > 1:
            return 400, "more than one Content-Length"
        if lengths and not _DIGITS.fullmatch(lengths[0].strip()):
            return 400, "Content-Length is not a number"
        return None

    def log_message(self, format: str, *args: Any) -> None:  # one line per scrape would drown the log
        pass


class _ServerHandler(ServerHandler):
    # set by wsgiref (the stubs leave them out) and by _Handler.handle
    environ: WSGIEnvironment
    headers_sent: bool
    request_handler: _Handler

    def write(self, data: bytes) -> None:
        """HEAD: the headers (with the Content-Length of GET's body), never the body."""
        if self.environ.get("REQUEST_METHOD") != "HEAD":
            super().write(data)
            return
        if not self.headers_sent:
            self.bytes_sent = len(data)
            self.send_headers()
        else:
            self.bytes_sent += len(data)
        self._flush()

    def log_exception(self, exc_info: OptExcInfo) -> None:
        error = exc_info[1]
        if isinstance(error, TimeoutError):  # the client stopped reading the answer
            self.request_handler.server._problem("timeout", "a client stopped reading its answer; connection closed")
            return
        server = self.request_handler.server
        if not server.traceback_logged:  # the first traceback tells the bug; the rest are counted
            server.traceback_logged = True
            log.error("http: answering %s failed", ascii(self.environ.get("PATH_INFO", ""))[:200], exc_info=exc_info)
        server._problem("error", f"answering a request failed: {_describe(error)}")


class _BoundedServer(WSGIServer):
    request_queue_size = BACKLOG
    allow_reuse_address = True
    traceback_logged = False

    def __init__(self, address: tuple[str, int], app: WSGIApplication, *, workers: int, max_connections: int,
                 request_timeout: float, on_problem: ProblemFn | None, slow_paths: tuple[str, ...],
                 slow_workers: int):
        super().__init__(address, _Handler)
        self.request_timeout = request_timeout
        self._on_problem = on_problem
        self._connections = threading.BoundedSemaphore(max_connections)
        slots = threading.Semaphore(workers)
        slow_slots = threading.Semaphore(slow_workers)
        slow_room = threading.BoundedSemaphore(slow_workers + SLOW_WAITING)  # running and waiting slow requests

        # both apps answer with a list, so the call is all the work
        def gated(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            if not slow_paths or not str(environ.get("PATH_INFO", "")).startswith(slow_paths):
                with slots:
                    return app(environ, start_response)
            if not slow_room.acquire(blocking=False):
                self._problem("overload", f"over {SLOW_WAITING} requests waiting on a slow path; one got 503")
                start_response("503 Service Unavailable", [("Content-Type", "text/plain"), ("Retry-After", "10"),
                                                           ("Content-Length", str(len(_BUSY)))])
                return [_BUSY]
            try:
                with slow_slots:
                    return app(environ, start_response)
            finally:
                slow_room.release()

        self._app: WSGIApplication = gated

    def get_app(self) -> WSGIApplication:  # never None: set above
        return self._app

    # a TCP server's requests are sockets (the stubs' type also covers a UDP server's (data, socket))
    def process_request(self, request: socket.socket, client_address: Any) -> None:  # type: ignore[override]
        if not self._connections.acquire(blocking=False):
            request.setblocking(False)  # the accept loop never waits on a client
            with contextlib.suppress(OSError):
                request.send(_OVERLOADED)
            self.shutdown_request(request)
            self._problem("overload", "too many open HTTP connections; a new one got 503")
            return
        # A thread per connection: one blocked on a slow client costs no CPU, and the deadline ends it.
        threading.Thread(target=self._serve, args=(request, client_address), name="verl-exporter-http-conn",
                         daemon=True).start()

    def _serve(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except TimeoutError:
            self._problem("timeout", f"a client did not send its request within {self.request_timeout:g} s "
                                     "(or stopped reading the answer); connection closed")
        except Exception as e:
            self._problem("error", f"an HTTP connection failed: {_describe(e)}")
        finally:
            self.shutdown_request(request)
            self._connections.release()

    def _problem(self, kind: str, message: str) -> None:
        if self._on_problem is None:
            log.debug("http: %s", message)
            return
        try:
            self._on_problem(kind, message)
        except Exception:  # counting a problem must never take the server down
            log.exception("http: on_problem failed")

    def handle_error(self, request: Any, client_address: Any) -> None:  # socketserver would print a traceback
        self._problem("error", f"an HTTP connection failed: {_describe(sys.exc_info()[1])}")


class _BoundedServer6(_BoundedServer):
    address_family = socket.AF_INET6


def _describe(error: BaseException | None) -> str:
    text = str(error)  # not repr(): a UnicodeEncodeError's quotes the whole answer it could not encode
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


class HttpServer:
    """The server on its own daemon thread; port 0 picks a free port. Binds in __init__ (ListenError)."""

    def __init__(self, app: WSGIApplication, listen: str, *, workers: int = WORKERS,
                 max_connections: int = MAX_CONNECTIONS, request_timeout: float = REQUEST_TIMEOUT_S,
                 on_problem: ProblemFn | None = None, slow_paths: tuple[str, ...] = (),
                 slow_workers: int = SLOW_WORKERS):
        host, port = parse_listen(listen)
        server_class = _BoundedServer6 if ":" in host else _BoundedServer
        try:
            self._httpd = server_class((host, port), app, workers=workers, max_connections=max_connections,
                                       request_timeout=request_timeout, on_problem=on_problem,
                                       slow_paths=slow_paths, slow_workers=slow_workers)
        except OSError as e:
            raise ListenError(e.errno, e.strerror or str(e)) from e
        self.host, self.port = host, self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="verl-exporter-http", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def start(self) -> HttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
