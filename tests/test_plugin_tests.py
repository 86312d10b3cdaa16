"""A family's tests may live in its plugin (plugins/NAME/tests/, D108): the README's test
command (``python -m pytest``, no paths) collects them through pyproject's ``testpaths``, and
the shared fixtures (the repository's conftest.py) reach them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _plugin_test_folders() -> list[Path]:
    return sorted(path for path in (REPO / "plugins").glob("*/tests") if path.is_dir())


def test_testpaths_take_every_plugins_tests():
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    # pytest expands each entry with glob (relative to the rootdir), as here.
    collected = {path.resolve() for entry in options["testpaths"] for path in REPO.glob(entry) if path.is_dir()}
    assert REPO / "tests" in collected
    assert _plugin_test_folders(), "no family keeps its tests in its plugin"
    for folder in _plugin_test_folders():
        assert folder in collected, f"{folder.relative_to(REPO)} is not in pyproject's testpaths"


def test_a_plugins_tests_get_the_shared_fixtures():
    """``--setup-plan`` resolves every test's fixtures without running them: a fixture that the
    plugin's tests cannot reach is an error there."""
    folders = [str(folder.relative_to(REPO)) for folder in _plugin_test_folders()]
    done = subprocess.run([sys.executable, "-m", "pytest", "--setup-plan", "-q", "-p", "no:cacheprovider", *folders],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "SETUP    S qwen2_audio_server" in done.stdout, done.stdout[-3000:]
