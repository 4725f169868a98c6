"""The README's headline figures come from the code as it is (issue 50: it quoted 67.8% /
+34.2 for ``make demo`` long after the demo ended at 62.4% / +28.8): its block is
:mod:`apps.readme_figures`' rendering of ``docs/readme_figures.json``, which was measured on
the demo configs as they are now. Standard library and OmegaConf only: no run here."""

import json

import pytest

from apps.readme_figures import (
    DEMO_CONFIGS,
    EVAL_CONFIG,
    README,
    RECORD,
    REGENERATE,
    config_digest,
    parse_demo_console,
    readme_block,
    rendered_blocks,
    stale_configs,
)


@pytest.fixture(scope="module")
def record():
    assert RECORD.is_file(), f"{RECORD} is missing; measure the figures: {REGENERATE}"
    return json.loads(RECORD.read_text())


def test_the_configs_are_the_ones_the_figures_were_measured_on(record):
    assert set(record["demo"]["configs"]) == set(DEMO_CONFIGS)
    assert set(record["eval"]["configs"]) == {EVAL_CONFIG}
    stale = stale_configs(record)
    assert not stale, (f"a config changed after the README's figures were measured "
                       f"({'; '.join(stale)}); rerun the demo and record it: {REGENERATE}")


def test_the_readme_blocks_are_the_records_rendering(record):
    readme = README.read_text()
    blocks = rendered_blocks(record)
    assert len(blocks) == 2
    for (begin, end), text in blocks.items():
        block = readme_block(readme, begin, end)
        assert block is not None, f"README.md has lost its generated block {begin}"
        assert block == text, f"README.md's block {begin} was edited; {REGENERATE}"


def test_the_evaluation_is_of_the_demos_policies(record):
    """Greedy held-out accuracy of the warm-start and the final policy, evaluated apart,
    equals what the demo run logged for them (same prompts, greedy)."""
    greedy = [round(100 * row["greedy"], 1) for row in record["eval"]["rows"]]
    assert greedy == [record["demo"]["warm_start"], record["demo"]["after"]]


def test_the_recorded_numbers_are_those_of_the_recorded_console_lines(record):
    demo = record["demo"]
    parsed = parse_demo_console([demo["warm_start_line"], demo["last_step_line"],
                                 demo["summary_line"]])
    for key in ("warm_start", "after", "gain", "steps", "prompts", "warm_start_steps"):
        assert parsed[key] == demo[key], key
    assert round(demo["after"] - demo["warm_start"], 1) == demo["gain"]


def test_a_comment_leaves_the_digest_and_a_value_changes_it(tmp_path, monkeypatch):
    import apps.readme_figures as figures

    config = tmp_path / "configs" / "demo.yaml"
    config.parent.mkdir()
    config.write_text("loop: {steps: 100}\n")
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    before = config_digest("configs/demo.yaml")
    config.write_text("# a comment\nloop:\n  steps: 100   # steps\n")
    assert config_digest("configs/demo.yaml") == before
    config.write_text("loop: {steps: 101}\n")
    assert config_digest("configs/demo.yaml") != before
    assert len(DEMO_CONFIGS) == 2


def test_write_rewrites_both_blocks_from_a_new_record(record, tmp_path, monkeypatch):
    """What ``--write`` does after its runs: the record saved, each README block replaced
    by its rendering, the text around them kept."""
    import apps.readme_figures as figures

    readme, saved = tmp_path / "README.md", tmp_path / "figures.json"
    readme.write_text("before\n" + readme_block(README.read_text()) + "\nmiddle\n"
                      + readme_block(README.read_text(), figures.EVAL_BEGIN, figures.EVAL_END)
                      + "\nafter\n")
    monkeypatch.setattr(figures, "README", readme)
    monkeypatch.setattr(figures, "RECORD", saved)
    results = {"checkpoints": [{"label": name, "sets": {"held-out": {"metrics": {
        "greedy": g, "pass@1": 0.1, "pass@8": 0.5, "maj@8": 0.2, "reward": 0.1}}}}
        for name, g in (("a", 0.3), ("b", 0.6))]}
    new = {**record, "demo": {**record["demo"], "after": 60.0, "gain": 30.0},
           "eval": {**record["eval"], "rows": figures.parse_eval_results(results)}}
    figures.write(new)
    text = readme.read_text()
    assert json.loads(saved.read_text()) == new
    assert text.startswith("before\n") and "\nmiddle\n" in text and text.endswith("\nafter\n")
    assert "60.0%" in text and "| `b` | 60.0% | 10.0% | 50.0% | 20.0% |" in text, text
