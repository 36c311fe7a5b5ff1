"""Chapter 1 exercises: processes, ranks and launching.

1.1  node_mates(rank, gpus_per_node) -> the ranks on the same node: who shares my machine?
1.2  whoami() -> "rank R of W (local rank L)", run on every rank: who am I?
1.3  place(hosts) -> [(node, local_rank), ...]: each rank's node and local rank, from the
     host each rank runs on, whatever the launcher's placement.
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

# Each rank's host, in rank order: blocks as torchrun numbers them first, then layouts where
# rank // gpus_per_node no longer works (round-robin placement, unsorted names, unequal nodes).
_LAYOUTS = (
    ["node02"] * 4 + ["node03"] * 4,
    ["a", "b", "c"] * 2,
    ["gpu-b", "gpu-b", "gpu-a", "gpu-a"],
    ["n1", "n1", "n1", "n2"],
    ["x", "y", "y", "x", "z", "y"],
    ["localhost"] * 3,
    ["h0", "h1", "h2"],
)


def _placement(hosts: list[str]) -> list[tuple[int, int]]:
    nodes: dict[str, int] = {}
    met: dict[str, int] = {}
    out = []
    for host in hosts:
        nodes.setdefault(host, len(nodes))
        out.append((nodes[host], met.get(host, 0)))
        met[host] = met.get(host, 0) + 1
    return out


def _as_pairs(got, n: int, call: str) -> list[tuple[int, int]]:
    expect(isinstance(got, (list, tuple)),
           f"{call} returned {got!r}; it should return a list of {n} (node, local_rank) "
           "pairs, one per rank.",
           "" if got is None else "return a list, one entry per rank, in rank order.")
    expect(len(got) == n, f"{call} returned {len(got)} entries for {n} ranks; it should "
                          "return one (node, local_rank) pair per rank.")
    for rank, pair in enumerate(got):
        expect(isinstance(pair, (list, tuple)) and len(pair) == 2
               and all(isinstance(v, int) and not isinstance(v, bool) for v in pair),
               f"{call}: rank {rank}'s entry is {pair!r}; it should be a pair of whole "
               "numbers, (node, local_rank).")
    return [tuple(pair) for pair in got]


def _why(hosts: list[str], got: list[tuple[int, int]], want: list[tuple[int, int]],
         call: str) -> str:
    """The first thing wrong with `got`, in terms of hosts, nodes and GPUs."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    for host, members in by_host.items():  # one host, one node number
        nodes = sorted({got[r][0] for r in members})
        if len(nodes) > 1:
            return (f"{call}: ranks {', '.join(map(str, members))} run on the same host "
                    f"{host!r}, yet they got nodes {nodes}. A node is a machine: every rank "
                    "on one host has the same node number.")
    for host, members in by_host.items():  # different hosts, different node numbers
        for other, theirs in by_host.items():
            if other != host and got[members[0]][0] == got[theirs[0]][0]:
                return (f"{call}: hosts {host!r} and {other!r} both got node "
                        f"{got[members[0]][0]}; different machines are different nodes.")
    for host, members in by_host.items():  # local ranks: 0, 1, ... on each host
        locals_ = [got[r][1] for r in members]
        if locals_ == [want[r][1] for r in members]:
            continue
        if locals_ == members and members != list(range(len(members))):
            return (f"{call}: the ranks on host {host!r} got local ranks {locals_}, their "
                    "global ranks; a local rank counts only the ranks on the rank's own "
                    f"node, from 0: here {[want[r][1] for r in members]}.")
        if locals_ == [v + 1 for v in range(len(members))]:
            return (f"{call}: the ranks on host {host!r} got local ranks {locals_}; local "
                    "ranks start at 0, like GPU numbers (set_device(local_rank)).")
        twice = next((v for v in locals_ if locals_.count(v) > 1), None)
        if twice is not None:
            pair = [r for r in members if got[r][1] == twice][:2]
            return (f"{call}: ranks {pair[0]} and {pair[1]} both run on host {host!r} with "
                    f"local rank {twice}: both would drive GPU {twice} of that machine, and "
                    "another GPU there would sit idle.")
        return (f"{call}: the ranks on host {host!r} ({members}) got local ranks {locals_}; "
                f"expected {[want[r][1] for r in members]}, counting them in rank order.")
    order = list(dict.fromkeys(hosts))
    if [got[by_host[h][0]][0] for h in sorted(order)] == list(range(len(order))):
        return (f"{call}: the nodes are numbered in the alphabetical order of the host "
                f"names; they go by rank instead: rank 0's host {hosts[0]!r} is node 0, the "
                "next host to appear is node 1, and so on.")
    return (f"{call}: the nodes are numbered "
            f"{ {h: got[by_host[h][0]][0] for h in order} }; expected "
            f"{ {h: want[by_host[h][0]][0] for h in order} }: rank 0's host is node 0, the "
            "next host to appear (rank by rank) is node 1, and so on.")


@exercise("1.3", "Node and local rank from host names", solution="place",
          hint="go through the ranks in order and keep, for each host met so far, what you "
               "know about it. Do not assume that a node's ranks are next to each other, or "
               "that every node has as many.")
def check_place(place) -> str:
    for hosts in _LAYOUTS:
        call = f"place({hosts})"
        got = _as_pairs(place(list(hosts)), len(hosts), call)
        want = _placement(list(hosts))
        if got != want:
            raise NotYet(_why(list(hosts), got, want, call))
    return (f"all {len(_LAYOUTS)} layouts placed: blocks, round-robin, unsorted host names, "
            "nodes of unequal size, one node, one rank per node.")
