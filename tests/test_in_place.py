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
    base = graph.call_function(aten.mm.default, (x, w))
    viewed = graph.call_function(aten.view.default, (base, [16]))
    product = graph.call_function(aten.mm.default, (w, w))
    product_view = graph.call_function(aten.view.default, (product, [16]))
    shared = graph.call_function(aten.mm.default, (w, x))
    reduces = {
        "fresh": graph.call_function(aten.add.Tensor, (x, w)),  # read by its all-reduce only
        "fresh view": product_view,  # a view of a fresh value that alone reads it
        "view": viewed,  # a view of a value read elsewhere too (the output reads `base`)
        "placeholder": x,
        "shared": shared,  # also read by the output
    }
    out = {}
    for name, value in reduces.items():
        reduce = graph.call_function(_F.all_reduce.default, (value, "sum", "0"))
        out[name] = reduce
        reduces[name] = graph.call_function(_F.wait_tensor.default, (reduce,))
    graph.output((*reduces.values(), shared, base))
    for n in graph.nodes:
        if n.op != "output":
            flat = n in (viewed, product_view) or n in (out["view"], out["fresh view"])
            n.meta["val"] = torch.zeros(16) if flat else torch.zeros(4, 4)
    return fx.GraphModule(torch.nn.Module(), graph), out


def test_only_a_fresh_unshared_value_is_reduced_in_place() -> None:
    gm, reduces = _program()
    stats = optimize_comm(gm, DEFAULT)
    for name in ("fresh", "fresh view"):
        assert reduces[name].target is _F.all_reduce_.default, name
    for name in ("view", "placeholder", "shared"):
        assert reduces[name].target is _F.all_reduce.default, name
    assert stats.collectives_after == stats.collectives_before == 5  # in place still counts


def test_out_of_place_undoes_it_for_torch_compile() -> None:
    gm, reduces = _program()
    optimize_comm(gm, DEFAULT)
    out_of_place(gm)
    assert all(r.target is _F.all_reduce.default for r in reduces.values())
    assert "all_reduce_.default" not in gm.code
