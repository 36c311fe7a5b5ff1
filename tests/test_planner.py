"""`ddplab.planner` and `ddplab plan`: hand-computed values, reasons, search order, the CLI,
and the published runs of benchmarks/planner_vs_published.py. Pure arithmetic: seconds."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ddplab import planner
from ddplab.costmodel import Model
from ddplab.planner import GPUS, MODELS, Cluster, Layout, Transformer, plan, search

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def _published():
    from ddplab.planning import published

    return published


def _gpt(layers=24, hidden=2304, heads=24, vocab=51200, seq=2048) -> Transformer:
    return Transformer("GPT", layers, hidden, heads, heads, 4 * hidden, vocab, seq,
                       gated=False, tied=True, positions=True, dropout=True)


@pytest.mark.parametrize(("name", "billions"), [
    ("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85), ("gpt3-175b", 174.6),
])
def test_parameter_counts_match_the_published_configs(name: str, billions: float) -> None:
    # 8B: 32 × (4096² × 2 + 4096 × 1024 × 2 + 3 × 4096 × 14336 + 2 × 4096)
    #     + 2 × 128256 × 4096 + 4096 = 8,030,261,248 (Hugging Face reports 8.03B)
    assert MODELS[name].params == pytest.approx(billions * 1e9, rel=2e-3)
    if name == "llama3-8b":
        assert MODELS[name].params == 8_030_261_248


def test_flops_are_narayanan_et_al_s_formula_for_gpt() -> None:
    """96Bslh²(1 + s/6h + V/16lh) with full recomputation, 72(...V/12lh) without."""
    m = _gpt()
    b, s, l, h, v = 512, m.seq, m.layers, m.hidden, m.vocab  # noqa: E741
    full = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    none = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert b * s * m.flops_per_token("full") == pytest.approx(full, rel=1e-12)
    assert b * s * m.flops_per_token() == pytest.approx(none, rel=1e-12)
    # selective recomputes QKᵀ and ·V only: 4sh per layer and token
    assert m.flops_per_token("selective") - m.flops_per_token() == 4 * s * h * l


def test_activations_are_korthikanti_et_al_s_table_2() -> None:
    m = _gpt()
    s, b, h, a, t = m.seq, 4, m.hidden, m.heads, 2
    assert m.activation_bytes(b, t) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)
    assert m.activation_bytes(b, t, recompute="selective") == pytest.approx(34 * s * b * h / t)
    assert m.activation_bytes(b, t, recompute="full") == pytest.approx(2 * s * b * h / t)
    # without sequence parallelism: sbh(10 + 24/t + 5as/ht), their "tensor parallel" row
    assert m.activation_bytes(b, t, sp=False) == pytest.approx(
        s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert m.activation_bytes(b, t, recompute="full", sp=False) == pytest.approx(2 * s * b * h)
    # Llama: no dropout, K and V a quarter as wide, three FFN-wide tensors
    llama = MODELS["llama3-8b"]
    per_sbh = (2 + 2 + 4 * 8 / 32 + 2) + (2 + 2 * 3 * 14336 / 4096) + 4
    assert llama.activation_bytes(1, recompute="selective") == pytest.approx(
        8192 * 4096 * per_sbh)


def test_memory_for_a_layout_by_hand() -> None:
    """Llama 3 8B, 8 GPUs of DP, ZeRO-1, selective, micro-batch 1, 64 sequences; gradients
    held in fp32, the dtype mixed precision accumulates them in (each bf16 gradient freed
    once added): 2 + 4 + 12 = 18 bytes a parameter before sharding."""
    m = MODELS["llama3-8b"]
    p = plan(m, GPUS["h100"], 8, Layout(zero=1, recompute="selective"), 64)
    psi = m.params
    layer = 8192 * 4096 * 34  # bytes: per_sbh = 34 for Llama 3 8B (see above)
    logits = 4 * 8192 * 128256 + 2 * 2 * 8192 * 4096  # + the final norm's input and output
    assert p.memory == pytest.approx({
        "parameters": 2 * psi, "gradients": 4 * psi, "optimizer": 12 * psi / 8,
        "activations": 32 * layer + logits, "reserved": 4 * GiB})
    assert list(p.memory)[:4] == list(planner.CATEGORIES)
    assert p.reasons == ["needs 98 GiB, has 80"]  # 98.0 GiB by the lines above
    assert p.micro_batches == 8 and p.dp == 8
    # bf16 accumulation: ZeRO's paper's 16 bytes; the fp32 buffer adds 2 bytes net (4Ψ in
    # place of 2Ψ), sharded as the gradients are
    bf16 = plan(m, GPUS["h100"], 8, Layout(zero=1, recompute="selective", grad_dtype="bf16"), 64)
    assert p.memory_total - bf16.memory_total == pytest.approx(2 * psi)
    assert bf16.memory["gradients"] == 2 * psi and bf16.reasons == ["needs 83 GiB, has 80"]
    z2 = plan(m, GPUS["h100"], 8, Layout(zero=2, recompute="selective"), 64)
    assert z2.feasible and z2.memory["gradients"] == pytest.approx(4 * psi / 8)
    # FSDP2's mixed precision: the shards are the fp32 masters, no bf16 copy: 16 bytes / N
    fsdp = plan(m, GPUS["h100"], 8, Layout(zero=3, recompute="selective", fp32_shards=True), 64)
    assert [fsdp.memory[k] for k in ("parameters", "gradients", "optimizer")] == \
        pytest.approx([4 * psi / 8, 4 * psi / 8, 8 * psi / 8])


def test_zero_under_gradient_accumulation_is_charged_in_time_or_in_memory() -> None:
    """ZeRO-2 with 128 micro-batches: either 128 reduce-scatters (gradients sharded), or
    one reduce-scatter and gradients whole until the last micro-batch (ZeRO-1's memory);
    ZeRO-3 gathers its weights for every micro-batch's forward and backward, or once."""
    m, c = MODELS["llama3-8b"], Cluster.measured(1e-5, 1e-9, 1e12, 1 << 40)
    batch = 128 * 8  # 8 ranks of DP, micro-batch 1: 128 micro-batches each

    def dp(**kw):
        p = plan(m, c, 8, Layout(recompute="selective", **kw), batch)
        assert p.micro_batches == 128
        return p

    psi, link = m.params, Model(1e-5, 1e-9)
    scatter = link.predict("ring", 8, 4 * psi) / 2  # fp32 gradients: 4 bytes each
    gather = link.predict("ring", 8, 2 * psi) / 2  # bf16 weights
    z1, every, last = dp(zero=1), dp(zero=2), dp(zero=2, grad_sync="step")
    assert scatter + 2 * gather < dp(zero=2).time["compute"] / 128  # each hides in its window
    per_bucket = scatter / m.layers  # what a hidden one leaves exposed: its last bucket
    assert every.exposed["DP"] == pytest.approx(128 * per_bucket + gather / m.layers)
    assert last.exposed["DP"] == pytest.approx(per_bucket + gather / m.layers)
    assert last.exposed["DP"] == pytest.approx(z1.exposed["DP"])
    assert every.memory["gradients"] == pytest.approx(4 * psi / 8)
    assert last.memory["gradients"] == z1.memory["gradients"] == pytest.approx(4 * psi)
    assert last.memory_total == pytest.approx(z1.memory_total)
    # ZeRO-3: 2 gathers every micro-batch, or the weights kept whole from the first
    regather, kept = dp(zero=3), dp(zero=3, keep_weights=True)
    assert regather.memory["parameters"] == pytest.approx(2 * psi / 8)
    assert kept.memory["parameters"] == pytest.approx(2 * psi)
    assert regather.exposed["DP"] - every.exposed["DP"] == pytest.approx(
        128 * 2 * gather / m.layers - gather / m.layers)
    assert kept.exposed["DP"] == pytest.approx(every.exposed["DP"])
    # a search never lists ZeRO-2 accumulating unsharded: it is ZeRO-1's plan
    found = search(m, GPUS["h100"], 8, 64)
    assert not any(p.layout.zero == 2 and p.layout.grad_sync == "step" for p in found.plans)
    assert found.rejected["the same plan as a lower ZeRO stage"] > 0


def test_the_categories_and_state_arithmetic_are_the_memory_ledgers() -> None:
    """Chapter 9's ledger and its `playbook` (what the measured ledger matched within
    0.25 %) and the planner agree on every ZeRO stage, mixed precision or fp32."""
    try:
        from ddplab import sharding
    except ImportError:
        pytest.skip("ddplab.sharding (chapter 9's ledger) is not in this checkout")
    assert planner.CATEGORIES == sharding.CATEGORIES
    m = Transformer("tiny", 2, 64, 4, 4, 256, 96, 32, gated=False)
    laptop = Cluster.measured(1e-5, 1e-9, 1e10, 1 << 33)
    psi = m.params
    for fp32 in (False, True):
        for stage in range(4):
            # chapter 9's ledger is ZeRO's paper's: bf16 gradients (16 bytes a parameter)
            p = plan(m, laptop, 4, Layout(zero=stage, fp32=fp32, grad_dtype="bf16"), 8)
            want = sharding.playbook(psi, stage, 4, mixed_precision=not fp32).as_dict()
            for key in planner.CATEGORIES[:3]:
                assert p.memory[key] == pytest.approx(want[key], abs=1), (fp32, stage, key)


@pytest.mark.parametrize(("gpus", "layout", "reason"), [
    (8, Layout(tp=3), "heads 64 not divisible by TP 3"),
    (32, Layout(tp=16), "TP 16 exceeds the 8 GPUs of a node"),
    (32, Layout(tp=16), "KV heads 8 not divisible by TP 16"),
    (8, Layout(tp=3), "TP 3 × PP 1 × CP 1 = 3 does not divide 8 GPUs"),
    (24, Layout(tp=8), "batch 512 not divisible by DP 3 × micro-batch 1"),
    (64, Layout(tp=8, pp=2, zero=1, interleave=2, recompute="full"), None),  # 128 mbs
    (64, Layout(tp=8, pp=4, cp=3), "sequence 8192 not divisible by 2 × CP 3"),
    (8, Layout(tp=8, pp=1), "needs"),
    (64, Layout(tp=8, pp=2, schedule="gpipe", interleave=2), "interleaved stages need"),
])
def test_infeasible_layouts_say_why(gpus: int, layout: Layout, reason: str | None) -> None:
    p = plan(MODELS["llama3-70b"], GPUS["h100"], gpus, layout, 512)
    if reason is None:
        assert p.feasible, p.reasons
    else:
        assert any(r.startswith(reason) for r in p.reasons), p.reasons
        assert not p.feasible


def test_step_time_parts_by_hand_on_a_measured_cluster() -> None:
    """Two ranks of DP on a 'laptop': compute is FLOPs / measured FLOP/s; the gradient
    all-reduce is costmodel's ring prediction, overlapped with the backward but for its
    last bucket (one layer's share)."""
    m = Transformer("tiny", 2, 64, 4, 4, 256, 100, 32, gated=False)
    laptop = Cluster.measured(alpha=50e-6, beta=1e-9, flops=20e9, memory=8 * GiB)
    p = plan(m, laptop, 2, Layout(fp32=True), 8)
    compute = 8 * 32 * m.flops_per_token() / 2 / 20e9
    assert p.time["compute"] == pytest.approx(compute)
    psi = m.params
    ring = Model(50e-6, 1e-9).predict("ring", 2, 4 * psi)
    window = compute / p.micro_batches * 2 / 3
    assert p.exposed["DP"] == pytest.approx(max(ring - window, ring / m.layers))
    assert p.time["bubble"] == 0 and p.exposed["TP"] == 0
    assert p.memory["parameters"] == 4 * psi and p.memory["optimizer"] == 8 * psi
    assert p.tokens_per_s == pytest.approx(8 * 32 / p.step)


def test_the_bubble_is_p_minus_1_over_v_m() -> None:
    m, c = MODELS["llama3-70b"], GPUS["h100"]
    for v in (1, 2):
        p = plan(m, c, 64, Layout(tp=8, pp=4, zero=1, recompute="full", interleave=v), 256)
        work = p.time["compute"] + p.exposed["TP"] + p.exposed["CP"]
        assert p.time["bubble"] == pytest.approx(3 / (v * p.micro_batches) * work)


def test_search_ranks_feasible_layouts_by_throughput() -> None:
    found = search(MODELS["llama3-70b"], GPUS["h100"], 64, 512)
    speeds = [p.tokens_per_s for p in found.plans]
    assert speeds == sorted(speeds, reverse=True) and len(speeds) > 100
    assert all(p.feasible for p in found.plans)
    assert found.tried == len(found.plans) + sum(found.rejected.values())
    assert found.rejected["out of memory"] > 0
    pick = found.recommended
    assert pick.tokens_per_s >= 0.98 * speeds[0]
    assert pick.memory_total == min(p.memory_total for p in found.plans
                                    if p.tokens_per_s >= 0.98 * speeds[0])
    # the answer the chapter ends with: TP inside a node, and a sane MFU
    assert pick.layout.tp <= 8 and 0.35 < pick.mfu < 0.6
    assert "recommended" in found.table()
    # more GPUs of the same kind never make the best layout slower
    bigger = search(MODELS["llama3-70b"], GPUS["h100"], 128, 512)
    assert bigger.plans[0].tokens_per_s > speeds[0]


def test_nothing_fits_is_said() -> None:
    found = search(MODELS["llama3-405b"], GPUS["a100-40gb"], 8, 64)
    assert found.plans == [] and found.recommended is None
    assert found.table().startswith("no feasible layout among")


def test_published_runs_within_15_percent() -> None:
    """benchmarks/RESULTS.md's table: every run within 15 % of its published per-GPU
    throughput, Megatron-LM's with the interleaving its paper used (section 5.1), and the
    presets hold the figures fitted: the H100's and H200's on the H200's own steps, the
    A100's on Megatron-LM's runs."""
    from ddplab.planning import steps

    published = _published()
    assert [row[0] for row in published.rows() if row[5] != "✓"] == []
    assert all(r.layout.interleave > 1 for r in published.MEGATRON if r.layout.pp > 1)
    assert {r.layout.interleave for r in published.MEGATRON} == {1, 2, 3}  # 15 and 3 a stage
    for gpu, (efficiency, overhead) in (("h200", steps.fitted()), ("h100", steps.fitted()),
                                        ("a100-80gb", published.fitted(published.MEGATRON))):
        assert GPUS[gpu].efficiency == pytest.approx(efficiency, abs=0.001), gpu
        assert GPUS[gpu].overhead == pytest.approx(overhead, abs=1e-5), gpu


def test_held_out_the_efficiency_still_predicts() -> None:
    """Held out, every run within 15 %: Llama 3's H100 runs with the H200's figures (no
    Llama 3 row set them), each Megatron-LM run with figures fitted on the other nine,
    and each paper with the other source's figures."""
    published = _published()
    for rows in (published.held_out(), published.crossed()):
        assert len(rows) == 13
        ratios = {run.source: got / run.tflops for run, _, got in rows}
        assert all(abs(r - 1) <= published.TOLERANCE for r in ratios.values()), ratios


def test_the_h200_steps_are_predicted() -> None:
    """The H200's measured steps: eager ones fitted within 5 %, the others (every block
    checkpointed, compiled blocks) predicted within 10 %; bytes saved per layer within 1 %
    with the kernels' factors (eager 1.27, compiled 1.06, full recomputation 1.00)."""
    from ddplab.planning import steps

    assert len(steps.STEPS) == 8
    for s in steps.STEPS:
        ratio = s.predict(GPUS["h200"]).step / s.seconds
        assert abs(ratio - 1) <= (0.05 if s.mode == "eager" else 0.10), (s.model.name, s.mode,
                                                                        ratio)
        assert s.saved_per_layer / s.saved_predicted() == pytest.approx(1, abs=0.01)
    # efficiency follows width: a step's MFU, predicted, at hidden 2,048 and 8,192
    eager = {s.model.hidden: s.predict(GPUS["h200"]) for s in steps.STEPS[:6]
             if s.mode == "eager"}
    assert eager[2048].mfu < 0.9 * eager[8192].mfu


def test_every_pipeline_depth_is_searched() -> None:
    """A pipeline of 12 or 35 stages is tried (not powers of two only), and interleaving
    as far as the layers split evenly."""
    from ddplab.planning.predict import layouts

    gpt = _gpt(layers=105, hidden=20480, heads=128)
    tried = layouts(gpt, GPUS["a100-80gb"], 8 * 35 * 9, framework="megatron-2021")
    assert {lay.pp for lay in tried} >= {35, 5, 7, 15, 21, 105}
    assert {lay.interleave for lay in tried if lay.pp == 35} == {1, 3}
    llama = MODELS["llama3-70b"]
    tried = layouts(llama, GPUS["h100"], 96)
    assert 12 in {lay.pp for lay in tried}
    assert {lay.interleave for lay in tried if lay.pp == 8} == {1, 2, 5, 10}


def test_frameworks_limit_what_search_tries() -> None:
    """Megatron-LM 2021 had no sequence parallelism, no selective recomputation, no ZeRO
    and no CP; DeepSpeed's pipeline takes ZeRO-1 at most; torchtitan's pipeline keeps
    gradients unsharded, and without one it syncs every micro-batch. `plan` says why a
    framework cannot run a layout."""
    from ddplab.planner import FRAMEWORKS
    from ddplab.planning.predict import layouts

    m, c = MODELS["llama3-70b"], GPUS["h100"]
    old = layouts(m, c, 64, framework="megatron-2021")
    assert {lay.sp for lay in old if lay.tp > 1} == {False}
    assert {lay.recompute for lay in old} == {"none", "full"}
    assert {lay.zero for lay in old} == {0} and {lay.cp for lay in old} == {1}
    ds = layouts(m, c, 64, framework="deepspeed")
    assert max(lay.zero for lay in ds if lay.pp > 1) == 1 and {lay.interleave for lay in ds} == {1}
    titan = layouts(m, c, 64, framework="torchtitan")
    piped = [lay for lay in titan if lay.pp > 1 and lay.zero == 3]
    assert all(lay.grad_sync == "step" for lay in piped)
    # weights kept up to 3 virtual stages a GPU (torch's interleaved runtime keeps 3)
    assert all(lay.keep_weights == (lay.interleave <= 3) for lay in piped)
    # without a pipeline its loop never turns FSDP's sync off: every micro-batch, regathered
    flat = [lay for lay in titan if lay.pp == 1 and lay.zero == 3]
    assert flat and {(lay.grad_sync, lay.keep_weights) for lay in flat} == {("micro-batch", False)}
    assert {lay.recompute for lay in titan} == {"selective", "full"}
    assert {lay.kernels for lay in titan} == {"eager"} and all(lay.fp32_shards for lay in titan)
    p = plan(m, c, 64, Layout(tp=8, pp=2, zero=2, recompute="selective"), 512,
             FRAMEWORKS["megatron-2021"])
    assert p.reasons[:3] == ["Megatron-LM 2021 has no ZeRO-2 (it has 0)",
                             "Megatron-LM 2021 has no sequence parallelism",
                             "Megatron-LM 2021 has no selective recomputation"]


def test_search_finds_the_published_layouts_of_megatron_lm_s_largest_models() -> None:
    """Restricted to the paper's software (Megatron-LM 2021: no SP, no ZeRO, no selective
    recomputation), search ranks the published TP × PP of the 529.6B and 1T models among
    its top 5: a pipeline of 35 and of 64 stages, which powers of two alone never found."""
    published = _published()
    for run in published.MEGATRON[-2:]:
        found = search(run.model, GPUS[run.gpu], run.gpus, run.batch, framework=run.framework)
        top = [(p.layout.tp, p.layout.pp) for p in found.plans[:5]]
        assert (run.layout.tp, run.layout.pp) in top, (run.source, top)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddplab", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_plans_tp_without_sequence_parallelism() -> None:
    with_sp = json.loads(_cli("--model", "llama3-8b", "--tp", "4", "--json").stdout)
    without = json.loads(_cli("--model", "llama3-8b", "--tp", "4", "--no-sp", "--json").stdout)
    assert without["layout"]["sp"] is False and with_sp["layout"]["sp"] is True
    assert without["memory_bytes"]["activations"] > with_sp["memory_bytes"]["activations"]
    assert without["memory_bytes"]["parameters"] == with_sp["memory_bytes"]["parameters"]


def test_cli_json_round_trip() -> None:
    args = ["--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "2",
            "--zero", "1", "--recompute", "selective", "--tokens", str(1 << 22)]
    done = _cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    want = plan(MODELS["llama3-70b"], GPUS["h100"], 64,
                Layout(tp=8, pp=2, zero=1, recompute="selective"), 512).as_dict()
    assert got == json.loads(json.dumps(want))
    assert set(planner.CATEGORIES) <= set(got["memory_bytes"])
    table = _cli(*args)
    assert table.returncode == 0 and "tokens/s" in table.stdout and "MFU" in table.stdout
    found = json.loads(_cli("--model", "llama3-70b", "--gpus", "64", "--search", "--json",
                            "--top", "3").stdout)
    assert found["feasible"] > 0 and len(found["plans"]) >= 3


def test_cli_infeasible_exits_1_and_bad_input_exits_2() -> None:
    done = _cli("--model", "llama3-70b", "--tp", "3")
    assert done.returncode == 1 and "heads 64 not divisible by TP 3" in done.stdout
    for args, words in ((["--gpu", "b300"], "h100"), (["--model", "llama9"], "llama3-8b"),
                        (["--tokens", "100"], "less than one 8,192-token sequence"),
                        (["--zero", "4"], "invalid choice"),
                        (["--efficiency", "1.5"], "efficiency 1.5")):
        done = _cli(*args)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)


