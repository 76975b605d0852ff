"""The SGLang HTTP client's failure classes: a server that dies while it answers is unavailable
(retried elsewhere), not an unexpected exception from requests."""

import socket
import threading

import pytest

from gspo_megatron.rollout.sglang.client import SGLangServerClient, ServerUnavailable


def _server_dying_mid_answer() -> tuple:
    """A one-shot HTTP server that starts a chunked 200 answer and closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n2b9\r\n{\"text\": \"par")
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{port}", thread


def test_a_server_that_dies_mid_answer_is_unavailable():
    address, thread = _server_dying_mid_answer()
    client = SGLangServerClient(address, timeout_s=10)
    with pytest.raises(ServerUnavailable, match=f"{address}/generate: ChunkedEncodingError"):
        client.request("POST", "/generate", {"input_ids": [1]})
    thread.join(timeout=10)
