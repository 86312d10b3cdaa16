"""The docs name only things that exist: every repository path, code symbol and ``--flag``
that README.md or docs/*.md writes in backticks is checked against the tree.

What is checked (an inline code span, its line breaks joined; fenced code is not read,
except command lines, below):

- **paths**: a span (or a word of a command span) ending in ``/`` or in .py .c .h .md .toml
  .sh .cfg .ini, or containing ``/`` with a first part that is a folder of the repository,
  of ``vlmd/``, of ``plugins/`` or of a plugin package. It must exist relative to the repo
  root, ``vlmd/``, ``plugins/`` or a plugin's folder; a bare file name (``decode_plan.py``)
  must be some file's name; ``...`` stands for any folders. ``PATH:SYMBOL`` also checks that
  the file defines ``SYMBOL`` (``Class.method``: both). URLs, absolute paths and ``../``
  paths (outside this repository) are not checked.
- **symbols** must be defined in a .py, .c or .h file of the repository (``def NAME``,
  ``class NAME``, ``NAME =`` or ``NAME: type``, ``self.NAME =``; a C function, struct,
  struct field, typedef or ``#define``): a CamelCase name, a call ``name(...)``,
  ``Class.attr`` (``attr`` in the file that defines ``Class``: a method a class only
  inherits is named on the class that defines it), ``module.attr`` where ``module.py``
  exists (``attr`` in that file), ``vlmd.a.b`` (a module, or an attribute of one). Plain ``snake_case`` and
  ``UPPER_CASE`` names (often request fields, config keys or environment variables) need
  only occur as a word somewhere in that code.
- **flags**: every ``--flag`` must be one of ``vlmd``'s (serve's are generated from
  ``ServeConfig``; convert's and cost's parsers) or an ``add_argument`` flag of a script in
  the repository (contrib/bench, ``vlmd.testing.tiny``), whether in an inline span or on a
  line that runs ``vlmd``, ``python -m vlmd...`` or ``python contrib/...``. Spans that run
  another program (pip, curl, ...) are not checked.
- markdown **links** to files must resolve, and every decision cited as ``D12`` must be an
  entry of docs/decisions.md (numbered once each, in order).

Names of other projects (transformers, torch, Python's library) that the docs write in
backticks are listed in ``EXTERNAL``: each is a deliberate exception, not a pattern.
Plain words, numbers, JSON, shell snippets and expressions with brackets are not checked.
"""

from __future__ import annotations

import builtins
import os
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]

SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", "node_modules", "wheels"}
CODE_SUFFIXES = {".py", ".c", ".h"}
PATH_SUFFIXES = (".py", ".c", ".h", ".md", ".toml", ".sh", ".cfg", ".ini")

# Names from other projects that the docs quote and this repository never defines
# (transformers' classes, ctypes', a /proc field). Each is a deliberate exception: add one
# only for a name of another project, never to silence a name of this one.
EXTERNAL = {
    "AutoProcessor", "Qwen2AudioEncoder", "Qwen2AudioForConditionalGeneration", "WhisperFeatureExtractor",
    "WhisperForConditionalGeneration", "WhisperProcessor", "WhisperTimeStampLogitsProcessor",
    "PyDLL",  # ctypes
    "VmHWM",  # a field of /proc/self/status
}
# Leading parts of a dotted name that belong to another project (`torch.tensor`, `F.linear`).
EXTERNAL_MODULES = {"torch", "F", "np", "numpy", "mkldnn", "transformers", "os", "ctypes"}
# Last parts of a dotted name that make it a data file or a model's name (`config.json`,
# `tiny.en`), not code.
DATA_SUFFIXES = {"json", "txt", "so", "yaml", "yml", "jinja", "safetensors", "bin", "wav", "mp3", "png", "jpg",
                 "jpeg", "html", "in", "cfg", "en"}
# Programs whose flags are not vlmd's.
FOREIGN_COMMANDS = {"pip", "pip3", "curl", "apt-get", "apt", "git", "docker", "gcc", "cc", "espeak-ng", "sox",
                    "perf", "py-spy", "sudo", "uv"}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
