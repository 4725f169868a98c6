"""Every YAML in configs/ loads and validates into the typed config of its app (GPU configs
as they validate on a GPU machine); config errors name the offending key."""

import json
import os
import re
from pathlib import Path

import pytest
import torch

from apps.grpo.config import GRPOConfig, load_config
from apps.sft.config import SFTConfig
from apps.sft.config import check_config as check_sft_config
from forge_ext.config import from_mapping, load_yaml, record_run_config
from forge_ext.engine import engine_config_from_mapping
from forge_ext.rl.loop import LoopConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# Architecture fields of the hub's Qwen3 config.json files (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B):
# validation reads only config.json, so no weights are needed.
QWEN3 = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
}


def write_qwen3_config(directory: Path, size: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, **QWEN3[size],
    )
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def all_configs():
    return sorted(p.name for p in CONFIGS.glob("*.yaml"))


def test_configs_exist_for_demo_gpu_and_pp_ga():
    names = all_configs()
    assert {"sft_cpu_demo.yaml", "grpo_cpu_demo.yaml", "grpo_cpu_pp_ga.yaml",
            "grpo_qwen3_0.6b_gpu.yaml", "grpo_qwen3_1.7b_gpu.yaml"} <= set(names)


@pytest.mark.parametrize("name", ["grpo_cpu_demo.yaml", "grpo_cpu_pp_ga.yaml", "grpo_cpu_async.yaml",
                                  "grpo_cpu_lora.yaml", "grpo_cpu_demo_hf.yaml",
                                  "grpo_cpu_chain_sum.yaml", "ppo_cpu_demo.yaml"])
def test_cpu_grpo_configs_validate(name, demo_checkpoint):
    config = load_config(str(CONFIGS / name), [f"model.hf_path={demo_checkpoint}"])
    assert isinstance(config, GRPOConfig)
    assert config.trainer["model"]["hf_path"] == demo_checkpoint  # interpolated
    assert config.generator.hf_path == demo_checkpoint
    if config.reference is None:  # grpo_cpu_lora.yaml: the KL reference is the trainer's base
        assert config.reference_is_trainer_base and name == "grpo_cpu_lora.yaml"
    else:
        assert config.reference["model"]["hf_path"] == demo_checkpoint


def test_ppo_demo_is_the_grpo_demo_with_a_critic_at_the_same_samples_per_step(demo_checkpoint):
    grpo, ppo = (load_config(str(CONFIGS / name), [f"model.hf_path={demo_checkpoint}"])
                 for name in ("grpo_cpu_demo.yaml", "ppo_cpu_demo.yaml"))
    assert ppo.algorithm.advantage == "gae" and ppo.critic is not None
    assert ppo.grpo.group_size == 1 and ppo.grpo.batch_size == grpo.grpo.batch_size == 512
    # The policy's side is the GRPO demo's: same trainer (but its folder), loss and steps.
    assert {**ppo.trainer, "dump_folder": None} == {**grpo.trainer, "dump_folder": None}
    assert ppo.loss == grpo.loss and ppo.loop.steps == grpo.loop.steps
    assert ppo.output_dir != grpo.output_dir


def test_pp_ga_variant_overrides_only_the_trainer_split(demo_checkpoint):
    config = load_config(str(CONFIGS / "grpo_cpu_pp_ga.yaml"), [f"model.hf_path={demo_checkpoint}"])
    assert config.trainer["parallelism"]["pipeline_parallel_degree"] == 2
    assert config.trainer["training"]["gradient_accumulation_steps"] == 4
    assert config.output_dir == "outputs/demo/grpo_pp_ga"
    assert config.trainer["dump_folder"] == "outputs/demo/grpo_pp_ga"  # interpolated after merge


