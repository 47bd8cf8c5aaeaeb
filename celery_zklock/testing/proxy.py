"""A TCP proxy on 127.0.0.1 that a test can cut, or turn silent, at a chosen moment."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from celery_zklock.testing.processes import Service


class TcpProxy(Service):
    """Forwards connections from a free local port to ``target``; cut or silence them on demand.

    - :meth:`cut` closes every open connection (the client sees a connection loss; its
      ZooKeeper session lives on if it reconnects within the session timeout).
    - ``drop_responses = True`` silently discards what the server sends: requests still reach
      the server and run, but the client never hears the answers (a lost response).
    - ``blackhole = True`` is a silent partition: every byte, both ways, on existing and new
      connections, is read and discarded, and no socket is closed or reset by the proxy. Neither
      side learns anything: the client sees silence (until its own timeouts), the server sees
      silence (and expires the session after its timeout). A side that closes its end meanwhile
      is not announced to the other side: the other socket stays open (its bytes still
      discarded) until ``blackhole`` is set back to ``False``, which closes it. Setting
      ``False`` resumes forwarding; bytes that arrived while silent stay dropped (the stream
      then continues mid-way, as after lost segments: ZooKeeper clients reconnect).
    - ``refuse = True`` closes new connections at once (the server looks down).
    """

    what = "the TCP proxy"

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.drop_responses = False
        self.refuse = False
        self._blackhole = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._pairs: dict[socket.socket, tuple[socket.socket, bool]] = {}
        # Sockets whose peer closed while the proxy was a black hole: kept open, drained.
        self._orphans: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zklock-tcp-proxy", daemon=True)
        self.connections_accepted = 0
        self.bytes_dropped = 0
        """Bytes read and discarded by the black hole (both directions) or by
        ``drop_responses`` (the server's), for tests."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def blackhole(self) -> bool:
        """True while every byte is dropped both ways with all sockets kept open."""
        return self._blackhole

    @blackhole.setter
    def blackhole(self, value: bool) -> None:
        self._blackhole = bool(value)
        if not value:
            with self._lock:
                orphans = list(self._orphans)
                self._orphans.clear()
            for sock in orphans:
                self._discard(sock)

    def is_started(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> TcpProxy:
        self._refuse_restart()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop forwarding and close every socket, the listener included. Idempotent."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.cut()
        self._listener.close()
        self._selector.close()

    def cut(self) -> int:
        """Close every open connection; return how many client connections were cut."""
        with self._lock:
            sockets = [*self._pairs, *self._orphans]
            cut = sum(1 for _, (_, from_client) in self._pairs.items() if from_client)
            self._pairs.clear()
            self._orphans.clear()
        for sock in sockets:
            self._discard(sock)
        return cut

    @property
    def orphaned_connections(self) -> int:
        """Sockets held open (and drained) because their peer closed during a black hole."""
        with self._lock:
            return len(self._orphans)

    def open_connections(self) -> int:
        """How many client connections the proxy holds open (paired or orphaned)."""
        with self._lock:
            paired = sum(1 for _, (_, from_client) in self._pairs.items() if from_client)
            return paired + len(self._orphans)

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
            orphan = sock in self._orphans
        if pair is None and not orphan:
            return
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if pair is None:  # an orphan: its peer closed during a black hole
            if not data or not self._blackhole:
                with self._lock:
                    self._orphans.discard(sock)
                self._discard(sock)
            else:
                self.bytes_dropped += len(data)
            return
        peer, from_client = pair
        if self._blackhole:
            if data:
                self.bytes_dropped += len(data)
                return
            # This side closed: keep the other side open and silent, as a partition would.
            with self._lock:
                self._pairs.pop(sock, None)
                self._pairs.pop(peer, None)
                self._orphans.add(peer)
            self._discard(sock)
            return
        if not data:
            self._close_pair(sock, peer)
            return
        if not from_client and self.drop_responses:
            self.bytes_dropped += len(data)
            return
        try:
            peer.sendall(data)
        except OSError:
            self._close_pair(sock, peer)

    def _discard(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def _close_pair(self, a: socket.socket, b: socket.socket) -> None:
        with self._lock:
            self._pairs.pop(a, None)
            self._pairs.pop(b, None)
        for sock in (a, b):
            self._discard(sock)
