"""Who may import whom (DESIGN.md section 2), and the plugin hooks: all implemented, all tested.

The import rules are checked on the source with ``ast``, so they hold for every import in a
file (top level, inside functions, under ``TYPE_CHECKING``, in ``try``) and for
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name, whether or not
that code path ever runs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from vlmd.plugins import hookspecs
from vlmd.plugins.hookspecs import hookimpl
from vlmd.plugins.manager import ENTRY_POINT_GROUP, build_registry, plugin_manager
from vlmd.plugins.registry import FamilyRegistry, ModelFamily

REPO = Path(__file__).resolve().parent.parent
VLMD = REPO / "vlmd"
PLUGINS = REPO / "plugins"
TESTS = REPO / "tests"


# ---- the checker ------------------------------------------------------------------------


def imports_in_source(source: str, module: str, is_package: bool = False, filename: str = "<src>") -> list[tuple[int, str]]:
    """(line, absolute module name) for every import anywhere in ``source``.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (``c`` may be a submodule);
    relative imports are resolved against ``module``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base, package)
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def module_of(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imports_in_file(path: Path, root: Path) -> list[tuple[int, str]]:
    module, is_package = module_of(path, root)
    return imports_in_source(path.read_text(encoding="utf-8"), module, is_package, filename=str(path))


def source_files(directory: Path) -> list[Path]:
    """The code under ``directory``, without a family's tests (``plugins/NAME/tests/``, which
    pytest collects beside tests/): they are not the family's production code."""
    return sorted(p for p in directory.rglob("*.py")
                  if "__pycache__" not in p.parts and "tests" not in p.relative_to(directory).parts[:-1])


def family_packages() -> dict[str, tuple[Path, Path]]:
    """Family package name -> (its directory, the root it is imported from)."""
    packages = {}
    for distribution in sorted(p for p in PLUGINS.iterdir() if p.is_dir()):
        for init in sorted(distribution.glob("*/__init__.py")):
            packages[init.parent.name] = (init.parent, distribution)
    return packages


def violations(files: list[Path], root: Path, forbidden) -> list[str]:
    found = []
    for path in files:
        for line, name in imports_in_file(path, root):
            if forbidden(name):
                found.append(f"{path.relative_to(REPO)}:{line} imports {name}")
    return found


def test_checker_sees_every_kind_of_import():
    source = '''
import os, torch.nn as nn
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from vlmd.runner.batch import InputBatch
def later():
    import vlmd_qwen2_vl.model
    try:
        from ..sched import scheduler
    except ImportError:
        pass
    importlib.import_module("vlmd_whisper")
    return __import__("torch")
from . import protocol
from .. import runner
'''
    names = {name for _, name in imports_in_source(source, "vlmd.server.app")}
    assert {"os", "torch.nn", "vlmd.runner.batch", "vlmd_qwen2_vl.model", "vlmd.sched", "vlmd.sched.scheduler",
            "vlmd_whisper", "torch", "vlmd.server.protocol", "vlmd.runner"} <= names
    assert {name for _, name in imports_in_source("from . import x", "vlmd.sched", is_package=True)} == {
        "vlmd.sched", "vlmd.sched.x"
    }


def test_the_checker_has_files_to_check():
    assert len(source_files(VLMD / "sched")) >= 6
    assert source_files(VLMD / "server")
    assert "vlmd_llava" in family_packages()


# ---- the rules --------------------------------------------------------------------------


def test_sched_never_imports_torch():
    assert violations(source_files(VLMD / "sched"), REPO, lambda name: within(name, "torch")) == []


def test_server_never_imports_torch_sched_or_runner():
    def forbidden(name: str) -> bool:
        return any(within(name, package) for package in ("torch", "vlmd.sched", "vlmd.runner"))

    assert violations(source_files(VLMD / "server"), REPO, forbidden) == []


def test_model_code_calls_seams_never_the_cpu_kernels():
    """Models (the core's and every family's) reach the CPU room's kernels only through the
    seams (linear, norm, rotary, attention, the decoder structure), so a backend can
    change what runs without a model naming it."""
    def forbidden(name: str) -> bool:
        return within(name, "vlmd.layers.cpu")

    found = violations(source_files(VLMD / "models"), REPO, forbidden)
    for directory, root in family_packages().values():
        found += violations(source_files(directory), root, forbidden)
    assert found == []


def test_vlmd_never_imports_a_family_package():
    def forbidden(name: str) -> bool:
        return name.split(".")[0].startswith("vlmd_")

    assert violations(source_files(VLMD), REPO, forbidden) == []


def declared_families(distribution: Path) -> set[str]:
    """The family packages a plugin distribution declares as dependencies in its
    pyproject.toml (``vlmd-qwen2-vl`` -> ``vlmd_qwen2_vl``): installed with it, as any third
    party's dependency would be."""
    import re
    import tomllib

    pyproject = distribution / "pyproject.toml"
    if not pyproject.exists():
        return set()
    requirements = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
    names = {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("-", "_")
             for requirement in requirements}
    return {name for name in names if name.startswith("vlmd_")}


@pytest.mark.parametrize("package", sorted(family_packages()))
def test_family_packages_never_import_each_other(package):
    """Unless the importer declares the other family as a dependency (Qwen2.5-VL builds on
    Qwen2-VL's processor and positions): then it is a dependency like any other."""
    directory, root = family_packages()[package]
    allowed = declared_families(root)

    def forbidden(name: str) -> bool:
        top = name.split(".")[0]
        return top.startswith("vlmd_") and top != package and top not in allowed

    assert violations(source_files(directory), root, forbidden) == []


def test_declared_family_dependencies_are_read():
    assert declared_families(PLUGINS / "vlmd_qwen2_5_vl") == {"vlmd_qwen2_vl"}
    assert declared_families(PLUGINS / "vlmd_llava") == set()


def test_family_rules_catch_a_sibling_import():
    # The rule above, on a file that breaks it.
    names = [name for _, name in imports_in_source("from vlmd_qwen2_vl.processing import x", "vlmd_llava.model")]
    assert any(name.split(".")[0].startswith("vlmd_") and name.split(".")[0] != "vlmd_llava" for name in names)


def test_production_code_never_uses_vlmd_testing():
    """vlmd.testing holds test support (fault injection, soak clients); a server that imported
    it, or a docstring that sent a reader there for production behaviour, would make it part
    of vlmd. Checked on imports and on the text, docstrings included, of vlmd/ and plugins/."""
    testing = VLMD / "testing"
    production = [path for path in source_files(VLMD) if not path.is_relative_to(testing)]
    assert violations(production, REPO, lambda name: within(name, "vlmd.testing")) == []
    for package, (directory, root) in family_packages().items():
        assert violations(source_files(directory), root, lambda name: within(name, "vlmd.testing")) == [], package
    mentions = [str(path.relative_to(REPO)) for path in production + source_files(PLUGINS)
                for word in ("vlmd.testing", "vlmd/testing") if word in path.read_text(encoding="utf-8")]
    assert mentions == []


def test_the_cache_directory_is_resolved_in_one_place():
    """vlmd/config.py:cache_dir is the one reader of the cache directory's variable; the server,
    the tests and the benches ask it, so they cannot disagree on where the built models are."""
    from vlmd.config import CACHE_DIR_ENV, cache_dir

    files = [REPO / "conftest.py", *(path for directory in (VLMD, PLUGINS, TESTS, *PLUGINS.glob("*/tests"), REPO / "contrib")
                                     for path in source_files(directory))]
    named_by = [str(path.relative_to(REPO)) for path in files if CACHE_DIR_ENV in path.read_text(encoding="utf-8")]
    assert named_by == ["vlmd/config.py"]
    assert cache_dir({CACHE_DIR_ENV: "/srv/vlmd-cache"}) == Path("/srv/vlmd-cache")
    assert cache_dir({}) == cache_dir({CACHE_DIR_ENV: ""}) == Path.home() / ".cache" / "vlmd"


# ---- hooks ------------------------------------------------------------------------------


def hookspec_names() -> list[str]:
    return sorted(
        name for name, value in vars(hookspecs).items()
        if callable(value) and getattr(value, "vlmd_spec", None) is not None
    )


def test_there_are_hooks():
    assert hookspec_names()


@pytest.mark.parametrize("hook", hookspec_names())
def test_every_hook_is_implemented_by_a_built_in_plugin(hook):
    manager = plugin_manager()
    implementers = [impl.plugin for impl in getattr(manager.hook, hook).get_hookimpls()]
    built_in = [
        plugin for plugin in implementers
        if Path(getattr(plugin, "__file__", "/")).resolve().is_relative_to(PLUGINS.resolve())
    ]
    assert built_in, f"no package under plugins/ implements {hook}"


def hook_calls_in_source(source: str, filename: str = "<src>") -> dict[str, list[str]]:
    """Hook name -> the test functions in ``source`` that call it through a plugin manager
    (``<manager>.hook.<name>(...)`` inside a ``def test_...``). A name in a comment, a string or
    a helper does not count: only a test that runs the hook's implementations."""
    calls: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")):
            continue
        for inner in ast.walk(node):
            if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                    and isinstance(inner.func.value, ast.Attribute) and inner.func.value.attr == "hook"):
                calls.setdefault(inner.func.attr, []).append(node.name)
    return calls