def test_async_variant_changes_only_the_loop_mode_staleness_and_correction():
    def flat(mapping, prefix=""):
        out = {}
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            out.update(flat(value, name + ".") if isinstance(value, dict) else {name: value})
        return out

    demo = flat(load_yaml(CONFIGS / "grpo_cpu_demo.yaml"))
    variant = flat(load_yaml(CONFIGS / "grpo_cpu_async.yaml"))
    assert "loop.mode" not in demo  # the demo keeps the default, sync
    changed = {k for k in demo.keys() | variant.keys() if demo.get(k) != variant.get(k)}
    assert changed == {
        "output_dir", "trainer.dump_folder", "metrics.log_dir",  # ${output_dir}
        "loop.mode", "loop.max_policy_age", "loss.off_policy_correction",
    }
    assert variant["loop.mode"] == "async" and variant["output_dir"] == "outputs/demo/grpo_async"


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_gpu_configs_validate_as_on_a_gpu_machine(size, tmp_path, monkeypatch):
    # FSDP and bf16 are GPU-only settings: validate as the controller of a GPU node would.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = write_qwen3_config(tmp_path / f"Qwen3-{size}", size)
    config = load_config(str(CONFIGS / f"grpo_qwen3_{size}_gpu.yaml"), [f"model.hf_path={path}"])
    assert config.generator.backend == "vllm"
    assert config.trainer["parallelism"]["data_parallel_shard_degree"] == 4
    assert config.prompt.chat_template
    assert config.procs.trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_gsm8k_gpu_config_validates_with_its_data_and_reward(tmp_path, monkeypatch):
    """The GSM8K config with a GSM8K-format jsonl written here: the dataset task and the
    math_verify reward resolve, and the rows render through Qwen3's chat template."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = write_qwen3_config(tmp_path / "Qwen3-0.6B", "0.6b")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Q{i}?", "answer": f"so {i}\n#### {i}"}) + "\n"
                            for i in range(10)))
    config = load_config(str(CONFIGS / "grpo_qwen3_0.6b_gsm8k_gpu.yaml"), [
        f"model.hf_path={path}", f"task.train_path={data}", f"task.eval_path={data}",
    ])
    assert config.task["source"] == "dataset" and "max_digits" not in config.task
    assert [f.fn for f in config.reward.functions] == ["math_verify"]
    assert config.trainer["training"]["seq_len"] == 1024
    assert config.trainer["parallelism"]["data_parallel_shard_degree"] == 4  # from its base
    from forge_ext.tasks import Rubric, build_task

    task = build_task(config.task)
    assert task.eval_rows()[0].prompt[0]["role"] == "system"
    assert Rubric(config.reward, task).names == ["math_verify"]


def test_sft_config_validates_and_shares_the_demo_task():
    sft = from_mapping(SFTConfig, load_yaml(CONFIGS / "sft_cpu_demo.yaml"))
    grpo = load_yaml(CONFIGS / "grpo_cpu_demo.yaml")
    assert grpo["model"]["hf_path"] == sft.output_dir  # GRPO starts from the warm-start
    assert grpo["task"] == load_yaml(CONFIGS / "sft_cpu_demo.yaml")["task"]  # same held-out set


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("init.model_type=qwen2", "model_type='qwen2' cannot be loaded"),
        ("trainer.parallelism.data_parallel_shard_degree=2",
         "degrees multiply to 2 processes, but the SFT app trains in this one process"),
        ("trainer.training.seq_len=6",  # a rank's traceback mid-run before (issue 38)
         r"trainer.training.seq_len=6 < \d+ tokens \(longest training prompt \+ answer"),
    ],
)
def test_sft_refuses_what_it_cannot_train_and_keeps_no_random_init_of_it(
    tmp_path, override, message
):
    """A random init the engine then refused was left in init.hf_path, and every rerun
    reused it (the same error with the default init.model_type)."""
    from apps.sft.main import main

    init = tmp_path / "init"
    argv = ["--config", str(CONFIGS / "sft_cpu_demo.yaml"), f"init.hf_path={init}",
            f"output_dir={tmp_path / 'out'}", override]
    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        with pytest.raises(SystemExit, match=message):
            main(argv)
    finally:  # main applies the config's env (OMP_NUM_THREADS=1) to this process
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    assert not init.exists()


def sft_main_exits(argv, capsys):
    """``apps.sft.main.main(argv)``'s exit message and what it printed to stderr before."""
    from apps.sft.main import main

    threads, environ = torch.get_num_threads(), dict(os.environ)
    try:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
    finally:  # main applies the config's env (OMP_NUM_THREADS=1) to this process
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)
    return str(exit_.value), capsys.readouterr().err


def user_dataset(root: Path, prompt: str, held_out_unit: bool) -> list[str]:
    """Overrides of a dataset task whose prompt template names a ``unit`` column, which the
    held-out rows may lack."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows, unit in (("train", 8, True), ("eval", 2, held_out_unit)):
        with open(root / f"{name}.jsonl", "w") as f:
            for i in range(rows):
                row = {"q": prompt.format(i=i), "answer": str(2 * i),
                       **({"unit": "="} if unit else {})}
                f.write(json.dumps(row) + "\n")
    return ["task.source=dataset", f"task.train_path={root / 'train.jsonl'}",
            f"task.eval_path={root / 'eval.jsonl'}", "task.prompt_field=q",
            "prompt.template='{prompt}{unit}'", "reward.functions=[{fn: exact_match}]"]


def test_sft_refuses_a_held_out_row_that_does_not_render_before_training(
    tmp_path, demo_checkpoint, capsys
):
    """Issue 38: the SFT app checks what the GRPO app checks before anything runs: every
    prompt renders, held-out rows too. Before, a held-out row the template could not format
    was a traceback (a random init: before training; an existing checkpoint: after it)."""
    task = user_dataset(tmp_path / "data", "{i}+{i}", held_out_unit=False)
    base = ["--config", str(CONFIGS / "sft_cpu_demo.yaml"), f"output_dir={tmp_path / 'out'}"]
    message, _ = sft_main_exits([*base, f"init.hf_path={tmp_path / 'init'}", *task], capsys)
    assert message.startswith("config error: prompt.template='{prompt}{unit}' does not "
                              "format with the row"), message
    assert not (tmp_path / "init").exists()
    message, _ = sft_main_exits([*base, f"init.hf_path={demo_checkpoint}", *task], capsys)
    assert message.startswith("config error: held-out row 0: prompt.template="), message


def test_sft_warns_of_prompts_its_tokenizer_cannot_read_before_training(
    tmp_path, demo_checkpoint, capsys
):
    """English prompts under the demo's character tokenizer (an existing init.hf_path): the
    GRPO app's <unk> warning, before training (stopped here by a short seq_len)."""
    task = user_dataset(tmp_path / "data", "What is {i}+{i}", held_out_unit=True)
    message, err = sft_main_exits(
        ["--config", str(CONFIGS / "sft_cpu_demo.yaml"), f"output_dir={tmp_path / 'out'}",
         f"init.hf_path={demo_checkpoint}", *task, "trainer.training.seq_len=6"], capsys)
    assert "warning: 10 of 10 prompts hold text the tokenizer of init.hf_path maps to <unk>" \
        in err, err
    # Which prompts: the first 3, each with its split, index, text and unknown characters.
    assert "vocabulary), the first 3: training row 0: 'What is 0+0' (unknown: 'W', 'h', " \
        "'a', 't', ' ', 'i', 's'); training row 1: 'What is 1+1' (unknown: " in err, err
    assert message.startswith("config error: trainer.training.seq_len=6 <"), message


