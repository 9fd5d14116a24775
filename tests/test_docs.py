"""The README's and the docs site's figures come from one source each: the README's demo table is
docs/demo.md's, which `longhorizon demo` wrote in a full `make demo` run (runs/demo/results.md),
copied verbatim; benchmark figures are quoted from bench/results.md. The site builds strictly."""

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


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_docs_benchmark_figures_are_quoted_from_bench_results():
    """Every number in each paragraph of the README and the docs pages marked `<!-- bench-figures
    ... -->` appears in bench/results.md (the docs quote; they never retype a figure that could drift)."""
    import re

    text = "".join(page.read_text() + "\n\n" for page in DOCS)
    results = (REPO / "bench" / "results.md").read_text()
    starts = [m.start() for m in re.finditer("<!-- bench-figures", text)]
    assert len(starts) >= 7, "the docs' benchmark paragraphs lost their markers"
    numbers = []
    for start in starts:
        paragraph = text[text.index("-->", start) + 3 : text.index("\n\n", start)]
        numbers += re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", paragraph)
    assert len(numbers) >= 40, numbers
    missing = [
        n for n in numbers if not re.search(rf"(?<![\d.,]){re.escape(n)}(?!\d|,\d|\.\d)", results)
    ]
    assert not missing, f"README benchmark figures not in bench/results.md: {missing}"


def test_the_plugin_example_is_the_tested_plugin():
    """ "Your own environment" (the README and the environments page) shows the demo plugin's file
    verbatim (the one a test installs, makes by id and checks), so the example cannot drift from
    code that runs."""
    source = (REPO / "tests/plugins/lh_demo_plugin/lh_demo_plugin/echo.py").read_text()
    for page in (REPO / "README.md", REPO / "docs" / "environments.md"):
        text = page.read_text()
        start = text.index("```python\n", text.index("**Your own environment**")) + len(
            "```python\n"
        )
        shown = text[start : text.index("```\n", start)]
        assert source.split('"""', 2)[2].lstrip("\n") == shown, page
    # the argument-check hook the environments page shows is the plugin's own
    words = (REPO / "tests/plugins/lh_demo_plugin/lh_demo_plugin/words.py").read_text()
    hook = words[words.index("    @classmethod\n") : words.index("\n\n    def _reset_task")] + "\n"
    assert f"```python\n{hook}```" in (REPO / "docs" / "environments.md").read_text()


def test_the_readme_is_short_and_the_site_builds_strictly(tmp_path):
    """The README is the front door (what it is, a picture, the commands, the results, a plugin,
    the links); the manual is the site, built with every warning an error: a broken link, a page
    missing from the nav, a config section whose reference cannot be generated."""
    import re
    import subprocess
    import sys

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\(docs/([^)]+)\)", readme))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages - {"index.md"} <= linked, f"docs pages the README does not link: {pages - linked}"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reference = (tmp_path / "site" / "configuration" / "index.html").read_text()
    # every section and a nested one, each key with its docstring
    for key in ("rollout", "algo", "warm_start", "rollout.context"):
        assert f"<code>{key}</code>" in reference, key
    assert (
        "max_model_len" in reference
        and "Experts per MoE layer, each a copy of the dense MLP" in reference
    )


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
