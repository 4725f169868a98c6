"""Shared test helpers. ``import forge_ext`` first: it makes torchtitan pick the CPU device
on machines without an accelerator."""

import contextlib
import os

# Monarch polls its meshes' supervision state every 10 s by default, so a killed proc is
# reported up to 10 s late; tests that kill procs wait for that report. Read once, when
# Monarch is imported: set before anything imports it.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import forge_ext  # noqa: E402,F401  (must precede any torchtitan import)
import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402
import torch  # noqa: E402

from forge_ext.engine import IGNORE_INDEX


def make_lm_batch(batch_size: int, seq_len: int, vocab: int, seed: int, ignore_prefix=None):
    """A causal-LM batch: ``input_ids [B, S]`` and shifted ``labels [B, S]``.

    ``ignore_prefix[i]`` masks the first tokens of row i (like a prompt), so rows carry
    different numbers of valid tokens.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    for i, n in enumerate(ignore_prefix or []):
        labels[i, :n] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (or the tensor itself)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def random_state_dict(state_dict: dict, seed: int, std: float = 0.2) -> dict:
    """Random weights shaped like ``state_dict`` (the default init leaves logits near zero,
    which makes parity tests pass vacuously)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state_dict.items():
        v = full(v)
        noise = torch.randn(v.shape, generator=g, dtype=v.dtype) * std
        out[k] = (1.0 + noise) if "norm" in k else noise
    return out


async def generator_logprob_gap(trainer, episodes, pad_id: int) -> float:
    """Largest ``|trainer log-prob - generator log-prob|`` over the sampled tokens of
    ``episodes`` (GRPO ``Episode``s), the trainer's from a forward pass of the packed batch
    (``RLTrainer.forward(..., output="logprobs")``)."""
    from forge_ext.episode import pack_episodes

    packed = pack_episodes(episodes, pad_id=pad_id)
    logprobs = await trainer.forward(
        [{"input_ids": packed["input_ids"]}], [{"labels": packed["labels"]}], output="logprobs"
    )
    valid = packed["labels"] != -100
    return (logprobs - packed["generator_logprobs"])[valid].abs().max().item()


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    """An HF checkpoint shaped like the demo's warm-start (architecture of sft_cpu_demo.yaml)."""
    from forge_ext.tasks.tokenizer import VOCAB_SIZE, save_tokenizer
    from forge_ext.hf_checkpoint import init_hf_checkpoint

    from pathlib import Path

    from forge_ext.config import load_yaml

    sft = load_yaml(Path(__file__).resolve().parent.parent / "configs" / "sft_cpu_demo.yaml")
    root = tmp_path_factory.mktemp("demo")
    save_tokenizer(root / "tok")
    fields = {"vocab_size": VOCAB_SIZE, "eos_token_id": 2, **sft["init"]["architecture"]}
    return str(init_hf_checkpoint(root / "ckpt", "qwen3", fields, seed=0, tokenizer_from=root / "tok"))


async def spawn_all(*spawns):
    """Await the spawns (of trainers, generators: anything with an async ``stop()``) at
    once and return their handles in order: a proc's start is mostly imports in a fresh
    process, and two cores run two. If one fails, those that started are stopped, then its
    error is raised."""
    import asyncio

    results = await asyncio.gather(*spawns, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        await asyncio.gather(*(r.stop() for r in results if not isinstance(r, BaseException)),
                             return_exceptions=True)
        raise failures[0]
    return results


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def store():
    """A torchstore for the module's tests (``forge_ext.compat.torchstore_monarch``)."""
    import torchstore as ts

    from forge_ext.compat.torchstore_monarch import initialize_store

    await initialize_store()
    yield
    await ts.shutdown()


@pytest.fixture
def mesh_failures():
    """Failures Monarch reports to this client for a proc killed with ``SIGKILL``, recorded
    instead of passed to Monarch's default ``unhandled_fault_hook`` (``sys.exit``, which
    reaches pytest as a KeyboardInterrupt); every other failure still goes to it.

    The hook stays for the rest of the session: Monarch reports each actor of the dead proc
    (the generator, its logger, ...), some after the test has ended.
    """
    import monarch.actor

    failures = []
    default = monarch.actor.unhandled_fault_hook

    def record_sigkill(failure):
        if "Killed(sig=9)" not in failure.report():
            default(failure)
        failures.append(failure)

    monarch.actor.unhandled_fault_hook = record_sigkill
    return failures


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_chat_tokenizer(directory, corpus=None):
    """A byte-level BPE tokenizer trained here with ``tokenizers`` (a few hundred ids) plus a
    ChatML chat template, saved with ``save_pretrained`` into ``directory``: ``<|im_end|>``
    ends a turn (its ``eos_token``), ``<|endoftext|>`` pads. Returns the transformers
    tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = corpus or [
        "What is 12 plus 30? The answer is 42.", "You are a helpful assistant.",
        "system user assistant", "Compute 7 times 6 and reply with the number only.",
    ] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(directory)
    return fast


@contextlib.contextmanager
def engine_core_in_this_process():
    """vLLM engines started inside run their engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), their workers in processes of their own as
    always: a process less to start (mostly imports), ~10 s less per engine here.

    The engine core then sets this process's torch threads to 1, seeds its global RNGs,
    freezes its heap and caches vLLM's environment variables (``vllm/v1/engine/core.py``,
    ``vllm/engine/arg_utils.py``): all undone on leaving, for the tests that follow.
    """
    import gc
    import random

    import numpy
    import vllm.envs

    saved = (torch.get_num_threads(), torch.get_rng_state(), random.getstate(),
             numpy.random.get_state())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            yield
        finally:
            vllm.envs.disable_envs_cache()
            gc.unfreeze()
            threads, torch_rng, python_rng, numpy_rng = saved
            torch.set_num_threads(threads)
            torch.set_rng_state(torch_rng)
            random.setstate(python_rng)
            numpy.random.set_state(numpy_rng)
