"""Packaging: one metadata source (pyproject.toml ``[project]``; setup.py only maps folders),
one version (``graphrt/_version.py``), requirements that resolve with the torch the README
installs, the console script, light imports, and a wheel that carries graphrt.capture and
graphrt.kernels.

The resolution itself against a stock index (``pip install --isolated --dry-run``) needs the
network: it is a step of ``.ci/run``. Here the declared requirements are checked statically
against the triton that each supported torch pins on Linux.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]

# What torch pins on Linux (its wheel's Requires-Dist), for the torches we document:
# 2.13.0 (README's main command) and 2.11.0 (the gpu extra, the H200 machines).
TORCH_TRITON = {"2.13.0": "3.7.1", "2.11.0": "3.6.0"}
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "python_version": "3.12"}


def _reqs(extra: str | None = None) -> dict[str, Requirement]:
    lines = PROJECT["dependencies"] + (PROJECT["optional-dependencies"][extra] if extra else [])
    out: dict[str, Requirement] = {}
    for line in lines:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(LINUX):
            out[r.name] = r  # an extra's line narrows the base one (numpy -> numpy<2.5)
    return out


def test_metadata_lives_in_pyproject():
    assert PYPROJECT["build-system"]["requires"] == ["setuptools>=77"]  # PEP 639 license
    assert PROJECT["name"] == "graphrt" and PROJECT["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "graphrt._version.__version__"}
    for key in ("description", "readme", "license", "requires-python", "classifiers",
                "dependencies", "optional-dependencies", "scripts"):
        assert PROJECT.get(key), key
    # an SPDX expression: the `{text = ...}` table stops building after 2027-02-18
    assert PROJECT["license"] == "MIT" and PROJECT["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in PROJECT["classifiers"])  # PEP 639
    assert PROJECT["scripts"] == {"graphrt": "graphrt.cli.main:main"}
    setup = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(setup) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "setup")
    assert sorted(k.arg for k in call.keywords) == ["package_dir", "packages"]


def test_one_version():
    import graphrt
    from graphrt._version import __version__
    assert graphrt.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    hits = [str(p.relative_to(ROOT)) for p in [ROOT / "setup.py", ROOT / "pyproject.toml",
                                                 *(ROOT / "graphrt").rglob("*.py")]
            if re.search(r"^\s*(__)?version(__)?\s*=\s*[\"']\d", p.read_text(), re.M)]
    assert hits == [os.path.join("graphrt", "_version.py")], hits


def test_requirements():
    base = _reqs()
    assert set(base) == {"torch", "numpy", "rich", "triton"}  # no tqdm: rich draws the bars
    assert str(base["triton"].marker) == 'sys_platform == "linux"'  # Linux wheels only
    assert _reqs("dev")["numpy"].specifier.contains("2.4.6")
    assert not _reqs("dev")["numpy"].specifier.contains("2.5.0")  # old Triton interpreters
    assert {"pytest", "matplotlib"} <= set(_reqs("dev")) and "matplotlib" in _reqs("bench")
    gpu = _reqs("gpu")
    assert str(gpu["torch"].specifier) == "==2.11.0"  # what the DeepEP/DeepGEMM wheels are built for
    assert str(gpu["tokenspeed-deepep"].specifier) == "==1.2.1.post20251110"
    assert str(gpu["tokenspeed-deepgemm"].specifier) == "==2.5.0.post20260424"


@pytest.mark.parametrize("extras", [("dev",), ("bench",), ("gpu",), ("dev", "gpu")])
def test_requirements_agree_with_torchs_triton_pin(extras):
    """Each torch we document must satisfy our torch requirement and its pinned triton ours
    (a triton bound above torch's pin made `.[dev]` unresolvable on a stock index)."""
    reqs: dict[str, list[Requirement]] = {}
    for extra in (None, *extras):
        for name, r in _reqs(extra).items():
            reqs.setdefault(name, []).append(r)
    fits = [(t, tr) for t, tr in TORCH_TRITON.items()
            if all(r.specifier.contains(t) for r in reqs["torch"])
            and all(r.specifier.contains(tr) for r in reqs["triton"])]
    assert fits, f"no documented torch fits {reqs['torch']} with {reqs['triton']}"
    if "gpu" in extras:
        assert fits == [("2.11.0", "3.6.0")]
    else:
        assert ("2.13.0", "3.7.1") in fits


def test_readme_installs_a_documented_torch():
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"pip install torch==([\d.]+)", readme) == ["2.13.0"]
    assert "pip install -e '.[dev]'" in readme and "graphrt demo" in readme


def test_imports_stay_light():
    code = ("import sys, graphrt, graphrt.cli.main; "
            "print(sorted(m for m in ('triton', 'deep_ep', 'deep_gemm', 'matplotlib') "
            "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_one_console_library():
    """rich draws every progress bar and table; tqdm is not a requirement any more."""
    files = [f for folder in ("graphrt", "capture", "kernels", "examples")
             for f in (ROOT / folder).rglob("*.py")]
    assert [str(f) for f in files if "tqdm" in f.read_text()] == []


@pytest.mark.slow
def test_wheel_without_isolation(tmp_path):
    """What the GPU machines run offline (`pip install --no-deps --no-build-isolation -e .`)
    builds here from the metadata alone: a wheel with graphrt.capture and graphrt.kernels,
    the dynamic version and the requirements."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in ("graphrt", "capture", "kernels"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from graphrt._version import __version__
    wheel = next((tmp_path / "dist").glob("graphrt-*.whl"))
    assert wheel.name.startswith(f"graphrt-{__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "graphrt/capture/__init__.py" in names and "graphrt/kernels/__init__.py" in names
    assert "graphrt/_version.py" in names and not any(n.startswith(("capture/", "kernels/"))
                                                      for n in names)
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
    assert 'triton; sys_platform == "linux"' in requires and not any("tqdm" in r for r in requires)
    assert re.search(r"^License-Expression: MIT$", meta, re.M), meta[:800]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "graphrt = graphrt.cli.main:main" in entry
