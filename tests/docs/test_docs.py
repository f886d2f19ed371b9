"""The documentation cannot drift from the code: it builds strictly, and its examples run.

* ``mkdocs build --strict`` into a temporary directory: a broken link or anchor, a page missing
  from the nav, or an API reference entry (mkdocstrings) that no longer resolves fails it;
* every code block marked runnable in ``README.md`` and ``docs/**/*.md`` runs as a script in a
  fresh Python process, in an empty temporary working directory, with a timeout; it fails if it
  raises. Mark a block by putting ``<!-- runnable -->`` on the line right before its
  ````` ```python ````` fence. Runnable blocks must be self-contained and cheap: CPU, temp dirs,
  seconds;
* the generated sections (configuration reference, benchmark summary) equal what the code
  generates now (``python docs/gen.py`` rewrites them);
* every test a page names as a guard (``tests/...py::test_name``) exists;
* the README's relative links (it is not part of the site) reach a file, and their anchors a
  heading of that page.

What is real: mkdocs, the Material theme, mkdocstrings over the installed cfdist, a real Python
interpreter per block. Nothing is faked.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARK = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 240
BLOCK = re.compile(r"^" + re.escape(MARK) + r"[ \t]*\n```python[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def runnable_blocks() -> list[tuple[str, str]]:
    """``[(id, code)]``: ``id`` is ``page:line`` of the block's first line of code."""
    out = []
    for page in _pages():
        with open(page) as f:
            text = f.read()
        rel = os.path.relpath(page, ROOT)
        if len(re.findall(r"^" + re.escape(MARK) + r"[ \t]*$", text, re.M)) != len(BLOCK.findall(text)):
            raise AssertionError(f"{rel}: a {MARK} line is not followed directly by a ```python block")
        for m in BLOCK.finditer(text):
            line = text[: m.start(1)].count("\n") + 1
            out.append((f"{rel}:{line}", m.group(1)))
    return out


BLOCKS = runnable_blocks()


def test_the_readme_quickstart_and_the_docs_have_runnable_blocks():
    pages = {b[0].split(":")[0] for b in BLOCKS}
    assert "README.md" in pages, "the README's quickstart must be marked runnable"
    assert len(pages) >= 5, f"runnable blocks on only {sorted(pages)}"


@pytest.mark.slow
@pytest.mark.parametrize("where,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_runnable_block_runs(where, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path)}
    try:
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the runnable block at {where} ran longer than {BLOCK_TIMEOUT_S} s "
                    f"(runnable blocks must take seconds):\n{e.stdout}\n{e.stderr}")
    assert r.returncode == 0, f"the runnable block at {where} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """Warnings are errors (``strict: true`` and ``--strict``): broken links and anchors, pages
    not in the nav, mkdocstrings references that do not resolve."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}   # Material's end-of-life banner, not a warning
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    assert (tmp_path / "site" / "api" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    import cfdist

    missing = [n for n in cfdist.__all__ if n != "__version__" and f'id="cfdist.{n}"' not in api]
    assert not missing, f"the API reference lacks {missing} from cfdist.__all__"


def test_generated_sections_are_current():
    sys.path.insert(0, os.path.join(ROOT, "docs"))
    try:
        import gen
    finally:
        sys.path.pop(0)
    assert gen.stale() == [], "run `python docs/gen.py` to regenerate the stale sections"


def test_every_test_the_docs_name_exists():
    named = set()
    for page in _pages():
        with open(page) as f:
            named |= set(re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", f.read()))
    assert named
    missing = []
    for path, name in sorted(named):
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            missing.append(path)
            continue
        if name:
            with open(full) as f:
                defs = {n.name for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.FunctionDef)}
            if name not in defs:
                missing.append(f"{path}::{name}")
    assert not missing, f"the docs name tests that do not exist: {missing}"


def _anchors(md_text: str) -> set[str]:
    from markdown.extensions.toc import slugify

    return {slugify(h, "-") for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", md_text, re.M)}


def test_the_readme_links_resolve():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [u for u in links if "://" not in u]
    assert relative
    bad = []
    for u in relative:
        path, _, anchor = u.partition("#")
        full = os.path.join(ROOT, path) if path else os.path.join(ROOT, "README.md")
        if not os.path.exists(full):
            bad.append(f"{u}: no such file")
        elif anchor:
            with open(full) as f:
                if anchor not in _anchors(f.read()):
                    bad.append(f"{u}: no heading gives #{anchor}")
    assert not bad, f"broken links in README.md: {bad}"


def test_the_cfdist_fit_yaml_example_is_the_one_the_command_prints():
    from cfdist.cli import FIT_EXAMPLE

    with open(os.path.join(ROOT, "docs", "multi-node.md")) as f:
        page = f.read()
    example = "\n".join(line[2:] for line in FIT_EXAMPLE.splitlines()[2:])
    assert f"```yaml\n{example}\n```" in page, "docs/multi-node.md's run.yaml differs from cfdist.cli.FIT_EXAMPLE"
