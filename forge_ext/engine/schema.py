"""An engine section (YAML ``trainer:``, ``reference:``, ``critic:``) checked without torch or
torchtitan: its keys, the types of its plain fields, and the sizes the apps derive from it
(processes, data-parallel ranks, microbatches). Issue 38: a config error in under 2 s, where
importing torchtitan alone takes seconds.

The field tree of :class:`forge_ext.engine.config.EngineConfig` (forge_ext's sections and
torchtitan's own ``TrainingConfig``, ``ParallelismConfig``, ...) is saved in
``engine_fields.json`` beside this module, written by ``python -m forge_ext.engine.config
--write`` and kept current by tests/test_fast_config.py, as ``apps/<app>/help.txt`` is for
``--help``. :func:`forge_ext.engine.engine_config_from_mapping` still builds and validates
the real config (the model's own checks: RoPE length, heads, LoRA targets, pipeline stages)
before anything is spawned.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from forge_ext.config import unknown_keys_message

FIELDS_FILE = Path(__file__).with_name("engine_fields.json")

# The fields the sizes read, with the defaults _defaults / torchtitan give them (checked
# against the saved tree by the tests).
_SIZE_FIELDS = {
    "training": ("local_batch_size", "seq_len", "microbatch_size", "gradient_accumulation_steps",
                 "max_tokens_per_microbatch", "pad_to_multiple_of", "packing"),
    "parallelism": ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                    "context_parallel_degree", "tensor_parallel_degree",
                    "pipeline_parallel_degree", "pipeline_parallel_microbatch_size"),
    "checkpoint": ("enable", "folder", "keep_latest_k"),
}


@cache
def engine_fields() -> dict[str, Any]:
    """The saved field tree: ``{section: {field: {"types": [...], "default": ...,
    "section": <nested section or None>}}}``, ``""`` the top level."""
    return json.loads(FIELDS_FILE.read_text())


def check_engine_section(mapping: Any, section: str = "trainer") -> None:
    """Raise one ValueError naming every unknown key (``unknown key 'trainer.training.foo';
    accepted keys of trainer.training: [...]``) and plain value of the wrong type
    (``trainer.training.seq_len: 'abc' is not a valid int``) of an engine section, one line
    each (:func:`engine_section_problems`)."""
    problems = engine_section_problems(mapping, section)
    if problems:
        raise ValueError("\n".join(problems))


def engine_section_problems(mapping: Any, section: str = "trainer", *,
                            types: bool = True, extra: Sequence[str] = ()) -> list[str]:
    """The messages :func:`check_engine_section` raises, as a list (empty: none);
    ``types=False`` leaves out the values' types (the unknown keys only); ``extra``: keys
    the section takes at its top beside the engine's (the critic's own, not checked here)."""
    tree, problems = engine_fields(), []

    def check(node: Any, name: str, path: str) -> None:
        fields = tree[name] if name or not extra else {
            **{key: {"types": ["any"]} for key in extra}, **tree[name]}
        if not isinstance(node, Mapping):
            problems.append(f"{path} must be a mapping, got {type(node).__name__}")
            return
        unknown = sorted(set(node) - set(fields), key=str)
        if unknown:
            problems.append(unknown_keys_message(path, unknown, list(fields)))
        for key, value in node.items():
            if key not in fields:
                continue
            entry, where = fields[key], f"{path}.{key}"
            if entry.get("section") and isinstance(value, Mapping):
                check(value, entry["section"], where)
            elif types and not _admits(entry["types"], value):
                problems.append(f"{where}: {_describe(entry['types'], value)}")

    check(mapping if mapping is not None else {}, "", section)
    return problems


def engine_key_problems(mapping: Any, section: str = "trainer") -> list[str]:
    """The unknown keys of an engine section (:func:`engine_section_problems` without the
    types: a value interpolated from a field of the app's own, ``steps: ${loop.steps}``, is
    named by that field's check); a :data:`forge_ext.config.SectionCheck` for an app's
    ``from_mapping``."""
    return engine_section_problems(mapping, section, types=False)


def _admits(kinds: list[Any], value: Any) -> bool:
    for kind in kinds:
        if kind in ("any", "section") and not (kind == "section" and value is None):
            return True
        if isinstance(kind, dict) and value in kind["literal"]:
            return True
        if (kind == "null" and value is None or kind == "str" and isinstance(value, str)
                or kind == "bool" and isinstance(value, bool)
                or kind == "int" and isinstance(value, int) and not isinstance(value, bool)
                or kind == "float" and isinstance(value, (int, float))
                and not isinstance(value, bool)):
            return True
    return False


def _describe(kinds: list[Any], value: Any) -> str:
    literals = [v for k in kinds if isinstance(k, dict) for v in k["literal"]]
    if literals:
        return f"{value!r} is not one of {', '.join(repr(v) for v in literals)}"
    if value is None:
        return f"empty (null), but it needs a {' | '.join(kinds)} value"
    return f"{value!r} is not a valid {' | '.join(k for k in kinds if k != 'null')}"


def engine_view(mapping: Mapping[str, Any] | None, section: str = "trainer") -> SimpleNamespace:
    """The sizes of an engine section, defaults filled, after :func:`check_engine_section`:
    ``.engine``, ``.training`` and ``.parallelism`` (the fields of ``_SIZE_FIELDS``),
    ``.checkpoint`` (``enable``, ``folder``, ``keep_latest_k``), ``.model`` (``flavor``,
    ``hf_path``), ``.lora`` (the section as given, or None), ``.dump_folder``, ``.pp_degree``; what :func:`world_size_of`,
    :func:`data_parallel_size`, :func:`num_microbatches`, :func:`check_weights_transport` and
    :func:`check_checkpoint_limits` read, as they read an
    :class:`~forge_ext.engine.config.EngineConfig`."""
    check_engine_section(mapping, section)
    raw, tree = dict(mapping or {}), engine_fields()
    view = SimpleNamespace(engine=raw.get("engine", tree[""]["engine"]["default"]),
                           dump_folder=raw.get("dump_folder", tree[""]["dump_folder"]["default"]))
    defaults = {"checkpoint": {"last_save_model_only": False}}  # as engine.config._defaults
    for name, keys in _SIZE_FIELDS.items():
        given = raw.get(name) or {}
        setattr(view, name, SimpleNamespace(**{
            key: given.get(key, defaults.get(name, {}).get(key, tree[name][key].get("default")))
            for key in keys}))
    view.pp_degree = view.parallelism.pipeline_parallel_degree
    model = raw.get("model") or {}
    view.model = SimpleNamespace(**{key: model.get(key, tree["model"][key].get("default"))
                                    for key in ("flavor", "hf_path")})
    view.lora = raw.get("lora")
    return view


def world_size_of(config: Any, num_procs: int | None) -> int:
    """Processes the trainer needs: the product of parallel degrees, where
    ``data_parallel_shard_degree=-1`` (torchtitan's default) takes whatever ``num_procs``
    leaves. ``config``: an :class:`~forge_ext.engine.config.EngineConfig` or an
    :func:`engine_view`.

    Raises:
        ValueError: ``num_procs`` disagrees with explicit degrees.
    """
    par = config.parallelism
    fixed = (
        par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1)
        * par.context_parallel_degree * par.tensor_parallel_degree
        * par.pipeline_parallel_degree
    )
    if num_procs is None:
        return fixed
    if num_procs % fixed or (par.data_parallel_shard_degree != -1 and num_procs != fixed):
        raise ValueError(
            f"num_procs={num_procs} does not match the parallelism degrees (product {fixed}); "
            "change trainer.parallelism or num_procs"
        )
    return num_procs


def data_parallel_size(config: Any, world_size: int) -> int:
    """Data-parallel ranks of an engine world: processes / (TP * PP * CP)."""
    par = config.parallelism
    model_parallel = (
        par.tensor_parallel_degree * par.pipeline_parallel_degree * par.context_parallel_degree
    )
    return world_size // model_parallel


def num_microbatches(training: Any) -> int:
    """Microbatches per step on each data-parallel rank (``training``: an engine's
    ``training`` section, :meth:`forge_ext.engine.config.EngineConfig.num_microbatches`).

    Raises:
        ValueError: naming ``training.local_batch_size`` and the microbatch field when
            they do not divide, or when both microbatch fields are set.
    """
    t = training
    chosen = [
        f"training.{name}={getattr(t, name)}"
        for name in ("microbatch_size", "gradient_accumulation_steps",
                     "max_tokens_per_microbatch")
        if getattr(t, name) is not None
    ]
    if len(chosen) > 1:
        raise ValueError(f"set only one of {' and '.join(chosen)}")
    if t.max_tokens_per_microbatch is not None:
        return 1  # per step, from the rows' lengths (forge_ext.engine.microbatch)
    if t.microbatch_size is not None:
        if t.microbatch_size <= 0 or t.local_batch_size % t.microbatch_size:
            raise ValueError(
                f"training.local_batch_size={t.local_batch_size} is not a multiple of "
                f"training.microbatch_size={t.microbatch_size}"
            )
        return t.local_batch_size // t.microbatch_size
    if t.gradient_accumulation_steps is not None:
        ga = t.gradient_accumulation_steps
        if ga <= 0 or t.local_batch_size % ga:
            raise ValueError(
                f"training.local_batch_size={t.local_batch_size} is not divisible by "
                f"training.gradient_accumulation_steps={ga}"
            )
        return ga
    return 1


def fixed_rows_token_budget(config: Any) -> int:
    """The token budget (``training.max_tokens_per_microbatch``) that holds what one
    fixed-row microbatch of ``config`` holds (an engine config or :func:`engine_view`):
    ``training.seq_len`` x its rows (``local_batch_size`` / :func:`num_microbatches`), in
    padded positions per data-parallel rank. A batch of any number of rows then splits into
    microbatches none larger than the fixed one (:mod:`forge_ext.engine.microbatch`).

    Raises:
        ValueError: the split does not divide (:func:`num_microbatches`), or pipeline
            parallelism, whose schedules fix the microbatch shapes (naming the field).
    """
    if config.pp_degree > 1:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree={config.pp_degree} (a pipeline schedule "
            "fixes its microbatch shapes; a token budget needs it at 1)")
    t = config.training
    return t.seq_len * (t.local_batch_size // num_microbatches(t))


def check_model_limits(training: Any, parallelism: Any, *, max_seq_len: int | None,
                       n_heads: int, n_kv_heads: int, model: str) -> None:
    """Raise ValueError if ``training.seq_len`` exceeds the model's longest sequence or
    ``parallelism.tensor_parallel_degree`` does not divide its attention and KV heads
    (tensor parallelism splits attention by heads). One home for the two checks: the full
    check (the backends' ``validate_config``, from the built model or the checkpoint) and
    the light one (:func:`check_checkpoint_limits`, from config.json) raise the same words.

    Args:
        training, parallelism: an engine's sections (or an :func:`engine_view`'s).
        max_seq_len: the model's longest sequence (RoPE table, ``max_position_embeddings``),
            None if it has none.
        n_heads, n_kv_heads: attention and key/value heads.
        model: how the message names the model (``"qwen3 tiny"``, a checkpoint's
            config.json, :func:`checkpoint_label`).
    """
    if max_seq_len is not None and training.seq_len > max_seq_len:
        raise ValueError(
            f"training.seq_len={training.seq_len} exceeds the model's maximum sequence length "
            f"{max_seq_len} ({model}); lower training.seq_len"
        )
    tp = parallelism.tensor_parallel_degree
    for field, count in {"n_heads": n_heads, "n_kv_heads": n_kv_heads}.items():
        if tp > 1 and count % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree={tp} must divide the model's "
                f"{field}={count} ({model}: n_heads={n_heads}, n_kv_heads={n_kv_heads}); tensor "
                "parallelism splits attention by heads"
            )


def check_checkpoint_limits(view: SimpleNamespace) -> None:
    """:func:`check_model_limits` from ``model.hf_path``'s config.json (``max_position_
    embeddings``, ``num_attention_heads``, ``num_key_value_heads``), and a LoRA rank no larger
    than its ``hidden_size``, without torch, for an engine that builds its model from the
    checkpoint (``engine: hf``, or titan's ``model.flavor: hf``); other flavors and a missing
    config.json are left to the full check.

    Raises:
        ValueError: as :func:`check_model_limits`; a LoRA rank above ``hidden_size``.
    """
    model = view.model
    if not model.hf_path or (view.engine != "hf" and model.flavor != "hf"):
        return
    hf = checkpoint_config(model.hf_path)
    try:
        n_heads = int(hf["num_attention_heads"])
    except (ValueError, KeyError, TypeError):  # the full check says what is wrong
        return
    check_model_limits(view.training, view.parallelism,
                       max_seq_len=hf.get("max_position_embeddings"), n_heads=n_heads,
                       n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                       model=checkpoint_label(model.hf_path))
    lora = getattr(view, "lora", None)
    rank = lora.get("rank") if isinstance(lora, Mapping) else None
    hidden = hf.get("hidden_size")
    if isinstance(rank, int) and isinstance(hidden, int) and rank > hidden:
        # Not low-rank: the adapter outgrows the layer (a run wrote 7.3 GB of checkpoints
        # for the demo's 128-wide model at rank 100000).
        raise ValueError(
            f"lora.rank={rank} exceeds the model's hidden_size={hidden} "
            f"({checkpoint_label(model.hf_path)}): an adapter's rank is at most the smaller "
            "side of the layers it adapts (8 to 64 is usual); lower lora.rank"
        )


def check_engine_view(view: SimpleNamespace, section: str = "trainer") -> None:
    """The light checks of one engine section (:func:`engine_view`), without torch: its batch
    splits into microbatches (:func:`num_microbatches`), its LoRA suits its parallelism
    (:func:`check_lora`), its model's checkpoint admits it (:func:`check_checkpoint_limits`).

    Raises:
        ValueError: the first that fails, prefixed ``<section>: ``.
    """
    try:
        num_microbatches(view.training)
        check_lora(view.lora, view.parallelism)
        check_checkpoint_limits(view)  # seq_len, TP vs heads, LoRA rank: config.json
    except ValueError as e:
        raise ValueError(f"{section}: {e}") from None


def checkpoint_config(hf_path: str) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict, without torch; empty if it is missing, not
    JSON or not an object (the full check, which loads it, says what is wrong)."""
    try:
        config = json.loads((Path(hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def checkpoint_label(hf_path: str) -> str:
    """How a message names a model built from a checkpoint's config.json."""
    return str(Path(hf_path) / "config.json")


# The linear layers of a Llama/Qwen decoder block, HF name -> torchtitan's attribute name
# (torchtitan/models/common/decoder.py: attention.wq/wk/wv/wo, feed_forward.w1/w2/w3).
TITAN_NAMES: dict[str, str] = {
    "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
    "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2",
}
HF_TARGETS: tuple[str, ...] = tuple(TITAN_NAMES)


def check_targets(target_modules: Sequence[str] | str | None,
                  field: str = "trainer.lora.target_modules") -> tuple[str, ...]:
    """``target_modules`` as HF names; None or ``"all-linear"`` means every one of
    :data:`HF_TARGETS` (PEFT's ``all-linear`` leaves the output head alone, as here).

    Raises:
        ValueError: an empty list, or a name that is not a linear layer of the decoder blocks,
            naming ``field`` and the accepted names.
    """
    if target_modules is None or target_modules == "all-linear" or list(target_modules) == [
            "all-linear"]:
        return HF_TARGETS
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    names = tuple(target_modules)
    if not names:
        raise ValueError(f"{field}=[] adapts no layer: list some of {list(HF_TARGETS)} "
                         "or leave it unset for all of them")
    unknown = [n for n in names if n not in TITAN_NAMES]
    if unknown:
        raise ValueError(f"{field} names {unknown}, which the model has no linear layer "
                         f"called; choose among {list(HF_TARGETS)} (HF names) or 'all-linear'")
    return tuple(dict.fromkeys(names))


def check_lora(lora: Mapping[str, Any] | Any | None, parallelism: Any = None) -> None:
    """Raise ValueError, naming the field, for a ``lora`` section (a mapping, or
    :class:`~forge_ext.engine.config.LoRAConfig`) the engine cannot take: a rank below 1, a
    non-positive alpha, a target that is not a decoder linear layer (:func:`check_targets`),
    pipeline or tensor parallelism (``parallelism``: an engine's section, None not to check
    it). ``lora`` None: no LoRA, nothing to check. The rules' one home:
    :meth:`~forge_ext.engine.config.LoRAConfig.check` and the light config checks call it."""
    if lora is None:
        return
    if not isinstance(lora, Mapping) and not hasattr(lora, "rank"):
        raise ValueError(f"lora={lora!r} must be a section, e.g. lora={{rank: 16}} (fields rank, "
                         "alpha, target_modules, export_merged); remove it to train every weight")
    get = lora.get if isinstance(lora, Mapping) else lambda key, default=None: getattr(
        lora, key, default)
    rank = get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"lora.rank={rank!r} must be an integer >= 1 (e.g. lora.rank=8); remove the lora "
            "section to train every weight"
        )
    alpha = get("alpha")
    alpha = 2.0 * rank if alpha is None else alpha  # LoRAConfig's default
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"lora.alpha={alpha} must be > 0 (default 2 * lora.rank)")
    check_targets(get("target_modules"), "lora.target_modules")
    if parallelism is None:
        return
    pp = parallelism.pipeline_parallel_degree
    if pp > 1:
        raise ValueError(
            f"lora with parallelism.pipeline_parallel_degree={pp} is not supported yet (the "
            "adapter export and checkpoints are per stage); use data parallelism "
            "(parallelism.data_parallel_shard_degree / _replicate_degree), or no lora section"
        )
    tp = parallelism.tensor_parallel_degree
    if tp > 1:
        raise ValueError(
            f"lora with parallelism.tensor_parallel_degree={tp} is not supported (the split "
            "q/k/v projections LoRA needs have no tensor-parallel plan here); use "
            "parallelism.tensor_parallel_degree=1 with data parallelism, or no lora section"
        )


def check_weights_transport(config: Any, weights: Any) -> None:
    """Raise ValueError if the trainer cannot publish its weights through
    ``weights.transport``: ``direct`` needs the same tensors on every rank, which pipeline
    stages do not hold."""
    if config.pp_degree > 1 and weights.transport != "dcp":
        raise ValueError(
            f"weights.transport={weights.transport!r} needs the same tensors on every trainer "
            "rank, but pipeline stages hold different ones; use weights.transport=dcp with "
            "parallelism.pipeline_parallel_degree > 1"
        )
