"""The test suite's time as Markdown tables (the slowest tests and the total per file) from the
JUnit XML files pytest writes (``--junitxml``): ``make test-times`` runs each tier serially and
prints this for CONTRIBUTING.md.

    python scripts/test_durations.py runs/test-times/test.xml runs/test-times/test-all.xml --top 40
"""

from __future__ import annotations

import argparse
import platform
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (``lscpu`` reads the same file)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"


def read(path: Path) -> tuple[list[tuple[str, str, float, str]], float]:
    """``(file, test, seconds, outcome)`` per test case, and the suite's wall time."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as err:
        raise SystemExit(f"error: cannot read {path} as JUnit XML ({err}): run pytest with --junitxml={path} first") from None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    cases = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        cases.append((file, case.get("name", "?"), float(case.get("time", 0.0)), outcome))
    return cases, sum(float(s.get("time", 0.0)) for s in suites)


def table(paths: list[Path], top: int) -> str:
    lines = [f"Measured on {cpu_name()}, {__import__('os').cpu_count()} cores, one pytest process per tier "
             "(serial); seconds from pytest's JUnit report (setup, call and teardown together).", ""]
    everything = []
    lines += ["| tier file | tests | passed | wall |", "|---|---|---|---|"]
    for path in paths:
        cases, wall = read(path)
        everything += cases
        passed = sum(1 for c in cases if c[3] == "passed")
        lines.append(f"| {path.name} | {len(cases)} | {passed} | {wall / 60:.1f} min ({wall:.0f} s) |")
    per_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds, _ in everything:
        per_file[file].append(seconds)
    lines += ["", f"The {top} slowest tests:", "", "| s | test |", "|---|---|"]
    for file, name, seconds, _ in sorted(everything, key=lambda c: -c[2])[:top]:
        lines.append(f"| {seconds:.1f} | `{file}::{name}` |")
    lines += ["", "Per file:", "", "| s | tests | file |", "|---|---|---|"]
    for file, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {sum(times):.1f} | {len(times)} | `{file}` |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML files, one per tier")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest tests to list (default 40)")
    args = parser.parse_args(argv)
    print(table(args.reports, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
