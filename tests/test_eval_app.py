"""The trained model out of a run and its evaluation, through the real apps (Monarch actors,
gloo, a real vLLM engine): a GRPO run with FSDP=2 exports ``<output_dir>/hf/step-N`` at its
last step and evaluates an evaluation set on the way; then ``apps.eval`` evaluates that
folder, the run's DCP step folder and a LoRA adapter on that folder.

What must hold: the exported folder loads in transformers with logits equal to the trainer's
own forward (fp32, 1e-5) and vLLM (tp=1) serves it with log-probs equal to transformers' for
the same tokens; ``apps.export`` converts the DCP step of that step into the same tensors; the
same checkpoint evaluated twice with one seed gives the same numbers (through separate
generator processes), another seed other samples; a LoRA adapter folder is served on its
base with PEFT's log-probs; the GRPO app logs each set's metrics.
(The PP=2 export: tests/test_pipeline.py; metrics and bad input: tests/test_evaluation.py.)
"""

import json
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from conftest import history, task_checkpoint

from apps.grpo.config import load_config
from apps.grpo.main import RLApp

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Partial credit: a random model's rewards differ between samples (its answers are wrong).
SET = ("{name: sums, task: {source: addition, num_train: 1, num_eval: 6, seed: 3, "
       "reverse_answer: true, partial_credit: 0.5}, n: 4, "
       "metrics: [greedy, pass@1, pass@4, mean@4, maj@2]}")
IDS = torch.randint(0, 16, (8, 12), generator=torch.Generator().manual_seed(5))


