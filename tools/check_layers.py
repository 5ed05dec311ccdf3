#!/usr/bin/env python3
"""Check the dependency rule of ARCHITECTURE §2 by reading imports (no code is executed).

- ``scheduling`` imports nothing from the other packages and no I/O, clock or thread modules;
- ``transport`` never imports torch;
- only ``integrations`` (and ``bench``/``tests``/``tools``) may import torch;
- nothing in the packages imports ``bench`` or ``tools``;
- package code has no ``print(`` (output goes through the CLI's one place).

Usage: ``python tools/check_layers.py [ROOT]``; exits 1 and lists every violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGES = ("scheduling", "transport", "integrations")

#: package -> top-level modules it must not import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "scheduling": frozenset({
        "transport", "integrations", "bench", "tools", "torch", "socket", "asyncio", "uvloop",
        "zmq", "threading", "time", "selectors",
    }),
    "transport": frozenset({"torch", "integrations", "bench", "tools"}),
    "integrations": frozenset({"bench", "tools"}),
}  # fmt: skip

#: Files allowed to print (the CLI's single output point).
PRINT_ALLOWED = frozenset({"integrations/cli.py"})


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations(root: Path) -> list[str]:
    """Every breach of the rules above under ``root``."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            for line, module in imported_modules(tree):
                if module in FORBIDDEN[package]:
                    out.append(f"{rel}:{line}: {package}/ must not import {module}")
            if rel not in PRINT_ALLOWED:
                for node in ast.walk(tree):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Name)
                        and node.func.id == "print"
                    ):
                        out.append(f"{rel}:{node.lineno}: print() in package code")
    return out


def main(argv: list[str]) -> int:
    """Print the violations; exit status 1 when there are any."""
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    found = violations(root)
    for line in found:
        sys.stdout.write(line + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
