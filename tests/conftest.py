"""Shared test helpers. ``import forge_ext`` first: it makes torchtitan pick the CPU device
on machines without an accelerator."""

import contextlib
import math
import os
import sys

# Monarch polls its meshes' supervision state every 10 s by default, so a killed proc is
# reported up to 10 s late; tests that kill procs wait for that report. Read once, when
# Monarch is imported: set before anything imports it.
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
# Stopping a proc mesh waits for its actors to stop and then for each process to exit before
# killing it; a proc that ran torch.distributed (gloo) does not exit by itself, so every
# trainer mesh's stop waited out Monarch's defaults: 10.3 s for a DP=2 trainer here, 2.3 s
# with these (its cleanup endpoint, which unlinks its shared memory, has run before).
os.environ.setdefault("HYPERACTOR_STOP_ACTOR_TIMEOUT", "2s")
os.environ.setdefault("HYPERACTOR_PROCESS_EXIT_TIMEOUT", "2s")

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


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-5):
    """Equal to fp32 rounding: ``rel`` relative, and ``rel`` of the tensor's largest entry
    absolute (a sum of microbatch or rank terms in another order differs by that where entries
    cancel)."""
    atol = rel * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=rel, atol=atol, msg=lambda m: f"{name}: {m}")


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
    from forge_ext.rl.episode import pack_episodes

    packed = pack_episodes(episodes, pad_id=pad_id)
    # One batch per data-parallel rank (a trainer of plain DP: every proc a DP rank); the
    # outputs come back concatenated in rank order.
    ranks = trainer.num_procs
    ids, labels = packed["input_ids"].chunk(ranks), packed["labels"].chunk(ranks)
    assert len(ids) == ranks, f"{len(packed['input_ids'])} rows over {ranks} DP ranks"
    logprobs = await trainer.forward(
        [{"input_ids": i} for i in ids], [{"labels": t} for t in labels], output="logprobs"
    )
    valid = packed["labels"] != -100
    return (logprobs - packed["generator_logprobs"])[valid].abs().max().item()


async def trainer_logprobs(trainer, completions):
    """The trainer's log-probs of each completion's response tokens (teacher-forced), and
    its argmax token at each response position: ``[(logprobs [R], argmax [R])]``. The
    trainer's ``training.local_batch_size`` must be 4 (rows go 4 at a time)."""
    width = max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    rows = len(completions) + (-len(completions)) % 4  # a multiple of local_batch_size
    ids = torch.zeros(rows, width, dtype=torch.long)
    labels = torch.full((rows, width), -100, dtype=torch.long)
    for i, c in enumerate(completions):
        row = c.prompt_ids + c.response_ids
        ids[i, : len(row)] = torch.tensor(row)
        start = len(c.prompt_ids) - 1
        labels[i, start : start + len(c.response_ids)] = torch.tensor(c.response_ids)
    out = []
    for lo in range(0, rows, 4):
        inputs, targets = [{"input_ids": ids[lo : lo + 4]}], [{"labels": labels[lo : lo + 4]}]
        logprobs = await trainer.forward(inputs, targets, output="logprobs")
        logits = await trainer.forward(inputs, output="logits")
        for j in range(4):
            i = lo + j
            if i >= len(completions):
                break
            start, n = len(completions[i].prompt_ids) - 1, len(completions[i].response_ids)
            out.append((logprobs[j, start : start + n], logits[j, start : start + n].argmax(-1)))
    return out


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    """An HF checkpoint shaped like the demo's warm-start (architecture of sft_cpu_demo.yaml)."""
    from forge_ext.tasks.tokenizer import VOCAB_SIZE, save_tokenizer
    from forge_ext.engine.hf_checkpoint import init_hf_checkpoint

    from pathlib import Path

    from forge_ext.config import load_yaml

    sft = load_yaml(Path(__file__).resolve().parent.parent / "configs" / "sft_cpu_demo.yaml")
    root = tmp_path_factory.mktemp("demo")
    save_tokenizer(root / "tok")
    fields = {"vocab_size": VOCAB_SIZE, "eos_token_id": 2, **sft["init"]["architecture"]}
    return str(init_hf_checkpoint(root / "ckpt", "qwen3", fields, seed=0, tokenizer_from=root / "tok"))


