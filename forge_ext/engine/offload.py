"""Moving an engine's parameters, gradients and optimizer state between the accelerator and
host memory (verl's parameter and optimizer offload, ``verl/utils/fsdp_utils.py``
``offload_fsdp2_model_to_cpu`` / ``offload_fsdp_optimizer``: same idea, written here for
torchtitan's model parts and ``OptimizersContainer``).

Every move is a copy to the other device (pinned host memory when the source is on an
accelerator, so the way back can be asynchronous), never a cast: a round trip returns the same
bits. A tensor already on the target device is left as it is (no copy), which makes every move
the identity on a machine without an accelerator. FSDP2 modules re-bind their sharded
parameters after a device move through their own ``_apply`` override
(``FSDPModule._apply`` -> ``FSDPParam.reset_sharded_param``), the path ``module.to(device)``
takes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def same_place(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` already lives on ``device`` (its local shard, for a DTensor)."""
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if local.device.type != device.type:
        return False
    return device.index is None or local.device.index in (None, device.index)


def moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` copied onto ``device`` (exact), or ``tensor`` itself when it is there
    already. Host copies of accelerator tensors are pinned. A DTensor keeps its mesh and
    placements; only its local shard moves."""
    if same_place(tensor, device):
        return tensor
    if isinstance(tensor, DTensor):
        # Same spec (mesh, placements, global shape), the local shard elsewhere: the way
        # DTensor's own dispatch wraps results (aten._to_copy of a DTensor gives the same).
        # Not DTensor.from_local: it moves a local tensor back to the mesh's device type.
        local = moved(tensor._local_tensor, device)
        return DTensor(local, tensor._spec, requires_grad=tensor.requires_grad)
    if device.type == "cpu" and tensor.device.type != "cpu":
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor.to(device, non_blocking=True, copy=True)


@torch.no_grad()
def move_modules(modules: Iterable[torch.nn.Module], device: torch.device) -> None:
    """Move every parameter, its gradient and every buffer of ``modules`` to ``device``
    (``nn.Module._apply``: gradients travel with their parameters, since torch keeps a
    gradient on its parameter's device)."""
    for module in modules:
        module._apply(lambda t: moved(t, device))


def local_device(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor``'s data lives (its local shard's device, for a DTensor)."""
    return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).device


def modules_on(modules: Iterable[torch.nn.Module], device: torch.device) -> bool:
    """Whether every parameter, gradient and buffer of ``modules`` is on ``device``."""
    for module in modules:
        for p in module.parameters():
            if not same_place(p, device) or (p.grad is not None
                                             and not same_place(p.grad, device)):
                return False
        if not all(same_place(b, device) for b in module.buffers()):
            return False
    return True


@torch.no_grad()
def move_optimizer_state(optimizers: Iterable[torch.optim.Optimizer], device: torch.device,
                         homes: dict[tuple[int, str], torch.device]) -> None:
    """Move every tensor of the optimizers' per-parameter state (Adam's ``exp_avg``,
    ``exp_avg_sq``, ...) to host memory (``device`` the CPU) or back to where each was.

    Args:
        homes: ``(id(param), state key) -> device`` of each state tensor before its first
            move to the host, filled on the way out and emptied on the way back, so that a
            tensor that lives on the CPU with the model on the accelerator (Adam's ``step``
            counter, unless fused or capturable) stays there, and a second move out keeps
            the first record.
    """
    to_host = device.type == "cpu"
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                where = (id(param), key)
                if to_host:
                    homes.setdefault(where, local_device(value))
                    state[key] = moved(value, device)
                else:
                    state[key] = moved(value, homes.pop(where, device))
