"""Exercises with automatic checks: the learner writes a function, `check` runs it for real.

In a chapter:

    def whoami():
        ...                       # the learner's attempt

    check("1.1", whoami)          # runs it on real ranks, says what is wrong and gives a hint

A check never raises at the learner: it returns a `Feedback` that prints as a short
verdict (✓ or ✗), what was expected and what came back, and a hint that points the way
without giving the answer. Each chapter's exercises live in their own module
(`ddplab.exercises.ch01`, ...), registered with `@exercise`. Solutions for instructors are
in `notebooks/solutions/chNN.py`, as functions named by each exercise's `solution`; the
test suite proves every solution passes its check and an empty attempt does not.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from ddplab.pool import tracebacks
from ddplab.pool.errors import RankError, RankTimeout, ranks_text


@dataclass
class Feedback:
    """The verdict on one attempt. Prints as a message for the learner."""

    exercise: str
    passed: bool
    message: str
    hint: str = ""
    # What the ranks raised, whole (every rank's traceback, a hang's stacks), when the
    # verdict is "your code failed on the ranks": the learner reads the message, a test
    # that expected a pass shows this.
    error: BaseException | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        if self.passed:
            return f"✓ Exercise {self.exercise} passed: {self.message}"
        text = f"✗ Exercise {self.exercise} not yet: {self.message}"
        return text + (f"\n  Hint: {self.hint}" if self.hint else "")

    def __bool__(self) -> bool:
        return self.passed


class NotYet(Exception):
    """Raised inside a checker to fail the attempt with a message (and a hint)."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass
class Exercise:
    id: str
    title: str
    solution: str  # the function's name in notebooks/solutions/chNN.py
    checker: Callable[[Callable], str]  # returns the success message, or raises NotYet
    hint: str = ""  # shown when the attempt fails without a more specific hint
    takes: str = "function"  # or "script": the path of a .py file the check runs itself

    @property
    def chapter(self) -> int:
        """The chapter the exercise belongs to: 5 for "5.4"."""
        return int(self.id.split(".")[0])


EXERCISES: dict[str, Exercise] = {}


def exercise(id: str, title: str, solution: str, hint: str = "", takes: str = "function"):
    """Register a checker: `checker(attempt) -> success message`, raising NotYet if wrong.

    With `takes="script"` the attempt is a script (the path of a .py file, or its text)
    that the checker runs in processes of its own, not a function.
    """

    def register(checker: Callable[[Callable], str]) -> Callable[[Callable], str]:
        EXERCISES[id] = Exercise(id, title, solution, checker, hint, takes)
        return checker

    return register


def _load_all() -> None:
    """Import every chapter's module (ch01, ch02, ...), which registers its exercises.

    Only this folder's own modules are found: a chapter that is a package (ch05/, with a
    file per exercise) imports its files in its `__init__.py`, or their checks go missing.
    """
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def check(id: str, attempt: Callable) -> Feedback:
    """Run the learner's attempt at exercise `id` and say whether it is right, and why not."""
    _load_all()
    if id not in EXERCISES:
        raise KeyError(f"no exercise {id!r}; the exercises are {', '.join(sorted(EXERCISES))}")
    ex = EXERCISES[id]
    if ex.takes == "script":
        if not isinstance(attempt, (str, os.PathLike)):
            return Feedback(id, False, f"check({id!r}, ...) needs the path of your script (a "
                                       f"str or a Path), not {type(attempt).__name__}.",
                            "pass the path you wrote the script to with %%writefile.")
        ours = True  # the script runs in processes of the check's own: an error here is the check's
    elif not callable(attempt):
        return Feedback(id, False, f"check({id!r}, ...) needs your function itself, not "
                                   f"{type(attempt).__name__} {attempt!r}.",
                        "pass the function's name without calling it: no parentheses.")
    else:
        ours = _is_users(attempt)  # a library function as the attempt: its errors are the learner's
    checking = _checking.set(ex)
    try:
        return Feedback(id, True, ex.checker(attempt))
    except NotYet as no:
        return Feedback(id, False, no.message, no.hint or ex.hint)
    except RankError as err:
        first = err.failures.get(err.root_cause)
        if first is not None and first.type != "died" and ours and not first.in_user_code:
            raise CheckError(id, first.headline(), first.full_traceback) from None
        what = first.headline() if first else str(err).splitlines()[0]
        return Feedback(id, False, f"your code failed on the ranks: {what}.",
                        "run it on the pool yourself to see the full traceback; " + ex.hint,
                        error=err)
    except Exception as err:  # raised in the notebook itself: by the attempt, or the check
        if ours and not tracebacks.passed_through_user_code(err):
            raise CheckError(id, f"{type(err).__name__}: {err}",
                             "".join(traceback.format_exception(err))) from err
        return Feedback(id, False, f"your code raised {type(err).__name__}: {err}.", ex.hint)
    finally:
        _checking.reset(checking)


