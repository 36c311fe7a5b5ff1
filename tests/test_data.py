"""ddplab.data: IDX files, the shipped MNIST sample, and downloads that never leave junk.

Everything is real: IDX files written here, the sample in the package, and an HTTP server
on 127.0.0.1 whose path prefix picks how the "mirror" behaves (good, corrupt, cut off
mid-file, 404, slow). A dead mirror is a port nothing listens on.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from ddplab import data
from ddplab.cli import main
from ddplab.data import (
    FILES,
    MNIST_SHA256,
    SAMPLE_DIR,
    SAMPLE_SHA256,
    DownloadError,
    download_mnist,
    load_mnist,
    read_idx,
    save_subset,
)

SAMPLE_COUNTS = {
    "train": [801, 902, 793, 826, 784, 691, 812, 856, 756, 783],
    "test": [200, 225, 198, 206, 196, 172, 202, 214, 188, 195],
}
NAMES = [name for split in FILES.values() for name in split]


# --- helpers ---------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray, *, kind: int = 0x08) -> bytes:
    """`array` as an IDX file: two zero bytes, type, dimension count, big-endian sizes."""
    header = bytes([0, 0, kind, array.ndim]) + b"".join(
        n.to_bytes(4, "big") for n in array.shape
    )
    return header + array.astype(np.uint8).tobytes()


def fake_mnist(n_train: int = 5, n_test: int = 3, seed: int = 0) -> dict[str, bytes]:
    """A tiny but valid MNIST: the four .gz files' bytes, by name."""
    rng = np.random.default_rng(seed)
    files = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images, labels = FILES[split]
        files[images] = gzip.compress(idx_bytes(rng.integers(0, 256, (n, 28, 28))), mtime=0)
        files[labels] = gzip.compress(idx_bytes(np.arange(n) % 10), mtime=0)
    return files


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def assert_alone(exc: BaseException) -> None:
    """`exc` shows no other exception (numpy, zlib, struct...) in its traceback."""
    assert exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__


def leftovers(root: Path) -> list[str]:
    """What a failed download left in `root`, the lock file aside."""
    return sorted(p.name for p in root.iterdir() if p.name != data.LOCK_NAME)


@dataclass
class Mirrors:
    """The test server: `url(kind)` is a mirror base URL; `requests` counts paths asked."""

    base: str
    good: dict[str, bytes]
    requests: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, kind: str) -> str:
        return f"{self.base}/{kind}/"

    @property
    def checksums(self) -> dict[str, str]:
        return {name: sha256(blob) for name, blob in self.good.items()}

    def fetched(self, kind: str = "good") -> Counter[str]:
        """Requests per file name that went to mirror `kind`."""
        with self.lock:
            return Counter({path.rsplit("/", 1)[1]: n for path, n in self.requests.items()
                            if path.startswith(f"/{kind}/")})


