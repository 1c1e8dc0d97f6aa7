"""The documents cannot drift from the code: what docs/design.md and docs/observability.md
show as the rules table, the output of a script, or a trace is what the code produces now."""

import re
import subprocess
import sys
from pathlib import Path

from shardkit.eager.state import render_rules
from tests.fake.test_prefetch import schedule, sharded, step
from tests.fake.test_trace import traced_step
from tests.conftest import fake_world

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def block_after(doc: str, marker: str) -> str:
    """The text between a ``<!-- marker -->`` comment and the end of what follows it: a fenced
    block, or (for the rules) everything up to ``<!-- end rules -->``."""
    start = doc.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->\n")
    if doc.startswith("```", start):
        body = doc[doc.index("\n", start) + 1 :]
        return body[: body.index("```")].rstrip("\n")
    return doc[start : doc.index("<!-- end rules -->", start)].rstrip("\n")


def is_subsequence(lines: list[str], of: list[str]) -> bool:
    it = iter(of)
    return all(line in it for line in lines)


def test_the_rules_table_in_the_design_doc_is_the_code_s():
    assert block_after(DESIGN, "rules: state.render_rules()") == render_rules()


def test_the_two_block_script_prints_what_the_design_doc_shows():
    script = block_after(DESIGN, "script: two-block step")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == block_after(DESIGN, "output: two-block step")


def test_the_four_block_schedule_excerpt_in_the_design_doc_is_in_order():
    excerpt = DESIGN[DESIGN.index("> pre_forward blocks.0          > pre_backward blocks.3") :].split("```")[0]
    columns = ([], [])
    for line in excerpt.splitlines():
        for i, part in enumerate((line[:32].rstrip(), line[32:].rstrip())):
            if part.strip() and part.strip() != "...":
                columns[i].append(part)
    with fake_world(8, 0) as mesh:
        net = sharded(mesh)
        step(net)
        actual = schedule(step(net)).splitlines()
    assert (len(columns[0]), len(columns[1])) == (7, 8)
    assert all(is_subsequence(column, actual) for column in columns)


def test_the_trace_excerpt_in_observability_md_is_in_order():
    doc = (ROOT / "docs" / "observability.md").read_text()
    excerpt = block_after(doc, "excerpt: tests/fake/test_trace.py")
    shown = [line for line in excerpt.splitlines() if line != "..."]
    assert shown and is_subsequence(shown, traced_step().format().splitlines())
    assert re.search(r"wait all_gather \S+", excerpt)


def file_table_rows(doc: str) -> list[str]:
    """The rows of the table under ``| file | what it holds |`` (header and rule left out): the
    whole table, blank lines inside it included, up to the next heading or paragraph."""
    rows = []
    for line in doc[doc.index("| file | what it holds |") :].splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif line.strip():
            break
    return rows[2:]


def test_the_file_table_rows_after_a_blank_line_are_read():
    doc = "| file | what it holds |\n|---|---|\n| `a.py` | a |\n\n| `b.py` | b |\n\nA paragraph.\n| `c.py` | c |\n"
    assert file_table_rows(doc) == ["| `a.py` | a |", "| `b.py` | b |"]


def test_the_file_table_in_the_design_doc_names_every_module():
    """Every runtime file is in design.md's table (a folder row covers its files), and every
    row names files that exist."""
    named = [p for row in file_table_rows(DESIGN) for p in re.findall(r"`([^`]+)`", row.split("|")[1])]
    package = ROOT / "shardkit"
    missing = [p for p in named if not (package / p).exists()]
    assert not missing, f"design.md's file table names files that do not exist: {missing}"
    folders = [p for p in named if p.endswith("/")]
    files = sorted(str(f.relative_to(package)) for f in package.rglob("*.py") if f.name not in ("__init__.py", "__main__.py"))
    unnamed = [f for f in files if f not in named and not any(f.startswith(d) for d in folders)]
    assert not unnamed, f"design.md's file table does not name: {unnamed}"
