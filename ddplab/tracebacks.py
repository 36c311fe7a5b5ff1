"""Tracebacks and stacks as a learner should read them.

A rank's traceback is formatted inside the rank (where the frames live) and sent to the
notebook as text. Two things make the raw text unfit for a notebook: frames of ddplab's own
machinery, which say nothing about the learner's code, and absolute paths of this machine
(`/tmp/ipykernel_123/456.py`, `.../site-packages/torch/...`), which are noise for a learner and
make outputs differ between machines. So cells are named the way IPython names them
(`Cell In[5]`), library files by their path inside the installation, and ddplab's frames go.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import threading
import traceback
from collections.abc import Iterable, Mapping

# Files whose frames are ddplab's plumbing, never the learner's code.
_INTERNAL = {
    os.path.join(os.path.dirname(__file__), name)
    for name in ("worker.py", "forkserver.py", "tracebacks.py")
}
_STDLIB = sysconfig.get_paths()["stdlib"].rstrip(os.sep) + os.sep
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SITE = re.compile(r".*[/\\](?:site|dist)-packages[/\\]")

# Where a cell's code came from: filename -> display name ("Cell In[5]"). Filled by the
# kernel's messages (see `install_sources`) so that ranks print the names IPython prints.
cell_names: dict[str, str] = {}


def install_sources(sources: Mapping[str, tuple[str, str]]) -> None:
    """Make cell sources sent by the kernel visible to tracebacks in this process.

    `sources` maps a code filename to (display name, source text). The text goes into
    `linecache` with no modification time, so `checkcache` never drops it.
    """
    for filename, (display, text) in sources.items():
        lines = text.splitlines(keepends=True)
        linecache.cache[filename] = (len(text), None, lines, filename)
        cell_names[filename] = display


def display_path(filename: str) -> str:
    """A short, machine-independent name for a source file."""
    if filename in cell_names:
        return cell_names[filename]
    if filename.startswith("<"):
        return filename
    match = _SITE.match(filename)
    if match:
        return filename[match.end():]
    if filename.startswith(_STDLIB):
        return filename[len(_STDLIB):]
    if filename.startswith(_PACKAGE_ROOT):
        return filename[len(_PACKAGE_ROOT):]
    return filename


def is_user_frame(filename: str) -> bool:
    """True for the learner's code: cells and files outside installed packages."""
    if filename in cell_names:
        return True
    if filename in _INTERNAL or filename.startswith(_STDLIB) or _SITE.match(filename):
        return False
    return not filename.startswith("<frozen")


def _after_internal(frames: Iterable[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames below ddplab's machinery: the learner's code and what it called."""
    frames = list(frames)
    last = max((i for i, f in enumerate(frames) if f.filename in _INTERNAL), default=-1)
    return [f for f in frames[last + 1:] if not f.filename.startswith("<frozen")]


def _clean(frames: Iterable[traceback.FrameSummary]) -> traceback.StackSummary:
    kept = []
    for f in _after_internal(frames):
        line = linecache.getline(f.filename, f.lineno or 0).strip() or f.line
        kept.append(traceback.FrameSummary(display_path(f.filename), f.lineno, f.name,
                                           lookup_line=False, line=line))
    return traceback.StackSummary.from_list(kept)


def _clean_exception(te: traceback.TracebackException) -> None:
    te.stack = _clean(te.stack)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _clean_exception(chained)


def format_exception(exc: BaseException) -> str:
    """The exception's traceback without ddplab frames and with readable file names."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    _clean_exception(te)
    return "".join(te.format())


def describe_stack(frame) -> tuple[str, str]:
    """(headline, formatted frames) for where a running thread is right now.

    The headline names the innermost Python function the thread is in, when that is
    library code ("waiting in recv() of torch/distributed/distributed_c10d.py"), or says
    it is running the learner's own code; the frames shown are the learner's only.
    """
    frames = _after_internal(traceback.extract_stack(frame))
    last_user = max((i for i, f in enumerate(frames) if is_user_frame(f.filename)), default=None)
    shown = frames if last_user is None else frames[: last_user + 1]
    if last_user is not None and last_user == len(frames) - 1:
        headline = "running its own code"
    else:
        inner = frames[-1] if frames else None
        headline = (f"waiting in {inner.name}() of {display_path(inner.filename)}"
                    if inner else "not running Python code")
    return headline, "".join(_clean(shown).format())


def current_main_stack() -> tuple[str, str]:
    """describe_stack for this process's main thread (called from another thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "not running Python code", ""
    return describe_stack(frame)
