"""The pool's rank side: what runs inside each rank, a small loop that executes whatever
the notebook sends.

A rank is forked from the forkserver (see `ddplab.pool.kernel.forkserver`) with four
channels from the kernel: a command socket (calls in, results out), a control socket
(answered by a thread, so the kernel can ask "where are you stuck?" while the main thread
is blocked in a collective), and its stdout and stderr, which are pipes read by the kernel.
Output is captured at the file-descriptor level, so C++ warnings from gloo/NCCL and a raw
`os.write(1, ...)` reach the notebook too.

After each call the rank writes an end-of-call marker into both pipes before replying.
The kernel shows a call's output only once it has seen those markers, so every line a
rank printed is shown in the cell that ran the code, and never in the next one.

Everything the notebook sends is a function call: `%%ranks` cells, `push` and `pull` are
calls to the small functions at the bottom of this file, which work on the rank's
persistent namespace. The messages themselves are spelled out in `protocol.py`.

This module imports nothing of the kernel side (`ddplab.pool.kernel`) or of the IPython
side (`ddplab.pool.ipython`): only what both sides share (protocol, pickling, errors,
tracebacks, the GPU policy). The forkserver imports it before it forks, so it must not
initialise CUDA or start threads when imported.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import ctypes.util
import datetime
import faulthandler
import io
import os
import pickle
import random
import signal
import sys
import threading
import time
import types
import warnings
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from ddplab.pool import gpus, pickling, protocol, tracebacks
from ddplab.pool.errors import RankFailure

namespace: dict = {}
"""The rank's persistent namespace: `%%ranks` cells run in it, push/pull use it."""

_spec: dict = {}
"""What the pool said this rank is: rank, world size, backend, init method, ..."""

_call: dict = {}
"""The call in progress: its id and the channel its events go home on (see `emit`)."""
_emit_lock = threading.Lock()

_LIBC_PATH = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_LIBC_PATH) if _LIBC_PATH else None  # to flush C stdio buffers


# --- set-up ---

def _redirect_output(out_fd: int, err_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    # Line-buffered, so `--stream` shows lines as they are printed.
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True,
                                  errors="backslashreplace")


def _die_with_parent(lifeline_fd: int) -> None:
    """Exit, with everything this rank started, when the kernel goes away."""

    def watch() -> None:
        while True:
            try:
                if not os.read(lifeline_fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="ddplab-lifeline", daemon=True).start()


def _answer_control(ctl: Connection) -> None:
    """Serve the kernel's questions while the main thread may be stuck."""

    def serve() -> None:
        while True:
            try:
                request = ctl.recv()
            except (EOFError, OSError):
                return
            if request == protocol.STACKS:
                # Busy or not: a rank that finished just as its deadline passed has sent
                # its reply, and its main thread is back in this module's loop.
                ctl.send((_call.get("id") is not None, tracebacks.current_stacks()))
            elif request == protocol.FLIGHT:
                ctl.send(_flight_record())

    threading.Thread(target=serve, name="ddplab-control", daemon=True).start()


def _flight_record() -> str | bytes | None:
    """This process's flight recorder dump (see `ddplab.flight`), taken while a call may hang.

    NCCL keeps a recorder of its own (`_dump_nccl_trace_json`, in torch 2.11 and 2.13's
    CUDA builds); gloo writes to the generic one (`_dump_fr_trace_json`), which on an NCCL
    group holds nothing. So an NCCL rank asks NCCL's first.
    """
    from torch._C import _distributed_c10d as c10d

    names = ["_dump_fr_trace_json"]
    if _spec.get("backend") == "nccl":
        names.insert(0, "_dump_nccl_trace_json")
    for name in names:
        dump = getattr(c10d, name, None)  # None: a torch without that recorder
        if dump is None:
            continue
        try:
            raw = dump()
        except Exception:
            continue
        try:
            return _with_groups(raw)
        except Exception:  # the groups changed while being read (the main thread was making
            return raw     # one): the dump without them, each group's ranks then those that
            #                recorded in it (`flightrecorder.members`)
    return None


