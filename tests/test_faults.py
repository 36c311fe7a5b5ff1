"""The fault injector, the flight recorder reader and DETAIL's fingerprints, on real gloo.

The symptoms of every fault, on a default pool and under DETAIL, are chapter 7a's tables,
which nbval re-runs and compares; these tests check the parts the tables rest on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab import Pool, RankError, faults, flight


@pytest.fixture(scope="module")
def pool():
    with Pool(3, timeout=30) as p:
        p.error_grace = 1.0
        yield p


@pytest.mark.slow
def test_a_hang_report_carries_the_flight_recorder_and_reads_it(pool):
    trial = faults.attempt(pool, "skip", victim=2, timeout=3)
    err = trial.error
    assert sorted(err.flight) == [0, 1, 2]
    records = {r: flight.parse(r, dump) for r, dump in err.flight.items()}
    seq = records[0].last_enqueued
    assert records[0].at(seq).op == "all_reduce" and records[2].at(seq).op == "broadcast"
    assert (f"flight recorders disagree at collective #{seq}: ranks 0 and 1 have "
            f"all_reduce([4]); rank 2 has broadcast([1])") in str(err)
    table = flight.table(err.flight).splitlines()
    assert table[0].split() == ["#", "rank", "0", "rank", "1", "rank", "2"]
    assert table[-2].split() == [str(seq), "all_reduce([4])", "all_reduce([4])", "broadcast([1])"]


def _issue_then_dump():
    """Two collectives, the second asynchronous; then both of torch's dumps of this rank."""
    import json
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    x = torch.ones(2)
    dist.all_reduce(x)
    work = dist.broadcast(x, src=0, async_op=True)
    work.wait()
    return pickle.loads(_dump_fr_trace()), json.loads(_dump_fr_trace_json())


@pytest.mark.slow  # the first pickled dump imports torch._dynamo: about a second
def test_a_pickled_dump_names_the_line_that_issued_each_collective_and_json_does_not(pool):
    import inspect

    lines, first = inspect.getsourcelines(_issue_then_dump)
    line_of = {name: first + next(i for i, text in enumerate(lines) if f"dist.{name}(" in text)
               for name in ("all_reduce", "broadcast")}
    pickled, as_json = pool.run(_issue_then_dump)[1]
    entries = flight.parse(1, pickled).entries[-2:]
    assert [e.op for e in entries] == ["all_reduce", "broadcast"]
    for entry in entries:  # the call, not the wait: the broadcast's line, not work.wait()'s
        file, line, function = entry.issued_at
        assert file.endswith("test_faults.py") and function == "_issue_then_dump"
        assert line == line_of[entry.op]
    assert all(e.issued_at is None for e in flight.parse(1, as_json).entries)


