"""The devices a memory plan is made for: each one's memory, whether CPU and GPU share it (Jetson)
and the reserve that comes off it (plan.py's docstring: Budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .sizes import PlanError

GIB = 1 << 30
JETSON_RESERVE_MIN_GIB = 1.5
JETSON_RESERVE_FRACTION = 0.10
WORKSTATION_RESERVE_GIB = 0.5


class UnknownDevice(PlanError, KeyError):
    """The device name is not in the device table."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.args[0] if self.args else ""


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    memory_gib: float
    shared: bool  # True: Jetson, one memory for CPU and GPU
    note: str = ""

    @property
    def reserve_gib(self) -> float:
        if self.shared:
            return max(JETSON_RESERVE_MIN_GIB, JETSON_RESERVE_FRACTION * self.memory_gib)
        return WORKSTATION_RESERVE_GIB

    @property
    def budget_bytes(self) -> int:
        return int((self.memory_gib - self.reserve_gib) * GIB)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "label": self.label,
            "memory_gib": self.memory_gib,
            "shared": self.shared,
            "reserve_gib": round(self.reserve_gib, 2),
            "budget_gib": round(self.budget_bytes / GIB, 2),
            "note": self.note,
        }


DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device("orin-nano-4gb", "Jetson Orin Nano 4GB", 4, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("orin-nano-8gb", "Jetson Orin Nano 8GB", 8, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("orin-nx-8gb", "Jetson Orin NX 8GB", 8, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("orin-nx-16gb", "Jetson Orin NX 16GB", 16, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("agx-orin-32gb", "Jetson AGX Orin 32GB", 32, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("agx-orin-64gb", "Jetson AGX Orin 64GB", 64, True, "JetPack 6.1+, TensorRT 10.3"),
        Device("thor", "Jetson AGX Thor (128 GB)", 128, True, "JetPack 7, a newer TensorRT 10.x"),
        Device("rtx-4090", "GeForce RTX 4090 (workstation)", 24, False, "24 GB GDDR6X"),
        Device("h200", "H200 (workstation / server)", 141, False, "141 GB HBM3e"),
    )
}


def get_device(name: str) -> Device:
    key = name.strip().lower()
    if key not in DEVICES:
        raise UnknownDevice(f"device {name!r} is unknown; known devices: {', '.join(DEVICES)}")
    return DEVICES[key]
