"""The SFT warm-start app: trains with the engine in this process and writes an HF checkpoint
that transformers and the engine's ``flavor: hf`` path both load, with identical logits."""

from pathlib import Path

import pytest
import torch

from apps.sft.config import SFTConfig
from apps.sft.main import run
from forge_ext.config import from_mapping, load_yaml

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "sft_cpu_demo.yaml"


def tiny_config(tmp_path, steps=30, **extra):
    overrides = [
        f"output_dir={tmp_path / 'warmstart'}", f"init.hf_path={tmp_path / 'init'}",
        f"metrics.log_dir={tmp_path / 'logs'}", "metrics.tensorboard=false",
        f"trainer.training.steps={steps}", "trainer.training.local_batch_size=16",
        "init.architecture.hidden_size=32", "init.architecture.intermediate_size=64",
        "init.architecture.head_dim=8", "task.num_train=200", "task.num_eval=20",
        "env={}",  # leave the test process's thread settings alone
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    return from_mapping(SFTConfig, load_yaml(CONFIG, overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sft")
    config = tiny_config(tmp_path)
    accuracy = run(config)
    return config, accuracy


def test_sft_writes_a_complete_hf_checkpoint_and_lowers_the_loss(trained):
    config, accuracy = trained
    out = Path(config.output_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert 0.0 <= accuracy <= 1.0
    import json

    rows = [json.loads(line) for line in open(Path(config.metrics.log_dir) / "metrics.jsonl")]
    losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]


def test_checkpoint_loads_in_transformers_and_the_engine_with_equal_logits(trained):
    from transformers import AutoModelForCausalLM

    from forge_ext.engine import TitanEngine
    from forge_ext.engine.distributed import init_single_process_env

    config, _ = trained
    path = config.output_dir
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    init_single_process_env()
    engine = TitanEngine({
        "model": {"name": "qwen3", "flavor": "hf", "hf_path": path},
        "training": {"local_batch_size": 4, "seq_len": 32},
    })
    ids = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    got = engine.forward_batch({"input_ids": ids})
    assert expected.abs().max() > 1.0  # trained weights: the comparison is not vacuous
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_existing_checkpoint_is_kept(trained, capsys):
    config, _ = trained
    before = (Path(config.output_dir) / "model.safetensors").stat().st_mtime_ns
    assert run(config) is None
    assert "exists, skipping" in capsys.readouterr().out
    assert (Path(config.output_dir) / "model.safetensors").stat().st_mtime_ns == before


def test_existing_checkpoint_from_another_config_is_refused(trained):
    config, _ = trained
    tmp_path = Path(config.output_dir).parent
    other = tiny_config(tmp_path, seed=3)
    with pytest.raises(ValueError, match=r"another config \(seed: 0 -> 3; trainer.seed: 0 -> 3\)"):
        run(other)
    assert run(tiny_config(tmp_path, **{"metrics.tensorboard": "true"})) is None  # may change


def test_training_stops_once_validation_accuracy_reaches_the_target(tmp_path, capsys):
    """One-digit sums are learnt within ~20 steps: the target is first reached mid-run,
    after evaluations that fell short of it, and training stops at that evaluation."""
    import json

    target = 0.2
    config = tiny_config(tmp_path, steps=40, **{
        "eval.every": 5, "eval.stop_at_accuracy": target,
        "task.max_digits": 1, "task.num_train": 22, "task.num_eval": 5,
    })
    run(config)
    rows = [json.loads(line) for line in open(Path(config.metrics.log_dir) / "metrics.jsonl")]
    evals = [(r["step"], r["validation/accuracy"]) for r in rows if "validation/accuracy" in r]
    stop_step = max(r["step"] for r in rows if "sft/loss" in r)
    # The reference: the first evaluation at or above the target, from the logged accuracies.
    *before, (last_step, last_accuracy) = evals
    assert before and all(accuracy < target for _, accuracy in before), evals
    assert last_accuracy >= target and last_step == stop_step < 40, evals
    assert f"step {stop_step}: reached eval.stop_at_accuracy={target}, stopping" in (
        capsys.readouterr().out
    )
    assert (Path(config.output_dir) / "model.safetensors").is_file()


def test_lora_sft_exports_a_peft_adapter_and_on_request_the_merged_checkpoint(tmp_path):
    """A LoRA warm-start writes ``<output_dir>/adapter`` (PEFT, base ``init.hf_path``, which
    stays as it was) and, with ``export_merged``, the merged HF checkpoint in ``output_dir``:
    ``peft`` over the base and ``transformers`` on the merged checkpoint give equal logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from forge_ext.engine.lora import read_peft_folder

    config = tiny_config(tmp_path, steps=4, **{
        "trainer.lora": "{rank: 2, export_merged: true}", "trainer.optimizer.lr": "3e-2"})
    run(config)
    out = Path(config.output_dir)
    tensors, adapter_config = read_peft_folder(out / "adapter")
    assert adapter_config["base_model_name_or_path"] == config.init.hf_path
    assert adapter_config["r"] == 2 and len(tensors) == 2 * 7 * 2
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # it trained
    init = load_file(str(Path(config.init.hf_path) / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(config.init.hf_path, dtype=torch.float32).eval()
    assert all(torch.equal(v, init[k]) for k, v in base.state_dict().items() if k in init)
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_model = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
        want, got = merged(ids).logits, peft_model(ids).logits
    assert (want - base_logits).abs().max() > 1e-3  # the adapter trained away from the base
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_reward_function_failing_on_every_row_stops_the_accuracy_with_its_traceback(
        demo_checkpoint):
    """Issue 38: the SFT app's held-out accuracy scored a function that raised on every row
    as 0% and went on; it now stops with the count and the first traceback (the GRPO app's
    rule, ``reward.max_error_rate``)."""
    import reward_fns as fns

    from apps.sft.main import greedy_accuracy
    from forge_ext.rollout.engines.hf import HFSampler
    from forge_ext.tasks import (
        PromptConfig, PromptRenderer, RewardConfig, RewardFunctionConfig, Row, Rubric,
    )
    from forge_ext.tasks.rubric import RewardFailure
    from forge_ext.tasks.tokenizer import CheckpointTokenizer

    tok = CheckpointTokenizer(demo_checkpoint)
    sampler = HFSampler(demo_checkpoint, stop_token_ids=tok.stop_ids, pad_token_id=tok.pad_id)
    render = PromptRenderer(tok, PromptConfig())
    rows = [Row(prompt="12+3=", answer="51"), Row(prompt="4+4=", answer="8")]
    rubric = Rubric(RewardConfig(functions=[RewardFunctionConfig(fn="reward_fns:raises")]),
                    fns.NoTask())
    with pytest.raises(RewardFailure) as failure:
        greedy_accuracy(sampler, rubric, rows, render, tok, max_new_tokens=3)
    message = str(failure.value)
    assert message.startswith("the accuracy on 2 rows: reward function 'raises' failed on 2 "
                              "of 2 calls"), message
    assert message.count("RuntimeError: boom") == 1
    rubric.close()
