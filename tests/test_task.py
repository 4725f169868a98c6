"""Addition task, its tokenizer, and packing episodes into the engine's batch dict."""

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from forge_ext.rl.episode import Episode, pack_episodes
from forge_ext.tasks.addition import AdditionProblem, AdditionTask
from forge_ext.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer, save_tokenizer
from forge_ext.rl.losses.grpo import token_logprobs

# Ids written out by hand from the documented vocabulary: <pad>0 <bos>1 <eos>2 <unk>3,
# '0'..'9' -> 4..13, '+' 14, '=' 15.
PROMPT_12_PLUS_345 = [1, 5, 6, 14, 7, 8, 9, 15]


def digits(text: str) -> list[int]:
    return [4 + int(c) for c in text]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_encodes_one_token_per_character_after_bos():
    assert (PAD_ID, BOS_ID, EOS_ID, VOCAB_SIZE) == (0, 1, 2, 16)
    encoding = build_tokenizer().encode("12+345=")
    assert encoding.ids == PROMPT_12_PLUS_345
    assert encoding.tokens == ["<bos>", "1", "2", "+", "3", "4", "5", "="]


def test_saved_tokenizer_loads_with_tokenizers_and_transformers(tmp_path):
    path = save_tokenizer(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"

    plain = Tokenizer.from_file(str(path))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path))
    auto = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert plain.encode("12+345=").ids == PROMPT_12_PLUS_345
    assert fast.encode("12+345=") == PROMPT_12_PLUS_345
    assert auto("12+345=").input_ids == PROMPT_12_PLUS_345
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert auto.decode(digits("357") + [EOS_ID], skip_special_tokens=True) == "357"
    assert plain.decode(digits("357") + [EOS_ID], skip_special_tokens=False) == "357<eos>"


def test_unknown_characters_become_unk():
    assert build_tokenizer().encode("1 a").tokens == ["<bos>", "1", "<unk>", "<unk>"]


# ---------------------------------------------------------------- problems and splits


def small_task(**overrides) -> AdditionTask:
    config = dict(seed=7, max_digits=2, num_train=300, num_eval=50)
    return AdditionTask(AdditionTask.Config(**{**config, **overrides}))


def unordered(problems):
    return {(min(p.a, p.b), max(p.a, p.b)) for p in problems}


def test_splits_have_requested_sizes_and_operand_range():
    task = small_task()
    assert len(task.train_problems) == 300 and len(task.eval_problems) == 50
    for p in task.train_problems + task.eval_problems:
        assert 0 <= p.a < 100 and 0 <= p.b < 100


def test_held_out_is_disjoint_from_train_even_when_operands_swap():
    task = small_task()
    train, held_out = unordered(task.train_problems), unordered(task.eval_problems)
    assert len(train) == 300 and len(held_out) == 50  # no duplicates inside either split
    assert not train & held_out


def test_splits_are_a_function_of_the_seed():
    assert small_task().train_problems == small_task().train_problems
    assert small_task().eval_problems == small_task().eval_problems
    assert small_task(seed=8).train_problems != small_task().train_problems
    # The held-out set does not move when the training set grows.
    assert small_task(num_train=500).eval_problems == small_task().eval_problems


def test_config_rejects_more_problems_than_can_be_distinct():
    # max_digits=1: 55 unordered pairs, at most 27 may be requested.
    with pytest.raises(ValueError, match="max_digits=1"):
        AdditionTask(AdditionTask.Config(max_digits=1, num_train=20, num_eval=10))
    with pytest.raises(ValueError, match="partial_credit"):
        AdditionTask.Config(partial_credit=1.0)


def test_prompt_answer_and_max_lengths():
    problem = AdditionProblem(12, 345)
    assert (problem.prompt, problem.answer) == ("12+345=", "357")
    task = small_task(max_digits=3)
    tokenizer = build_tokenizer()
    longest = AdditionProblem(999, 999)
    assert len(tokenizer.encode(longest.prompt).ids) == task.max_prompt_tokens == 9
    assert len(digits(longest.answer) + [EOS_ID]) == task.max_response_tokens == 5


# ---------------------------------------------------------------- reward and accuracy


@pytest.mark.parametrize(
    "response, expected",
    [
        (digits("357") + [EOS_ID], 1.0),
        (digits("357") + [EOS_ID] + digits("9"), 1.0),  # after <eos>: ignored
        (digits("357"), 0.0),  # no <eos>: truncated
        (digits("358") + [EOS_ID], 0.0),
        (digits("0357") + [EOS_ID], 0.0),  # leading zero is not the exact answer
        (digits("35") + [BOS_ID] + digits("7") + [EOS_ID], 0.0),  # stray special token
        ([EOS_ID], 0.0),
        ([], 0.0),
    ],
)
def test_reward_is_one_only_for_exact_answer_then_eos(response, expected):
    assert small_task().reward(AdditionProblem(12, 345), response) == expected


def test_partial_credit_only_for_well_formed_wrong_answers():
    task = small_task(partial_credit=0.1)
    problem = AdditionProblem(12, 345)
    assert task.reward(problem, digits("358") + [EOS_ID]) == 0.1
    assert task.reward(problem, digits("357") + [EOS_ID]) == 1.0
    assert task.reward(problem, digits("358")) == 0.0
    assert task.reward(problem, [14, EOS_ID]) == 0.0  # "+" is not a number
    assert task.reward(problem, [EOS_ID]) == 0.0


