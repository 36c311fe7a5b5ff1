"""Chapter 2 exercises: init methods, stores and rendezvous.

2.1  rendezvous_by_hand(url) -> sum of the ranks, run on every rank: join a gloo group at a
     tcp:// URL, all_reduce, leave the group.
2.2  arrive(store, key, world_size) -> world_size, run on every rank: a store as a counter.
2.3  exchange(store, rank, world_size, address) -> every rank's address, run on every rank:
     what rendezvous does, with a store you are given.
"""

from __future__ import annotations

import datetime
import os
import secrets
import shutil
import tempfile
import time

from ddplab.errors import RankTimeout, ranks_text
from ddplab.exercises import NotYet, exercise, expect, ranks
from ddplab.launch import free_port

_WORLD = 3
_CALL_TIMEOUT = 15  # seconds a checker waits for the learner's code on the ranks


def _int_value(value):
    """A one-number result as an int (tensor([3]), tensor(3), [3] or 3), else None."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return int(value.item()) if value.numel() == 1 else None
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    except (TypeError, ValueError, RuntimeError):
        pass
    return None


def _waited_too_long(what: str, hint: str) -> NotYet:
    return NotYet(f"{what} was still waiting after {_CALL_TIMEOUT} s, so the check stopped "
                  "it.", hint)


# --- 2.1 ---------------------------------------------------------------------------------

def _without_master_port() -> None:
    """On a checker's rank: env:// cannot stand in for the URL the learner was given."""
    os.environ.pop("MASTER_PORT", None)


def _is_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


@exercise("2.1", "Rendezvous by hand", solution="rendezvous_by_hand",
          hint="tcp:// does not read RANK and WORLD_SIZE for you: take them from os.environ "
               "(they are strings) and pass them to init_process_group yourself. Leave the "
               "group before you return.")
def check_rendezvous_by_hand(rendezvous_by_hand) -> str:
    want = sum(range(_WORLD))
    with ranks(_WORLD, init_method=None) as pool:
        pool.run(_without_master_port)
        for _ in range(2):
            url = f"tcp://127.0.0.1:{free_port()}"
            try:
                got = pool.run(rendezvous_by_hand, url, timeout=_CALL_TIMEOUT)
            except RankTimeout:
                raise _waited_too_long(
                    "at least one rank", "a group forms only when world_size ranks join it: "
                    "take the world size from os.environ['WORLD_SIZE'], not a number you "
                    "chose.") from None
            for rank, value in enumerate(got):
                if _int_value(value) == want:
                    continue
                raise NotYet(f"on rank {rank} your function returned {value!r}; expected "
                             f"{want} (0 + 1 + 2, the all_reduce of each rank's "
                             f"torch.tensor([rank]) over {_WORLD} ranks).",
                             "" if value is None else
                             "all_reduce works in place: return the tensor you passed to "
                             "it, after the call (or its .item()).")
            still = [r for r, on in enumerate(pool.run(_is_initialized)) if on]
            if still:
                raise NotYet(f"after your function returned, the process group was still "
                             f"initialized on {ranks_text(still)}. The next "
                             "init_process_group there would fail with 'trying to "
                             "initialize the default process group twice!'.",
                             "call dist.destroy_process_group() once the group's work is "
                             "done.")
    return (f"all {_WORLD} ranks met at the tcp:// address, summed their ranks to {want} and "
            "left the group, twice in a row on the same processes.")


# --- 2.2 ---------------------------------------------------------------------------------

_COUNTER = "arrived"