def task_checkpoint(root) -> str:
    """A tiny Qwen3 HF checkpoint under ``root`` with the addition task's tokenizer and
    random weights (std 0.5: logits far from uniform); head_dim 32, a size vLLM's CPU
    attention supports."""
    from pathlib import Path

    from safetensors.torch import load_file

    from forge_ext.engine.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint
    from forge_ext.tasks.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer

    root = Path(root)
    arch = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
        tie_word_embeddings=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
    )
    save_tokenizer(root / "tok")
    init = init_hf_checkpoint(root / "init", "qwen3", arch, seed=0, tokenizer_from=root / "tok")
    weights = random_state_dict(load_file(str(init / "model.safetensors")), seed=9, std=0.5)
    return str(save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", arch),
                                  tokenizer_from=init))


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


@contextlib.asynccontextmanager
async def gloo_ranks(name: str, actor: type, procs: int = 2):
    """``procs`` ranks of ``actor`` spawned as ``name`` on this host's own procs, with
    torch.distributed's environment set up (``monarch.spmd``) and each rank's
    ``init_process_group`` endpoint called (``actor`` defines it: gloo, as a CPU trainer's
    ranks); the procs are stopped on leaving. The rank mesh of a sharded trainer's tests
    (tests/test_weights_publish.py, tests/test_weights_delta.py)."""
    import monarch.spmd
    from monarch.actor import this_host

    mesh = this_host().spawn_procs(per_host={"procs": procs})
    await monarch.spmd.setup_torch_elastic_env_async(mesh)
    ranks = mesh.spawn(name, actor)
    await ranks.init_process_group.call()
    try:
        yield ranks
    finally:
        await mesh.stop()


@contextlib.asynccontextmanager
async def one_proc_actor(name: str, actor: type):
    """``actor`` spawned as ``name`` on a proc of its own (a generator-side reader), stopped
    on leaving."""
    from monarch.actor import this_host

    mesh = this_host().spawn_procs(per_host={"procs": 1})
    try:
        yield mesh.spawn(name, actor)
    finally:
        await mesh.stop()


@pytest.fixture
def mesh_failures():
    """Failures Monarch reports to this client for a proc killed with ``SIGKILL``, recorded;
    every other failure is printed and goes on to the hook before (forge_ext's, installed at
    the session's start).

    The hook stays for the rest of the session: Monarch reports each actor of the dead proc
    (the generator, its logger, ...), some after the test has ended.
    """
    import monarch.actor

    failures = []
    default = monarch.actor.unhandled_fault_hook

    def record_sigkill(failure):
        if "Killed(sig=9)" not in failure.report():
            print(f"unexpected mesh failure: {failure.report()}", file=sys.stderr, flush=True)
            default(failure)  # forge_ext's hook (pytest_sessionstart): never exits
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


def chat_checkpoint(root, end_prone: float = 0.0) -> str:
    """A tiny random Qwen3 (head_dim 32, a size vLLM's CPU attention takes) whose tokenizer
    is :func:`save_chat_tokenizer`'s, saved under ``root``; returns its path.

    ``end_prone > 0`` points the LM head's row of the end token along the mean final hidden
    state (scaled by ``end_prone``), so that a turn often ends within a few tokens (a random
    model otherwise almost never samples it): 1.0 gave it a mean probability of ~0.18 per
    position, 1.5 about 0.4.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from forge_ext.engine.hf_checkpoint import hf_config_dict, init_hf_checkpoint, save_hf_checkpoint

    tok = save_chat_tokenizer(root / "tok")
    arch = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    init = init_hf_checkpoint(root / "init", "qwen3", arch, seed=0, tokenizer_from=root / "tok")
    weights = random_state_dict(load_file(str(init / "model.safetensors")), seed=3, std=0.5)
    if end_prone:
        model = AutoModelForCausalLM.from_config(
            __import__("transformers").AutoConfig.from_pretrained(init), torch_dtype=torch.float32)
        model.load_state_dict(weights)
        ids = torch.randint(0, len(tok), (8, 40), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            mean = model.model(input_ids=ids).last_hidden_state.reshape(-1, 64).mean(0)
        head = weights["lm_head.weight"]
        head[tok.eos_token_id] = end_prone * mean / mean.norm() * head.norm(dim=1).mean()
    return str(save_hf_checkpoint(root / "ckpt", weights, hf_config_dict("qwen3", arch),
                                  tokenizer_from=init))


def _grpo_app():
    from apps.grpo.main import RLApp

    return RLApp


class Recording(_grpo_app()):
    """The app as shipped, plus each step's rollouts and the generator-vs-trainer log-prob
    gap on the sampled tokens (on-policy: the trainer holds the sampling weights)."""

    def __init__(self, config):
        super().__init__(config)
        self.rollouts, self.trained, self.gap = {}, {}, {}

    async def build_rollouts(self, step):
        rollouts = await super().build_rollouts(step)
        self.rollouts[step] = rollouts
        self.gap[step] = await generator_logprob_gap(self.trainer, rollouts.episodes,
                                                     self.tok.pad_id)
        return rollouts

    async def train_step(self, step, rollouts):
        metrics = await super().train_step(step, rollouts)
        self.trained[step] = rollouts
        return metrics


def history(output_dir):
    """The rows of a run's ``metrics.jsonl``."""
    import json
    import os

    return [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]