class _Handler(http.server.BaseHTTPRequestHandler):
    """good/NAME: the file. corrupt/NAME: other bytes. drop/NAME: half, then hang up.
    missing/NAME: 404. slow/NAME: the file after 0.2 s. sample/NAME: the shipped sample."""

    def do_GET(self) -> None:
        mirrors: Mirrors = self.server.mirrors  # type: ignore[attr-defined]
        with mirrors.lock:
            mirrors.requests[self.path] += 1
        kind, _, name = self.path.strip("/").partition("/")
        if kind == "sample" and name in SAMPLE_SHA256:
            body = (SAMPLE_DIR / name).read_bytes()
        elif kind in ("good", "corrupt", "drop", "slow") and name in mirrors.good:
            body = mirrors.good[name]
        else:
            self.send_error(404)
            return
        if kind == "corrupt":
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        if kind == "slow":
            time.sleep(0.2)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if kind == "drop":
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def mirrors() -> Iterator[Mirrors]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    server.mirrors = Mirrors(base, fake_mnist())  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.mirrors  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def dead_mirror() -> str:
    """A base URL on a port nothing listens on: connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


# --- the shipped sample ----------------------------------------------------------------------


def test_sample_files_match_their_published_digests() -> None:
    readme = (SAMPLE_DIR / "README.md").read_text(encoding="utf-8")
    table = dict(re.findall(r"\| (\S+\.gz) +\| \d+ \| ([0-9a-f]{64}) \|", readme))
    assert table == SAMPLE_SHA256
    for name, digest in SAMPLE_SHA256.items():
        assert sha256((SAMPLE_DIR / name).read_bytes()) == digest, name


@pytest.mark.parametrize("split", ["train", "test"])
def test_read_idx_on_the_sample(split: str) -> None:
    images_name, labels_name = FILES[split]
    images = read_idx(SAMPLE_DIR / images_name)
    labels = read_idx(SAMPLE_DIR / labels_name)
    n = sum(SAMPLE_COUNTS[split])
    assert images.shape == (n, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (n,) and labels.dtype == torch.uint8
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert labels.bincount(minlength=10).tolist() == SAMPLE_COUNTS[split]
    assert 0 < images.float().mean() < 255 and int(images.max()) == 255


@pytest.mark.parametrize("split", ["train", "test"])
def test_load_mnist_reads_the_sample_by_default(split: str) -> None:
    images, labels = load_mnist(split)
    n = sum(SAMPLE_COUNTS[split])
    assert images.shape == (n, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (n,) and labels.dtype == torch.int64
    assert labels.bincount(minlength=10).tolist() == SAMPLE_COUNTS[split]
    images[0, 0, 0] = 7  # writable, and not shared with the next call
    assert load_mnist(split)[0][0, 0, 0] == read_idx(SAMPLE_DIR / FILES[split][0])[0, 0, 0]


def test_load_mnist_rejects_other_splits() -> None:
    with pytest.raises(ValueError, match=r"'train', 'test'.*'val'"):
        load_mnist("val")


def test_importing_the_module_reads_nothing_and_starts_nothing() -> None:
    code = ("import sys, threading, ddplab.data; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "assert threading.active_count() == 1, 'a thread started'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- read_idx ---------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
def test_read_idx_raw_and_gzip(tmp_path: Path, compress: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    blob = idx_bytes(array)
    path = tmp_path / "a-idx3-ubyte"
    path.write_bytes(gzip.compress(blob) if compress else blob)
    got = read_idx(path)
    assert got.dtype == torch.uint8 and got.tolist() == array.tolist()
    got += 1  # writable


HEADER_5 = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (5, 28, 28))
BAD_IDX = {
    "wrong magic": (b"\x01\x02\x08\x01" + b"\x00" * 8, "wrong magic number 0x01020801"),
    "wrong type": (bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + b"\x00" * 4,
                   "unsupported IDX data type 0x0D (float)"),
    "truncated": (HEADER_5 + b"\x00" * 1000,
                  "truncated: the header promises 5×28×28 = 3920 bytes of data, "
                  "the file holds 1000"),
    "trailing": (HEADER_5 + b"\x00" * 3923,
                 "trailing bytes: the header promises 5×28×28 = 3920 bytes of data, "
                 "the file holds 3923"),
    "header cut": (HEADER_5[:9], "truncated: the header announces 3 dimensions"),
    "short": (b"\x00\x00\x08", "3 bytes, too short for an IDX header"),
    "empty": (b"", "empty file"),
    "other format": (b"\x89PNG\r\n\x1a\n" + b"\x00" * 50, "not an IDX file: wrong magic"),
}


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
@pytest.mark.parametrize("case", list(BAD_IDX))
def test_read_idx_bad_files_name_the_file_and_the_fault(tmp_path: Path, case: str,
                                                        compress: bool) -> None:
    blob, fault = BAD_IDX[case]
    path = tmp_path / ("bad.gz" if compress else "bad")
    path.write_bytes(gzip.compress(blob) if compress else blob)
    with pytest.raises(ValueError) as caught:
        read_idx(path)
    assert str(caught.value).startswith(f"{path}: ") and fault in str(caught.value)
    assert_alone(caught.value)


@pytest.mark.parametrize("blob", [
    b"\x1f\x8b" + b"garbage, not deflate" * 5,
    gzip.compress(HEADER_5 + b"\x00" * 3920)[:-30],  # stream cut short
    gzip.compress(HEADER_5 + b"\x00" * 3920) + b"trailing junk",
], ids=["garbage", "cut", "junk after"])
def test_read_idx_corrupt_gzip(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(blob)
    with pytest.raises(ValueError, match=r"corrupt gzip stream") as caught:
        read_idx(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert_alone(caught.value)


# --- load_mnist on a directory ---------------------------------------------------------------


def write_set(root: Path, files: dict[str, bytes], *, raw: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        if raw:
            (root / name.removesuffix(".gz")).write_bytes(gzip.decompress(blob))
        else:
            (root / name).write_bytes(blob)
    return root


@pytest.mark.parametrize("raw", [False, True], ids=["gz", "uncompressed"])
def test_load_mnist_from_a_directory(tmp_path: Path, raw: bool) -> None:
    root = write_set(tmp_path / "mnist", fake_mnist(), raw=raw)
    images, labels = load_mnist("train", root)
    assert images.shape == (5, 28, 28) and labels.tolist() == [0, 1, 2, 3, 4]
    assert labels.dtype == torch.int64
    images, labels = load_mnist("test", str(root))
    assert images.shape == (3, 28, 28) and labels.tolist() == [0, 1, 2]


def test_load_mnist_missing_files_says_how_to_get_them(tmp_path: Path) -> None:
    files = fake_mnist()
    del files["train-labels-idx1-ubyte.gz"]
    root = write_set(tmp_path / "partial", files)
    assert load_mnist("test", root)[0].shape == (3, 28, 28)  # the other split is complete
    with pytest.raises(FileNotFoundError) as caught:
        load_mnist("train", root)
    message = str(caught.value)
    assert str(root) in message and "train-labels-idx1-ubyte.gz" in message
    assert "missing train-labels-idx1-ubyte.gz (" in message
    assert f"ddplab data download --root {root}" in message
    assert "root=None" in message and "without --data" in message


@pytest.mark.parametrize("fault, names, match", [
    ("count", ("train-labels-idx1-ubyte.gz", np.arange(4) % 10), "5 images but .* 4 labels"),
    ("range", ("train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 3, 10])), "label 10 outside"),
    ("size", ("train-images-idx3-ubyte.gz", np.zeros((5, 32, 32))), "expected N×28×28"),
    ("rank", ("train-labels-idx1-ubyte.gz", np.zeros((5, 1))), "expected one dimension"),
])
def test_load_mnist_rejects_files_that_do_not_belong_together(
    tmp_path: Path, fault: str, names: tuple[str, np.ndarray], match: str
) -> None:
    name, array = names
    files = fake_mnist()
    files[name] = gzip.compress(idx_bytes(array))
    root = write_set(tmp_path / fault, files)
    with pytest.raises(ValueError, match=match) as caught:
        load_mnist("train", root)
    assert str(root / name) in str(caught.value)


# --- download_mnist ----------------------------------------------------------------------------


def test_download_then_load(tmp_path: Path, mirrors: Mirrors) -> None:
    root = tmp_path / "new" / "dir"
    got = download_mnist(root, [mirrors.url("good")], mirrors.checksums, progress=False)
    assert got == root
    assert sorted(p.name for p in root.iterdir()) == sorted([*NAMES, data.LOCK_NAME])
    for name, blob in mirrors.good.items():
        assert (root / name).read_bytes() == blob
    assert mirrors.fetched() == Counter(dict.fromkeys(NAMES, 1))
    images, labels = load_mnist("train", root)
    assert images.shape == (5, 28, 28) and labels.tolist() == [0, 1, 2, 3, 4]


def test_download_of_the_real_sample_reads_back_identically(tmp_path: Path,
                                                            mirrors: Mirrors) -> None:
    download_mnist(tmp_path, [mirrors.url("sample")], SAMPLE_SHA256, progress=False)
    for split in FILES:
        for ours, shipped in zip(load_mnist(split, tmp_path), load_mnist(split), strict=True):
            assert torch.equal(ours, shipped)


def test_a_dead_mirror_moves_on_to_the_next(tmp_path: Path, mirrors: Mirrors,
                                            dead_mirror: str) -> None:
    download_mnist(tmp_path, [dead_mirror, mirrors.url("good")], mirrors.checksums,
                   progress=False)
    assert leftovers(tmp_path) == sorted(NAMES)


@pytest.mark.parametrize("first", ["drop", "missing", "corrupt"])
def test_a_failing_mirror_moves_on_to_the_next(tmp_path: Path, mirrors: Mirrors,
                                               first: str) -> None:
    download_mnist(tmp_path, [mirrors.url(first), mirrors.url("good")], mirrors.checksums,
                   progress=False)
    assert leftovers(tmp_path) == sorted(NAMES)
    assert mirrors.fetched(first) == Counter(dict.fromkeys(NAMES, 1))
    assert mirrors.fetched("good") == Counter(dict.fromkeys(NAMES, 1))
    for name, blob in mirrors.good.items():
        assert (tmp_path / name).read_bytes() == blob


def test_corrupt_everywhere_is_one_error_and_leaves_nothing(tmp_path: Path,
                                                            mirrors: Mirrors) -> None:
    with pytest.raises(DownloadError) as caught:
        download_mnist(tmp_path, [mirrors.url("corrupt")], mirrors.checksums, progress=False)
    message = str(caught.value)
    assert f"{mirrors.url('corrupt')}train-images-idx3-ubyte.gz: checksum mismatch" in message
    assert "load_mnist(root=None)" in message
    assert leftovers(tmp_path) == []


def test_the_error_names_every_mirror_and_what_failed(tmp_path: Path, mirrors: Mirrors,
                                                      dead_mirror: str) -> None:
    kinds = ["missing", "corrupt", "drop"]
    with pytest.raises(DownloadError) as caught:
        download_mnist(tmp_path, [*map(mirrors.url, kinds), dead_mirror], mirrors.checksums,
                       progress=False)
    message = str(caught.value)
    name = "train-images-idx3-ubyte.gz"
    for kind, fault in zip(kinds, ["HTTP error 404", "checksum mismatch",
                                   "connection dropped mid-file"], strict=True):
        assert f"{mirrors.url(kind)}{name}: {fault}" in message
    assert f"{dead_mirror}{name}: no answer" in message
    assert leftovers(tmp_path) == []


def test_no_mirror_answering_points_at_the_sample(tmp_path: Path, dead_mirror: str) -> None:
    root = tmp_path / "data"
    with pytest.raises(DownloadError) as caught:
        download_mnist(root, [dead_mirror, dead_mirror.rstrip("/")], progress=False)
    message = str(caught.value)
    assert message.count("no answer") == 2
    assert "load_mnist(root=None)" in message and "without --data" in message
    assert leftovers(root) == []


def test_files_present_and_verified_are_not_fetched_again(tmp_path: Path,
                                                         mirrors: Mirrors) -> None:
    download_mnist(tmp_path, [mirrors.url("good")], mirrors.checksums, progress=False)
    mirrors.requests.clear()
    download_mnist(tmp_path, [mirrors.url("good")], mirrors.checksums, progress=False)
    assert sum(mirrors.requests.values()) == 0


def test_a_present_but_corrupt_file_is_fetched_again(tmp_path: Path, mirrors: Mirrors) -> None:
    download_mnist(tmp_path, [mirrors.url("good")], mirrors.checksums, progress=False)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not what was downloaded")
    mirrors.requests.clear()
    download_mnist(tmp_path, [mirrors.url("good")], mirrors.checksums, progress=False)
    assert mirrors.fetched() == Counter({"t10k-labels-idx1-ubyte.gz": 1})
    assert (tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes() == \
        mirrors.good["t10k-labels-idx1-ubyte.gz"]


def test_a_present_but_corrupt_file_does_not_survive_a_failed_download(
    tmp_path: Path, dead_mirror: str
) -> None:
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"corrupt")
    with pytest.raises(DownloadError):
        download_mnist(tmp_path, [dead_mirror], progress=False)
    assert leftovers(tmp_path) == []


def test_unknown_checksum_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train-images\.gz"):
        download_mnist(tmp_path, checksums={"train-images.gz": "0" * 64}, progress=False)


def test_progress_bars_go_to_stderr_only_when_asked(tmp_path: Path, mirrors: Mirrors,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    download_mnist(tmp_path / "quiet", [mirrors.url("good")], mirrors.checksums,
                   progress=False)
    assert capfd.readouterr() == ("", "")
    download_mnist(tmp_path / "loud", [mirrors.url("good")], mirrors.checksums)
    out, err = capfd.readouterr()
    assert out == ""
    for name in NAMES:
        assert re.search(rf"{re.escape(name)}: 100%\|", err), err


def test_two_processes_at_once_fetch_each_file_once(tmp_path: Path, mirrors: Mirrors) -> None:
    import fcntl

    root = tmp_path / "shared"
    root.mkdir()
    code = ("import sys; from ddplab.data import download_mnist; "
            f"download_mnist(sys.argv[1], [{mirrors.url('slow')!r}], {mirrors.checksums!r})")
    logs = [tmp_path / f"rank{i}.log" for i in range(2)]
    # Hold the lock while both start, so that both are provably waiting on it at once.
    with open(root / data.LOCK_NAME, "w") as lock, ExitStack() as files:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [subprocess.Popen([sys.executable, "-c", code, str(root)],
                                  stderr=files.enter_context(open(log, "w"))) for log in logs]
        deadline = time.monotonic() + 30
        while not all("waiting for another process" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            assert all(p.poll() is None for p in procs)
            time.sleep(0.05)
    for p in procs:
        assert p.wait(timeout=30) == 0
    assert mirrors.fetched("slow") == Counter(dict.fromkeys(NAMES, 1))
    assert leftovers(root) == sorted(NAMES)


# --- the command -------------------------------------------------------------------------------


def test_cli_info_on_the_sample(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "info"]) == 0
    out = capsys.readouterr().out
    assert str(SAMPLE_DIR) in out
    assert "train: 8004 digits" in out and "test: 1996 digits" in out
    assert "0:801  1:902  2:793" in out and "0:200  1:225" in out
    assert out.count("matches the sample's digest") == 4


def test_cli_download_then_info(tmp_path: Path, mirrors: Mirrors,
                                monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    # The command checks the published MNIST digests; point them at the served files.
    monkeypatch.setattr(data, "MNIST_SHA256", mirrors.checksums)
    root = tmp_path / "mnist"
    assert main(["data", "download", "--root", str(root), "--no-progress",
                 "--mirror", mirrors.url("missing"), "--mirror", mirrors.url("good")]) == 0
    out, err = capsys.readouterr()
    assert str(root) in out and err == ""
    assert mirrors.fetched() == Counter(dict.fromkeys(NAMES, 1))

    assert main(["data", "info", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "train: 5 digits" in out and "test: 3 digits" in out
    assert out.count("matches the published MNIST digest") == 4

    monkeypatch.setattr(data, "MNIST_SHA256", MNIST_SHA256)
    assert main(["data", "info", "--root", str(root)]) == 0
    assert capsys.readouterr().out.count("MISMATCH") == 4


def test_cli_download_failure_exits_1_with_the_message(tmp_path: Path, mirrors: Mirrors,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    root = tmp_path / "mnist"
    assert main(["data", "download", "--root", str(root), "--no-progress",
                 "--mirror", mirrors.url("good")]) == 1  # fake files, real digests
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("ddplab data download: could not download MNIST")
    assert "checksum mismatch" in err and "load_mnist(root=None)" in err
    assert "Traceback" not in err
    assert leftovers(root) == []


def test_cli_info_on_a_directory_without_mnist(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "info", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"ddplab data download --root {tmp_path}" in err and "Traceback" not in err


def test_cli_download_default_root_is_data_in_the_current_directory(
    tmp_path: Path, mirrors: Mirrors, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data, "MNIST_SHA256", mirrors.checksums)
    monkeypatch.chdir(tmp_path)
    assert main(["data", "download", "--no-progress", "--mirror", mirrors.url("good")]) == 0
    assert leftovers(tmp_path / "data") == sorted(NAMES)


def test_a_subset_of_the_sample_reads_back_as_a_data_directory(tmp_path):
    root = save_subset(tmp_path / "quick", train=5, test=3)
    for split, count in (("train", 5), ("test", 3)):
        images, labels = load_mnist(split, root)
        sample_images, sample_labels = load_mnist(split)
        assert torch.equal(images, sample_images[:count])
        assert torch.equal(labels, sample_labels[:count])
    with pytest.raises(ValueError, match="the sample has 8004 digits; ask for 1 to 8004, not 0"):
        save_subset(tmp_path / "none", train=0, test=3)
