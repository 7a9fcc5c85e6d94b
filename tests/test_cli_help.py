"""Every command's ``--help`` names its on/off flags without a type after them (Typer 0.29
printed ``--json <bool>`` and ``--help <bool>``, as if they took a value) and prints each
paragraph of its docstring as one text, wrapped where the terminal ends (Typer's Rich help
kept the docstring's own line breaks: ragged lines)."""

from __future__ import annotations

import inspect

import click
import pytest
import typer
from typer.testing import CliRunner

from kvchat.cli import app

runner = CliRunner()


def commands(command: click.Command, path: tuple[str, ...] = ()):
    """``(words after kvchat, command)`` for the root and every command below it."""
    yield path, command
    ctx = click.Context(command)
    for name in getattr(command, "commands", {}):
        yield from commands(command.get_command(ctx, name), (*path, name))  # type: ignore[attr-defined]


ROOT = typer.main.get_command(app)
EVERY = list(commands(ROOT))


def flags(command: click.Command) -> list[str]:
    """The on/off flags of ``command`` (``--help`` included), by their names."""
    ctx = click.Context(command)
    return [
        name
        for param in command.get_params(ctx)
        if getattr(param, "is_flag", False)
        for name in (*param.opts, *param.secondary_opts)
    ]


def test_every_command_is_checked():
    names = {" ".join(path) for path, _ in EVERY}
    assert {"", "ask", "serve", "doctor", "sessions list", "models list"} <= names


@pytest.mark.parametrize(
    ("path", "command"), EVERY, ids=[" ".join(p) or "kvchat" for p, _ in EVERY]
)
def test_help_prints_flags_without_a_type(path, command):
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output and "--help" in result.output
    for flag in flags(command):
        assert flag in result.output, flag
    if path == ("doctor",):  # a flag with an off switch keeps both names
        assert "--probe" in result.output and "--no-probe" in result.output
    if path == ():
        assert "--version" in result.output and "<float>" in result.output  # values keep theirs


# the commands whose help is their docstring (the root's is the app's own text)
DOCUMENTED = [(p, c) for p, c in EVERY if p and c.callback and inspect.getdoc(c.callback)]


def paragraphs(command: click.Command) -> list[str]:
    """The paragraphs of ``command``'s docstring, each as one line of words."""
    return [" ".join(p.split()) for p in inspect.getdoc(command.callback).split("\n\n")]


def printed(path: tuple[str, ...]) -> list[str]:
    """The lines of ``kvchat PATH --help`` on a wide terminal, frames and padding dropped."""
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    return [" ".join(line.strip("│ ").split()) for line in result.output.splitlines()]


def test_commands_with_paragraphs_of_several_lines_are_checked():
    several = {p for p, c in DOCUMENTED if "\n" in inspect.getdoc(c.callback).split("\n\n")[0]}
    assert {("bench",), ("doctor",), ("sessions", "search")} <= several


@pytest.mark.parametrize(("path", "command"), DOCUMENTED, ids=[" ".join(p) for p, _ in DOCUMENTED])
def test_help_prints_each_paragraph_as_one_text(path, command):
    lines = printed(path)
    for paragraph in paragraphs(command):
        assert paragraph in lines
    # the parent's list of commands: the first paragraph after the command's name
    assert f"{path[-1]} {paragraphs(command)[0]}" in printed(path[:-1])
