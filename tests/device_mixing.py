"""See on a CPU-only machine the bug class a GPU shows as "Expected all tensors to be on the same device".

The model goes to the ``meta`` device (a stand-in for the GPU: no data, shapes only) and the code under test runs
inside :class:`OneDevicePerOp`, a dispatch mode that refuses any aten op whose tensor arguments span two devices
(0-dim CPU scalars excepted, as CUDA allows them; copies between devices are what moves data, so they pass). That is
stricter than CUDA, which lets a CUDA tensor be indexed by CPU indices: what passes here passes there.

A meta model has no values, so the code under test stops at the first value it reads (``float(loss)``, ``.item()``):
:func:`run_until_a_value_is_read` runs it that far and returns how far it went.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

#: ops that move data between devices (or only look at metadata)
CROSS_DEVICE_OPS = {
    "aten::_to_copy",
    "aten::copy_",
    "aten::_copy_from",
    "aten::_copy_from_and_resize",
    "aten::to",
    "aten::lift_fresh",
    "aten::detach",
    "aten::alias",
    "aten::empty_like",
    "aten::set_",
}


class DeviceMixing(RuntimeError):
    pass


class OneDevicePerOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name not in CROSS_DEVICE_OPS:
            leaves, _ = tree_flatten((args, kwargs))
            devices = {
                t.device
                for t in leaves
                if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
            }
            if len(devices) > 1:
                raise DeviceMixing(f"{func._schema.name} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


#: what a meta tensor says when code asks for its value (the run went as far as a meta model can)
VALUE_READ = ("meta tensors", "Cannot copy out of meta tensor", "cannot be called on meta", "on meta tensor")


def run_until_a_value_is_read(fn, *args, **kwargs) -> str:
    """Run ``fn`` under :class:`OneDevicePerOp`: "done" if it finished, "stopped at a value" if it read a meta tensor's
    value; a device mixing (or any other error) propagates."""
    try:
        with OneDevicePerOp():
            fn(*args, **kwargs)
    except DeviceMixing:
        raise
    except (RuntimeError, NotImplementedError) as error:
        if any(text in str(error) for text in VALUE_READ):
            return "stopped at a value"
        raise
    return "done"
