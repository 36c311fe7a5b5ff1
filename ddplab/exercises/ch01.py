"""Chapter 1 exercises: processes, ranks and launching.

1.1  node_mates(rank, gpus_per_node) -> the ranks on the same node: who shares my machine?
1.2  whoami() -> "rank R of W (local rank L)", run on every rank: who am I?
1.3  threads_per_rank(cores, ranks_per_node, workers_per_rank) -> threads: how many CPU
     threads may a rank use beside its data-loader workers?
"""

from __future__ import annotations

import os

from ddplab.exercises import NotYet, exercise, expect, ranks

# --- 1.1 ---------------------------------------------------------------------------------

_NODE_SIZES = (4, 2, 3, 8, 1)  # 4 first: the picture in the chapter
_RANKS = range(0, 40)


@exercise("1.1", "Who shares my machine?", solution="node_mates",
          hint="first work out which node the rank is on; then think about which ranks that "
               "node holds: where its block of ranks starts, and how long it is.")
def check_node_mates(node_mates) -> str:
    for gpus_per_node in _NODE_SIZES:
        for rank in _RANKS:
            call = f"node_mates({rank}, gpus_per_node={gpus_per_node})"
            got = node_mates(rank, gpus_per_node)
            node = rank // gpus_per_node
            want = list(range(node * gpus_per_node, (node + 1) * gpus_per_node))
            as_list = list(got) if isinstance(got, (list, tuple, range)) else None
            expect(as_list is not None,
                   f"{call} returned {got!r}; it should return a list of ranks.",
                   "" if got is None else "return a list (or a range) of ranks.")
            expect(all(isinstance(v, int) and not isinstance(v, bool) for v in as_list),
                   f"{call} returned {as_list!r}; ranks are whole numbers (ints).",
                   "/ gives a float in Python 3; // is integer division.")
            if as_list == want:
                continue
            same_gpu = list(range(rank % gpus_per_node, _RANKS[-1] + 1, gpus_per_node))
            if sorted(as_list) == want:
                raise NotYet(f"{call} returned {as_list}: the right ranks, but not in "
                             f"order; expected {want}.")
            if gpus_per_node > 1 and as_list and set(as_list) <= set(same_gpu) \
                    and len(as_list) > 1:
                raise NotYet(f"{call} returned {as_list}: those are ranks with the same "
                             f"local rank ({rank % gpus_per_node}) on different nodes, not the "
                             f"ranks on rank {rank}'s node, which are {want}.")
            if as_list == list(range(rank, rank + gpus_per_node)):
                raise NotYet(f"{call} returned {as_list}, counting from rank {rank} itself; "
                             f"but rank {rank} is local rank {rank % gpus_per_node} of node "
                             f"{node}, whose ranks are {want}.")
            if rank not in as_list:
                raise NotYet(f"{call} returned {as_list}, which leaves out rank {rank} "
                             f"itself; expected {want} (a rank shares its node with itself).")
            raise NotYet(f"{call} returned {as_list}; rank {rank} is on node {node}, which "
                         f"holds ranks {want}.")
    sizes = ", ".join(map(str, sorted(_NODE_SIZES)))
    return (f"every rank from 0 to {_RANKS[-1]} finds the ranks of its own node, for nodes "
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

# (cores, ranks per node, data-loader workers per rank)
_MACHINES = ((64, 8, 4), (64, 8, 0), (2, 2, 0), (16, 3, 1), (8, 8, 2), (96, 8, 3),
             (4, 1, 2), (12, 5, 0), (24, 4, 5), (23, 3, 2))


@exercise("1.3", "Threads beside data-loader workers", solution="threads_per_rank",
          hint="count the cores the workers take first; what is left is shared between the "
               "node's ranks. A thread count is whole, and cannot be less than one.")
def check_threads_per_rank(threads_per_rank) -> str:
    for cores, per_node, workers in _MACHINES:
        got = threads_per_rank(cores, per_node, workers)
        call = (f"threads_per_rank(cores={cores}, ranks_per_node={per_node}, "
                f"workers_per_rank={workers})")
        expect(isinstance(got, int) and not isinstance(got, bool),
               f"{call} returned {got!r}; it should be a whole number of threads (an int).",
               "" if got is None else "torch.set_num_threads takes an int; // is integer "
                                      "division.")
        left = cores - per_node * workers
        want = max(1, left // per_node)
        if got == want:
            continue
        used = per_node * (got + workers)
        workers_text = f"{workers} worker" + ("" if workers == 1 else "s")
        if got < 1:
            raise NotYet(f"{call} returned {got}: every rank needs at least one thread of "
                         "its own.")
        if got == max(1, cores // per_node) and workers:
            raise NotYet(f"{call} returned {got}, as if the workers took no cores: "
                         f"{per_node} ranks × ({got} threads + {workers_text}) = {used} "
                         f"busy processes and threads on {cores} cores.")
        if used > cores and got > 1:
            raise NotYet(f"{call} returned {got}: {per_node} ranks × ({got} threads + "
                         f"{workers_text}) = {used} on {cores} cores, oversubscribed.")
        threads = "thread" if got == 1 else "threads"
        raise NotYet(f"{call} returned {got}: {per_node} ranks × ({got} {threads} + "
                     f"{workers_text}) = {used} leaves cores idle on a {cores}-core node; "
                     "each rank may have more.")
    return ("every node's cores are shared out after its data-loader workers, none "
            "oversubscribed where it can be avoided, and no rank left without a thread.")
