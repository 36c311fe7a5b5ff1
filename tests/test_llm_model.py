"""ddplab.llm.model: the Llama-style decoder, checked part by part against what each part claims.

Causal (a later token never changes an earlier logit), grouped-query attention equal to
multi-head attention with each key/value head repeated, rotary positions that make a query
and a key depend on their distance only, RMSNorm equal to torch's, a pipeline stage as the
model with parts removed, sizes that cannot work refused; and, on real ranks (a Pool of 2,
gloo), torchtitan's tensor-parallel plan for Llama 3 applied by name, equal to one process.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddplab import Pool
from ddplab.llm.model import (
    Attention,
    ModelArgs,
    RMSNorm,
    Transformer,
    apply_rotary,
    check_tensor_parallel,
    rotary_tables,
)

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16, ffn_hidden=64,
                  max_seq_len=12)


def tokens(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (batch, seq),
                         generator=torch.Generator().manual_seed(3))


def test_logits_for_every_position_and_no_position_sees_a_later_token():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    ids = tokens()
    logits = model(ids)
    assert logits.shape == (2, 12, SMALL.vocab_size)
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % SMALL.vocab_size
    again = model(changed)
    assert torch.equal(again[:, :7], logits[:, :7])
    assert (again[:, 7:] - logits[:, 7:]).abs().max() > 1e-3


def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_repeated():
    torch.manual_seed(0)
    gqa = Attention(SMALL)
    mha = Attention(ModelArgs(dim=32, n_heads=4, n_kv_heads=4))
    hd, group = SMALL.head_dim, SMALL.n_heads // SMALL.n_kv_heads
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):   # key/value head j serves query heads j·group … (j+1)·group-1
            heads = getattr(gqa, name).weight.view(SMALL.n_kv_heads, hd, SMALL.dim)
            getattr(mha, name).weight.copy_(heads.repeat_interleave(group, dim=0).flatten(0, 1))
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_tables(hd, 12, SMALL.rope_theta)
    assert (gqa(x, cos, sin) - mha(x, cos, sin)).abs().max() < 1e-6


def test_rotary_positions_keep_lengths_and_make_scores_depend_on_distance_only():
    cos, sin = rotary_tables(8, 32, 10_000.0)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)

    def at(x, position):
        return apply_rotary(x, cos[position:position + 1], sin[position:position + 1])

    assert (at(q, 5).norm() - q.norm()).abs() < 1e-6
    score = (at(q, 9) * at(k, 4)).sum()                 # distance 5
    for shift in (1, 7, 20):
        assert ((at(q, 9 + shift) * at(k, 4 + shift)).sum() - score).abs() < 1e-5
    assert ((at(q, 9) * at(k, 2)).sum() - score).abs() > 1e-3     # another distance


def test_rms_norm_equals_torchs():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    ours, theirs = RMSNorm(16, eps=1e-5), nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    assert (ours(x) - theirs(x)).abs().max() < 1e-6


def test_a_pipeline_stage_is_the_model_with_its_other_parts_removed():
    torch.manual_seed(0)
    model = Transformer(SMALL)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    ids = tokens()
    assert torch.equal(last(first(ids)), model(ids))
    # The kept layers keep their names: a checkpoint's keys are the same at every layout
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())


def test_sizes_that_cannot_work_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="n_kv_heads dividing n_heads"):
        ModelArgs(n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="not a multiple of n_heads"):
        ModelArgs(dim=100, n_heads=8)
    with pytest.raises(ValueError, match="odd"):
        ModelArgs(dim=24, n_heads=8, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"n_kv_heads=2 .*choose a TP size that divides it"):
        check_tensor_parallel(SMALL, 4)
    with pytest.raises(ValueError, match=r"vocab_size=65 .*pad it"):
        check_tensor_parallel(ModelArgs(), 2)
    check_tensor_parallel(SMALL, 2)
    with pytest.raises(ValueError, match="longer than max_seq_len=12"):
        Transformer(SMALL)(tokens(seq=13))


def torchtitan_tp_against_one_process():
    """torchtitan's `apply_tp` for Llama 3, by this model's names, on the whole world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = Transformer(SMALL)
    model = copy.deepcopy(full)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False)})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    ids, target = tokens(), tokens().roll(1, dims=1)
    with warnings.catch_warnings(), loss_parallel():
        warnings.simplefilter("error")            # no warning from the model's own code
        loss = F.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        loss.backward()
    reference = F.cross_entropy(full(ids).flatten(0, 1), target.flatten())
    reference.backward()
    params = dict(full.named_parameters())
    return {"loss": abs(loss.item() - reference.item()),
            "grads": max((p.grad.full_tensor() - params[n].grad).abs().max().item()
                         for n, p in model.named_parameters()),
            "heads on a rank": model.layers["0"].attention.wq.weight.to_local().shape[0]
            // SMALL.head_dim}


@pytest.mark.slow
def test_torchtitans_tensor_parallel_plan_applies_by_name_and_equals_one_process():
    with Pool(2, timeout=60) as pool:
        for out in pool.run(torchtitan_tp_against_one_process):
            assert out["heads on a rank"] == 2
            assert out["loss"] < 1e-6
            assert out["grads"] < 1e-6