def write_llama_config(directory: Path) -> str:
    """config.json of a tiny Llama as transformers writes it (validation reads no weights)."""
    from forge_ext.engine.hf_checkpoint import hf_config_dict

    directory.mkdir(parents=True, exist_ok=True)
    fields = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    (directory / "config.json").write_text(json.dumps(hf_config_dict("llama", fields)))
    return str(directory)


def test_model_name_follows_config_json_model_type_unless_given(tmp_path):
    from forge_ext.engine import engine_config_from_mapping

    llama, qwen3 = write_llama_config(tmp_path / "llama"), write_qwen3_config(tmp_path / "q", "0.6b")
    for path, name in ((llama, "llama3"), (qwen3, "qwen3")):
        config = engine_config_from_mapping({"model": {"flavor": "hf", "hf_path": path}})
        assert config.model.name == name
    given = engine_config_from_mapping({"model": {"name": "llama3", "flavor": "hf",
                                                  "hf_path": llama}})
    assert given.model.name == "llama3"
    assert engine_config_from_mapping({"model": {"flavor": "tiny"}}).model.name == "qwen3"


def test_a_model_name_that_contradicts_config_json_is_one_line_naming_the_fix(tmp_path):
    llama = write_llama_config(tmp_path / "llama")
    with pytest.raises(SystemExit) as error:
        from apps.grpo.main import main

        main(["--config", str(CONFIGS / "grpo_cpu_demo.yaml"), f"model.hf_path={llama}",
              f"output_dir={tmp_path / 'out'}", "trainer.model.name=qwen3"])
    message = str(error.value.code)
    assert "\n" not in message
    assert message.startswith("config error: trainer: model.hf_path config.json "
                              "model_type='llama' cannot be loaded as model.name='qwen3'; set "
                              "model.name=llama3 or leave model.name out"), message
    assert not (tmp_path / "out").exists()  # refused before anything was written or spawned


def test_unknown_keys_are_named_with_their_path_and_the_closest_key():
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError,
                       match=r"unknown key 'loop\.stpes' \(did you mean 'loop\.steps'\?\)"):
        load_config(path, ["loop.stpes=3"], check_model=False)
    with pytest.raises(ValueError, match=r"unknown key 'generator\.sampling\.temprature' "
                                         r"\(did you mean 'generator\.sampling\.temperature'\?\)"):
        load_config(path, ["generator.sampling.temprature=0.5"], check_model=False)
    # No guess where nothing is close.
    with pytest.raises(ValueError, match=r"unknown key 'loop\.zzz'; accepted keys of loop"):
        load_config(path, ["loop.zzz=3"], check_model=False)


def test_unknown_engine_keys_are_named_with_their_section(demo_checkpoint):
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError, match=r"unknown key .reference\.training\.foo."):
        load_config(path, [f"model.hf_path={demo_checkpoint}", "reference.training.foo=1"])


def test_a_brace_value_read_as_a_mapping_says_to_quote_it():
    """``prompt.template={prompt}`` on the command line is YAML for a mapping: the error
    says to quote it, as docs show (``"prompt.template='{prompt}'"``)."""
    with pytest.raises(ValueError, match=re.escape(
            "prompt.template: {'prompt': None} is not a valid str; a value in braces reads "
            "as a YAML mapping: quote it, e.g. \"prompt.template='{prompt}'\"")):
        load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), ["prompt.template={prompt}"],
                    check_model=False)


@pytest.mark.parametrize("value", ["[exact_match]", "['my_rewards:digits']"])
def test_a_list_of_bare_names_where_mappings_are_due_shows_the_entry_form(value):
    """``reward.functions=[exact_match]`` (a newcomer's short form) said only "is not a valid
    list": the error shows what an entry is."""
    with pytest.raises(ValueError, match=re.escape(
            "is not a valid list: each entry is a mapping with keys among: fn, model, weight")
            ) as error:
        load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [f"reward.functions={value}"],
                    check_model=False)
    assert "(e.g. [{fn: ...}])" in str(error.value)


def test_wrong_types_and_values_name_the_field():
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError, match="loop.steps"):
        load_config(path, ["loop.steps=many"], check_model=False)
    with pytest.raises(ValueError, match=r"model.hf_path: empty \(null\), but it needs a str"):
        load_config(path, ["model.hf_path="], check_model=False)  # was "None is not a valid str"
    with pytest.raises(ValueError, match="loop.max_policy_age=-1"):
        LoopConfig(steps=3, max_policy_age=-1)
    with pytest.raises(ValueError, match="eval.stop_at_accuracy needs eval.every"):
        from_mapping(SFTConfig, load_yaml(CONFIGS / "sft_cpu_demo.yaml", ["eval.every=0"]))


def test_overrides_reach_interpolated_fields():
    raw = load_yaml(CONFIGS / "grpo_cpu_demo.yaml", ["output_dir=/runs/x", "loop.steps=7"])
    assert raw["trainer"]["dump_folder"] == "/runs/x"
    assert raw["metrics"]["log_dir"] == "/runs/x"
    assert raw["trainer"]["training"]["steps"] == 7


