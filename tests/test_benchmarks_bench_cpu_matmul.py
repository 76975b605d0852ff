"""``benchmarks/bench_cpu_matmul.py`` on small sizes: one row per size with both dtypes (and bf16
computed in fp32) timed,
the processor's flags read, and the doc section replaced (and only it)."""

import pytest

from benchmarks import bench_cpu_matmul as bench


def test_a_small_run_times_both_dtypes_and_writes_only_its_section(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{bench.BEGIN}\nold\n{bench.END}\nafter\n")
    assert bench.main(["--sizes", "16", "32", "--repeats", "1", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| 16 ") or
            line.startswith("| 32 ")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[3]) > 0 and cells[5].endswith("x")
        assert float(cells[6]) > 0 and cells[7].endswith("x")  # bf16 computed in fp32
    assert "flags: " in text


def test_the_flags_come_from_the_processor():
    facts = bench.cpu_facts()
    assert facts["model"] and facts["flags"]
    assert all(f in bench.FLAGS for f in facts["flags"].split()) or facts["flags"] == "none of them"


def test_bad_arguments_and_a_doc_without_its_section_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "0"])
    doc = tmp_path / "doc.md"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no <!-- bench_cpu_matmul: begin -->"):
        bench.main(["--sizes", "8", "--repeats", "1", "--doc", str(doc)])
    assert doc.read_text() == "no markers\n"
