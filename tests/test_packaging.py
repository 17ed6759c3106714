"""pyproject.toml: runtime dependencies are ranges, the test extra pins CI's environment inside them, the
version lives in one place, and the package imports without its optional extras."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import moe_compile

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _requirements(lines: list[str]) -> dict[str, Requirement]:
    return {Requirement(line).name.lower(): Requirement(line) for line in lines}


def test_version_has_one_home():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert SETUPTOOLS["dynamic"]["version"] == {"attr": "moe_compile.__version__"}
    assert moe_compile.__version__.count(".") == 2


def test_runtime_dependencies_are_ranges():
    for requirement in _requirements(PROJECT["dependencies"]).values():
        assert not any(spec.operator in ("==", "===") for spec in requirement.specifier), requirement


def test_test_extra_pins_every_dependency_inside_its_range():
    """`pip install -e ".[test]"` gives CI's environment: every runtime and optional dependency pinned exactly,
    each pin allowed by the range a user installs with."""
    pinned = _requirements(PROJECT["optional-dependencies"]["test"])
    for requirement in pinned.values():
        assert [spec.operator for spec in requirement.specifier] == ["=="], requirement
    ranges = [PROJECT["dependencies"]] + [lines for name, lines in PROJECT["optional-dependencies"].items()
                                          if name != "test"]
    for lines in ranges:
        for name, requirement in _requirements(lines).items():
            assert name in pinned, f"{requirement} has no pin in the test extra"
            version = next(iter(pinned[name].specifier)).version
            assert requirement.specifier.contains(version), f"the test pin {pinned[name]} is outside {requirement}"


def test_this_environment_is_the_pinned_one():
    """The environment the suite runs in is the test extra's (a drifted one tests something else than CI)."""
    for name, requirement in _requirements(PROJECT["optional-dependencies"]["test"]).items():
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        installed = metadata.version(name).split("+")[0]
        assert requirement.specifier.contains(installed), f"{name} {installed} installed, the test extra pins {requirement}"


def test_imports_without_the_optional_extras():
    """matplotlib (plots), tqdm (bench) and transformers (hf) are not needed to import the package."""
    blocked = ("matplotlib", "tqdm", "transformers")
    code = (f"import sys\nfor name in {blocked!r}: sys.modules[name] = None\n"
            "import moe_compile, moe_compile.hf, moe_compile.explain, moe_compile.profile\n"
            "print(moe_compile.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == moe_compile.__version__