SNAKE = re.compile(r"^_{0,2}[a-z][a-z0-9]*(?:_[a-z0-9]+)+_?$")  # at least one underscore
UPPER = re.compile(r"^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
CALL = re.compile(rf"^({IDENT}(?:\.{IDENT})*)\((.*)")
DOTTED = re.compile(rf"^{IDENT}(?:\.{IDENT})+$")
COMMAND_LINE = re.compile(r"^\s*(?:\$\s+)?(?:vlmd\s|python3?\s+-m\s+vlmd|python3?\s+contrib/)")


# ---- the repository's side ---------------------------------------------------------------


@lru_cache(maxsize=None)
def repo_files() -> tuple[Path, ...]:
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        found.extend(Path(root, name) for name in files)
    return tuple(found)


@lru_cache(maxsize=None)
def code_files() -> tuple[Path, ...]:
    """The repository's .py, .c and .h files, this checker excepted (its made-up names)."""
    return tuple(p for p in repo_files() if p.suffix in CODE_SUFFIXES and p != Path(__file__).resolve())


@lru_cache(maxsize=None)
def code_text() -> str:
    """Every code file and pyproject.toml as one text, for names that are strings there
    (an entry-point group such as ``vlmd.model_families``)."""
    parts = [p.read_text(errors="replace") for p in code_files()]
    parts += [p.read_text(errors="replace") for p in repo_files() if p.name == "pyproject.toml"]
    return "\n".join(parts)


PY_DEFS = [
    re.compile(rf"^\s*(?:async\s+)?def\s+({IDENT})", re.M),
    re.compile(rf"^\s*class\s+({IDENT})", re.M),
    re.compile(rf"^\s*({IDENT})\s*(?::[^=\n]*)?=(?!=)", re.M),  # NAME = ..., NAME: T = ...
    re.compile(rf"^\s+({IDENT})\s*:\s*[^\s=]", re.M),  # dataclass / Protocol field NAME: T
    re.compile(rf"\bself\.({IDENT})\s*(?::[^=\n]*)?=(?!=)"),
    re.compile(rf"^\s*({IDENT}(?:\s*,\s*{IDENT})+)\s*=(?!=)", re.M),  # A, B = ...
]
C_DEFS = [
    re.compile(rf"^(?:(?:static|inline|extern|const|unsigned|signed|struct|enum)\s+)*{IDENT}[\s*]+({IDENT})\s*\(", re.M),
    re.compile(rf"\b(?:struct|enum|union)\s+({IDENT})"),
    re.compile(rf"^\s*typedef\b[^;]*?\b({IDENT})\s*(?:\[[^\]]*\])?\s*;", re.M),
    re.compile(rf"^\s*#\s*define\s+({IDENT})", re.M),
    re.compile(rf"^\s+(?:const\s+)?{IDENT}[\s*]+({IDENT})(?:\[[^\]]*\])?\s*;", re.M),  # struct fields
    re.compile(rf"}}\s*({IDENT})\s*;"),  # } name;  (typedef struct { ... } name;)
]


@lru_cache(maxsize=None)
def defined_in(path: Path) -> frozenset[str]:
    text = path.read_text(errors="replace")
    names: set[str] = set()
    for pattern in PY_DEFS if path.suffix == ".py" else C_DEFS:
        for match in pattern.finditer(text):
            names.update(part.strip() for part in match.group(1).split(","))
    return frozenset(names)


@lru_cache(maxsize=None)
def classes_in(path: Path) -> frozenset[str]:
    """The classes (C: structs) ``path`` defines."""
    pattern = PY_DEFS[1] if path.suffix == ".py" else C_DEFS[1]
    return frozenset(pattern.findall(path.read_text(errors="replace")))


@lru_cache(maxsize=None)
def all_definitions() -> frozenset[str]:
    names: set[str] = set()
    for path in code_files():
        names |= defined_in(path)
    return frozenset(names)


@lru_cache(maxsize=None)
def all_words() -> frozenset[str]:
    words: set[str] = set()
    for path in code_files():
        words.update(re.findall(IDENT, path.read_text(errors="replace")))
    return frozenset(words)


@lru_cache(maxsize=None)
def repo_file_names() -> frozenset[str]:
    return frozenset(p.name for p in repo_files())


@lru_cache(maxsize=None)
def repo_dirs() -> tuple[Path, ...]:
    return tuple(sorted({p.parent for p in repo_files()}))


def _bases() -> list[Path]:
    plugin_dirs = sorted(p for p in (REPO / "plugins").iterdir() if p.is_dir())
    return [REPO, REPO / "vlmd", REPO / "plugins", *plugin_dirs]


@lru_cache(maxsize=None)
def top_folders() -> frozenset[str]:
    """First parts that make a slashed token a path: folders of the bases."""
    names = {"vlmd", "plugins"}
    for base in _bases():
        names.update(p.name for p in base.iterdir() if p.is_dir() and p.name not in SKIP_DIRS)
    return frozenset(names)


def resolve_path(token: str) -> list[Path]:
    """The files or folders ``token`` can name (empty: it names nothing)."""
    token = token.rstrip("/")
    if "/" not in token:  # a bare name: any file, or any folder, of that name
        return [p for p in repo_files() if p.name == token] + [d for d in repo_dirs() if d.name == token]
    if "..." in token:
        head, _, tail = token.partition("...")
        pattern = re.compile(re.escape(head.rstrip("/")) + r"(/.+)?/" + re.escape(tail.strip("/")) + "$")
        return [p for p in repo_files() for base in _bases()
                if pattern.match(p.relative_to(base).as_posix() if p.is_relative_to(base) else "")]
    return [base / token for base in _bases() if (base / token).exists()]


@lru_cache(maxsize=None)
def known_flags() -> frozenset[str]:
    from vlmd.cli import _parser

    parser, commands = _parser()
    flags = {"--help", *(f for action in parser._actions for f in action.option_strings)}
    for command in commands.values():
        flags.update(f for action in command._actions for f in action.option_strings)
    for path in repo_files():
        if path.suffix == ".py" and "tests" not in path.parts:
            text = path.read_text(errors="replace")
            if "add_argument" in text:
                flags.update(re.findall(r"""add_argument\(\s*["'](--[\w-]+)["']""", text))
    return frozenset(f for f in flags if f.startswith("--"))


# ---- the docs' side ------------------------------------------------------------------


def _join_lines(span: str) -> str:
    """An inline span wrapped over lines: a break next to . _ / : joins the parts, any
    other is a space (as markdown renders it)."""
    def join(match: re.Match) -> str:
        before, after = match.group(1), match.group(2)
        return before + after if before in "._/:" or after in "._/:" else before + " " + after
    return re.sub(r"(\S)[ \t]*\n[ \t]*(\S)", join, span).strip()


def inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, span) for every inline code span outside fenced blocks."""
    spans = []
    lines = text.split("\n")
    keep = []
    fenced = False
    for line in lines:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            keep.append("")
            continue
        keep.append("" if fenced else line)
    prose = "\n".join(keep)
    # A span does not cross a blank line; `` ``double`` `` spans are read as single ones.
    for match in re.finditer(r"(?<!`)`([^`]+?)`(?!`)", prose):
        if "\n\n" in match.group(1):
            continue
        line_no = prose.count("\n", 0, match.start()) + 1
        spans.append((line_no, _join_lines(match.group(1))))
    return spans


def command_lines(text: str) -> list[tuple[int, str]]:
    """Lines anywhere in the doc (fenced blocks included) that run vlmd or a repo script,
    with their backslash continuations."""
    found = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i
        if COMMAND_LINE.match(line):
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            found.append((start + 1, line))
        i += 1
    return found


def is_path_like(token: str) -> bool:
    if "://" in token or token.startswith(("/", "~", "../", "./", "data:")) or re.search(r"[<>{}*$|,;=()\[\]\"' ]", token):
        return False
    if token.endswith("/") or token.endswith(PATH_SUFFIXES):
        return True
    return "/" in token and token.split("/")[0] in top_folders()


def check_symbol(name: str, call: bool = False) -> str | None:
    """None when ``name`` is defined (or, plain snake/UPPER and not ``call``ed, used) in the
    code, else why not."""
    name = name.rstrip("()")
    if name in EXTERNAL or hasattr(builtins, name):
        return None
    parts = name.split(".")
    if len(parts) > 1:
        if parts[0] in EXTERNAL_MODULES:
            return None
        if parts[0] == "vlmd" or parts[0].startswith("vlmd_"):
            return check_module_path(parts)
        if CAMEL.match(parts[0]):  # Class.attr: attr defined in the file that defines Class
            homes = [p for p in code_files() if parts[0] in classes_in(p)]
            if not homes:
                return f"{parts[0]} not defined" if parts[0] not in all_definitions() else None
            if not any(parts[1] in defined_in(p) for p in homes):
                return f"{parts[1]} not defined beside class {parts[0]}"
            missing = [p for p in parts[2:] if p not in all_definitions()]
            return f"{', '.join(missing)} not defined" if missing else None
        modules = [p for p in code_files() if p.stem == parts[0]]
        if modules:
            if any(parts[1] in defined_in(p) for p in modules):
                return None
            return f"{parts[1]} not defined in {parts[0]}.py"
        last = parts[-1]  # an expression (`meta.backend.forward`): its last name is used somewhere
        return None if last in all_words() else f"{last} not found in the code"
    if CAMEL.match(name) or call:
        return None if name in all_definitions() else "not defined"
    return None if name in all_words() else "not found in the code"


def check_module_path(parts: list[str]) -> str | None:
    """``vlmd.a.b`` or ``vlmd.a.b.attr``: the longest prefix that is a module (of vlmd or a
    plugin package), then attributes defined in the code; or a dotted string the code
    holds (an entry-point group such as ``vlmd.model_families``)."""
    if re.search(r"[\"']" + re.escape(".".join(parts)) + r"[\"']", code_text()):
        return None
    for cut in range(len(parts), 0, -1):
        rel = Path(*parts[:cut])
        for base in (REPO, *sorted((REPO / "plugins").iterdir())):
            if (base / rel.with_suffix(".py")).is_file() or (base / rel / "__init__.py").is_file():
                missing = [p for p in parts[cut:] if p not in all_definitions()]
                return f"{', '.join(missing)} not defined" if missing else None
    return f"no module {'.'.join(parts)}"


def check_path(token: str) -> str | None:
    path, _, symbol = token.partition(":")
    targets = resolve_path(path)
    if not targets:
        return "no such file or folder"
    if symbol:
        files = [t for t in targets if t.is_file() and t.suffix in CODE_SUFFIXES]
        for part in symbol.rstrip("()").split("."):
            if not any(part in defined_in(f) for f in files):
                return f"{part} not defined in {path}"
    return None


def is_symbol(token: str) -> bool:
    return bool(CAMEL.match(token) or SNAKE.match(token) or UPPER.match(token) or DOTTED.match(token))


def called(span: str) -> str | None:
    """The callee of a span written as a call: ``name()``, ``snake_name(x)``,
    ``Class.method(a, b)``, ``name(a, ..., b=1)``; not ``http(s)``."""
    call = CALL.match(span)
    if call is None:
        return None
    name, args = call.group(1), call.group(2)
    if is_symbol(name) or args.startswith(")") or re.search(r",|=|\.\.\.", args):
        return name
    return None


def check_token(token: str) -> str | None:
    """Why ``token`` (one word, no spaces) names nothing; None if it is fine or not checked."""
    token = token.rstrip(".,;")
    if is_path_like(token) or re.match(r"^[\w./-]+\.(py|c|h):[\w.]+(\(\))?$", token):
        return check_path(token)
    callee = called(token)
    if callee:
        return check_symbol(callee, call=True)
    if CALL.match(token):
        return None
    if token in repo_file_names():
        return None  # Dockerfile, MANIFEST.in
    metric = re.match(r"^([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\{", token)
    if metric:  # a Prometheus series: its name must be in the code
        return None if metric.group(1) in all_words() else f"{metric.group(1)} not found in the code"
    if is_symbol(token):
        if DOTTED.match(token) and token.rsplit(".", 1)[1] in DATA_SUFFIXES:
            return None  # config.json, a data file of a checkpoint
        return check_symbol(token)
    return None


def check_flags(text: str) -> list[str]:
    return [f"{flag}: not a flag of vlmd or of a repo script" for flag in FLAG.findall(text)
            if flag not in known_flags()]


def check_span(span: str) -> list[str]:
    """Why the names in one inline code span do not exist (empty: they do, or are not checked)."""
    words = span.split()
    if not words:
        return []
    foreign = words[0] in FOREIGN_COMMANDS or span.startswith("python -m pytest")
    found = [] if foreign else check_flags(span)
    callee = called(span)
    located = re.match(r"^([\w./-]+\.(?:py|c|h):[\w.]+)\(", span)
    module = re.search(r"\bpython3? -m (vlmd[\w.]*)", span)
    if located:  # `file.py:name(args ...)`
        found.append(check_path(located.group(1)))
    elif callee:  # `name(args ...)`: the callee
        found.append(check_symbol(callee, call=True))
    elif CALL.match(span):
        pass  # `http(s)`: not code
    elif module:  # `python -m vlmd.testing.tiny ...`
        found.append(check_module_path(module.group(1).split(".")))
    elif len(words) == 1:
        found.append(check_token(span))
    elif not foreign:  # a command or a phrase: its path-like words
        for word in (w.rstrip(".,;") for w in words if not w.startswith("-")):
            if is_path_like(word):
                why = check_path(word)
                found.append(why and f"{word}: {why}")
    return [why for why in found if why]


def decision_numbers() -> list[int]:
    """The entries of docs/decisions.md, in order (``- **D12. Title**``)."""
    return [int(n) for n in re.findall(r"^- \*\*D(\d+)\. ", (REPO / "docs" / "decisions.md").read_text(), re.M)]


def problems_in(text: str, doc_dir: Path) -> list[str]:
    """Every name in ``text`` (a markdown document in ``doc_dir``) that does not exist."""
    found = []
    for line, span in inline_spans(text):
        found += [f"line {line}: `{span}`: {why}" for why in check_span(span)]
    for line, command in command_lines(text):
        found += [f"line {line}: {command.strip()[:60]}: {why}" for why in check_flags(command)]
    for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        target = match.group(1)
        if "://" not in target and not target.startswith("mailto:") and not (doc_dir / target).exists():
            found.append(f"line {text.count(chr(10), 0, match.start()) + 1}: link {target}: no such file")
    entries = set(decision_numbers())
    for match in re.finditer(r"\bD(\d+)\b", text):
        if int(match.group(1)) not in entries:
            found.append(f"line {text.count(chr(10), 0, match.start()) + 1}: D{match.group(1)}: "
                         "no such entry in docs/decisions.md")
    return found


RUN_MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")


def unrunnable(module: str) -> str | None:
    """Why ``python -m module`` would fail here (None: it runs): one of this repository's
    (``vlmd...``, a plugin's ``vlmd_...``) must be a package with ``__main__.py`` or a module
    with a ``__main__`` guard; another must be importable (``venv``, ``pytest``)."""
    import importlib.util

    if module.split(".")[0] == "vlmd" or module.startswith("vlmd_"):
        parts = module.split(".")
        for base in (REPO, *sorted((REPO / "plugins").iterdir())):
            package = base.joinpath(*parts)
            if (package / "__main__.py").is_file():
                return None
            source = package.with_suffix(".py")
            if source.is_file():
                text = source.read_text()
                return None if re.search(r"""if __name__ == ["']__main__["']""", text) else "has no __main__ guard"
        return "no such module or package"
    return None if importlib.util.find_spec(module.split(".")[0]) is not None else "not importable"


# ---- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_doc_names_exist(doc: Path):
    problems = problems_in(doc.read_text(), doc.parent)
    assert not problems, f"{doc.relative_to(REPO)} names things that do not exist:\n" + "\n".join(problems)


def test_decisions_are_numbered_once_in_order():
    """Entries are cited by number (D12): each number once, none skipped."""
    numbers = decision_numbers()
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_checker_finds_made_up_names():
    """The checker is not vacuous: each kind of made-up name is reported, its real twin is not."""
    pairs = [  # (real, made up): one of each kind the checker reads
        ("`vlmd/layers/linear/selection.py`", "`vlmd/layers/linear/no_such_file.py`"),
        ("`layers/cpu/`", "`layers/nowhere/`"),
        ("`contrib/bench/roofline.py`", "`contrib/bench/nope.py`"),
        ("`decode_plan.py`", "`no_such_plan.py`"),
        ("`SchedulerOutput`", "`SchedulerOutputz`"),
        ("`select_linear_kernels()`", "`select_linear_kernelz()`"),
        ("`native_buckets`", "`no_such_bucketz`"),
        ("`CPUPagedBackend.prepare_metadata`", "`CPUPagedBackend.no_such_method`"),
        ("`AttentionBackend.decode_step`", "`CPUPagedBackend.decode_step`"),  # inherited, not defined there
        ("`selection.py:select_linear_kernels`", "`selection.py:no_such_function`"),
        ("`registry.py:attention_backend_for(\"cpu\", block_size)`", "`registry.py:no_backend_for(\"cpu\", 16)`"),
        ("`sampler.sample`", "`sampler.no_such_sample`"),
        ("`vlmd.testing.tiny`", "`vlmd.engine.no_such_module`"),
        ("`python -m vlmd.engine.rank_process SPEC`", "`python -m vlmd.engine.no_such_process SPEC`"),
        ("`vlmd_engine_step_seconds{kind=...}`", "`vlmd_no_such_seconds{kind=...}`"),
        ("`--max-num-batched-tokens`", "`--no-such-flag`"),
        ("`python contrib/bench/bench_chat.py --concurrency 1 8`", "`python contrib/bench/bench_chat.py --no-such-bench-flag`"),
        ("`vlmd cost DIR --image 640x480`", "`vlmd cost DIR --no-such-cost-flag 640x480`"),
        ("[x](structures.md)", "[x](no_such_doc.md)"),
        ("D12", "D9999"),
    ]
    docs = REPO / "docs"
    for real, made_up in pairs:
        assert problems_in(f"See {real}.\n", docs) == [], real
        problems = problems_in(f"See {made_up}.\n", docs)
        assert len(problems) == 1, (made_up, problems)
    # Not checked: plain words, shell commands of other programs, JSON, expressions.
    for text in ("`auto`", "`pip install -e .`", '`{"type": "image"}`', "`cache[slots]`", "`http(s)://`",
                 "`config.json`", "`F.linear`", "`../shared/DESIGN.md`", "`/proc/cpuinfo`"):
        assert problems_in(f"See {text}.\n", docs) == [], text


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_python_dash_m_runs_a_module_that_exists(doc: Path):
    """Every ``python -m MODULE`` the docs write, in prose or in a code block, names a module
    that runs as written (README examples once ran a module that had moved)."""
    problems = [f"python -m {name}: {why}" for name in RUN_MODULE.findall(doc.read_text())
                if (why := unrunnable(name))]
    assert not problems, f"{doc.relative_to(REPO)}:\n" + "\n".join(problems)


def test_the_python_dash_m_check_finds_a_module_that_does_not_run():
    assert unrunnable("vlmd.tiny") is None and unrunnable("vlmd.testing.tiny") is None
    assert unrunnable("venv") is None
    assert unrunnable("vlmd.no_such_module") == "no such module or package"
    assert unrunnable("vlmd.config") == "has no __main__ guard"  # exists, but runs nothing
    assert unrunnable("no_such_tool_anywhere") == "not importable"
