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


def _named_files() -> set[str]:
    """Every ``.py`` file the section names, relative to ``minivllm/``."""
    section = re.search(r"## Follow one decode step\n(.*?)\n## ", PAGE.read_text(), re.S)
    names = re.findall(r"`(?:minivllm/)?([\w/]+\.py)(?::[\w.]+)?`", section.group(1))
    return set(names)


def test_a_traced_decode_step_follows_the_page(tiny_model_dir, backend_spec) -> None:
    """One real decode step on the CPU with the fast backend (the page's path), traced
    with ``sys.setprofile``: every minivllm module it enters is named on the page, and
    every numbered Python hop below the loop (2 on) is entered."""
    import os
    import sys

    from minivllm import LLM, SamplingParams
    from minivllm.fast import cpu_ops

    if backend_spec != "fast":
        pytest.skip("the page maps the fast backend's path: traced once, under --backend=fast")
    if not cpu_ops.available():
        pytest.skip("the C++ ops are not built: the page's path needs them")
    llm = LLM(str(tiny_model_dir("llama")), backend="fast", device="cpu", dtype="float32",
              max_model_len=128)
    engine = llm.llm_engine
    engine.add_request(None, [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0))
    engine.step()  # the prefill
    engine.step()  # a first decode step: what is built once is built
    root = os.path.dirname(sys.modules["minivllm"].__file__)
    entered: dict[str, set[str]] = {}

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            path = os.path.relpath(frame.f_code.co_filename, root).replace(os.sep, "/")
            entered.setdefault(path, set()).add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        outputs = engine.step()
    finally:
        sys.setprofile(None)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 3  # a decode step
    unnamed = sorted(set(entered) - _named_files())
    assert not unnamed, f"the step entered modules the page does not name: {unnamed}"
    missed = [f"{path}:{name}" for path, name in hops(numbered_only=True)
              if path.endswith(".py") and path != "minivllm/llm.py"
              and name not in entered.get(path.removeprefix("minivllm/"), set())]
    assert not missed, f"numbered hops the step did not enter: {missed}"


#: A ``Request``'s state: the attributes that change while it lives.
REQUEST_STATE = frozenset({"output_token_ids", "all_token_ids", "num_computed_tokens",
                           "num_cached_tokens", "status", "stop_reason", "num_preemptions",
                           "block_hashes", "spec_token_ids", "max_tokens"})
#: Modules that write those names on something that is not a live engine request.
NOT_A_REQUEST = {
    "request.py": "the Request's own methods (check_stop, run by update_from_output)",
    "bench/_soak.py": "SoakResult.status",
    "bench/sharing.py": "a benchmark that drives a scheduler by hand, with its own requests",
    "engine/async_stream.py": "a stream delta's stop_reason",
    "worker/sampling.py": "the sampling worker's own copy of a request (CachedRequestState)",
}
#: Who changes a live Request today, as docs/architecture.md says.
REQUEST_WRITERS = {"ref/scheduler.py", "scheduler_groups.py"}


def _writes_request_state(tree: ast.AST) -> bool:
    """True if the module assigns one of :data:`REQUEST_STATE` on an object other than
    ``self``, calls ``append_output_token_ids``, or edits such a list in place."""
    def foreign(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr in REQUEST_STATE
                and not (isinstance(node.value, ast.Name) and node.value.id == "self"))

    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if any(foreign(t) for target in targets for t in ast.walk(target)):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "append_output_token_ids" or (
                    node.func.attr in ("append", "extend", "clear", "pop", "insert")
                    and foreign(node.func.value)):
                return True
    return False


def test_the_page_names_who_changes_a_request() -> None:
    root = ROOT / "minivllm"
    writers = {str(f.relative_to(root)).replace("\\", "/") for f in root.rglob("*.py")
               if _writes_request_state(ast.parse(f.read_text()))}
    assert writers - set(NOT_A_REQUEST) == REQUEST_WRITERS, (
        "the modules that change a live Request are not the ones docs/architecture.md "
        "names: update the page and REQUEST_WRITERS together")
    page = PAGE.read_text()
    assert all(f"`{w}`" in page for w in REQUEST_WRITERS)


def test_the_request_scan_sees_each_kind_of_write() -> None:
    for source, writes in [("req.status = 1", True), ("self.status = 1", False),
                           ("r.num_computed_tokens += 4", True),
                           ("r.append_output_token_ids(3)", True),
                           ("r.spec_token_ids.clear()", True), ("x = r.status", False),
                           ("r.prompt_token_ids = []", False)]:
        assert _writes_request_state(ast.parse(source)) is writes, source
