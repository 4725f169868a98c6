"""The reward-model role (issue 35, test 3): a frozen sequence classifier on its own procs
(DP=2, a token budget) scores each chat-templated completion as transformers'
``AutoModelForSequenceClassification`` does on the same checkpoint; the rubric weighs and
logs its scores like a function's, and a failing reward model costs its scores
(``reward.on_error``, counted), not the run. One role serves every test of the module."""

import json

import pytest
import pytest_asyncio
import torch
from conftest import save_chat_tokenizer
from reward_fns import NoTask

from forge_ext.actors.reward_model import RewardModel, spawn_reward_model
from forge_ext.config import from_mapping
from forge_ext.tasks import RewardConfig, RewardFunctionConfig, Row, Rubric, Sample

on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the shared role's loop

SEQ_LEN = 96  # the role's seq_len: the long sample below exceeds it
BUDGET = 80  # tokens per microbatch and rank: several microbatches per call
PROMPTS = ["What is 12 plus 30?", "Compute 7 times 6.", "You are a helpful assistant.",
           "What is 12 plus 30?", [{"role": "system", "content": "Reply with a number."},
                                   {"role": "user", "content": "7 times 6?"}]]
COMPLETIONS = ["The answer is 42.", "42", "system user assistant. The answer is 42 plus 7.",
               "It is 41.", "The answer is 42."]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random ``Qwen3ForSequenceClassification`` (num_labels 1) with a ChatML
    tokenizer, saved as a reward model is published."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    path = tmp_path_factory.mktemp("rm")
    tok = save_chat_tokenizer(path)
    torch.manual_seed(0)
    arch = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        num_labels=1, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    model = Qwen3ForSequenceClassification(arch).float().eval()
    with torch.no_grad():  # norms around 1, not 0: attention and scores far from uniform
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(path)
    return str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reward_model(checkpoint):
    entry = RewardFunctionConfig(model=checkpoint, procs=2, max_tokens_per_microbatch=BUDGET,
                                 seq_len=SEQ_LEN)
    rm = await spawn_reward_model(entry, "reward.functions[0]", name="rm")
    yield rm
    await rm.stop()


