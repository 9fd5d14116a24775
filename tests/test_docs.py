"""The README's figures come from one source each: its demo table is docs/demo.md's, which
`longhorizon demo` wrote in a full `make demo` run (runs/demo/results.md), copied verbatim."""

from conftest import REPO


def _table(text: str) -> list[str]:
    """The markdown table that follows the marker line `<!-- demo-table -->`."""
    lines = text.splitlines()
    start = lines.index("<!-- demo-table -->") + 1
    while not lines[start].startswith("|"):
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def test_the_readme_demo_table_is_the_recorded_runs():
    readme = _table((REPO / "README.md").read_text())
    recorded = (REPO / "docs" / "demo.md").read_text().splitlines()
    assert len(readme) >= 3, "the README's demo table has no rows"
    assert all(line in recorded for line in readme), "README demo table differs from docs/demo.md"
    # the rows are the demo's environments, and the curve they come with is there
    assert any("`tools/calculator-v0`" in line for line in readme)
    assert any("`tools/shell-v0`" in line for line in readme)
    assert (REPO / "docs" / "demo-curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_benchmark_figures_are_quoted_from_bench_results():
    """Every number in each README paragraph marked `<!-- bench-figures ... -->` appears in
    bench/results.md (the README quotes; it never retypes a figure that could drift)."""
    import re

    text = (REPO / "README.md").read_text()
    results = (REPO / "bench" / "results.md").read_text()
    starts = [m.start() for m in re.finditer("<!-- bench-figures", text)]
    assert len(starts) >= 4, "the README's benchmark paragraphs lost their markers"
    numbers = []
    for start in starts:
        paragraph = text[text.index("-->", start) + 3 : text.index("\n\n", start)]
        numbers += re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", paragraph)
    assert len(numbers) >= 40, numbers
    missing = [
        n for n in numbers if not re.search(rf"(?<![\d.,]){re.escape(n)}(?!\d|,\d|\.\d)", results)
    ]
    assert not missing, f"README benchmark figures not in bench/results.md: {missing}"


def test_the_readme_plugin_example_is_the_tested_plugin():
    """ "Your own environment" shows the demo plugin's file verbatim (the one a test installs, makes
    by id and checks), so the example cannot drift from code that runs."""
    text = (REPO / "README.md").read_text()
    start = text.index("```python\n", text.index("**Your own environment**")) + len("```python\n")
    shown = text[start : text.index("```\n", start)]
    source = (REPO / "tests/plugins/lh_demo_plugin/lh_demo_plugin/echo.py").read_text()
    assert source.split('"""', 2)[2].lstrip("\n") == shown


def test_make_bench_keeps_the_gpu_checks_and_the_rows_it_did_not_run(tmp_path):
    """bench/run_all.py rewrites results.md; the GPU section (written on a lent GPU machine, which
    `make bench` never has) must survive it, and so must the rows an `--only` run left out (with the
    status they had), so rerunning one benchmark never drops another's figures."""
    import subprocess
    import sys

    out = tmp_path / "results.md"
    out.write_text(
        "# old\n\n| row | benchmark | status | wall |\n| ---: | --- | --- | ---: |\n"
        "| 1 | old title | ok (run alone) | 7 s |\n\n## 1. old row\n\nkept figures 12.5\n\n"
        "## GPU checks (run by hand on a lent GPU machine)\n\nH200 numbers\n"
    )
    r = subprocess.run(
        [sys.executable, "bench/run_all.py", "--only", "999", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "## 1. old row\n\nkept figures 12.5\n" in text and "ok (run alone) | 7 s |" in text
    assert "# old" not in text.splitlines()  # the head is rewritten
    assert text.endswith("## GPU checks (run by hand on a lent GPU machine)\n\nH200 numbers\n")
    r = subprocess.run(
        [sys.executable, "bench/run_all.py", "--only", "999", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "stale" not in text and text.endswith(
        "## GPU checks (run by hand on a lent GPU machine)\n\nH200 numbers\n"
    )
