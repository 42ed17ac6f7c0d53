"""Fusion pass: matched regions, same loss and gradients, plans and lowering of fused graphs,
and the numerics of every sharding strategy of the fused ops (forward and backward).

Triton kernels run in the interpreter here (conftest sets TRITON_INTERPRET=1 before triton
is imported). Strategy numerics: inputs become DTensors with the strategy's input specs on
a (2, 2) mesh simulated by ``LocalTensorMode``; DTensor must put each output where the
strategy says and the values must match the unsharded op; then backward through DTensor
(the ``*_backward`` ops' registered strategies) must give the unsharded gradients, the
row-sharded ones sharded like their inputs, the weight/bias ones Partial on the axes that
shard rows.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

import autopar
from autopar import kernels
from autopar._compat import FakeStore, LocalTensorMode
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.passes import fusion
from autopar.passes.fusion import fuse_regions
from autopar.passes.lower import lower_plan
from autopar.passes.strategies import node_strategies
from autopar.passes.strategies.rules.fused import ELEMENTWISE, ROLES, ROW
from autopar.plan import FusedRegion, Plan, parse_spec
from autopar.runtime.shards import local_chunk
from autopar.search.intra_op import search_plan
from autopar.search.pins import SearchOptions
from samples import get_sample

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Triton kernels unavailable")

aten = torch.ops.aten
MESH = (2, 2)
ATOL, RTOL = 1e-5, 1e-4


class Case:
    """A tiny sample: its model and batch, the captured graph and a fused capture."""

    def __init__(self, name: str) -> None:
        sample = get_sample(name)
        torch.manual_seed(0)
        self.model = sample.build("tiny")
        self.batch = sample.example_batch(self.model, 4)
        self.plain = capture(self.model, self.batch)
        self.fused = capture(self.model, self.batch)
        self.regions = fuse_regions(self.fused)

    def inputs(self, captured: Captured) -> list[torch.Tensor]:
        state = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        user = dict(zip(captured.user_inputs, self.batch, strict=True))
        out = []
        for ph in captured.placeholders():
            fqn = captured.params.get(ph.name) or captured.buffers.get(ph.name)
            if fqn is not None:
                out.append(state[fqn])
            else:
                out.append(captured.constants.get(ph.name, user.get(ph.name)))
        return out

    def kinds(self) -> collections.Counter[str]:
        return collections.Counter(r.kernel for r in self.regions)

    def node(self, region: FusedRegion) -> fx.Node:
        return next(n for n in self.fused.gm.graph.nodes if n.name == region.node)


@pytest.fixture(scope="module")
def gpt() -> Case:
    return Case("gpt")


@pytest.fixture(scope="module")
def llama() -> Case:
    return Case("llama")


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield init_device_mesh("cpu", MESH)
    dist.destroy_process_group()


# ---------------------------------------------------------------- (a) what is fused


def test_gpt_regions(gpt: Case) -> None:
    # residual add + LayerNorm: ln_2 of each block, ln_1 of block 1 and the final norm
    # (whose sum is read nowhere else). The first add (token + position embedding)
    # broadcasts. bias + GELU: each block's MLP up-projection.
    assert gpt.kinds() == {"add_layer_norm": 4, "bias_gelu": 2, "linear_cross_entropy": 1}
    targets = collections.Counter(str(n.target) for n in gpt.fused.gm.graph.nodes)
    assert targets["autopar.add_layer_norm.default"] == 4
    assert targets["aten.native_layer_norm.default"] == 5 - 4
    norms = [r for r in gpt.regions if r.kernel == "add_layer_norm"]
    for r in norms:
        assert [n.split("_")[0] for n in r.replaced] == ["add", "native", "getitem"], r
        node = gpt.node(r)
        y, s = node.meta["val"]
        assert y.shape == s.shape == (4, 16, 32)
    assert [gpt.fused.layer_of(gpt.node(r)) for r in norms] == ["h.0", "h.1", "h.1", None]
    # the final norm's sum has no reader: the fused node's output 1 gets no getitem
    assert [u.args[1] for u in gpt.node(norms[-1]).users] == [0]
    assert all(len(gpt.node(r).users) == 2 for r in norms[:-1])
    layers = {gpt.fused.layer_of(n) for n in gpt.fused.gm.graph.nodes} - {None}
    assert layers == {"h.0", "h.1"}
    assert gpt.fused.fingerprint != gpt.plain.fingerprint


def test_gpt_bias_gelu(gpt: Case) -> None:
    """``gelu(view(addmm(b, x, w)))`` -> ``bias_gelu(view(mm(x, w)), b, "tanh")``."""
    regions = [r for r in gpt.regions if r.kernel == "bias_gelu"]
    assert [r.replaced for r in regions] == [("addmm_2", "gelu"), ("addmm_6", "gelu_1")]
    for r, layer in zip(regions, ("h.0", "h.1"), strict=True):
        node = gpt.node(r)
        view, bias, approximate = node.args
        assert approximate == "tanh" and bias.name == f"p_h_{layer[-1]}_mlp_c_fc_bias"
        assert view.target is aten.view.default and view.args[0].target is aten.mm.default
        assert node.meta["val"].shape == (4, 16, 128) and gpt.fused.layer_of(node) == layer
    targets = collections.Counter(str(n.target) for n in gpt.fused.gm.graph.nodes)
    assert targets["aten.gelu.default"] == 0 and targets["aten.addmm.default"] == 8 - 2


class _MLP(torch.nn.Module):
    def __init__(self, approximate: str, reuse: bool = False) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(12, 20)
        self.act = torch.nn.GELU(approximate=approximate)
        self.reuse = reuse  # the pre-activation read elsewhere too: no fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (self.act(h) + h if self.reuse else self.act(h)).square().mean()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_pattern(approximate: str) -> None:
    """2-D input (no view), both approximations; same loss and gradients as unfused."""
    torch.manual_seed(0)
    model, x = _MLP(approximate), torch.randn(6, 12)
    fused = capture(model, (x,))
    (region,) = fuse_regions(fused)
    node = next(n for n in fused.gm.graph.nodes if n.name == region.node)
    assert region.kernel == "bias_gelu" and node.args[2] == approximate
    assert node.args[0].target is aten.mm.default
    inputs = [
        dict(model.named_parameters()).get(fused.params.get(ph.name), x)
        for ph in fused.placeholders()
    ]
    loss = _Run(fused.gm).run(*inputs)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    torch.testing.assert_close(loss, model(x), atol=1e-6, rtol=0)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(model(x), list(model.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=RTOL)
    reused = capture(_MLP(approximate, reuse=True), (x,))
    assert fuse_regions(reused) == []


class _Head(torch.nn.Module):
    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.proj, self.head = torch.nn.Linear(12, 12), torch.nn.Linear(12, 37, bias=False)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.proj(x)))
        return F.cross_entropy(logits.view(-1, 37), t.view(-1), reduction=self.reduction)


def test_linear_cross_entropy_pattern() -> None:
    """Head matmul + log_softmax + nll_loss (mean, ignored rows) -> the kernel's sum divided
    by the count of counted rows: same loss and gradients; "sum" reduction is left alone."""
    torch.manual_seed(0)
    model, x = _Head(), torch.randn(3, 5, 12)
    t = torch.randint(0, 37, (3, 5))
    t[0, :3] = -100
    fused = capture(model, (x, t))
    (region,) = fuse_regions(fused)
    assert region.kernel == "linear_cross_entropy"
    assert [n.rstrip("_0123456789") for n in region.replaced][:2] == ["permute", "mm"]
    targets = [str(n.target) for n in fused.gm.graph.nodes if n.op == "call_function"]
    assert targets[-4:] == [
        "<built-in function getitem>",
        *(f"aten.{o}" for o in ("ne.Scalar", "sum.default", "div.Tensor")),
    ]
    state, user = dict(model.named_parameters()), dict(zip(fused.user_inputs, (x, t), strict=True))
    inputs = [
        state[fused.params[ph.name]] if ph.name in fused.params else user[ph.name]
        for ph in fused.placeholders()
    ]
    loss = _Run(fused.gm).run(*inputs)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    torch.testing.assert_close(loss, model(x, t), atol=1e-6, rtol=0)
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(model(x, t), list(model.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=RTOL)
    assert fuse_regions(capture(_Head("sum"), (x, t))) == []


def test_llama_regions(llama: Case) -> None:
    # the final norm too; the head and the loss
    assert llama.kinds() == {"swiglu": 2, "add_rms_norm": 4, "linear_cross_entropy": 1}
    targets = collections.Counter(str(n.target) for n in llama.fused.gm.graph.nodes)
    assert targets["aten.sigmoid.default"] == 0 and targets["aten.rsqrt.default"] == 5 - 4
    rms = next(r for r in llama.regions if r.kernel == "add_rms_norm")
    ops = [n.rstrip("_0123456789") for n in rms.replaced]
    assert ops == ["add", "pow", "mean", "add", "rsqrt", "mul", "mul"]
    swiglu = next(r for r in llama.regions if r.kernel == "swiglu")
    assert [n.rstrip("_0123456789") for n in swiglu.replaced] == ["sigmoid", "mul", "mul"]
    assert llama.node(swiglu).meta["val"].shape == (4, 16, 64)
    layers = [llama.fused.layer_of(llama.node(r)) for r in llama.regions]
    assert set(layers) == {"layers.0", "layers.1", None} and layers.count(None) == 2


def test_none_and_unavailable(
    gpt: Case, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    captured = capture(gpt.model, gpt.batch)
    before = captured.fingerprint
    assert fuse_regions(captured, kernels="none") == []
    monkeypatch.setattr(fusion, "_kernels_available", lambda: False)
    monkeypatch.setattr(fusion, "_warned_unavailable", False)
    with caplog.at_level(logging.WARNING, logger=fusion.__name__):
        assert fuse_regions(captured) == [] and fuse_regions(captured) == []
    assert [r.message for r in caplog.records if r.name == fusion.__name__] == [
        "Triton kernels unavailable (no GPU, TRITON_INTERPRET unset): leaving the graph unfused"
    ]
    assert captured.fingerprint == before
    with pytest.raises(ValueError, match="kernels="):
        fuse_regions(captured, kernels="cuda")
    r = gpt.regions[0]
    assert FusedRegion.from_dict(asdict(r)) == r


def test_plan_records_the_mode_and_the_regions(gpt: Case, tmp_path) -> None:
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    plan = autopar.plan(gpt.model, gpt.batch, cluster=cluster, strategy="dp", fusion="triton")
    assert plan.fusion == "triton" and plan.fused_regions == tuple(gpt.regions)
    assert plan.graph_fingerprint == gpt.fused.fingerprint
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan


# ---------------------------------------------------------------- (b) same numbers


class _Run(fx.Interpreter):
    """Runs a captured graph eagerly: capture drops layout clones, so a view may need a
    contiguous input (lowering does the same per shard)."""

    def call_function(self, target, args, kwargs):
        if target is aten.view.default:
            args = (args[0].contiguous(), *args[1:])
        return super().call_function(target, args, kwargs)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_same_loss_and_grads(name: str, request: pytest.FixtureRequest) -> None:
    case: Case = request.getfixturevalue(name)
    params = list(case.model.parameters())
    losses, grads = [], []
    for captured in (case.plain, case.fused):
        out = _Run(captured.gm).run(*case.inputs(captured))
        loss = out[0] if isinstance(out, (tuple, list)) else out
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, params))
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=0)
    for g_fused, g_plain in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g_fused, g_plain, atol=1e-5, rtol=RTOL)


# ---------------------------------------------------------------- (c) plans and lowering


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_plan_and_lower_fused_graph(
    name: str, mesh: DeviceMesh, request: pytest.FixtureRequest
) -> None:
    case: Case = request.getfixturevalue(name)
    cluster = Cluster.preset("cpu", mesh=MESH, axis_names=("dp", "tp"))
    plan = search_plan(case.fused, cluster, mesh, SearchOptions(strategy=("dp", "tp")))
    by_name = {n.name: n for n in plan.nodes}
    for r in case.regions:
        node = by_name[r.node]
        assert node.op == f"autopar.{r.kernel}.default"
        assert not any(n in by_name for n in r.replaced)
        if r.kernel == "linear_cross_entropy":  # rows on dp, hidden and weight R on tp
            assert node.inputs == ("S(0),R", "R,R", "S(0),R") and node.outputs[:2] == (
                "P,R",  # the summed loss; divided by the global count of counted rows
                "S(0),R",
            )
            continue
        assert node.outputs[0].startswith("S(0),"), node  # dp: rows sharded on axis 0
        if r.kernel == "bias_gelu":  # Megatron: column-parallel up-projection, bias split
            assert node.inputs == ("S(0),S(2)", "R,S(0)") and node.outputs == ("S(0),S(2)",)
    # lowering: one fused node per region in forward and one in backward
    tensors = {t.name: t for t in plan.tensors}
    names = [p.name for p in case.fused.placeholders()]
    state = dict(zip(names, case.inputs(case.fused), strict=True))
    example = {}
    for ph in case.fused.placeholders():
        local = local_chunk(state[ph.name].detach(), parse_spec(tensors[ph.name].spec), mesh)
        example[ph.name] = local.requires_grad_(ph.name in case.fused.params)
    step = lower_plan(case.fused, plan, mesh, example)
    traced = collections.Counter(str(n.target) for n in step.gm.graph.nodes)
    for kernel, count in case.kinds().items():
        assert traced[f"autopar.{kernel}.default"] == count
        # linear + cross-entropy computes its gradients in forward: no backward op
        backward = 0 if kernel == "linear_cross_entropy" else count
        assert traced[f"autopar.{kernel}_backward.default"] == backward
    # the final norm's unread sum: its backward gets ds=None, not materialized zeros
    norm_bwd = [n for n in step.gm.graph.nodes if str(n.target).endswith("norm_backward.default")]
    assert [n.args[1] is None for n in norm_bwd].count(True) == 1
    # reduced out of place, or in place where nothing else reads the value (passes.in_place)
    assert (
        traced["_c10d_functional.all_reduce.default"]
        + traced["_c10d_functional.all_reduce_.default"]
        > 0
    )


# ---------------------------------------------------------------- (d) strategy numerics


def _dtensor(t: torch.Tensor, spec: tuple, mesh: DeviceMesh) -> DTensor:
    return distribute_tensor(t.detach(), mesh, list(spec)).requires_grad_()


def _check_strategy(node: fx.Node, strategy, mesh: DeviceMesh) -> None:
    gen = torch.Generator().manual_seed(0)
    full = fx.node.map_arg(
        node.args, lambda n: torch.randn(n.meta["val"].shape, generator=gen).requires_grad_()
    )
    leaves = [a for a in full if isinstance(a, torch.Tensor)]
    outs = node.target(*full)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    cots = [torch.randn(o.shape, generator=gen) for o in outs]
    ref_grads = torch.autograd.grad(outs, leaves, cots)
    msg = f"{node.name} {strategy}"
    with LocalTensorMode(mesh.size()):
        dts = [_dtensor(t, spec, mesh) for t, spec in zip(leaves, strategy.inputs, strict=True)]
        it = iter(dts)
        args = [next(it) if isinstance(a, torch.Tensor) else a for a in full]
        douts = node.target(*args)
        douts = list(douts) if isinstance(douts, (tuple, list)) else [douts]
        for o, ref, claim in zip(douts, outs, strategy.outputs, strict=True):
            assert tuple(o.placements) == claim, msg
            torch.testing.assert_close(o.full_tensor(), ref.detach(), atol=ATOL, rtol=RTOL)
        dcots = [
            distribute_tensor(c, mesh, list(o.placements)) for c, o in zip(cots, douts, strict=True)
        ]
        grads = torch.autograd.grad(douts, dts, dcots)
        row, last = strategy.inputs[0], full[0].dim() - 1
        for g, ref, spec, role in zip(grads, ref_grads, strategy.inputs, _roles(node), strict=True):
            if role == ROW:  # x, residual / a, b: the gradient is sharded like the input
                assert tuple(g.placements) == spec, msg
            else:  # weight / bias: a sum over rows, split with the last dim
                want = tuple(_param_grad(p, last) for p in row)
                assert tuple(g.placements) == want, msg
            torch.testing.assert_close(g.full_tensor(), ref, atol=ATOL, rtol=RTOL)


def _roles(node: fx.Node) -> list[str]:
    """The role (ROW or PARAM) of each tensor argument of a fused node."""
    arg_roles = ROLES[node.target.__name__.split(".")[0]][0]
    return [r for r, a in zip(arg_roles, node.args, strict=False) if isinstance(a, fx.Node)]


def _param_grad(row: Placement, last: int) -> Placement:
    if row == Shard(last):
        return Shard(0)
    return Partial() if isinstance(row, Shard) else Replicate()


def _param_spec(row: Placement, last: int) -> Placement:
    return Shard(0) if row == Shard(last) else Replicate()


@pytest.mark.parametrize(
    ("name", "kernel"),
    [
        ("gpt", "add_layer_norm"),
        ("llama", "add_rms_norm"),
        ("llama", "swiglu"),
        ("gpt", "bias_gelu"),
    ],
)
def test_fused_strategies_numerically(
    name: str, kernel: str, mesh: DeviceMesh, request: pytest.FixtureRequest
) -> None:
    case: Case = request.getfixturevalue(name)
    node = case.node(next(r for r in case.regions if r.kernel == kernel))
    strategies = node_strategies(node, mesh, {})
    ndim = node.args[0].meta["val"].dim()
    dims = range(ndim) if kernel in ELEMENTWISE else range(ndim - 1)
    per_axis = [Replicate(), *(Shard(d) for d in dims)]
    assert {s.inputs[0] for s in strategies} == {(a, b) for a in per_axis for b in per_axis}
    for s in strategies:
        row = s.inputs[0]
        param = tuple(_param_spec(p, ndim - 1) for p in row)
        for spec, role in zip(s.inputs, _roles(node), strict=True):
            assert spec == (row if role == ROW else param), s
        assert all(spec == row for spec in s.outputs), s
        _check_strategy(node, s, mesh)


@pytest.mark.multiproc
def test_fused_models_train_like_single_device_under_tp_dp() -> None:
    """GPT and Llama with Triton kernels (interpreted on CPU) on 4 gloo ranks, dp x tp."""
    from autopar.testing.parity import (
        LR,
        ParityCase,
        ParityResult,
        Tolerance,
        check,
        run_parity,
    )

    # 2 steps: the second's gradients are at weights the first step moved (each step runs
    # every interpreted kernel, forward and backward, on every rank)
    steps = 2
    cases = [
        ParityCase(name, (2, 2), ("dp", "tp"), ("dp", "tp"), steps=steps, fusion="triton")
        for name in ("gpt", "llama")
    ]
    head = {"linear_cross_entropy": 1}  # rows on dp, hidden and weight gathered on tp
    fused = {
        "gpt": {"add_layer_norm": 4, "bias_gelu": 2, **head},
        "llama": {"add_rms_norm": 4, "swiglu": 2, **head},
    }

    def fused_as_expected(case: ParityCase, res: ParityResult) -> list[str]:
        if collections.Counter(res.fusion) != fused[case.sample]:  # final norms included
            return [f"{res.label}: fused {res.fusion}"]
        return []

    tol = Tolerance(loss=1e-5, grad=1e-4, param=LR * steps)
    check(cases, run_parity(cases), tol, fused_as_expected)
