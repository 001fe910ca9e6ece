"""Accelerators the planner and the roofline profiles know: memory, HBM bandwidth, dense BF16 FLOPs.

Public datasheet numbers (SXM parts where there are several; dense, i.e. without 2:4 sparsity):
- H200 SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS BF16 (nvidia.com/en-us/data-center/h200, "1,979 with sparsity").
- H100 SXM: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 (H100 datasheet, "1,979 with sparsity").
- H800 SXM: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16: the H100's compute and memory, NVLink cut to 400 GB/s.
- H20: 96 GB HBM3, 4.0 TB/s, 148 TFLOPS BF16 (NVIDIA HGX H20 product brief).
- A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s, 312 TFLOPS BF16 (A100 datasheet, "624 with sparsity").
- A10: 24 GB GDDR6, 600 GB/s, 125 TFLOPS BF16 (A10 datasheet, "250 with sparsity").
- L20: 48 GB GDDR6, 864 GB/s, 119.5 TFLOPS BF16 (L20 product brief, "239 with sparsity").
Memory is the advertised decimal GB (1e9 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

_GB = 1e9
_TB = 1e12


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float  # HBM (or GDDR) bandwidth
    flops_per_s: float  # dense BF16 tensor-core FLOP/s

    def describe(self) -> str:
        return (f"{self.name}: {self.memory_bytes / _GB:g} GB, {self.bandwidth_bytes_per_s / _TB:g} TB/s, "
                f"{self.flops_per_s / _TB:g} TFLOPS BF16 dense")


DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (
    DeviceSpec("H200", 141 * _GB, 4.8 * _TB, 989 * _TB),
    DeviceSpec("H100", 80 * _GB, 3.35 * _TB, 989 * _TB),
    DeviceSpec("H800", 80 * _GB, 3.35 * _TB, 989 * _TB),
    DeviceSpec("H20", 96 * _GB, 4.0 * _TB, 148 * _TB),
    DeviceSpec("A100-80G", 80 * _GB, 2.039 * _TB, 312 * _TB),
    DeviceSpec("A10", 24 * _GB, 0.6 * _TB, 125 * _TB),
    DeviceSpec("L20", 48 * _GB, 0.864 * _TB, 119.5 * _TB),
)}


def device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}: one of {', '.join(DEVICES)}, or give explicit numbers") from None
