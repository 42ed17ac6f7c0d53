"""A device's fitted rates as text: what `autopar calibrate` measured, to read beside the
step times a plan predicts from them (`device_lines`)."""

from __future__ import annotations

from autopar.hardware import DeviceSpec
from autopar.views.layers import fmt_bytes

__all__ = ["device_lines"]

_OPTIMIZERS = {0: "SGD", 1: "SGD momentum", 2: "AdamW"}


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.4g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.4g} GFLOP/s"


def device_lines(device: DeviceSpec) -> list[str]:
    """One line per kind of figure the cost model prices compute with (those the device
    has: a preset has no curve, op rates or update rates)."""
    flops = ", ".join(f"{k} {_flops(v)}" for k, v in device.peak_flops.items())
    lines = [f"matmul: {flops} (x{device.matmul_efficiency:.2g} achieved)"]
    if device.matmul_half_flops:
        lines[-1] += f"; half rate at {device.matmul_half_flops / 1e6:.3g} MFLOP a kernel"
    if device.matmul_half_dim:
        lines[-1] += f"; half rate at a side of {device.matmul_half_dim:.3g}"
    rate = device.memory_bandwidth * device.memory_efficiency
    memory = f"memory-bound: {rate / 1e9:.4g} GB/s"
    if device.memory_curve:
        memory = "memory-bound: " + ", ".join(
            f"{device.memory_bandwidth * f / 1e9:.3g} GB/s at {fmt_bytes(b)}"
            for b, f in device.memory_curve
        )
    if device.memory_in_place:
        memory += f"; in place {device.memory_in_place / 1e9:.3g} GB/s"
    lines.append(memory)
    attention = f"attention: x{device.attention_efficiency:.2g} of the matmul peak"
    if device.attention_half_seq:
        attention += f", half rate at {device.attention_half_seq:.3g} keys"
    if device.attention_block:
        attention += f", causal key tile {device.attention_block:.0f}"
    lines.append(attention)
    if device.op_rates:
        rates = ", ".join(f"{op} {r / 1e9:.3g}" for op, r in device.op_rates)
        lines.append(f"elementwise arithmetic (G elements/s): {rates}")
    for states in sorted({k for k, _, _ in device.update_rates}):
        name = _OPTIMIZERS.get(states, f"{states} states")
        sizes = ", ".join(
            f"{r / 1e9:.3g} at {fmt_bytes(4 * n)}" for k, n, r in device.update_rates if k == states
        )
        lines.append(f"optimizer update, {name} (G elements/s by float32 tensor): {sizes}")
    lines.append(
        f"launch {device.launch_overhead * 1e6:.3g} us a kernel; "
        f"{device.overlap_efficiency:.2g} of a collective hides under compute"
    )
    if device.core_share < 1:
        lines[-1] += f"; measured on {device.core_share:.2g} of a CPU core a process"
    return lines
