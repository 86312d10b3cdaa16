"""The README's Quick start works as written: its curl and Python blocks run against a real
server of the default model's checkpoint, and its install lines install every family plugin
in the repository by glob (the test command is also the one .ci/run runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from conftest import Server
from vlmd.cli import DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
QUICK_START = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 1)]
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", QUICK_START, re.S)


def _block(language: str, starts: str) -> str:
    found = [code for lang, code in BLOCKS if lang == language and code.lstrip().startswith(starts)]
    assert len(found) == 1, f"one {language} block starting with {starts!r} in the Quick start"
    return found[0]


@pytest.fixture(scope="module")
def server(llava_server):
    """The session's tiny LLaVA: the same checkpoint as the default model, under another name."""
    return llava_server


def _on(server: Server, code: str) -> str:
    """The block, talking to the test's server instead of port 8000, by its model name."""
    assert "8000" in code and DEFAULT_MODEL_NAME in code
    code = code.replace("localhost:8000", f"127.0.0.1:{server.port}").replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
    return code.replace(f'"{DEFAULT_MODEL_NAME}"', f'"{server.model}"')


def test_the_curl_example_answers(server):
    done = subprocess.run(["bash", "-c", _on(server, _block("bash", "curl"))], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = orjson.loads(done.stdout)
    assert body["model"] == server.model and body["choices"][0]["message"]["content"], body
    assert body["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 576}, body


def test_the_python_example_streams_an_answer(server):
    done = subprocess.run([sys.executable, "-c", _on(server, _block("python", "import base64, io"))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the stream printed no text"


def _pip_arguments(command: str) -> list[str]:
    """The arguments pip gets from ``command`` as bash expands it in the repository (globs
    included): ``pip`` and ``python`` are stand-ins there that print their arguments and install
    or run nothing."""
    done = subprocess.run(["bash", "-c", 'pip() { printf "%s\\n" "$@"; }; python() { :; }; ' + command],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _pip_line(block: str) -> str:
    lines = [line for line in block.splitlines() if line.startswith("pip install")]
    assert len(lines) == 1, block
    return lines[0]


def test_the_install_lines_install_every_family_plugin_and_ci_runs_the_test_command():
    """The install lines find the plugins by glob (``plugins/*/``), so a new family is installed
    without editing them: as bash expands them they name every plugin, and every folder the
    glob finds is a plugin (pip would stop at one that is not a package)."""
    plugins = sorted(path.parent.name for path in (REPO / "plugins").glob("*/pyproject.toml"))
    assert plugins and plugins == sorted(path.name for path in (REPO / "plugins").iterdir() if path.is_dir())
    serve = _pip_arguments(_pip_line(_block("bash", "# 1.")))
    test_command = _block("bash", "pip install -q").strip()
    tests = _pip_arguments(test_command)
    installed = [tests[i + 1] for i, arg in enumerate(tests[:-1]) if arg == "-e"]
    assert installed == [".[test]", *(f"plugins/{plugin}/" for plugin in plugins)], tests
    assert serve == ["install", "torch==2.13.0", "./", *(f"./plugins/{plugin}/" for plugin in plugins), "openai"]
    assert test_command in (REPO / ".ci" / "run").read_text()
