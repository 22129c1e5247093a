"""The README's configuration table and its commands against the services' real argument parsers.

Each service's parser is built by its own main() (the console script pyproject.toml names), which
is stopped the moment it parses: nothing loads, nothing binds. OMNI_* variables are cleared, so the
defaults are the code's own. A flag the table lists that a service lacks, or a default that differs
from the parser's, fails; so does a README command line whose flags its program rejects, and a
`make` target the Makefile does not have.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# README service name -> (console script, subcommand or None)
SERVICES = {
    "thinker": ("omni-thinker", None),
    "talker": ("omni-talker", None),
    "code2wav": ("omni-code2wav", None),
    "router": ("omni-router", None),
    "sessions": ("omni-session", None),
    "gateway": ("omni-gateway", None),
    "omni-serve up": ("omni-serve", "up"),
}


@dataclass(frozen=True)
class Row:
    services: tuple[str, ...]
    flag: str
    default: str  # the first `code` span of the default cell, unquoted
    line: int


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def scripts() -> dict[str, str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]  # console script -> "module:function"


def build_parser(script: str, subcommand: str | None = None) -> argparse.ArgumentParser:
    """The parser `script`'s main() builds, with no OMNI_* variable set."""
    module, function = scripts()[script].split(":")
    main = getattr(importlib.import_module(module), function)

    def capture(self, args=None, namespace=None):
        raise _Parsed(self)

    environ = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_")}
    try:
        with mock.patch.dict(os.environ, environ, clear=True), \
                mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
            main([])
    except _Parsed as parsed:
        parser = parsed.parser
    else:
        raise AssertionError(f"{script}: main() returned without parsing its arguments")
    if subcommand is None:
        return parser
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[subcommand]


_parsers: dict[tuple[str, str | None], argparse.ArgumentParser] = {}  # (script, subcommand) -> parser


def parser_for(service: str) -> argparse.ArgumentParser:
    key = SERVICES[service]
    if key not in _parsers:
        _parsers[key] = build_parser(*key)
    return _parsers[key]


def section(text: str, title: str) -> tuple[int, list[str]]:
    """(first line number, lines) of the README section `## title`, up to the next `## `."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start + 1, lines[start + 1:end]


def config_rows() -> list[Row]:
    first, lines = section(README.read_text(), "Configuration")
    rows = []
    for offset, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 3 or cells[0] in ("service",) or set(cells[0]) <= set("-: "):
            continue
        flag = re.fullmatch(r"`(--[a-z0-9-]+)`", cells[1])
        default = re.match(r"`([^`]*)`", cells[2])
        assert flag and default, f"README line {first + offset + 1}: want `| services | `--flag` | `default` | ... |`: {line}"
        services = tuple(s.strip() for s in cells[0].split(","))
        rows.append(Row(services, flag.group(1), default.group(1).strip('"'), first + offset + 1))
    return rows


def matches(default, written: str) -> bool:
    if default is None:
        return written == "none"
    if isinstance(default, bool):
        return written == ("on" if default else "off")
    if isinstance(default, (int, float)):
        try:
            return float(written) == float(default)
        except ValueError:
            return False
    return written == str(default)


ROWS = config_rows()


def test_readme_configuration_table_is_read():
    # The table must stay parseable: an empty parse would let every other check pass vacuously.
    assert len(ROWS) >= 40, f"only {len(ROWS)} rows read from the README's configuration table"
    assert {s for row in ROWS for s in row.services} == set(SERVICES)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.flag}@{r.line}")
def test_readme_flag_exists_with_its_default(row: Row):
    for service in row.services:
        assert service in SERVICES, f"README line {row.line}: unknown service {service!r} (known: {sorted(SERVICES)})"
        parser = parser_for(service)
        action = parser._option_string_actions.get(row.flag)
        assert action is not None, f"README line {row.line}: {SERVICES[service][0]} has no {row.flag}"
        assert matches(action.default, row.default), (
            f"README line {row.line}: {service} {row.flag} defaults to {action.default!r}, the README says {row.default!r}")


def readme_commands() -> list[tuple[int, list[str]]]:
    """(line, argv) of every `.venv/bin/omni-*` command in the README: in sh blocks and in `code` spans."""
    commands, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = line.strip() == "```sh"
            continue
        if not in_block:
            for span in re.findall(r"`(\.venv/bin/omni-[^`]*)`", line):
                argv = shlex.split(span)
                commands.append((number, [argv[0].removeprefix(".venv/bin/"), *argv[1:]]))
            continue
        if not pending:
            start = number
        pending += line.rstrip().removesuffix("\\") + " "
        if line.rstrip().endswith("\\"):
            continue
        for part in re.split(r"&&|&(?!\S)", pending):
            argv = shlex.split(part, comments=True)
            if argv and argv[0].startswith(".venv/bin/omni-"):
                commands.append((start, [argv[0].removeprefix(".venv/bin/"), *argv[1:]]))
        pending = ""
    return commands


def test_readme_commands_parse():
    commands = readme_commands()
    assert len(commands) >= 3, commands
    for line, argv in commands:
        script, args = argv[0], argv[1:]
        assert script in scripts(), f"README line {line}: {script} is not a console script in pyproject.toml"
        parser = _parsers.get((script, None)) or _parsers.setdefault((script, None), build_parser(script))
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"README line {line}: {shlex.join(argv)} is rejected by {script}'s parser")


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (REPO / "Makefile").read_text(), re.M))
    used = set(re.findall(r"`make ([a-z][a-z0-9-]*)", README.read_text()))
    used |= set(re.findall(r"^make ([a-z][a-z0-9-]*)", README.read_text(), re.M))
    assert used, "no make targets found in the README"
    assert used <= targets, f"README names make targets the Makefile lacks: {sorted(used - targets)}"
