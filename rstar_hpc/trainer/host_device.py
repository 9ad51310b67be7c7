"""Megatron-core's training machinery on the host: what lets the `cpu` backend run it unchanged.

megatron-core 0.16 writes CUDA into code that is otherwise device-neutral: the schedules count tokens in
`torch.zeros(..., device="cuda")`, the optimizers accept parameters only if `p.type()` is a
`torch.cuda.*Tensor` and keep their scalars on `'cuda'`, the grad buffers and the pipeline's
shape exchange allocate on `torch.cuda.current_device()`, activation recompute saves the CUDA RNG state, and
the dist-checkpoint writer calls `torch.cuda.synchronize()`. On a torch without CUDA, `on_host()` routes exactly
these to the host for as long as it is entered:

  * a `TorchFunctionMode` that turns `device="cuda"` (or a CUDA index) into `"cpu"` in tensor factories and
    `Tensor.to`, makes `Tensor.cuda()` a no-op, and reports host tensors' `type()` as `torch.cuda.*Tensor`;
  * `torch.cuda.current_device()` -> `"cpu"`, `torch.cuda.synchronize()` -> no-op;
  * megatron's CUDA RNG get/set (used by recompute) -> an empty state, no-op (the host generator is still
    saved and restored by megatron itself, and the `cpu` backend has no dropout).

The real DDP, distributed optimizer, schedules, p2p and dist-checkpointing code runs over gloo; nothing of the
parallel machinery is replaced. With CUDA available, `on_host()` does nothing.

The mode costs a Python call per torch call (~35% on a tiny model's forward), so `paused()` lifts it inside
the model's own forward and loss, which never ask for CUDA.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.utils._device
from torch.overrides import TorchFunctionMode

_FACTORIES = torch.utils._device._device_constructors()
_active: list[_HostMode] = []  # the entered mode, if any (paused() needs it)


def _host(device):
    if isinstance(device, int) or (device is not None and str(device).startswith("cuda")):
        return "cpu"
    return device


class _HostMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES:
            if "device" in kwargs:
                kwargs["device"] = _host(kwargs["device"])
        elif func is torch.Tensor.to:
            args = tuple(_host(a) if isinstance(a, (str, torch.device)) else a for a in args)
            if "device" in kwargs:
                kwargs["device"] = _host(kwargs["device"])
        elif func is torch.Tensor.cuda:
            return args[0]
        elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Run megatron-core's CUDA-assuming code on the host (see the module docstring); re-entrant."""
    if torch.cuda.is_available() or _active:
        yield
        return
    import megatron.core.tensor_parallel.random as mrandom

    saved = (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
             mrandom._set_cuda_rng_state)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mode = _HostMode()
    _active.append(mode)
    try:
        with mode:
            yield
    finally:
        _active.pop()
        (torch.cuda.current_device, torch.cuda.synchronize, mrandom._get_cuda_rng_state,
         mrandom._set_cuda_rng_state) = saved


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Lift the device mode of `on_host()` (if entered) for code that never asks for CUDA."""
    if not _active:
        yield
        return
    mode = _active[-1]
    mode.__exit__(None, None, None)
    try:
        yield
    finally:
        mode.__enter__()