def test_cross_section_checks(demo_checkpoint):
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    model = f"model.hf_path={demo_checkpoint}"
    with pytest.raises(ValueError, match="loss.kl_coef=0.01 needs a reference"):
        load_config(path, [model, "reference=null"])
    with pytest.raises(ValueError, match=r"trainer.training.local_batch_size=512 x 1 .* = 128"):
        load_config(path, [model, "grpo.prompts_per_step=16",
                           "trainer.training.local_batch_size=512"])
    with pytest.raises(ValueError, match="needs trainer.checkpoint.enable=true"):
        load_config(path, [model, "trainer.checkpoint.enable=false"])


def test_a_run_resized_by_prompts_per_step_alone_validates(demo_checkpoint):
    """Batch sizes follow from grpo.prompts_per_step x grpo.group_size / data-parallel ranks,
    and the reference's seq_len from the trainer's, unless set (issue 38)."""
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    model = f"model.hf_path={demo_checkpoint}"
    config = load_config(path, [model, "grpo.prompts_per_step=16"])
    assert config.trainer["training"]["local_batch_size"] == 16 * 8
    assert config.reference["training"]["local_batch_size"] == 16 * 8
    assert config.reference["training"]["seq_len"] == config.trainer["training"]["seq_len"] == 32
    config = load_config(path, [model, "grpo.group_size=4", "trainer.training.seq_len=48",
                                "procs.trainer.num_procs=2"])
    assert config.trainer["training"]["local_batch_size"] == 64 * 4 // 2  # two DP ranks
    assert config.reference["training"]["local_batch_size"] == 64 * 4
    assert config.reference["training"]["seq_len"] == 48


def test_a_run_without_a_kl_term_spawns_no_reference(demo_checkpoint):
    """The DAPO preset with loss.kl_coef=0 on the demo (whose reference: section it
    inherits) spawned and ran a reference model for nothing (issue 38)."""
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    config = load_config(path, [f"model.hf_path={demo_checkpoint}", "loss.preset=dapo",
                                "loss.kl_coef=0"])
    assert config.reference is None and set(config.processes()) == {"trainer", "generator"}
    assert load_config(path, [f"model.hf_path={demo_checkpoint}"]).reference is not None
    # PPO's KL penalty in the reward needs the reference's log-probs with loss.kl_coef 0.
    ppo = load_config(str(CONFIGS / "ppo_cpu_demo.yaml"), [
        f"model.hf_path={demo_checkpoint}", "loss.kl_coef=0", "algorithm.kl_in_reward=true"])
    assert ppo.reference is not None and "reference" in ppo.processes()


def test_hand_set_sizes_that_disagree_are_refused_together_in_one_message(demo_checkpoint):
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError) as refused:
        load_config(path, [f"model.hf_path={demo_checkpoint}", "grpo.prompts_per_step=16",
                           "trainer.training.local_batch_size=512",
                           "reference.training.local_batch_size=256",
                           "reference.training.seq_len=64"])
    message = str(refused.value)
    assert message.startswith("sizes that disagree: ")
    assert "trainer.training.local_batch_size=512 x 1 data-parallel ranks = 512 sequences" in message
    assert "reference.training.local_batch_size=256 x 1" in message
    assert "reference.training.seq_len=64 but trainer.training.seq_len=32" in message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.parallelism.tensor_parallel_degree=3",
         r"tensor_parallel_degree=3 must divide the model's n_heads=4"),
        ("trainer.parallelism.tensor_parallel_degree=4",
         r"tensor_parallel_degree=4 must divide the model's n_kv_heads=2"),
        ("reference.parallelism.tensor_parallel_degree=3",
         r"tensor_parallel_degree=3 must divide the model's n_heads=4"),
        ("trainer.parallelism.pipeline_parallel_degree=3",
         r"weights.transport='direct' needs the same tensors on every trainer rank"),
        ("trainer.training.max_tokens_per_microbatch=0",
         r"trainer: training.max_tokens_per_microbatch=0 must be >= "),
        ("reference.training.packing=true",
         r"reference: training.packing=true needs training.max_tokens_per_microbatch"),
        ("trainer.lora.rank=0", r"trainer: lora.rank=0 must be an integer >= 1"),
        ("trainer.lora={rank: 4, alpha: 0}", r"trainer: lora.alpha=0 must be > 0"),
        ("trainer.lora={rank: 4, target_modules: [q_proj, qkv_proj]}",
         r"trainer: lora.target_modules names \['qkv_proj'\], which the model has no linear"),
        ("trainer.lora={rank: 4, target_modules: []}", r"trainer: lora.target_modules=\[\] adapts"),
        ("trainer.lora={rank: 4, export_merged: yes_please}", r"trainer.lora.export_merged"),
    ],
)
def test_parallelism_the_model_or_weights_cannot_take_is_refused_before_spawning(
    demo_checkpoint, override, message
):
    """A newcomer's tries: each was refused only after the procs were spawned (up to 2 min)."""
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError, match=message):
        load_config(path, [f"model.hf_path={demo_checkpoint}", override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.parallelism.pipeline_parallel_degree=2", "weights.transport=dcp",
          "weights.dcp_path=/tmp/unused"],
         r"trainer: lora with parallelism.pipeline_parallel_degree=2 is not supported"),
        (["trainer.parallelism.tensor_parallel_degree=2"],
         r"trainer: lora with parallelism.tensor_parallel_degree=2 is not supported"),
    ],
)
def test_lora_with_parallelism_it_cannot_take_is_refused_before_spawning(
    demo_checkpoint, overrides, message
):
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(ValueError, match=message):
        load_config(path, [f"model.hf_path={demo_checkpoint}", "trainer.lora.rank=4", *overrides])