@pytest.mark.parametrize(("args", "line"), [
    (["--batch", "0"], "--batch 0: must be a positive integer"),
    (["--gpus", "-8"], "--gpus -8: must be a positive integer"),
    (["--micro-batch", "0"], "--micro-batch 0: must be a positive integer"),
    (["--hidden", "0"], "--hidden 0: must be a positive integer"),
    (["--interleave", "4"], "--interleave 4: virtual stages need a pipeline; give --pp"),
    (["--inter-bw", "0"], "--inter-bw 0: must be positive"),
    (["--intra-latency", "-1"], "--intra-latency -1: must be at least 0"),
    (["--efficiency", "0"], "--efficiency 0: must be in (0, 1]"),
])
def test_cli_bad_values_name_their_flag_in_one_line(args: list[str], line: str) -> None:
    done = _cli(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and line in done.stderr, done.stderr


def test_cli_says_what_an_override_kept_and_flags_an_absurd_step() -> None:
    done = _cli("--hidden", "2048", "--json")
    assert done.returncode in (0, 1)  # planned, whether or not it fits
    assert json.loads(done.stdout)["model"]["name"] == "Llama 3 8B with hidden 2,048"
    assert "keeps the preset's layers 32, heads 32, kv heads 8, ffn 14,336" in done.stderr
    huge = _cli("--batch", str(10**12), "--zero", "3")
    assert "one step takes" in huge.stderr and "years" in huge.stderr and "--batch" in huge.stderr
    fast = _cli("--inter-bw", "12.5", "--inter-latency", "20", "--gpus", "16", "--json")
    cluster = json.loads(fast.stdout)["cluster"]
    assert cluster["inter"]["beta"] == pytest.approx(1 / 12.5e9)
    assert cluster["inter"]["alpha"] == pytest.approx(20e-6)
    assert cluster["intra"] == json.loads(json.dumps(dataclasses.asdict(GPUS["h100"].intra)))


def test_bad_values_raise_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="heads must divide hidden"):
        Transformer("x", 2, 100, 3, 3, 400, 10, 16)
    with pytest.raises(ValueError, match="ZeRO stage 4: choose 0, 1, 2 or 3"):
        Layout(zero=4)
    with pytest.raises(ValueError, match="recompute 'some': choose one of none, selective"):
        Layout(recompute="some")
    with pytest.raises(ValueError, match="unknown GPU 'v100': choose one of h100"):
        planner.resolve("v100", GPUS, "GPU")
    with pytest.raises(ValueError, match="flops and memory must be positive"):
        Cluster.measured(1e-5, 1e-9, 0, 1)
    with pytest.raises(ValueError, match="gpus 0"):
        plan(MODELS["llama3-8b"], GPUS["h100"], 0, Layout(), 8)


