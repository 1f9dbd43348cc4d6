"""No two modules import each other (at their top or inside a function): the circles once in data/ and report/."""
from pathlib import Path

from test_spec import SRC, edgetrain_imports


def module_imports() -> dict[str, set[str]]:
    """Every edgetrain module (dotted name) and the edgetrain modules it imports."""
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = {m for m in edgetrain_imports(path) if m.startswith("edgetrain.")}
    return found


def test_no_module_imports_one_that_imports_it():
    imports = module_imports()
    circles = sorted({tuple(sorted((a, b))) for a, deps in imports.items() for b in deps
                      if a != b and a in imports.get(b, set()) and not b.startswith(a + ".")
                      and not a.startswith(b + ".")})
    assert circles == []  # once data.datasets <-> data.formats and report.html <-> report.plan_page


def test_every_bench_result_type_has_its_table_and_its_radar_rows_in_the_report():
    from edgetrain.records import RunSummary
    from edgetrain.report.html import BENCH_HEADLINES, RADAR_CONFIGURATIONS
    from edgetrain.results import BENCH_RESULTS, PlanResult

    assert set(BENCH_HEADLINES) == set(BENCH_RESULTS.values())
    assert set(RADAR_CONFIGURATIONS) == set(BENCH_RESULTS.values()) | {RunSummary, PlanResult}
    assert Path(SRC / "report" / "plan_page.py").read_text().count("edgetrain.report.html") == 0