def test_lora_is_a_trainer_section_of_the_grpo_and_sft_apps(demo_checkpoint):
    grpo = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"),
                       [f"model.hf_path={demo_checkpoint}", "trainer.lora.rank=4"])
    engine = engine_config_from_mapping(grpo.trainer)
    assert (engine.lora.rank, engine.lora.alpha, len(engine.lora.targets)) == (4, 8.0, 7)
    assert not grpo.reference_is_trainer_base  # a reference: section is a reference role
    # reference: null with LoRA: the KL reference is the trainer's base (no reference role).
    base_ref = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"),
                           [f"model.hf_path={demo_checkpoint}", "trainer.lora.rank=4",
                            "reference=null"])
    assert base_ref.reference_is_trainer_base and "reference" not in base_ref.processes()
    sft = from_mapping(SFTConfig, load_yaml(
        CONFIGS / "sft_cpu_demo.yaml",
        [f"init.hf_path={demo_checkpoint}", "trainer.lora={rank: 2, target_modules: [q_proj]}"]))
    assert engine_config_from_mapping(sft.trainer).lora.targets == ("q_proj",)
    # One word where a list may stand (PEFT's spelling): all seven layers, or the one named.
    for word, targets in (("all-linear", 7), ("v_proj", 1)):
        one = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [
            f"model.hf_path={demo_checkpoint}", f"trainer.lora={{rank: 4, target_modules: {word}}}"])
        assert len(engine_config_from_mapping(one.trainer).lora.targets) == targets


def test_the_vllm_generator_gets_lora_with_the_trainers_rank(demo_checkpoint):
    """Issue 25: trainer.lora makes the GRPO app start vLLM with LoRA, max_lora_rank the
    smallest rank vLLM takes that holds trainer.lora.rank (users do not set it twice)."""
    vllm = str(CONFIGS / "grpo_cpu_vllm.yaml")
    config = load_config(vllm, [f"model.hf_path={demo_checkpoint}", "trainer.lora.rank=4"])
    assert config.generator.vllm == {"tensor_parallel_size": 1, "max_model_len": 64,
                                     "enable_lora": True, "max_lora_rank": 8}
    config = load_config(vllm, [f"model.hf_path={demo_checkpoint}", "trainer.lora.rank=16",
                                "generator.vllm.max_lora_rank=32"])
    assert config.generator.vllm["max_lora_rank"] == 32  # the user's, above the rank
    config = load_config(vllm, [f"model.hf_path={demo_checkpoint}"])
    assert "enable_lora" not in config.generator.vllm  # full fine-tuning: vLLM without LoRA


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.lora.rank=32", "generator.vllm.max_lora_rank=16"],
         r"generator.vllm.max_lora_rank=16 < trainer.lora.rank=32: .* at least 32"),
        (["trainer.lora.rank=4", "generator.vllm.max_lora_rank=12"],
         r"generator.vllm.max_lora_rank=12 must be one of \[1, 8, 16"),
        (["trainer.lora.rank=4", "generator.vllm.enable_lora=false"],
         r"generator.vllm.enable_lora=False but trainer.lora is set"),
        (["trainer.lora.rank=1024"], r"trainer.lora.rank=1024 is above the largest LoRA rank"),
    ],
)
def test_lora_settings_vllm_cannot_serve_are_refused_before_spawning(
    demo_checkpoint, overrides, message
):
    with pytest.raises(ValueError, match=message):
        load_config(str(CONFIGS / "grpo_cpu_vllm.yaml"),
                    [f"model.hf_path={demo_checkpoint}", *overrides])



@pytest.mark.parametrize(
    ("vllm", "message"),
    [
        ({"enable_chunked_prefill": True},
         r"generator.vllm.enable_chunked_prefill=true crashes vLLM 0.32 on CPU"),
        ({"max_model_len": 64, "max_num_batched_tokens": 32},
         r"generator.vllm.max_num_batched_tokens=32 < generator.vllm.max_model_len=64"),
    ],
)
def test_chunked_prefill_is_off_for_vllm_on_cpu_and_settings_that_need_it_are_refused(
    demo_checkpoint, vllm, message
):
    """vLLM 0.32 on CPU crashes a seeded step over its batched-token budget when it chunks a
    prefill (issue 32): chunking is off there, and what would need it is refused before
    anything is spawned."""
    from forge_ext.rollout.config import GeneratorConfig
    from forge_ext.rollout.engines.vllm import engine_args_for

    assert engine_args_for({}, dtype="float32", cuda=False)["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in engine_args_for({}, dtype="float32", cuda=True)
    with pytest.raises(ValueError, match=message):
        GeneratorConfig(hf_path=demo_checkpoint, backend="vllm", vllm=vllm).check_backend()


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_generator_dtype_is_a_torch_dtype_name_checked_before_anything_runs(demo_checkpoint,
                                                                             backend):
    from forge_ext.rollout.config import GeneratorConfig

    with pytest.raises(ValueError, match=r"generator.dtype='bf16' must be one of \['float32', "
                                         r"'bfloat16', 'float16'\]"):
        GeneratorConfig(hf_path=demo_checkpoint, backend=backend, dtype="bf16").check_backend()
    GeneratorConfig(hf_path=demo_checkpoint, dtype="bfloat16").check_backend()


def test_missing_checkpoint_is_reported_before_anything_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [f"model.hf_path={tmp_path}"])


