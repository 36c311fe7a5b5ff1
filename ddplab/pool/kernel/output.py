"""The ranks' stdout and stderr, brought into the notebook cell that ran the code.

Each rank writes to two pipes that the kernel reads. Text is shown from the kernel's main
thread, by writing to `sys.stdout` / `sys.stderr` there: under nbval ipykernel does not
capture subprocesses' output, and output written from other threads can land in the wrong
cell. By default a call's output is shown when the call ends, grouped in rank order under
`[rank N]` headers, so it is the same on every run (nbval compares it). With `stream=True`
lines are shown as they arrive, each prefixed with `[rank N]`.

A rank ends each call's output with a marker (see `ddplab.pool.protocol`); a call's output is
complete when both of each rank's streams have shown that marker, or have closed.
"""

from __future__ import annotations

import codecs
import os
import re
import sys
from dataclasses import dataclass, field

from ddplab.pool.ipython import cells
from ddplab.pool.protocol import MARK_HEAD as _MARK_HEAD
from ddplab.pool.protocol import MARK_TAIL as _MARK_TAIL
from ddplab.pool.tracebacks import display_path

STREAMS = ("stdout", "stderr")


@dataclass
class _Stream:
    rank: int
    name: str  # "stdout" or "stderr"
    pending: bytes = b""
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    text: list[str] = field(default_factory=list)  # this call's text, not yet shown
    partial_line: str = ""  # stream mode: the unfinished line
    last_mark: int = -1
    closed: bool = False


# faulthandler's crash dumps ("  File "/abs/path.py", line 3 in f") name files by absolute
# path; shorten them as tracebacks are, so a crash report shows no machine paths.
_DUMP_FRAME = re.compile(r'^(\s*File ")([^"]+)(", line \d+)', re.MULTILINE)


# torch's C++ log lines start "[rank0]:[E1121 05:00:26.545108378 ProcessGroupGloo.cpp:67] ":
# the rank is already in the header and the time differs at every run, so keep only the
# level and the source line ("[E ProcessGroupGloo.cpp:67] "): outputs stay comparable.
_C10_LOG = re.compile(r"^(?:\[rank\d+\]:)?\[([DIWEF])\d{4} [\d:.]+ (?:\d+ )?([^\]\s]+)\] ",
                      re.MULTILINE)


# CPython's fatal-error report ends with the extension modules loaded ("Extension modules:
# numpy..., torch._C, ... (total: 30)"): a list that depends on the install (a CUDA build of
# torch adds cuda.bindings) and says nothing about the crash. Leave it out.
_EXTENSION_MODULES = re.compile(r"^\n?Extension modules: [^\n]*\(total: \d+\)\n?", re.MULTILINE)


def _dump_path(filename: str) -> str:
    """A file of a crash dump, named as tracebacks name it: "Cell In[4]" for a cell.

    faulthandler prints a code object's own file name: for a function defined in a cell,
    the kernel's file of that cell (kept by `pickling` when the function is sent).
    """
    return cells.cell_names().get(filename) or display_path(filename)


def _tidy(text: str) -> str:
    text = _EXTENSION_MODULES.sub("", _C10_LOG.sub(r"[\1 \2] ", text))
    return _DUMP_FRAME.sub(lambda m: m[1] + _dump_path(m[2]) + m[3], text)


def _rank_order(stream: _Stream) -> tuple[int, int]:
    """Rank by rank, and within a rank stdout before stderr."""
    return stream.rank, STREAMS.index(stream.name)


class OutputRouter:
    """Collects the ranks' output for one pool and shows it in the running cell.

    A quiet router reads everything (so no rank ever blocks on a full pipe) and shows
    nothing: for pools that run code the learner did not write in this cell.
    """

    def __init__(self, quiet: bool = False) -> None:
        self._by_fd: dict[int, _Stream] = {}
        self._call_id = 0
        self._live = False
        self.quiet = quiet

    def add(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        for name, fd in zip(STREAMS, (stdout_fd, stderr_fd), strict=True):
            os.set_blocking(fd, False)
            self._by_fd[fd] = _Stream(rank, name)

    def fds(self) -> list[int]:
        return [fd for fd, s in self._by_fd.items() if not s.closed]

    def close_all(self) -> None:
        for fd in self._by_fd:
            os.close(fd)
        self._by_fd.clear()

    def begin(self, call_id: int, live: bool) -> None:
        self._call_id = call_id
        self._live = live

    def complete(self, ranks) -> bool:
        """Has every stream of these ranks shown this call's marker (or closed)?"""
        return all(s.closed or s.last_mark >= self._call_id
                   for s in self._by_fd.values() if s.rank in ranks)

    def read(self, fd: int) -> bool:
        """Read what is available on fd; False once it has closed."""
        stream = self._by_fd[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            stream.closed = True
            self._emit(stream, stream.decoder.decode(stream.pending, final=True))
            stream.pending = b""
            return False
        self._consume(stream, stream.pending + data)
        return True

    def _consume(self, stream: _Stream, data: bytes) -> None:
        while True:
            start = data.find(_MARK_HEAD)
            if start < 0:
                break
            end = data.find(_MARK_TAIL, start + len(_MARK_HEAD))
            if end < 0:
                break  # the marker is cut in two; wait for the rest
            self._emit(stream, stream.decoder.decode(data[:start]))
            stream.last_mark = int(data[start + len(_MARK_HEAD):end])
            data = data[end + len(_MARK_TAIL):]
        # Hold back what may be the start of a marker: a whole head whose number has not
        # arrived yet, or a tail that is the beginning of a head.
        start = data.find(_MARK_HEAD)
        if start < 0:
            start = len(data)
            for k in range(min(len(_MARK_HEAD) - 1, len(data)), 0, -1):
                if data.endswith(_MARK_HEAD[:k]):
                    start = len(data) - k
                    break
        self._emit(stream, stream.decoder.decode(data[:start]))
        stream.pending = data[start:]

    def _emit(self, stream: _Stream, text: str) -> None:
        if not text or self.quiet:
            return
        if not self._live:
            stream.text.append(text)
            return
        lines = (stream.partial_line + text).split("\n")
        stream.partial_line = lines.pop()
        if lines:
            out = sys.stdout if stream.name == "stdout" else sys.stderr
            out.write("".join(f"[rank {stream.rank}] {_tidy(line)}\n" for line in lines))
            out.flush()

    def show(self) -> None:
        """Show what this call printed: grouped by rank, or the last partial lines."""
        if self._live:
            for stream in sorted(self._by_fd.values(), key=_rank_order):
                if stream.partial_line:
                    out = sys.stdout if stream.name == "stdout" else sys.stderr
                    out.write(f"[rank {stream.rank}] {stream.partial_line}\n")
                    out.flush()
                    stream.partial_line = ""
            return
        for stream in sorted(self._by_fd.values(), key=_rank_order):
            text = _tidy("".join(stream.text))
            stream.text.clear()
            if not text:
                continue
            out = sys.stdout if stream.name == "stdout" else sys.stderr
            out.write(f"[rank {stream.rank}]\n{text}" + ("" if text.endswith("\n") else "\n"))
            out.flush()
