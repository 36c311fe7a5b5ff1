"""ddplab.parallel.tp and ddplab.parallel.sp: tensor and sequence parallelism by hand,
checked against the unsharded blocks (outputs and every gradient), the vocabulary-parallel
embedding and cross-entropy against `nn.Embedding` and `F.cross_entropy`, their collectives
recorded and counted against the arithmetic, SP's saved activations measured against TP's.

Real ranks (one ddplab Pool of 4, gloo, shared by the module): the whole world as one TP
group of 4 (the tensor-parallel blocks), and two TP groups of 2 (ranks 0-1 and 2-3: the
sequence-parallel block, the vocabulary-parallel layers) for the explicit `group=` a 2-D
mesh needs. Every test that uses
the pool is marked slow, so that the fast inner loop (`make quick`) starts no pool here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddplab import Pool
from ddplab.parallel.sp import (
    Block,
    SequenceParallelBlock,
    TensorParallelBlock,
    gather_sequence,
    scatter_sequence,
    split_sequence,
)
from ddplab.parallel.tp import (
    MLP,
    Attention,
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelAttention,
    TensorParallelMLP,
    VocabParallelEmbedding,
    causal_attention,
    copy_to_tp,
    reduce_from_tp,
    shard_range,
    vocab_parallel_cross_entropy,
)
from ddplab.sharding import measure_step, record_collectives

B, T, D, H, HEADS = 2, 8, 8, 32, 4
TOL = 1e-5
F32 = 4


@pytest.fixture(scope="module")
def pool():
    with Pool(4, timeout=60) as p:
        yield p


def tp_group(size: int):
    """The world (size 4) or this rank's pair (size 2: ranks 0-1 and 2-3), made on every
    rank (new_subgroups is collective)."""
    if size == dist.get_world_size():
        return None
    group, _ = dist.new_subgroups(size)
    return group


def inputs(shape=(B, T, D)) -> torch.Tensor:
    """The same input on every rank (seeded), requiring grad (its gradient is checked)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7)).requires_grad_()


def grads_match(sharded: nn.Module, full: nn.Module, pairs: dict) -> float:
    """Max |Δ| between each sharded parameter's gradient and its slice of the full one.
    `pairs`: sharded name -> (full name, slice of the full gradient)."""
    s, f = dict(sharded.named_parameters()), dict(full.named_parameters())
    return max((s[name].grad - f[ref].grad[where]).abs().max().item()
               for name, (ref, where) in pairs.items())


def linear_pairs(prefix: str, full: str, layer: nn.Module) -> dict:
    rows = slice(layer.start, layer.stop)
    if isinstance(layer, ColumnParallelLinear):
        return {f"{prefix}.weight": (f"{full}.weight", rows),
                f"{prefix}.bias": (f"{full}.bias", rows)}
    return {f"{prefix}.weight": (f"{full}.weight", (slice(None), rows)),
            f"{prefix}.bias": (f"{full}.bias", slice(None))}


# --- f and g ---------------------------------------------------------------------------

def f_and_g() -> dict:
    r = dist.get_rank()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = copy_to_tp(x)
    (y * (r + 1)).sum().backward()  # rank r's gradient for y is r + 1
    f_forward, f_grad = y.detach().tolist(), x.grad.tolist()
    x.grad = None
    z = reduce_from_tp(x)
    (z * (r + 1)).sum().backward()
    return {"f": (f_forward, f_grad), "g": (z.detach().tolist(), x.grad.tolist())}


@pytest.mark.slow
def test_f_is_identity_forward_and_all_reduce_backward_g_the_reverse(pool):
    for r, out in enumerate(pool.run(f_and_g)):
        assert out["f"] == ([r + 1.0] * 3, [10.0] * 3)  # 1 + 2 + 3 + 4
        assert out["g"] == ([10.0] * 3, [r + 1.0] * 3)


# --- the MLP and attention, against the unsharded blocks -------------------------------