def hook_calls_in_tests() -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    # A family's own tests (plugins/*/tests/, collected by pytest's testpaths) count too.
    for path in sorted([*TESTS.glob("test_*.py"), *PLUGINS.glob("*/tests/test_*.py")]):
        for hook, tests in hook_calls_in_source(path.read_text(encoding="utf-8"), str(path)).items():
            calls.setdefault(hook, []).extend(f"{path.name}::{test}" for test in tests)
    return calls


def test_the_hook_checker_counts_only_calls_in_tests():
    source = '''
# manager.hook.vlmd_in_a_comment(registry=r)
"""manager.hook.vlmd_in_a_docstring(registry=r)"""
def helper(manager):
    manager.hook.vlmd_in_a_helper(registry=r)
def test_names_it():
    name = "vlmd_in_a_string"
    hook = manager.hook.vlmd_not_called
def test_calls_it():
    plugin_manager().hook.vlmd_called(registry=r)
'''
    assert hook_calls_in_source(source) == {"vlmd_called": ["test_calls_it"]}


@pytest.mark.parametrize("hook", hookspec_names())
def test_every_hook_is_tested(hook):
    # Datasette-style, but a test must run the hook (manager.hook.<name>(...)), not name it.
    assert hook_calls_in_tests().get(hook), (
        f"no test under tests/ or plugins/*/tests/ calls the hook {hook} (manager.hook.{hook}(...) in a def test_...)")


