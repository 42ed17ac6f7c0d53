"""Activation checkpointing and FSDP reshard-after-forward in the lowered program.

Single process (fake process group of 4 ranks): on a 2-block toy model planned as FSDP, the
pass re-emits recomputed chains in backward, the recomputed forward values have no backward
reader left, the program's outputs are bit-for-bit those without recompute, and the peak
bytes of live tensors measured with `track_memory` drop (none > selective > full; reshard
below none). Multi-process (gloo: 2 ranks for 1-D meshes, 4 for 2-D): GPT and Llama under dp, fsdp and tp
meshes, and pipelined (pp x dp fsdp, pp x tp: the stage programs AOTAutograd partitions),
train exactly as without recompute (same losses, gradient and parameter deviations
from the single-device reference, bit for bit) and within the parity tolerances.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar._compat import FakeStore
from autopar.capture import capture
from autopar.capture.recompute_policy import RANDOM, SAVED_BY_SELECTIVE, is_collective
from autopar.options import PlanOptions
from autopar.passes.comm import DEFAULT, OFF, UNPACK, CommOptions
from autopar.passes.recompute import RECOMPUTED, is_backward, layer_of
from autopar.plan import MemoryPlan
from autopar.rank_plans import plan_for_ranks
from autopar.runtime.memory_stats import track_memory
from autopar.runtime.parallel_model import ParallelModel
from autopar.testing.parity import LR, ParityCase, ParityResult, Tolerance, check, run_parity

LAYERS = ("blocks.0", "blocks.1")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.norm, self.drop = nn.LayerNorm(16), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x))) * 2.0))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.fixture(scope="module")
def toy() -> Iterator[tuple]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    torch.manual_seed(0)
    model, batch = _Toy(), (torch.randn(32, 16),)
    cluster = autopar.Cluster.local(mesh=(4,), axis_names=("dp",))
    plan, captured, mesh = plan_for_ranks(
        model, batch, cluster, None, PlanOptions(strategy="fsdp"), None
    )
    yield model, batch, plan, captured, mesh
    dist.destroy_process_group()


def _memory(policy: str | None = None, reshard: bool = False) -> MemoryPlan:
    recompute = tuple((layer, policy) for layer in LAYERS) if policy else ()
    return MemoryPlan(recompute=recompute, reshard_after_forward=LAYERS if reshard else ())


def _run(toy, memory: MemoryPlan, comm: CommOptions = DEFAULT):
    model, batch, plan, captured, mesh = toy
    # with `passes.comm` (fused per-layer gathers, scheduled) unless `comm` says otherwise
    pm = ParallelModel(model, captured, dataclasses.replace(plan, memory=memory), mesh, comm=comm)
    params = [pm.local_params[n].detach() for n in pm.program.param_names]
    inputs = [pm._local_input(n, t) for n, t in zip(captured.user_inputs, batch, strict=True)]
    torch.manual_seed(1)  # the dropout mask
    with track_memory({"parameters": params}) as tracker:
        outs = pm.program.gm(*params, *inputs)
    assert tracker.stats is not None
    return pm.program.gm, outs, tracker.stats.peak_bytes


def _forward_reads(gm) -> list[tuple]:
    """(forward node, its layer) for every forward value a backward node reads."""
    nodes = list(gm.graph.nodes)
    start = next(i for i, n in enumerate(nodes) if is_backward(n))
    forward = set(nodes[:start])
    return [
        (a, layer_of(a))
        for b in nodes[start:]
        if b.op == "call_function"
        for a in b.all_input_nodes
        if a in forward and a.op == "call_function"
    ]


def _kept(node, layer: str, policy: str) -> bool:
    """What backward may still read of a layer: its outputs (the next layer's inputs), random
    ops (the dropout mask) and, under selective, matmul and collective outputs."""
    src = node.args[0] if node.target is operator.getitem else node
    origin = src  # a fused gather's member: its copy out of the flat result
    while origin.op == "call_function" and origin.target in UNPACK and origin.all_input_nodes:
        origin = origin.args[0]
    if is_collective(origin.target):
        src = origin
    if src.target in RANDOM:
        return True
    if any(layer_of(u) != layer for u in node.users if not is_backward(u)):
        return True
    return policy == "selective" and (src.target in SAVED_BY_SELECTIVE or is_collective(src.target))


def test_recompute_rewrites_backward_and_frees_earlier(toy) -> None:
    base_gm, base_outs, _ = _run(toy, _memory())
    # the peaks compared with the collectives scheduled but not fused: the toy's fused
    # gradient bucket (every gradient held to the end of backward) is a peak all share
    unfused = CommOptions(bucket=False)
    base_peak = _run(toy, _memory(), unfused)[2]
    peaks = {}
    for policy in ("selective", "full"):
        gm, outs, _ = _run(toy, _memory(policy))
        peaks[policy] = _run(toy, _memory(policy), unfused)[2]
        for a, b in zip(base_outs, outs, strict=True):
            assert torch.equal(a, b), policy  # bit for bit: same ops on the same inputs
        nodes = list(gm.graph.nodes)
        start = next(i for i, n in enumerate(nodes) if is_backward(n))
        copies = [i for i, n in enumerate(nodes) if (n.meta.get("custom") or {}).get(RECOMPUTED)]
        assert copies and min(copies) >= start  # re-emitted in backward, not in forward
        assert any(nodes[i].target is torch.ops.aten.tanh.default for i in copies)
        for node, layer in _forward_reads(gm):
            if layer is not None:
                assert _kept(node, layer, policy), (policy, node.name)
        # the generated code drops recomputed forward values after their forward use
        assert "= None" in gm.code
    assert base_peak > peaks["selective"] > peaks["full"], (base_peak, peaks)
    _, reshard_outs, reshard_peak = _run(toy, _memory(reshard=True), unfused)
    assert all(torch.equal(a, b) for a, b in zip(base_outs, reshard_outs, strict=True))
    assert reshard_peak < base_peak
    print(f"toy fsdp peak bytes: none {base_peak} reshard {reshard_peak} {peaks}")


def test_reshard_regathers_weights_in_backward(toy) -> None:
    """reshard_after_forward alone: backward runs the weights' all-gathers again and reads
    no gathered weight kept from the forward."""
    # one collective per weight: the program as lowered (`passes.comm` fuses them per layer)
    base_gm, _, _ = _run(toy, _memory(), OFF)
    gm, _, _ = _run(toy, _memory(reshard=True), OFF)
    gathers = torch.ops._c10d_functional.all_gather_into_tensor.default

    def count(g) -> tuple[int, int]:
        nodes = [n for n in g.graph.nodes if n.target is gathers]
        return len(nodes), sum(is_backward(n) for n in nodes)

    (base_total, base_bw), (total, bw) = count(base_gm), count(gm)
    # per block, backward reads the up and down weights and the norm's weight and bias
    # (native_layer_norm_backward takes both): 8 gathers again; the linear biases' gathered
    # copies are not read by backward and die in the forward
    assert (base_bw, bw) == (0, 8) and total == base_total + bw
    for node, layer in _forward_reads(gm):
        assert layer is None or not is_collective(node.target), node.name


# ----------------------------------------------------------------- multi-process

STEPS = 3  # the parity tests' count: five of the six base runs are their cases, run once
# (recompute policy, reshard_after_forward), applied to every layer
FULL, SELECTIVE, SELECTIVE_RESHARD = ("full", False), ("selective", False), ("selective", True)
# (sample, config, mesh, axis names, strategy, schedule, memory levers checked against the
# same run without them); pipelines: the stage programs AOTAutograd partitions. Reshard
# alone is checked on one process (test_reshard_regathers_weights_in_backward)
RUNS = [
    ("gpt", "tiny", (2,), ("dp",), "fsdp", None, [SELECTIVE_RESHARD, FULL]),
    ("gpt", "tiny", (2,), ("tp",), "tp", None, [SELECTIVE]),
    ("llama", "tiny", (2,), ("dp",), "fsdp", None, [SELECTIVE_RESHARD]),
    ("llama", "tiny", (2,), ("tp",), "tp", None, [FULL]),
    ("gpt", "tiny4", (2, 2), ("pp", "dp"), "fsdp", "1f1b", [SELECTIVE_RESHARD]),
    ("llama", "tiny4", (2, 2), ("pp", "tp"), "tp", "gpipe", [FULL]),
]


def _layers(sample: str, config: str) -> tuple[str, ...]:
    from autopar.cli.sources import load_model

    model, batch = load_model(sample, config, 8)
    captured = capture(model, batch)
    return tuple(sorted({captured.layer_of(n) for n in captured.gm.graph.nodes} - {None}))


def _cases() -> tuple[list[ParityCase], list[int]]:
    """Every case, and per case the index of its run without memory levers."""
    cases, bases = [], []
    for sample, config, mesh, names, strategy, schedule, variants in RUNS:
        layers = _layers(sample, config)
        base = ParityCase(
            sample, mesh, names, strategy, config=config, steps=STEPS, schedule=schedule
        )
        base = dataclasses.replace(base, microbatches=4) if schedule else base
        first = len(cases)
        cases.append(base)
        for policy, reshard in variants:
            memory = MemoryPlan(
                recompute=tuple((layer, policy) for layer in layers) if policy else (),
                reshard_after_forward=layers if reshard else (),
            )
            cases.append(dataclasses.replace(base, memory=memory))
        bases += [first] * (len(cases) - first)
    return cases, bases


@pytest.mark.multiproc
def test_recompute_trains_bit_for_bit_like_without() -> None:
    cases, bases = _cases()
    results = run_parity(cases)
    base_of = {case: results[b] for case, b in zip(cases, bases, strict=True)}

    def like_base(case: ParityCase, res: ParityResult) -> list[str]:
        print(f"{res.label}: recomputed {res.recomputed} nodes")
        if case.memory is None:
            return []
        base = base_of[case]
        failures = [f"{res.label}: nothing recomputed"] if res.recomputed == 0 else []
        same = (res.losses, res.grad_abs_err, res.param_err)
        if same != (base.losses, base.grad_abs_err, base.param_err):
            failures.append(f"{res.label}: not bit for bit {same} vs {base.label}")
        return failures

    check(cases, results, Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS), like_base)