def _block_case(full, tp, layers: str | tuple[str, ...]) -> dict:
    """One step of the unsharded block and of its tensor-parallel copy, on the same inputs:
    the largest differences, the collectives recorded (how many in forward), and whether
    every parameter's gradient is its slice of the unsharded one."""
    x, xs = inputs(), inputs()
    y_full = full(x)
    y_full.square().sum().backward()
    with record_collectives() as comms:
        y = tp(xs)
        forward = len(comms)
        y.square().sum().backward()
    pairs = {}
    for name in layers:
        pairs.update(linear_pairs(name, name, getattr(tp, name)))
    return {"out": (y - y_full).abs().max().item(), "grad_x": (xs.grad - x.grad).abs().max().item(),
            "grads": grads_match(tp, full, pairs), "forward": forward,
            "comms": [(c.kind, c.bytes, c.world_size) for c in comms]}


def mlp_case(size: int) -> dict:
    group = tp_group(size)
    torch.manual_seed(0)
    full = MLP(D, H)
    return _block_case(full, TensorParallelMLP(full, group), ("fc1", "fc2"))


def attention_case(size: int) -> dict:
    group = tp_group(size)
    torch.manual_seed(0)
    full = Attention(D, HEADS)
    tp = TensorParallelAttention(full, group)
    return {**_block_case(full, tp, "qkvo"), "heads": tp.heads}


@pytest.mark.slow
def test_tp_blocks_equal_the_unsharded_with_one_all_reduce_each_way(pool):
    """Outputs, the input's gradient and every parameter's gradient (its slice) equal the
    unsharded block's; one all-reduce of the activations (B·T·D floats) forward, one
    backward, over the TP group of 4; per rank per step the MLP sends 2 all-reduces ×
    2(N-1)/N × B·T·D·4 bytes (the ring arithmetic)."""
    from ddplab.sharding import Comm

    for case, fn in (("mlp", mlp_case), ("attention", attention_case)):
        for out in pool.run(fn, 4):
            assert out["out"] < TOL and out["grad_x"] < TOL and out["grads"] < TOL, (case, out)
            assert out["forward"] == 1
            assert out["comms"] == [("all_reduce", B * T * D * F32, 4)] * 2
            if case == "attention":
                assert out["heads"] == HEADS // 4
            else:
                comms = [Comm(0, kind, nbytes, 0.0, 0.0, n) for kind, nbytes, n in out["comms"]]
                assert sum(c.ring_bytes for c in comms) == 2 * round(2 * 3 / 4 * B * T * D * F32)


def overlap_case() -> dict:
    """The MLP with f's backward all-reduce overlapped (`overlap=True`) against the plain
    one: every difference, the collectives, and when the weight-gradient matmul of fc1 ran
    relative to the all-reduce's issue and its wait (aten.mm calls timed by a dispatch mode)."""
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.monotonic()
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                self.calls.append((tuple(out.shape), start, time.monotonic()))
            return out

    torch.manual_seed(0)
    full = MLP(D, 48)  # fc1's weight (12, 8): a shape no other matmul of the backward makes
    plain, overlapped = TensorParallelMLP(full, None), TensorParallelMLP(full, None, overlap=True)
    x, xs = inputs(), inputs()
    plain(x).square().sum().backward()
    with record_collectives() as comms:
        y = overlapped(xs)
        with Matmuls() as matmuls:
            y.square().sum().backward()
    dw = [(start, end) for shape, start, end in matmuls.calls
          if shape == tuple(overlapped.fc1.weight.shape)]
    backward = comms[-1]
    return {"out": (y - plain(x)).abs().max().item(),
            "grad_x": (xs.grad - x.grad).abs().max().item(),
            "grads": max((a.grad - b.grad).abs().max().item()
                         for a, b in zip(overlapped.parameters(), plain.parameters(), strict=True)),
            "comms": [(c.kind, c.bytes) for c in comms],
            "dw_inside": len(dw) == 1 and backward.start <= dw[0][0] and dw[0][1] <= backward.end}


@pytest.mark.slow
def test_overlapped_all_reduce_gives_the_same_bits_and_runs_under_the_weight_gradient(pool):
    """`overlap=True` changes when f's all-reduce runs, not what is computed: outputs and
    every gradient equal the plain MLP's exactly, with the same two all-reduces; and fc1's
    weight-gradient matmul runs after the backward all-reduce is issued and before its wait
    returns (the overlap)."""
    for out in pool.run(overlap_case):
        assert out["out"] == 0 and out["grad_x"] == 0 and out["grads"] == 0, out
        assert out["comms"] == [("all_reduce", B * T * D * F32)] * 2
        assert out["dw_inside"], out