def test_run_config_is_recorded_and_a_rerun_may_change_only_the_allowed_keys(tmp_path):
    run = {"seed": 0, "loop": {"steps": 10, "eval_every": 5}, "optimizer": {"lr": 1e-3}}
    path = record_run_config(tmp_path / "run", run, may_change=["loop.steps"])
    assert load_yaml(path) == {**run, "working_dir": os.getcwd()}
    record_run_config(tmp_path / "run", run, may_change=["loop.steps"])  # the same run
    longer = {**run, "loop": {"steps": 20, "eval_every": 5}}
    record_run_config(tmp_path / "run", longer, may_change=["loop.steps"])
    assert load_yaml(path)["loop"]["steps"] == 20

    other = {**longer, "seed": 1, "optimizer": {"lr": 2e-3}}
    with pytest.raises(ValueError) as error:
        record_run_config(tmp_path / "run", other, may_change=["loop.steps"])
    message = str(error.value)
    assert "seed: 0 -> 1" in message and "optimizer.lr: 0.001 -> 0.002" in message
    assert "loop.steps" not in message.split("(")[1].split(")")[0]  # an allowed change
    assert "Use a new output_dir" in message
    assert load_yaml(path)["seed"] == 0  # a refused rerun leaves the record alone


def test_run_record_treats_one_folder_named_two_ways_as_the_same(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    run = {"output_dir": "run", "model": "ckpt/warm"}
    record_run_config("run", run)
    # Absolute spellings, and relative ones from another working directory.
    same = {"output_dir": str(tmp_path / "run"), "model": str(tmp_path / "ckpt" / "warm")}
    record_run_config(tmp_path / "run", same)
    monkeypatch.chdir(tmp_path / "sub")
    record_run_config("../run", {"output_dir": "../run", "model": "../ckpt/warm"})
    with pytest.raises(ValueError, match="model: '../ckpt/warm' -> 'ckpt/warm'"):
        record_run_config("../run", {"output_dir": "../run", "model": "ckpt/warm"})


def test_a_file_is_not_an_output_dir(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; it must be a folder"):
        record_run_config(tmp_path / "file", {"seed": 0})


@pytest.mark.parametrize("text", ["seed: [1\n", "", "- a list\n"])
def test_an_unreadable_run_record_is_a_clear_error(tmp_path, text):
    (tmp_path / "run_config.yaml").write_text(text)
    with pytest.raises(ValueError, match="is not a readable run record"):
        record_run_config(tmp_path, {"seed": 0})


def test_grpo_resumes_from_the_newest_complete_checkpoint(demo_checkpoint, tmp_path):
    from apps.grpo.prepare import resume_step_of as latest_checkpoint_step

    out = tmp_path / "run"
    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"),
                         [f"model.hf_path={demo_checkpoint}", f"output_dir={out}"])
    assert latest_checkpoint_step(config) == 0
    for step in (5, 10):
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (out / "checkpoints" / "step-5" / ".metadata").write_text("")
    assert latest_checkpoint_step(config) == 5  # step-10 is incomplete: no .metadata yet


def test_a_resume_is_announced_before_anything_is_spawned(demo_checkpoint, tmp_path):
    """The plan printed before spawning says the run resumes (it came after the spawn, 54 s
    later, issue 38)."""
    from apps.grpo.main import RLApp

    out = tmp_path / "run"
    overrides = [f"model.hf_path={demo_checkpoint}", f"output_dir={out}", "loop.steps=8",
                 "task.num_train=16", "task.num_eval=2"]
    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), overrides)
    assert not any("resuming" in line for line in RLApp(config).plan_lines(["generator"], None))
    (out / "checkpoints" / "step-5").mkdir(parents=True)
    (out / "checkpoints" / "step-5" / ".metadata").write_text("")
    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), overrides)
    lines = RLApp(config).plan_lines(["generator"], None)
    assert f"resuming from the checkpoint of step 5 in {out}" in lines


def test_the_plot_shows_loss_kl_each_reward_function_and_response_length(demo_checkpoint,
                                                                         tmp_path):
    from apps.grpo.main import RLApp

    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [
        f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path}", "task.num_train=16",
        "task.num_eval=2"])
    spec = RLApp(config).plot_spec()
    plotted = {key for panel in spec["panels"] for key in panel.keys}
    assert {"loss", "loss/kl", "reward/addition", "rollout/response_tokens"} <= plotted


def test_the_plot_leaves_out_what_is_zero_by_construction_in_the_runs_mode(demo_checkpoint,
                                                                          tmp_path):
    """Issue 50: on-policy (sync, ``loop.max_policy_age: 0``) every sample's policy age is 0,
    none is dropped as stale and the clip never binds (one update per rollout: the ratio is
    1); one-turn episodes are cut only at ``max_new_tokens``. Those panels and series were
    drawn flat at 0; they are drawn where the mode makes them move."""
    from apps.grpo.main import RLApp

    def plotted(config: str, *overrides: str) -> set[str]:
        spec = RLApp(load_config(str(CONFIGS / config), [
            f"model.hf_path={demo_checkpoint}", f"output_dir={tmp_path / config}",
            "task.num_train=16", "task.num_eval=2", *overrides])).plot_spec()
        return {key for panel in spec["panels"] for key in panel.keys}

    on_policy = plotted("grpo_cpu_demo.yaml")
    zero = {"rollout/policy_age_mean", "rollout/policy_age_max", "rollout/dropped_samples",
            "loss/clip_fraction", "rollout/truncated/max_episode_tokens",
            "rollout/truncated/max_turns"}
    assert not zero & on_policy, zero & on_policy
    assert {"rollout/truncated/max_new_tokens", "rollout/groups_without_spread"} <= on_policy
    off_policy = plotted("grpo_cpu_async.yaml")
    assert {"rollout/policy_age_mean", "rollout/policy_age_max", "rollout/dropped_samples",
            "loss/clip_fraction"} <= off_policy


