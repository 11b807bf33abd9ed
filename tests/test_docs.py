"""The documents work from a clone: README.md, BENCHMARKS.md and docs/*.md.

- every relative link and image (``[text](path)``, ``#anchor`` included) and every
  repository path they name in code (``examples/validate_step.py``, ``graphrt/moe/``, the
  files in commands) exists;
- nothing points outside the repository (a design note, a method page or scripts that are
  not in it, ``$OUT`` folders of a machine);
- every ``graphrt.*`` module name resolves (``importlib.util.find_spec`` imports only the
  parent packages, which are light; attributes are looked up in the module's source, so
  nothing heavy such as triton is imported);
- the README's Layout lists the tree exactly, and docs/architecture.md maps every module.

CPU only, no GPU and no network.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs() -> list[str]:
    docs = ["README.md", "BENCHMARKS.md"]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        docs += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md")]
    return sorted(docs)


DOCS = _docs()

# Paths in code spans that name files of other projects' repositories (read there, not here).
EXTERNAL = ("deep_ep/", "bench-out/")  # another project's path; what `graphrt bench` writes
# A path-like token in code: it has a '/' and ends in one of these (or in '/': a folder).
FILE_EXTS = (".py", ".md", ".toml", ".png", ".json", ".txt", ".sh", ".cfg", ".yml", ".yaml")
# Places outside the repository that a document must not send a reader to.
FORBIDDEN = ("../shared", ".dev/", "DESIGN.md", "METHOD.md", "STYLE.md", "gpu-env.sh", "$OUT")

_FENCE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1[ \t]*$", re.S | re.M)
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_MODULE = re.compile(r"(?<![\w./-])graphrt(?:\.[A-Za-z_]\w*)+")


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def _split(text: str) -> tuple[str, list[str]]:
    """``(prose, [fenced block bodies])``; the prose keeps its line count."""
    blocks = [m.group(2) for m in _FENCE.finditer(text)]
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return prose, blocks


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(doc: str) -> frozenset:
    prose, _ = _split(_read(doc))
    return frozenset(_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M))


def _links(doc: str) -> list[str]:
    prose, _ = _split(_read(doc))
    prose = _CODE_SPAN.sub("", prose)  # `[x](y)` in code is not a link
    return [m.group(1) for m in _LINK.finditer(prose)]


def _path_token(token: str) -> str | None:
    """The repository path a code token names, or None when it names none."""
    token = token.strip("\"'(),;[]{}")
    token = re.sub(r"::.*$", "", token)                      # pytest node ids
    token = re.sub(r"(\.py):[\w.:]*$", r"\1", token)         # FILE.py:FUNC, FILE.py:LINE
    if "/" not in token or token.startswith(("http:", "https:", "$", "~", "/", "..", "-")):
        return None
    if any(c in token for c in "*<>{}|=") or token.startswith(EXTERNAL):
        return None
    if token.endswith("/") or token.endswith(FILE_EXTS):
        return token
    return None


def _code_paths(doc: str) -> list[str]:
    prose, blocks = _split(_read(doc))
    code = [m.group(2) for m in _CODE_SPAN.finditer(prose)] + blocks
    return [p for chunk in code for p in map(_path_token, chunk.split()) if p]


# -- links and paths -------------------------------------------------------------------------
@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_exist(doc):
    base = os.path.dirname(os.path.join(ROOT, doc))
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):             # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, doc)
        if not full.startswith(ROOT + os.sep) or not os.path.exists(full):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and full.endswith(".md") and anchor not in _anchors(os.path.relpath(full, ROOT)):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{doc}: broken links: {broken}"


@pytest.mark.parametrize("doc", DOCS)
def test_repository_paths_in_code_exist(doc):
    missing = sorted({p for p in _code_paths(doc) if not os.path.exists(os.path.join(ROOT, p))})
    assert not missing, (f"{doc} names paths that are not in the repository: {missing} (paths in "
                         f"code are relative to the repository root; another project's path "
                         f"belongs in EXTERNAL of {os.path.basename(__file__)})")


@pytest.mark.parametrize("doc", DOCS)
def test_nothing_outside_the_repository(doc):
    text = _read(doc)
    found = [s for s in FORBIDDEN if s in text]
    assert not found, (f"{doc} mentions {found}: a reader with a clone has none of these; "
                       "point at a file in the repository (docs/gpu.md for GPU setup)")


def test_path_rule():
    assert _path_token("examples/validate_step.py:make_hazardous_step") == "examples/validate_step.py"
    assert _path_token('"tests/test_ep_multigpu.py::test_ep_matches_ep1[deepep-hook-True]"') \
        == "tests/test_ep_multigpu.py"
    assert _path_token("graphrt/moe/") == "graphrt/moe/"
    assert _path_token("examples/validate_step.py:65") == "examples/validate_step.py"
    for not_a_path in ("/abs/path/x.py", "$OUT/bench", "../x.md", "https://a/b.py", "bench-out/modes",
                       "a/b", "deep_ep/buffers/elastic.py", "x.py"):
        assert _path_token(not_a_path) is None, not_a_path


# -- module names ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _top_level_names(path: str) -> frozenset:
    """Names a module's source binds at its top level (and lists in ``__all__``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value:
                names.update(e.value for e in getattr(node.value, "elts", [])
                             if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return frozenset(names)


def _resolves(name: str) -> bool:
    """Whether ``graphrt.a.b.c`` is a module, or an attribute its module's source defines.
    ``find_spec`` of a submodule imports its parent packages (light), never the module."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec.submodule_search_locations is not None:   # a package: maybe a submodule
            sub = importlib.util.find_spec(".".join(parts[:i + 1]))
            if sub is not None:
                spec = sub
                continue
        return spec.origin is not None and parts[i] in _top_level_names(spec.origin)
    return True


@pytest.mark.parametrize("doc", DOCS)
def test_module_names_resolve(doc):
    names = sorted(set(_MODULE.findall(_read(doc))))
    bad = [n for n in names if not _resolves(n)]
    assert not bad, f"{doc} names modules or attributes that do not exist: {bad}"


def _runnable(module: str) -> bool:
    """Whether ``python -m module`` runs: a package with ``__main__.py``, or a module whose
    source has an ``if __name__ == "__main__":`` block."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations is not None:
        return importlib.util.find_spec(module + ".__main__") is not None
    with open(spec.origin, encoding="utf-8") as f:
        return re.search(r"""^if __name__ == ["']__main__["']\s*:""", f.read(), re.M) is not None


@pytest.mark.parametrize("doc", DOCS)
def test_python_m_commands_run(doc):
    modules = sorted(set(re.findall(r"-m\s+(graphrt(?:\.\w+)*)", _read(doc))))
    bad = [m for m in modules if not _runnable(m)]
    assert not bad, f"{doc}: `python -m` of {bad} does not run (no __main__)"


def test_module_rule():
    assert _resolves("graphrt.comm.base.Receiver") and _resolves("graphrt.capture.analyze_step")
    assert _resolves("graphrt.StepSpec") and _resolves("graphrt.kernels.ops")
    assert not _resolves("graphrt.bench_ep") and not _resolves("graphrt.bench.small_step")
    assert not _resolves("graphrt.scheduler")
    assert _MODULE.findall("python -m graphrt.bench.ep --ranks 2; torch.ops.graphrt.x") \
        == ["graphrt.bench.ep"]
    assert _runnable("graphrt") and _runnable("graphrt.bench") and not _runnable("graphrt.spec")


# -- the README's Layout and the module map ---------------------------------------------------
# Never part of the tree: hidden files, caches, build outputs, `graphrt bench`'s default output.
_NOT_TREE = re.compile(r"(^|/)(\.[^/]*|__pycache__|build|dist|[^/]*\.egg-info|bench-out[^/]*)(/|$)")


def _tree() -> list[str]:
    """Every file of the repository (tracked, or untracked and not ignored), relative to the
    root; without git, every file under the root but the ``_NOT_TREE`` ones."""
    files = []
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True, timeout=60).stdout
        files = [f for f in out.splitlines() if os.path.exists(os.path.join(ROOT, f))]
    except (OSError, subprocess.SubprocessError):
        pass
    if not files:
        for folder, _, names in os.walk(ROOT):
            files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
    return [f for f in files if not _NOT_TREE.search(f)]


