"""The kernel swap layer: selection forms, fallbacks, and twin API parity."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import types

import pytest

from minivllm import backend


def _public_api(mod: types.ModuleType, also_from: str | None = None) -> dict[str, object]:
    """Public functions and classes *defined* in ``mod`` (not imported into it).

    ``also_from``: a module whose definitions count as ``mod``'s too (a fast
    twin re-exports what it takes from the ref unchanged).
    """
    names = getattr(mod, "__all__", None)
    if names is None:
        owners = {mod.__name__, also_from}
        names = [n for n, obj in vars(mod).items()
                 if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                 and getattr(obj, "__module__", None) in owners]
    return {n: getattr(mod, n) for n in names}


def _signature(obj: object) -> dict[str, str]:
    """Signature of a function, or of a class's __init__ and public methods."""
    if inspect.isclass(obj):
        sigs = {}
        for name, member in inspect.getmembers(obj):
            if name == "__init__" or (not name.startswith("_") and callable(member)):
                try:
                    sigs[name] = str(inspect.signature(member))
                except (TypeError, ValueError):
                    pass
        return sigs
    return {"__call__": str(inspect.signature(obj))}


@pytest.mark.parametrize("component", sorted(backend.COMPONENTS))
def test_twins_expose_the_same_api(component: str) -> None:
    ref = importlib.import_module(f"minivllm.ref.{component}")
    fast = importlib.import_module(f"minivllm.fast.{component}")
    ref_api, fast_api = _public_api(ref), _public_api(fast, also_from=ref.__name__)
    assert sorted(ref_api) == sorted(fast_api), f"{component}: public names differ"
    for name in ref_api:
        if not callable(ref_api[name]):  # a constant in __all__ (METHODS, a group size)
            assert ref_api[name] == fast_api[name], f"{component}.{name}: values differ"
            continue
        assert _signature(ref_api[name]) == _signature(fast_api[name]), (
            f"{component}.{name}: signatures differ"
        )


#: fast/ modules that are neither twins nor one component's helper, and why.
FAST_SHARED_MODULES = {
    "cpu": "import-path backend: every kernel component's C++ path (minivllm.fast.cpu)",
    "triton": "import-path backend: every kernel component's Triton path (minivllm.fast.triton)",
    "cpu_ops": "builds and loads the C++ ops every kernel component's CPU path calls",
    "cpp_build": "the one build lock every C++ build takes (the ops, a course task, a "
                 "student's csrc/, tutorial 07)",
}


def test_every_twin_pair_is_a_registered_component() -> None:
    """A module in both ref/ and fast/ is a component (so the test above covers it); a
    fast-only module is a helper of one, named ``<component>_<part>``, private
    (``_x``), or one of the few listed shared modules."""
    import pkgutil

    import minivllm.fast
    import minivllm.ref

    ref = {m.name for m in pkgutil.iter_modules(minivllm.ref.__path__)}
    fast = {m.name for m in pkgutil.iter_modules(minivllm.fast.__path__)}
    assert ref == set(backend.COMPONENTS), "every ref module is a registered component"
    for name in fast - ref - set(FAST_SHARED_MODULES):
        assert name.startswith("_") or any(name.startswith(f"{c}_") for c in backend.COMPONENTS), (
            f"minivllm/fast/{name}.py has no ref twin and is no component's helper")


@pytest.mark.parametrize("path", ["minivllm.fast.cpu", "minivllm.fast.triton"])
def test_explicit_kernel_paths_provide_every_kernel_component(path: str) -> None:
    """``--backend=minivllm.fast.cpu|triton`` must serve every kernel component itself
    (a missing one would silently come from the ref)."""
    import importlib

    pkg = importlib.import_module(path)
    kernels = [c for c, kind in backend.COMPONENTS.items() if kind == "kernel"]
    missing = [c for c in kernels if getattr(pkg, c, None) is None]
    assert not missing, f"{path} lacks {missing}"


