"""--download by several nodes into one shared folder (Compose's one data volume): one writer, atomic
renames, no reader ever sees half a file; the dataset's host serves each file once."""

from __future__ import annotations

import gzip
import http.server
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from devtools.processes import REPO_ROOT, clean_env, kill_session
from tests.support.data_files import write_idx_dataset
from trainer.data.catalog import SPECS
from trainer.data.locate import holds_dataset, local_filesystem

NODES = 3
CHUNKS = 8  # each file is sent in pieces with pauses: a download is slow enough for others to overlap it


def slow_handler(site: Path, requests: Counter) -> type[http.server.BaseHTTPRequestHandler]:
    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = site / self.path.lstrip("/")
            if not path.is_file():
                self.send_error(404)
                return
            content = path.read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            piece = -(-len(content) // CHUNKS)
            try:
                for start in range(0, len(content), piece):
                    self.wfile.write(content[start:start + piece])
                    self.wfile.flush()
                    time.sleep(0.05)
            except BrokenPipeError:
                return  # torchvision opens each URL once to look for a redirect, and closes it unread
            requests[path.name] += 1  # sent whole

        def log_message(self, *args: object) -> None:
            pass

    return Slow


@pytest.mark.parametrize("locks", ["flock", "no-locks"])
def test_nodes_downloading_into_one_folder_download_once_and_no_reader_sees_half_a_file(tmp_path, locks):
    """no-locks: a file system whose flock fails (ENOSYS, Lustre without its flock option): the nodes may each
    download, and still no reader sees half a file and every node ends with the dataset."""
    site, shared = tmp_path / "site", tmp_path / "shared"
    write_idx_dataset(site, train_size=400, test_size=100)
    whole = {path.name: path.read_bytes() for path in site.iterdir()}
    whole.update({name.removesuffix(".gz"): gzip.decompress(content) for name, content in whole.items()})
    requests: Counter = Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), slow_handler(site, requests))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    seen_partial: list[str] = []
    reader_failed: list[BaseException] = []
    files_read = Counter()
    stop = threading.Event()

    def visible_files() -> list[Path]:
        """The finished files a reader can see; staging folders come and go under the walk (a vanished one
        ends this walk, not the reader: the next walk sees the folder as it is then)."""
        try:
            return [path for path in shared.rglob("*")
                    if not any(part.startswith(".") for part in path.relative_to(shared).parts) and path.is_file()]
        except FileNotFoundError:
            return []

    def read_everything_visible() -> None:  # a node reading the folder while the others download
        try:
            while not stop.is_set():
                for path in visible_files():
                    try:
                        content = path.read_bytes()
                    except FileNotFoundError:
                        continue
                    files_read[path.name] += 1
                    if content != whole.get(path.name):
                        seen_partial.append(f"{path.relative_to(shared)}: {len(content)} bytes")
                time.sleep(0.002)
        except BaseException as error:  # a checker that dies must fail the test, not leave it unchecked
            reader_failed.append(error)
            raise

    reader = threading.Thread(target=read_everything_visible, daemon=True)
    reader.start()
    nodes = [subprocess.Popen([sys.executable, "-m", "tests.workers.data_download", str(shared), url, str(site), locks],
                              env=clean_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(NODES)]
    try:
        outcomes = [node.communicate(timeout=120) for node in nodes]
    finally:
        stop.set()
        for node in nodes:
            kill_session(node)
        server.shutdown()
        server.server_close()
    reader.join(timeout=10)
    assert not reader.is_alive() and reader_failed == [], f"the reader stopped checking: {reader_failed!r}"
    assert [node.returncode for node in nodes] == [0] * NODES, [err[-2000:] for _, err in outcomes]
    assert seen_partial == []
    assert files_read, "the reader never saw a finished file: it checked nothing"
    served = whole.keys() & {p.name for p in site.iterdir()}
    if locks == "flock":
        assert dict(requests) == dict.fromkeys(served, 1), "one download each"
    else:
        assert set(requests) == served and "Traceback" not in "".join(err for _, err in outcomes)
        assert all("the file system has no file locks (Function not implemented" in err for _, err in outcomes)
    assert holds_dataset(local_filesystem(), str(shared), SPECS["mnist"])
    assert sorted(path.name for path in shared.iterdir()) == [".download-mnist.lock", "MNIST"], "no staging left"
