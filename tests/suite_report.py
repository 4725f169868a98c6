"""What ``make test`` prints after a suite that did not pass, read from the suite's log: the
last lines of the log can hold only a native crash's trace, and CI shows only the end.

Printed, a few KB at most: the test files that were running (the last progress lines), the
short summary's ``FAILED``/``ERROR`` lines, the 15 slowest (``--durations``), and, after a fatal signal (``PYTHONFAULTHANDLER``'s
report), each Python thread's frames without the native ones (Monarch's Rust frames fill
screens).

Usage: ``python tests/suite_report.py LOG STATUS``.
"""

from __future__ import annotations

import re
import sys


def report(text: str, status: int) -> str:
    """The report of a suite's log ``text`` (pytest's output, faulthandler's included) whose
    process ended with ``status`` (a shell's: ``128 + N`` for signal ``N``): at most ~100
    lines."""
    lines = text.splitlines()
    out = [f"== the suite ended with status {status}"
           + (f" (killed by signal {status - 128})" if status > 128 else "")]
    progress = [line for line in lines if re.match(r"tests/\S+\.py(::\S+)? ", line)]
    if progress:
        out.append("last progress lines:")
        out += ["  " + line[:160] for line in progress[-3:]]
    failed = [line for line in lines if re.match(r"(FAILED|ERROR) tests/", line)]
    if failed:
        out.append(f"failed ({len(failed)}):")
        out += ["  " + line[:200] for line in failed[:30]]
    slowest = next((i for i, line in enumerate(lines) if "slowest" in line and "durations"
                    in line), None)
    if slowest is not None:  # pytest --durations: where the suite's time went
        out.append("slowest:")
        out += ["  " + line[:160] for line in lines[slowest + 1 : slowest + 16]
                if re.match(r"\d+\.\d+s ", line)]
    start = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    if start is not None:
        out.append("the fatal error, Python frames only (pytest's own left out):")
        for line in lines[start : start + 600]:
            if line.startswith(("Thread 0x", "Current thread")) or "Fatal Python error" in line:
                out.append("  " + line.strip()[:200])
            elif (re.match(r'\s+File "[^<].*\.py", line \d+', line)
                    and not re.search(r"/(_pytest|pluggy)/", line)):
                out.append("    " + line.strip()[:200])
        out = out[:100]
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1], errors="replace") as f:
        print(report(f.read(), int(sys.argv[2])))
