"""A TCP forwarder on loopback for fault tests: it passes bytes between its clients
and one server until it is ``cut`` (every open connection is shut down and new ones
are accepted and closed at once, as a dropped network or a restarting server looks
to a client) and forwards again after ``restore``."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType

__all__ = ["TcpProxy"]


class TcpProxy:
    """Listens on 127.0.0.1 (``port``) and forwards to ``target_host:target_port``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._accepting.start()

    # -- faults ------------------------------------------------------------------------

    def cut(self) -> None:
        """Shut down every forwarded connection and refuse new ones until ``restore``."""
        with self._lock:
            self._cut = True
            sockets = list(self._open)
        for sock in sockets:
            # shutdown, not close: it wakes the forwarding thread blocked in recv.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    @property
    def connections(self) -> int:
        """Forwarded connections open now (two sockets each)."""
        with self._lock:
            return len(self._open) // 2

    # -- forwarding --------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                refuse = self._cut or self._closed
            if refuse:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._open.discard(src)
            src.close()

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):  # wakes the accepting thread (Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.cut()
        self._accepting.join(timeout=5)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