def test_grpo_refuses_a_resume_past_loop_steps_and_changed_weights(demo_checkpoint, tmp_path):
    import shutil

    from apps.grpo.main import RLApp

    out, weights = tmp_path / "run", tmp_path / "weights"
    shutil.copytree(demo_checkpoint, weights)
    overrides = [f"model.hf_path={weights}", f"output_dir={out}", "loop.steps=8", "procs.env={}"]
    RLApp(load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), overrides))  # records the run
    (out / "checkpoints" / "step-6").mkdir(parents=True)
    (out / "checkpoints" / "step-6" / ".metadata").write_text("")
    with pytest.raises(ValueError, match="checkpoint of step 6 > loop.steps=5"):
        RLApp(load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [*overrides, "loop.steps=5"]))
    safetensors = weights / "model.safetensors"
    safetensors.write_bytes(safetensors.read_bytes())  # rewritten in place: a new mtime
    with pytest.raises(ValueError, match=r"model_files\.model\.safetensors: "):
        RLApp(load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), overrides))


def test_a_resume_may_change_how_batches_are_split_and_a_model_name_config_json_gives():
    """Fixed rows -> token budget (any split gives the same gradient) and a spelled-out
    ``model.name`` -> taken from config.json (the checkpoint files are fingerprinted) resume a
    run recorded before them; the learning rate does not."""
    from apps.grpo.main import MAY_CHANGE_ON_RESUME
    from forge_ext.config import config_changes

    recorded = {"trainer": {"model": {"name": "qwen3"}, "optimizer": {"lr": 1e-3},
                            "training": {"microbatch_size": 4}},
                "reference": {"training": {"gradient_accumulation_steps": 2}}}
    now = {"trainer": {"model": {}, "optimizer": {"lr": 1e-3},
                       "training": {"max_tokens_per_microbatch": 4096, "packing": True}},
           "reference": {"training": {"max_tokens_per_microbatch": 8192}}}
    assert config_changes(recorded, now, may_change=MAY_CHANGE_ON_RESUME) == []
    now["trainer"]["optimizer"]["lr"] = 2e-3
    assert config_changes(recorded, now, may_change=MAY_CHANGE_ON_RESUME) == [
        "trainer.optimizer.lr: 0.001 -> 0.002"
    ]


def test_a_changed_list_entry_on_resume_shows_only_the_fields_that_differ():
    """A newcomer's resume with one reward weight changed listed both whole entries, every
    default field of each; now the field, by its entry's index. Entries added or removed:
    the lists, without their unset fields. A list under a may-change prefix (eval.sets) is
    still free to change, entry fields included."""
    from apps.grpo.main import MAY_CHANGE_ON_RESUME
    from forge_ext.config import config_changes

    def entry(fn, weight):
        return {"fn": fn, "model": None, "weight": weight, "name": None, "procs": None,
                "env": {}, "seq_len": None, "pooling": None}

    recorded = {"reward": {"functions": [entry("my:exact", 1.0), entry("my:short", 0.1)]},
                "eval": {"sets": [{"name": "a", "batch_size": 4}]}}
    now = {"reward": {"functions": [entry("my:exact", 1.0), entry("my:short", 0.2)]},
           "eval": {"sets": [{"name": "a", "batch_size": 8}]}}
    assert config_changes(recorded, now, may_change=MAY_CHANGE_ON_RESUME) == [
        "reward.functions[1].weight: 0.1 -> 0.2"]
    now["reward"]["functions"].append(entry("my:long", 0.5))
    assert config_changes(recorded, now, may_change=MAY_CHANGE_ON_RESUME) == [
        "reward.functions: [{'fn': 'my:exact', 'weight': 1.0}, {'fn': 'my:short', 'weight': "
        "0.1}] -> [{'fn': 'my:exact', 'weight': 1.0}, {'fn': 'my:short', 'weight': 0.2}, "
        "{'fn': 'my:long', 'weight': 0.5}]"]
    # Lists of scalars stay whole leaves.
    assert config_changes({"stop": [2]}, {"stop": [2, 5]}) == ["stop: [2] -> [2, 5]"]


def test_torchtitan_notices_about_defaults_the_engine_does_not_use_are_not_printed(
    tmp_path, caplog
):
    """An engine config and the state-dict adapter of an unsharded checkpoint log none of
    torchtitan's two not-applicable warnings; any other root-logger warning still shows."""
    import logging

    from forge_ext.engine import engine_config_from_mapping
    from forge_ext.engine.models import build_model_spec

    with caplog.at_level(logging.WARNING):
        engine_config_from_mapping({})
        spec = build_model_spec("qwen3", "tiny")
        spec.state_dict_adapter(spec.model, str(tmp_path))  # no model.safetensors.index.json
        logging.getLogger().warning("a warning of someone else")
    assert [r.getMessage() for r in caplog.records] == ["a warning of someone else"]


