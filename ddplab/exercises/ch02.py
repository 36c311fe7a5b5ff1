"""Chapter 2 exercises: init methods, stores and rendezvous.

2.1  join(i, nprocs, node, nnodes, url) -> sum of the ranks, run as mp.spawn's process i
     on each of 2 nodes: work out the global rank and world size, join a gloo group at a
     tcp:// URL, all_reduce, leave the group.
2.2  arrive(store, key, world_size) -> world_size, run on every rank: a store as a counter.
2.3  sign_in(store, world_size, address) -> (rank, every rank's address), run by processes
     that have no rank yet: hand out the ranks through the store, then swap addresses.
2.4  who_came(store, world_size) -> {rank: "ip:port"}, from the store of a start-up that
     hangs because one rank never came: which ranks wrote gloo's note, and the address in
     each.
2.5  preflight(master_addr, master_port, ifname, nnodes) -> the problems a multi-node
     start-up would meet, found on rank 0's node before launching: a name that does not
     resolve, a loopback address on several nodes, a port in use, an interface not there.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import time
import urllib.parse

from ddplab.exercises import NotYet, exercise, expect, ranks
from ddplab.launch import free_port, port_is_free
from ddplab.pool.errors import RankTimeout, ranks_text

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

_NODES, _PER_NODE = 2, 2
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _DryRun(Exception):
    """Stops an attempt at its init_process_group call, so that the check sees the call's
    arguments before any rank can wait for another."""


def _spawned(join, url: str, dry: bool):
    """On a checker's rank: look like process i of an mp.spawn on node `node` (2 nodes of
    2), with none of a launcher's variables, and call the learner's function as spawn would.

    A dry run stops at init_process_group and returns its arguments; a real run returns
    (what the function returned, whether the group is still initialized)."""
    import inspect

    import torch.distributed as dist

    from ddplab.exercises import watching

    me = int(os.environ.get("RANK", "-1")) if dry else int(os.environ["DDPLAB_CHECK_RANK"])
    os.environ["DDPLAB_CHECK_RANK"] = str(me)
    for name in _LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    args = (me % _PER_NODE, _PER_NODE, me // _PER_NODE, _NODES, url)
    if not dry:
        value = join(*args)
        return value, dist.is_initialized()
    calls = []
    signature = inspect.signature(dist.init_process_group)  # before watching wraps it

    def stop(name, call_args, call_kwargs):
        try:
            bound = signature.bind(*call_args, **call_kwargs)
            calls.append(dict(bound.arguments))
        except TypeError as err:
            calls.append({"error": str(err)})
        raise _DryRun

    with watching(["init_process_group"], stop), contextlib.suppress(_DryRun):
        join(*args)
    return calls[0] if calls else None


def _numbering(ranks_given: list) -> str:
    """Why a list of rank= arguments, one per process in launch order, is wrong."""
    local = [me % _PER_NODE for me in range(_NODES * _PER_NODE)]
    by_gpu = [(me % _PER_NODE) * _NODES + me // _PER_NODE for me in range(_NODES * _PER_NODE)]
    if ranks_given == local:
        return ("that is each process's number on its own node (i), so two processes "
                "claimed each rank.")
    if ranks_given == by_gpu:
        return ("that numbers the processes GPU by GPU across the nodes; launchers number "
                "them node by node, as chapter 1 showed.")
    if len(set(ranks_given)) < len(ranks_given):
        return "two processes claimed the same rank."
    return "every process of the job needs its own global rank."


def _from_url(call: dict) -> dict:
    """A dry-run call that wrote rank and world_size into the URL's query, as tcp:// allows
    (`tcp://ADDRESS:PORT?rank=0&world_size=4`), read as if it had passed them as arguments."""
    given = call.get("init_method")
    if not isinstance(given, str) or "?" not in given:
        return call
    base, _, query = given.partition("?")
    read = {**call, "init_method": base}
    for key, value in urllib.parse.parse_qsl(query):
        if key in ("rank", "world_size") and key not in call:
            read[key] = int(value) if value.lstrip("-").isdigit() else value
    return read


@exercise("2.1", "Rendezvous for a two-node job", solution="join",
          hint="mp.spawn gives each process only its number on its own node; tcp:// wants "
               "the global rank and the world size of the whole job. Chapter 1's arithmetic "
               "turns the one into the other.")
def check_join(join) -> str:
    world = _NODES * _PER_NODE
    want = sum(range(world))
    with ranks(world, init_method=None) as pool:
        url = f"tcp://127.0.0.1:{free_port()}"
        seen = [call if call is None or "error" in call else _from_url(call)
                for call in pool.run(_spawned, join, url, True, timeout=_CALL_TIMEOUT)]
        for me, call in enumerate(seen):
            who = (f"process i={me % _PER_NODE} of node {me // _PER_NODE}")
            expect(call is not None,
                   f"{who} returned without calling dist.init_process_group.")
            expect("error" not in call,
                   f"{who} called dist.init_process_group with arguments it does not take: "
                   f"{call.get('error')}.")
            given = call.get("init_method")
            expect(given == url,
                   f"{who} joined at init_method={given!r}, not at the url it was given "
                   f"({url}).",
                   "pass the url as init_method=." if given is None else "")
            size = call.get("world_size", -1)
            expect(size == world,
                   f"{who} passed world_size={size!r}; the job has {_NODES} nodes × "
                   f"{_PER_NODE} processes = {world}."
                   + (" That is the processes of one node only." if size == _PER_NODE
                      else ""),
                   "tcp:// reads no WORLD_SIZE: pass world_size= yourself." if size == -1
                   else "")
        given = [call.get("rank", -1) for call in seen]
        if given != list(range(world)):
            if -1 in given:
                raise NotYet("dist.init_process_group was called without rank=, so tcp:// "
                             "cannot tell the processes apart.",
                             "tcp:// reads no RANK: pass rank= yourself.")
            listing = ", ".join(f"node {me // _PER_NODE} i={me % _PER_NODE} → {r!r}"
                                for me, r in enumerate(given))
            raise NotYet(f"the processes passed rank= {listing}: {_numbering(given)}")
        try:
            got = pool.run(_spawned, join, f"tcp://127.0.0.1:{free_port()}", False,
                           timeout=_CALL_TIMEOUT)
        except RankTimeout:
            raise _waited_too_long(
                "at least one rank", "every process must call init_process_group once, and "
                "then all_reduce once.") from None
    for me, (value, _) in enumerate(got):
        who = f"process i={me % _PER_NODE} of node {me // _PER_NODE}"
        expect(_int_value(value) == want,
               f"{who} returned {value!r}; expected {want} (0 + 1 + 2 + 3, the all_reduce "
               f"of each rank's torch.tensor([rank]) over {world} ranks).",
               "" if value is None else
               "all_reduce works in place: return the tensor you passed to it, after the "
               "call (or its .item()).")
    still = [me for me, (_, on) in enumerate(got) if on]
    if still:
        raise NotYet(f"after your function returned, the process group was still initialized "
                     f"on {ranks_text(still)}. The next init_process_group there would fail "
                     "with 'trying to initialize the default process group twice!'.",
                     "leave the group once its work is done.")
    return (f"the {world} processes of 2 nodes × 2 worked out their global ranks, met at the "
            f"tcp:// address, summed their ranks to {want} and left the group.")


# --- 2.2 ---------------------------------------------------------------------------------

_COUNTER = "arrived"


def _arrive_on_rank(arrive, port: int):
    """On a checker's rank: make the store, call the learner's function (the last rank is
    late on purpose), and have rank 0 read the counter once every rank is done."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=10))
    if rank == world - 1:  # late on purpose: half a second after the others have called
        others = [f"checker/called/{r}" for r in range(world - 1)]
        deadline = time.monotonic() + 10
        while not store.check(others) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        store.set("checker/late_one_came", "1")  # before it adds itself to the counter
    else:
        store.set(f"checker/called/{rank}", "1")
    value = arrive(store, _COUNTER, world)
    # A rank that returned before the late one came did not wait, whatever it returned.
    early = not store.check(["checker/late_one_came"])
    store.add("checker/done", 1)
    counter = None
    if rank == 0:  # rank 0 serves the store: keep it up until every rank is done with it
        deadline = time.monotonic() + 10
        while store.add("checker/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        if store.check([_COUNTER]):
            counter = store.get(_COUNTER)
    return value, counter, early


@exercise("2.2", "A store as a counter", solution="arrive",
          hint="store.add returns the counter's value after the addition. What could a rank "
               "add to learn the count without changing it? It has to look more than once.")
def check_arrive(arrive) -> str:
    with ranks(_WORLD, init_method=None) as pool:
        try:
            got = pool.run(_arrive_on_rank, arrive, free_port(), timeout=_CALL_TIMEOUT)
        except RankTimeout:
            raise _waited_too_long(
                "at least one rank", "wait until the counter reaches world_size, not more: "
                "each rank adds exactly 1, so it never goes past world_size.") from None
    values = [value for value, _, _ in got]
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
    early = [rank for rank, (_, _, came_first) in enumerate(got) if came_first]
    expect(not early, f"on rank {early[0] if early else 0} your function returned before "
           f"rank {_WORLD - 1} had arrived (the check makes it half a second late): it did "
           "not wait for every rank, whatever it returned.",
           "after adding 1, look more than once at the counter, until it is world_size.")
    expect(counter is not None and counter == str(_WORLD).encode(),
           f"every rank returned {_WORLD}, but the counter {_COUNTER!r} in the store ended "
           f"at {counter.decode() if counter else 'nothing'}, not {_WORLD}: each rank should "
           "add 1 to it exactly once.",
           "add 1 once; to read the counter afterwards, add 0.")
    return (f"all {_WORLD} ranks counted themselves in and waited for the late one: every "
            f"rank returned {_WORLD}.")


# --- 2.3 ---------------------------------------------------------------------------------

_LATE = (0.6, 0.3, 0.0)  # process p sleeps _LATE[p]: they arrive in the order 2, 1, 0


def _sign_in_on_rank(sign_in, path: str, addresses: list[str]):
    """On a checker's rank: a FileStore in a private folder, no RANK to read, and the
    processes arriving in the reverse of their start order."""
    import torch.distributed as dist

    me, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name in _LAUNCHER_VARIABLES:
        if name != "WORLD_SIZE":
            os.environ.pop(name, None)
    store = dist.FileStore(path, world)
    store.set_timeout(datetime.timedelta(seconds=10))
    time.sleep(_LATE[me])
    return sign_in(store, world, addresses[me])


@exercise("2.3", "Hand out the ranks at rendezvous", solution="sign_in",
          hint="the processes need numbers 0, 1, 2, ... with none given twice, and the "
               "store can hand out a different number to each caller. Once a process has its "
               "number, the addresses are swapped as in the chapter's hello exchange.")
def check_sign_in(sign_in) -> str:
    token = secrets.token_hex(2)
    addresses = [f"10.{int(token[:2], 16)}.{int(token[2:], 16)}.{10 + p}:{29500 + p}"
                 for p in range(_WORLD)]
    folder = tempfile.mkdtemp(prefix="ddplab-check-")
    try:
        with ranks(_WORLD, init_method=None) as pool:
            try:
                got = pool.run(_sign_in_on_rank, sign_in, os.path.join(folder, "store"),
                               addresses, timeout=_CALL_TIMEOUT)
            except RankTimeout:
                raise _waited_too_long(
                    "at least one process", "a process must publish its own address before "
                    "it waits for the others', or they all wait for each other.") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for p, value in enumerate(got):
        expect(isinstance(value, (tuple, list)) and len(value) == 2,
               f"process {p} returned {value!r}; expected a pair (rank, addresses).",
               "" if value is None else "return rank, addresses")
    numbers = [value[0] for value in got]
    expect(all(isinstance(n, int) and not isinstance(n, bool) for n in numbers),
           f"the processes returned the ranks {numbers!r}; a rank is an int.")
    if sorted(numbers) == list(range(1, _WORLD + 1)):
        raise NotYet(f"the processes took the ranks {numbers}: one each, but ranks count "
                     f"from 0, so they should be 0 to {_WORLD - 1}.",
                     "store.add returns the count after adding, and the first caller "
                     "gets 1.")
    expect(sorted(numbers) == list(range(_WORLD)),
           f"the processes took the ranks {numbers}; every one of 0 to {_WORLD - 1} must "
           "go to exactly one process.")
    want = [addresses[numbers.index(r)] for r in range(_WORLD)]
    for p, (rank, value) in enumerate(got):
        if isinstance(value, (list, tuple)) and list(value) == want:
            continue
        as_text = ([v.decode() if isinstance(v, bytes) else v for v in value]
                   if isinstance(value, (list, tuple)) else None)
        if as_text == want:
            raise NotYet(f"process {p} (rank {rank}) returned the addresses {value!r}: the "
                         "right ones, but as bytes.",
                         "store.get returns bytes: .decode() turns them into a str.")
        if isinstance(value, (list, tuple)) and list(value) == addresses:
            raise NotYet(f"process {p} (rank {rank}) listed the addresses in the order the "
                         f"processes were started, {addresses!r}; expected them in the order "
                         f"of the ranks they took, {want!r}.")
        if as_text is not None and sorted(map(str, as_text)) == sorted(want):
            raise NotYet(f"process {p} (rank {rank}) returned the right addresses in the "
                         f"wrong order, {value!r}; expected them in rank order, {want!r}.")
        raise NotYet(f"process {p} (rank {rank}) returned the addresses {value!r}; expected "
                     f"every rank's address in rank order: {want!r}.")
    return (f"{_WORLD} processes with no numbers, arriving in any order, each took its own "
            "rank and learned every rank's address, the handing out that a launcher's "
            "rendezvous does (torchrun's c10d numbers the nodes once all have joined, by "
            "their addresses, not by arrival).")


# --- 2.4 ---------------------------------------------------------------------------------

_JOB = 4
_STARTUP_TIMEOUT = 2  # seconds the ranks that came wait for the one that did not
_LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"


def _start_without(missing: int, port: int) -> str:
    """On a checker's rank: join a 4-rank gloo group as torchrun's workers do (clients of a
    store served outside the ranks), unless this is the rank that never comes."""
    import torch.distributed as dist

    if int(os.environ["RANK"]) == missing:
        return "never came"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", GLOO_SOCKET_IFNAME=_LOOPBACK)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT))
    except dist.DistStoreError:  # the wait for the missing rank's note: what the job does
        return "waited"
    dist.destroy_process_group()
    return "joined"


def _ask(who_came, port: int):
    """On a checker's rank: the learner's function, given a client of the hung job's store.

    A get of the missing rank's note waits out the store's timeout and raises: returned as
    ("waited", message) so that the verdict can say why."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT))
    try:
        return "answered", who_came(store, _JOB)
    except dist.DistStoreError as err:
        return "waited", str(err).splitlines()[0]


def _gloo_address(note: bytes) -> tuple[str, int]:
    """The (IPv4 address, port) a gloo note asks the peers to dial: after a length-prefixed
    host name, a length-prefixed sockaddr (family, port in network byte order, address)."""
    (n,) = struct.unpack_from("<Q", note, 0)
    at = 8 + n + 8
    return socket.inet_ntoa(note[at + 4:at + 8]), struct.unpack_from(">H", note, at + 2)[0]


def _byte_swapped(port: int) -> int:
    return int.from_bytes(port.to_bytes(2, "big"), "little")


@exercise("2.4", "Who never came?", solution="who_came",
          hint="store.list_keys() shows what is in the store and how this job named the "
               "notes; the chapter took one note apart.")
def check_who_came(who_came) -> str:
    import torch.distributed as dist

    missing = secrets.randbelow(_JOB)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=_CALL_TIMEOUT))
    with ranks(_JOB, init_method=None) as pool:
        came = pool.run(_start_without, missing, server.port, timeout=_CALL_TIMEOUT)
        if came.count("waited") != _JOB - 1:
            raise RuntimeError(f"the hung start-up went otherwise than planned: {came}")
        truth = {int(key.rpartition("/")[2]): "{}:{}".format(*_gloo_address(server.get(key)))
                 for key in server.list_keys() if "/cpu/" in key}
        try:
            how, value = pool.run(_ask, who_came, server.port, ranks=[0],
                                  timeout=_CALL_TIMEOUT)[0]
        except RankTimeout:
            raise _waited_too_long("your function", "a rank that never came never writes "
                                   "its note: look at what is there, do not wait for "
                                   "what is not.") from None
    came_ranks = sorted(truth)
    if how == "waited":
        raise NotYet(f"your function waited for a key that never came, until the store's "
                     f"timeout ({_STARTUP_TIMEOUT} s for this client; 5 minutes by default): "
                     f"{value}. That is rank {missing}'s note: the rank that never came.",
                     "store.get and store.wait wait for a missing key; store.list_keys() "
                     "lists what is there, and store.check([key]) asks without waiting.")
    expect(value is not None, "your function returned None; expected a dict {rank: "
           "'ip:port'} of the ranks whose note is in the store.", "")
    expect(isinstance(value, dict), f"your function returned {type(value).__name__} "
           f"{value!r}; expected a dict {{rank: 'ip:port'}}.")
    if not value:
        raise NotYet(f"your function found no note; the store holds the notes of ranks "
                     f"{came_ranks}.", "store.list_keys() shows how this job named them: "
                     "not quite as the chapter's group did.")
    bad = [k for k in value if not isinstance(k, int) or isinstance(k, bool)]
    expect(not bad, f"your dict's keys are {list(value)!r}; a rank is an int, such as "
           f"{came_ranks[0]}.", "int() turns the last part of a key into a rank.")
    if missing in value:
        raise NotYet(f"your dict names rank {missing}, the rank that never came: its note is "
                     f"not in the store (the notes there are of ranks {came_ranks}).")
    expect(sorted(value) == came_ranks, f"your dict names the ranks {sorted(value)}; the "
           f"store holds the notes of ranks {came_ranks}.")
    for rank in came_ranks:
        got, want = value[rank], truth[rank]
        if got == want:
            continue
        ip, port = want.rsplit(":", 1)
        if got == f"{ip}:{_byte_swapped(int(port))}":
            raise NotYet(f"for rank {rank} you read the port as {got.rsplit(':', 1)[1]}; the "
                         f"note says {port}. The bytes are right, their order is not.",
                         "a sockaddr holds the port in network byte order (big-endian): "
                         "'>H' in struct.")
        if isinstance(got, bytes):
            raise NotYet(f"for rank {rank} you returned bytes, {got!r}; expected a str "
                         f"such as '{ip}:PORT'.")
        raise NotYet(f"for rank {rank} you returned {got!r}; its note says it listens at "
                     f"{ip}, on port {port}: expected '{want}'.")
    return (f"rank {missing} never came: the store holds the notes of ranks {came_ranks} "
            "only, and each says where that rank listens for its peers. That is what you "
            "can learn about a start-up that hangs from the store alone, which a client can "
            "open at MASTER_ADDR:MASTER_PORT while the job waits.")


# --- 2.5 ---------------------------------------------------------------------------------

_PROBLEMS = ("resolve", "loopback", "port", "interface")
_MISSING_INTERFACE = "ddplab9"  # no machine names an interface so


def _held_port() -> tuple[socket.socket, int]:
    """A port another program is listening on: a socket the check holds."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held, held.getsockname()[1]


def _keywords(found, call: str) -> list[str]:
    expect(isinstance(found, (list, tuple)),
           f"{call} returned {found!r}; it should return a list of problems, each a string "
           f"starting with its keyword ({', '.join(_PROBLEMS)}), or [] when all is well.")
    words = []
    for problem in found:
        expect(isinstance(problem, str),
               f"{call} returned {found!r}: each problem should be a string such as "
               f"'port: 29500 is in use', not {type(problem).__name__}.")
        word = problem.split(":", 1)[0].strip().lower()
        expect(word in _PROBLEMS,
               f"{call} returned the problem {problem!r}, which starts with none of the "
               f"keywords {', '.join(_PROBLEMS)}.")
        words.append(word)
    return sorted(words)


def _why_not(case: str, got: list[str], want: list[str]) -> str:
    """What a wrong list of problems misses, for the case the check made."""
    missing = [w for w in want if w not in got]
    extra = [w for w in got if w not in want]
    reasons = {
        ("loopback", "127.0.1.1"): "127.0.1.1 is a loopback address too: the whole of "
        "127.0.0.0/8 is (Debian's /etc/hosts maps a host name to it), and another node "
        "that dials it dials itself.",
        ("loopback", "localhost"): "'localhost' resolves to a loopback address: resolve the "
        "name, then look at the addresses.",
        ("loopback", "nnodes=1"): "On one node the loopback is the right address: every "
        "rank is on this machine.",
        ("port", "free"): "The port is free: something your function opened to test it may "
        "still hold it.",
    }
    for word in missing + extra:
        for (reason_word, where), reason in reasons.items():
            if word == reason_word and where in case:
                return reason
    return ""


@exercise("2.5", "A preflight check before a multi-node job", solution="preflight",
          hint="socket.getaddrinfo resolves a name (socket.gaierror when it cannot); "
               "ipaddress.ip_address(address).is_loopback knows every loopback address; a "
               "socket bound to the port, then closed, tells whether it is free; "
               "socket.if_nameindex() lists this machine's interfaces.")
def check_preflight(preflight) -> str:
    held, busy = _held_port()
    try:
        # The loopback interface: "lo" on Linux, "lo0" on macOS.
        lo = next(name for _, name in socket.if_nameindex() if name.startswith("lo"))
        cases = [
            (("127.0.0.1", None, None, 1), []),
            (("127.0.0.1", None, None, 2), ["loopback"]),
            (("127.0.1.1", None, None, 2), ["loopback"]),
            (("localhost", None, None, 2), ["loopback"]),
            (("no-such-node.invalid", None, None, 2), ["resolve"]),
            (("127.0.0.1", busy, None, 1), ["port"]),
            (("127.0.0.1", None, _MISSING_INTERFACE, 1), ["interface"]),
            (("127.0.0.1", None, lo, 1), []),
            (("127.0.1.1", busy, _MISSING_INTERFACE, 2), ["interface", "loopback", "port"]),
        ]
        for (addr, port, ifname, nnodes), want in cases:
            port = free_port() if port is None else port
            call = f"preflight({addr!r}, {'a busy port' if port == busy else 'a free port'}, " \
                   f"{ifname!r}, nnodes={nnodes})"
            got = _keywords(preflight(addr, port, ifname, nnodes), call)
            if got != sorted(want):
                case = f"{addr} nnodes={nnodes} {'busy' if port == busy else 'free'}"
                why = _why_not(case, got, sorted(want))
                raise NotYet(f"{call} found {got or 'no problem'}; expected "
                             f"{sorted(want) or 'no problem'}." + (f" {why}" if why else ""))
            if port != busy:
                expect(port_is_free(port),
                       f"after {call} returned, port {port} was no longer free: close the "
                       "socket you tested it with (a `with` block does).")
    finally:
        held.close()
    return (f"all {len(cases)} cases found: a name that does not resolve, 127.0.0.1, "
            "127.0.1.1 and 'localhost' on two nodes (but not on one), a port in use, an "
            "interface this machine lacks, and three problems at once.")
