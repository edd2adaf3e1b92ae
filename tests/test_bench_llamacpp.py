"""``minivllm bench throughput --compare llamacpp`` without the optional extra installed."""

from __future__ import annotations

import sys

import pytest

from minivllm.bench import llamacpp


def test_missing_binding_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(SystemExit, match=r"\[llamacpp\]"):
        llamacpp.require_llama_cpp()


def test_find_gguf_reports_where_it_looked(tmp_path):
    with pytest.raises(SystemExit, match="no.*gguf|gguf.*none"):
        llamacpp.find_gguf(str(tmp_path), tmp_path)
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"GGUF")
    assert llamacpp.find_gguf(str(tmp_path), tmp_path).name == "model.Q4_1.gguf"
