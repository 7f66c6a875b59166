"""Whether the policy's weights changed since an inference engine's last push.

    weights_version(policy)  per parameter: its autograd version (bumped by in-place updates such as torch
                             optimizers' steps and ``load_state_dict``) and its fp64 sum (for writers that bypass
                             the version counter, e.g. bitsandbytes' 8-bit optimizers); of this rank's shard
                             under FSDP2 (no collective)

The push itself sends ``lit_gspo.models.hf_weights`` whole every time: vLLM reloads a stacked layer (q, k, v → qkv)
only once all its parts arrived, and a partial push leaves it corrupted.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@torch.no_grad()
def weights_version(policy: nn.Module) -> tuple:
    """A fingerprint of ``policy``'s parameters: equal before and after only when no parameter was written."""
    local = ((p, p.to_local() if isinstance(p, DTensor) else p) for p in policy.parameters())
    return tuple((id(p), shard._version, float(shard.detach().sum(dtype=torch.float64))) for p, shard in local)
