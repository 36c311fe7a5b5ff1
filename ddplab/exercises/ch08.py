"""Chapter 8 exercises: the chunked ring by hand, busbw from a time, DDP's buckets, a hook.

8.1 runs the learner's ring on real ranks with their sends counted: the sum must be exact
and the busiest rank must send no more than the chunked ring's 2(n − 1)/n · S, so the
whole-tensor ring and the naive all-reduce, both correct, are told apart from the real
thing. 8.2 asks for busbw factors the text does not give, each derived from what a rank
holds before and after a collective, and held against `ddplab.bench`'s own. 8.3 holds the
learner's predicted buckets against what a real DDP on two ranks reports (the first bucket's
cap is for the learner to find), and 8.4 a float16 compression hook written by hand against
torch's own `fp16_compress_hook`: what it all-reduces, and the gradients it produces.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

from ddplab.exercises import LOAD_TIMEOUT, exercise, expect, ranks, run_in_time, show, watching

DEADLINE = 5.0
"""Seconds an attempt may take on the ranks: a correct ring takes milliseconds."""

# --- 8.1 the chunked ring all-reduce, from isend/irecv ---

RING_SIZES = (300, 10)
"""Elements of the int64 tensor summed: one that 3 ranks divide evenly (the byte count is
checked there), one they do not (chunks of 4, 3 and 3: the sum must still be exact)."""

SENDS = ("send", "isend")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather",
               "scatter")
"""What 8.1 may not call: the point is to build the all-reduce from point-to-point."""


@contextlib.contextmanager
def counting_sends(sent: list[int], used: list[str]) -> Iterator[None]:
    """On a rank: add the bytes of every tensor sent to `sent`, the name of every
    collective called to `used`, for the duration of the block."""

    def seen(name: str, args: tuple, kwargs: dict) -> None:
        if name in SENDS:
            tensor = kwargs.get("tensor", args[0] if args else None)
            sent.append(tensor.numel() * tensor.element_size())
        else:
            used.append(name)

    with watching(SENDS + COLLECTIVES, seen, c10d=True):  # c10d: P2POp must accept isend
        yield


def ring_on_rank(attempt: Callable, numel: int) -> tuple[list[int], list[int], int, list[str]]:
    """On a rank: the learner's all-reduce on rank-dependent integers, with sends counted.
    Returns (the result, what it should be, bytes this rank sent, collectives called)."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    tensor = torch.arange(numel, dtype=torch.int64) * (rank + 1) + 1000 * rank
    want = sum(torch.arange(numel, dtype=torch.int64) * (r + 1) + 1000 * r for r in range(n))
    sent: list[int] = []
    used: list[str] = []
    with counting_sends(sent, used):
        attempt(tensor)
    return tensor.tolist(), want.tolist(), sum(sent), used


@exercise("8.1", "The chunked ring all-reduce from isend and irecv", solution="ring_all_reduce",
          hint="after the n − 1 steps of the reduce-scatter, which chunk does rank r hold "
               "finished (the schedule says)? Work back from there: at each step, which "
               "chunk must r send right, and which one does the chunk from its left add "
               "into? Then, in the all-gather, which finished chunk does r pass on at each "
               "step? And how do you add into a piece of the tensor so that the tensor "
               "itself changes?")
