"""StaticCacheSampler on CPU (eager, the same static cache as on CUDA): the lean sampler's greedy tokens, the trainer's
log-probs, caches reused across calls of one bucket, seeded draws, a CLI fit with it, the default engine per device."""

import copy
import csv
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from lit_gspo.rl.engines import HFGenerate, LeanSampler, StaticCacheSampler, default_engine
from lit_gspo.rl.engines.static_cache import SPARE_SLOTS
from lit_gspo.rl.rollout import token_logprobs

PAD, EOS = 0, 1  # conftest.py's tiny model
PROMPTS = [[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]]  # left padding differs per row
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen3():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=23,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=2,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(params=["llama", "qwen3"])
def any_model(request, model, qwen3):
    return {"llama": model, "qwen3": qwen3}[request.param]


def sample(engine, model, prompts=PROMPTS, seed=0, max_new_tokens=12, eos_id=EOS, **kwargs):
    torch.manual_seed(seed)
    return engine.sample(
        model, prompts, num_generations=3, max_new_tokens=max_new_tokens, pad_id=PAD, eos_id=eos_id, **kwargs
    )


def eos_that_ends_some_rows_early(model) -> int:
    """A token the greedy completions emit in some rows but not all, so that rows end by EOS and by the limit alike."""
    free = sample(LeanSampler(), model, greedy=True, eos_id=-1)  # no EOS: every row runs to the limit
    completions = free.input_ids[:, free.prompt_length :]
    for token in range(3, model.config.vocab_size):
        ends = (completions == token).any(1)
        if ends.any() and not ends.all():
            return token
    raise AssertionError("no token ends some rows but not all")


def test_greedy_tokens_and_logprobs_are_the_lean_samplers_and_generates(any_model):
    eos = eos_that_ends_some_rows_early(any_model)
    ours = sample(StaticCacheSampler(), any_model, greedy=True, return_logprobs=True, eos_id=eos)
    lengths = ours.completion_mask.sum(1)
    assert lengths.max() == 12 and lengths.min() < 12  # the limit and an early EOS both happen
    assert ours.input_ids[:, : ours.prompt_length].eq(PAD).any()  # left padding
    for other in (LeanSampler(), HFGenerate()):
        theirs = sample(other, any_model, greedy=True, return_logprobs=True, eos_id=eos)
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(
            ours.completion_mask, theirs.completion_mask
        )
        torch.testing.assert_close(ours.engine_logprobs, theirs.engine_logprobs, atol=2e-5, rtol=0)


def test_sampled_logprobs_are_the_trainers_in_fp32(any_model):
    batch = sample(StaticCacheSampler(), any_model, temperature=0.7, return_logprobs=True)
    mask = batch.completion_mask
    assert batch.engine_logprobs.dtype == torch.float32 and batch.engine_logprobs.shape == mask.shape
    assert batch.engine_logprobs[~mask].eq(0).all() and (batch.engine_logprobs[mask] < 0).all()
    with torch.no_grad():
        trainer = token_logprobs(any_model, batch, temperature=0.7).logprobs
    torch.testing.assert_close(batch.engine_logprobs[mask], trainer[mask], atol=2e-5, rtol=0)


def test_with_top_k_the_logprobs_are_of_the_renormalised_distribution(model):
    batch = sample(StaticCacheSampler(), model, top_k=3, return_logprobs=True)
    mask = batch.completion_mask
    with torch.no_grad():
        trainer = token_logprobs(model, batch).logprobs
    assert (
        (batch.engine_logprobs - trainer)[mask] > 1e-4
    ).all()  # the 3 kept tokens' mass is < 1 under the full softmax