def tensorboard_events(log_dir):
    """``(scalars {tag: [(step, value)]}, texts {tag: [(step, text)]})`` read back from a
    run's TensorBoard event files with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    texts = {}
    for tag in events.Tags()["tensors"]:  # add_text writes a string tensor ("<tag>/text_summary")
        texts[tag.split("/text_summary")[0]] = [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in events.Tensors(tag)]
    return scalars, texts


def small(output_dir, checkpoint, *extra):
    """Overrides of a GRPO config for a 2-step run of 2 prompts x 4 samples, checkpoints off."""
    return [
        f"model.hf_path={checkpoint}", f"output_dir={output_dir}",
        "grpo.prompts_per_step=2", "grpo.group_size=4",
        "trainer.training.local_batch_size=8", "reference.training.local_batch_size=8",
        "loop.steps=2", "loop.eval_every=2", "loop.save_every=0",
        "trainer.checkpoint.enable=false", "procs.env={}", *extra,
    ]


@contextlib.contextmanager
def vllm_environment_restored():
    """Undo, on leaving, what starting a vLLM engine in this process sets in ``os.environ``
    (``VLLMEngine``'s defaults, e.g. ``VLLM_CPU_OMP_THREADS_BIND`` for its tensor-parallel
    size: left set, a later tp=2 engine's workers failed on tp=1's binding) and vLLM's cache
    of its environment variables."""
    import vllm.envs

    environ = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        vllm.envs.disable_envs_cache()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster of 3 simulated nodes on this machine for the session
    (:mod:`slurm_cluster`: partitions ``all``, 3 nodes, and ``one``), installed from the
    distribution's packages when missing. Skipped, saying why, only where this machine cannot
    run Slurm (not root)."""
    from slurm_cluster import SlurmCluster, slurm_unavailable

    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(nodes=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_sessionstart(session):
    """Monarch's failure reports go to forge_ext's hook from the session's start
    (:func:`forge_ext.runtime.supervision.install_fault_hook`: to the active run's watch, else logged
    and dropped), never to Monarch's default, ``sys.exit(1)`` from its client thread: a late
    report of a proc an earlier test killed (a host killed, its procs' reports arriving after
    the test) ended a whole session at 56% with status 1, no summary and nothing printed (the
    default hook's message goes to the test's captured stderr). A test that needs a dead proc
    noticed sees it in its own calls or its run's watch."""
    from forge_ext.runtime.supervision import install_fault_hook

    install_fault_hook()


def pytest_sessionfinish(session, exitstatus):
    session.config._forge_exit_status = int(exitstatus)


class _ShutDownByTheExit:
    """What Monarch's atexit hook gets from ``shutdown_context`` once the session ends the
    process itself (:func:`pytest_unconfigure`)."""

    def get(self, timeout: float | None = None) -> None:
        return None


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the session's process once pytest has finished (the summary printed, every other
    plugin unconfigured), with pytest's exit status:

    1. failures Monarch reports from now on are dropped: they have no test to fail, and
       Monarch's default hook answers with ``sys.exit`` (a killed proc's undeliverable
       messages were reported after the summary);
    2. Monarch's client is not shut down: in three sessions of 2026-12-03/04 (1042-1043
       passed) its shutdown ended the process with status 1 after the summary, nothing
       printed. A proc a test had SIGKILLed was still subscribed to the supervision of
       torchstore's controller mesh; at shutdown the mesh controller's message to it
       expired, the mesh controller failed, and its report to the client, stopped by then,
       is "failed to send supervision event to actor ... Crash the process" in Monarch's
       Rust (``/tmp/<user>/monarch_log.log``). The session's procs end with it (Monarch's
       bootstrap sets PDEATHSIG); Monarch's atexit hook finds nothing to do;
    3. the atexit hooks run (shared memory unlinked), then ``os._exit``: the interpreter's
       own teardown is skipped, in which a green CI session (708 passed) was killed by
       SIGSEGV after its summary. The threads left by Monarch's runtime, gloo, OpenMP and
       vLLM engines run in-process are torn down by the exit itself.

    ``FORGE_EXT_PYTEST_NORMAL_EXIT=1`` shuts Monarch down
    (:func:`forge_ext.runtime.supervision.shutdown_monarch`) and keeps the interpreter's own exit (to
    debug it; ``PYTHONFAULTHANDLER=1`` prints where a crash happens).
    """
    import atexit
    import sys

    from forge_ext.runtime.supervision import shutdown_monarch

    if "monarch.actor" in sys.modules:
        import monarch.actor

        monarch.actor.unhandled_fault_hook = lambda failure: None
    status = getattr(config, "_forge_exit_status", None)
    if status is None or os.environ.get("FORGE_EXT_PYTEST_NORMAL_EXIT") == "1":
        shutdown_monarch()
        return
    if "monarch.actor" in sys.modules:
        from monarch._src.actor import actor_mesh

        # Monarch's atexit hook calls actor_mesh.shutdown_context(...).get(timeout=1.0).
        actor_mesh.shutdown_context = lambda *args, **kwargs: _ShutDownByTheExit()
    sys.stdout.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def random_adapter(hf_state_dict: dict, rank: int, targets=("q_proj", "v_proj", "down_proj"),
                   seed: int = 0, std: float = 0.1) -> dict:
    """A LoRA adapter in PEFT's names (:mod:`forge_ext.engine.lora`) for the ``targets`` linear
    layers of ``hf_state_dict`` (HF names): ``lora_A [rank, in]``, ``lora_B [out, rank]``,
    both random (non-zero B: the adapter changes the model)."""
    from forge_ext.engine import lora

    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, weight in hf_state_dict.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in targets or not name.endswith(".weight"):
            continue
        out_features, in_features = weight.shape
        adapter[lora.peft_key(module, "A")] = torch.randn(rank, in_features, generator=g) * std
        adapter[lora.peft_key(module, "B")] = torch.randn(out_features, rank, generator=g) * std
    return adapter


LORA_RANK = 4


def lora_trainer_config(checkpoint: str) -> dict:
    """A ``trainer:`` section training rank-4 LoRA adapters on all seven linear kinds (alpha
    2 * rank) of the HF ``checkpoint``, 4 rows per step (:func:`trainer_logprobs`)."""
    return {
        "model": {"name": "qwen3", "flavor": "hf", "hf_path": checkpoint},
        "training": {"local_batch_size": 4, "seq_len": 64},
        "optimizer": {"lr": 3e-2},
        "lora": {"rank": LORA_RANK},
    }


def lora_roots(generator) -> list[str]:
    """A vLLM generator's adapter folders in /dev/shm (``forge_ext-lora-<its pid>-...``)."""
    return [os.path.join("/dev/shm", f) for f in os.listdir("/dev/shm")
            if f.startswith(f"forge_ext-lora-{generator.owner_pid}-")]


