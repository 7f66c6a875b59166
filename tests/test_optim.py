"""bitsandbytes 8-bit optimizers: picked by class path, 8-bit state where bitsandbytes uses it, and on FSDP2 shards."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lit_gspo.runtime.optim import optimizer_state_bytes, shard_aware, state_dtypes
from lit_gspo.tools.main import cli_main

bnb = pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]


def tiny_args(tmp_path, *extra):
    return [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "1",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "64",
        "--data.num_val",
        "8",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.generation.max_new_tokens",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


@pytest.mark.parametrize("name", ["AdamW8bit", "PagedAdamW8bit", "Lion8bit"])
def test_8bit_optimizer_by_class_path_keeps_uint8_state_for_tensors_of_4096_elements_or_more(tmp_path, name):
    cli = cli_main(
        tiny_args(tmp_path, "--model.optimizer", f"bitsandbytes.optim.{name}", "--model.optimizer.lr", "0.001"),
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    opt = cli.trainer.optimizers[0]
    assert type(opt).__name__ == name  # unsharded parameters: the optimizer is left as it is
    assert opt.state, "no optimizer step was taken"
    for param, state in opt.state.items():
        # bitsandbytes' rule: 8-bit state for tensors with >= min_8bit_size (4096) elements, fp32 below
        expected = torch.uint8 if param.numel() >= 4096 else torch.float32
        assert state["state1"].dtype == expected, (tuple(param.shape), state["state1"].dtype)
    dtypes = state_dtypes(opt)["state1"]
    assert dtypes == {torch.uint8, torch.float32}
    n = sum(p.numel() for p in cli.model.policy.parameters())
    per_param = optimizer_state_bytes(opt) / n
    two_states = name != "Lion8bit"
    # fp32 state: 8 (AdamW) / 4 (Lion) bytes per parameter; this tiny model has many small fp32-state tensors
    assert per_param < (4.0 if two_states else 2.0), per_param


def test_torch_optimizers_and_unsharded_parameters_are_left_alone():
    params = [torch.nn.Parameter(torch.randn(4))]
    adam = torch.optim.AdamW(params)
    assert shard_aware(adam) is adam and type(adam) is torch.optim.AdamW
    eight = bnb.optim.AdamW8bit(params)
    assert type(shard_aware(eight)) is bnb.optim.AdamW8bit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_process_group():
    """A world of one (gloo), enough to make FSDP2 DTensor parameters in-process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _model(mesh=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _steps(model, opt, n, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(8, 64, generator=generator)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def _full(model):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit"])
def test_on_fsdp2_parameters_the_update_runs_on_local_shards_and_the_state_round_trips(one_process_group, name):
    """World of one: the local shard is the whole tensor, so the update must equal plain bitsandbytes' exactly."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    cls = getattr(bnb.optim, name)
    plain = _model()
    plain_opt = cls(plain.parameters(), lr=1e-2)
    sharded = _model(one_process_group)
    sharded_opt = shard_aware(cls(sharded.parameters(), lr=1e-2))
    assert type(sharded_opt).__name__ == f"ShardAware{name}"
    _steps(plain, plain_opt, 3, seed=1)
    _steps(sharded, sharded_opt, 3, seed=1)
    for key, value in _full(sharded).items():
        torch.testing.assert_close(value, plain.state_dict()[key], atol=0, rtol=0)
    # the 8192-element weight keeps uint8 state, the 128-element bias fp32 (decided on the full parameter)
    weight, bias = sharded[0].weight, sharded[0].bias
    assert sharded_opt.state[weight]["state1"].dtype == torch.uint8
    assert sharded_opt.state[bias]["state1"].dtype == torch.float32

    saved = get_optimizer_state_dict(sharded, sharded_opt)  # what ModelParallelStrategy checkpoints
    restored = _model(one_process_group)
    restored.load_state_dict(sharded.state_dict())
    restored_opt = shard_aware(cls(restored.parameters(), lr=1e-2))
    set_optimizer_state_dict(restored, restored_opt, optim_state_dict=saved)
    for p_old, p_new in zip(sharded.parameters(), restored.parameters()):
        for key, value in sharded_opt.state[p_old].items():
            other = restored_opt.state[p_new][key]
            assert type(other) is torch.Tensor or not isinstance(other, torch.Tensor)  # local tensors, not DTensors
            assert (value == other).all() if isinstance(value, torch.Tensor) else value == other, key
    _steps(sharded, sharded_opt, 2, seed=2)
    _steps(restored, restored_opt, 2, seed=2)
    for key, value in _full(sharded).items():
        torch.testing.assert_close(_full(restored)[key], value, atol=0, rtol=0)


def test_shard_aware_builds_its_subclass_with_the_optimizers_own_settings(one_process_group):
    sharded = _model(one_process_group)
    weight, bias = sharded[0].weight, sharded[0].bias
    opt = bnb.optim.AdamW8bit(
        [{"params": [weight], "lr": 3e-3}, {"params": [bias]}],
        lr=1e-2,
        betas=(0.8, 0.9),
        min_8bit_size=100,
        is_paged=True,
    )
    aware = shard_aware(opt)
    assert type(aware).__name__ == "ShardAwareAdamW8bit" and isinstance(aware, bnb.optim.AdamW8bit)
    assert aware is not opt and type(opt) is bnb.optim.AdamW8bit  # built, not converted
    assert [g["lr"] for g in aware.param_groups] == [3e-3, 1e-2] and aware.defaults["betas"] == (0.8, 0.9)
    assert vars(aware.args) == vars(opt.args) and aware.args.min_8bit_size == 100 and aware.is_paged
    assert aware.param_groups[0]["params"][0] is weight