class ExportRecording(RLApp):
    """The app as shipped, plus the trainer's logits of ``IDS`` right after each export."""

    async def export_model(self, step):
        await super().export_model(step)
        self.logits = await self.trainer.forward([{"input_ids": IDS[:4]}, {"input_ids": IDS[4:]}])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return task_checkpoint(tmp_path_factory.mktemp("eval_ckpt"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(checkpoint, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("fsdp_run")
    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [
        f"model.hf_path={checkpoint}", f"output_dir={output_dir}", "task.num_train=40",
        "task.num_eval=4", "task.partial_credit=0.5", "grpo.prompts_per_step=2",
        "grpo.group_size=4",
        "trainer.training.local_batch_size=4",
        "trainer.parallelism.data_parallel_shard_degree=2", "trainer.optimizer.lr=1e-2",
        "reference=null", "loss.kl_coef=0", "loop.steps=2", "loop.eval_every=2",
        "loop.save_every=2", "export.max_shard_mb=0.1", f"eval.sets=[{SET}]", "procs.env={}",
    ])
    app = ExportRecording(config)
    await app.run()
    return app, output_dir


async def test_the_fsdp_export_gives_transformers_the_trainers_logits(run):
    from transformers import AutoModelForCausalLM

    app, output_dir = run
    folder = output_dir / "hf" / "step-2"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # 0.1 MB shards: several files
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    model, loading = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          output_loading_info=True)
    assert not any(loading.values()), loading  # every weight, each from the folder
    with torch.no_grad():
        logits = model.eval()(IDS).logits
    assert logits.abs().max() > 1.0  # far from uniform: the comparison is not vacuous
    torch.testing.assert_close(logits, app.logits, rtol=1e-5, atol=1e-5)
    # The weights moved from the checkpoint the run started from: the export is the policy.
    start = AutoModelForCausalLM.from_pretrained(app.config.model.hf_path, dtype=torch.float32)
    with torch.no_grad():
        assert (start(IDS).logits - logits).abs().max() > 1e-3


async def test_the_dcp_step_converts_to_the_same_tensors(run, tmp_path):
    from safetensors.torch import load_file

    from apps.export import main as export

    _, output_dir = run
    export([str(output_dir / "checkpoints" / "step-2"), str(tmp_path / "converted")])
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    exported = {}
    for shard in (output_dir / "hf" / "step-2").glob("*.safetensors"):
        exported.update(load_file(str(shard)))
    assert sorted(converted) == sorted(exported)
    for name, value in exported.items():
        assert torch.equal(converted[name], value), name


async def test_the_run_logs_its_evaluation_set(run):
    app, output_dir = run
    rows = {r["step"]: r for r in history(output_dir)}
    for step in (0, 2):
        for metric in ("greedy", "pass@1", "pass@4", "mean@4", "maj@2", "response_tokens",
                       "truncated"):
            assert f"eval/sums/{metric}" in rows[step], (step, metric)
        assert rows[step]["eval/sums/prompts"] == 6
        assert rows[step]["eval/sums/pass@4"] >= rows[step]["eval/sums/pass@1"]
    assert "eval/accuracy" in rows[2]  # the held-out split is still evaluated


async def evaluate(overrides):
    """``python -m apps.eval --config configs/eval_cpu_demo.yaml <overrides>``, in this
    event loop."""
    from apps.eval.config import load_eval_config
    from apps.eval.main import EvalApp

    return await EvalApp(load_eval_config(str(CONFIGS / "eval_cpu_demo.yaml"), overrides)).run()


async def test_the_same_seed_gives_the_same_numbers_and_another_seed_other_samples(
        run, tmp_path):
    _, output_dir = run
    sets = f"eval.sets=[{SET}]"
    hf, dcp = output_dir / "hf" / "step-2", output_dir / "checkpoints" / "step-2"
    # The HF folder and the DCP step (converted, the same tensors) in separate generator
    # processes, one seed.
    same = await evaluate([f"checkpoint=[{hf},{dcp}]", f"output_dir={tmp_path / 'a'}", sets,
                     "save_samples=true", "env={}"])
    first, second = same["checkpoints"]
    assert (first["kind"], second["kind"]) == ("hf", "dcp")
    for key in ("metrics", "settings"):
        assert first["sets"]["sums"][key] == second["sets"]["sums"][key], key
    assert first["sets"]["sums"]["metrics"]["reward"] > 0  # not all zero: a real comparison
    assert first["sets"]["sums"]["settings"]["n"] == 4
    other = await evaluate([f"checkpoint={hf}", f"output_dir={tmp_path / 'b'}", sets, "seed=1",
                      "save_samples=true", "env={}"])

    def sampled(folder):
        rows = [json.loads(line) for line in open(folder / "samples.jsonl")]
        return [(r["row"], r["response_ids"]) for r in rows if not r["greedy"]]

    a = sampled(tmp_path / "a")
    assert a[: len(a) // 2] == a[len(a) // 2:]  # hf, then dcp: the same samples
    assert sampled(tmp_path / "b") != a[: len(a) // 2]
    assert other["checkpoints"][0]["sets"]["sums"]["settings"]["seed"] != (
        first["sets"]["sums"]["settings"]["seed"])
    for name in ("eval_results.json", "eval_results.md"):
        assert (tmp_path / "a" / name).is_file()


def response_logprobs(model, samples):
    """Each sample's response log-probs under ``model`` (transformers, fp32): ``[len]``."""
    out = []
    for s in samples:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        start = len(s["prompt_ids"]) - 1
        out.append(logprobs[start:start + len(s["response_ids"])].gather(
            -1, torch.tensor(s["response_ids"])[:, None])[:, 0])
    return out


async def test_a_lora_adapter_is_served_on_its_base_as_peft_computes_it(run, tmp_path):
    """``checkpoint=<PEFT folder>`` is served on its ``base_model_name_or_path``: the
    generator's log-probs of every sample are PEFT's (``PeftModel`` on the base, fp32), not
    the base's."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from forge_ext.engine.lora import peft_adapter_config, peft_key, write_peft_folder

    _, output_dir = run
    base = output_dir / "hf" / "step-2"
    weights = {}
    for shard in base.glob("*.safetensors"):
        weights.update(load_file(str(shard)))
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            module = f"model.layers.{layer}.self_attn.{proj}"
            out_dim, in_dim = weights[f"{module}.weight"].shape
            tensors[peft_key(module, "A")] = torch.randn(4, in_dim, generator=g) * 0.5
            tensors[peft_key(module, "B")] = torch.randn(out_dim, 4, generator=g) * 0.5
    adapter = write_peft_folder(tmp_path / "adapter", tensors,
                                peft_adapter_config(4, 8.0, ["q_proj", "v_proj"], str(base)))

    results = await evaluate([f"checkpoint={adapter}", f"output_dir={tmp_path / 'e'}",
                              f"eval.sets=[{SET}]", "save_samples=true", "env={}"])
    (entry,) = results["checkpoints"]
    assert (entry["kind"], entry["model"]) == ("lora", str(base))
    samples = [json.loads(line) for line in open(tmp_path / "e" / "samples.jsonl")]
    assert len(samples) == 6 * (1 + 4)
    served = [torch.tensor(s["logprobs"]) for s in samples]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    of_base = response_logprobs(model, samples)
    of_peft = response_logprobs(PeftModel.from_pretrained(model, adapter).eval(), samples)
    assert max((a - b).abs().max().item() for a, b in zip(served, of_peft)) <= 1e-4
    # Not the base: the adapter moves these log-probs far beyond the tolerance.
    assert max((a - b).abs().max().item() for a, b in zip(served, of_base)) > 0.1


async def test_vllm_serves_the_export_with_transformers_logprobs(run, tmp_path):
    from transformers import AutoModelForCausalLM

    _, output_dir = run
    folder = output_dir / "hf" / "step-2"
    # At the set's own temperature (0.7): vLLM samples from the sharpened distribution and
    # still reports the policy's log-probs (raw logits), which transformers computes.
    await evaluate([f"checkpoint={folder}", f"output_dir={tmp_path}",
                    f"eval.sets=[{SET.replace('n: 4,', 'n: 4, temperature: 0.7,')}]",
                    "generator.backend=vllm", "generator.vllm={max_model_len: 64}",
                    "save_samples=true", "env={}"])
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert len(samples) == 6 * (1 + 4)  # a greedy and 4 sampled completions per prompt
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    worst = max((want - torch.tensor(s["logprobs"])).abs().max().item()
                for want, s in zip(response_logprobs(model, samples), samples))
    assert worst <= 1e-4, f"vLLM log-probs differ from transformers' by {worst}"
