"""GPU utilisation and memory of this node from NVML (nvidia-ml-py, in the tracking extra; libnvidia-ml ships with
the driver). Nothing where NVML or a GPU is missing: CPU nodes, or a node without the package."""
from __future__ import annotations

import functools


@functools.cache
def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:   # noqa: BLE001  (no package, no driver, no device: nothing to log)
        return None


def gpu_figures() -> dict[str, float]:
    """{"gpu<i>/util_pct", "gpu<i>/mem_used(GiB)", "gpu<i>/mem_pct"} per GPU NVML sees ({} without one); under
    Slurm's cgroups that is the job's GPUs of this node."""
    nvml = _nvml()
    if nvml is None:
        return {}
    out: dict[str, float] = {}
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out[f"gpu{i}/util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            out[f"gpu{i}/mem_used(GiB)"] = mem.used / 2**30
            out[f"gpu{i}/mem_pct"] = 100.0 * mem.used / mem.total if mem.total else 0.0
    except Exception:   # noqa: BLE001  (a GPU fallen off the bus must not stop a step's metrics)
        return out
    return out
