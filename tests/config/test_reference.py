"""The configuration reference (docs/configuration.md) is generated from the config
models: the checked-in file must be exactly what they generate, and every field of every
model a file can hold must be in it."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest

from nodeagent.config import AgentConfig, Model, ServerConfig
from nodeagent.config.reference import NO_DESCRIPTION, main, render_reference

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_the_checked_in_reference_is_what_the_models_generate() -> None:
    assert DOC.read_text() == render_reference(), (
        "docs/configuration.md is out of date: run "
        "`python -m nodeagent.config.reference > docs/configuration.md`"
    )


def _models(annotation: Any) -> list[type[Model]]:
    if isinstance(annotation, type) and issubclass(annotation, Model):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _reachable(root: type[Model]) -> set[type[Model]]:
    found: set[type[Model]] = set()
    todo = [root]
    while todo:
        for field in todo.pop().model_fields.values():
            for model in _models(field.annotation):
                if model not in found and model is not root:
                    found.add(model)
                    todo.append(model)
    return found


def _section(text: str, heading: str, end: str | None = None) -> str:
    """From the line `heading` to `end`, or to the next heading of its level or above."""
    lines = text.splitlines()
    start = lines.index(heading)
    level = heading.split(" ")[0]
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line == end or (
            end is None and line.startswith("#") and len(line.split(" ")[0]) <= len(level)
        ):
            return "\n".join(lines[start:i])
    return "\n".join(lines[start:])


@pytest.mark.parametrize(
    ("title", "root"), [("Server file", ServerConfig), ("Agent file", AgentConfig)]
)
def test_every_field_of_every_model_appears_in_its_section(title: str, root: type[Model]) -> None:
    text = render_reference()
    own = _section(text, f"## {title}", end=f"### Types used by the {title.lower()}")
    missing = [
        f"{root.__name__}.{name}" for name in root.model_fields if f"| `{name}` |" not in own
    ]
    for model in _reachable(root):
        heading = next(
            line
            for line in text.splitlines()
            if line.startswith("#") and line.split(" ", 1)[1] == model.__name__
        )
        section = _section(text, heading)
        missing += [
            f"{model.__name__}.{name}"
            for name in model.model_fields
            if f"| `{name}` |" not in section
        ]
    assert not missing, missing


def test_descriptions_come_from_the_model_and_are_never_made_up() -> None:
    text = render_reference()
    agent = _section(text, "## Agent file", end="### Types used by the agent file")
    # A comment above the field in the model's source:
    assert "| `drain_seconds` | number | `10` | On SIGTERM: stop taking new" in agent
    # The comment ending the field's line, and its constraints from the model:
    rule = _section(text, "#### InterceptRuleConfig")
    assert "| `ports` | list of integer or string | none | empty: every port |" in rule
    assert "matching `^[A-Za-z0-9][-A-Za-z0-9_.]*$`" in rule
    # A field the model says nothing about:
    assert f"| `source_interfaces` | list of string | none | {NO_DESCRIPTION} |" in rule


def test_check_exits_1_with_one_line_when_the_file_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, stale = tmp_path / "good.md", tmp_path / "stale.md"
    good.write_text(render_reference())
    stale.write_text(render_reference().replace("Agent file", "Agent files"))
    assert main(["--check", str(good)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of date" in err and "stale.md" in err
    assert main(["--check", str(tmp_path / "absent.md")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_without_check_it_prints_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    assert capsys.readouterr().out == render_reference()
