"""One call on the ranks: send it, then gather until it is over.

A call is over when every target rank has replied and its output is complete; or one
rank has failed and the others had `error_grace` seconds to finish (those still running
are most likely waiting for it); or the deadline has passed. Then the ranks that did not
finish are asked where they are. What happened comes back as an `Outcome`; what to do
about it (raise, rebuild the pool) is the pool's decision, not this module's.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddplab.pool import pickling, protocol
from ddplab.pool.errors import PoolTypeError, RankFailure, Stuck, died
from ddplab.pool.ipython import cells
from ddplab.pool.kernel.processes import Processes, kill_groups
from ddplab.pool.timeouts import Timeouts

_call_ids = itertools.count(1)

# What gloo says when it has given up on its connections: the process group cannot carry
# another collective (every later one fails with "Application timeout caused pair
# closure"), so the pool must start a new one, as after a hang.
GROUP_BROKEN = ("timed out waiting", "application timeout caused pair closure",
                "connection reset by peer", "connection closed by peer")


def breaks_group(failure: RankFailure) -> bool:
    """Did this failure leave the rank's process group unusable?"""
    text = failure.message.lower()
    return failure.type == "died" or any(sign in text for sign in GROUP_BROKEN)


@dataclass
class Outcome:
    """What came back from one call: values, failures, and ranks that never finished."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    stuck: dict[int, Stuck] = field(default_factory=dict)
    broken: bool = False  # ranks were killed: the process group cannot be trusted again
    interrupted: bool = False
    event_error: BaseException | None = None  # raised by the on_event callback
    flight: dict[int, str] = field(default_factory=dict)  # rank -> flight recorder dump


@dataclass
class Plan:
    """How one call is to be made: what to run, where, and for how long."""

    fn: Callable | protocol.Ref
    args: tuple
    kwargs: dict
    targets: list[int]
    timeout: float
    stream: bool = False
    on_event: Callable[[int, Any], None] | None = None
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)


def run(procs: Processes, call: Plan, timeouts: Timeouts, all_threads: bool = False) -> Outcome:
    """Send one call, then gather results, events and output until it is over."""
    payload = _payload(procs, call)
    call_id = next(_call_ids)
    message = protocol.request(protocol.CALL, call_id, payload)
    procs.output.begin(call_id, call.stream)
    outcome = Outcome()
    pending = set(call.targets)
    started = time.monotonic()
    deadline = started + call.timeout
    try:
        for r in call.targets:
            with contextlib.suppress(OSError):  # a dead rank's result channel says so
                procs.ranks[r].conn.send_bytes(message)
        while pending or not procs.output.complete(call.targets):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in procs.selector.select(remaining):
                kind, r = key.data
                if kind == "output":
                    if not procs.output.read(key.fd):
                        procs.selector.unregister(key.fd)
                    continue
                if _receive(procs, r, call_id, call, outcome, started, timeouts):
                    pending.discard(r)
                if outcome.failures:
                    deadline = min(deadline, time.monotonic() + timeouts.error_grace)
        if pending:
            _report_unfinished(procs, call, call_id, outcome, pending, started, timeouts,
                               all_threads)
    except KeyboardInterrupt:  # also while the report is made: the learner wants out
        outcome.interrupted = True
    outcome.broken = bool(pending) or outcome.interrupted or any(
        breaks_group(f) for f in outcome.failures.values())
    if outcome.broken:
        kill_groups(procs.pids)
        procs.drain(timeouts.drain)  # what a dying rank printed last is often the clue
    procs.output.show()
    return outcome


def _report_unfinished(procs: Processes, call: Plan, call_id: int, outcome: Outcome,
                       pending: set[int], started: float, timeouts: Timeouts,
                       all_threads: bool) -> None:
    """Ask the ranks that did not finish where they are; take the flight recorder's dumps.

    A rank that says it is no longer in a call finished as the deadline passed: its reply
    (after any events it sent first) is read now. Every rank still pending afterwards is
    reported as stuck, so that a call never returns with a rank's result missing.
    """
    outcome.stuck = where(procs, sorted(pending), timeouts, all_threads)
    late = []
    for r in sorted(pending - set(outcome.stuck)):
        conn, until = procs.ranks[r].conn, time.monotonic() + timeouts.stacks
        while (left := until - time.monotonic()) > 0 and conn.poll(left):
            if _receive(procs, r, call_id, call, outcome, started, timeouts):
                late.append(r)
                break
    pending.difference_update(late)
    _finish_output(procs, late, timeouts.drain)
    for r in pending - set(outcome.stuck):
        outcome.stuck[r] = Stuck(r, [])
    if outcome.stuck and procs.setup.init_method is not None:
        outcome.flight = flight_records(procs, call.targets, timeouts)


def _ask(ctl, request: str) -> None:
    """Send a control request, dropping answers to earlier ones that came too late."""
    with contextlib.suppress(EOFError, OSError):
        while ctl.poll(0):
            ctl.recv()
    with contextlib.suppress(OSError):
        ctl.send(request)


def _finish_output(procs: Processes, ranks: list[int], seconds: float) -> None:
    """Read these ranks' output up to this call's end markers (or for `seconds`)."""
    deadline = time.monotonic() + seconds
    while (ranks and not procs.output.complete(ranks)
           and (remaining := deadline - time.monotonic()) > 0):
        for fd in select.select(procs.output.fds(), [], [], remaining)[0]:
            procs.output.read(fd)


def _payload(procs: Processes, call: Plan) -> bytes:
    """The pickled call, with the sources of cells the target ranks have not seen yet."""
    sources = dict(call.sources)
    for filename, display in cells.cell_names().items():
        if any(filename not in procs.ranks[r].sources_sent for r in call.targets):
            entry = linecache.cache.get(filename)
            if entry:
                sources[filename] = (display, "".join(entry[2]))
    try:
        payload = pickling.dumps(protocol.Call(call.fn, call.args, call.kwargs, sources))
    except Exception as e:
        name = getattr(call.fn, "__name__", call.fn)
        raise PoolTypeError(f"could not send {name!r} and its arguments to the ranks: {e}. "
                            "Everything passed to a pool must be picklable; create objects "
                            "such as locks, files or open connections inside the function "
                            "instead.") from None
    for r in call.targets:
        procs.ranks[r].sources_sent.update(sources)
    return payload


def _receive(procs: Processes, r: int, call_id: int, call: Plan, outcome: Outcome,
             started: float, timeouts: Timeouts) -> bool:
    """Read one message from rank r; True when the rank is done with this call."""
    rank = procs.ranks[r]
    try:
        data = rank.conn.recv_bytes()
    except (EOFError, OSError):
        seen = time.monotonic()
        procs.selector.unregister(rank.conn)
        status = procs.wait_exit(rank.pid, timeouts.exit_status)
        debug = procs.started_env.get("TORCH_DISTRIBUTED_DEBUG", "")
        outcome.failures[r] = died(r, status, procs.setup.backend, seen, started, debug)
        return True
    kind, cid, body = protocol.decode(data)
    if cid != call_id:
        return False
    if kind == protocol.EVENT:
        if call.on_event is not None and outcome.event_error is None:
            try:
                call.on_event(r, body)
            except Exception as exc:  # the ranks carry on; the error is raised after
                outcome.event_error = exc
        return False
    if kind == protocol.OK:
        outcome.results[r] = body
    else:
        outcome.failures[r] = body
    return True


def flight_records(procs: Processes, ranks: list[int], timeouts: Timeouts) -> dict[int, str]:
    """Each rank's flight recorder dump, taken before the ranks are stopped.

    All ranks of the call are asked, stuck or not: which collectives the finished ones
    issued is half of the story. A rank that does not answer in time is left out.
    """
    for r in ranks:
        _ask(procs.ranks[r].ctl, protocol.FLIGHT)
    records = {}
    deadline = time.monotonic() + timeouts.stacks
    for r in ranks:
        ctl = procs.ranks[r].ctl
        with contextlib.suppress(EOFError, OSError):
            while ctl.poll(max(0.0, deadline - time.monotonic())):
                dump = ctl.recv()
                if isinstance(dump, tuple):  # a late answer about stacks: skip it
                    continue
                if dump:
                    records[r] = dump.decode() if isinstance(dump, bytes) else dump
                break
    return records


def where(procs: Processes, ranks: list[int], timeouts: Timeouts,
          all_threads: bool = False) -> dict[int, Stuck]:
    """Ask each unfinished rank where its threads are; fall back to faulthandler.

    The rank's control thread answers while its main thread is blocked in a collective. A
    rank that holds the GIL in native code cannot answer: faulthandler then writes a
    C-level dump of it into its stderr, which the cell shows. A rank that says it is no
    longer in a call finished as the deadline passed, and is left out.
    """
    stuck = {}
    for r in ranks:
        _ask(procs.ranks[r].ctl, protocol.STACKS)
    deadline = time.monotonic() + timeouts.stacks
    for r in ranks:
        ctl = procs.ranks[r].ctl
        try:
            if ctl.poll(max(0.0, deadline - time.monotonic())):
                answer = ctl.recv()
                if isinstance(answer, tuple) and len(answer) == 2:
                    busy, threads = answer
                    if busy:
                        stuck[r] = Stuck(r, threads if all_threads else threads[:1])
                    continue
        except (EOFError, OSError):
            pass
        with contextlib.suppress(OSError):
            os.kill(procs.ranks[r].pid, signal.SIGUSR1)
        stuck[r] = Stuck(r, [])
    return stuck
