"""The loopback S3 server's own failure report (devtools.s3_server): a request that fails because the server went
away is ServerDied, which the bench retries once; one that fails while the server still listens is the caller's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from devtools.s3_server import ServerDied, s3_server, still_serving


@pytest.fixture
def alive_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def test_a_live_process_whose_listener_closed_is_not_serving(alive_process):
    # CI's case: werkzeug closes its socket on the way out while the process is still there.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert still_serving(alive_process, port, exit_wait_s=0.1)
    listener.close()
    assert not still_serving(alive_process, port, exit_wait_s=0.1)


def test_an_exited_process_is_not_serving():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    listener = socket.create_server(("127.0.0.1", 0))  # someone listening on the port changes nothing
    with listener:
        assert not still_serving(process, listener.getsockname()[1])


def test_a_failure_after_the_server_stopped_is_server_died_and_one_while_it_serves_is_not():
    with pytest.raises(ValueError, match="the caller's own"), s3_server():
        raise ValueError("the caller's own")
    with pytest.raises(ServerDied, match="stopped listening while in use") as died, s3_server() as server:
        os.kill(server.process.pid, signal.SIGTERM)  # moto's handler exits: the listener closes first
        server.process.wait(timeout=30)
        raise ConnectionRefusedError("refused")
    assert isinstance(died.value.__cause__, ConnectionRefusedError)


def test_a_folder_opened_under_a_second_server_in_one_process_reaches_that_server():
    """As the bench runs figure 14 and then 17: without the cache cleared, the second open got the first server's
    filesystem back, and the upload was refused by its closed port."""
    from bench.harness.launch import environment
    from trainer.checkpoint import open_storage

    for _ in range(2):
        with s3_server() as server, environment(server.env):
            storage = open_storage(f"s3://{server.new_bucket()}/ckpt")
            storage.fs.pipe_file(f"{storage.root}/raw.bin", b"saved")
            assert storage.fs.cat_file(f"{storage.root}/raw.bin") == b"saved"
