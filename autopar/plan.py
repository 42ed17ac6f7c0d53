"""Plan: the search's answer as pure data.

A plan is JSON, never code: a schema version, the fingerprint of the graph it was made for,
the cluster, and per node the placements its inputs must have and its outputs will have
(one placement per mesh axis, written DTensor-style: `S(0)`, `R`, `P` (sum), `P(avg)`,
`MP` (the masked sum of a vocab-parallel embedding)). Parameters carry their storage
placement (what each rank keeps between steps: `R` = replicated (DP), `S(d)` on a data
axis = ZeRO-3/FSDP, `S(d)` on a tensor axis = Megatron TP).
`fusion` is how the planned graph was fused ("none", "triton": `fused_regions` lists the
regions swapped for autopar kernels, "inductor": the runtime hands each rank's program to
torch.compile and no region is rewritten); the runtime reproduces it before lowering.
`comm` is how the non-pipelined per-rank program's collectives are bucketed and overlapped
(`passes.comm`), the options `predicted_step_time` was priced with (`search.step`); None: no
communication pass (every collective waited at once where traced; pipelined plans, whose
stage programs run none). `predicted_step_time` is that program's step as it runs; the
ILP's bound (every collective waited at once, one per tensor) is `solver["ilp_step_time_bound"]`.
`content_hash` covers everything but itself; every rank compares it with rank 0's before
the first collective.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._compat import StridedShard, is_mask_partial

# 2: `fusion` is the mode, the regions are `fused_regions`; 3: `comm`, and
# `predicted_step_time` is the overlapped step (version 2 recorded the ILP's bound there);
# 4: nodes named in graph order (`capture.export._renumbered`)
SCHEMA_VERSION = 4
_OLDER = {
    1: "version 1 recorded fusion as a list of regions",
    2: "version 2 recorded no communication options and priced the step without overlap",
    3: "version 3 named nodes as torch.export left them; they are now numbered in graph order",
}

Spec = tuple[Placement, ...]


def placement_str(p: Placement) -> str:
    if isinstance(p, StridedShard):  # dim p.dim as split_factor pieces, each split
        return f"SS({p.dim}:{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if p.is_partial():
        if is_mask_partial(p):
            return "MP"  # vocab-parallel embedding's masked sum (rebuilt by DTensor itself)
        return "P" if getattr(p, "reduce_op", "sum") == "sum" else f"P({p.reduce_op})"
    raise ValueError(f"placement {p!r} has no plan encoding")


def parse_placement(text: str) -> Placement:
    if text == "R":
        return Replicate()
    if text in ("P", "MP"):
        return Partial("sum")
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    if text.startswith("SS(") and text.endswith(")") and ":" in text:
        dim, pieces = text[3:-1].split(":")
        return StridedShard(int(dim), split_factor=int(pieces))
    raise ValueError(f"'{text}' is not a placement (expected R, P, S(dim) or SS(dim:pieces))")


def spec_str(spec: Spec | None) -> str | None:
    return None if spec is None else ",".join(placement_str(p) for p in spec)


@functools.cache  # placements are immutable: each of a plan's few specs parsed once
def parse_spec(text: str | None) -> Spec | None:
    return None if text is None else tuple(parse_placement(t) for t in text.split(","))


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One graph node: the specs its tensor inputs are given and its outputs have."""

    name: str
    op: str
    inputs: tuple[str | None, ...]
    outputs: tuple[str | None, ...]
    layer: str | None = None
    args: tuple[str, ...] = ()  # the node or tensor producing each input, by name
    shapes: tuple[tuple[int, ...] | None, ...] = ()  # global shape per output
    dtypes: tuple[str | None, ...] = ()
    # per input, which output of a multi-output producer it reads (a getitem's index);
    # empty when no input reads one
    arg_outputs: tuple[int | None, ...] = ()
    # positions of the inputs redistributed from their producer's spec (priced by the search)
    reshards: tuple[int, ...] = ()
    # a region's (`autopar.Region`) all-to-all payload for the whole batch: the bytes one
    # dispatch moves when its experts are split (`Region.exchanged_bytes`); 0 otherwise
    exchange_bytes: float = 0.0