def test_global_and_context_manager() -> None:
    old = backend.get_backend()
    try:
        backend.set_backend("ref")
        assert backend.get("scheduler").__name__ == "minivllm.ref.scheduler"
        with backend.use_backend("fast"):
            assert backend.get("scheduler").__name__ == "minivllm.fast.scheduler"
        assert backend.get("scheduler").__name__ == "minivllm.ref.scheduler"
    finally:
        backend.set_backend(old)


def test_per_component_dict() -> None:
    spec = {"scheduler": "fast", "block_allocator": "ref"}
    assert backend.get("scheduler", spec).__name__ == "minivllm.fast.scheduler"
    assert backend.get("block_allocator", spec).__name__ == "minivllm.ref.block_allocator"


def test_auto_prefers_fast_host_components() -> None:
    assert backend.resolve("block_table", "auto") == "fast"
    expected = "fast" if backend.fast_kernels_unavailable() is None else "ref"
    assert backend.resolve("attention", "auto") == expected


def test_import_path_overrides_only_what_it_provides(tmp_path, monkeypatch,
                                                     tiny_model_dir) -> None:
    pkg = tmp_path / "student_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "activation.py").write_text(textwrap.dedent("""
        import torch
        CALLS = []
        def silu_and_mul(x):
            CALLS.append(tuple(x.shape))
            gate, up = x.chunk(2, dim=-1)
            return torch.sigmoid(gate) * gate * up
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    act = backend.get("activation", "student_kernels")
    assert act.__name__ == "student_kernels.activation"
    assert backend.get("attention", "student_kernels").__name__ == "minivllm.ref.attention"
    # The engine really routes through the student's module: the spy sees one call per
    # layer per forward step, with the step's tokens, and the tokens match the ref's.
    from minivllm import LLM, SamplingParams

    path, prompt = str(tiny_model_dir("llama")), list(range(5, 12))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def tokens(spec: str) -> list[int]:
        llm = LLM(path, backend=spec, dtype="float32", device="cpu", max_model_len=64)
        return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0] \
            .outputs[0].token_ids

    assert tokens("student_kernels") == tokens("ref")
    inter2 = 2 * 96  # the tiny llama's 2 * intermediate_size
    # 2 layers x 3 forward steps: the prompt, then two decodes (the last token needs none).
    assert act.CALLS == [(len(prompt), inter2)] * 2 + [(1, inter2)] * 4


def test_bad_specs_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown component"):
        backend.get("attn")
    with pytest.raises(ValueError, match="could not be imported"):
        backend.get("attention", "no_such_package_xyz")
    with pytest.raises(ValueError, match="unknown component"):
        backend.set_backend({"not_a_component": "fast"})
    with pytest.raises(ValueError):
        backend.set_backend("")


def test_env_var_sets_the_default() -> None:
    code = "from minivllm import backend; print(backend.get_backend())"
    env = dict(os.environ, MINIVLLM_BACKEND="fast")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "fast"


def test_fast_kernels_fall_back_with_a_warning_when_they_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(backend, "fast_kernels_unavailable", lambda: "no compiler")
    monkeypatch.setattr(backend, "_warned", set())
    with pytest.warns(UserWarning, match="using the ref implementation"):
        mod = backend.get("layernorm", "fast")
    assert mod.__name__ == "minivllm.ref.layernorm"


