"""A config reference generated from the code: every section and field of an app's config with
its type, default and docstring.

Field docstrings are the string literal under each dataclass field (the convention of
torchtitan's configs and of ``simple_parsing``); they are read from the source with
:mod:`ast`, following the class's bases, so a subclass's docstring of a field overrides its
base's. The same walk renders the console text of ``--help``
(:func:`help_text`) and the Markdown of ``docs/config.md`` (:func:`markdown`), so the two
cannot disagree, and ``tests/test_config_doc.py`` keeps the page equal to the code.

A section whose field is a plain mapping for a component that validates it itself (the
engine's ``trainer:``, the ``task:`` of each source) is described by the dataclass that
validates it, named in the app's ``expand`` mapping::

    sections(GRPOConfig, expand={"trainer": EngineConfig, "task": {"addition": ...}})
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any

# Modules whose fields must carry a docstring (test 1 of issue 28): ours. torchtitan's own
# fields are documented by torchtitan; one it leaves without says so in the reference.
OWN_MODULES = ("forge_ext", "apps")
NO_DOCSTRING = "(no docstring upstream)"


@dataclasses.dataclass(frozen=True, slots=True)
class FieldDoc:
    path: str
    """Dotted YAML key, e.g. ``trainer.training.seq_len``."""
    type: str
    """The annotation as written for a reader (``int | None``, ``"sdpa" | "flex"``)."""
    default: str
    """The default as YAML would spell it (``null``, ``true``, ``[]``), or ``required``."""
    doc: str
    """The field's docstring (dedented, paragraphs kept), or ``""``."""
    owner: str
    """``module.QualName`` of the dataclass that declares the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class SectionDoc:
    path: str
    """Dotted YAML key of the section (``""`` for the top level)."""
    owner: str
    """``module.QualName`` of the section's dataclass."""
    doc: str
    """The dataclass's own docstring (``""`` if it has none)."""
    fields: tuple[FieldDoc, ...]
    variant: str = ""
    """For a section whose fields depend on a value (``task.source``), which value."""


def first_sentence(doc: str) -> str:
    """The docstring's first sentence on one line (up to the first ``". "`` or the end of
    its first paragraph)."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    match = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bvs)\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


@functools.cache
def _class_field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` declared in ``cls``'s own body (not its bases)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a C extension, an interactive class)
        return {}
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))
    docs = {}
    body = node.body
    for stmt, after in zip(body, [*body[1:], None]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _attributes_section(cls: type) -> dict[str, str]:
    """``{name: text}`` of a Google-style ``Attributes:`` block in the class docstring (the
    other place a field is documented, e.g. :class:`forge_ext.weights.config.WeightsConfig`)."""
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    match = re.search(r"^Attributes:\n((?:[ \t]+.*\n?|\n)+)", doc, re.MULTILINE)
    if not match:
        return {}
    out, name = {}, None
    for line in textwrap.dedent(match.group(1)).splitlines():
        entry = re.match(r"^(\w+)(?: \([^)]*\))?: ?(.*)$", line)
        if entry:
            name = entry.group(1)
            out[name] = entry.group(2)
        elif name and line.strip():
            out[name] += " " + line.strip()
    return out


def field_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (docstring, owner)}`` of a dataclass, a subclass's docstring overriding its
    base's; ``owner`` is the class that declares the field last. A field without a docstring
    of its own takes its entry of the class docstring's ``Attributes:`` block, if any."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        own = {**_attributes_section(klass), **_class_field_docs(klass)}
        annotations = klass.__dict__.get("__annotations__", {})
        for name in annotations:
            if name in own or name not in out:
                out[name] = (own.get(name, out.get(name, ("", ""))[0]), _qualname(klass))
    return out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def type_name(hint: Any) -> str:
    """An annotation for a reader: ``int``, ``str | None``, ``list[str]``,
    ``"sdpa" | "flex"`` (a ``Literal``), a dataclass by its class name."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) if isinstance(a, str) else repr(a) for a in args)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    if hint is Any:
        return "any"
    if isinstance(hint, type):
        return hint.__qualname__ if dataclasses.is_dataclass(hint) else hint.__name__
    return str(hint).replace("typing.", "")


