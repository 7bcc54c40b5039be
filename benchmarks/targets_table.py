"""Every target the issues name, as measured: the table the README shows, made from
``benchmarks/results/targets.json`` (each entry there also holds its command and notes)::

    python benchmarks/targets_table.py

``tests/test_readme.py`` checks that the README's copy is this table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = Path(__file__).resolve().parent / "results" / "targets.json"


def verdict(entry: dict) -> str:
    if str(entry.get("target", "")).startswith("reported"):
        return "reported"
    return "met" if entry.get("met") else "**missed**"


def table(targets: dict) -> str:
    """Markdown: key, value, target, met or missed, device (its name without the details), commit."""
    rows = ["| key | value | target | | device | commit |", "|---|---|---|---|---|---|"]
    for key, e in targets.items():
        device = str(e.get("device", "")).split(" (")[0].split(";")[0].split(",")[0]
        rows.append(f"| `{key}` | {e['value']} | {e.get('target', '')} | {verdict(e)} | {device} | {e.get('commit', '')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=str(TARGETS), help="the targets file (default: the project's)")
    print(table(json.loads(Path(ap.parse_args().targets).read_text())))


if __name__ == "__main__":
    main()