def test_every_unknown_key_of_a_config_is_reported_in_one_error(tmp_path):
    """Issue 50: two typos in one YAML file were reported one per run. Every unknown key,
    in the app's own sections, the engine sections and the task section, comes in one
    error, each with its guess."""
    config = tmp_path / "typos.yaml"
    config.write_text(f"base: {CONFIGS / 'grpo_cpu_demo.yaml'}\nloop: {{stpes: 3}}\n"
                      "trainer: {training: {sequence_len: 64}}\n"
                      "reference: {training: {foo: 1}}\ntask: {max_digit: 2}\n"
                      "generator: {sampling: {temprature: 0.5}}\n")
    with pytest.raises(ValueError) as error:
        load_config(str(config), check_model=False)
    message = str(error.value)
    for key, guess in [("loop.stpes", "loop.steps"), ("trainer.training.sequence_len",
                                                      "trainer.training.seq_len"),
                       ("reference.training.foo", None), ("task.max_digit", "task.max_digits"),
                       ("generator.sampling.temprature", "generator.sampling.temperature")]:
        assert repr(key) in message, (key, message)
        if guess:
            assert f"{key!r} (did you mean {guess!r}?)" in message, (key, message)
    with pytest.raises(ValueError) as error:  # PPO's critic: its own fields and its engine's
        load_config(str(CONFIGS / "ppo_cpu_demo.yaml"), ["critic.clip_valu=0.1",
                                                         "critic.training.sequence_len=8",
                                                         "loop.stpes=2"], check_model=False)
    message = str(error.value)
    for key, guess in [("critic.clip_valu", "critic.clip_value"), ("loop.stpes", "loop.steps"),
                       ("critic.training.sequence_len", "critic.training.seq_len")]:
        assert f"{key!r} (did you mean {guess!r}?)" in message, (key, message)
    with pytest.raises(ValueError) as error:
        check_sft_config(str(CONFIGS / "sft_cpu_demo.yaml"),
                         ["eval.evry=5", "trainer.optimizer.lrr=1"])
    assert "'eval.evry'" in str(error.value) and "'trainer.optimizer.lrr'" in str(error.value)


@pytest.mark.parametrize("key, guess", [
    ("trainer.optimizer.learning_rate", "trainer.optimizer.lr"),
    ("trainer.training.max_seq_len", "trainer.training.seq_len"),
    ("trainer.training.max_grad_norm", "trainer.training.max_norm"),
    ("grpo.num_generations", "grpo.group_size"),
    ("loss.beta", "loss.kl_coef"),
    ("model.model_name_or_path", "model.hf_path"),
])
def test_the_common_names_of_a_field_point_to_its_name_here(key, guess):
    """Issue 50: ``learning_rate`` got no "did you mean 'lr'" (too far for difflib): the
    names other trainers give a field (TRL, verl, HF TrainingArguments) point to ours."""
    with pytest.raises(ValueError, match=re.escape(f"{key!r} (did you mean {guess!r}?)")):
        load_config(str(CONFIGS / "grpo_cpu_demo.yaml"), [f"{key}=1"], check_model=False)


def test_a_dcp_step_folder_as_model_hf_path_points_to_its_hf_folder_and_to_export(tmp_path):
    """Issue 50: ``model.hf_path=<run>/checkpoints/step-N`` said "write the warm-start
    first"; it is a training checkpoint: the message names ``<run>/hf/step-N`` where the
    run wrote it, and ``python -m apps.export`` otherwise."""
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    path = str(CONFIGS / "grpo_cpu_demo.yaml")
    with pytest.raises(FileNotFoundError) as error:
        load_config(path, [f"model.hf_path={step}"])
    message = str(error.value)
    assert "DCP" in message and f"python -m apps.export {step} " in message, message
    assert "warm-start" not in message, message
    (run / "hf" / "step-4").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=re.escape(f"model.hf_path={run / 'hf' / 'step-4'}")):
        load_config(path, [f"model.hf_path={step}"])


def warm_start(demo_checkpoint, root: Path, task: dict) -> str:
    """The demo checkpoint as an apps.sft warm-start trained on ``task`` (its files linked,
    beside the record an SFT run writes)."""
    root.mkdir()
    for f in Path(demo_checkpoint).iterdir():
        (root / f.name).symlink_to(f)
    record_run_config(root, {"task": task})
    return str(root)


DEMO_WARM_TASK = {"source": "addition", "max_digits": 2, "reverse_answer": True}


@pytest.mark.parametrize(("warm_task", "run_overrides", "note", "warning"), [
    # Own data on the demo's warm-start (the README's command): a choice, said as a note.
    (DEMO_WARM_TASK,
     ["task.source=dataset", "task.train_path={data}", "task.prompt_field=question"],
     "note: model.hf_path={warm} was warm-started on task.source=addition; this run trains it "
     "on task.source=dataset (your own task: nothing to change)\n", ""),
    # The same task with other settings: likely a slip, said so, with the overrides that undo it.
    (DEMO_WARM_TASK, ["task.max_digits=3"], "",
     "warning: the task differs from the one model.hf_path={warm} was warm-started on "
     "(task.max_digits: 2 -> 3): likely a mistake, unless meant (a curriculum); to train on "
     "the warm-start's task, set task.max_digits=2\n"),
    (DEMO_WARM_TASK, ["task.max_digits=2"], "", ""),
])
def test_a_task_other_than_the_warm_starts_is_a_note_when_chosen_a_warning_when_a_slip(
    demo_checkpoint, tmp_path, capsys, warm_task, run_overrides, note, warning
):
    from apps.grpo.prepare import warn_if_task_differs_from_warm_start

    warm = warm_start(demo_checkpoint, tmp_path / "warm", warm_task)
    data = tmp_path / "my_data.jsonl"
    data.write_text('{"question": "12+34=", "answer": "64"}\n')
    config = load_config(str(CONFIGS / "grpo_cpu_demo.yaml"),
                         [f"model.hf_path={warm}", *(o.format(data=data) for o in run_overrides)])
    warn_if_task_differs_from_warm_start(config)
    out, err = capsys.readouterr()
    assert (out, err) == (note.format(warm=warm), warning.format(warm=warm))