class CheckError(RuntimeError):
    """An exercise's check failed by itself, not because of the learner's attempt.

    Raised, not returned as a verdict: a checker's bug must never read as the learner's
    mistake. `details` holds the traceback of the check, for whoever fixes it.
    """

    def __init__(self, id: str, what: str, details: str) -> None:
        super().__init__(f"the check of exercise {id} failed by itself ({what}), while your "
                         "code was not running: this is a bug in ddplab, not in your "
                         "attempt. Please report it with this message; meanwhile, try your "
                         "function on the pool yourself.")
        self.details = details


def _is_users(attempt: Callable) -> bool:
    """Is the attempt the learner's own code, not a library function passed as one?"""
    code = getattr(attempt, "__code__", None)
    return code is not None and tracebacks.is_user_frame(code.co_filename)


CHECK_PRELOAD = ("torch._dynamo",)
"""What the ranks of checks from chapter `PRELOAD_FROM` on import before they are forked.
Those checks build DDP, FSDP or DTensor models, whose constructors import torch's compiler
front end (DDP asks `torch._dynamo` which reducer to use): about 2 s of CPU in every fresh
rank, and every check starts fresh ranks. Imported once in the checks' own forkserver
instead, a check's ranks start without it (the exercise tests took about half the CPU).
The checks of the chapters before run collectives only: they fork from the learner's own
forkserver, already running, rather than start one more."""
PRELOAD_FROM = 5

_checking: ContextVar[Exercise | None] = ContextVar("checking", default=None)
"""The exercise `check` is running, for `ranks`."""


def ranks(world_size: int, **kwargs):
    """A pool of the size a checker needs, quiet and short-lived (use it in a `with`).

    The checker's pool is separate from the learner's, so a check never disturbs the
    variables of the learner's ranks; its output is not shown (the verdict says it all).
    Its ranks preload CHECK_PRELOAD for the checks of chapter PRELOAD_FROM on, and when
    no check is running (a checker called directly); `preload=` overrides it.
    """
    from ddplab.pool import Pool

    ex = _checking.get()
    heavy = ex is None or ex.chapter >= PRELOAD_FROM
    kwargs.setdefault("preload", CHECK_PRELOAD if heavy else ())
    return Pool(world_size, quiet=True, **kwargs)


LOAD_TIMEOUT = 60.0  # seconds the ranks may take to load an attempt (imports, on a busy machine)


def _received(*args) -> None:
    """Runs on each rank: nothing. Receiving the arguments loads what they need."""


def run_in_time(pool, fn: Callable, *args, meaning: str, hint: str,
                deadline: float = 5.0) -> list:
    """`pool.run` with an exercise's deadline: a hang becomes a NotYet that says where.

    Correct answers take milliseconds, so an attempt still running after `deadline` is
    stuck; the verdict names the ranks and what they were waiting in, then `meaning` says
    what that tells about the attempt, and `hint` how to get out of it. The arguments are
    sent once before the clock starts, so that importing the module an attempt lives in
    (seconds, on a loaded machine) is never mistaken for a hang.
    """
    pool.run(_received, fn, *args, timeout=max(LOAD_TIMEOUT, deadline))
    try:
        return pool.run(fn, *args, timeout=deadline)
    except RankTimeout as err:
        waits = [s.main.waiting_in for s in err.stuck.values() if s.main is not None]
        if waits and len(waits) == len(err.stuck) and all(waits):
            where = "waiting in " + " or ".join(sorted({f"{w.function}()" for w in waits}))
        else:
            where = "running"
        raise NotYet(f"your function did not finish within {deadline:g} s: "
                     f"{ranks_text(err.stuck)} {'was' if len(err.stuck) == 1 else 'were'} "
                     f"still {where}. {meaning}", hint) from None


def show(value) -> str:
    """A value as a verdict quotes it: tensors with their values and dtype, nested in lists."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()}, dtype={str(value.dtype).removeprefix('torch.')})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(show(item) for item in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def expect(condition: bool, message: str, hint: str = "") -> None:
    """Fail the attempt with `message` unless `condition` holds."""
    if not condition:
        raise NotYet(message, hint)


@contextmanager
def watching(names: Iterable[str], seen: Callable[[str, tuple, dict], None], *,
             c10d: bool = False) -> Iterator[None]:
    """On a rank: call `seen(name, args, kwargs)` before each call of `dist.<name>` in the
    block; the calls still run. This is how checks see which collectives an attempt used.

    With `c10d=True` the wrapper also replaces the function in `distributed_c10d`, where it
    is the same one: `P2POp(dist.isend, ...)` and `batch_isend_irecv` compare an op with
    c10d's own `isend`, and accept a watched one only then. Off by default, because c10d's
    functions call each other (all_gather_object calls all_gather), and a check must count
    only what the learner called.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    modules = (dist, distributed_c10d) if c10d else (dist,)
    saved = [(module, name, getattr(module, name)) for name in names if hasattr(dist, name)
             for module in modules if getattr(module, name, None) is getattr(dist, name)]

    def watched(name: str, original: Callable) -> Callable:
        def call(*args, **kwargs):
            seen(name, args, kwargs)
            return original(*args, **kwargs)
        return call

    wrappers = {name: watched(name, original) for _, name, original in saved}
    try:
        for module, name, _ in saved:
            setattr(module, name, wrappers[name])
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
