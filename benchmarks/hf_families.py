"""Hugging Face model families through autopar: parity on local ranks, and planning at scale.

    python benchmarks/hf_families.py parity [--families llama,bert] [--runs dptp,fsdp,pp-tp]
                                            [--mixed-precision bf16] [--zero] [--csv ...]
    python benchmarks/hf_families.py plan [--families llama,t5] [--nodes 2] [--csv ...]

`parity`: each family's tiny model (2 layers, d 32, vocab 64, seq 16, no dropout; its
`labels` loss) trains 2 AdamW steps on 4 local gloo processes under each run of `RUNS` and
is compared with one device (`autopar.testing.parity`; one set of ranks for every case):
loss, gradient and parameter errors, and the fused kernels where `--fusion triton` (set
`TRITON_INTERPRET=1` on CPU). `plan`: the default `autopar.plan` of each family at ~1B
parameters (d 2048, 16 layers, 16 heads, ff 5632, vocab 32000; seq 2048, 512 for the
encoders; bf16, meta device, batch 16) on `--nodes` nodes of dgx-h100: seconds, layout,
predicted step and peak, or the error. A sweep, not a test: the models are
tests/models/hf_families.py's, of which the test suite runs three.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models"))  # the families' builders

import torch  # noqa: E402
from hf_families import FAMILIES, LabelsLoss, hf_model  # noqa: E402

import autopar  # noqa: E402
from autopar.views.bench import write_rows_csv  # noqa: E402

SOURCE = f"{ROOT / 'tests' / 'models' / 'hf_families.py'}:build"
ENCODERS = ("bert", "roberta", "distilbert")
RUNS = {  # name -> (mesh, axis names, strategy, pipeline schedule)
    "dptp": ((2, 2), ("dp", "tp"), ("dp", "tp"), None),
    "fsdp": ((4,), ("dp",), "fsdp", None),
    "fsdp-tp": ((2, 2), ("dp", "tp"), ("fsdp", "tp"), None),
    "auto": ((2, 2), ("dp", "tp"), "auto", None),
    "pp-tp": ((2, 2), ("pp", "tp"), "tp", "1f1b"),
    "pp-dp": ((2, 2), ("pp", "dp"), "dp", "gpipe"),
    "sp": ((2, 2), ("dp", "tp"), ("dp", "sp"), None),
    "cp-gather": ((2, 2), ("dp", "cp"), ("dp", "cp-gather"), None),
    "cp-ring": ((2, 2), ("dp", "cp"), ("dp", "cp-ring"), None),
}
BILLION = dict(h=2048, layers=16, heads=16, ff=5632, vocab=32000, seq=2048, kv=4, hd=128)


def parity_rows(families, runs, mixed_precision, zero, fusion) -> list[dict]:
    from autopar.testing.parity import ParityCase, run_parity
    from autopar.testing.rank_pool import kept_ranks

    extra = dict(mixed_precision=mixed_precision, shard_optimizer=zero, fusion=fusion)
    rows = []
    with kept_ranks():
        for family in families:
            cases = []
            for run in runs:
                mesh, names, strategy, schedule = RUNS[run]
                pipe = dict(schedule=schedule, microbatches=4) if schedule else {}
                cases.append(
                    ParityCase(SOURCE, mesh, names, strategy, family, steps=2, **pipe, **extra)
                )
            for run, res in zip(runs, run_parity(cases), strict=True):
                error = (res.error or "").strip().splitlines()[-1:] or [""]
                row = dict(family=family, run=run, loss=res.loss_rel_err, grad=res.grad_err)
                row |= dict(param=res.param_err, fused=" ".join(sorted(set(res.fusion))))
                rows.append(row | dict(error=error[0][:160]))
                _print_row(rows[-1], PARITY_COLUMNS)
    return rows


def plan_rows(families, nodes: int) -> list[dict]:
    rows = []
    for family in families:
        seq = 512 if family in ENCODERS else 2048
        t0 = time.perf_counter()
        row = dict(family=family, seconds=0.0, layout="", step_s=0.0, peak_gib=0.0, error="")
        try:
            with torch.device("meta"):
                model = LabelsLoss(hf_model(family, **(BILLION | dict(seq=seq))))
            model = model.to(torch.bfloat16)
            ids = torch.zeros(16, seq, dtype=torch.long, device="meta")
            cluster = autopar.Cluster.preset("dgx-h100", nodes=nodes)
            plan = autopar.plan(model, (ids, ids), cluster=cluster)
            row |= dict(layout=plan.solver.get("layout", ""), step_s=plan.predicted_step_time)
            row["peak_gib"] = plan.predicted_peak_memory / 2**30
        except Exception as exc:  # noqa: BLE001 - a sweep reports what failed and goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        _print_row(row, PLAN_COLUMNS)
    return rows


PARITY_COLUMNS = [("family", "{:11s}"), ("run", "{:9s}"), ("loss", "{:.1e}"),
                  ("grad", "{:.1e}"), ("param", "{:.1e}"), ("fused", "{}"), ("error", "{}")]  # fmt: skip
PLAN_COLUMNS = [("family", "{:11s}"), ("seconds", "{:6.1f}"), ("layout", "{}"),
                ("step_s", "{:.3f}"), ("peak_gib", "{:.1f}"), ("error", "{}")]  # fmt: skip


def _print_row(row: dict, columns) -> None:
    print(" | ".join(fmt.format(row[name]) for name, fmt in columns), flush=True)


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("parity", "plan"))
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--runs", default="dptp,fsdp,auto,pp-tp,pp-dp,sp,cp-gather,cp-ring")
    parser.add_argument("--mixed-precision", default=None, choices=(None, "bf16", "fp16"))
    parser.add_argument("--zero", action="store_true", help="ZeRO-1 (shard_optimizer)")
    parser.add_argument("--fusion", default="none", choices=("none", "triton", "inductor"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if args.mode == "parity":
        runs = [r.strip() for r in args.runs.split(",") if r.strip()]
        print(" | ".join(name for name, _ in PARITY_COLUMNS))
        rows = parity_rows(families, runs, args.mixed_precision, args.zero, args.fusion)
    else:
        print(" | ".join(name for name, _ in PLAN_COLUMNS))
        rows = plan_rows(families, args.nodes)
    path = args.csv or f"build/hf_families_{args.mode}.csv"
    write_rows_csv(path, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
