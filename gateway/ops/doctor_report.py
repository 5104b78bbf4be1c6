"""The doctor's findings and how they are rendered.

Contract: a check (``doctor``, ``doctor_fs``) returns a list of ``Finding``: ``check`` names
what was checked (an indented name is a sub-check of the line above), ``level`` is one of OK,
WARN, FAIL, SKIP, ``found`` says what was seen, ``fix`` what to do (shown for WARN and FAIL
only). ``report`` renders findings in the order given, one line each plus a fix line, and a
closing summary; ``exit_code`` is 0 when nothing is WARN or FAIL, 1 with any FAIL, 2 with
warnings only. Nothing here looks at the host.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"


@dataclasses.dataclass
class Finding:
    check: str
    level: str
    found: str
    fix: str = ""


def exit_code(findings: Iterable[Finding]) -> int:
    levels = {f.level for f in findings}
    return 1 if FAIL in levels else 2 if WARN in levels else 0


def report(findings: list[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{f.level:<5} {f.check:<14} {f.found}")
        if f.fix and f.level in (WARN, FAIL):
            lines.append(f"{'':<5} {'':<14} fix: {f.fix}")
    fails = sum(f.level == FAIL for f in findings)
    warns = sum(f.level == WARN for f in findings)
    lines.append("all is well" if not fails and not warns else
                 f"{fails} problem(s), {warns} warning(s): fix the FAIL lines before the engine starts")
    return "\n".join(lines)