def test_calls_within_one_bucket_reuse_the_cache_and_a_longer_or_wider_call_builds_another(model):
    engine = StaticCacheSampler()
    sample(engine, model)  # 9 rows -> bucket 16; 5 + 12 tokens -> cache of 64
    (cache,) = engine.caches.values()
    sample(engine, model, prompts=[[3, 4], [5, 6, 7], [8], [9, 10]], max_new_tokens=20)  # 12 rows, 3 + 20 tokens
    assert engine.caches_built == 1 and engine.caches[16] is cache
    sample(engine, model, prompts=PROMPTS * 2)  # 18 rows -> bucket 32
    assert engine.caches_built == 2 and set(engine.caches) == {16, 32}
    sample(engine, model, max_new_tokens=70)  # 5 + 70 tokens: the 16-row cache grows to 128
    assert engine.caches_built == 3 and engine.caches[16].layers[0].max_cache_len == 128 + SPARE_SLOTS


def test_a_fixed_cache_length_is_kept_and_a_prompt_too_long_for_it_refused(model):
    engine = StaticCacheSampler(max_cache_len=40)
    sample(engine, model)
    sample(engine, model, max_new_tokens=30)
    assert engine.caches_built == 1 and engine.caches[16].layers[0].max_cache_len == 40 + SPARE_SLOTS
    with pytest.raises(ValueError, match="max_cache_len=40"):
        sample(engine, model, max_new_tokens=36)


def test_finished_rows_decode_pads_and_the_loop_stops_at_the_next_check(model):
    ids = torch.tensor([[10, 11, 12]])  # its greedy completion ends by EOS after 3 tokens (see the test above)
    args = dict(
        num_generations=2,
        max_new_tokens=12,
        pad_id=PAD,
        eos_id=EOS,
        sampling={},
        synced_gpus=False,
        return_logprobs=True,
    )
    every_step, logprobs = StaticCacheSampler(finished_check_every=1).generate(model, ids, torch.ones_like(ids), **args)
    assert every_step[:, 3:].tolist() == [[5, 10, EOS]] * 2 and (logprobs < 0).all()
    every_4, logprobs = StaticCacheSampler(finished_check_every=4).generate(model, ids, torch.ones_like(ids), **args)
    assert every_4[:, 3:].tolist() == [[5, 10, EOS, PAD]] * 2 and logprobs[:, 3].eq(0).all()


def test_seeded_sampling_is_reproducible(qwen3):
    engine = StaticCacheSampler()
    first, again = (sample(engine, qwen3, seed=7, return_logprobs=True) for _ in range(2))
    other = sample(engine, qwen3, seed=8)
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.engine_logprobs, again.engine_logprobs)
    assert not torch.equal(first.input_ids, other.input_ids)


def test_the_default_engine_is_the_static_cache_sampler_on_cuda_only():
    assert type(default_engine(torch.device("cuda", 0))) is StaticCacheSampler
    assert type(default_engine("cpu")) is HFGenerate  # the CPU default, unchanged
    assert type(default_engine("cuda", sharded=True)) is HFGenerate  # FSDP2: generate's synced loop, as before


def test_the_modules_default_engine_on_cpu_stays_hf_generate():
    from lit_gspo.lightning.module import RLModule
    from lit_gspo.rl.config import Policy

    assert type(RLModule(policy=Policy(kl_to_ref=False)).collector.engine) is HFGenerate
    assert (
        type(RLModule(engine=StaticCacheSampler(), policy=Policy(kl_to_ref=False)).collector.engine)
        is StaticCacheSampler
    )


