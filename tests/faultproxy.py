"""A TCP proxy in front of a real server that a test can take down and bring back: a
network outage between a client (say the daemon) and its S3 endpoint, without stopping
the server other tests share.

While down, every open connection is reset and new ones are accepted and closed at once
(the client sees its connections fail, as when an endpoint restarts or a route drops).
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit


class FaultProxy:
    def __init__(self, target_url: str) -> None:
        u = urlsplit(target_url)
        self.target = (u.hostname or "127.0.0.1", u.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{u.scheme}://127.0.0.1:{self._listener.getsockname()[1]}"
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.refused = 0      # connections closed while down
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="faultproxy").start()

    def down(self) -> None:
        self._up.clear()
        with self._lock:
            for s in self._open:
                _reset(s)
            self._open.clear()

    def up(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                self.refused += 1
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                _reset(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._open.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._open.discard(s)
                _reset(s)


def _reset(s: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dropped connection looks to the peer."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
