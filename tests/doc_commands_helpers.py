"""The `python -m experiments.<module> ...` and `python -m engine.serve ...` commands that README.md
and docs/*.md show, as a reader would copy them: from fenced and indented code blocks (backslash
continuations joined, shell variables the block sets expanded, the shell around the command cut
off) and from inline backtick spans (which may wrap across lines of prose).

Placeholders are made concrete by `PLACEHOLDERS` (a word or a `key=value` value as the page writes
it -> a value of that kind), and a `[...]` optional part is expanded both ways (all parts in, all
out); a word still looking like a placeholder afterwards is reported, never dropped.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = re.compile(r"python -m ((?:experiments\.[\w.]+)|engine\.serve)\b")

SEARCH_RESULT = "experiments/results/search_check/qwen3-0.6b-h200-search"  # a search's output folder
PROFILE = "experiments/profiles/h200-qwen3-0.6b-async-8k.csv"
RUNS = "outputs/fidelity/run"  # a runs folder an earlier command of the page writes
# A trace the reader brings (a workload's `path`): the repository's small one of that layout.
MOONCAKE_TRACE = "experiments/lib/workloads/fixtures/mooncake.jsonl"
AZURE_TRACE = "experiments/lib/workloads/fixtures/azure_llm_2023.csv"
HF_DIR = "@hf_dir"  # a local HF model folder: the test writes one (config.json)
# Placeholder (a whole word, or a whole value after `=`) -> a concrete value of its kind; None: the
# word goes (`...`: "the options as before").
PLACEHOLDERS: dict[str, str | None] = {
    "N": "2", "M": "qwen3-0.6b", "P": "fcfs", "W": "64", "T": "512", "S": "1", "R": RUNS, "<r>": RUNS,
    "RUNS...": RUNS, "<name>": "fcfs", "DIR": "/tmp/docs-commands", "O": "/tmp/docs-commands",
    "OUT": "/tmp/docs-commands", "FILE": "/tmp/docs-commands.jsonl", "FILE.csv": "/tmp/docs-commands.csv",
    "F": PROFILE, "<p>": PROFILE, "<it>": PROFILE, "<traces>": RUNS, "REF": "main", "RESULT": SEARCH_RESULT,
    "outputs/search/<date>/<time>": SEARCH_RESULT, "16,128,...": "16,128", "...": None,
    "trace.jsonl": MOONCAKE_TRACE, "/data/mooncake_trace.jsonl": MOONCAKE_TRACE,
    "/tmp/mooncake_1h.jsonl": MOONCAKE_TRACE, "trace.csv": AZURE_TRACE, "/path/to/hf_dir": HF_DIR,
    # The receive profile an earlier command of the page writes there: the one the repository holds.
    "W/h200-qwen3-0.6b-kv-receive.csv": "experiments/profiles/kv_receive/h200-qwen3-0.6b.csv",
}
UNRESOLVED = re.compile(r"^(?:[A-Z][A-Z_]*|.*<[\w -]+>.*|.*\.\.\..*)$")
_SHELL_CHARS = ";&|<>()"
_ANGLED = re.compile(r"<([\w -]+)>")
_FENCE = re.compile(r"^\s*(```|~~~)")
_ASSIGN = re.compile(r"^\s*([A-Za-z_]\w*)=(.*)$")
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository root
    line: int  # 1-based, where `python -m` stands
    text: str  # the page's text from `python -m` on (continuations joined)
    module: str
    shown: tuple[str, ...]  # the arguments as the page writes them
    args: tuple[str, ...]  # after the module, placeholders made concrete
    variant: str = ""  # "with [..]" / "without [..]" where the page marks optional parts
    inline: bool = False  # from a backtick span of prose, not a code block

    @property
    def names_the_tool(self) -> bool:
        """`python -m experiments.ab` alone in prose names the tool (its arguments are in the text
        around it), where in a code block it is a command to run as is."""
        return self.inline and not self.args

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(['python', '-m', self.module, *self.shown])}"


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Code lines with backslash continuations joined; each keeps its first line's number."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in lines:
        start, head = pending if pending else (number, "")
        if text.rstrip().endswith("\\"):
            pending = (start, head + text.rstrip()[:-1] + " ")
            continue
        pending = None
        out.append((start, head + text))
    if pending:
        out.append(pending)
    return out


def _expand(text: str, variables: dict[str, str]) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(3)
        return variables.get(name, m.group(2) if m.group(2) is not None else m.group(0))
    return _VAR.sub(value, text)


def _assignments(line: str) -> list[tuple[str, str]]:
    """(name, value) of a line that only sets shell variables (`B="python -m ..."  # why`,
    `R=dir; OUT=${OUT:-dir}`); [] for any other line (`NAME=1 python -m ...` runs a command)."""
    try:
        parts = [shlex.split(p, comments=True) for p in line.split(";")]
    except ValueError:
        return []
    words = [w for p in parts for w in p]
    if not words or any(len(p) > 1 for p in parts) or not all(_ASSIGN.match(w) for w in words):
        return []
    return [(w.split("=", 1)[0], w.split("=", 1)[1]) for w in words]


def _code_commands(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line, command text) of a code block: variables its lines set are expanded in later lines."""
    variables: dict[str, str] = {}
    found = []
    for number, text in _logical_lines(lines):
        assigns = _assignments(text)
        if assigns:
            for name, value in assigns:
                variables[name] = _expand(value, variables)
            continue
        expanded = _expand(text, variables)
        for m in CHECKED.finditer(expanded):
            found.append((number, expanded[m.start():].split("`")[0]))
    return found


