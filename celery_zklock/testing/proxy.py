"""A TCP proxy on 127.0.0.1 that a test can cut, to drop a connection at a chosen moment."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType


class TcpProxy:
    """Forwards connections from a free local port to ``target``; cut them on demand.

    - :meth:`cut` closes every open connection (the client sees a connection loss; its
      ZooKeeper session lives on if it reconnects within the session timeout).
    - ``drop_responses = True`` silently discards what the server sends: requests still reach
      the server and run, but the client never hears the answers (a lost response).
    - ``refuse = True`` closes new connections at once (the server looks down).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.drop_responses = False
        self.refuse = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, tuple[socket.socket, bool]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zklock-tcp-proxy", daemon=True)
        self.connections_accepted = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self.cut()
        self._listener.close()
        self._selector.close()

    def cut(self) -> int:
        """Close every open connection; return how many client connections were cut."""
        with self._lock:
            sockets = list(self._pairs)
            cut = sum(1 for _, (_, from_client) in self._pairs.items() if from_client)
            self._pairs.clear()
        for sock in sockets:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        return cut

    def _run(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                else:
                    self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self.refuse:
            client.close()
            return
        try:
            server = socket.create_connection(self.target, timeout=2)
        except OSError:
            client.close()
            return
        self.connections_accepted += 1
        for sock in (client, server):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._pairs[client] = (server, True)
            self._pairs[server] = (client, False)
        self._selector.register(client, selectors.EVENT_READ)
        self._selector.register(server, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        with self._lock:
            pair = self._pairs.get(sock)
        if pair is None:
            return
        peer, from_client = pair
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close_pair(sock, peer)
            return
        if not from_client and self.drop_responses:
            return
        try:
            peer.sendall(data)
        except OSError:
            self._close_pair(sock, peer)

    def _close_pair(self, a: socket.socket, b: socket.socket) -> None:
        with self._lock:
            self._pairs.pop(a, None)
            self._pairs.pop(b, None)
        for sock in (a, b):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
