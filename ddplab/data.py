"""MNIST without torchvision: read the IDX files, ship a sample, download the full set.

    images, labels = load_mnist("train")               # the 10,000-digit sample in the package
    download_mnist("data")                             # the full 70,000 digits, verified
    images, labels = load_mnist("train", root="data")  # uint8 N×28×28, int64 N

The kit must work offline and in CI, so a real 10,000-digit sample of MNIST ships inside
the package (``ddplab/mnist_sample/``, see its README for provenance and license) in the
original file format; the same code reads it and the full set. ``download_mnist`` fetches
the full set from the mirrors PyTorch and TensorFlow use, checks every file against the
published SHA-256 digests, and never leaves a partial or corrupt file behind: a learner
whose download broke gets one error saying what failed and how to go on with the sample.

Every rank of a training job may call ``download_mnist`` at once; one process per node
downloads while the others wait on a lock file, then find the files in place.

Importing this module reads no file, starts nothing and does not import torch (the
``ddplab data`` command does not need it); it is safe to import before forking ranks.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import http.client
import math
import os
import struct
import sys
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "FILES",
    "MIRRORS",
    "MNIST_SHA256",
    "SAMPLE_DIR",
    "SAMPLE_SHA256",
    "SPLITS",
    "DownloadError",
    "describe",
    "download_mnist",
    "load_mnist",
    "read_idx",
    "save_subset",
    "write_idx",
]

SPLITS = ("train", "test")

# (images, labels) per split, named as in the original MNIST distribution.
FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# Tried in order: the mirror torchvision's MNIST uses (its other one, yann.lecun.com, now
# often refuses downloads), then the one TensorFlow and tensorflow_datasets use.
MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


def _digest_table(text: str) -> dict[str, str]:
    """File name → digest, from lines in `sha256sum`'s format (compare: sha256sum *.gz)."""
    return {name: digest for digest, name in (line.split() for line in text.strip().splitlines())}


# SHA-256 of the four original .gz files, as published in tensorflow/datasets
# (tensorflow_datasets/url_checksums/mnist.txt) and pytorch/vision (the prototype
# datasets' MNIST._CHECKSUMS); the two agree. torchvision's MNIST class checks the same
# files by MD5: f68b3c2d…, d53e105e…, 9fb629c4…, ec29112d….
MNIST_SHA256: dict[str, str] = _digest_table("""
440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609  train-images-idx3-ubyte.gz
3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c  train-labels-idx1-ubyte.gz
8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6  t10k-images-idx3-ubyte.gz
f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6  t10k-labels-idx1-ubyte.gz
""")

# The shipped sample (ddplab/mnist_sample/README.md): 8004 training and 1996 test digits.
SAMPLE_DIR = Path(__file__).resolve().parent / "mnist_sample"
SAMPLE_SHA256: dict[str, str] = _digest_table("""
42a5e6e1ee3866e7a844b062698e5b3dd29a7631eff746cf70aea29b8bed6940  train-images-idx3-ubyte.gz
2b4625ed82300eebe80a93a91bfa103ffce662460d3298840c6234d775c037c9  train-labels-idx1-ubyte.gz
80fe9318d4027d7b2cc08b2ac95f14dfaea2813d1a94da44c9bf11eb88a098af  t10k-images-idx3-ubyte.gz
ccad6b7e93ced7377383ee1eb7e4d5327206fddea1bbf06071d649253790b842  t10k-labels-idx1-ubyte.gz
""")

TIMEOUT = 30.0  # seconds a mirror may take to connect, or between two pieces of a file
LOCK_NAME = ".download.lock"
_CHUNK = 1 << 16
_GZIP_MAGIC = b"\x1f\x8b"
_IDX_TYPES = {0x08: "unsigned byte", 0x09: "signed byte", 0x0B: "short", 0x0C: "int",
              0x0D: "float", 0x0E: "double"}
_SAMPLE_FIX = (
    "To go on without it, use the 10,000-digit sample that ships with ddplab: "
    "load_mnist(root=None) in Python, or run the training without --data."
)


class DownloadError(RuntimeError):
    """MNIST could not be downloaded: no mirror answered, or none served the right bytes."""


# --- reading ---------------------------------------------------------------------------------


def read_idx(path: str | os.PathLike[str]) -> torch.Tensor:
    """The uint8 array in an IDX file (gzip-compressed or raw), shaped as its header says.

    Every way a file can be wrong (not IDX, not gzip after all, cut short, longer than its
    header says) raises ValueError naming the file and the fault, so that a broken download
    reads as one sentence rather than a numpy or zlib traceback.
    """
    import torch

    return torch.from_numpy(_read_idx_array(Path(path)))


