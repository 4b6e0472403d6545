"""No dead code at the top level of the package: every public function and class is used somewhere.

A public top-level name of ``metainfer_gen`` must appear in code (a name token, or a string that is exactly the name
or ends a ``"module:function"`` reference; not in a comment or docstring) at least once more in the repository's
Python files (the package, tests, benchmarks, demo_models) than its own definition: a call, an import, a lazy
export string or a test. Names nobody uses are deleted, not kept "in case". Methods are not checked (hooks and
protocols are called by name from outside). This file names no package function, so it counts for none.
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
FOLDERS = ("metainfer_gen", "tests", "benchmarks", "demo_models")


def _python_files() -> list[Path]:
    return [p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")]


def _public_definitions(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]


def _code_words(path: Path) -> list[str]:
    """Names in the code of ``path``, and strings that are exactly a name or a ``"module:function"`` reference
    (lazy-export keys, registries); comments and docstrings count for nothing."""
    found = []
    with path.open("rb") as source:
        for token in tokenize.tokenize(source.readline):
            if token.type == tokenize.NAME:
                found.append(token.string)
            elif token.type == tokenize.STRING:
                text = token.string.strip("\"'")
                if IDENTIFIER.fullmatch(text):
                    found.append(text)
                elif ":" in text and IDENTIFIER.fullmatch(text.rpartition(":")[2]):
                    found.append(text.rpartition(":")[2])
    return found


def test_every_public_top_level_function_and_class_is_used():
    files = _python_files()
    words: dict[str, int] = {}
    for path in files:
        for word in _code_words(path):
            words[word] = words.get(word, 0) + 1
    unused = [f"{path.relative_to(REPO)}: {name}" for path in files if path.is_relative_to(REPO / "metainfer_gen")
              for name in _public_definitions(path) if words.get(name, 0) < 2]
    assert not unused, f"defined but used nowhere (delete them, or use them): {unused}"