def test_vlmd_register_model_families_registers_every_built_in_family():
    registry = FamilyRegistry()
    plugin_manager().hook.vlmd_register_model_families(registry=registry)
    families = {family.name: family for family in registry.families()}
    assert {"llava", "qwen2_vl", "whisper", "qwen2_audio"} <= set(families)
    for family in families.values():
        assert family.architectures, family.name
        for architecture in family.architectures:
            assert registry.for_architectures([architecture]) is family


def test_vlmd_register_tiny_builders_names_a_builder_per_built_in_family():
    from vlmd.plugins.registry import resolve

    builders: dict[str, str] = {}
    plugin_manager().hook.vlmd_register_tiny_builders(builders=builders)
    assert {"llava", "qwen2_vl", "whisper", "qwen2_audio"} <= set(builders)
    for family, target in builders.items():
        # Each family's own package builds it (a variant, such as qwen3_vl_moe, in its family's).
        owner = target.split(".")[0].removeprefix("vlmd_")
        assert family == owner or family.startswith(owner + "_"), target
        assert callable(resolve(target)), target


def test_vlmd_register_converters_names_the_ct2_converter():
    from vlmd.plugins.registry import resolve

    converters: dict[str, str] = {}
    plugin_manager().hook.vlmd_register_converters(converters=converters)
    assert set(converters) == {"ct2"}
    assert converters["ct2"].startswith("vlmd_whisper.") and callable(resolve(converters["ct2"]))


