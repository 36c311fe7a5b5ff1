"""A rank's traceback, hang report and warning name the learner's cell and show its line,
on every supported Python and every cloudpickle release.

They rest on two things that changed under the kit, and each has a test here that would
catch the next change:

- cloudpickle sends code defined in cells by value, and since 3.1.3 it rewrites every such
  code object's file name to "<dynamic-code>"; `ddplab.pool.pickling` gives the name back
  (functions, lambdas, nested functions, closures, methods of classes defined in cells).
- `traceback.StackSummary`'s methods differ between Pythons (3.10 has no
  `format_frame_summary`, 3.13 passes it `colorize=`); `tracebacks` formats a library
  frame as one line through `StackSummary.format` only.

A cell is simulated the way IPython makes one: code compiled from a file name of its own
(never on disk), its text in `linecache`, and `cells.cell_names()` naming it "Cell In[7]"
(test_kernel.py does the same in a real kernel).
"""

from __future__ import annotations

import json
import linecache
import os
import tempfile
import types

import pytest

from ddplab import Pool, RankError, RankTimeout
from ddplab.pool import pickling, tracebacks
from ddplab.pool.ipython import cells

CELL_FILE = os.path.join(tempfile.gettempdir(), "ipykernel_ddplab_tests", "7.py")
CELL_NAME = "Cell In[7]"
CELL = '''\
import json, threading, warnings

def plain():
    raise ValueError("in a function")

in_a_lambda = lambda: {}["in a lambda"]

def outer():
    def inner():
        return [][0]
    return inner()

def make_closure(k):
    def closure():
        return k / 0
    return closure

class Model:
    def forward(self):
        raise RuntimeError("in a method")

def parses():
    return json.loads("{")

def blocks():
    threading.Event().wait(60)

def warns():
    warnings.warn("mind the cell", UserWarning)

def crashes():
    import ctypes
    ctypes.string_at(0)
'''


def line_of(text: str) -> int:
    """The cell's line number of the line that holds `text`."""
    return next(n for n, line in enumerate(CELL.splitlines(), 1) if text in line)


@pytest.fixture
def cell(monkeypatch) -> dict:
    """The cell's namespace, the cell known to the kernel side as IPython would make it."""
    namespace: dict = {"__name__": "__main__"}  # as in a notebook: sent by value
    exec(compile(CELL, CELL_FILE, "exec"), namespace)
    monkeypatch.setitem(linecache.cache, CELL_FILE,
                        (len(CELL), None, CELL.splitlines(keepends=True), CELL_FILE))
    monkeypatch.setattr(cells, "cell_names", lambda: {CELL_FILE: CELL_NAME})
    return namespace


@pytest.fixture(scope="module")
def pool():
    with Pool(2, timeout=30) as p:
        yield p