def _write_spy_package(root, name: str) -> None:
    """A package serving activation, sampler and block_allocator that records its use."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "activation.py").write_text(textwrap.dedent("""
        from minivllm.ref import activation as _ref
        CALLS = []
        def silu_and_mul(x):
            CALLS.append(x.shape[0])
            return _ref.silu_and_mul(x)
    """))
    (pkg / "sampler.py").write_text(textwrap.dedent("""
        from minivllm.ref import sampler as _ref
        CALLS = []
        def sample(logits, metadata):
            CALLS.append(logits.shape[0])
            return _ref.sample(logits, metadata)
    """))
    (pkg / "block_allocator.py").write_text(textwrap.dedent("""
        from minivllm.ref.block_allocator import BlockAllocator as _Ref
        MADE = []
        class BlockAllocator(_Ref):
            def __init__(self, *args, **kwargs):
                MADE.append(args)
                super().__init__(*args, **kwargs)
    """))


def test_components_are_resolved_once_into_a_frozen_record() -> None:
    import dataclasses

    comps = backend.Components.resolve("ref")
    assert set(comps.modules) == set(backend.COMPONENTS) == set(comps.impls)
    assert comps.attention is comps.get("attention") is backend.get("attention", "ref")
    with pytest.raises(AttributeError, match="no component"):
        comps.attn  # noqa: B018
    with pytest.raises(ValueError, match="unknown component"):
        comps.get("attn")
    with pytest.raises(dataclasses.FrozenInstanceError):
        comps.spec = "fast"
    with pytest.raises(TypeError):
        comps.modules["attention"] = None  # read-only mapping
    # A dict's gaps are filled from the global spec once, when it is resolved.
    with backend.use_backend("ref"):
        mixed = backend.Components.resolve({"scheduler": "fast"})
    assert mixed.impls["scheduler"] == "fast" and mixed.impls["block_allocator"] == "ref"
    import pickle

    again = pickle.loads(pickle.dumps(mixed))  # what a tensor-parallel worker receives
    assert dict(again.impls) == dict(mixed.impls) and again.scheduler is mixed.scheduler


def test_two_engines_with_different_backends_in_one_process(tmp_path, monkeypatch,
                                                            tiny_model_dir) -> None:
    import threading

    from minivllm import LLM, SamplingParams

    for name in ("spy_a", "spy_b"):
        _write_spy_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    spy = {n: importlib.import_module(f"{n}.activation") for n in ("spy_a", "spy_b")}
    samplers = {n: importlib.import_module(f"{n}.sampler") for n in ("spy_a", "spy_b")}
    allocs = {n: importlib.import_module(f"{n}.block_allocator") for n in ("spy_a", "spy_b")}
    path = str(tiny_model_dir("llama"))
    llms: dict[str, LLM] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def build(name: str) -> None:
        try:
            llms[name] = LLM(path, backend=name, dtype="float32", device="cpu",
                             max_model_len=64)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    def flip_global() -> None:
        # Someone else changes the process-global spec all the time: no engine may care.
        old = backend.get_backend()
        while not stop.is_set():
            for spec in ("ref", "spy_b", "spy_a"):
                backend.set_backend(spec)
        backend.set_backend(old)

    threads = [threading.Thread(target=build, args=(n,)) for n in ("spy_a", "spy_b")]
    flipper = threading.Thread(target=flip_global)
    flipper.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    flipper.join()
    assert not errors, errors
    assert len(allocs["spy_a"].MADE) == len(allocs["spy_b"].MADE) == 1
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(5, 12))}
    answers = {}
    for name, other in (("spy_a", "spy_b"), ("spy_b", "spy_a")):
        engine = llms[name].llm_engine
        assert engine.components.activation is spy[name]
        assert type(engine.scheduler.block_allocator) is allocs[name].BlockAllocator
        layer = engine.executor.worker.model.model.layers[0]
        assert layer.mlp.ops_act is spy[name]
        assert layer.self_attn.ops_attn.__name__ == "minivllm.ref.attention"  # the fallback
        before = (len(spy[other].CALLS), len(samplers[other].CALLS))
        n_act, n_samp = len(spy[name].CALLS), len(samplers[name].CALLS)
        out = llms[name].generate(prompt, params, use_tqdm=False)[0]
        answers[name] = out.outputs[0].token_ids
        # 2 layers x 3 forward steps through this engine's spy, none through the other's.
        assert len(spy[name].CALLS) - n_act == 6 and len(samplers[name].CALLS) - n_samp == 3
        assert (len(spy[other].CALLS), len(samplers[other].CALLS)) == before
    assert answers["spy_a"] == answers["spy_b"]  # both are the ref's arithmetic