def test_a_quickstart_fit_samples_with_it(tmp_path):
    from lit_gspo.tools.main import cli_main

    args = [
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.max_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--model.policy.warm_start.steps",
        "0",
        "--model.validation.every_n_steps",
        "0",
        "--data.num_train",
        "16",
        "--data.num_val",
        "4",
        "--data.prompts_per_step",
        "4",
        "--model.generation.num_generations",
        "4",
        "--model.engine",
        "StaticCacheSampler",
        "--model.engine.finished_check_every",
        "4",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    engine = cli.model.collector.engine
    assert type(engine) is StaticCacheSampler and engine.finished_check_every == 4  # not replaced by the default
    assert engine.caches_built >= 1
    (path,) = tmp_path.rglob("metrics.csv")
    rewards = [float(r["train/reward"]) for r in csv.DictReader(open(path)) if r.get("train/reward")]
    assert len(rewards) == 2


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_tokens(model):
    """torch.compile of the decoding step on CPU (inductor, no CUDA graphs): about a minute on 2 cores."""
    for greedy in (True, False):  # sampled: both invert the CDF at the same uniform draws
        compiled = sample(StaticCacheSampler(compile=True), model, greedy=greedy, return_logprobs=True)
        eager = sample(StaticCacheSampler(compile=False), model, greedy=greedy, return_logprobs=True)
        assert torch.equal(compiled.input_ids, eager.input_ids)
        torch.testing.assert_close(compiled.engine_logprobs, eager.engine_logprobs, atol=1e-5, rtol=0)


def _failing_backend(calls):
    def backend(graph, example_inputs):  # inductor on the H100 (torch 2.11), code generation at a real vocabulary
        calls.append(1)
        raise TypeError("list indices must be integers or slices, not NoneType")

    real_compile = torch.compile
    return lambda fn, **kwargs: real_compile(fn, backend=backend)


def _failing_tracer(calls, error=torch._dynamo.exc.InternalTorchDynamoError):
    def compile(fn, **kwargs):  # Dynamo tracing the step's cache keyword on torch 2.11 (a CPU run of its versions)
        def compiled(*args):
            calls.append(1)
            raise error("AsPythonConstantNotImplementedError: UnspecializedNNModuleVariable is not a constant")

        return compiled

    return compile


@pytest.mark.parametrize(
    "compiler, names",
    [(_failing_backend, "TypeError: list indices must be integers"), (_failing_tracer, "AsPythonConstantNot")],
    ids=["inductor", "dynamo"],
)
def test_a_step_the_compiler_fails_on_decodes_eagerly_with_a_warning_that_names_the_error(
    model, monkeypatch, compiler, names
):
    """On the H100 inductor failed to generate code for the step at a real vocabulary (a split scan), and the fit
    crashed in its first rollout: a compiler's failure is a slower sampler and a warning, not a lost run. The eager
    step draws the same tokens; the compiler is not tried again."""
    calls = []
    monkeypatch.setattr(torch, "compile", compiler(calls))
    torch._dynamo.reset()
    engine = StaticCacheSampler(compile=True)
    with pytest.warns(UserWarning, match=rf"decodes eagerly \(slower\).*{names}"):
        first = sample(engine, model, return_logprobs=True)
    eager = sample(StaticCacheSampler(compile=False), model, return_logprobs=True)
    assert torch.equal(first.input_ids, eager.input_ids) and torch.equal(first.engine_logprobs, eager.engine_logprobs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="StaticCacheSampler decodes eagerly")
        again = sample(engine, model, return_logprobs=True)
    assert torch.equal(again.input_ids, eager.input_ids) and len(calls) == 1


def test_a_refusal_of_the_compiler_is_not_taken_for_its_failure(model, monkeypatch):
    """A recompile under ``fail_on_recompile`` (how the tests hold the step to one graph) still raises."""
    monkeypatch.setattr(torch, "compile", _failing_tracer([], torch._dynamo.exc.RecompileError))
    with pytest.raises(torch._dynamo.exc.RecompileError):
        sample(StaticCacheSampler(compile=True), model)


@pytest.mark.slow
def test_the_compiled_step_compiles_once_per_bucket_across_rl_steps(model):
    """What changes between RL steps (prompt lengths, rows within the bucket, the weights, the temperature,
    validation's inference mode) reuses the compiled step (one for greedy decoding, one for sampling): on CUDA a
    recompile is a new compilation and CUDA graph capture (seconds), and after torch.compile's recompile limit the
    step silently runs eagerly. Without ``generate``'s ``inference_mode(False)`` the inference-mode call recompiles
    (its tensors' dispatch keys differ)."""
    engine = StaticCacheSampler(compile=True)
    policy = copy.deepcopy(model)
    sample(engine, policy, greedy=True)  # compiles the greedy step: 9 rows -> bucket 16, cache of 64
    sample(engine, policy)  # and the sampling one
    with torch.no_grad():
        for p in policy.parameters():  # an optimiser step: the same tensors, new values
            p.add_(0.01 * torch.randn_like(p))
    with torch.compiler.set_stance("fail_on_recompile"):
        sample(engine, policy, prompts=[[3, 4], [5, 6, 7], [8], [9, 10]], max_new_tokens=20)  # 12 rows, shorter
        with torch.inference_mode():
            sample(engine, policy, prompts=[[3, 4, 5, 6], [7], [8, 9]], temperature=0.7)  # 9 rows: bucket 16
        sample(engine, policy, greedy=True)
    assert engine.caches_built == 1


PENALISED = dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3)


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast, precast weights"])
def test_the_decoding_step_compiles_as_one_graph(any_model, autocast):
    """No graph break in the step with the installed transformers (Llama, Qwen3): a break would leave part of every
    token's work outside the CUDA graph on a GPU."""
    torch.compiler.reset()  # the steps compiled by earlier tests count towards dynamo's recompile limit of the function
    engine = StaticCacheSampler(compile=True, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        compiled = sample(engine, any_model, greedy=True)
        drawn = sample(engine, any_model, temperature=0.7, top_k=5, top_p=0.9)  # the sampling step: one graph too
        penalised = sample(engine, any_model, **PENALISED)  # and with min-p and the penalty's tokens-seen buffer
    if not autocast:  # (a graph break raised above) and the one graph decodes the eager step's tokens
        assert torch.equal(compiled.input_ids, sample(StaticCacheSampler(), any_model, greedy=True).input_ids)
        eager = sample(StaticCacheSampler(), any_model, temperature=0.7, top_k=5, top_p=0.9)
        assert torch.equal(drawn.input_ids, eager.input_ids)
        assert torch.equal(penalised.input_ids, sample(StaticCacheSampler(), any_model, **PENALISED).input_ids)


@pytest.mark.slow
def test_a_fit_compiles_the_step_in_its_first_steps_and_never_again(tmp_path):
    """The whole loop as a user runs it (validation at steps 0, 2, 4 and the end, training rollouts, the learner between them):
    once steps 0 and 1 have compiled each row bucket, nothing compiles again."""
    from lightning.pytorch import Callback

    from lit_gspo.tools.main import cli_main

    class NoRecompileAfterStep1(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 1:
                torch.compiler.set_stance("fail_on_recompile")

    args = ["--config", str(ROOT / "configs/quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path)]
    args += ["--trainer.max_steps", "5", "--trainer.enable_progress_bar", "false"]
    args += ["--model.policy.warm_start.steps", "0", "--model.validation.every_n_steps", "2"]
    args += ["--data.num_train", "40", "--data.num_val", "4", "--data.prompts_per_step", "4"]
    args += ["--model.engine", "StaticCacheSampler", "--model.engine.compile", "true"]
    cli = cli_main(args, run=False)
    cli.trainer.callbacks.append(NoRecompileAfterStep1())
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.compiler.set_stance("default")
    (path,) = tmp_path.rglob("metrics.csv")
    rows = list(csv.DictReader(open(path)))
    assert (
        len([r for r in rows if r.get("train/reward")]) == 5 and len([r for r in rows if r.get("val/reward")]) == 4
    )  # 0, 2, 4 and the end


def test_a_cache_built_under_inference_mode_serves_a_later_no_grad_call(model):
    """Validation samples under inference mode, training rollouts under no_grad: both use one cache."""
    engine = StaticCacheSampler()
    with torch.inference_mode():
        first = sample(engine, model, greedy=True)
    again = sample(engine, model, greedy=True)
    assert engine.caches_built == 1 and torch.equal(first.input_ids, again.input_ids)


def test_under_autocast_the_step_reads_precast_weights_with_the_same_tokens_and_logprobs(model):
    """The Linear weights cast once per rollout give what autocast's per-step casts give, bit for bit, and follow the
    policy's updates; every other parameter is the policy's own tensor (no second copy of the model)."""
    policy = copy.deepcopy(model)
    precast, per_step = StaticCacheSampler(), StaticCacheSampler(precast_weights=False)
    for update in range(2):
        if update:
            with torch.no_grad():
                for p in policy.parameters():  # an optimiser step between two rollouts
                    p.add_(0.05 * torch.randn_like(p))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = sample(precast, policy, seed=update, return_logprobs=True)
            theirs = sample(per_step, policy, seed=update, return_logprobs=True)
        assert torch.equal(ours.input_ids, theirs.input_ids)
        assert torch.equal(ours.engine_logprobs, theirs.engine_logprobs)
    view = precast.precast.copy
    linears = {name for name, m in policy.named_modules() if type(m) is torch.nn.Linear}
    for name, tensor in view.named_parameters(remove_duplicate=False):
        module_name = name.rsplit(".", 1)[0]
        if module_name in linears:
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, policy.get_parameter(name).detach().bfloat16())
        else:
            assert tensor is policy.get_parameter(name)  # shared, not copied
    assert view.get_parameter("lm_head.weight").dtype == torch.bfloat16  # a tied head: its own bf16 copy
    assert view.get_parameter("model.embed_tokens.weight") is policy.get_parameter("model.embed_tokens.weight")
    with torch.no_grad():  # outside autocast the step reads the policy itself
        assert precast.precast.view(policy) is policy


def test_a_copy_of_a_used_engine_holds_none_of_its_caches_or_weights(model):
    """An async worker deep-copies the engine: it gets the settings, not the KV caches, compiled step or weights. The
    engine then samples outside autocast: its bf16-valued cache is rebuilt (fp32 values), not written into."""
    engine = StaticCacheSampler(finished_check_every=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sample(engine, model)
    assert engine.caches and engine.precast.copy is not None
    twin = copy.deepcopy(engine)
    assert (twin.caches, twin.caches_built, twin.precast.copy) == ({}, 0, None)
    assert twin.finished_check_every == 4 and engine.caches  # the original keeps its own
    assert torch.equal(sample(twin, model, greedy=True).input_ids, sample(engine, model, greedy=True).input_ids)


def test_precast_weights_with_lora_adapters_sample_what_autocast_samples():
    """PEFT's LoRA layers are not nn.Linear; their base and adapter Linears are precast, with the same numbers."""
    from lit_gspo.models import load_policy
    from lit_gspo.models.lora import apply_lora

    policy, _ = load_policy("tiny-llama", seed=0)
    policy = apply_lora(policy, r=4, alpha=8)
    with torch.no_grad():  # adapters that change the output (lora_B starts at zero)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    precast, per_step = StaticCacheSampler(), StaticCacheSampler(precast_weights=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = sample(precast, policy, return_logprobs=True)
        theirs = sample(per_step, policy, return_logprobs=True)
    assert torch.equal(ours.input_ids, theirs.input_ids)
    assert torch.equal(ours.engine_logprobs, theirs.engine_logprobs)
    adapters = [t for t, _ in precast.precast.pairs if t.shape[0] == 4 or t.shape[1] == 4]  # r = 4
    assert adapters and all(t.dtype == torch.bfloat16 for t in adapters)


def test_under_autocast_the_cache_holds_keys_in_its_dtype_with_the_same_tokens_and_logprobs(any_model):
    """The rotary embedding leaves keys in fp32 under autocast; the attention casts them to bf16 when it reads them. Stored
    in bf16 they take half the memory and reads, and the tokens and log-probs are the same, bit for bit."""

    class AsComputed(StaticCacheSampler):
        store_in_autocast_dtype = False

    ours, as_computed = StaticCacheSampler(), AsComputed()
    for attention in (None, "eager"):
        ours.attn_implementation = as_computed.attn_implementation = attention
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = sample(ours, any_model, return_logprobs=True, seed=1)
            b = sample(as_computed, any_model, return_logprobs=True, seed=1)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.engine_logprobs, b.engine_logprobs)
    ours_layer, computed_layer = ours.caches[16].layers[0], as_computed.caches[16].layers[0]
    assert (ours_layer.keys.dtype, ours_layer.values.dtype) == (torch.bfloat16, torch.bfloat16)
    assert computed_layer.keys.dtype == torch.float32  # what it saves: half the keys' bytes
    sample(ours, any_model)  # outside autocast: fp32 again (the cache is rebuilt)
    assert ours.caches[16].layers[0].keys.dtype == torch.float32


@pytest.mark.parametrize("version, worker_mode", [("2.11.0+cu130", "default"), ("2.13.0", "reduce-overhead")])
def test_a_worker_thread_compiles_the_step_without_cuda_graphs_where_torch_cannot_record_them_there(
    model, monkeypatch, version, worker_mode
):
    """The asynchronous rollouts' worker is a thread: torch < 2.13 records CUDA graphs only in the main thread (on an
    H200 with torch 2.11 the worker's first step failed a bare assert), so there the step compiles without them."""
    import threading

    modes = []

    def recording_compile(fn, mode=None, **kwargs):
        modes.append(mode)
        return fn

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(torch, "__version__", version)
    eager = sample(StaticCacheSampler(compile=False), model, greedy=True)
    sample(StaticCacheSampler(compile=True), model, greedy=True)  # the main thread: CUDA graphs on every version
    in_worker = {}
    worker = threading.Thread(
        target=lambda: in_worker.update(batch=sample(StaticCacheSampler(compile=True), model, greedy=True)),
        name="lit-gspo-rollout-worker",
    )
    with pytest.warns(UserWarning, match="without CUDA graphs") if worker_mode == "default" else nullcontext():
        worker.start()
        worker.join()
    assert modes == ["reduce-overhead", worker_mode]
    assert torch.equal(in_worker["batch"].input_ids, eager.input_ids)


def test_under_fsdp2_the_step_reads_the_policys_own_weights_eagerly(model):
    """FSDP2's modules cannot be deep-copied (the precast weights' copy failed: FSDP2 on one H200, bf16-mixed) and its
    hooks gather the parameters around every forward: the step runs eagerly on the policy, with the eager tokens."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = copy.deepcopy(model)
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = sample(StaticCacheSampler(precast_weights=False), model, greedy=True, return_logprobs=True)
            with pytest.warns(UserWarning, match="eagerly under FSDP2"):
                got = sample(StaticCacheSampler(compile=True), sharded, greedy=True, return_logprobs=True)
    finally:
        dist.destroy_process_group()
    assert torch.equal(got.input_ids, expected.input_ids)
    torch.testing.assert_close(got.engine_logprobs, expected.engine_logprobs, atol=0, rtol=0)


def ops_outside_the_decoding_step(monkeypatch, engine, model, max_new_tokens: int) -> int:
    """The aten ops one sampling call dispatches outside the decoding step (the host's work around each token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import lit_gspo.rl.engines.static_cache as static_cache

    inside = []
    for name in ("decode_next", "decode_next_greedy"):
        step = getattr(static_cache, name)

        def counted(*args, _step=step):
            inside.append(True)
            try:
                return _step(*args)
            finally:
                inside.pop()

        monkeypatch.setattr(static_cache, name, counted)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += not inside
            return func(*args, **(kwargs or {}))

    with Count():
        sample(engine, model, eos_id=-1, max_new_tokens=max_new_tokens)  # no EOS: every row to the limit
    return Count.ops


def test_between_two_tokens_the_host_only_copies_the_step_s_outputs(model, monkeypatch):
    """Drawing, log-probs, EOS and the next input are the decoding step's own work (one CUDA graph per token on a GPU):
    outside it each token costs the host its uniform draw copied in and the token copied out (the former loop ran ~25
    ops a token there: softmax, cumsum, searchsorted, log_softmax, gather, isin, ... each a kernel launch)."""
    short, long = (ops_outside_the_decoding_step(monkeypatch, StaticCacheSampler(), model, T) for T in (12, 44))
    assert (long - short) / 32 <= 6


def test_the_decoding_step_reads_the_cache_without_a_copy_per_query_head(model, monkeypatch):
    """transformers' sdpa under a padding mask, compiled, repeats the cached keys and values once per query head
    (``repeat_kv``) at every token: 5× the cache's bytes moved where the model has half as many key-value heads as
    query heads. In the graph of the step as torch.compile traces it (its tensors' sizes), the step's attention
    (``lit_gqa_eager``) makes no tensor as large as that copy."""
    largest = []

    def recording(graph, example_inputs):
        values = [node.meta.get("example_value") for node in graph.graph.nodes if node.op.startswith("call")]
        largest.append(max(value.numel() for value in values if isinstance(value, torch.Tensor)))
        return graph.forward

    compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kwargs: compile(fn, backend=recording, fullgraph=True, dynamic=False)
    )
    torch.compiler.reset()  # no graph of the step from an earlier test
    config = model.config
    copy_per_head = 16 * config.num_attention_heads * 64 * (config.hidden_size // config.num_attention_heads)
    batches = {}
    for kernel in (None, "lit_gqa_eager"):  # None: the prefill's (sdpa)
        largest.clear()
        batches[kernel] = sample(StaticCacheSampler(compile=True, decode_attention=kernel), model, greedy=True)
        assert largest and (max(largest) >= copy_per_head) == (kernel is None)  # bucket 16, cache 64
    assert torch.equal(batches[None].input_ids, batches["lit_gqa_eager"].input_ids)


def test_a_model_with_more_than_plain_attention_decodes_with_its_own_kernel(qwen3):
    """Soft-capped logits (Gemma 2's ``attn_logit_softcapping``) or attention sinks: the decoding step keeps the
    model's attention instead of lit_gqa_eager's plain one (which would refuse them)."""
    from lit_gspo.rl.engines.static_cache import plain_attention

    policy = copy.deepcopy(qwen3)
    assert plain_attention(policy)
    policy.config.attn_logit_softcapping = 50.0
    assert not plain_attention(policy)
    chosen = []
    original = policy.set_attn_implementation

    def recorded(implementation):
        chosen.append(implementation)
        return original(implementation)

    policy.set_attn_implementation = recorded
    sample(StaticCacheSampler(), policy, greedy=True)
    assert "lit_gqa_eager" not in chosen
    del policy.config.attn_logit_softcapping
    policy.register_parameter("sinks", torch.nn.Parameter(torch.zeros(4)))
    assert not plain_attention(policy)


def test_each_step_reads_the_written_slots_rounded_up_not_the_whole_cache(model):
    """A rollout's cache holds its longest prompt + every new token from the first step on; the step's attention reads
    the slots written so far, rounded up to one of at most 8 lengths (a CUDA graph each), with the same tokens."""
    from lit_gspo.rl.engines.fast_generate import ATTENTION_SLOTS

    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get(ATTENTION_SLOTS)), with_kwargs=True
    )
    try:
        batch = sample(StaticCacheSampler(), model, greedy=True, eos_id=-1, max_new_tokens=70)  # P 5: cache 128
    finally:
        handle.remove()
    decoding = [len(slots) for slots in seen[1:]]  # (the prefill's forward reads the prompt only)
    assert seen[0] is None and len(decoding) == 69
    assert decoding == [64] * 59 + [128] * 10  # step t writes slot 5 + t - 1 and reads up to it
    assert torch.equal(
        batch.input_ids, sample(LeanSampler(), model, greedy=True, eos_id=-1, max_new_tokens=70).input_ids
    )


@pytest.mark.slow
def test_the_compiled_step_reads_more_slots_without_compiling_again(model):
    """The number of slots read is a dynamic size of the one compiled step (on CUDA: a CUDA graph per length)."""
    engine = StaticCacheSampler(compile=True, max_cache_len=128)  # one cache: 64 and 128 slots
    sample(engine, model, greedy=True, max_new_tokens=12)  # compiles, reading 64 slots
    with torch.compiler.set_stance("fail_on_recompile"):
        long = sample(engine, model, greedy=True, eos_id=-1, max_new_tokens=70)  # then 128
    eager = sample(StaticCacheSampler(max_cache_len=128), model, greedy=True, eos_id=-1, max_new_tokens=70)
    assert torch.equal(long.input_ids, eager.input_ids)
