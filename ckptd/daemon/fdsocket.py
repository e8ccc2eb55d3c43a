"""The fd side channel: hands staging segments (memfd descriptors) to local clients.

gRPC cannot carry file descriptors, so next to the gRPC socket the daemon listens on
``<socket>.fds``, a ``SOCK_SEQPACKET`` Unix socket in the same restricted directory.
Each message is one small JSON object.  Protocol (client -> daemon, daemon -> client)::

    {"session": ID, "secret": HEX}   ->  {"ok": true}             attach the session (first)
    {"fetch": SEGMENT_ID}            ->  {"ok": true, "segment": ID, "size": N}  + the fd
                                          (SCM_RIGHTS; a segment is handed out once)
    anything invalid                 ->  {"ok": false, "error": "..."}

The connection is the session's liveness signal: when it closes, the session closes and
its idle segments return to the budget.  The first message must arrive within 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct

from ckptd.daemon.staging import StagingPool
from ckptd.errors import CkptdError

log = logging.getLogger("ckptd.daemon")

MAX_MESSAGE = 4096
HELLO_TIMEOUT = 10.0


def peer_pid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[0]
    except OSError:
        return None


class FdServer:
    def __init__(self, pool: StagingPool, path: str) -> None:
        self.pool = pool
        self.path = path
        self.sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    def bind(self) -> None:
        """Bind (call under the restrictive umask) and listen."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(self.path)
            sock.listen(256)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                log.warning("fd socket accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _send(self, conn: socket.socket, doc: dict, fd: int | None = None) -> None:
        data = json.dumps(doc).encode()
        for _ in range(500):
            try:
                if fd is None:
                    conn.send(data)
                else:
                    socket.send_fds(conn, [data], [fd])
                return
            except BlockingIOError:
                await asyncio.sleep(0.01)
        raise OSError("fd socket peer does not read")

    async def _recv(self, conn: socket.socket) -> dict | None:
        data = await asyncio.get_running_loop().sock_recv(conn, MAX_MESSAGE)
        if not data:
            return None
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise TypeError("expected a JSON object")
        return doc

    async def _serve(self, conn: socket.socket) -> None:
        session = None
        pid = peer_pid(conn)
        try:
            try:
                hello = await asyncio.wait_for(self._recv(conn), HELLO_TIMEOUT)
                if hello is None:
                    return
                session = self.pool.attach(str(hello.get("session", "")),
                                           bytes.fromhex(str(hello.get("secret", ""))), pid)
            except (TimeoutError, CkptdError, ValueError, TypeError) as exc:
                with contextlib.suppress(OSError):
                    await self._send(conn, {"ok": False, "error": f"attach refused: {exc}"})
                return
            await self._send(conn, {"ok": True})
            while True:
                try:
                    msg = await self._recv(conn)
                except (ValueError, TypeError) as exc:
                    await self._send(conn, {"ok": False, "error": f"bad message: {exc}"})
                    continue
                if msg is None:
                    return
                try:
                    seg = self.pool.fetch(session, str(msg.get("fetch", "")))
                except CkptdError as exc:
                    await self._send(conn, {"ok": False, "error": str(exc)})
                    continue
                await self._send(conn, {"ok": True, "segment": seg.id, "size": seg.size},
                                 seg.fd)
        except (OSError, ConnectionError) as exc:
            log.debug("fd connection of pid %s ended: %s", pid, exc)
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("fd connection of pid %s failed", pid)
        finally:
            conn.close()
            if session is not None:
                self.pool.close_session(session, "fd connection closed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self.sock is not None:
            self.sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