@pytest.mark.slow
def test_detail_names_the_mismatch_with_sequence_numbers():
    with Pool(3, timeout=30, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as p:
        p.error_grace = 1.0
        skip = faults.attempt(p, "skip", timeout=5)
        shape = faults.attempt(p, "shape", timeout=5)
        op = faults.attempt(p, "op", timeout=5)
    assert all(text.startswith("error: mismatch detected")
               for text in skip.seen.values())
    prints = faults.fingerprints(skip.error)
    assert [(f.rank, f.op) for f in prints][:2] == [(0, "ALLREDUCE"), (1, "BROADCAST")]
    assert len({f.seq for f in prints}) == 1  # the same collective number on every rank
    assert {f.shape for f in faults.fingerprints(shape.error)} == {"4", "5"}
    assert "seq" in faults.fingerprint_table(shape.error).splitlines()[0]
    assert op.seen[1] == "✗ [2, 4, 6, 8], no error"  # DETAIL does not compare reduce ops


def _send_then_barrier():
    """A correct program that DETAIL rejects in torch 2.13 (pytorch#148976)."""
    if dist.get_rank() == 0:
        dist.send(torch.ones(1), dst=1)
    elif dist.get_rank() == 1:
        dist.recv(torch.zeros(1), src=0)
    dist.barrier()


@pytest.mark.slow
def test_detail_fingerprints_of_a_barrier_behind_a_send():
    """A send between two of three ranks advances their sequence number only, and the
    barrier's fingerprints (no tensors, no separator in torch's text) are still read."""
    with Pool(3, timeout=30, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as p:
        p.quiet = True
        with pytest.raises(RankError) as info:
            p.run(_send_then_barrier)
    prints = {f.rank: f for f in faults.fingerprints(info.value)}
    assert (prints[0].seq, prints[2].seq) == (1, 0)
    assert {(f.op, f.shape, f.dtype) for f in prints.values()} == {("BARRIER", None, None)}
    rows = faults.fingerprint_table(info.value).splitlines()[1:]
    assert rows[0].split() == ["0", "1", "BARRIER", "-", "-"]


def _skip_the_first_of_three():
    """Three identical all_reduces, the first skipped by rank 1, then a barrier."""
    sums = []
    try:
        for step in range(3):
            if dist.get_rank() == 1 and step == 0:
                continue
            x = torch.tensor([10.0 * step + dist.get_rank()])
            dist.all_reduce(x)
            sums.append(x.item())
        dist.barrier()
    except RuntimeError as err:
        return sums, str(err)
    return sums, None


@pytest.mark.slow
def test_detail_misses_a_skipped_identical_collective_and_each_rank_is_read_from_its_own_message():
    """DETAIL compares fingerprints: rank 1's first all_reduce pairs with the others' first
    (wrong sums, no error), the error comes at the barrier. Rank 1's message then describes
    rank 0 by its fingerprint's length decoded as a fingerprint (torch 2.13): the table must
    take rank 0 from rank 0's own message."""
    with Pool(3, timeout=30, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) as p:
        p.quiet = True
        outcomes = p.run(_skip_the_first_of_three)
    assert [sums for sums, _ in outcomes] == [[13.0, 43.0]] * 3
    assert all(error and error.startswith("Detected mismatch") for _, error in outcomes)
    prints = faults.fingerprints({rank: error for rank, (_, error) in enumerate(outcomes)})
    assert [(f.rank, f.seq, f.op) for f in prints] == [(0, 2, "ALLREDUCE"), (1, 2, "BARRIER"),
                                                       (2, 2, "ALLREDUCE")]


def test_tidy_keeps_a_whole_first_line_without_the_peer():
    message = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
               "peer [127.0.0.1]:10973. This is typically caused by a remote worker crashing.\n"
               " Original exception: ...")
    assert faults.tidy(message) == "Connection to a peer lost"
    assert faults.tidy(message, limit=200, whole_line=True) == (
        "Connection to a peer lost. This is typically caused by a remote worker crashing.")


@pytest.mark.slow
def test_gloo_giving_up_rebuilds_the_pool():
    """After gloo's own timeout the group's connections are closed: the pool starts anew."""
    with Pool(2, timeout=2) as p:
        with pytest.raises(RankError) as info:
            p.run(lambda: dist.recv(torch.zeros(1), src=0) if dist.get_rank() == 1 else None,
                  timeout=20)
        assert "Timed out waiting" in info.value.failures[1].message
        assert info.value.restarted
        assert p.run(lambda: dist.all_reduce(torch.ones(1)) or 1) == [1, 1]


def test_flight_verdicts_name_who_is_behind():
    def dump(seqs, last, op="all_reduce"):
        return {"entries": [{"collective_seq_id": s, "profiling_name": f"gloo:{op}",
                             "input_sizes": [[2]], "process_group": ["0", "default_pg"]}
                            for s in seqs],
                "pg_status": {"0": {"last_enqueued_collective": str(last),
                                    "last_completed_collective": str(last - 1)}}}

    assert flight.verdict({0: dump([1, 2], 2), 1: dump([1], 1), 2: dump([1], 1)}) == (
        "flight recorder: rank 0 is waiting in collective #2 (all_reduce), which ranks 1 "
        "and 2 never issued (they stopped after #1).")
    assert flight.verdict({0: dump([1], 1), 1: dump([], -1)}).endswith("(it issued none).")
    assert flight.verdict({0: dump([1], 1), 1: dump([1], 1, "broadcast")}) == (
        "the ranks' flight recorders disagree at collective #1: rank 0 has all_reduce([2]); "
        "rank 1 has broadcast([2]).")
    assert flight.verdict({0: dump([1, 2], 2), 1: dump([1, 2], 2)}) == ""
    assert flight.verdict({0: dump([1], 1)}) == ""
    unnamed = dump([1, 2], 2)  # under DETAIL every entry loses its group's name
    for entry in unnamed["entries"]:
        entry["process_group"] = ["", ""]
    assert flight.members({0: unnamed, 1: unnamed}) == {"0": [0, 1]}


def test_flight_verdicts_read_every_group_apart():
    """Sequence numbers count per group: a rank missing from one group may be waiting in
    another, and the verdict says what each group shows. Ranks 0..3, pairs {0, 1} and
    {2, 3} (groups "1" and "2"); rank 3 skipped its pair's all_reduce."""
    from ddplab.pool.protocol import FLIGHT_GROUPS

    def dump(rank, issued):  # issued: (group, pg_id, seq) of each collective, in order
        groups = {"0": [0, 1, 2, 3], ("1" if rank < 2 else "2"): [0, 1] if rank < 2 else [2, 3]}
        return {"entries": [{"collective_seq_id": seq, "profiling_name": "gloo:all_reduce",
                             "input_sizes": [[2]], "process_group": [group, ""],
                             "pg_id": pg_id} for group, pg_id, seq in issued],
                "pg_status": {str(pg_id): {"last_enqueued_collective": str(seq),
                                           "last_completed_collective": "-1"}
                              for _, pg_id, seq in issued},
                FLIGHT_GROUPS: groups}

    dumps = {0: dump(0, [("1", 1, 1), ("0", 0, 1)]), 1: dump(1, [("1", 1, 1), ("0", 0, 1)]),
             2: dump(2, [("2", 1, 1)]), 3: dump(3, [("0", 0, 1)])}
    assert flight.members(dumps) == {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}
    assert flight.verdict(dumps) == (
        "the ranks' flight recorders, group by group: in the default group, ranks 0, 1 and "
        "3 are waiting in collective #1 (all_reduce), which rank 2 never issued (it issued "
        "none); in group 2 (ranks 2 and 3), rank 2 is waiting in collective #1 "
        "(all_reduce), which rank 3 never issued (it issued none).")
    assert flight.table(dumps, group="2").splitlines()[1].split() == ["1", "all_reduce([2])",
                                                                       "-"]
    with pytest.raises(ValueError, match=r"no process group named '7'.*'0', '1', '2'"):
        flight.table(dumps, group="7")


def _pairs_skip():
    """Four ranks in pairs {0, 1} and {2, 3}; rank 3 skips its pair's all_reduce."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    x = torch.ones(2)
    if rank != 3:
        dist.all_reduce(x, group=pairs[rank // 2])
    dist.all_reduce(x)


@pytest.mark.slow
def test_a_hang_in_a_subgroup_is_reported_group_by_group():
    with Pool(4, timeout=30) as p, pytest.raises(RankError) as info:
        p.run(_pairs_skip, timeout=2)
    err = info.value
    assert flight.members(err.flight) == {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}
    assert ("in group 2 (ranks 2 and 3), rank 2 is waiting in collective #1 (all_reduce), "
            "which rank 3 never issued") in str(err)


def test_bad_faults_are_refused(pool):
    with pytest.raises(ValueError, match="unknown fault 'typo': choose one of skip, shape"):
        faults.attempt(pool, "typo")
    with pytest.raises(ValueError, match=r"victim=5: this pool has ranks 0\.\.2"):
        faults.attempt(pool, "skip", victim=5)
