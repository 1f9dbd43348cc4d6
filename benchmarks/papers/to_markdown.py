"""A paper's JSON (``--out``) as the Markdown table docs/benchmarks/papers.md shows.

    python benchmarks/papers/to_markdown.py benchmarks/results/papers/tiling.json [ROW-FILTER]
"""
from __future__ import annotations

import json
import sys


def markdown(rows: list[dict]) -> str:
    lines = ["| figure | the paper | edgetrain | how | note: where they differ, why |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r["figure"], r["paper"], r["edgetrain"], r["how"], r["note"] or ""]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    data = json.loads(open(sys.argv[1]).read())
    wanted = sys.argv[2] if len(sys.argv) > 2 else ""
    print(f"`{data['command']}`, {data['date_utc']} UTC, {data['seconds']} s; {data['load']} at the end\n")
    print(markdown([r for r in data["rows"] if wanted in r["figure"]]))
