"""Where a role computes (`--device`, resolved by `node.context.resolve_device`) and what crosses to and from it.

The rule every role follows: the device is for compute only. Master weights and optimizer state stay fp32
wherever the module lives (bf16 is an autocast of the compute, never a storage dtype); everything that leaves
the role (a wire tensor to be encoded and signed, a snapshot for the syncer, a value compared by a check) is a
CPU fp32 tensor, so the protocol, the codecs and the checks never see a device.
"""

from __future__ import annotations

import contextlib

import torch


def autocast(device: str | torch.device) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA, nothing elsewhere: CPU (the tested default) and MPS compute in fp32, untouched."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.bfloat16)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An input from the wire (CPU) on the compute device; the same tensor when it is already there."""
    return tensor.to(device)


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A computed tensor as it may leave the role: detached, on the CPU, fp32 (the same tensor on a CPU run)."""
    return tensor.detach().to("cpu", torch.float32)


def to_wire_optional(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else to_wire(tensor)