def test_presets_cite_their_sources_and_fit_their_datasheets() -> None:
    assert all(m.source for m in MODELS.values()) and all(g.source for g in GPUS.values())
    assert GPUS["h100"].flops == 989e12 and GPUS["a100-80gb"].flops == 312e12
    assert GPUS["a100-40gb"].memory == 40 * GiB and GPUS["h200"].memory == 141 * GiB
    assert math.isclose(GPUS["h100"].intra.bandwidth, 450e9)


def test_planning_imports_no_torch() -> None:
    # ddplab/planner.py is the interface the issue names: a module, not a package.
    assert (ROOT / "ddplab" / "planner.py").is_file()
    code = ("import sys, ddplab.planner, ddplab.planning.published, ddplab.cli; "
            "ddplab.cli.main(['plan', '--json']) ; print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip().endswith("False"), done.stderr


def test_what_if_keeps_the_preset() -> None:
    half = GPUS["h100"].efficiency / 2
    slower = planner.with_efficiency(GPUS["h100"], half)
    assert slower.efficiency == half and GPUS["h100"].efficiency == 2 * half
    a = plan(MODELS["llama3-8b"], GPUS["h100"], 8, Layout(zero=3, recompute="full"), 64)
    b = plan(MODELS["llama3-8b"], slower, 8, Layout(zero=3, recompute="full"), 64)
    # the FLOPs' share doubles; the overhead a layer (launches) does not
    overhead = GPUS["h100"].overhead * 32 * a.micro_batches * 4 / 3
    assert b.time["compute"] - overhead == pytest.approx(2 * (a.time["compute"] - overhead),
                                                         rel=1e-9)
    assert dataclasses.asdict(a.layout) == dataclasses.asdict(b.layout)


def test_pipeline_stages_are_whole_layers() -> None:
    """A split that can be built: 80 layers on 16 stages leave the last stage 5 layers and
    the logit layer, or some stage 6 (no fractions of a layer); Llama 3 405B's 126 layers
    on 16 stages take layers off the last; compute and memory use the same split."""
    from ddplab.planning.predict import stages
    assert stages(80, 16, 1.0, 1.2) == [5] * 10 + [6] * 5 + [0]
    assert stages(80, 16, 1.0, 0.2) == [5] * 16
    assert stages(80, 16, 1.0, 1.2, balanced=False) == [5] * 16
    assert stages(7, 2, 1.0, 0.5, balanced=False) == [4, 3]
    assert sum(stages(126, 16, 1.0, 1.0)) == 126 and stages(3, 1, 1.0, 1.0) == [3]
    p = plan(MODELS["llama3-70b"], GPUS["h100"], 64,
             Layout(tp=2, pp=16, cp=2, zero=2, recompute="selective"), 512)
    assert sum(p.stages) == 80 and max(p.stages) in (5, 6)
    whole = plan(MODELS["llama3-70b"], GPUS["h100"], 64,
                 Layout(tp=2, pp=16, cp=2, zero=2, recompute="selective", balanced=False), 512)
    assert p.time["compute"] <= whole.time["compute"]