# A sampled token its policy is not sure of (p < 0.9): one a new version can move. A token at
# p ~ 1 (the end token after a prompt that always ends) keeps log-prob ~0 under any version,
# so it cannot tell a stale generator from a fresh one.
UNCERTAIN_LOGPROB = math.log(0.9)


def uncertain_tokens(completions) -> int:
    """How many of ``completions``' sampled tokens had log-prob < :data:`UNCERTAIN_LOGPROB`
    when sampled."""
    return sum(lp < UNCERTAIN_LOGPROB for c in completions for lp in c.logprobs)


async def probe_samples(generator, prompts, version: int, want: int = 8, vocab: int = 256):
    """``generator``'s samples of ``prompts`` (4 each, seeded by ``version``), and probes:
    while fewer than ``want`` sampled tokens were uncertain (:func:`uncertain_tokens`), up to
    4 rounds of 4 more prompts of 8 random tokens (ids 3..199, seeded by ``version`` and the
    round), 4 samples each. Fails if ``want`` is not reached: a check on certain tokens alone
    would pass whatever version the generator served.

    Returns:
        ``(samples of prompts, samples of the probes)``.
    """
    sampled, probes = await generator.generate(prompts, n=4, seed=version), []
    for round_ in range(4):
        if uncertain_tokens(sampled + probes) >= want:
            break
        g = torch.Generator().manual_seed(1_000 * version + round_)
        extra = torch.randint(3, min(200, vocab), (4, 8), generator=g).tolist()
        probes += await generator.generate(extra, n=4, seed=1_000 * version + round_)
    found = uncertain_tokens(sampled + probes)
    assert found >= want, (
        f"version {version}: {found} of the sampled tokens had p < 0.9 (want {want}): the "
        "policy is certain of everything sampled, so no version change could be seen")
    return sampled, probes


