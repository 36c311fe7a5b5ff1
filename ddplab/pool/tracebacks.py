"""Tracebacks and stacks as a learner should read them.

A rank's traceback is formatted inside the rank (where the frames live) and sent to the
notebook as text. Two things make the raw text unfit for a notebook: frames of ddplab's own
machinery, which say nothing about the learner's code, and absolute paths of this machine
(`/tmp/ipykernel_123/456.py`, `.../site-packages/torch/...`), which are noise for a learner and
make outputs differ between machines. So cells are named the way IPython names them
(`Cell In[5]`), library files by their path inside the installation, and ddplab's frames go.

A traceback shown to a learner (`format_exception`) goes one step further: the frames
inside torch and other libraries (c10d_logger's wrappers, `Module._call_impl`, ...) are
left out, and where the exception was raised inside a library, one line names the
innermost function and its file, without line numbers that change between releases. The
learner's own lines keep their numbers and source. Every frame stays available to
maintainers in `format_full`'s text (`RankFailure.full_traceback`).
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
from typing import Any

from ddplab.pool.errors import Frame, ThreadStack

# Files whose frames are ddplab's plumbing, never the learner's code: the rank's loop, the
# forkserver that forked it, and this module (this file is ddplab/pool/tracebacks.py).
_POOL = os.path.dirname(__file__)
_INTERNAL = {os.path.join(_POOL, *path) for path in (("rank.py",), ("kernel", "forkserver.py"),
                                                     ("tracebacks.py",))}
_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # ddplab's own files
_STDLIB = sysconfig.get_paths()["stdlib"].rstrip(os.sep) + os.sep
_PACKAGE_ROOT = os.path.dirname(_KIT.rstrip(os.sep)) + os.sep  # the folder that holds ddplab
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


def passed_through_user_code(exc: BaseException) -> bool:
    """Did the exception come through the learner's own code (a cell, a file of theirs)?

    False when every frame it passed is ddplab's or a library's: then the learner's code
    was not running when it was raised. An exercise check uses this to tell its own bug
    from the learner's mistake.
    """
    return any(is_user_frame(f.filename) and not f.filename.startswith(_KIT)
               for f in traceback.extract_tb(exc.__traceback__))


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


# The line that stands for the library frames under the learner's last line.
LIBRARY_LINE = "  (raised in {function}() of {file})\n"


class _LibraryFrame(traceback.FrameSummary):
    """The innermost frame of the library code a traceback ends in, shown on one line."""


class _ShownStack(traceback.StackSummary):
    """The learner's frames, then at most one `_LibraryFrame`, which prints as one line.

    `format` is the one method overridden, the one every supported Python's
    `TracebackException.format` calls on its stack. Its arguments are passed on untouched:
    they differ between Pythons (3.13 added `colorize=`), and so does what `format` calls
    (`format_frame_summary` appeared in 3.11 and got `colorize=` in 3.13; 3.10 has none,
    and printed the library frame as "line None"). The learner's frames are formatted by
    a plain `StackSummary`, the library frame by `LIBRARY_LINE`.
    """

    def format(self, *args: Any, **kwargs: Any) -> list[str]:
        own = [f for f in self if not isinstance(f, _LibraryFrame)]
        lines = traceback.StackSummary.from_list(own).format(*args, **kwargs)
        return lines + [LIBRARY_LINE.format(function=f.name, file=f.filename)
                        for f in self if isinstance(f, _LibraryFrame)]


def _shown(frames: Iterable[traceback.FrameSummary]) -> traceback.StackSummary:
    """The learner's frames, and one line for the library code the exception came from.

    Library frames between two of the learner's frames (a Module's `__call__` on the way
    to a cell's `forward`) are left out; a run of them at the end, where the exception
    was raised, becomes one line naming its innermost function and file.
    """
    frames = _after_internal(frames)
    cleaned = list(_clean(frames))
    kept = [c for f, c in zip(frames, cleaned, strict=True) if is_user_frame(f.filename)]
    if frames and not is_user_frame(frames[-1].filename):
        kept.append(_LibraryFrame(cleaned[-1].filename, None, cleaned[-1].name,
                                  lookup_line=False))
    return _ShownStack(kept)


def _clean_exception(te: traceback.TracebackException, shown: bool) -> None:
    te.stack = _shown(te.stack) if shown else _clean(te.stack)
    for chained in (te.__cause__, te.__context__):
        if chained is not None:
            _clean_exception(chained, shown)


def format_exception(exc: BaseException) -> str:
    """The exception's traceback as a learner should read it.

    The learner's frames (cells, their own files) with line numbers and source lines, then
    one line for the library function the exception was raised in, then the exception.
    ddplab's machinery, the frames inside torch and library line numbers are left out.
    """
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    _clean_exception(te, shown=True)
    return "".join(te.format())


def format_full(exc: BaseException) -> str:
    """Every frame below ddplab's machinery, torch's included, with line numbers.

    For maintainers: what `format_exception` leaves out is here.
    """
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    _clean_exception(te, shown=False)
    return "".join(te.format())


def _frame(f: traceback.FrameSummary) -> Frame:
    code = linecache.getline(f.filename, f.lineno or 0).strip() or (f.line or "")
    return Frame(display_path(f.filename), f.lineno or 0, f.name, code)


def thread_stack(frame, name: str = "MainThread") -> ThreadStack:
    """Where a running thread is right now, as structured frames.

    The learner's frames are kept, outermost first; of the library code they called only
    the innermost frame is kept, as `waiting_in` ("waiting in recv() of
    torch/distributed/distributed_c10d.py"). With no learner's frame at all (a thread the
    library started), every frame below ddplab's machinery is kept.
    """
    frames = _after_internal(traceback.extract_stack(frame))
    last_user = max((i for i, f in enumerate(frames) if is_user_frame(f.filename)), default=None)
    shown = frames if last_user is None else frames[: last_user + 1]
    inner = frames[-1] if frames and last_user != len(frames) - 1 else None
    return ThreadStack(name, [_frame(f) for f in shown], _frame(inner) if inner else None)


def current_stacks() -> list[ThreadStack]:
    """Every Python thread of this process but ddplab's own, the main thread first.

    Called from the rank's control thread while the main thread may be blocked.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    stacks = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        name = names.get(ident, f"thread {ident}")
        if ident == threading.get_ident() or name.startswith("ddplab-"):
            continue
        stacks.append(thread_stack(frame, name))
    return stacks


def format_warning(message, category, filename, lineno, line=None) -> str:
    """`warnings.formatwarning` that names a cell as tracebacks do: "Cell In[4], line 5".

    Python's own format names the file a cell's code was compiled from, which is the
    kernel's temporary file (/tmp/ipykernel_<pid>/<hash>.py); library files lose this
    machine's install path, as in tracebacks.
    """
    if line is None:
        line = linecache.getline(filename, lineno).strip()
    name = display_path(filename)
    where = f"{name}, line {lineno}" if filename in cell_names else f"{name}:{lineno}"
    text = f"{where}: {category.__name__}: {message}\n"
    return text + (f"  {line.strip()}\n" if line and line.strip() else "")
