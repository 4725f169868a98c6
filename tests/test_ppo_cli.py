"""PPO has a command of its own, ``python -m apps.ppo.main``: the RL app of apps.grpo.main
under that name (issue 46). Its ``--help`` is the saved reference, printed before torch,
torchtitan and Monarch are imported; its configs pass the same light checks, and a config
error is one line before the heavy imports, as the GRPO app's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "torchtitan", "transformers", "monarch", "vllm", "torchstore")
PROBE = """
import runpy, sys
sys.argv = ["main", *{args!r}]
code = 0
try:
    runpy.run_module("apps.ppo.main", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("EXIT", code, "IMPORTED", [m for m in {heavy!r} if m in sys.modules], file=sys.stderr)
"""


def run_ppo(*args: str) -> subprocess.CompletedProcess:
    """``python -m apps.ppo.main ARGS`` as a user runs it; stderr ends with its exit code and
    the heavy packages it imported."""
    return subprocess.run([sys.executable, "-c", PROBE.format(args=list(args), heavy=HEAVY)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """What the light checks read of model.hf_path: a config.json (Qwen3, 64 positions)."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "hidden_size": 128}))
    return str(folder)


def test_ppo_help_is_the_saved_reference_and_imports_nothing_heavy():
    result = run_ppo("--help")
    assert "EXIT 0 IMPORTED []" in result.stderr, result.stderr[-2000:]
    assert result.stdout == (ROOT / "apps" / "ppo" / "help.txt").read_text()
    assert result.stdout.startswith("usage: python -m apps.ppo.main [-h] --config CONFIG")
    assert "\nPPO on real Monarch actors: python -m apps.ppo.main --config\n" in result.stdout
    assert "  critic.warmup_steps: int = " in result.stdout  # the critic's own fields


def test_the_ppo_config_validates_as_a_ppo_run(model_dir):
    from apps.grpo.config import check_config

    config = check_config(str(ROOT / "configs" / "ppo_cpu_demo.yaml"),
                          [f"model.hf_path={model_dir}"])
    assert config.algorithm.advantage == "gae" and config.critic is not None
    assert config.grpo.group_size == 1


def test_a_ppo_config_error_is_one_line_before_the_heavy_imports(model_dir):
    result = run_ppo("--config", "configs/ppo_cpu_demo.yaml", f"model.hf_path={model_dir}",
                     "critic.warmup_steps=abc")
    assert "config error: " in result.stderr and "critic.warmup_steps" in result.stderr, (
        result.stderr[-2000:])
    assert "IMPORTED []" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