def max_log_ratio(completions, reference) -> float:
    """Largest ``|log pi_trainer - log pi_generator|`` over ``completions``' sampled tokens
    (``reference``: :func:`trainer_logprobs` of them); 0 for none."""
    return max(((lp - torch.tensor(c.logprobs)).abs().max().item()
                for c, (lp, _) in zip(completions, reference)), default=0.0)


# The probes' bound: random prompts reach tokens whose logits are large (tests/test_vllm.py's
# end token, its head row scaled to norm 100), where float32 rounding differs by more than
# 1e-4 between vLLM and the trainer (1.3e-4 seen). A stale version moves uncertain tokens by
# more than 1e-2 (checked below), which this bound still sees.
PROBE_LOG_RATIO = 1e-3


async def assert_on_policy_across_lora_versions(generator, trainer, prompts, versions,
                                                count: int = 3) -> None:
    """``count`` LoRA versions, each after two optimizer steps on random sequences (the
    adapters' B starts at zero): the trainer pushes it, the generator loads and samples with
    it, and the importance ratio ``pi_trainer / pi_generator`` of every token sampled for
    ``prompts`` is 1 within 1e-4. The samples hold tokens the policy was not sure of (probes
    of random prompts are added where ``prompts``' are all near certain, their ratio within
    :data:`PROBE_LOG_RATIO`; :func:`probe_samples`), and on those of the previous version's
    samples the new version must move the trainer's log-probs by more than 1e-2: a generator
    that kept serving the previous version fails at any seed (at some, every sample of
    ``prompts`` is the end token at p = 1, whose log-prob no version moves). A vLLM generator
    holds exactly the served version's PEFT folder."""
    vocab = 256
    previous = None
    for _ in range(count):
        version = next(versions)
        for seed in (2 * version, 2 * version + 1):
            batch = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(seed))
            await trainer.train_step([{"input_ids": batch}],
                                     [{"labels": torch.roll(batch, -1, 1)}])
        await trainer.push_weights(version)
        await generator.update_weights(version)
        own, probes = await probe_samples(generator, prompts, version, vocab=vocab)
        sampled = own + probes
        assert {c.policy_version for c in sampled} == {version}
        reference = await trainer_logprobs(trainer, sampled)
        for group, refs, bound in ((own, reference[:len(own)], math.log1p(1e-4)),
                                   (probes, reference[len(own):], PROBE_LOG_RATIO)):
            log_ratio = max_log_ratio(group, refs)
            assert log_ratio <= bound, (
                f"version {version}: importance ratio off 1 (|log ratio| up to "
                f"{log_ratio:.2e} > {bound:.0e}; {len(probes)} of {len(sampled)} samples "
                "are probes)")
        if previous is not None:  # the new version must matter, or this could not fail
            again = await trainer_logprobs(trainer, previous)
            moved = 0.0
            for c, (lp, _) in zip(previous, again):
                sampled_lp = torch.tensor(c.logprobs)
                uncertain = sampled_lp < UNCERTAIN_LOGPROB
                if uncertain.any():
                    moved = max(moved, (lp - sampled_lp)[uncertain].abs().max().item())
            assert moved > 1e-2, (
                f"version {version} barely changed the policy on the previous version's "
                f"uncertain tokens ({moved:.1e})")
        previous = sampled
        if generator.config.backend == "vllm":  # the previous adapter's folder is gone
            (root,) = lora_roots(generator)
            (folder,) = os.listdir(root)
            assert folder.startswith(f"policy-v{version}-id")


