"""Network faults for tests, made with real sockets: a proxy that loses one reply, or one
request."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class ReplyDropper:
    """A TCP proxy in front of Redis (``port``) that, once ``armed``, forwards the next
    request holding ``marker`` (a script's SHA-1: its ``EVALSHA``) and then closes the
    client's connection instead of passing Redis's reply on: the command ran, its reply was
    lost (what a Redis shutting down, or a dropped connection, does to a client). Every
    other byte goes through unchanged."""

    def __init__(self, port: int, marker: str) -> None:
        self.target = ("127.0.0.1", port)
        self.marker = marker.encode()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.armed = False
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            drop = threading.Event()
            threading.Thread(target=self._up, args=(client, upstream, drop), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, drop), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, drop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.armed and self.marker in data:
                    self.armed = False
                    drop.set()
                dst.sendall(data)

    def _down(self, src: socket.socket, dst: socket.socket, drop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if drop.is_set():  # Redis replied: the client never hears it
                    self.dropped += 1
                    dst.shutdown(socket.SHUT_RDWR)
                    dst.close()
                    src.close()
                    return
                dst.sendall(data)

    def close(self) -> None:
        self.server.close()


class RequestDropper(ReplyDropper):
    """A :class:`ReplyDropper` that, once ``armed``, loses the next request holding
    ``marker`` itself: it calls ``before_drop`` (what happens meanwhile: another producer's
    submit), then closes the client's connection instead of forwarding the request, so
    Redis never runs it (a connection that died while the request was on its way)."""

    def __init__(self, port: int, marker: str, before_drop: Callable[[], None]) -> None:
        self.before_drop = before_drop
        super().__init__(port, marker)

    def _up(self, src: socket.socket, dst: socket.socket, drop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.armed and self.marker in data:
                    self.armed = False
                    self.before_drop()
                    self.dropped += 1
                    src.shutdown(socket.SHUT_RDWR)
                    src.close()
                    dst.close()
                    return
                dst.sendall(data)