def _node_plan(raw: dict) -> NodePlan:
    shapes = tuple(None if s is None else tuple(s) for s in raw.get("shapes", ()))
    return NodePlan(
        **{
            **raw,
            "inputs": tuple(raw["inputs"]),
            "outputs": tuple(raw["outputs"]),
            "args": tuple(raw.get("args", ())),
            "shapes": shapes,
            "dtypes": tuple(raw.get("dtypes", ())),
            "arg_outputs": tuple(raw.get("arg_outputs", ())),
            "reshards": tuple(raw.get("reshards", ())),
        }
    )


FUSION_MODES = ("none", "triton", "inductor")


@dataclass(frozen=True, slots=True)
class FusedRegion:
    """One region the fusion pass swapped for a kernel call: the kernel (``autopar::<kernel>``),
    the fused node's name and the names of the nodes it replaced, in graph order."""

    kernel: str
    node: str
    replaced: tuple[str, ...]

    @classmethod
    def from_dict(cls, raw: dict) -> FusedRegion:
        return cls(str(raw["kernel"]), str(raw["node"]), tuple(raw["replaced"]))


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """A parameter, buffer or user input: its storage placement and global shape."""

    name: str  # placeholder name in the graph
    fqn: str  # parameter/buffer name in the model, or the user input's name
    kind: str  # "param" | "buffer" | "input"
    spec: str
    shape: tuple[int, ...]
    dtype: str


# The schedule vocabulary: a schedule's name -> virtual stages per pipeline rank. What runs
# each one (torch.distributed.pipelining's classes) is the runtime's business.
SCHEDULES: dict[str, int] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved1f1b": 2,
    "interleavedzb": 2,
    "zbv": 2,
    "dualpipev": 2,
}
V_SHAPED = frozenset({"zbv", "dualpipev"})


def stage_ranks(schedule: str, pp: int) -> list[int]:
    """Pipeline rank of every stage: round-robin, or a V (stage s and 2pp-1-s on one rank)."""
    n = pp * SCHEDULES[schedule]
    if schedule in V_SHAPED:
        return [s if s < pp else n - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    """The inter-op half: stages over the `pp` mesh axis and their schedule.

    `stage_cuts[s]` is the index (in graph order) of the first layer of stage s; the node
    placements of the plan apply to every stage's submesh `stage_mesh` (named
    `stage_axis_names`). Stage s runs on pipeline rank `rank_of_stage[s]`.

    `boundary`: how an activation crosses from one stage to the next. "placed": as its
    producer's output placement (a Partial reduced), each rank sending its whole local
    shard to the rank at its place in the next stage's mesh. "scattered": split over the
    stage mesh's replicated axes too (`scattered_spec`), each rank sending 1/n of it; the
    next stage gathers it back where its plan needs it (Megatron's scatter/gather of
    pipeline messages: less traffic on the slow inter-stage link for a gather on the
    fast one). "canonical": split on one dim over all the stage's devices in rank order
    (`canonical_spec`), what every stage mesh shape holds alike.

    `rank_meshes`: per pipeline rank, its stage mesh's shape where they differ (the same
    devices and axis names in another (dp, tp): a node's placements read on its stage's
    rank's mesh, activations cross "canonical"); empty: every rank on `stage_mesh`."""

    pp: int
    stage_cuts: tuple[int, ...]
    layers: tuple[str, ...]
    schedule: str
    microbatches: int
    stage_mesh: tuple[int, ...]
    stage_axis_names: tuple[str, ...]
    rank_of_stage: tuple[int, ...]
    timeline: tuple[str, ...] = ()  # text rows, one per pipeline rank (see search/schedules)
    boundary: str = "placed"  # or "scattered", "canonical"
    rank_meshes: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"pipeline boundary {self.boundary!r}: expected one of {BOUNDARIES}")
        meshes, devices = self.rank_meshes, math.prod(self.stage_mesh)
        if meshes and (
            len(meshes) != self.pp
            or any(len(m) != len(self.stage_mesh) or math.prod(m) != devices for m in meshes)
        ):
            raise ValueError(
                f"rank_meshes {meshes}: one stage mesh per pipeline rank ({self.pp}), every "
                f"rank {devices} devices on the axes {self.stage_axis_names}"
            )
        if self.boundary != "canonical" and mixed_shapes(meshes):
            raise ValueError("stages on meshes of different shapes cross 'canonical'")

    def mesh_of(self, rank: int) -> tuple[int, ...]:
        """The stage mesh shape of pipeline rank `rank`."""
        return self.rank_meshes[rank] if self.rank_meshes else self.stage_mesh

    @classmethod
    def from_dict(cls, raw: dict) -> PipelinePlan:
        out = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        out["rank_meshes"] = tuple(tuple(m) for m in raw.get("rank_meshes", ()))
        return cls(**out)


