"""Data from URLs that carry credentials, with two real ranks: the password never reaches a log line, an
error, config.yaml, a checkpoint, the metrics or the cache; a refused, unreachable or unauthorised URL is the
same one-line data error (exit 2) on every rank as missing data."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator

import pytest

from devtools.processes import env_ranks, free_port
from tests.support.checkpoint_reading import every_file_under
from tests.support.data_files import write_idx_dataset
from trainer.errors import EXIT_USAGE

SECRET = "S3cretPassw0rd"
TINY = ["--dataset", "mnist", "--epochs", "1", "--batch-size", "8", "--progress", "off", "--no-tensorboard"]


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class _Unauthorised(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="data"')
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[object]:
    """Start an HTTP server on loopback with a handler; returns its port."""
    servers: list[http.server.ThreadingHTTPServer] = []

    def start(handler: type[http.server.BaseHTTPRequestHandler]) -> int:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_password_in_the_data_url_is_used_but_never_written(serve, tmp_path):
    write_idx_dataset(tmp_path / "site" / "mnist")
    port = serve(functools.partial(_Quiet, directory=str(tmp_path / "site")))
    url = f"http://alice:{SECRET}@127.0.0.1:{port}/mnist/"
    output, cache = tmp_path / "run", tmp_path / "cache"
    args = [*TINY, "--data-dir", url, "--data-cache-dir", str(cache), "--output-dir", str(output)]
    first = env_ranks(args, world_size=2)
    assert [rank.returncode for rank in first] == [0, 0], first[0].stderr[-3000:] + first[1].stderr[-3000:]
    resumed = env_ranks([*args, "--epochs", "2"], world_size=2)  # the stored, redacted config resumes
    assert [rank.returncode for rank in resumed] == [0, 0], resumed[0].stderr[-3000:]
    assert "resuming with a change: --epochs 1 -> 2" in resumed[0].stderr
    assert "resuming with a change: --data-dir" not in resumed[0].stderr
    shown = f"http://alice:***@127.0.0.1:{port}/mnist/"
    assert f"data_dir: {shown}" in (output / "config.yaml").read_text()
    assert f"fetched 4 of 4 mnist files from {shown}" in first[0].stderr
    for rank in (*first, *resumed):
        assert SECRET not in rank.stdout + rank.stderr
    written = every_file_under(output, cache)
    assert any(path.endswith("manifest.json") for path in written) and len(written) > 8
    assert [path for path, content in written.items() if SECRET.encode() in content or SECRET in path] == []


@pytest.mark.parametrize("kind", ["refused", "unauthorised", "token-as-user", "fragment-token"])
def test_a_url_that_refuses_or_is_unreachable_is_one_data_error_on_every_rank(serve, tmp_path, kind):
    if kind == "refused":  # nothing listens there: the FTP filesystem connects and logs in when opened
        url = f"ftp://alice:{SECRET}@127.0.0.1:{free_port()}/mnist"
        reason = "ConnectionRefusedError: [Errno 111] Connection refused"
    elif kind in ("token-as-user", "fragment-token"):
        url = (f"http://{SECRET}@127.0.0.1:{serve(_Unauthorised)}/mnist/" if kind == "token-as-user" else
               f"http://127.0.0.1:{serve(_Unauthorised)}/mnist/#access_token={SECRET}")
        reason = "ClientResponseError: 401, message='Unauthorized'"
    else:
        url = f"http://127.0.0.1:{serve(_Unauthorised)}/mnist/?token={SECRET}"
        reason = "ClientResponseError: 401, message='Unauthorized'"
    ranks = env_ranks([*TINY, "--data-dir", url, "--data-cache-dir", str(tmp_path / "cache"),
                       "--output-dir", str(tmp_path / "run")], world_size=2, timeout_s=120)
    shown = url.replace(SECRET, "***")
    for rank, result in enumerate(ranks):
        assert result.returncode == EXIT_USAGE, result.stderr[-3000:]
        (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
        assert line.startswith(f"[rank {rank}] error: --data-dir {shown}: cannot reach it ({reason}"), line
        # Rank 0 fetches for the node; one agreement inside another still names it once.
        assert "check the URL, credentials and network (seen by rank 0 on " in line and line.count("seen by") == 1
        assert SECRET not in result.stdout + result.stderr and "Traceback" not in result.stderr