def _read_idx_array(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        raw = _gunzip(path, raw)
    dims, offset = _idx_header(path, raw)
    expected = math.prod(dims)
    held = len(raw) - offset
    if held != expected:
        fault = "truncated" if held < expected else "trailing bytes"
        shape = "×".join(map(str, dims))
        raise ValueError(
            f"{path}: {fault}: the header promises {shape} = {expected} bytes of data, "
            f"the file holds {held}"
        )
    # frombuffer is a view on the bytes (fast, read-only); the copy makes it writable.
    return np.frombuffer(raw, dtype=np.uint8, count=expected, offset=offset).reshape(dims).copy()


def _gunzip(path: Path, raw: bytes) -> bytes:
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: corrupt gzip stream ({exc})") from None


def _idx_header(path: Path, raw: bytes) -> tuple[tuple[int, ...], int]:
    """The dimensions an IDX header announces, and where the data starts."""
    if len(raw) < 4:
        what = "empty file" if not raw else f"{len(raw)} bytes, too short for an IDX header"
        raise ValueError(f"{path}: not an IDX file: {what}")
    if raw[:2] != b"\x00\x00":
        raise ValueError(
            f"{path}: not an IDX file: wrong magic number 0x{raw[:4].hex()} "
            "(IDX files start with two zero bytes, a type byte and a dimension count)"
        )
    kind, ndim = raw[2], raw[3]
    if kind != 0x08:
        name = _IDX_TYPES.get(kind, "unknown")
        raise ValueError(
            f"{path}: unsupported IDX data type 0x{kind:02X} ({name}); "
            "only 0x08 (unsigned byte) is supported"
        )
    offset = 4 + 4 * ndim
    if len(raw) < offset:
        raise ValueError(
            f"{path}: truncated: the header announces {ndim} dimensions "
            f"({offset} bytes of header), the file holds {len(raw)} bytes"
        )
    return struct.unpack(f">{ndim}I", raw[4:offset]), offset


def load_mnist(
    split: str = "train", root: str | os.PathLike[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST's images (uint8 N×28×28) and labels (int64 N) for `split`, "train" or "test".

    `root=None` reads the 10,000-digit sample shipped in the package (8004 train, 1996
    test), so that everything works offline; a directory reads the files
    `download_mnist` put there (or the same names without .gz). Nothing is cached: each
    call reads the files, which keeps forked ranks free of shared state.
    """
    import torch

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(map(repr, SPLITS))}, not {split!r}")
    image_path, label_path = _split_files(split, root)
    images = _read_idx_array(image_path)
    labels = _read_idx_array(label_path)
    _check_pair(image_path, images, label_path, labels)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def write_idx(path: str | os.PathLike[str], array: torch.Tensor) -> None:
    """Write a uint8 tensor as an IDX file (gzipped when `path` ends in .gz), as MNIST ships.

    The header is two zero bytes, the type (8: unsigned byte), the number of dimensions,
    then each size as a big-endian 32-bit integer; the values follow, row by row.
    """
    import torch

    if array.dtype != torch.uint8 and (array.min() < 0 or array.max() > 255):
        raise ValueError("write_idx writes unsigned bytes: values must lie in 0..255")
    header = bytes([0, 0, 0x08, array.dim()]) + b"".join(
        struct.pack(">I", n) for n in array.shape)
    data = header + array.to(torch.uint8).contiguous().numpy().tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(data)


def save_subset(root: str | os.PathLike[str], train: int, test: int) -> Path:
    """The first `train` and `test` digits of the shipped sample, as a `--data` directory.

    For quick runs (a launcher shown working, a test): `python -m ddplab.train --data
    ROOT` then trains on `train` digits and tests on `test`. Returns `root`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        images, labels = load_mnist(split)
        if not 1 <= count <= len(labels):
            raise ValueError(f"{split}: the sample has {len(labels)} digits; ask for 1 to "
                             f"{len(labels)}, not {count}")
        image_name, label_name = FILES[split]
        write_idx(root / image_name, images[:count])
        write_idx(root / label_name, labels[:count])
    return root


def _split_files(split: str, root: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """The image and label files of `split` under `root` (the sample when None)."""
    if root is None:
        images, labels = FILES[split]
        return SAMPLE_DIR / images, SAMPLE_DIR / labels
    root = Path(root)
    found: list[Path] = []
    missing: list[str] = []
    for name in FILES[split]:
        candidates = [root / name, root / name.removesuffix(".gz")]
        present = [p for p in candidates if p.is_file()]
        if present:
            found.append(present[0])
        else:
            missing.append(name)
    if missing:
        raise FileNotFoundError(
            f"{root}: no MNIST {split} split there: missing {' and '.join(missing)} (or the "
            f"same names without .gz). Download the full set with "
            f"`ddplab data download --root {root}`; or use the 10,000-digit sample that ships "
            "with ddplab: load_mnist(root=None), or run the training without --data."
        )
    return found[0], found[1]


def _check_pair(image_path: Path, images: np.ndarray, label_path: Path,
                labels: np.ndarray) -> None:
    """Images and labels that belong together: N×28×28 images, N labels in 0..9."""
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(
            f"{image_path}: not MNIST images: shape {tuple(images.shape)}, expected N×28×28"
        )
    if labels.ndim != 1:
        raise ValueError(f"{label_path}: not MNIST labels: shape {tuple(labels.shape)}, "
                         "expected one dimension")
    if len(images) != len(labels):
        raise ValueError(
            f"{image_path} holds {len(images)} images but {label_path} holds {len(labels)} "
            "labels: they are not one pair"
        )
    if len(labels) and labels.max() > 9:
        raise ValueError(f"{label_path}: label {int(labels.max())} outside 0..9: "
                         "not MNIST labels")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def describe(root: str | os.PathLike[str] | None = None) -> str:
    """What `ddplab data info` prints: per split, the files, digits, classes and checksums.

    Files ending .gz are checked against the sample's digests (`root=None`) or the published
    MNIST ones; uncompressed files have no published digest to check.
    """
    if root is None:
        lines = [f"MNIST sample shipped with ddplab: {SAMPLE_DIR}"]
        digests, whose = SAMPLE_SHA256, "the sample's"
    else:
        lines = [f"MNIST in {Path(root)}"]
        digests, whose = MNIST_SHA256, "the published MNIST"
    for split in SPLITS:
        image_path, label_path = _split_files(split, root)
        images, labels = _read_idx_array(image_path), _read_idx_array(label_path)
        _check_pair(image_path, images, label_path, labels)
        counts = np.bincount(labels, minlength=10)
        lines.append(f"{split}: {len(labels)} digits")
        lines.append(f"  files:   {image_path.name}, {label_path.name}")
        lines.append("  classes: " + "  ".join(f"{d}:{n}" for d, n in enumerate(counts)))
        for path in (image_path, label_path):
            lines.append(f"  sha256:  {path.name}: {_checksum_verdict(path, digests, whose)}")
    return "\n".join(lines)


def _checksum_verdict(path: Path, digests: Mapping[str, str], whose: str) -> str:
    if path.name not in digests:
        return "not checked (no published digest for uncompressed files)"
    if _sha256(path) == digests[path.name]:
        return f"matches {whose} digest"
    return f"MISMATCH: differs from {whose} digest"


# --- downloading -----------------------------------------------------------------------------


class _MirrorFailed(Exception):
    """One mirror could not deliver one file; the reason goes into the DownloadError."""


def download_mnist(
    root: str | os.PathLike[str],
    mirrors: Sequence[str] | None = None,
    checksums: Mapping[str, str] | None = None,
    progress: bool = True,
) -> Path:
    """Download the full MNIST (70,000 digits, four .gz files) into `root`; return it as a Path.

    Each file comes from the first of `mirrors` (base URLs, default `MIRRORS`) that
    delivers it whole with the right SHA-256 (`checksums`, file name → hex digest,
    overrides the published `MNIST_SHA256`). Files already in `root` with the right digest
    are kept, and a run where all are present downloads nothing; a present but corrupt one
    is fetched again. A file is written to a hidden ``.<name>.<pid>.*.part`` file, hashed as
    it streams, and renamed into place only once its digest matches, so an interrupted or
    failed download leaves no partial or corrupt file. When a file fails on every mirror,
    one DownloadError names each mirror and what went wrong with it (files verified by then
    stay; the next run fetches only the rest).

    Ranks that call this at once on one node take turns on an exclusive lock on
    ``root/.download.lock`` (left in place afterwards): the first downloads, the others
    then find the files verified and download nothing. `progress` shows a bar per file,
    and the mirrors that failed, on stderr; False prints nothing.
    """
    root = Path(root)
    bases = _mirror_bases(MIRRORS if mirrors is None else mirrors)
    expected = _expected_digests(checksums)
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / LOCK_NAME, progress):
        for name, digest in expected.items():
            _ensure_file(root, name, digest, bases, progress)
    return root


def _mirror_bases(mirrors: Sequence[str] | str) -> list[str]:
    if isinstance(mirrors, str):  # one mirror passed as a string, not a string's characters
        mirrors = [mirrors]
    if not mirrors:
        raise ValueError("download_mnist: no mirror to download from")
    return [m if m.endswith("/") else m + "/" for m in mirrors]


def _expected_digests(checksums: Mapping[str, str] | None) -> dict[str, str]:
    expected = dict(MNIST_SHA256)
    unknown = sorted(set(checksums or {}) - set(expected))
    if unknown:
        raise ValueError(
            f"download_mnist: checksums for unknown files {unknown}; "
            f"the files are {sorted(expected)}"
        )
    expected.update({name: d.lower() for name, d in (checksums or {}).items()})
    return expected


@contextlib.contextmanager
def _exclusive_lock(path: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if need be); waiting says so on stderr."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another process downloading MNIST into {path.parent} ...",
                      file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _ensure_file(root: Path, name: str, digest: str, bases: list[str], progress: bool) -> None:
    """`root/name` with the right digest: kept if already so, else downloaded."""
    final = root / name
    if final.is_file():
        if _sha256(final) == digest:
            return
        # Never leave a corrupt file under the final name, even if no mirror answers now.
        final.unlink()
        if progress:
            print(f"{final}: wrong checksum, downloading it again", file=sys.stderr, flush=True)
    failures: list[str] = []
    for i, base in enumerate(bases):
        url = base + name
        try:
            _fetch(url, final, digest, progress)
            return
        except _MirrorFailed as exc:
            failures.append(f"    {url}: {exc}")
            if progress:
                more = "; trying the next mirror" if i + 1 < len(bases) else ""
                print(f"{url}: {exc}{more}", file=sys.stderr, flush=True)
    raise DownloadError(
        f"could not download MNIST into {root}: no mirror delivered {name} intact:\n"
        + "\n".join(failures)
        + f"\nNo partial or corrupt file was left in {root}. {_SAMPLE_FIX}"
    )


def _fetch(url: str, final: Path, digest: str, progress: bool) -> None:
    """Stream `url` into a hidden .part file beside `final`; rename it there if it verifies.

    Raises _MirrorFailed for anything the next mirror might do better: no answer, an HTTP
    error, a connection dropped mid-file, a wrong digest. The .part file never survives.
    """
    fd, part_name = tempfile.mkstemp(prefix=f".{final.name}.{os.getpid()}.", suffix=".part",
                                     dir=final.parent)
    os.close(fd)
    part = Path(part_name)
    try:
        got = _stream(url, part, final.name, progress)
        if got != digest:
            raise _MirrorFailed(f"checksum mismatch (sha256 {got}, expected {digest})")
        os.replace(part, final)
    finally:
        part.unlink(missing_ok=True)  # gone already after a successful os.replace


def _stream(url: str, part: Path, label: str, progress: bool) -> str:
    """Copy `url`'s body into the file `part`, showing a progress bar; the body's SHA-256."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as resp, open(part, "wb") as out:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            received = 0
            with tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                      file=sys.stderr, disable=not progress, leave=True) as bar:
                while chunk := resp.read(_CHUNK):
                    _write(out, part, chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
    except urllib.error.HTTPError as exc:
        raise _MirrorFailed(f"HTTP error {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise _MirrorFailed(f"no answer ({exc.reason})") from None
    except http.client.IncompleteRead as exc:
        raise _MirrorFailed(f"connection dropped mid-file ({exc})") from None
    except (http.client.HTTPException, OSError) as exc:  # timeouts and resets are OSErrors
        raise _MirrorFailed(f"connection failed mid-file ({exc!r})") from None
    if total is not None and received < total:
        raise _MirrorFailed(
            f"connection dropped mid-file after {received} of {total} bytes"
        )
    return digest.hexdigest()


def _write(out: BinaryIO, part: Path, chunk: bytes) -> None:
    """Write, turning a local failure (a full disk) into a DownloadError of its own: it is
    no reason to try the next mirror, nor should it read as the mirror's fault."""
    try:
        out.write(chunk)
    except OSError as exc:
        raise DownloadError(
            f"could not download MNIST into {part.parent}: writing failed ({exc}). "
            f"No partial file was left there. {_SAMPLE_FIX}"
        ) from None