def check_ring(ring_all_reduce: Callable) -> str:
    world = 3
    with ranks(world) as pool:
        for numel in RING_SIZES:
            got = run_in_time(
                pool, ring_on_rank, ring_all_reduce, numel, deadline=DEADLINE,
                meaning="Around a ring every rank sends to one neighbour while receiving "
                        "from the other: if each first waits for its send to be received, "
                        "all of them wait at once.",
                hint="post the send and the receive before waiting on either: isend and "
                     "irecv (or batch_isend_irecv), then .wait() on both.")
            used = sorted({name for *_, names in got for name in names})
            expect(not used, f"your function called {', '.join(used)}: build the "
                             "all-reduce from sends and receives only.",
                   "use dist.isend and dist.irecv (or dist.batch_isend_irecv) between "
                   "neighbours, no collectives.")
            wrong = {r: result for r, (result, want, _, _) in enumerate(got) if result != want}
            if wrong:
                rank, result = next(iter(wrong.items()))
                expect(False, f"for {numel} int64 elements on {world} ranks, rank {rank} "
                              f"ended with {show(result[:6])}... instead of "
                              f"{show(got[rank][1][:6])}...",
                       "the result must land in the tensor you were given (in place): "
                       "reduce into views of it, and check the chunk each step sends and "
                       "receives.")
            if numel % world == 0:
                size = numel * 8
                busiest = max(sent for *_, sent, _ in got)
                ring = 2 * (world - 1) * size // world
                expect(busiest <= ring,
                       f"the sum is right, but a rank sent {busiest} bytes for a tensor of "
                       f"{size} bytes on {world} ranks; the chunked ring sends "
                       f"2(n − 1)/n · S = {ring}.",
                       "sending whole tensors costs (n − 1) · S: send one chunk of S/n per "
                       "step, 2(n − 1) steps in all.")
    return (f"exact sums on {world} ranks (also with uneven chunks), and each rank sent "
            f"2(n − 1)/n · S = {2 * (world - 1) * RING_SIZES[0] * 8 // world} bytes for "
            f"S = {RING_SIZES[0] * 8}.")


# --- 8.2 busbw from a measured time ---

BUSBW_CASES = [("all_reduce", 64 << 20, 0.0125, 4), ("all_reduce", 1 << 20, 0.001, 2),
               ("all_gather", 16 << 20, 0.004, 8), ("reduce_scatter", 16 << 20, 0.002, 4),
               ("broadcast", 4 << 20, 0.0005, 8), ("send_recv", 8 << 20, 0.001, 2),
               ("all_to_all", 32 << 20, 0.01, 4), ("all_reduce", 3 << 20, 0.002, 3),
               ("reduce_scatter", 6 << 20, 0.003, 6)]
"""(collective, bytes, seconds, world size): every factor of nccl-tests, several n."""

BUSBW_QUESTIONS = {
    "all_reduce": "an all_reduce is a reduce_scatter followed by an all_gather (chapter 4b; "
                  "this chapter's ring does exactly that): what do their two shares add up "
                  "to?",
    "all_gather": "at the end every rank holds the whole gathered output, nbytes; which part "
                  "of it did the rank hold from the start, and so which share had to come in "
                  "through its link?",
    "reduce_scatter": "each rank ends with its own slice of sums, and to make it needs that "
                      "slice from every other rank: as a share of nbytes, how much is that?",
    "all_to_all": "of the nbytes a rank holds, one slice is addressed to itself and never "
                  "leaves: what share has to cross the link?",
    "broadcast": "a rank other than the root starts with nothing and ends with all nbytes; "
                 "pipelined along a chain, each byte crosses each link once.",
    "send_recv": "one message from one rank to another: how many times does each byte "
                 "cross the link?",
}
"""For each collective, the question that leads to its factor: feedback for a learner
whose busbw is off for that collective, which guides without giving the number."""


@exercise("8.2", "Bus bandwidth, derived for each collective", solution="busbw",
          hint="algbw = nbytes / seconds / 1e9 (nccl-tests' GB/s are 10⁹ bytes). busbw = "
               "algbw × the share of nbytes that must come into one rank through its link "
               "with the best algorithm: work that share out for each collective from what a "
               "rank holds before and after it. Only all_reduce's is given in the text.")
