"""The messages between the kernel and its ranks, spelled out in one place.

A rank has four channels from the kernel (see `kernel/processes.py` for how they are made):

- the **command** channel carries requests in and replies out, each one pickled tuple:
    kernel -> rank   `(CALL, call_id, payload)`   payload: `Call`, by `pickling.dumps`
                     `(EXIT, 0, b"")`             leave the loop, tear the group down
    rank -> kernel   `(OK, call_id, value)`       the call's return value
                     `(ERR, call_id, failure)`    an `errors.RankFailure`
                     `(EVENT, call_id, value)`    sent by `rank.emit` while the call runs
- the **control** channel is answered by a thread of the rank, so the kernel can ask where
  a rank is while its main thread is blocked: `STACKS` -> `(busy, threads)`, whether the
  rank is still in a call, and a list of `errors.ThreadStack`, the main thread first;
  `FLIGHT` -> the rank's flight recorder dump (torch's JSON text), or None; the rank adds
  its process groups, name -> global ranks, under the key `FLIGHT_GROUPS` (gloo's dump
  leaves its table of groups empty, and a hang in a subgroup cannot be read without it).
- **stdout** and **stderr** are pipes; after each call the rank writes `marker(call_id)`
  into both, so the kernel knows when a call's output is complete (see `kernel/output.py`).

Both sides import this module: the kernel side (`kernel/`) and the rank side (`rank.py`).
Nothing here imports torch: the kernel imports this module, and it must stay cheap.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

CALL, EXIT = "call", "exit"
OK, ERR, EVENT = "ok", "err", "event"
STACKS = "stacks"
FLIGHT = "flight"
FLIGHT_GROUPS = "ddplab_groups"


@dataclass(frozen=True)
class Ref:
    """A function of an importable module, named rather than pickled.

    The pool calls the rank side's own functions (run a cell, set a variable) by name:
    the kernel then never imports the rank side, and with it torch.
    """

    module: str
    name: str

    def resolve(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


RANK_SIDE = "ddplab.pool.rank"
EXEC_CELL = Ref(RANK_SIDE, "exec_cell")
SET_VARS = Ref(RANK_SIDE, "set_vars")
GET_VAR = Ref(RANK_SIDE, "get_var")
INIT_PROCESS_GROUP = Ref(RANK_SIDE, "init_process_group")


@dataclass
class Call:
    """One function call for the ranks, and the cell sources their tracebacks need.

    `sources` maps a code filename to (display name, text): "Cell In[4]" and its lines.
    """

    fn: Any  # a callable, or a Ref
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)


def request(op: str, call_id: int = 0, payload: bytes = b"") -> bytes:
    """A kernel -> rank message."""
    return pickle.dumps((op, call_id, payload))


def reply(kind: str, call_id: int, body: Any, dumps=pickle.dumps) -> bytes:
    """A rank -> kernel message; `dumps` lets the rank move GPU tensors to the CPU."""
    return dumps((kind, call_id, body))


def decode(data: bytes) -> tuple[str, int, Any]:
    """(kind, call_id, body) of either direction's message."""
    return pickle.loads(data)


# --- the end-of-call marker in the output pipes ---

MARK_HEAD = b"\x00ddplab-end:"
MARK_TAIL = b"\x00"


def marker(call_id: int) -> bytes:
    """Written to stdout and stderr after a call; never shown to the learner."""
    return MARK_HEAD + str(call_id).encode() + MARK_TAIL