def _span_commands(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line, command text) of the backtick spans of a paragraph of prose that hold a command."""
    text = "\n".join(t for _, t in lines)
    found = []
    for span in re.finditer(r"`([^`]+)`", text):
        for m in CHECKED.finditer(span.group(1)):
            line = lines[0][0] + text.count("\n", 0, span.start(1) + m.start())
            found.append((line, span.group(1)[m.start():].replace("\n", " ")))
    return found


def _blocks(lines: list[str]) -> list[tuple[str, list[tuple[int, str]]]]:
    """The page cut into ("code", lines) and ("prose", lines) blocks; indented paragraphs are code."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence: str | None = None
    current: list[tuple[int, str]] = []

    def close(kind: str) -> None:
        if current:
            indented = all(t.startswith(("    ", "\t")) for _, t in current)
            blocks.append(("code" if kind == "code" or indented else "prose", list(current)))
            current.clear()

    for number, line in enumerate(lines, 1):
        m = _FENCE.match(line)
        if m and fence is None:
            close("prose")
            fence = m.group(1)
        elif m and line.strip().startswith(fence or ""):
            close("code")
            fence = None
        elif fence is None and not line.strip():
            close("prose")
        else:
            current.append((number, line))
    close("code" if fence else "prose")
    return blocks


def _words(text: str) -> list[str]:
    """The command's words, up to where the shell would end it (`;`, `>`, `|`, `&`, `)`, `#`); a
    `<placeholder>` is a word's text, not a redirection."""
    lexer = shlex.shlex(_ANGLED.sub(lambda m: f"\x02{m.group(1)}\x03", text), posix=True,
                        punctuation_chars=_SHELL_CHARS)
    lexer.whitespace_split = True
    words = []
    for word in lexer:
        if word and set(word) <= set(_SHELL_CHARS):
            break
        words.append(word.replace("\x02", "<").replace("\x03", ">"))
    return words


def _concrete(words: list[str]) -> tuple[str, ...]:
    out = []
    for word in words:
        key, sep, value = word.partition("=")
        if word in PLACEHOLDERS:
            word = PLACEHOLDERS[word]
        elif sep and value in PLACEHOLDERS:
            word = f"{key}={PLACEHOLDERS[value]}"
        if word is not None:
            out.append(word)
    return tuple(out)


def _variants(text: str) -> list[tuple[str, str]]:
    """("", text), or with `[...]` optional parts (a `[` starting a word): both ways."""
    optional = re.compile(r"(?:(?<=\s)|^)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]")
    if not optional.search(text):
        return [("", text)]
    return [("with [..]", optional.sub(lambda m: m.group(1), text)), ("without [..]", optional.sub("", text))]


def commands(pages: list[Path] = PAGES) -> list[DocCommand]:
    found = []
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        for kind, lines in _blocks(page.read_text().splitlines()):
            for number, text in (_code_commands if kind == "code" else _span_commands)(lines):
                text = " ".join(text.split())
                for variant, shown in _variants(text):
                    words = _words(shown)
                    found.append(DocCommand(rel, number, text, words[2], tuple(words[3:]), _concrete(words[3:]),
                                            variant, kind == "prose"))
    return found


def unresolved(command: DocCommand) -> list[str]:
    """The words of a command that still look like placeholders (`N`, `<name>`, `...`)."""
    return [w for w in command.args if UNRESOLVED.match(w.partition("=")[2] if "=" in w else w)]


def occurrences(pages: list[Path] = PAGES) -> list[tuple[str, int]]:
    """(page, line) of every checked `python -m` the pages hold, but those setting a shell variable."""
    return [(page.relative_to(ROOT).as_posix(), number)
            for page in pages for number, line in enumerate(page.read_text().splitlines(), 1)
            for _ in CHECKED.finditer(line) if not _assignments(line)]
