"""What a user asks of `autopar.plan` / `autopar.compile`: one frozen, validated object.

`PlanOptions(strategy=..., placements=..., ...)` checks every field when it is built, so a
bad option fails in milliseconds, before the model is captured; each `ValueError` names
the option and how to fix it. The orchestration (`autopar.planning`) derives what each
stage needs from it: the search's `SearchOptions`, the pipeline's `PipelineOptions`, the
fusion mode. Pins left at their default are searched (`strategy="auto"`, no `placements`,
`pipeline_stages=None` with no "pp" mesh axis, ...).

    strategy         a role for every mesh axis ("auto", "dp", "fsdp", "tp", "sp", "cp",
                     "ep") or one per axis ("sp": tp with sequence-parallel norms; "cp":
                     context parallel, the sequence split through attention, ring or
                     all-gathered K/V as the search prices them, "cp-ring" / "cp-gather"
                     pinning one; "ep": dp with stacked expert weights split on their
                     expert dim)
    placements       {parameter or input name: spec}, e.g. {"lm_head.weight": "S(0),R"}
    memory_limit     bytes per device (default: 90% of the cluster's device memory)
    time_limit_s     the ILP solver's time limit
    pipeline_stages  stages over the first mesh axis (1: no pipeline), or "auto" to search
                     the layout; None: searched when nothing pins the mesh
                     (`autopar.planning.searches_layout`)
    microbatches     microbatches per step when pipelining (default: 2 x stages, or less)
    schedule         a pipeline schedule (`autopar.plan.SCHEDULES`; default: searched)
    stage_cuts       the first layer of each stage, 0 first, increasing (default: balanced)
    stage_meshes     per pipeline rank, the shape of its stage mesh, e.g. ((2, 1), (1, 2)):
                     the same devices laid out as another (dp, tp) (default: the mesh's)
    fusion           "none", "triton" (autopar's kernels) or "inductor" (torch.compile)
    shard_optimizer  ZeRO-1: optimizer state (and fp32 master) split over each parameter's
                     replicas, gradients reduce-scattered, parameters all-gathered
    shard_gradients  ZeRO-2: keep only the gradient shard too (implies shard_optimizer)
    mixed_precision  None (train in the model's dtype), "bf16" or "fp16": parameters cast
                     to that dtype for forward and backward, fp32 master and optimizer state
    reduce_dtype     the dtype gradients are reduced in under mixed_precision ("float32"
                     by default, or "bfloat16"/"float16")
    activation_checkpointing  "auto" (searched per layer), "none", "selective" or "full"
    reshard_after_forward     "auto" (searched), True or False: FSDP-gathered weights freed
                     after forward and gathered again for backward
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real

from autopar.plan import FUSION_MODES, RECOMPUTE_POLICIES, SCHEDULES, parse_spec

ROLES = ("auto", "dp", "fsdp", "tp", "sp", "cp", "cp-ring", "cp-gather", "ep")
CP_ROLES = ("cp", "cp-ring", "cp-gather")  # context parallel: either variant, ring, all-gather
MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16"}  # option -> torch dtype name
REDUCE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class PlanOptions:
    strategy: str | tuple[str, ...] = "auto"
    placements: Mapping[str, str] = field(default_factory=dict)
    memory_limit: float | None = None
    time_limit_s: float = 30.0
    pipeline_stages: int | str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    stage_cuts: tuple[int, ...] | None = None
    stage_meshes: tuple[tuple[int, ...], ...] | None = None
    fusion: str = "none"
    shard_optimizer: bool = False
    shard_gradients: bool = False
    mixed_precision: str | None = None
    reduce_dtype: str = "float32"
    activation_checkpointing: str = "auto"
    reshard_after_forward: bool | str = "auto"

    def __post_init__(self) -> None:
        # normalize containers (lists from a CLI, a caller's dict it may mutate later)
        if isinstance(self.strategy, Sequence) and not isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", tuple(self.strategy))
        if self.stage_cuts is not None and isinstance(self.stage_cuts, Sequence):
            object.__setattr__(self, "stage_cuts", tuple(self.stage_cuts))
        if self.stage_meshes is not None:
            object.__setattr__(self, "stage_meshes", _shapes(self.stage_meshes))
        object.__setattr__(self, "placements", dict(self._checked_placements()))
        self._check_strategy()
        self._check_limits()
        self._check_pipeline()
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"fusion={self.fusion!r}: choose one of {', '.join(FUSION_MODES)}")
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"shard_optimizer={self.shard_optimizer!r}: give True or False")
        self._check_memory_levers()

    def _check_memory_levers(self) -> None:
        if not isinstance(self.shard_gradients, bool):
            raise ValueError(f"shard_gradients={self.shard_gradients!r}: give True or False")
        if self.shard_gradients and not self.shard_optimizer:
            raise ValueError(
                "shard_gradients=True (ZeRO-2) shards the optimizer state too: "
                "add shard_optimizer=True"
            )
        if self.mixed_precision is not None and self.mixed_precision not in MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r}: choose "
                f"{', '.join(map(repr, MIXED_PRECISION))} or None (the model's own dtype)"
            )
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r}: choose one of {', '.join(REDUCE_DTYPES)}"
            )
        if self.activation_checkpointing not in ("auto", *RECOMPUTE_POLICIES):
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r}: choose 'auto' "
                f"(searched per layer) or one of {', '.join(RECOMPUTE_POLICIES)}"
            )
        if self.reshard_after_forward not in ("auto", True, False):
            raise ValueError(
                f"reshard_after_forward={self.reshard_after_forward!r}: give 'auto' "
                "(searched), True or False"
            )

    @property
    def searches_layout(self) -> bool:
        """pipeline_stages="auto": the pipeline degree and the stage meshes are searched."""
        return self.pipeline_stages == "auto"

    def strategy_roles(self) -> tuple[str, ...]:
        """The roles named, one per axis (a single role stands for every axis)."""
        return (self.strategy,) if isinstance(self.strategy, str) else self.strategy

    def _checked_placements(self) -> Mapping[str, str]:
        if self.placements is None:
            return {}
        if not isinstance(self.placements, Mapping):
            raise ValueError(
                f"placements={self.placements!r}: give a dict of name -> spec, "
                'e.g. {"lm_head.weight": "S(0),R"}'
            )
        for name, spec in self.placements.items():
            if not isinstance(name, str) or not isinstance(spec, str):
                raise ValueError(
                    f"placements entry {name!r}: {spec!r}: names and specs are strings, "
                    'e.g. {"lm_head.weight": "S(0),R"}'
                )
            try:
                parse_spec(spec)
            except ValueError as exc:
                raise ValueError(
                    f"placements[{name!r}] = {spec!r}: {exc}; write one placement per "
                    'mesh axis, comma-separated, e.g. "S(0),R"'
                ) from None
        return self.placements

    def _check_strategy(self) -> None:
        roles = self.strategy_roles()
        if not roles or not all(isinstance(r, str) for r in roles):
            raise ValueError(
                f"strategy={self.strategy!r}: give one role or a tuple of roles, one per "
                f"mesh axis, from {', '.join(ROLES)}"
            )
        for r in roles:
            if r not in ROLES:
                raise ValueError(f"unknown strategy '{r}'; choose from {', '.join(ROLES)}")
        if self.searches_layout and not isinstance(self.strategy, str):
            raise ValueError(
                f"strategy={self.strategy!r} names a role per mesh axis, but "
                "pipeline_stages='auto' chooses the mesh; give one role (e.g. 'auto'), or a "
                "cluster with the mesh you want"
            )

    def _check_limits(self) -> None:
        if self.memory_limit is not None and not _positive(self.memory_limit):
            raise ValueError(
                f"memory_limit={self.memory_limit!r}: give bytes per device (> 0), "
                "or None for 90% of the cluster's device memory"
            )
        if not _positive(self.time_limit_s):
            raise ValueError(
                f"time_limit_s={self.time_limit_s!r}: give the solver's time limit in seconds (> 0)"
            )

    def _check_pipeline(self) -> None:
        stages = self.pipeline_stages
        if stages is not None and stages != "auto" and not _count(stages):
            raise ValueError(
                f"pipeline_stages={stages!r}: give a number of stages (>= 1), 'auto' to "
                "search the layout, or None (the default: searched on a cluster's own mesh, "
                "else a pipeline only over a mesh axis named 'pp')"
            )
        if self.microbatches is not None and not _count(self.microbatches):
            raise ValueError(
                f"microbatches={self.microbatches!r}: give a count >= 1 (at most the "
                "batch's rows; one that does not divide it makes the last ones smaller), "
                "or None for the default"
            )
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}, "
                "or None to search them all"
            )
        if self.stage_meshes is not None and self.searches_layout:
            raise ValueError(
                "stage_meshes pins every pipeline rank's stage mesh, but "
                "pipeline_stages='auto' searches the degree; give pipeline_stages=<n>"
            )
        cuts = self.stage_cuts
        if cuts is None:
            return
        if (
            not isinstance(cuts, tuple)
            or not cuts
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
            or cuts[0] != 0
            or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False))
        ):
            raise ValueError(
                f"stage_cuts={cuts!r}: give the first layer of every stage, starting at 0 "
                "and increasing, e.g. (0, 2) for two stages of a 4-layer model"
            )
        if self.searches_layout:
            raise ValueError(
                "stage_cuts pins the stages of one pipeline degree, but pipeline_stages='auto' "
                "searches the degree; give pipeline_stages=<n> with stage_cuts, or drop them"
            )


def _shapes(meshes: object) -> tuple[tuple[int, ...], ...]:
    """`stage_meshes` as a tuple of shapes of positive ints, else a ValueError."""
    try:
        shapes = tuple(tuple(int(n) for n in m) for m in meshes)
    except (TypeError, ValueError):
        shapes = ()
    if not shapes or any(not m or min(m) < 1 for m in shapes):
        raise ValueError(
            f"stage_meshes={meshes!r}: give one stage mesh shape per pipeline rank, e.g. "
            "((2, 1), (1, 2)) for two ranks of two devices as dp x tp 2 x 1 and 1 x 2"
        )
    return shapes


def _positive(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and x > 0


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1
