"""Every `python -m experiments.<module> ...` and `python -m engine.serve ...` command that README.md
and docs/*.md show is accepted as written: its own parser reads it and the checks it makes before
its work pass (tests/command_check_helpers.py), so a renamed option, a removed config key or a bad
value in a page fails here, naming the page, the line and the command. Nothing is run: no
simulation, engine, server or profile starts. Placeholders (`N`, `DIR`, `<name>`, `[optional]`
parts) are made concrete as tests/doc_commands_helpers.py says.
"""
from __future__ import annotations

import importlib
import json

import pytest
from command_check_helpers import check_command
from doc_commands_helpers import HF_DIR, PLACEHOLDERS, DocCommand, commands, occurrences, unresolved

COMMANDS = commands()

# (page, what the command holds) -> why the commands of the page holding it are not checked here.
# Kept small: each only works after the reader has done what the page around it says.
NOT_CHECKED = {
    ("docs/extending.md", "policy=spf"): "the tutorial's policy `spf`, which the reader writes first",
    ("docs/extending.md", "blocks=paged-cautious"): "the tutorial's block manager, which the reader writes first",
    ("docs/extending.md", "blocks.kind=headroom"): "the tutorial's block manager (tests/project/"
                                                   "test_extending_examples.py runs it)",
    ("docs/extending.md", "backend=fixed"): "the tutorial's backend `fixed`, which the reader writes first",
    ("docs/sweeps.md", "--config-dir my_conf"): "the reader's own config folder, which the page shows",
}


def _not_checked(command: DocCommand) -> str | None:
    return next((why for (page, held), why in NOT_CHECKED.items() if page == command.page and held in command.text),
                None)


def _id(command: DocCommand) -> str:
    return f"{command.page}:{command.line}:{command.module}" + (f":{command.variant}" if command.variant else "")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A local HF model folder, as `--model <dir>` takes one: its config.json (a tiny Qwen3)."""
    path = tmp_path_factory.mktemp("hf_dir")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "float32"}))
    return str(path)


@pytest.mark.parametrize("command", COMMANDS, ids=[_id(c) for c in COMMANDS])
def test_a_docs_command_is_accepted(command: DocCommand, hf_dir, tmp_path, monkeypatch, capsys):
    reason = _not_checked(command)
    if reason:
        pytest.skip(reason)
    if command.names_the_tool:  # the module is there to run
        try:
            main = getattr(importlib.import_module(command.module), "main", None)
        except ImportError as exc:
            pytest.fail(f"{command.where}\n  {exc}", pytrace=False)
        assert callable(main), f"{command.where}\n  {command.module} has no main()"
        return
    assert not unresolved(command), f"{command.where}\n  placeholders with no value in PLACEHOLDERS: " \
                                    f"{unresolved(command)}"
    args = tuple(a.replace(HF_DIR, hf_dir) for a in command.args)
    failure = _failure(command.module, args, tmp_path, monkeypatch, capsys)
    if failure:
        pytest.fail(f"{command.where}\n  (checked as: {command.module} {' '.join(command.args)})\n  {failure}",
                    pytrace=False)


_FAILURES: dict[tuple[str, tuple[str, ...]], str | None] = {}  # pages repeat commands: each is checked once


def _failure(module: str, args: tuple[str, ...], tmp_path, monkeypatch, capsys) -> str | None:
    """What the command reports (its last line on stderr, else its exception), or None."""
    key = (module, args)
    if key not in _FAILURES:
        try:
            check_command(module, args, tmp_path, monkeypatch)
            _FAILURES[key] = None
        except SystemExit as exc:  # the command said why: argparse, run_cli and engine.serve print `error: ...`
            said = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
            _FAILURES[key] = str(exc.code) if isinstance(exc.code, str) else (said or [f"exit code {exc.code}"])[-1]
        except Exception as exc:  # noqa: BLE001 (any error is the command's failure, reported below)
            _FAILURES[key] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return _FAILURES[key]


def test_every_command_of_the_pages_is_found():
    """Each `python -m` of a checked module in the pages yields a command (none lost to the parsing)."""
    found = {(c.page, c.line) for c in COMMANDS}
    assert not [o for o in occurrences() if o not in found]
    assert len(COMMANDS) > 200


def test_the_tables_name_only_what_the_pages_hold():
    """A stale entry would hide nothing but mislead: every skipped command is still on its page,
    every placeholder is still written somewhere."""
    assert not [k for k in NOT_CHECKED if not any(c.page == k[0] and k[1] in c.text for c in COMMANDS)]
    written = {part for c in COMMANDS for word in c.shown for part in (word, word.partition("=")[2])}
    assert not [p for p in PLACEHOLDERS if p not in written]
