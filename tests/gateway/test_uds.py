"""--uds's socket: bound at a fresh path, a stale socket file replaced, a live server's or another
file's path refused in one line, and /health probed over it."""
import socket
import threading

import pytest

from pagedserve.gateway import uds


def test_binds_a_fresh_path_not_listening(tmp_path):
    path = str(tmp_path / "api.sock")
    with uds.bind_unix(path) as sock:
        assert sock.family == socket.AF_UNIX and sock.getsockname() == path
        assert not uds.answers(path)
    uds.remove(path)
    assert not (tmp_path / "api.sock").exists()


def test_a_stale_socket_file_is_replaced(tmp_path):
    path = str(tmp_path / "api.sock")
    # A killed server leaves its socket file behind, with no one answering on it.
    socket.socket(socket.AF_UNIX).bind(path)
    with uds.bind_unix(path) as sock:
        sock.listen()
        assert uds.answers(path)


def test_a_live_server_or_another_file_is_refused(tmp_path):
    path = str(tmp_path / "api.sock")
    with uds.bind_unix(path) as live:
        live.listen()
        with pytest.raises(ValueError, match="already listens on --uds"):
            uds.bind_unix(path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a socket"):
        uds.bind_unix(str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("status, ok", [(b"200 OK", True), (b"503 Service Unavailable", False)])
def test_health_ok_reads_the_status_line(tmp_path, status, ok):
    path = str(tmp_path / "api.sock")
    with uds.bind_unix(path) as server:
        server.listen()

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                assert conn.recv(1024).startswith(b"GET /health HTTP/1.0")
                conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        assert uds.health_ok(path) is ok
        thread.join()
    assert not uds.health_ok(str(tmp_path / "nothing.sock"))
