"""Split the captured loss graph into pipeline stages.

`split_stages(captured, cuts) -> list[StageGraph]`

`cuts` gives, per stage, the index of the first layer (repeated block, in graph order) it
owns; nodes outside layers go to the stage of the layer before them (the embedding to the
first stage, the final norm, head and loss to the last). Nodes computed from parameters,
buffers and constants alone (a transposed weight, RoPE tables, position ids) are copied
into every stage that reads them, so only activations cross stages.

Stage `s` takes, in order: the values stage `s-1` sends (stage 0: the user inputs), and
returns every value that a later stage reads (user inputs such as the targets are
forwarded stage to stage), or, for the last stage, the loss. Parameters and buffers enter
as placeholders of the same names as in the captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.capture.analysis import assign_stages


@dataclass
class StageGraph:
    index: int
    gm: fx.GraphModule  # placeholders: params, buffers, then `inputs`
    params: list[str]
    buffers: list[str]
    inputs: list[str]  # what this stage receives (stage 0: the user inputs)
    outputs: list[str]  # what it sends on; the last stage: ["loss"]


def split_stages(captured: Captured, cuts: list[int]) -> list[StageGraph]:
    stage_of = assign_stages(captured, cuts)
    num = len(cuts)
    last_use = _last_use(captured, stage_of, num)
    graphs = []
    carried = list(captured.user_inputs)  # values entering stage 0, in order
    for s in range(num):
        mine = [n for n in captured.gm.graph.nodes if stage_of.get(n) == s]
        sent = [v for v in _defined_up_to(captured, stage_of, s) if last_use.get(v, -1) > s]
        graphs.append(_build_stage(captured, s, mine, carried, sent, last=s == num - 1))
        carried = sent
    return graphs


def _defined_up_to(captured: Captured, stage_of, s: int) -> list[str]:
    """Activation values (and user inputs) available after stage s, in graph order."""
    out = list(captured.user_inputs)
    out += [n.name for n in captured.gm.graph.nodes if n in stage_of and stage_of[n] <= s]
    return out


def _last_use(captured: Captured, stage_of, num: int) -> dict[str, int]:
    last: dict[str, int] = {}
    for n in captured.gm.graph.nodes:
        user_stage = num - 1 if n.op == "output" else stage_of.get(n)
        if user_stage is None:
            continue
        for a in n.all_input_nodes:
            if a.name in captured.user_inputs or a in stage_of:
                last[a.name] = max(last.get(a.name, -1), user_stage)
    return last


def _build_stage(
    captured: Captured, s: int, mine: list[fx.Node], carried: list[str], sent: list[str], last: bool
) -> StageGraph:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    params, buffers = [], []
    by_name = {n.name: n for n in captured.gm.graph.nodes}

    def value(node: fx.Node) -> fx.Node:
        if node.name in env:
            return env[node.name]
        if node.op == "placeholder":  # a parameter or buffer this stage reads
            (params if node.name in captured.params else buffers).append(node.name)
            new = g.placeholder(node.name)
        else:  # a node computed from parameters/buffers/constants alone: copy it here
            new = g.node_copy(node, value)
        new.meta = dict(node.meta)
        env[node.name] = new
        return new

    for name in carried:
        env[name] = g.placeholder(name)
        env[name].meta = dict(by_name[name].meta)
    for n in mine:
        env[n.name] = g.node_copy(n, value)
    if last:
        out_node = next(n for n in captured.gm.graph.nodes if n.op == "output")
        loss = out_node.args[0]
        loss = loss[0] if isinstance(loss, (tuple, list)) else loss
        g.output(env[loss.name])
        outputs = ["loss"]
    else:
        g.output(tuple(env[name] for name in sent))
        outputs = list(sent)
    _order_placeholders(g, params + buffers)
    g.lint()
    gm = fx.GraphModule(torch.nn.Module(), g)
    return StageGraph(s, gm, params, buffers, list(carried), outputs)


def _order_placeholders(g: fx.Graph, state_names: list[str]) -> None:
    """Parameters and buffers first, then the stage's inputs (in the callers' order)."""
    placeholders = {n.name: n for n in g.nodes if n.op == "placeholder"}
    carried = [n for n in placeholders if n not in state_names]
    head = next(n for n in g.nodes if n.op != "placeholder")
    for name in [*state_names, *carried]:
        head.prepend(placeholders[name])
