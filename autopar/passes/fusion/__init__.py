"""Fusion: replace matched regions of the captured forward graph by one autopar kernel call.

``fuse_regions(captured, kernels="triton") -> list[FusedRegion]`` rewrites ``captured.gm``
(core ATen, after capture, before planning) in place. Each matched region becomes one call
of an ``autopar::*`` custom op (:mod:`autopar.kernels`) followed by ``getitem`` nodes for
its outputs. The search then plans the fused op like any other node (strategies:
:mod:`autopar.passes.strategies.rules.fused`), and lowering runs it on DTensors (the fused
forward and backward ops are registered into DTensor's propagator), so the per-rank program
holds one fused node in forward and one in backward, with collectives only around it: a
fused region never spans a collective, by construction.

The table of what is matched (``PATTERNS``: name, matcher, handler, tried in order) is
:mod:`autopar.passes.fusion.patterns`; the rewriting of one match is
:mod:`autopar.passes.fusion.rewrite`.

Every new node gets ``meta["val"]`` (the op's fake implementation run on the inputs' fake
values) and the ``nn_module_stack`` / ``stack_trace`` of the last node it replaces, so
layer grouping (:func:`autopar.capture.layer_of`) keeps working. The captured graph's
fingerprint is recomputed when anything was fused (a plan of the unfused graph then does
not apply to the fused one). The plan records the mode (``Plan.fusion``) and the regions
(``Plan.fused_regions``).

Kernels run only when :func:`autopar.kernels.available` (a CUDA device, or
``TRITON_INTERPRET=1`` set before triton is imported); otherwise the graph is left as is.
"""

from __future__ import annotations

import logging

import torch.fx as fx

from autopar.capture.export import Captured, graph_fingerprint
from autopar.passes.fusion.patterns import PATTERNS
from autopar.passes.fusion.rewrite import Match, Pattern, rewrite
from autopar.plan import FUSION_MODES, FusedRegion

__all__ = ["PATTERNS", "Match", "Pattern", "fuse_regions"]

log = logging.getLogger(__name__)

_UNAVAILABLE = (
    "Triton kernels unavailable (no GPU, TRITON_INTERPRET unset): leaving the graph unfused"
)
_warned_unavailable = False


def _kernels_available() -> bool:
    try:
        from autopar.kernels import available
    except ImportError:  # triton not installed
        return False
    return available()


def fuse_regions(captured: Captured, kernels: str = "triton") -> list[FusedRegion]:
    """Replace every matched region of ``captured.gm`` by one fused kernel call.

    ``kernels``: ``"triton"`` (autopar's Triton kernels), ``"inductor"`` or ``"none"``
    (the graph is left as it is: with ``"inductor"`` the runtime hands each rank's lowered
    program to torch.compile). Returns the regions in the order they were fused;
    ``captured.gm`` is recompiled and ``captured.fingerprint`` recomputed when any was.
    """
    global _warned_unavailable
    if kernels not in FUSION_MODES:
        raise ValueError(f"kernels={kernels!r}: expected one of {FUSION_MODES}")
    if kernels != "triton":
        return []
    if not _kernels_available():
        if not _warned_unavailable:
            _warned_unavailable = True
            log.warning(_UNAVAILABLE)
        return []
    from autopar.passes.strategies.rules import fused

    fused.register()  # strategies for the fused ops (planning and DTensor execution)
    gm = captured.gm
    regions: list[FusedRegion] = []
    for pattern in PATTERNS:
        regions += _fuse_pattern(gm, pattern)
    if regions:
        gm.graph.lint()
        gm.recompile()
        captured.fingerprint = graph_fingerprint(captured)
        log.info(
            "fused %d regions: %s",
            len(regions),
            ", ".join(f"{r.kernel}({r.node})" for r in regions),
        )
    return regions


def _fuse_pattern(gm: fx.GraphModule, pattern: Pattern) -> list[FusedRegion]:
    """Every match of one pattern, rewritten in graph order."""
    regions = []
    dead: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node in dead or node.op != "call_function":
            continue
        match = pattern.matcher(node)
        if match is None:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        gone = [*match.replaced, *(swap[0] for swap in match.swaps)]
        names = tuple(n.name for n in sorted(gone, key=order.__getitem__))
        new = rewrite(gm, pattern, match)
        if new is None:
            continue
        dead.update(gone)
        regions.append(FusedRegion(pattern.name, new.name, names))
    return regions
