#!/usr/bin/env python3
"""The time report that ends a CI run (.ci/run): each phase against its budget, then the slowest
tests of each suite.

    ci_report.py PHASE_LOG [--suite LABEL=JUNIT_XML ...] [--slowest N]

PHASE_LOG holds the lines scripts/phases.sh writes ("NAME<TAB>SECONDS[<TAB>failed]"), and
"state<TAB>warm|cold" lines from setup.sh. The budgets are tests/README.md's ("CI time budget"):
a cold run (a fresh machine: nothing installed, no compiler cache) and a warm one (packages,
models and the compiler cache kept from the last run). A phase over its budget gets a warning
that names it; the exit status stays 0 (machines differ in speed: the budget warns, CI's own
limit fails).
"""
import argparse
import sys
import xml.etree.ElementTree as ET

# Seconds per phase: (cold, warm). Keep in step with tests/README.md.
BUDGETS = {
    "setup: Debian packages": (180, 30),
    "setup: Python packages": (60, 10),
    "setup: models": (60, 10),
    "setup: Release build": (420, 60),
    "Release build": (30, 30),
    "Release suite": (360, 360),
    "ASan+UBSan build": (660, 90),
    "ASan+UBSan suite": (630, 600),
}
TOTAL_BUDGET = {"cold": 2400, "warm": 1200}  # the 40 and 20 minutes


def read_phases(path):
    phases, state = [], "cold"
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        print(f"ci_report: no phase log ({e})", file=sys.stderr)
        return phases, state
    for line in lines:
        fields = line.split("\t")
        if fields[0] == "state" and len(fields) > 1:
            state = fields[1]
        elif len(fields) >= 2:
            phases.append((fields[0], float(fields[1]), len(fields) > 2 and fields[2] == "failed"))
    return phases, state


def read_junit(path):
    """(seconds, name, status) of every test case CTest wrote to its JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"ci_report: cannot read {path} ({e})", file=sys.stderr)
        return []
    cases = []
    for case in root.iter("testcase"):
        status = case.get("status", "run")
        if case.find("failure") is not None:
            status = "failed"
        elif case.find("skipped") is not None:
            status = "skipped"
        cases.append((float(case.get("time", "0")), case.get("name", "?"), status))
    return cases


def minutes(seconds):
    return f"{seconds / 60:.1f} min"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase_log")
    ap.add_argument("--suite", action="append", default=[], help="LABEL=JUNIT_XML")
    ap.add_argument("--slowest", type=int, default=15)
    args = ap.parse_args()

    phases, state = read_phases(args.phase_log)
    column = 0 if state == "cold" else 1
    over = []
    print(f"\n== CI time by phase ({state} run: setup found "
          f"{'everything cached' if state == 'warm' else 'something to install, fetch or compile afresh'})")
    print(f"{'phase':<28} {'seconds':>8} {'budget':>8}")
    total = 0.0
    for name, seconds, failed in phases:
        total += seconds
        budget = BUDGETS.get(name, (None, None))[column]
        mark = ""
        if failed:
            mark = "  (stopped by a failure)"
        elif budget is not None and seconds > budget:
            mark = "  OVER BUDGET"
            over.append((name, seconds, budget))
        print(f"{name:<28} {seconds:8.0f} {budget if budget is not None else '-':>8}{mark}")
    total_budget = TOTAL_BUDGET[state]
    print(f"{'total':<28} {total:8.0f} {total_budget:8d}  ({minutes(total)} of {minutes(total_budget)})")

    for spec in args.suite:
        label, _, path = spec.partition("=")
        cases = read_junit(path)
        if not cases:
            continue
        cases.sort(reverse=True)
        print(f"\n== {label}: {len(cases)} tests, {sum(c[0] for c in cases):.0f} s of test time; "
              f"the {min(args.slowest, len(cases))} slowest")
        for seconds, name, status in cases[: args.slowest]:
            print(f"{seconds:8.1f} s  {name}{'' if status == 'run' else '  (' + status + ')'}")

    print()
    for name, seconds, budget in over:
        print(f"WARNING: CI phase '{name}' took {seconds:.0f} s, over its {state} budget of {budget} s "
              f"(tests/README.md, 'CI time budget')")
    if total > total_budget:
        print(f"WARNING: the whole CI run took {minutes(total)}, over the {state} budget of {minutes(total_budget)}")
    if not over and total <= total_budget:
        print(f"CI time: every phase within its {state} budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