def _code_files(code: types.CodeType) -> set[str]:
    """The file names of `code` and of every code object nested in it."""
    nested = (_code_files(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return {code.co_filename}.union(*nested)


# --- without ranks: what the pool's pickles and the traceback module do ---

def test_code_sent_by_value_keeps_its_cells_file_name(cell):
    sent = [cell["plain"], cell["in_a_lambda"], cell["outer"], cell["make_closure"](3),
            cell["Model"], cell["Model"]().forward]
    plain, in_a_lambda, outer, closure, model, method = pickling.loads(pickling.dumps(sent))
    assert plain is not cell["plain"]  # really rebuilt from the pickle, as on a rank
    for fn in (plain, in_a_lambda, outer, closure, model.forward, method.__func__):
        assert _code_files(fn.__code__) == {CELL_FILE}, fn
    assert any(isinstance(c, types.CodeType) for c in outer.__code__.co_consts)  # inner's
    assert closure.__closure__[0].cell_contents == 3


def test_functions_pickled_by_reference_stay_references():
    assert pickling.loads(pickling.dumps([json.loads, os.getpid])) == [json.loads, os.getpid]


def test_a_library_frame_is_one_line_on_every_python(cell, monkeypatch):
    """What every supported Python's `traceback` calls is what `tracebacks` overrides."""
    monkeypatch.setitem(tracebacks.cell_names, CELL_FILE, CELL_NAME)
    try:
        try:
            cell["parses"]()
        except ValueError as e:
            raise KeyError("then this") from e
    except KeyError as exc:
        shown = tracebacks.format_exception(exc)
        full = tracebacks.format_full(exc)
    first = (f'  File "{CELL_NAME}", line {line_of("json.loads")}, in parses\n'
             '    return json.loads("{")\n'
             "  (raised in raw_decode() of json/decoder.py)\n"
             "json.decoder.JSONDecodeError: ")
    assert first in shown
    assert "The above exception was the direct cause of the following exception:" in shown
    assert shown.rstrip().endswith("KeyError: 'then this'")
    assert "line None" not in shown and 'decoder.py", line' not in shown
    assert 'json/decoder.py", line' in full  # every frame, with its line, for maintainers


def test_a_warning_names_the_cell(cell, monkeypatch):
    monkeypatch.setitem(tracebacks.cell_names, CELL_FILE, CELL_NAME)
    line = line_of("warnings.warn")
    assert tracebacks.format_warning("m", UserWarning, CELL_FILE, line) == \
        f'{CELL_NAME}, line {line}: UserWarning: m\n  warnings.warn("mind the cell", UserWarning)\n'


# --- on the ranks ---

@pytest.mark.parametrize("sent, function, source", [
    (lambda cell: cell["plain"], "plain", 'raise ValueError("in a function")'),
    (lambda cell: cell["in_a_lambda"], "<lambda>", 'in_a_lambda = lambda: {}["in a lambda"]'),
    (lambda cell: cell["outer"], "inner", "return [][0]"),
    (lambda cell: cell["make_closure"](3), "closure", "return k / 0"),
    (lambda cell: cell["Model"]().forward, "forward", 'raise RuntimeError("in a method")'),
], ids=["function", "lambda", "nested function", "closure", "method"])
def test_a_ranks_traceback_names_the_cell_and_shows_its_line(pool, cell, sent, function,
                                                            source):
    with pytest.raises(RankError) as info:
        pool.run(sent(cell), ranks=[0])
    shown = info.value.failures[0].traceback
    assert f'  File "{CELL_NAME}", line {line_of(source)}, in {function}\n    {source}\n' \
        in shown, shown
    assert "<dynamic-code>" not in shown and CELL_FILE not in shown
    assert info.value.failures[0].in_user_code


def test_a_ranks_cells_code_names_its_cell_there_and_back(pool):
    """`%%ranks` code is compiled on the rank; a function it defines keeps the cell's name
    when it fails in a later cell, and when it is pulled back into the notebook."""
    name = "Cell In[8]"
    body = "def helper():\n    raise KeyError('from %%ranks')\n"
    pool.exec_cell(body, filename=name, display_name=name,
                   full_text="%%ranks\n" + body, first_line=2)
    with pytest.raises(RankError) as info:
        pool.exec_cell("helper()", filename="Cell In[9]", display_name="Cell In[9]",
                       full_text="%%ranks\nhelper()", first_line=2)
    shown = info.value.failures[0].traceback
    assert ('  File "Cell In[9]", line 2, in <module>\n    helper()\n'
            '  File "Cell In[8]", line 3, in helper\n'
            "    raise KeyError('from %%ranks')\n") in shown, shown
    assert pool.pull("helper", ranks=[0])[0].__code__.co_filename == name


def test_a_ranks_warning_names_the_cell(pool, cell, capfd):
    capfd.readouterr()
    pool.run(cell["warns"], ranks=[0])
    err = capfd.readouterr().err
    line = line_of("warnings.warn")
    assert (f"{CELL_NAME}, line {line}: UserWarning: mind the cell\n"
            '  warnings.warn("mind the cell", UserWarning)\n') in err, err


@pytest.mark.slow
def test_a_hang_report_names_the_cell(pool, cell):
    with pytest.raises(RankTimeout) as info:
        pool.run(cell["blocks"], ranks=[0], timeout=2)
    stuck = info.value.stuck[0]
    line = line_of("threading.Event().wait(60)")
    assert (stuck.function, stuck.file, stuck.line) == ("wait", CELL_NAME, line)
    assert stuck.headline == "waiting in wait() of threading.py"
    assert stuck.main.frames[-1].function == "blocks"
    assert (f'  File "{CELL_NAME}", line {line}, in blocks\n'
            "    threading.Event().wait(60)") in str(info.value), str(info.value)
    assert pool.run(len, "ok") == [2, 2]  # rebuilt


@pytest.mark.slow
def test_a_crash_dump_names_the_cell(pool, cell, capfd):
    """faulthandler prints the code's own file name: the kernel shows it as the cell's."""
    pool.error_grace = 0.5
    with pytest.raises(RankError, match="SIGSEGV"):
        pool.run(cell["crashes"], ranks=[0])
    err = capfd.readouterr().err
    assert f'File "{CELL_NAME}", line {line_of("ctypes.string_at(0)")} in crashes' in err, err
    assert CELL_FILE not in err and "<dynamic-code>" not in err