def check_busbw(busbw: Callable) -> str:
    from ddplab.bench import Result

    for op, nbytes, seconds, n in BUSBW_CASES:
        result = Result(op, nbytes, nbytes // 4, "float32", n, seconds)
        want, algbw = result.busbw, result.algbw
        got = busbw(op, nbytes, seconds, n)
        call = f"busbw({op!r}, {nbytes}, {seconds}, {n})"
        expect(isinstance(got, (int, float)) and not isinstance(got, bool),
               f"{call} returned {got!r}; return a number of GB/s.")
        if abs(got - want) <= 1e-6 * want:
            continue
        expect(abs(got * 2**30 - want * 1e9) > 1e-6 * want * 1e9,
               f"{call} returned {got:.4g} GB/s; nccl-tests would print {want:.4g}.",
               "nccl-tests' GB are 10⁹ bytes, not 2³⁰: divide by 1e9.")
        expect(abs(got - algbw) > 1e-6 * algbw,
               f"{call} returned {got:.4g} GB/s, which is algbw (bytes / seconds); "
               f"nccl-tests would print {want:.4g} as busbw.",
               "busbw multiplies algbw by a factor per collective; for this one, "
               + BUSBW_QUESTIONS[op])
        expect(False, f"{call} returned {got:.4g} GB/s, algbw × {got / algbw:.4g}; nccl-tests "
                      f"would print {want:.4g}.",
               BUSBW_QUESTIONS[op][0].upper() + BUSBW_QUESTIONS[op][1:])
    return (f"{len(BUSBW_CASES)} measurements on 2 to 8 ranks, every collective: your busbw "
            "matches nccl-tests', factor by factor.")


# --- 8.3 predict DDP's rebuilt buckets ---

BUCKET_CASES = (("five linear layers", "mlp", None), ("five linear layers", "mlp", 0.5),
                ("five linear layers", "mlp", 1),
                ("a last layer of exactly 0.5 MiB", "exact", 0.5),
                ("five linear layers", "mlp", 25))
"""(description, model, bucket_cap_mb): the default caps, small caps, a bucket that reaches
its cap exactly, and an explicit cap equal to the default (which drops the first bucket's)."""


def _model(name: str):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 1024), nn.ReLU(),
                             nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                             nn.Linear(256, 10))
    # "exact": the last layer's weight, ready first, is 256 x 512 x 4 bytes = 0.5 MiB
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256, bias=False))