def _with_groups(dump: bytes | str) -> str:
    """The dump with this rank's process groups added, name -> global ranks.

    An entry names its group ("2"), and the dump's table of groups (`pg_config`) should
    say which ranks that group has: NCCL's does, gloo's is empty in torch 2.13. A rank that
    never issued a collective in a group leaves no trace of its membership, yet it is the
    one a hang in that group waits for; so the kit writes the membership down
    (`protocol.FLIGHT_GROUPS`), as torch's own list of groups holds it.
    """
    import json

    from torch.distributed.distributed_c10d import _world

    record = json.loads(dump)
    record[protocol.FLIGHT_GROUPS] = {
        name: sorted(_world.pg_group_ranks.get(group, {})) for group, name in
        list(_world.pg_names.items())}
    return json.dumps(record)


def _fresh_main_module() -> None:
    """Give the rank a clean `__main__` whose dict is the rank's namespace.

    Functions and classes defined in `%%ranks` cells then belong to `__main__`, as they
    would in a script, and cloudpickle sends them back by value.
    """
    global namespace
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    namespace = main.__dict__


def init_process_group() -> None:
    """Initialize this rank's process group the way the pool was asked to."""
    spec = _spec
    method = spec["init_method"]
    if method is None:
        return
    kwargs = {"backend": spec["backend"],
              "timeout": datetime.timedelta(seconds=spec["pg_timeout"])}
    if method == "env":
        kwargs["init_method"] = "env://"
    else:
        kwargs.update(init_method=spec["init_url"], rank=spec["rank"],
                      world_size=spec["world_size"])
    if spec["backend"] == "nccl":
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    server, store_fd = None, spec.pop("store_fd", None)  # a socket serves one store only
    if store_fd is not None:
        # Rank 0 starts its TCPStore server from the socket the kernel has held listening
        # since before any rank started (`ddplab.pool.rendezvous.listening_socket` says
        # why). The store init_process_group then makes for rank 0 is multi-tenant (one
        # server per port and process), so it is this server, and the rendezvous below is
        # exactly a script's. Once the group holds the store, ours is let go: a group
        # destroyed later closes its server as it would in a script.
        server = dist.TCPStore("127.0.0.1", int(spec["env"]["MASTER_PORT"]), spec["world_size"],
                               is_master=True, multi_tenant=True, wait_for_workers=False,
                               master_listen_fd=store_fd, timeout=kwargs["timeout"])
    try:
        dist.init_process_group(**kwargs)
    finally:
        del server


def main(spec: dict, lifeline_fd: int, cmd_fd: int, ctl_fd: int, out_fd: int, err_fd: int,
         store_fd: int | None = None) -> int:
    """Set up the rank described by `spec`, then serve calls until told to exit.

    `store_fd`, given to rank 0 of a group that meets through a TCPStore, is the listening
    socket its store serves from (see `init_process_group`).
    """
    _redirect_output(out_fd, err_fd)
    _die_with_parent(lifeline_fd)
    _spec.update(spec, store_fd=store_fd)
    os.environ.clear()
    os.environ.update(spec["env"])
    with contextlib.suppress(OSError):
        os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    faulthandler.enable(file=sys.stderr, all_threads=False)  # the crashing thread only
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=False)
    warnings.formatwarning = tracebacks.format_warning  # "Cell In[4], line 5: ..."
    torch.set_num_threads(spec["threads"])
    # A forked process inherits the server's random state; a rank should not.
    torch.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()

    rank, local_rank = spec["rank"], spec["local_rank"]
    device = gpus.device(local_rank, spec["world_size"], spec["backend"])  # the one GPU policy
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _fresh_main_module()
    namespace.update(torch=torch, dist=dist, rank=rank, world_size=spec["world_size"],
                     local_rank=local_rank, device=device)

    conn = Connection(cmd_fd)
    _call.update(conn=conn, pid=os.getpid())
    _answer_control(Connection(ctl_fd))
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return 0
        op, call_id, payload = protocol.decode(request)
        if op == protocol.EXIT:
            if dist.is_initialized():
                dist.destroy_process_group()
            return 0
        _call["id"] = call_id
        reply = _run(call_id, payload)
        _end_of_call(call_id)
        with _emit_lock:
            _call["id"] = None
            conn.send_bytes(reply)


