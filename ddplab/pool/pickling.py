"""How code travels between the kernel and its ranks: cloudpickle, keeping file names.

Functions, lambdas and classes defined in cells cannot be imported on the ranks, so
cloudpickle sends them by value: their code objects travel inside the pickle. A code
object's file name (`co_filename`) is what tracebacks, hang reports and warnings name
("Cell In[4], line 5") and look up the source line with. Since cloudpickle 3.1.3 it is
rewritten to "<dynamic-code>" on every code object pickled by value, so that a cell's
payload is the same in every kernel session (cloudpipe/cloudpickle#538 and #560), and a
rank's traceback then says `File "<dynamic-code>", line 5` with no source line; up to
3.1.2 the name was kept.

The kit does not depend on either behaviour: `Pickler` carries each function's file name
beside it and gives it back to the function's code, and to the code nested in it (inner
functions, lambdas, comprehensions), when the function is rebuilt. Only the pickle
protocol's own hooks are used (`reducer_override` and reduce tuples), so whatever
cloudpickle does to code objects, the name that arrives is the one that left.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable
from typing import Any

import cloudpickle


def with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """`code`, and every code object nested in its constants, compiled from `filename`.

    The code nested in a function (its inner functions, lambdas, class bodies and
    comprehensions) comes from the same `compile` call, hence the same file. Returns
    `code` itself when nothing differs, so a pickler that kept the name costs nothing.
    """
    consts = tuple(with_filename(c, filename) if isinstance(c, types.CodeType) else c
                   for c in code.co_consts)
    if code.co_filename == filename and all(
            new is old for new, old in zip(consts, code.co_consts, strict=True)):
        return code
    return code.replace(co_filename=filename, co_consts=consts)


def _rebuild_function(make: Callable[..., Any], args: tuple, filename: str) -> Any:
    """Rebuild a function as its pickler's reducer said, then give its code its file back."""
    fn = make(*args)
    if isinstance(fn, types.FunctionType):
        fn.__code__ = with_filename(fn.__code__, filename)
    return fn


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, but a function sent by value keeps its code's file name.

    cloudpickle reduces such a function to a reduce tuple `(make, args, state, ...)`;
    this pickler wraps `make` so that, on loading, the function it makes gets its
    original `co_filename` back, whatever the pickle carried in its place ("<dynamic-code>"
    since cloudpickle 3.1.3). Functions pickled by reference (importable ones) and every
    other object are left to cloudpickle.
    """

    def reducer_override(self, obj: Any) -> Any:
        reduced = super().reducer_override(obj)
        if (isinstance(obj, types.FunctionType) and isinstance(reduced, tuple)
                and len(reduced) >= 2):
            make, args, *rest = reduced
            return (_rebuild_function, (make, args, obj.__code__.co_filename), *rest)
        return reduced


def dumps(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """`obj` pickled with `Pickler`: loadable with plain `pickle.loads` (or `loads`)."""
    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


loads = pickle.loads
