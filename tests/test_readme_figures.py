"""The README's measured figures come from the benchmark reports (scripts/readme_figures.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import readme_figures  # noqa: E402


def test_the_committed_readme_cites_the_committed_reports() -> None:
    done = subprocess.run([sys.executable, "scripts/readme_figures.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_gpu_page_is_what_this_cost_model_predicts_for_the_gpu_runs() -> None:
    """docs/bench-gpu.md replays the committed H200 runs with the cost model: a change to it that moves a GPU
    prediction must regenerate the page (python3 bench/gpu.py), as golden plans are."""
    done = subprocess.run([sys.executable, "bench/gpu.py", "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_new_figure_in_a_report_changes_the_block(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    before = readme_figures.block(docs)
    run = docs / "bench-run.md"
    text = run.read_text()
    assert "vs static **" in text
    run.write_text(text.replace("vs static **", "vs static **9", 1))
    assert readme_figures.block(docs) != before


def test_a_report_whose_format_changed_fails_loudly(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "bench-run.md").write_text("# nothing here\n")
    with pytest.raises(readme_figures.StaleReport, match="bench-run.md"):
        readme_figures.block(docs)
