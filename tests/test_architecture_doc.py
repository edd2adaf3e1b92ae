"""docs/architecture.md's "Follow one decode step" names functions that exist.

Every hop is written ``path:function`` (``Class.method`` for a method); a
renamed or moved function makes the page lie, so this test fails until the
page follows the code. A ``.py`` hop is found by parsing the file; a C++ hop
by its definition in the source.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"


def hops(numbered_only: bool = False) -> list[tuple[str, str]]:
    """``(path, qualified name)`` of every hop in the section, in order (``numbered_only``:
    only the numbered list, the default CPU path; else also the other paths it names)."""
    text = PAGE.read_text()
    section = re.search(r"## Follow one decode step\n(.*?)\n## ", text, re.S)
    assert section, "docs/architecture.md has no 'Follow one decode step' section"
    body = section.group(1)
    if numbered_only:
        body = "\n".join(re.findall(r"^\d+\. .*$", body, re.M))
    found = re.findall(r"`(minivllm/[\w/]+\.(?:py|cpp)):([\w.]+)`", body)
    assert len(found) >= 12, f"expected the whole path, found {found}"
    return found


def _defined_in_python(path: Path, qualname: str) -> bool:
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                     and n.name == part), None)
        if node is None:
            return False
        scope = node.body
    return True


def _defined_in_cpp(path: Path, name: str) -> bool:
    # A definition: a return type, the name, an argument list, then a body.
    return re.search(rf"^[\w:<>]+[\s*&]+{re.escape(name)}\s*\([^;]*?\)\s*\{{", path.read_text(),
                     re.M | re.S) is not None


@pytest.mark.parametrize("path,qualname", hops())
def test_every_hop_exists(path: str, qualname: str) -> None:
    file = ROOT / path
    assert file.exists(), f"{path} does not exist"
    found = (_defined_in_python(file, qualname) if file.suffix == ".py"
             else _defined_in_cpp(file, qualname))
    assert found, f"{path} defines no {qualname}"


def test_the_page_counts_the_files_it_lists() -> None:
    """The numbered hops span at most twelve files of code, as the page says."""
    files = {path for path, _ in hops(numbered_only=True)}
    assert len(files) <= 12, sorted(files)


def test_the_checker_sees_a_missing_function(tmp_path) -> None:
    py = tmp_path / "m.py"
    py.write_text("class A:\n    def f(self): ...\n")
    assert _defined_in_python(py, "A.f") and not _defined_in_python(py, "A.g")
    cpp = tmp_path / "k.cpp"
    cpp.write_text("void decode_layers(at::Tensor& x,\n  int n) {\n}\nvoid g(int);\n")
    assert _defined_in_cpp(cpp, "decode_layers") and not _defined_in_cpp(cpp, "g")