def assert_masked_tokens_carry_no_gradient(path, episodes, pad_id: int) -> None:
    """The GRPO loss on ``episodes`` (with explicit loss masks; advantages set here, of both
    signs) through the transformers model at ``path``: changing the log-prob inputs (generator's, reference's) at prompt and masked
    positions leaves every gradient bitwise unchanged; changing them at one model token does
    not; the masked positions are exactly where each episode's mask says."""
    from transformers import AutoModelForCausalLM

    from forge_ext.rl.episode import pack_episodes
    from forge_ext.rl.losses.grpo import grpo_loss

    import dataclasses

    # Advantages of both signs (a group's may all be 0: no policy gradient to see).
    episodes = [dataclasses.replace(
        ep, advantage=(1.0, -0.5, 0.25, -1.0)[i % 4],
        ref_logprobs=ep.ref_logprobs if ep.ref_logprobs is not None
        else [lp - 0.1 for lp in ep.generator_logprobs.tolist()])
        for i, ep in enumerate(episodes)]
    packed = pack_episodes(episodes, pad_id=pad_id)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def gradients(mb):
        model.zero_grad()
        logits = model(input_ids=mb["input_ids"]).logits
        grpo_loss(logits, mb, kl_coef=0.1).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base = gradients(packed)
    masked = packed["labels"] == -100
    assert masked.any() and (~masked).any()
    changed = {k: v.clone() for k, v in packed.items()}
    for key in ("generator_logprobs", "ref_logprobs"):
        changed[key][masked] = torch.randn(int(masked.sum())) * 5
    assert all(torch.equal(a, b) for a, b in zip(base, gradients(changed)))
    one = {k: v.clone() for k, v in packed.items()}
    row, col = (~masked).nonzero()[0].tolist()
    one["generator_logprobs"][row, col] -= 1.0
    assert not all(torch.equal(a, b) for a, b in zip(base, gradients(one)))
    for r, ep in enumerate(episodes):
        first = len(ep.prompt_ids) - 1
        labels = packed["labels"][r, first : first + len(ep.response_ids)]
        assert ((labels != -100).int().tolist()) == ep.response_mask.int().tolist()


def assert_every_prompt_trained_once(crashed, resumed) -> None:
    """A run killed mid-step (``crashed``, Recording) and its rerun (``resumed``): together
    they trained the prompt stream's rows in order, each once, and the resumed step sampled
    what the killed one had (each sample seeded from its step, not from what ran before)."""
    from forge_ext.tasks import PromptStream, build_task

    steps = sorted(resumed.trained)
    assert sorted(crashed.trained) == list(range(steps[0])) and steps[-1] == len(
        crashed.trained) + len(steps) - 1
    trained = [row for run in (crashed, resumed) for r in run.trained.values() for row in r.rows]
    config = resumed.config
    expected = PromptStream(build_task(config.task).train_rows(), config.seed).slice(
        0, config.loop.steps * config.grpo.prompts_per_step)
    assert [r.prompt for r in trained] == [r.prompt for r in expected]
    assert len({r.prompt for r in trained}) == len(trained)
    before, after = crashed.rollouts[steps[0]].episodes, resumed.rollouts[steps[0]].episodes
    assert [(ep.prompt_ids.tolist(), ep.response_ids.tolist()) for ep in before] == [
        (ep.prompt_ids.tolist(), ep.response_ids.tolist()) for ep in after]
