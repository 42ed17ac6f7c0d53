"""`passes.shape_reads`: a factory reading a collective's result only for its shape does
not make the scheduler wait on the collective (the backward's seed, `ones_like(loss)`,
of a loss all-reduced across data-parallel ranks)."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.passes.comm import DEFAULT, WAITS, optimize_comm

_F = torch.ops._c10d_functional


def _program() -> fx.GraphModule:
    """loss = all_reduce(sum(x)); seed = ones_like(loss); then work reading x, and both
    returned: the program's shape as lowered."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.randn(4, 4), torch.randn(4, 4)
    total = graph.call_function(torch.ops.aten.sum.default, (x,))
    reduce = graph.call_function(_F.all_reduce.default, (total, "sum", "0"))
    wait = graph.call_function(_F.wait_tensor.default, (reduce,))
    loss = graph.call_function(torch.ops.aten.view.default, (wait, []))
    seed = graph.call_function(torch.ops.aten.ones_like.default, (loss,))
    work = graph.call_function(torch.ops.aten.mm.default, (x, w))
    scaled = graph.call_function(torch.ops.aten.mul.Tensor, (work, seed))
    graph.output((loss, scaled))
    for n in (total, reduce, wait, loss, seed):
        n.meta["val"] = torch.zeros(())
    work.meta["val"] = scaled.meta["val"] = torch.zeros(4, 4)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_the_seed_of_the_backward_does_not_wait_on_the_loss_all_reduce() -> None:
    gm = _program()
    optimize_comm(gm, DEFAULT)
    nodes = list(gm.graph.nodes)
    targets = [n.target for n in nodes]
    assert torch.ops.aten.ones_like.default not in targets
    full = next(n for n in nodes if n.target is torch.ops.aten.full.default)
    assert full.args == ([], 1) and full.kwargs["dtype"] == torch.float32
    wait = next(n for n in nodes if n.target in WAITS)
    mm = next(n for n in nodes if n.target is torch.ops.aten.mm.default)
    # the wait sinks past the work to the loss's own reader (the output)
    assert nodes.index(wait) > nodes.index(mm)