def _yaml(value: Any) -> str:
    """A default as YAML spells it."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value.strip() != value else value
    try:
        return json.dumps(value).replace("NaN", ".nan")
    except TypeError:
        return repr(value)


def default_of(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml(f.default_factory())
    return "required"


def _dataclass_in(hint: Any) -> tuple[type | None, bool]:
    """``(X, is_list)`` for a field typed ``X``, ``X | None`` or ``list[X]`` with ``X`` a
    dataclass; ``(None, False)`` otherwise."""
    members = typing.get_args(hint) if (
        typing.get_origin(hint) is typing.Union or isinstance(hint, types.UnionType)
    ) else (hint,)
    for member in members:
        if dataclasses.is_dataclass(member):
            return member, False
        if typing.get_origin(member) is list:
            args = typing.get_args(member)
            if args and dataclasses.is_dataclass(args[0]):
                return args[0], True
    return None, False


Expand = Mapping[str, "type | Mapping[str, type]"]


def sections(
    cls: type, expand: Expand | None = None, path: str = "", variant: str = ""
) -> list[SectionDoc]:
    """The sections of the config ``cls``, depth first: its own fields, then each nested
    dataclass (``X``, ``X | None``, ``list[X]`` as ``key[]``) and each mapping field named in
    ``expand`` (``{dotted key: dataclass}``, or ``{dotted key: {variant: dataclass}}`` for a
    section whose fields depend on a value such as ``task.source``: one section per
    variant, titled ``key (variant)``)."""
    expand = dict(expand or {})
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    fields, children = [], []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{path}.{f.name}" if path else f.name
        doc, owner = docs.get(f.name, ("", _qualname(cls)))
        nested, is_list = _dataclass_in(hints[f.name])
        schema = expand.get(key)
        if nested is not None and not doc:
            doc = _class_doc(nested)
        default = default_of(f)
        if nested is not None and default.startswith(("{", "[{")):
            default = "(section below)"  # its fields' defaults are listed there
        fields.append(FieldDoc(key, type_name(hints[f.name]), default, doc, owner))
        if nested is not None:
            children += sections(nested, expand, key + ("[]" if is_list else ""))
        elif isinstance(schema, Mapping):
            for variant_name, variant_cls in schema.items():
                children += sections(variant_cls, expand, key, variant_name)
        elif schema is not None:
            children += sections(schema, expand, key)
    return [SectionDoc(path, _qualname(cls), _class_doc(cls), tuple(fields), variant),
            *children]


def _class_doc(cls: type) -> str:
    """The class's own docstring without its ``Attributes:`` block (listed field by
    field); ``""`` for none or the one ``dataclass`` writes itself (``Name(field: ...)``)."""
    doc = cls.__dict__.get("__doc__") or ""
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return inspect.cleandoc(doc).split("\nAttributes:\n", 1)[0].strip()


def undocumented(all_sections: list[SectionDoc], modules: tuple[str, ...] = OWN_MODULES):
    """Dotted keys of fields declared in ``modules`` without a docstring (a nested section's
    field may instead rely on its dataclass's docstring)."""
    return [
        f"{f.path} ({f.owner})" for s in all_sections for f in s.fields
        if not f.doc and f.owner.split(".", 1)[0] in modules
    ]


def _missing(f: FieldDoc) -> str:
    own = f.owner.split(".", 1)[0] in OWN_MODULES
    return "(no docstring: add one)" if own else NO_DOCSTRING


def _section_title(section: SectionDoc) -> str:
    title = section.path or "top level"
    return title + (f" ({section.variant})" if section.variant else "")


def help_text(all_sections: list[SectionDoc], width: int = 100) -> str:
    """The console reference: per section a header, then per field ``key  type = default``
    and the docstring's first sentence, indented."""
    lines = []
    for section in all_sections:
        lines.append("")
        summary = _plain_text(first_sentence(section.doc))
        lines.append(_section_title(section) + ":" + (f"  {summary}" if summary else ""))
        for f in section.fields:
            lines.append(f"  {f.path}: {f.type} = {f.default}")
            text = first_sentence(f.doc) if f.doc else _missing(f)
            lines += textwrap.wrap(_plain_text(text), width, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines).lstrip("\n") + "\n"


def _plain_text(doc: str) -> str:
    """RST markup as a reader sees it: ``x`` -> x, :func:`a.b` -> a.b."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def _markdown_text(doc: str) -> str:
    """RST markup as Markdown on one line: ``x`` -> `x`, :func:`a.b` -> `a.b`; the table
    separator escaped."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", doc)
    doc = doc.replace("``", "`")
    return " ".join(doc.split()).replace("|", "\\|")


def markdown(title: str, intro: str, app_sections: Mapping[str, list[SectionDoc]]) -> str:
    """``docs/config.md``: per app, per section a table of key, type, default, description
    (the full docstring)."""
    out = [f"# {title}", "", intro.strip(), ""]
    for app, all_sections in app_sections.items():
        out += [f"## {app}", ""]
        for section in all_sections:
            name = f"`{section.path}`" if section.path else "top level"
            out += [f"### {name}" + (f" ({section.variant})" if section.variant else ""), ""]
            if section.doc:
                out += [_markdown_text(section.doc), ""]
            out += [f"Declared in `{section.owner}`.", "",
                    "| key | type | default | description |", "| --- | --- | --- | --- |"]
            for f in section.fields:
                doc = _markdown_text(f.doc) if f.doc else _missing(f)
                out.append(
                    f"| `{f.path}` | `{_markdown_text(f.type)}` | `{_markdown_text(f.default)}` "
                    f"| {doc} |"
                )
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"
