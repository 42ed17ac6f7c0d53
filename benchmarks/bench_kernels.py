"""Peak memory (and, on a GPU, time) of autopar's fused linear + cross-entropy kernel.

Compares, for one training step (forward + backward) of the LM head at a Llama-3 vocabulary:

    reference  F.cross_entropy(x @ W.T, t)          materializes [N, V] logits (and more)
    fused      autopar.kernels.linear_cross_entropy  chunks the rows, never holds [N, V]
    compiled   torch.compile(reference)              GPU only (Inductor's CPU path is skipped)

Memory method:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what
  was allocated before the step (inputs): exact, allocator-level.
* CPU: each variant runs in a fresh subprocess (no allocator caching or fragmentation left by
  the other variant). After building the inputs and a small warm-up, the process resets its
  kernel-tracked peak RSS (``echo 5 > /proc/self/clear_refs``, Linux) and reports
  ``VmHWM - VmRSS`` after the step: the step's peak resident memory above the inputs. Where
  ``clear_refs`` is not writable it falls back to the ``ru_maxrss`` delta across the step.
  (``tracemalloc`` does not see torch's allocator, and the CPU profiler's memory events need
  summing by hand; RSS counts every page torch touches, which for these dense tensors is all
  of them.)

On CPU without ``TRITON_INTERPRET=1`` the fused variant runs the module's pure-PyTorch chunk
step (``_ce_rows_torch``: same chunking and in-place gradient, so the same memory profile);
the table says which backend ran. CPU times are one wall-clock run, for orientation only.

    python benchmarks/bench_kernels.py --n 4096 --hidden 256 --vocab 128256 --csv out.csv
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

KIB = 1024


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096, help="rows (batch * sequence)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--csv", type=Path, default=None, help="write the table as CSV here")
    p.add_argument("--worker", choices=["reference", "fused"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _inputs(args: argparse.Namespace, device: str, n: int | None = None, vocab: int | None = None):
    g = torch.Generator().manual_seed(0)
    n, vocab = n or args.n, vocab or args.vocab
    dtype = getattr(torch, args.dtype)
    x = torch.randn(n, args.hidden, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, args.hidden, generator=g) / args.hidden**0.5).to(device, dtype)
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    return x, w.requires_grad_(), t


def _reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(x @ w.T, t)


def _fused(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    from autopar.kernels.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(x, w, t)


def _fused_backend(x: torch.Tensor) -> str:
    from autopar.kernels import linear_cross_entropy as lce

    if lce._triton_runs_on(x):
        return "triton" + (" (interpreter)" if x.device.type == "cpu" else "")
    return "pytorch-chunked (_ce_rows_torch)"


def _step(fn: Callable, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> float:
    loss = fn(x, w, t)
    loss.backward()
    x.grad = w.grad = None
    return float(loss)


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(args: argparse.Namespace) -> None:
    """Run one variant on CPU in this (fresh) process and print one JSON line."""
    fn = _reference if args.worker == "reference" else _fused
    _step(fn, *_inputs(args, "cpu", n=8, vocab=64))  # warm-up: load kernels, small buffers
    x, w, t = _inputs(args, "cpu")
    if _reset_peak_rss():
        method, base = "VmHWM after clear_refs", _proc_status_kib("VmRSS")
    else:
        method, base = "ru_maxrss delta", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    loss = _step(fn, x, w, t)
    seconds = time.perf_counter() - start
    peak = (
        _proc_status_kib("VmHWM")
        if method.startswith("VmHWM")
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    )
    backend = "torch" if args.worker == "reference" else _fused_backend(x)
    print(json.dumps({"peak_mib": (peak - base) / KIB, "time_ms": seconds * 1e3,
                      "loss": loss, "backend": backend, "method": method}))  # fmt: skip


def _measure_cpu(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--n", str(args.n)]
    cmd += ["--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure_cuda(variant: str, args: argparse.Namespace, iters: int = 10) -> dict:
    fn = {"reference": _reference, "fused": _fused}.get(variant)
    if fn is None:  # "compiled"
        fn = torch.compile(_reference)
    x, w, t = _inputs(args, "cuda")
    for _ in range(2):  # warm-up (and compile)
        _step(fn, x, w, t)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = _step(fn, x, w, t)
    peak = torch.cuda.max_memory_allocated() - base
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        _step(fn, x, w, t)
    end.record()
    torch.cuda.synchronize()
    backend = (
        _fused_backend(x) if variant == "fused" else "torch" if fn is _reference else "inductor"
    )
    return {"peak_mib": peak / KIB**2, "time_ms": begin.elapsed_time(end) / iters,
            "loss": loss, "backend": backend, "method": "cuda max_memory_allocated"}  # fmt: skip


def _print_table(rows: list[dict]) -> None:
    head = f"{'variant':<10} {'backend':<34} {'peak MiB':>10} {'x reference':>12} {'time ms':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['variant']:<10} {r['backend']:<34} {r['peak_mib']:>10.1f} "
              f"{r['ratio_to_reference']:>12.3f} {r['time_ms']:>10.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    args = _parse_args(argv)
    if args.worker:
        _worker(args)
        return []
    cuda = torch.cuda.is_available()
    variants = ["reference", "fused"] + (["compiled"] if cuda else [])
    results = {v: (_measure_cuda(v, args) if cuda else _measure_cpu(v, args)) for v in variants}
    ref_peak = results["reference"]["peak_mib"]
    rows = []
    for variant, r in results.items():
        rows.append({"kernel": "linear_cross_entropy", "variant": variant,
                     "device": "cuda" if cuda else "cpu", "n": args.n, "hidden": args.hidden,
                     "vocab": args.vocab, "dtype": args.dtype, **r,
                     "ratio_to_reference": r["peak_mib"] / ref_peak if ref_peak else float("nan")})  # fmt: skip
    logits_mib = args.n * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits / 8 / KIB**2
    print(f"linear+cross-entropy fwd+bwd, N={args.n} H={args.hidden} V={args.vocab} "
          f"{args.dtype} on {'cuda' if cuda else 'cpu'}; one [N, V] logits tensor = "
          f"{logits_mib:.0f} MiB; peak = step's peak memory above its inputs "
          f"({rows[0]['method']})")  # fmt: skip
    _print_table(rows)
    losses = {r["variant"]: r["loss"] for r in rows}
    print("losses:", ", ".join(f"{k}={v:.6f}" for k, v in losses.items()))
    if args.csv:
        from autopar.views.bench import write_rows_csv

        write_rows_csv(args.csv, rows)
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