def transformers_scores(checkpoint, prompts, completions):
    """Each conversation rendered by the tokenizer's chat template and scored alone by
    ``AutoModelForSequenceClassification`` (its pooled logit)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(
        checkpoint, torch_dtype=torch.float32).eval()
    scores = []
    for prompt, completion in zip(prompts, completions):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                       tokenize=False)
        assert text.endswith(f"<|im_start|>assistant\n{completion}<|im_end|>\n")
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(model(input_ids=ids).logits[0, 0].item())
    return scores


def samples(prompts, completions):
    return [Sample(row=Row(prompt=p, answer="42"), completion=c)
            for p, c in zip(prompts, completions)]


@on_module_loop
async def test_scores_equal_transformers_sequence_classifier_with_dp2(checkpoint, reward_model):
    """One call scores a batch of five conversations (chat template, a prompt given as
    messages) over two DP ranks and several token-budget microbatches: each score is the
    classifier's logit at the conversation's last token, to fp32 tolerance."""
    assert reward_model.trainer.num_procs == 2
    got = await reward_model.score(PROMPTS, COMPLETIONS)
    want = transformers_scores(checkpoint, PROMPTS, COMPLETIONS)
    assert len(set(round(w, 3) for w in want)) == len(want)  # distinct: a mix-up would show
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


def position_values(model, ids: torch.Tensor) -> torch.Tensor:
    """``[b, T]``: the classifier's score head on every position's hidden state (what its
    pooling picks one of)."""
    with torch.no_grad():
        return model.score(model.model(input_ids=ids).last_hidden_state)[..., 0]


def test_pooling_picks_transformers_position_in_every_padding_case(checkpoint):
    """:func:`score_position` picks the position ``AutoModelForSequenceClassification`` pools:
    right and left padding, pad == eos (the Llama recipe: a row ending in its end token
    scores the token before it), a row of pads only, and no pad token; ``last_token``
    (OpenRLHF's convention) the row's last token whatever it is."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from forge_ext.actors.reward_model import score_position

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(
        checkpoint, torch_dtype=torch.float32).eval()
    pad, eos = tok.pad_token_id, tok.eos_token_id
    rows = [tok(t)["input_ids"] for t in ("The answer is 42.", "42", "It is 41 or 7.")]
    width = max(map(len, rows)) + 2

    def check(batch, pad_token_id, position_of=None):
        model.config.pad_token_id = pad_token_id
        ids = torch.tensor(batch)
        want = model(input_ids=ids).logits[:, 0]
        values = position_values(model, ids)
        at = [score_position(row, pad_token_id) for row in batch]
        assert values[torch.arange(len(batch)), torch.tensor(at)].tolist() == pytest.approx(
            want.tolist(), rel=1e-5, abs=1e-5), (pad_token_id, batch, at)
        last = [score_position(row, pad_token_id, "last_token") for row in batch]
        assert last == [len(row) - 1 for row in batch]

    try:
        check([r + [pad] * (width - len(r)) for r in rows], pad)  # right padding
        check([[pad] * (width - len(r)) + r for r in rows], pad)  # left padding
        ended = [r + [eos] for r in rows]  # pad == eos: each row ends in the end token
        check([r + [eos] * (width - len(r)) for r in ended], eos)
        for row in ended:  # alone, unpadded, as the reward model scores a conversation
            check([row], eos)
        check([[pad] * 4], pad)  # pads only: transformers reads position 0
        check([rows[0] + [pad]], None)  # no pad token: the last token, pad or not
    finally:
        model.config.pad_token_id = pad


@on_module_loop
async def test_a_conversation_ending_in_the_pad_token_scores_where_transformers_pools(
        checkpoint, reward_model):
    """With pad == eos a conversation ends in the pad token: the role scores at the last
    token that is not the pad, as ``AutoModelForSequenceClassification`` does on the row
    alone; ``pooling: last_token`` scores at the row's last token."""
    from transformers import AutoModelForSequenceClassification

    pad = reward_model.tokenizer.pad_token_id
    ids = [row + [pad] * k for k, row in enumerate(reward_model.encode(PROMPTS, COMPLETIONS))]
    model = AutoModelForSequenceClassification.from_pretrained(
        checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = [model(input_ids=torch.tensor([row])).logits[0, 0].item() for row in ids]
        end = [position_values(model, torch.tensor([row]))[0, -1].item() for row in ids]
    assert want[1] != pytest.approx(end[1], abs=1e-3)  # the pad's value is another number
    assert await reward_model.score_ids(ids) == pytest.approx(want, rel=1e-4, abs=1e-4)
    at_end = RewardModel(reward_model.trainer, reward_model.tokenizer, "rm",
                         pad_token_id=pad, pooling="last_token")
    assert await at_end.score_ids(ids) == pytest.approx(end, rel=1e-4, abs=1e-4)


@on_module_loop
async def test_rubric_weighs_and_logs_the_model_like_a_function(checkpoint, reward_model):
    """``reward = exact_match + 0.5 * rm``; ``reward/rm`` is the model's mean; a conversation
    longer than the role's seq_len scores ``reward.on_error`` and is counted."""
    config = from_mapping(RewardConfig, {
        "functions": [{"fn": "exact_match"},
                      {"model": checkpoint, "weight": 0.5, "name": "rm"}],
        "on_error": -1.0, "isolation": "thread"})
    rubric = Rubric(config, NoTask())
    rubric.attach_model("rm", reward_model.score)
    long = "The answer is 42. " * 20
    prompts, completions = ["What is 12 plus 30?"] * 3, ["42", "The answer is 42.", long]
    scores = await rubric.score(samples(prompts, completions))
    model = transformers_scores(checkpoint, prompts[:2], completions[:2]) + [-1.0]
    assert scores.by_function["rm"] == pytest.approx(model, rel=1e-4, abs=1e-4)
    assert scores.rewards == pytest.approx(
        [e + 0.5 * m for e, m in zip([1.0, 0.0, 0.0], model)], rel=1e-4, abs=1e-4)
    metrics = scores.metrics()
    assert metrics["reward/rm"] == pytest.approx(sum(model) / 3, rel=1e-4, abs=1e-4)
    assert metrics["reward/errors/rm"] == 1 and metrics["reward/errors/exact_match"] == 0
    assert rubric.error_counts == {"exact_match": 0, "rm": 1}


@on_module_loop
async def test_a_failing_reward_model_costs_its_scores_not_the_run(checkpoint, reward_model):
    """The role raising (ids outside its vocabulary: the embedding fails on every rank)
    costs the batch's reward-model scores, ``reward.on_error`` each, counted; the functions'
    scores stand, and the role scores the next batch."""
    config = from_mapping(RewardConfig, {
        "functions": [{"fn": "exact_match"}, {"model": checkpoint, "name": "rm"}],
        "on_error": -2.0, "isolation": "thread"})
    rubric = Rubric(config, NoTask())
    broken = RewardModel(reward_model.trainer, reward_model.tokenizer, "rm")
    broken.encode = lambda prompts, completions: [[10**6] * 5 for _ in prompts]
    rubric.attach_model("rm", broken.score)
    prompts, completions = ["What is 12 plus 30?"] * 2, ["42", "41"]
    scores = await rubric.score(samples(prompts, completions))
    assert scores.by_function == {"exact_match": [1.0, 0.0], "rm": [-2.0, -2.0]}
    assert scores.rewards == [-1.0, -2.0]
    assert scores.metrics()["reward/errors/rm"] == 2
    rubric.check(scores)  # every call failed: reward.max_error_rate stops functions, not models
    rubric.attach_model("rm", reward_model.score)
    again = await rubric.score(samples(prompts, completions))
    assert again.by_function["rm"] == pytest.approx(
        transformers_scores(checkpoint, prompts, completions), rel=1e-4, abs=1e-4)
    assert rubric.error_counts["rm"] == 2


def test_without_a_chat_template_the_text_is_prompt_plus_completion(tmp_path):
    from transformers import AutoTokenizer

    tok = save_chat_tokenizer(tmp_path)
    tok.chat_template = None
    rm = RewardModel(trainer=None, tokenizer=tok)
    assert rm.encode(["What is 12 plus 30?"], [" 42"]) == [
        tok("What is 12 plus 30? 42")["input_ids"]]
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template  # the saved one has it


def test_reward_model_entries_are_refused_naming_the_field(tmp_path, checkpoint):
    def refused(entry, match):
        with pytest.raises(ValueError, match=match):
            Rubric(from_mapping(RewardConfig, {"functions": [entry], "isolation": "thread"}),
                   NoTask())

    refused({}, r"reward.functions\[0\] needs exactly one of fn .* neither")
    refused({"fn": "exact_match", "model": checkpoint}, r"exactly one .* both")
    refused({"fn": "exact_match", "procs": 2}, r"reward.functions\[0\].procs is a reward "
            "model's setting")
    refused({"fn": "exact_match", "env": {"CUDA_VISIBLE_DEVICES": "1"}},
            r"reward.functions\[0\].env is a reward model's setting")
    refused({"fn": "exact_match", "pooling": "last_token"},
            r"reward.functions\[0\].pooling is a reward model's setting")
    refused({"model": checkpoint, "pooling": "eos"},
            r"reward.functions\[0\].pooling='eos' must be last_non_pad .* or last_token")
    refused({"model": checkpoint, "max_tokens_per_microbatch": 0},
            r"max_tokens_per_microbatch=0 must be an int >= 1")
    refused({"model": str(tmp_path / "none")}, r"reward.functions\[0\].model=.* no config.json")
    for name, fields, match in [
        ("lm", {"architectures": ["Qwen3ForCausalLM"]}, r"must be one of \['Qwen3ForSequence"),
        ("two", {"architectures": ["Qwen3ForSequenceClassification"],
                 "id2label": {"0": "a", "1": "b"}}, r"num_labels=2; a reward model gives one"),
        ("default", {"architectures": ["LlamaForSequenceClassification"]}, r"num_labels=2"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(fields))
        refused({"model": str(tmp_path / name)}, match)
    # A classifier checkpoint whose tokenizer was not saved beside it.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((__import__("pathlib").Path(checkpoint) / f).read_bytes())
    refused({"model": str(bare)}, r"has no tokenizer")
    # The SFT app scores held-out answers with functions only.
    from apps.sft.config import functions_only

    with pytest.raises(ValueError, match="'rm' is a reward model .* which the SFT app"):
        functions_only(Rubric(from_mapping(RewardConfig, {"functions": [
            {"fn": "exact_match"}, {"model": checkpoint, "name": "rm"}],
            "isolation": "thread"}), NoTask()))


def test_the_grpo_config_checks_a_reward_model_before_spawning(checkpoint, demo_checkpoint):
    """``load_config`` validates a reward model's engine (errors naming its entry) and
    refuses the launchers that run roles on other hosts."""
    from pathlib import Path

    from apps.grpo.config import load_config

    path = str(Path(__file__).resolve().parent.parent / "configs" / "grpo_cpu_demo.yaml")
    entry = f"{{model: {checkpoint}, weight: 0.1, name: rm, procs: 2}}"
    functions = f"reward.functions=[{{fn: addition}}, {entry}]"
    config = load_config(path, [f"model.hf_path={demo_checkpoint}", functions])
    assert [f.metric_name for f in config.reward.functions] == ["addition", "rm"]
    too_long = f"reward.functions=[{{model: {checkpoint}, seq_len: 4096}}]"
    with pytest.raises(ValueError, match=r"reward.functions\[0\]: training.seq_len=4096 exceeds"):
        load_config(path, [f"model.hf_path={demo_checkpoint}", too_long])
    slurm = ["hosts.launcher=slurm", "hosts.slurm.partition=p", functions]
    with pytest.raises(ValueError, match=r"reward.functions\[1\].model: a reward model runs on "
                       "this machine's procs only"):
        load_config(path, slurm, check_model=False)


def test_evaluation_sets_are_scored_by_the_runs_reward_models_only(checkpoint, demo_checkpoint,
                                                                    capsys, monkeypatch):
    """A set's reward model must be one the app spawns and attaches (a GRPO run's own, the
    same entry); apps.eval spawns none and refuses one in one line before any spawn."""
    from pathlib import Path

    import forge_ext.rollout.replicas as replicas
    from apps.eval.main import main
    from forge_ext.evaluation import EvalSetConfig, build_sets, close_sets
    from forge_ext.evaluation.sets import check_reward_models
    from forge_ext.tasks import PromptConfig
    from forge_ext.tasks.tokenizer import CheckpointTokenizer

    entry = RewardFunctionConfig(model=checkpoint, name="rm")
    reward = RewardConfig(functions=[RewardFunctionConfig(fn="addition"), entry])
    sets = build_sets([EvalSetConfig(name="sums", task={"source": "addition", "num_eval": 2},
                                     reward=reward)],
                      CheckpointTokenizer(demo_checkpoint), prompt=PromptConfig(),
                      reward=RewardConfig(), max_new_tokens=4)
    try:
        check_reward_models(sets, {"rm": RewardFunctionConfig(model=checkpoint, name="rm")})
        with pytest.raises(ValueError, match=r"eval.sets\[0\] \(sums\): its reward model 'rm' "
                                             r".* is not the run's reward models"):
            check_reward_models(sets, {"rm": RewardFunctionConfig(model=checkpoint, name="rm",
                                                                  weight=2.0)})
    finally:
        close_sets(sets)

    def refuse(*args, **kwargs):
        raise AssertionError("a generator was spawned")

    monkeypatch.setattr(replicas, "spawn_replicas", refuse)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "eval_cpu_demo.yaml")
    with pytest.raises(SystemExit) as exit_:
        main(["--config", config, f"checkpoint={demo_checkpoint}",
              f"eval.sets=[{{name: sums, task: {{source: addition}}, reward: {{functions: "
              f"[{{model: {checkpoint}, name: rm}}]}}}}]"])
    message = str(exit_.value.code)
    assert message.startswith("config error: eval.sets[0] (sums): its reward model 'rm' "), message
    assert "\n" not in message and "run here (apps.eval" in message
    assert capsys.readouterr().out == ""  # nothing planned or spawned