def rebuilt_buckets(name: str, bucket_cap_mb: float | None) -> tuple[list[int], list[list[int]]]:
    """On a rank: (gradient bytes in ready order, the rebuilt buckets as positions in that
    order), as DDP itself reports them after three iterations."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(name)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    width = next(model.parameters()).shape[1]
    for _ in range(3):
        ddp(torch.randn(4, width)).sum().backward()
    ddp(torch.randn(4, width))  # DDP logs the last iteration at the next forward
    data = ddp._get_ddp_logging_data()
    order = [int(i) for i in data["prev_iteration_grad_ready_order_indices"].split(", ")]
    params = list(model.parameters())
    sizes = [params[i].numel() * params[i].element_size() for i in order]
    position = {index: k for k, index in enumerate(order)}
    buckets = [[position[int(i)] for i in bucket.split()]
               for bucket in data["rebuilt_per_bucket_param_indices"].split(", ")]
    return sizes, buckets


@functools.cache
def _real_layouts() -> list[tuple[str, float | None, list[int], list[list[int]]]]:
    """(case, bucket_cap_mb, sizes, DDP's buckets) for each of BUCKET_CASES; made once."""
    layouts = []
    with ranks(2) as pool:
        for description, name, cap_mb in BUCKET_CASES:
            sizes, buckets = pool.run(rebuilt_buckets, name, cap_mb, timeout=60)[0]
            label = f"{description}, " + ("bucket_cap_mb not passed" if cap_mb is None
                                          else f"bucket_cap_mb={cap_mb:g}")
            layouts.append((label, cap_mb, sizes, buckets))
    return layouts


def _walk(sizes: list[int], first_cap: float, cap: float, *,
          strictly: bool = False) -> list[list[int]]:
    """Buckets in ready order, each closed once it holds at least its cap (`strictly`: more
    than its cap): the rule the chapter states, used here to recognise what an attempt got
    wrong."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for position, size in enumerate(sizes):
        current.append(position)
        held += size
        limit = first_cap if not buckets else cap
        if held > limit or (held == limit and not strictly):
            buckets.append(current)
            current, held = [], 0
    return [*buckets, current] if current else buckets


@exercise("8.3", "Predict DDP's buckets", solution="predict_buckets",
          hint="walk `sizes` in ready order and close a bucket once it holds at least its "
               "cap. Which cap does the *first* bucket get? Compare the default layout with "
               "bucket_cap_mb=25 in the chapter: 25 MiB is the default cap in both, yet the "
               "first buckets differ. bucket_cap_mb counts MiB (2²⁰ bytes).")
def check_buckets(predict_buckets: Callable) -> str:
    import torch.distributed as dist

    mib = 1024 * 1024
    for label, cap_mb, sizes, buckets in _real_layouts():
        got = predict_buckets(list(sizes), cap_mb)
        if got == buckets:
            continue
        call = f"for {label} (sizes {sizes})"
        cap = (25 if cap_mb is None else cap_mb) * mib
        first_cap = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap
        expect(got != _walk(sizes, first_cap, cap, strictly=True),
               f"{call} you predicted {show(got)}; DDP rebuilt {show(buckets)}.",
               "a bucket closes once it holds at least its cap: a gradient that fills it "
               "exactly closes it.")
        wrong_first = {
            "the default 1 MiB": _walk(sizes, dist._DEFAULT_FIRST_BUCKET_BYTES, cap),
            "the same cap as the others": _walk(sizes, cap, cap)}
        for first, layout in wrong_first.items():
            expect(got != layout,
                   f"{call} you predicted {show(got)}: the walk is right, but your first "
                   f"bucket closed at {first}; DDP rebuilt {show(buckets)}.",
                   "what does DDP give the first bucket when bucket_cap_mb is passed, and "
                   "when it is not? The default layout and bucket_cap_mb=25 in the chapter "
                   "tell the two apart.")
        expect(False, f"{call} you predicted {show(got)}; DDP rebuilt {show(buckets)}.")
    return (f"your buckets match DDP's own in all {len(BUCKET_CASES)} cases, the 1 MiB first "
            "bucket, an explicit cap and the exact fit included.")


# --- 8.4 a communication hook of your own ---

HOOK_CAP_MB = 0.5
"""Buckets of 0.5 MiB: 8.4's model makes four, so a hook that only works for one fails."""


def _first_ddp() -> None:
    """Runs on each rank before the attempt: the rank's first DDP model, whose construction
    imports torch._dynamo, seconds of work per process (tens on a loaded machine) that must
    not count against the attempt's deadline."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    DDP(_model("mlp"), bucket_cap_mb=HOOK_CAP_MB)


def hooked_gradients(hook: Callable, iterations: int = 3) -> dict:
    """On a rank: the same model's gradients with the learner's hook and with torch's own
    `fp16_compress_hook`, on the same batches. Returns, per iteration, (their largest
    difference, the ratio of their norms); the dtypes of what the hook all-reduced; and what
    the hook returned when that was not a Future.

    Given None from a hook, DDP crashes the process (SIGSEGV, torch 2.13), so the hook is
    called through a guard that notes anything but a Future and all-reduces instead.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    returned: list[str] = []
    sent: set[str] = set()
    all_reduce = dist.all_reduce

    def noted(tensor, *args, **kwargs):
        sent.add(str(tensor.dtype).removeprefix("torch."))
        return all_reduce(tensor, *args, **kwargs)

    def guarded(state, bucket):
        dist.all_reduce = noted
        try:
            result = hook(state, bucket)
        finally:
            dist.all_reduce = all_reduce
        if isinstance(result, torch._C.Future):  # what get_future() and then() give
            return result
        returned.append("None" if result is None else f"a {type(result).__name__}")
        return default_hooks.fp16_compress_hook(None, bucket)

    mine, theirs = (DDP(_model("mlp"), bucket_cap_mb=HOOK_CAP_MB) for _ in range(2))
    mine.register_comm_hook(None, guarded)
    theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    torch.manual_seed(dist.get_rank())
    rows = []
    for _ in range(iterations):
        x = torch.randn(16, 256)
        grads = []
        for model in (mine, theirs):
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        rows.append(((grads[0] - grads[1]).abs().max().item(),
                     (grads[0].norm() / grads[1].norm()).item()))
    return {"rows": rows, "returned": returned[:1], "sent": sorted(sent),
            "dtype": str(grads[0].dtype).removeprefix("torch.")}


TOLERANCE = 1e-6
"""How far 8.4's gradients may be from torch's fp16_compress_hook's. Dividing before or
after the float16 all-reduce gives the same bits on 2 ranks (halving is exact), so a correct
hook is at 0; a float32 all-reduce is about 10⁻⁴ off, far above this."""


@exercise("8.4", "A float16 compression hook, by hand", solution="fp16_hook",
          hint="DDP hands you the bucket as one flat float32 tensor (bucket.buffer()) and wants "
               "back a Future of a float32 tensor. What has to happen to the tensor before the "
               "all-reduce, so that half the bytes travel, and what in the callback you chain "
               "with .then(...), so that DDP gets what it expects?")
def check_hook(fp16_hook: Callable) -> str:
    import inspect

    names = list(inspect.signature(fp16_hook).parameters)
    expect(names[1:2] == ["bucket"],
           f"your hook's parameters are ({', '.join(names)}); DDP calls hook(state, bucket) "
           "and looks up the parameter named `bucket` (to check its type annotation).",
           "name them as DDP does: def fp16_hook(state, bucket).")
    with ranks(2) as pool:
        pool.run(_first_ddp, timeout=LOAD_TIMEOUT)
        got = run_in_time(pool, hooked_gradients, fp16_hook, deadline=30.0,
                          meaning="DDP waits in backward() for the future your hook returns.",
                          hint="return the future of an async all_reduce (or a `.then` of "
                               "it); never wait for something only another bucket sends.")
    returned = got[0]["returned"]
    expect(not returned, f"your hook returned {returned[0] if returned else ''}; DDP needs a "
                         "torch.futures.Future whose value is the bucket's new contents (given "
                         "None, torch 2.13 even crashes the rank).",
           "return the future of an async all_reduce, or a `.then(...)` of it.")
    sent = got[0]["sent"]
    expect(sent == ["float16"],
           f"your hook all-reduced {', '.join(sent) or 'nothing'}"
           + (": 4 bytes per gradient, the bytes fp16_compress_hook halves." if "float32"
              in sent else "; fp16_compress_hook all-reduces float16, 2 bytes per gradient."),
           "make a float16 copy of the bucket's buffer and all-reduce that.")
    for rank, out in enumerate(got):
        for iteration, (difference, ratio) in enumerate(out["rows"], 1):
            if difference > TOLERANCE:
                expect(abs(ratio - 2) > 1e-3,
                       f"on rank {rank}, iteration {iteration}, your gradients are 2× those of "
                       "fp16_compress_hook: the sum over the 2 ranks, not the average.",
                       "divide by dist.get_world_size() (before the all-reduce or after).")
                expect(False, f"on rank {rank}, iteration {iteration}, your gradients differ "
                              f"from fp16_compress_hook's by up to {difference:.3g} (norm "
                              f"ratio {ratio:.4g}).",
                       "the value of the future you return becomes the bucket: a float32 "
                       "tensor of the buffer's size, the float16 sum divided by the ranks.")
    return ("with four buckets on 2 ranks your hook all-reduces float16, half the bytes, and "
            "its gradients equal torch's fp16_compress_hook's in every iteration.")