# --- one call ---

class _ResultPickler(pickling.Pickler):
    """Sends tensors home on the CPU: the notebook's kernel may have no GPU context.

    Functions defined on the rank (in a `%%ranks` cell) keep their cell's file name, as
    those the kernel sends do (see `pickling`).
    """

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            # The copy is made here, on the rank: handing pickle the GPU tensor itself
            # would bring it back to this method, again and again.
            return _identity, (obj.detach().cpu(),)
        return super().reducer_override(obj)


def _identity(obj):
    return obj


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _failure(exc: BaseException, started: float, note: str = "") -> RankFailure:
    try:
        pickled = pickle.dumps(exc)
    except Exception:
        pickled = None
    text = tracebacks.format_exception(exc)
    return RankFailure(_spec["rank"], type(exc).__name__, str(exc),
                       text + (f"\n{note}\n" if note else ""), time.monotonic(), pickled,
                       started=started, full_traceback=tracebacks.format_full(exc),
                       in_user_code=tracebacks.passed_through_user_code(exc))


def _run(call_id: int, payload: bytes) -> bytes:
    started = time.monotonic()
    try:
        call: protocol.Call = pickling.loads(payload)
        tracebacks.install_sources(call.sources)
        fn = call.fn.resolve() if isinstance(call.fn, protocol.Ref) else call.fn
        result = fn(*call.args, **call.kwargs)
    except BaseException as exc:  # a rank reports everything, even SystemExit
        return protocol.reply(protocol.ERR, call_id, _failure(exc, started))
    try:
        return protocol.reply(protocol.OK, call_id, result, dumps=_dumps)
    except Exception as exc:
        note = (f"The value returned by rank {_spec['rank']} could not be sent back to the "
                "notebook (it must be picklable). Return plain data or tensors instead.")
        return protocol.reply(protocol.ERR, call_id, _failure(exc, started, note))


def _end_of_call(call_id: int) -> None:
    """Flush every layer of buffering, then mark the end of this call's output."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if _libc is not None:
        _libc.fflush(None)  # C code's printf buffers
    marker = protocol.marker(call_id)
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            os.write(fd, marker)


def emit(value) -> None:
    """Send `value` to the notebook now, while the call is still running.

    `pool.run(fn, ..., on_event=callback)` calls `callback(rank, value)` in the notebook
    as each value arrives, which is how a training run draws its loss curves live. Values
    travel as pickles on the call's own channel, in order; without `on_event` they are
    dropped. Outside a pool call (under torchrun, say) `emit` does nothing, so code that
    emits runs unchanged anywhere.
    """
    with _emit_lock:
        # Not between calls, and not from a process the rank forked (a DataLoader worker):
        # it shares the channel, and its bytes would break the rank's messages.
        if _call.get("id") is None or _call.get("pid") != os.getpid():
            return
        _call["conn"].send_bytes(protocol.reply(protocol.EVENT, _call["id"], value, _dumps))


# --- the calls the notebook makes by name ---

def exec_cell(source: str, filename: str, first_line: int = 1) -> None:
    """Run a `%%ranks` cell in the rank's namespace, echoing a final expression like IPython.

    `first_line` is the cell line the body starts on, so tracebacks point at the same line
    numbers the learner sees in the notebook.
    """
    tree = ast.parse(source, filename)
    ast.increment_lineno(tree, first_line - 1)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None:
            print(repr(value))


def set_vars(values: dict) -> None:
    """`pool.push`: bind names in the rank's namespace."""
    namespace.update(values)


def get_var(name: str) -> tuple[bool, object]:
    """`pool.pull`: (found, value) of a name in the rank's namespace."""
    if name in namespace:
        return True, namespace[name]
    return False, None


def pid() -> int:
    """This rank's process id (the pool's tests use it to check that nothing leaks)."""
    return os.getpid()