BOUNDARIES = ("placed", "scattered", "canonical")


def mixed_shapes(rank_meshes: tuple[tuple[int, ...], ...]) -> bool:
    return len(set(rank_meshes)) > 1  # the pipeline ranks' stage meshes differ in shape


def canonical_spec(shape: tuple[int, ...], devices: int, ndim: int) -> Spec:
    """How a value crosses between stage meshes of any shape of `devices` devices: all
    `ndim` axes split the first dim `devices` divides, nested, so the stage's k-th device
    holds chunk k on any shape (replicated where no dim divides)."""
    dim = next((d for d, n in enumerate(shape) if n >= devices and n % devices == 0), None)
    return (Replicate() if dim is None or devices == 1 else Shard(dim),) * ndim


def scattered_spec(spec: Spec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Spec:
    """`spec` (a boundary value's, no Partial) with each replicated mesh axis of size > 1
    splitting a dim of its own too: the first dim no axis splits yet whose size that axis
    divides (an axis no such dim exists for stays replicated). One dim per axis, so the
    split is the same whatever order the axes are applied in."""
    out = list(spec)
    split = {p.dim for p in spec if isinstance(p, Shard)}
    for axis, p in enumerate(spec):
        n = mesh_shape[axis]
        if not isinstance(p, Replicate) or n == 1:
            continue
        dim = next(
            (d for d, size in enumerate(shape) if d not in split and size >= n and size % n == 0),
            None,
        )
        if dim is not None:
            out[axis] = Shard(dim)
            split.add(dim)
    return tuple(out)


MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class CommPlan:
    """How `passes.comm` rewrites the program, and what the step prediction assumed.

    bucket              fuse gradient reductions into size buckets (DDP's rule,
                        `cost_models.buckets.bucket_plan`) and a layer's all-gathers into one
    overlap             issue collectives early and wait at first use (forward gathers
                        prefetched one layer ahead)
    bucket_bytes        a bucket's cap after the first (DDP: 25 MiB)
    first_bucket_bytes  the first bucket's cap per key (DDP: 1 MiB)
    """

    bucket: bool = True
    overlap: bool = True
    bucket_bytes: int = 25 * MIB
    first_bucket_bytes: int = 1 * MIB

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0 or self.first_bucket_bytes <= 0:
            raise ValueError(
                f"bucket sizes must be positive (got bucket_bytes={self.bucket_bytes}, "
                f"first_bucket_bytes={self.first_bucket_bytes})"
            )

    @classmethod
    def from_dict(cls, raw: dict) -> CommPlan:
        return cls(
            bucket=bool(raw["bucket"]),
            overlap=bool(raw["overlap"]),
            bucket_bytes=int(raw["bucket_bytes"]),
            first_bucket_bytes=int(raw["first_bucket_bytes"]),
        )


DEFAULT_COMM = CommPlan()  # what the search assumes and non-pipelined programs run

RECOMPUTE_POLICIES = ("none", "selective", "full")
# the terms of a rank's memory, predicted (`Plan.predicted_memory`) and measured
# (`runtime.memory_stats`) alike
MEMORY_CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "buffers",
    "activations",
    "communication",
)
PRECISIONS = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The memory levers the runtime applies, exactly as the search priced them.

    recompute              (layer, "selective" | "full") for every layer that recomputes in
                           backward (absent layers keep all their activations); selective
                           keeps matmul and attention outputs (`capture.recompute_policy`)
    reshard_after_forward  layers whose all-gathered (FSDP) weights are freed after their
                           forward use and all-gathered again for backward
    param_dtype            mixed precision: the compute dtype parameters are cast to for
                           forward and backward (None: the model's own dtype, no master copy)
    reduce_dtype           the dtype gradients are reduced in (with param_dtype)
    loss_scaling           dynamic loss scaling (param_dtype float16)
    shard_optimizer        ZeRO-1: optimizer state (and fp32 master) split over each
                           parameter's replicas; gradients reduce-scattered, params gathered
    shard_gradients        ZeRO-2: only the gradient shard is kept as well
    """

    recompute: tuple[tuple[str, str], ...] = ()
    reshard_after_forward: tuple[str, ...] = ()
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    loss_scaling: bool = False
    shard_optimizer: bool = False
    shard_gradients: bool = False

    def __post_init__(self) -> None:
        bad = [p for _, p in self.recompute if p not in RECOMPUTE_POLICIES]
        assert not bad, f"unknown recompute policies {bad}"
        assert self.param_dtype in (None, *PRECISIONS), self.param_dtype
        assert self.reduce_dtype in (None, *PRECISIONS), self.reduce_dtype
        assert not self.shard_gradients or self.shard_optimizer, "ZeRO-2 implies ZeRO-1"

    def recompute_of(self, layer: str | None) -> str:
        return dict(self.recompute).get(layer, "none") if layer is not None else "none"

    @classmethod
    def from_dict(cls, raw: dict) -> MemoryPlan:
        return cls(
            recompute=tuple((str(a), str(b)) for a, b in raw.get("recompute", ())),
            reshard_after_forward=tuple(raw.get("reshard_after_forward", ())),
            param_dtype=raw.get("param_dtype"),
            reduce_dtype=raw.get("reduce_dtype"),
            loss_scaling=bool(raw.get("loss_scaling", False)),
            shard_optimizer=bool(raw.get("shard_optimizer", False)),
            shard_gradients=bool(raw.get("shard_gradients", False)),
        )


@dataclass(frozen=True, slots=True)
class Plan:
    graph_fingerprint: str
    cluster: dict
    strategy: str
    nodes: tuple[NodePlan, ...]
    tensors: tuple[TensorPlan, ...]
    predicted_step_time: float
    predicted_peak_memory: float
    solver: dict = field(default_factory=dict)
    pipeline: PipelinePlan | None = None
    fusion: str = "none"  # one of FUSION_MODES
    fused_regions: tuple[FusedRegion, ...] = ()  # with fusion="triton"
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    # the predicted peak's breakdown, bytes per device: parameters, gradients,
    # optimizer_state, buffers, activations, communication (`runtime.memory_stats` measures
    # the same categories)
    predicted_memory: dict = field(default_factory=dict)
    comm: CommPlan | None = None  # None: no communication pass (module docstring)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.fusion not in FUSION_MODES or (self.fused_regions and self.fusion != "triton"):
            raise ValueError(
                f"plan fusion={self.fusion!r} with {len(self.fused_regions)} fused regions: "
                f"the mode is one of {', '.join(FUSION_MODES)}, regions only with 'triton'; "
                "re-plan with `autopar plan`."
            )

    # ---- lookups -------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.cluster["mesh_shape"])

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.cluster["axis_names"])

    @property
    def stage_mesh_shape(self) -> tuple[int, ...]:
        """The mesh the node placements are for (the whole mesh without pipelining)."""
        return self.pipeline.stage_mesh if self.pipeline else self.mesh_shape

    @property
    def stage_axis_names(self) -> tuple[str, ...]:
        return self.pipeline.stage_axis_names if self.pipeline else self.axis_names

    @property
    def stage_cuts(self) -> tuple[int, ...]:
        return self.pipeline.stage_cuts if self.pipeline else (0,)

    @property
    def schedule(self) -> str:
        return self.pipeline.schedule if self.pipeline else "none"

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches if self.pipeline else 1

    def on_rank(self, rank: int) -> Plan:
        """The plan as pipeline rank `rank` reads it (`stage_mesh_shape` its own)."""
        p = self.pipeline
        if p is None or p.mesh_of(rank) == p.stage_mesh:
            return self
        return replace(self, pipeline=replace(p, stage_mesh=p.mesh_of(rank)))

    def node(self, name: str) -> NodePlan:
        return self._node_index()[name]

    def tensor(self, name: str) -> TensorPlan:
        return next(t for t in self.tensors if t.name == name)

    def _node_index(self) -> dict[str, NodePlan]:
        return {n.name: n for n in self.nodes}

    # ---- serialization ---------------------------------------------------------------
    def to_dict(self) -> dict:
        data = self._fields()  # asdict once, hashed before the hash joins it
        body = json.dumps(data, sort_keys=True, default=str)
        data["content_hash"] = hashlib.sha256(body.encode()).hexdigest()[:16]
        return data

    def _fields(self) -> dict:
        """`asdict`, a pipeline's default boundary ("placed") and uniform stage meshes left
        out: a plan saved before `PipelinePlan.boundary` existed reads (and hashes) as saved."""
        data = asdict(self)
        if data.get("pipeline") and data["pipeline"]["boundary"] == "placed":
            del data["pipeline"]["boundary"]
        if data.get("pipeline") and not data["pipeline"]["rank_meshes"]:
            del data["pipeline"]["rank_meshes"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            older = (
                f" (an older autopar's plan: {_OLDER[version]})"
                if isinstance(version, int) and version in _OLDER
                else ""
            )
            raise ValueError(
                f"plan schema version {version} is not supported by this autopar "
                f"(expects {SCHEMA_VERSION}){older}; re-plan with `autopar plan`."
            )
        data = dict(data)
        stored_hash = data.pop("content_hash", None)
        plan = cls(
            graph_fingerprint=data["graph_fingerprint"],
            cluster=data["cluster"],
            strategy=data["strategy"],
            nodes=tuple(_node_plan(n) for n in data["nodes"]),
            tensors=tuple(TensorPlan(**{**t, "shape": tuple(t["shape"])}) for t in data["tensors"]),
            predicted_step_time=data["predicted_step_time"],
            predicted_peak_memory=data["predicted_peak_memory"],
            solver=data.get("solver", {}),
            pipeline=PipelinePlan.from_dict(data["pipeline"]) if data.get("pipeline") else None,
            fusion=data.get("fusion", "none"),
            fused_regions=tuple(FusedRegion.from_dict(r) for r in data.get("fused_regions", ())),
            memory=MemoryPlan.from_dict(data.get("memory") or {}),
            predicted_memory=dict(data.get("predicted_memory") or {}),
            comm=CommPlan.from_dict(data["comm"]) if data.get("comm") else None,
        )
        if stored_hash is not None and stored_hash != plan.content_hash:
            raise ValueError(
                "plan file is corrupted or was edited: its content hash does not "
                "match its contents; re-plan with `autopar plan`."
            )
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())

    @property
    def content_hash(self) -> str:
        return self.to_dict()["content_hash"]

    def with_solver(self, **info) -> Plan:
        return replace(self, solver={**self.solver, **info})