def _arrive_on_rank(arrive, port: int):
    """On a checker's rank: make the store, call the learner's function (the last rank is
    late on purpose), and have rank 0 read the counter once every rank is done."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=10))
    if rank == world - 1:
        time.sleep(0.5)  # the others must wait for this one
    value = arrive(store, _COUNTER, world)
    store.add("checker/done", 1)
    counter = None
    if rank == 0:  # rank 0 serves the store: keep it up until every rank is done with it
        deadline = time.monotonic() + 10
        while store.add("checker/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        if store.check([_COUNTER]):
            counter = store.get(_COUNTER)
    return value, counter


@exercise("2.2", "A store as a counter", solution="arrive",
          hint="store.add(key, 1) adds one and returns the new count; adding 0 reads the "
               "count without changing it. Keep reading, with a short pause, until every "
               "rank has arrived.")
def check_arrive(arrive) -> str:
    with ranks(_WORLD, init_method=None) as pool:
        try:
            got = pool.run(_arrive_on_rank, arrive, free_port(), timeout=_CALL_TIMEOUT)
        except RankTimeout:
            raise _waited_too_long(
                "at least one rank", "wait until the counter reaches world_size, not more: "
                "each rank adds exactly 1, so it never goes past world_size.") from None
    values = [value for value, _ in got]
    counter = got[0][1]
    for rank, value in enumerate(values):
        if isinstance(value, int) and not isinstance(value, bool) and value == _WORLD:
            continue
        if isinstance(value, (bytes, str)) and value in (str(_WORLD), str(_WORLD).encode()):
            raise NotYet(f"on rank {rank} your function returned {value!r}, the right count "
                         "but as text; return it as an int.",
                         "store.get gives bytes: int(...) turns b'3' into 3. store.add "
                         "returns an int already.")
        if isinstance(value, int) and not isinstance(value, bool) and value > _WORLD:
            raise NotYet(f"on rank {rank} your function returned {value}, more than the "
                         f"{_WORLD} ranks there are: each rank should add 1 to the counter "
                         "exactly once.", "adding 0 reads the counter without changing it.")
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _WORLD:
            raise NotYet(f"on rank {rank} your function returned {value} while the last "
                         f"rank had not arrived yet (the check makes rank {_WORLD - 1} half "
                         f"a second late): it should wait until the counter is {_WORLD}.")
        raise NotYet(f"on rank {rank} your function returned {value!r}; expected {_WORLD}, "
                     f"the counter once all {_WORLD} ranks have arrived.",
                     "")
    expect(counter is not None and counter == str(_WORLD).encode(),
           f"every rank returned {_WORLD}, but the counter {_COUNTER!r} in the store ended "
           f"at {counter.decode() if counter else 'nothing'}, not {_WORLD}: each rank should "
           "add 1 to it exactly once.",
           "add 1 once; to read the counter afterwards, add 0.")
    return (f"all {_WORLD} ranks counted themselves in and waited for the late one: every "
            f"rank returned {_WORLD}.")


# --- 2.3 ---------------------------------------------------------------------------------

def _exchange_on_rank(exchange, path: str, addresses: list[str]):
    """On a checker's rank: a FileStore in a private folder, rank 0 late on purpose."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(path, world)
    store.set_timeout(datetime.timedelta(seconds=10))
    if rank == 0:
        time.sleep(0.5)  # the others must wait for rank 0's address
    return exchange(store, rank, world, addresses[rank])


@exercise("2.3", "Swap addresses, as rendezvous does", solution="exchange",
          hint="each rank sets one key of its own (put its rank in the key's name), then gets "
               "every rank's key; store.get waits for a key that is not there yet, and "
               "returns bytes.")
def check_exchange(exchange) -> str:
    token = secrets.token_hex(2)
    addresses = [f"10.{int(token[:2], 16)}.{int(token[2:], 16)}.{10 + r}:{29500 + r}"
                 for r in range(_WORLD)]
    folder = tempfile.mkdtemp(prefix="ddplab-check-")
    try:
        with ranks(_WORLD, init_method=None) as pool:
            try:
                got = pool.run(_exchange_on_rank, exchange, os.path.join(folder, "store"),
                               addresses, timeout=_CALL_TIMEOUT)
            except RankTimeout:
                raise _waited_too_long(
                    "at least one rank", "every rank must set its own key before it waits "
                    "for the others' keys, or they all wait for each other.") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for rank, value in enumerate(got):
        if value == addresses:
            continue
        if isinstance(value, (list, tuple)) and [
                v.decode() if isinstance(v, bytes) else v for v in value] == addresses:
            raise NotYet(f"on rank {rank} your function returned {value!r}: the right "
                         "addresses, but as bytes (or not in a list).",
                         "store.get returns bytes: .decode() turns them into a str.")
        if isinstance(value, (list, tuple)) and sorted(map(str, value)) == sorted(addresses):
            raise NotYet(f"on rank {rank} your function returned {value!r}: the right "
                         "addresses in the wrong order; expected them in rank order, "
                         f"{addresses!r}.")
        if value is None:
            raise NotYet(f"on rank {rank} your function returned None; expected a list of "
                         f"the {_WORLD} ranks' addresses, in rank order.")
        raise NotYet(f"on rank {rank} your function returned {value!r}; expected every "
                     f"rank's address in rank order: {addresses!r}.")
    return (f"all {_WORLD} ranks published their address and learned everyone else's, even "
            "with rank 0 arriving late: that is rendezvous.")
