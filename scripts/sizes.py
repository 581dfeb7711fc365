"""The size rule of the house (issue 43): no function over 60 lines in core/, daemon/,
history/, client/, and no class over 300 lines in daemon/ and client/.

    .venv/bin/python scripts/sizes.py [package ...]   # default: core daemon history client
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
CLASS_RULE = ("daemon", "client")  # the packages whose classes are bounded too


def oversized(package: str) -> list[str]:
    """Each function (and, where the rule holds, class) over its bound, as ``path:line: what``."""
    found = []
    for path in sorted(Path(package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                if package in CLASS_RULE and lines > MAX_CLASS_LINES:
                    found.append(f"{path}:{node.lineno}: class {node.name} is {lines} lines")
            elif lines > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno}: function {node.name} is {lines} lines")
    return found


def main(packages: list[str]) -> int:
    found = [line for package in packages for line in oversized(package)]
    print("\n".join([*found, f"{len(found)} over the limits in {', '.join(packages)}"]))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["core", "daemon", "history", "client"]))