def test_reversed_answers_are_scored_against_the_reversed_sum():
    task = small_task(reverse_answer=True, partial_credit=0.1)
    problem = AdditionProblem(12, 345)
    assert task.expected(problem) == "753"
    assert task.reward(problem, digits("753") + [EOS_ID]) == 1.0
    assert task.reward(problem, digits("357") + [EOS_ID]) == 0.1  # well-formed, wrong order
    assert task.score_text(problem, "753") == 1.0 and task.score_text(problem, None) == 0.0
    assert task.accuracy_text([problem, AdditionProblem(5, 5)], ["753", "10"]) == 0.5


def test_accuracy_counts_exact_answers_and_ignores_partial_credit():
    task = small_task(partial_credit=0.1)
    problems = [AdditionProblem(1, 2), AdditionProblem(10, 5), AdditionProblem(0, 0)]
    responses = [digits("3") + [EOS_ID], digits("16") + [EOS_ID], digits("0") + [EOS_ID]]
    assert task.accuracy(problems, responses) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="as many responses"):
        task.accuracy(problems, responses[:2])


# ---------------------------------------------------------------- episode packing


def test_pack_episodes_hand_written_example():
    episodes = [
        Episode(
            prompt_ids=[1, 5, 15],
            response_ids=[6, 2],
            generator_logprobs=[-0.5, -0.25],
            advantage=1.5,
            policy_version=0,
        ),
        Episode(
            prompt_ids=[1, 5, 14, 6, 15],
            response_ids=[7, 8, 2],
            generator_logprobs=[-1.0, -2.0, -3.0],
            advantage=-0.5,
            policy_version=0,
        ),
    ]
    batch = pack_episodes(episodes, pad_id=PAD_ID)

    I = -100  # noqa: E741
    assert torch.equal(
        batch["input_ids"], torch.tensor([[1, 5, 15, 6, 2, 0, 0, 0], [1, 5, 14, 6, 15, 7, 8, 2]])
    )
    assert torch.equal(
        batch["labels"], torch.tensor([[I, I, 6, 2, I, I, I, I], [I, I, I, I, 7, 8, 2, I]])
    )
    assert torch.equal(
        batch["generator_logprobs"],
        torch.tensor([[0, 0, -0.5, -0.25, 0, 0, 0, 0], [0, 0, 0, 0, -1.0, -2.0, -3.0, 0]]),
    )
    assert torch.equal(batch["advantages"], torch.tensor([1.5, -0.5]))
    assert "ref_logprobs" not in batch
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64


def test_pack_episodes_fixed_seq_len_and_ref_logprobs():
    episode = Episode(
        prompt_ids=[1, 4],
        response_ids=[2],
        generator_logprobs=[-0.1],
        ref_logprobs=[-0.2],
        advantage=0.0,
        policy_version=3,
    )
    batch = pack_episodes([episode], pad_id=PAD_ID, seq_len=4)
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 4, 2, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([[-100, 2, -100, -100]]))
    assert torch.equal(batch["ref_logprobs"], torch.tensor([[0, -0.2, 0, 0]]))
    with pytest.raises(ValueError, match="seq_len=2"):
        pack_episodes([episode], pad_id=PAD_ID, seq_len=2)
    without_ref = Episode(
        prompt_ids=[1], response_ids=[2], generator_logprobs=[0.0], advantage=0, policy_version=3
    )
    with pytest.raises(ValueError, match="ref_logprobs are set on 1 of 2"):
        pack_episodes([episode, without_ref], pad_id=PAD_ID)


def test_episode_rejects_logprobs_of_the_wrong_length():
    with pytest.raises(ValueError, match="generator_logprobs has 1 entries"):
        Episode(
            prompt_ids=[1], response_ids=[4, 2], generator_logprobs=[0.0], advantage=0,
            policy_version=0,
        )


def test_packed_labels_line_up_with_what_a_causal_model_scored_while_sampling():
    """Sample from a bigram model, record log p(o_i | previous token) as the generator would,
    pack, and recompute with ``token_logprobs`` on the bigram model's logits: they must agree."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=g)  # logits of next | current
    log_table = torch.log_softmax(table, dim=-1)
    episodes = []
    for prompt_len, response_len in [(4, 3), (9, 5), (2, 1)]:
        prompt = [BOS_ID] + torch.randint(4, 16, (prompt_len - 1,), generator=g).tolist()
        tokens, logps = list(prompt), []
        for _ in range(response_len):
            nxt = int(torch.multinomial(log_table[tokens[-1]].exp(), 1, generator=g))
            logps.append(float(log_table[tokens[-1], nxt]))
            tokens.append(nxt)
        episodes.append(
            Episode(
                prompt_ids=prompt,
                response_ids=tokens[prompt_len:],
                generator_logprobs=logps,
                advantage=1.0,
                policy_version=0,
            )
        )
    batch = pack_episodes(episodes, pad_id=PAD_ID)

    recomputed = token_logprobs(table[batch["input_ids"]], batch["labels"])

    torch.testing.assert_close(recomputed, batch["generator_logprobs"])
    assert int((batch["labels"] != -100).sum()) == 3 + 5 + 1
