"""The machine a speed figure or a timed choice belongs to, named the same way everywhere (the tuned trees'
keys, the linear kernel chosen per machine)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """The device as its kernels' speed depends on it: the GPU's model, or the CPU's."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{device.type}:{model or platform.processor() or platform.machine()}"