def test_build_registry_finds_llava_through_its_entry_point():
    entry_points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert entry_points.get("llava") == "vlmd_llava"

    manager = plugin_manager()
    distributions = {plugin.__name__: dist.project_name for plugin, dist in manager.list_plugin_distinfo()}
    assert distributions.get("vlmd_llava") == "vlmd-llava"

    registry = build_registry(manager)
    family = registry.for_architectures(["SomethingElse", "LlavaForConditionalGeneration"])
    import vlmd_llava

    assert family is vlmd_llava.FAMILY and family.name == "llava"
    assert "LlavaForConditionalGeneration" in registry.architectures()
    assert family.load("processor").__name__ == "LlavaProcessor"
    with pytest.raises(LookupError, match="LlavaForConditionalGeneration"):
        registry.for_architectures(["NoSuchForCausalLM"])


def test_building_the_registry_imports_no_torch():
    # Families name their classes as "module:attr" strings, so discovery stays cheap.
    code = (
        "import sys\n"
        "from vlmd.plugins.manager import build_registry\n"
        "assert build_registry().for_architectures(['LlavaForConditionalGeneration']).name == 'llava'\n"
        "assert 'torch' not in sys.modules, 'registering families imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _family(name: str, *architectures: str) -> ModelFamily:
    return ModelFamily(
        name=name,
        architectures=architectures,
        model="tests.nowhere:Model",
        processing_info="tests.nowhere:Info",
        processor="tests.nowhere:Processor",
        dummy_inputs="tests.nowhere:Dummy",
    )


def test_registering_an_architecture_twice_warns_and_the_later_wins():
    registry = FamilyRegistry()
    first = _family("first", "FooForCausalLM", "BarForCausalLM")
    second = _family("second", "FooForCausalLM")
    with capture_logs() as logs:
        registry.register(first)
        assert logs == []
        registry.register(second)
    assert registry.for_architectures(["FooForCausalLM"]) is second
    assert registry.for_architectures(["BarForCausalLM"]) is first
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0]["architecture"] == "FooForCausalLM"
    assert (warnings[0]["previous"], warnings[0]["new"]) == ("first", "second")
    assert registry.families() == [second, first]


def test_a_plugin_can_replace_the_built_in_llava_family():
    replacement = _family("my-llava", "LlavaForConditionalGeneration")

    class Replacement:
        # pluggy calls the latest registered implementation first; trylast makes this one
        # register after the built-in family, so it is the later registration and wins.
        @hookimpl(trylast=True)
        def vlmd_register_model_families(self, registry):
            registry.register(replacement)

    manager = plugin_manager()
    manager.register(Replacement(), name="replacement")
    with capture_logs() as logs:
        registry = build_registry(manager)
    assert registry.for_architectures(["LlavaForConditionalGeneration"]) is replacement
    assert [
        (entry["log_level"], entry["architecture"], entry["previous"], entry["new"])
        for entry in logs
        if entry.get("architecture") == "LlavaForConditionalGeneration"
    ] == [("warning", "LlavaForConditionalGeneration", "llava", "my-llava")]


def test_a_family_must_name_an_architecture():
    with pytest.raises(ValueError, match="names no architectures"):
        FamilyRegistry().register(_family("empty"))



def test_tiny_builders_and_converters_come_from_plugins():
    """vlmd_register_tiny_builders and vlmd_register_converters: the core names no family,
    and every registered target lives in a plugin package."""
    from vlmd.plugins.manager import converters, tiny_builders

    builders = tiny_builders()
    assert {"llava", "qwen2_vl", "whisper", "qwen2_audio"} <= set(builders)
    assert converters()["ct2"].startswith("vlmd_whisper.")
    for target in [*builders.values(), *converters().values()]:
        assert target.split(".")[0].startswith("vlmd_"), target


def test_vlmd_convert_names_the_formats_plugins_register():
    result = subprocess.run([sys.executable, "-m", "vlmd", "convert", "--from", "nope", "a", "b"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "no installed plugin converts from 'nope'; known formats: ct2" in result.stderr
