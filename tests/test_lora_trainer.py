"""A LoRA trainer on a real Monarch proc mesh under FSDP (DP=2, gloo) with gradient
accumulation equals the same model in one process without either; the GRPO app's hooks
export its adapter (``peft`` loads it and gives the trainer's logits) and take the KL
reference from its base with the adapters disabled."""

import asyncio

import pytest
import pytest_asyncio
import torch
from conftest import assert_grad_close, make_lm_batch

from forge_ext.actors import spawn_trainer
from forge_ext.actors.reference import base_of_trainer
from forge_ext.engine import TitanEngine, cross_entropy_loss, engine_config_from_mapping
from forge_ext.engine import valid_tokens
from forge_ext.engine.distributed import init_single_process_env

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Rank 0's rows hold far fewer valid tokens than rank 1's (31 per row at most).
PREFIX = [27, 28, 29, 30, 0, 1, 2, 1]


def grpo_overrides(checkpoint, output_dir):
    return [
        f"model.hf_path={checkpoint}", f"output_dir={output_dir}", "reference=null",
        "trainer.lora={rank: 4}", "grpo.prompts_per_step=2", "grpo.group_size=4",
        "trainer.training.local_batch_size=4", "trainer.training.microbatch_size=2",
        "trainer.parallelism.data_parallel_shard_degree=2", "trainer.optimizer.lr=1e-2",
        # A large Adam eps keeps updates proportional to gradients (with 1e-8 an update is
        # lr * sign(g), and fp32 noise flips the sign of near-zero gradients).
        "trainer.optimizer.eps=1e-3",
        "trainer.training.max_norm=1e6", "loop.steps=10", "task.num_train=20", "task.num_eval=4",
        "procs.env={}",
    ]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora(demo_checkpoint, tmp_path_factory):
    from apps.grpo.config import load_config

    from pathlib import Path

    demo = Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml"
    output_dir = tmp_path_factory.mktemp("lora_grpo")
    config = load_config(str(demo), grpo_overrides(demo_checkpoint, output_dir))
    # The same model in this process: one rank, one microbatch per step; built in a thread
    # while the trainer's procs start (both are mostly imports and model builds).
    single = engine_config_from_mapping({
        **config.trainer, "parallelism": {}, "checkpoint": {"enable": False},
        "training": {**config.trainer["training"], "local_batch_size": 8,
                     "microbatch_size": None},
    })
    init_single_process_env()
    fsdp, engine = await asyncio.gather(spawn_trainer(config.trainer, num_procs=2),
                                        asyncio.to_thread(TitanEngine, single))
    yield {"config": config, "fsdp": fsdp, "engine": engine, "checkpoint": demo_checkpoint}
    await fsdp.stop()


def split(batch, dp):
    return ([{"input_ids": t} for t in batch["input_ids"].chunk(dp)],
            [{"labels": t} for t in batch["labels"].chunk(dp)])


async def test_fsdp2_with_gradient_accumulation_equals_one_rank_for_the_adapters(lora):
    fsdp, engine = lora["fsdp"], lora["engine"]
    # torchtitan's random A init depends on the mesh: start both from this engine's.
    await fsdp.load_adapter_state_dict({k: v.cpu() for k, v in engine.adapter_state_dict().items()})
    batch = make_lm_batch(8, 32, 16, seed=0, ignore_prefix=PREFIX)
    await fsdp.forward_backward(*split(batch, 2))
    got = await fsdp.get_gradients()
    engine.optimizer_zero_grad()
    engine.forward_backward_batch(engine.microbatches(batch), cross_entropy_loss, valid_tokens)
    want = {n: p.grad.full_tensor() for n, p in engine.model_parts[0].named_parameters()
            if p.grad is not None}
    await fsdp.optim_step()  # lr 1e-2 on both: the first step moves B off zero
    engine.optimizer_step()
    engine.lr_scheduler_step()
    assert set(got) == set(want) and all(".lora_" in n for n in want)  # only adapters
    for name in want:
        assert_grad_close(got[name], want[name], name)
    for _ in range(2):
        loss = await fsdp.train_step(*split(batch, 2))
        expected = engine.train_batch(batch, cross_entropy_loss, valid_tokens)["loss"]
        assert loss == pytest.approx(expected, rel=1e-5)
    adapters = await fsdp.get_adapter_state_dict()
    for k, v in engine.adapter_state_dict().items():
        torch.testing.assert_close(adapters[k], v, rtol=1e-4, atol=1e-6, msg=k)
    assert any(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)


async def test_the_grpo_app_exports_the_adapter_and_takes_the_reference_from_the_base(lora):
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from apps.grpo.main import RLApp

    config, fsdp, engine = lora["config"], lora["fsdp"], lora["engine"]
    assert config.reference_is_trainer_base
    batch = make_lm_batch(8, 32, 16, seed=1, ignore_prefix=PREFIX)
    await fsdp.train_step(*split(batch, 2))  # adapters away from their zero start
    app = RLApp(config)
    app.trainer, app.reference = fsdp, base_of_trainer(fsdp)
    with engine.adapters_disabled():  # the base: this engine's adapters differ, not its base
        want = engine.forward_batch(batch, post_hook=lambda logits, mb: torch.log_softmax(
            logits, -1).gather(-1, mb["labels"].clamp(min=0)[..., None])[..., 0] * (
            mb["labels"] != -100))
    assert_grad_close(await app.reference.logprobs(batch), want, "reference log-probs")

    await app.save_checkpoint(config.loop.steps)  # the last step: adapter and checkpoint
    folder = config.output_dir + "/adapter"
    base = AutoModelForCausalLM.from_pretrained(lora["checkpoint"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base.eval(), folder)
    with torch.no_grad():
        assert_grad_close(peft_model(batch["input_ids"]).logits,
                          await fsdp.forward(*split(batch, 2)), "peft vs trainer")
    step = f"{config.output_dir}/checkpoints/step-{config.loop.steps}"
    keys = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    model = [k for k in keys if k.startswith("layers.")]
    assert model and all(".lora_" in k for k in model), model[:3]

    # A restarted process (one rank, no FSDP: DCP reshards) resumes from that checkpoint and
    # takes the next step as the trainer that saved it.
    resumed = TitanEngine(engine_config_from_mapping({
        **config.trainer, "parallelism": {},
        "training": {**config.trainer["training"], "local_batch_size": 8,
                     "microbatch_size": None},
    }))
    assert resumed.load_checkpoint() == await fsdp.get_policy_version()
    want = await fsdp.train_step(*split(batch, 2), return_metrics=True)
    got = resumed.train_batch(batch, cross_entropy_loss, valid_tokens)
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    resumed.close()