# --- the vocabulary: embedding and cross-entropy split by token id ----------------------

VOCAB = 16


def vocab_case(size: int) -> dict:
    """The vocabulary-parallel embedding against `nn.Embedding` and the vocabulary-parallel
    cross-entropy against `F.cross_entropy`, over this rank's TP group of `size`: the
    largest differences of outputs, losses and gradients (each rank's rows of the table,
    its classes of the logits), and the collectives each issued."""
    group = tp_group(size)
    torch.manual_seed(0)
    full = nn.Embedding(VOCAB, D)
    embed = VocabParallelEmbedding(full, group)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    ids[0, :VOCAB // 2] = torch.arange(0, VOCAB, 2)  # every rank's rows looked up
    weights = torch.randn(B, T, D, generator=g)  # a loss whose gradient differs by token
    (full(ids) * weights).sum().backward()
    with record_collectives() as embed_comms:
        y = embed(ids)
        (y * weights).sum().backward()
    rows = slice(embed.start, embed.stop)

    logits = torch.randn(B, T, VOCAB, generator=g, requires_grad=True)
    target = torch.randint(0, VOCAB, (B, T), generator=g)
    reference = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    reference.backward()
    classes = slice(*shard_range(VOCAB, group))
    mine = logits.detach()[..., classes].clone().requires_grad_()
    with record_collectives() as loss_comms:
        loss = vocab_parallel_cross_entropy(mine, target, group)
        loss.backward()
    return {"embedding": (y - full(ids)).abs().max().item(),
            "embedding_grad": (embed.weight.grad - full.weight.grad[rows]).abs().max().item(),
            "rows": (embed.start, embed.stop),
            "loss": (loss - reference).abs().item(),
            "logits_grad": (mine.grad - logits.grad[..., classes]).abs().max().item(),
            "comms": [(c.kind, c.bytes, c.world_size) for c in (*embed_comms, *loss_comms)]}


@pytest.mark.slow
def test_vocab_parallel_embedding_and_cross_entropy_equal_the_unsharded(pool):
    """On TP groups of 2 (ranks 0-1, 2-3): the embedding's output and its rows' gradient
    equal `nn.Embedding`'s with one all-reduce of the activations forward and none
    backward; the loss and each rank's classes' gradient equal `F.cross_entropy`'s, with
    three all-reduces of one float a token (the maximum, the sum, the target's logit)."""
    for r, out in enumerate(pool.run(vocab_case, 2)):
        print(f"rank {r}: max |Δ| embedding {out['embedding']:.1e}, its gradient "
              f"{out['embedding_grad']:.1e}; loss {out['loss']:.1e}, logits' gradient "
              f"{out['logits_grad']:.1e}")
        assert out["rows"] == ((r % 2) * VOCAB // 2, (r % 2 + 1) * VOCAB // 2)
        for what in ("embedding", "embedding_grad", "loss", "logits_grad"):
            assert out[what] < TOL, (r, what, out)
        assert out["comms"] == ([("all_reduce", B * T * D * F32, 2)]
                                + [("all_reduce", B * T * F32, 2)] * 3)


def out_of_vocabulary() -> dict:
    """Ids outside the vocabulary, refused on every rank before any collective."""
    embed = VocabParallelEmbedding(nn.Embedding(VOCAB, D))
    logits = torch.zeros(2, 3, VOCAB // dist.get_world_size())
    out = {}
    for name, attempt in (
            ("embedding", lambda: embed(torch.tensor([[0, 3, VOCAB]]))),
            ("negative", lambda: embed(torch.tensor([[-1, 3]]))),
            ("ignored", lambda: vocab_parallel_cross_entropy(
                logits, torch.tensor([[1, -100, 2], [0, 1, 2]]))),
            ("shape", lambda: vocab_parallel_cross_entropy(logits, torch.zeros(6).long()))):
        try:
            attempt()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.mark.slow
def test_an_id_outside_the_vocabulary_is_refused_not_counted_as_zeros(pool):
    for out in pool.run(out_of_vocabulary):
        assert out["embedding"] == ("a token id outside the vocabulary [0, 16): 0 … 16; the "
                                    "vocabulary-parallel layers take no ignored or padding ids")
        assert "a token id outside the vocabulary [0, 16): -1 … 3" in out["negative"]
        assert "a target outside the vocabulary [0, 16): -100 … 2" in out["ignored"]
        assert "logits of shape (2, 3, 4) need targets of shape (2, 3)" in out["shape"]


# --- sequence parallelism --------------------------------------------------------------

def gather_scatter() -> dict:
    r = dist.get_rank()
    x = torch.full((1, 2, 3), float(r), requires_grad=True)
    full = gather_sequence(x)  # (1, 8, 3): positions 2r, 2r+1 hold r
    (full * torch.arange(8.0).view(1, 8, 1)).sum().backward()
    gathered, grad = full[0, :, 0].tolist(), x.grad[0, :, 0].tolist()
    y = torch.ones(1, 8, 3, requires_grad=True)
    part = scatter_sequence(y * (r + 1))
    part.sum().backward()
    return {"gathered": gathered, "grad": grad, "scattered": part.detach().shape,
            "value": part[0, 0, 0].item(), "y_grad": y.grad[0, :, 0].tolist()}


@pytest.mark.slow
def test_gather_and_scatter_sequence_are_each_others_backward(pool):
    for r, out in enumerate(pool.run(gather_scatter)):
        assert out["gathered"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
        # backward of the all-gather: every rank's gradient (the positions) summed, split
        assert out["grad"] == [4.0 * (2 * r), 4.0 * (2 * r + 1)]
        assert out["scattered"] == (1, 2, 3) and out["value"] == 10.0
        assert out["y_grad"] == [float(r + 1)] * 8  # the all-gather of the ones, times r+1


def sp_case(size: int) -> dict:
    group = tp_group(size)
    torch.manual_seed(0)
    full = Block(D, H)
    sp = SequenceParallelBlock(full, group)
    x = inputs()
    y_full = full(x)
    y_full.square().sum().backward()
    xs = split_sequence(inputs(), group=group).detach().requires_grad_()
    with record_collectives() as comms:
        y = sp(xs)
        y.square().sum().backward()
    r, n = dist.get_rank(group), dist.get_world_size(group)
    rows = slice(r * T // n, (r + 1) * T // n)
    pairs = {"ln.weight": ("ln.weight", slice(None)), "ln.bias": ("ln.bias", slice(None)),
             **linear_pairs("fc1", "mlp.fc1", sp.fc1), **linear_pairs("fc2", "mlp.fc2", sp.fc2)}
    return {"out": (y - y_full[:, rows]).abs().max().item(),
            "grad_x": (xs.grad - x.grad[:, rows]).abs().max().item(),
            "grads": grads_match(sp, full, pairs),
            "comms": sorted((c.kind, c.bytes, c.world_size) for c in comms)}


@pytest.mark.slow
def test_sp_block_equals_the_unsharded_on_its_slice_of_the_sequence(pool):
    """Each rank's output and input gradient are its slice of the unsharded block's; every
    gradient equals (LayerNorm's and fc2's bias: whole, after their all-reduce). Forward
    one all-gather in and one reduce-scatter out (payload: the whole B·T·D activation),
    backward the reverse, plus three all-reduces of D floats (ln.weight, ln.bias, fc2.bias).
    Split over the pairs of ranks (0-1, 2-3): the explicit group a 2-D mesh passes."""
    size = 2
    for out in pool.run(sp_case, size):
        assert out["out"] < TOL and out["grad_x"] < TOL and out["grads"] < TOL, out
        act = B * T * D * F32
        assert out["comms"] == sorted([("all_gather_single", act, size)] * 2
                                      + [("reduce_scatter_single", act, size)] * 2
                                      + [("all_reduce", D * F32, size)] * 3)


def saved_activations(dropout: float) -> dict:
    torch.manual_seed(0)
    full = Block(D, H, dropout)
    out = {}
    for name, block, x in (("tp", TensorParallelBlock(full), inputs()),
                           ("sp", SequenceParallelBlock(full), split_sequence(inputs()))):
        opt = torch.optim.SGD(block.parameters(), lr=0.0)
        out[name] = measure_step(block, opt, x.detach().requires_grad_()).activations
    return out


@pytest.mark.slow
def test_sp_saves_less_activation_memory_than_tp_by_the_arithmetic(pool):
    """Per rank, the ledger's saved activations (bytes, fp32, N = 4), layer by layer:
    TP saves LayerNorm's input B·T·D and its two statistics B·T, fc1's input B·T·D,
    GeLU's and fc2's inputs B·T·H/N each, dropout's mask B·T·D (on a CPU a float mask:
    4 bytes an element) and the block's output B·T·D (the loss squares it). SP saves the
    same, but LayerNorm's input and statistics, the mask and the output are its own
    positions only (1/N); fc1's input is the all-gathered whole sequence, as with TP."""
    n = 4
    for out in pool.run(saved_activations, 0.1):
        tp = (B * T * D + 2 * B * T + B * T * D + 2 * B * T * H // n + 2 * B * T * D) * F32
        sp = (B * T * D // n + 2 * B * T // n + B * T * D + 2 * B * T * H // n
              + 2 * B * T * D // n) * F32
        assert out == {"tp": tp, "sp": sp}


# --- bad input -------------------------------------------------------------------------

def errors() -> dict:
    out = {}
    attempts = {
        "columns": lambda: ColumnParallelLinear(nn.Linear(8, 6)),
        "rows": lambda: RowParallelLinear(nn.Linear(6, 8)),
        "not_linear": lambda: ColumnParallelLinear(nn.Conv1d(8, 8, 1)),
        "heads": lambda: TensorParallelAttention(Attention(12, 6)),
        "head_dim": lambda: Attention(10, 4),
        "row_input": lambda: RowParallelLinear(nn.Linear(8, 8))(torch.ones(2, 8)),
        "sequence": lambda: split_sequence(torch.ones(2, 6, 8)),
        "vocabulary": lambda: VocabParallelEmbedding(nn.Embedding(10, 8)),
        "not_embedding": lambda: VocabParallelEmbedding(nn.Linear(8, 8)),
        "padding": lambda: VocabParallelEmbedding(nn.Embedding(8, 8, padding_idx=0)),
    }
    pair = dist.new_group([0, 1])  # collective: every rank makes it, only 0 and 1 are in it
    if dist.get_rank() >= 2:
        attempts["not_in_group"] = lambda: shard_range(8, pair)
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = str(e)
    return out


@pytest.mark.slow
def test_bad_input_gets_an_error_naming_the_problem_and_the_fix(pool):
    out = pool.run(errors)[2]
    assert "out_features = 6 does not split over 4 ranks" in out["columns"]
    assert "in_features = 6 does not split over 4 ranks" in out["rows"]
    assert "full nn.Linear" in out["not_linear"] and "Conv1d" in out["not_linear"]
    assert "6 heads do not split over 4 ranks" in out["heads"]
    assert "divisible by the number of heads" in out["head_dim"]
    assert "this rank's slice of the input features (2 of them), got 8" in out["row_input"]
    assert "6 positions" in out["sequence"] and "divisible by 4" in out["sequence"]
    assert "rank 2 is not in this group" in out["not_in_group"]
    assert "num_embeddings = 10 does not split over 4 ranks" in out["vocabulary"]
    assert "full nn.Embedding" in out["not_embedding"] and "Linear" in out["not_embedding"]
    assert "without padding_idx or max_norm" in out["padding"]


def test_attention_without_ranks_checks_its_heads_and_masks_on_the_inputs_device():
    """No pool: the causal mask is built where q lives (the same code runs on a GPU), and a
    width the heads do not divide is refused."""
    q = torch.randn(1, 3, 4)
    out = causal_attention(q, q, q, head_dim=2)
    assert out.shape == (1, 3, 4) and out.device == q.device
    assert torch.allclose(out[:, 0], q[:, 0])  # the first position sees only itself
    with pytest.raises(ValueError, match="divisible by the number of heads"):
        Attention(10, 4)
