"""The stand-in's HTTP server: a ``ThreadingHTTPServer`` whose close also ends its connections.

``http.server.ThreadingHTTPServer`` answers each connection in a daemon thread and does not
track daemon threads (``socketserver._Threads.append`` skips them), so ``server_close`` leaves
behind every thread still waiting on a kept-alive HTTP/1.1 connection (the client's
``requests.Session`` keeps one per server). A stopped stand-in must leave no thread running
(``tests/conftest.py`` checks every test for that), so this server remembers its open
connections and their threads, and :meth:`close_connections` shuts the sockets (a thread
blocked reading the next request then reads end-of-file and returns) and joins the threads.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Dict


class ClosingHTTPServer(ThreadingHTTPServer):
    """Tracks each connection's socket and thread until its handler returns."""

    daemon_threads = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._connections: Dict[socket.socket, threading.Thread] = {}
        self._connections_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  name=f"standin-http-{client_address[1]}", daemon=True)
        with self._connections_lock:
            self._connections[request] = thread
        thread.start()

    def shutdown_request(self, request) -> None:
        with self._connections_lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def close_connections(self, timeout_s: float = 10.0) -> None:
        """Shut every open connection and wait up to ``timeout_s`` in all for their threads."""
        with self._connections_lock:
            open_now = dict(self._connections)
        for request in open_now:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
        deadline = time.monotonic() + timeout_s
        for thread in open_now.values():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
