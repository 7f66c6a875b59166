"""policy.ref_sync (TR-DPO's reference syncing, TRL's sync_ref_model): π_ref ← α·π_θ + (1 − α)·π_ref after every n-th
RL step, in a fit as a user runs it."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_trainer import tiny_args
from torch import nn

from lit_gspo.rl.config import ReferenceSync
from lit_gspo.rl.reference_sync import sync_reference
from lit_gspo.tools.main import cli_main


def test_sync_moves_every_parameter_by_alpha():
    torch.manual_seed(0)
    policy, reference = nn.Linear(3, 2), nn.Linear(3, 2)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    sync_reference(reference, policy, 0.25)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(value, 0.25 * policy.state_dict()[name] + 0.75 * before[name])
    with pytest.raises(ValueError, match="do not hold the same parameters"):
        sync_reference(nn.Linear(3, 2, bias=False), policy, 0.5)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match=r"mixup_alpha must be in \(0, 1\] \(1: a reset\), got 1.5"):
        ReferenceSync(mixup_alpha=1.5)
    with pytest.raises(ValueError, match="every_n_steps must be >= 1, got 0"):
        ReferenceSync(every_n_steps=0)


class Weights(Callback):
    """The policy's and the reference's weights at the start and after each RL step."""

    def __init__(self):
        self.policy, self.reference = [], []

    def snap(self, module):
        self.policy.append({k: v.detach().clone() for k, v in module.policy.state_dict().items()})
        self.reference.append({k: v.detach().clone() for k, v in module.ref_policy.state_dict().items()})

    def on_train_start(self, trainer, module):
        self.snap(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.snap(module)


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_a_fit_syncs_the_reference_after_every_nth_step(tmp_path, alpha):
    args = tiny_args(tmp_path, "--model.policy.ref_sync", f"{{every_n_steps: 2, mixup_alpha: {alpha}}}")
    cli = cli_main(args, run=False)
    weights = Weights()
    cli.trainer.callbacks.append(weights)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    policy, reference = weights.policy, weights.reference  # index k: after RL step k (0: the start)
    assert len(policy) == 4
    for k in (1, 3):  # no sync after steps 1 and 3: the reference as it was
        assert all(torch.equal(reference[k][n], reference[k - 1][n]) for n in reference[k])
    assert any(not torch.equal(policy[3][n], reference[3][n]) for n in policy[3])
    for name, value in reference[2].items():  # after step 2: α·π_2 + (1 − α)·π_ref
        torch.testing.assert_close(value, alpha * policy[2][name] + (1 - alpha) * reference[1][name])
    assert any(not torch.equal(reference[2][n], reference[1][n]) for n in reference[2])


def test_a_run_without_a_reference_of_its_own_is_refused_in_one_line(tmp_path):
    sync = ["--model.policy.ref_sync", "{every_n_steps: 2}"]
    with pytest.raises(ValueError, match="policy.ref_sync moves the reference toward the policy, but this run keeps"):
        cli_main(tiny_args(tmp_path, *sync, "--model.policy.kl_to_ref", "false"), run=False)
    with pytest.raises(ValueError, match="with LoRA the reference is the base model with the adapters off"):
        cli_main(tiny_args(tmp_path, *sync, "--model.policy.lora", "{r: 4}"), run=False)
