"""`passes.in_place`: an all-reduce of a fresh tensor nothing else reads reduces it in its
own buffer (no clone); one of a view, a placeholder or a value read elsewhere stays out of
place; `out_of_place` undoes it for torch.compile. The values are the parity suites'
concern (every data-parallel bucket runs in place there)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.comm import DEFAULT, optimize_comm
from autopar.passes.in_place import out_of_place

_F = torch.ops._c10d_functional
aten = torch.ops.aten


def _program() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    fresh = graph.call_function(aten.mm.default, (x, w))
    viewed = graph.call_function(aten.view.default, (fresh, [16]))
    shared = graph.call_function(aten.mm.default, (w, x))
    reduces = {
        "fresh": graph.call_function(aten.add.Tensor, (x, w)),  # read by its all-reduce only
        "view": viewed,  # a view of `fresh` (which its reader `viewed` keeps alive)
        "placeholder": x,
        "shared": shared,  # also read by the output
    }
    out = {}
    for name, value in reduces.items():
        reduce = graph.call_function(_F.all_reduce.default, (value, "sum", "0"))
        out[name] = reduce
        reduces[name] = graph.call_function(_F.wait_tensor.default, (reduce,))
    graph.output((*reduces.values(), shared))
    for n in graph.nodes:
        if n.op != "output":
            n.meta["val"] = torch.zeros(16) if n in (viewed, out["view"]) else torch.zeros(4, 4)
    return fx.GraphModule(torch.nn.Module(), graph), out


def test_only_a_fresh_unshared_value_is_reduced_in_place() -> None:
    gm, reduces = _program()
    stats = optimize_comm(gm, DEFAULT)
    assert reduces["fresh"].target is _F.all_reduce_.default
    for name in ("view", "placeholder", "shared"):
        assert reduces[name].target is _F.all_reduce.default, name
    assert stats.collectives_after == stats.collectives_before == 4  # in place still counts


def test_out_of_place_undoes_it_for_torch_compile() -> None:
    gm, reduces = _program()
    optimize_comm(gm, DEFAULT)
    out_of_place(gm)
    assert all(r.target is _F.all_reduce.default for r in reduces.values())
    assert "all_reduce_.default" not in gm.code
