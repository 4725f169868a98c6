"""The config reference is generated from the code (issue 28, test 1): ``docs/config.md``
equals what :mod:`apps.config_reference` writes, every forge_ext/apps config field has a
docstring, and ``--help`` prints the same fields."""

from dataclasses import dataclass, field

import pytest

from apps.config_reference import REGENERATE, grpo_sections, render, sft_sections, DOC_PATH
from forge_ext.config_doc import field_docs, first_sentence, help_text, sections, undocumented


def test_docs_config_md_equals_the_reference_generated_from_the_code():
    assert DOC_PATH.is_file(), f"{DOC_PATH} is missing; write it: {REGENERATE}"
    assert DOC_PATH.read_text() == render(), (
        f"{DOC_PATH} is stale (a config field, default or docstring changed); "
        f"regenerate it: {REGENERATE}"
    )


def test_every_forge_ext_and_apps_config_field_has_a_docstring():
    missing = list(dict.fromkeys(undocumented(grpo_sections()) + undocumented(sft_sections())))
    assert not missing, (
        "config fields without a docstring (write one as a string literal under the field): "
        + ", ".join(missing)
    )


@dataclass(kw_only=True, slots=True)
class _Inner:
    """An inner section."""

    size: int = 3
    """Its size. More words."""


@dataclass(kw_only=True, slots=True)
class _Outer:
    name: str
    """The name, e.g. ``abc``. Then more."""
    inner: _Inner = field(default_factory=_Inner)
    flags: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class _Sub(_Outer):
    name: str = "x"
    """A new docstring for the name."""


def test_a_field_without_a_docstring_is_reported_and_docstrings_follow_the_bases():
    found = sections(_Outer)
    rows = {f.path: f for s in found for f in s.fields}
    assert [s.path for s in found] == ["", "inner"]
    assert rows["name"].default == "required" and rows["inner.size"].default == "3"
    assert rows["inner"].doc == "An inner section."  # a section falls back on its class
    assert first_sentence(rows["name"].doc) == "The name, e.g. ``abc``."
    missing = undocumented(found, modules=(__name__.split(".")[0],))
    assert missing == [f"flags ({__name__}._Outer)"]
    assert field_docs(_Sub)["name"][0] == "A new docstring for the name."
    assert field_docs(_Sub)["inner"][0] == ""
    assert "  inner.size: int = 3\n      Its size.\n" in help_text(found)


@pytest.mark.parametrize("app", ["grpo", "sft"])
def test_help_lists_every_field_with_type_and_default(app, capsys):
    import importlib

    main = importlib.import_module(f"apps.{app}.main").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m apps.{app}.main")
    for section in (grpo_sections() if app == "grpo" else sft_sections()):
        for f in section.fields:
            assert f"  {f.path}: {f.type} = {f.default}\n" in out, f.path
    assert "trainer.training.seq_len: int = 512" in out
