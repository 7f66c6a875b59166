"""Reading the update's numbers on the host, together, when they are needed rather than when they are made.

On a GPU each ``float(tensor)`` (or ``bool``, ``int``, a mask's size) stops the host until the device has run every
kernel queued before it; between a micro-batch's forward and its backward that leaves the device idle while the host
launches the next kernels. A micro-step's metrics and loss therefore stay on the device as they are computed and are
read here: the losses of a minibatch before its optimiser step, the metrics of the update at its end, each device's
values in one copy. The numbers are those ``float`` would give, value for value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: a metric as a micro-step leaves it: a float, a 0-d tensor, or a function that computes one (deferred work)
Value = float | Tensor | Callable[[], Tensor]


def host_floats(values: list[float | Tensor]) -> list[float]:
    """``[float(v) for v in values]``, each device's tensors copied to the host at once."""
    out: list = [value if isinstance(value, Tensor) else float(value) for value in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor):
            by_device.setdefault(value.device, []).append(i)
    for indices in by_device.values():  # float64 holds every float32, bf16 and integer count exactly
        read = torch.stack([values[i].detach().reshape(()).double() for i in indices]).tolist()
        for i, number in zip(indices, read):
            out[i] = number
    return out


def records_on_host(records: list[tuple[dict[str, Value], float]]) -> list[tuple[dict[str, float], float]]:
    """The update's (metrics, weight) records with every metric a float (deferred ones computed first)."""
    keys = [list(metrics) for metrics, _ in records]
    values = [value() if callable(value) else value for metrics, _ in records for value in metrics.values()]
    numbers = iter(host_floats(values))
    return [(dict(zip(names, numbers)), weight) for names, (_, weight) in zip(keys, records)]
