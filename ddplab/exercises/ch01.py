"""Chapter 1 exercises: processes, ranks and launching.

1.1  coordinates(rank, gpus_per_node) -> (node, local_rank): where does a rank live?
1.2  whoami() -> "rank R of W (local rank L)", run on every rank: who am I?
1.3  threads_per_rank(cores, ranks_per_node) -> threads: how many CPU threads may a rank use?
"""

from __future__ import annotations

import os

from ddplab.exercises import NotYet, exercise, expect, ranks

# --- 1.1 ---------------------------------------------------------------------------------

_NODE_SIZES = (4, 2, 3, 8, 1)  # 4 first: the picture in the chapter
_RANKS = range(0, 40)


@exercise("1.1", "Where does this rank live?", solution="coordinates",
          hint="a node holds gpus_per_node consecutive ranks: node 0 has the first "
               "gpus_per_node of them, node 1 the next ones. Integer division and its "
               "remainder say which block a rank is in and where inside it.")
def check_coordinates(coordinates) -> str:
    for gpus_per_node in _NODE_SIZES:
        for rank in _RANKS:
            got = coordinates(rank, gpus_per_node)
            call = f"coordinates({rank}, gpus_per_node={gpus_per_node})"
            expect(isinstance(got, tuple) and len(got) == 2,
                   f"{call} returned {got!r}; it should return a pair (node, local_rank).",
                   "" if got is None else "return two numbers as a tuple: "
                                          "return node, local_rank")
            node, local = got
            expect(all(isinstance(v, int) and not isinstance(v, bool) for v in got),
                   f"{call} returned {got!r}; node and local_rank should be ints.",
                   "/ gives a float in Python 3; // is integer division.")
            want = divmod(rank, gpus_per_node)
            if got != want:
                detail = ""
                if 0 <= local < gpus_per_node and node * gpus_per_node + local != rank:
                    detail = (f" Going back does not work either: node {node} × "
                              f"{gpus_per_node} + local_rank {local} = "
                              f"{node * gpus_per_node + local}, not {rank}.")
                elif not 0 <= local < gpus_per_node:
                    detail = (f" A node with {gpus_per_node} GPUs has local ranks 0 to "
                              f"{gpus_per_node - 1} only." if gpus_per_node > 1 else
                              " A node with 1 GPU has local rank 0 only.")
                raise NotYet(f"{call} returned {got!r}, but rank {rank} lives on node "
                             f"{want[0]} as local rank {want[1]}.{detail}")
    sizes = ", ".join(map(str, sorted(_NODE_SIZES)))
    return (f"every rank from 0 to {_RANKS[-1]} lands on the right node and GPU, for nodes "
            f"of {sizes} GPUs.")


# --- 1.2 ---------------------------------------------------------------------------------

_WORLD, _PER_NODE = 4, 2


def _as_two_nodes(attempt):
    """On a checker's rank: look like 2 nodes × 2 GPUs, then call the learner's function."""
    import torch.distributed as dist

    rank = dist.get_rank()
    os.environ.update(LOCAL_RANK=str(rank % _PER_NODE), LOCAL_WORLD_SIZE=str(_PER_NODE),
                      GROUP_RANK=str(rank // _PER_NODE))
    return attempt()


@exercise("1.2", "Who am I?", solution="whoami",
          hint="dist knows the global rank and the world size; the local rank is not part "
               "of the process group, so ask the environment the launcher set up (os.environ "
               "holds strings).")
def check_whoami(whoami) -> str:
    with ranks(_WORLD) as pool:
        got = pool.run(_as_two_nodes, whoami, timeout=20)
    for rank, value in enumerate(got):
        want = f"rank {rank} of {_WORLD} (local rank {rank % _PER_NODE})"
        if value == want:
            continue
        if not isinstance(value, str):
            raise NotYet(f"on rank {rank} your function returned {value!r}, not a string; "
                         f"expected {want!r}.",
                         "" if value is None else "build the text with an f-string and "
                                                  "return it.")
        note = ""
        if value == f"rank {rank} of {_WORLD} (local rank {rank})":
            note = (f" The check runs the {_WORLD} ranks as 2 nodes × {_PER_NODE} GPUs, so "
                    f"rank {rank}'s local rank is not its global rank.")
        raise NotYet(f"on rank {rank} your function returned {value!r}; expected "
                     f"{want!r}.{note}")
    return (f"each of the {_WORLD} ranks names itself correctly, also when the ranks are "
            f"spread over 2 nodes of {_PER_NODE} (so local rank ≠ rank).")


# --- 1.3 ---------------------------------------------------------------------------------

_MACHINES = ((64, 8), (2, 4), (2, 2), (16, 3), (8, 8), (96, 8), (4, 1), (1, 2), (12, 5))


@exercise("1.3", "Threads without oversubscription", solution="threads_per_rank",
          hint="share the node's cores evenly between its ranks, rounding down so the total "
               "never exceeds the cores, but never give a rank fewer than one thread.")
def check_threads_per_rank(threads_per_rank) -> str:
    for cores, per_node in _MACHINES:
        got = threads_per_rank(cores, per_node)
        call = f"threads_per_rank(cores={cores}, ranks_per_node={per_node})"
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"{call} returned {got!r}; it should be a whole number of threads (an int).",
               "" if got is None else "torch.set_num_threads takes an int: // divides "
                                      "and rounds down.")
        want = max(1, cores // per_node)
        if got == want:
            continue
        if got < 1:
            raise NotYet(f"{call} returned {got}: every rank needs at least one thread.")
        if got * per_node > cores and got > 1:
            raise NotYet(f"{call} returned {got}: {per_node} ranks × {got} threads = "
                         f"{per_node * got} threads on {cores} cores, oversubscribed.")
        threads = "thread" if got == 1 else "threads"
        raise NotYet(f"{call} returned {got}: {per_node} ranks × {got} {threads} = "
                     f"{per_node * got} threads leaves cores idle on a {cores}-core node; "
                     "each rank may have more.")
    return "every node gets its cores shared out, none oversubscribed, no rank left without one."