def _layout() -> dict[str, str]:
    """``{path: description}`` from the README's Layout block (an entry starts at column 0)."""
    text = _read("README.md")
    section = re.search(r"^## Layout\s*$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no '## Layout' section"
    _, blocks = _split(section.group(1))
    assert blocks, "README.md's Layout section has no code block"
    entries: dict[str, str] = {}
    current = None
    for line in blocks[0].splitlines():
        if line.strip() and not line[0].isspace():
            current, _, desc = line.partition(" ")
            entries[current] = desc
        elif line.strip() and current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_layout_entries_exist():
    missing = [p for p in _layout() if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README Layout lists paths that do not exist: {missing}"


def test_layout_lists_every_top_level_entry():
    listed = {p.split("/")[0] for p in _layout()}
    top = {f.split("/")[0] for f in _tree() if not f.startswith(".")} - {"README.md"}
    assert not top - listed, f"README Layout misses {sorted(top - listed)}"


def test_layout_names_every_module_and_folder():
    entries, tree = _layout(), _tree()
    problems = []
    for folder, desc in entries.items():
        if not folder.endswith("/"):
            continue
        inside = [f[len(folder):] for f in tree if f.startswith(folder)]
        files = {f for f in inside if "/" not in f}
        subdirs = {f.split("/")[0] + "/" for f in inside if "/" in f}
        if folder != "tests/":  # tests/: its folders, not every test file
            for f in sorted(files):
                if f.endswith((".py", ".md")) and f != "__init__.py" \
                        and not re.search(rf"(?<![\w/.]){re.escape(f)}\b", desc):
                    problems.append(f"{folder}: {f} not named")
        for sub in sorted(subdirs):
            if folder + sub not in entries and folder + sub not in desc:
                problems.append(f"{folder}: {folder}{sub} neither an entry nor named")
        for named in re.findall(r"(?<![\w/.])([\w]+\.(?:py|md))\b", desc):
            if named not in files:
                problems.append(f"{folder}: names {named}, which is not in {folder}")
    assert not problems, "README Layout does not match the tree:\n  " + "\n  ".join(problems)


def test_architecture_maps_every_module():
    text = _read(os.path.join("docs", "architecture.md"))
    modules = [f for f in _tree() if f.endswith(".py") and not f.endswith("__init__.py")
               and f.split("/")[0] in ("graphrt", "capture", "kernels", "examples")]
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md's module map misses {missing}"
