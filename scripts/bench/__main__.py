"""`python -m scripts.bench`: list the benchmarks, each with the first paragraph of its
docstring (read from the source, so listing imports none of them)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    print("Run from the repository root: .venv/bin/python -m scripts.bench.NAME [--help]")
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        print(textwrap.fill(summary, 100, initial_indent=f"  {path.stem:23} ",
                            subsequent_indent=" " * 26))


if __name__ == "__main__":
    main()
