"""A step's index arrays on their way to the device.

On the CPU a numpy array is handed to torch as it is (no copy). On CUDA each kind of array goes
through its own preallocated pinned host buffer with a non-blocking copy, so preparing a step
never waits on the device and never allocates pinned memory (slow) per step. A buffer is reused
by the next step only after this one has synchronised (the engine fetches the sampled tokens at
the end of every step), so an in-flight copy is never overwritten.
"""

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, initial_capacity: int = 1024):
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._initial_capacity = initial_capacity

    def to_device(self, name: str, values: np.ndarray) -> torch.Tensor:
        """`values` (int64 or float32, 1-D or 2-D) as a tensor on the device."""
        values = np.ascontiguousarray(values)
        host = torch.from_numpy(values)
        if not self.pinned:
            return host
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < values.size or buffer.dtype != host.dtype:
            size = max(values.size, self._initial_capacity, 2 * (buffer.numel() if buffer is not None else 0))
            buffer = torch.empty(size, dtype=host.dtype, pin_memory=True)
            self._buffers[name] = buffer
        staged = buffer[: values.size]
        staged.copy_(host.reshape(-1))
        return staged.view(values.shape).to(self.device, non_blocking=True)
