"""The kernel swap layer: choose an implementation for each component.

Every component of minivllm exists twice, as a readable reference in
``minivllm/ref/<component>.py`` and as an optimised twin in
``minivllm/fast/<component>.py``. Both modules expose the same public names
with the same signatures (``tests/test_backend.py`` checks it), so the rest of
the engine never knows which one it is talking to::

    from minivllm import backend
    attn = backend.get("attention")          # a module: ref or fast
    attn.paged_attention(q, k_cache, v_cache, metadata, scale)

A *backend spec* says which implementation to use:

- ``"ref"`` / ``"fast"``: every component from that package.
- ``"auto"``: fast where it runs natively, ref otherwise. Host-side components
  (allocator, KV cache manager, scheduler, block tables) are plain
  Python/torch and always run fast. Kernel components are fast on CUDA with
  Triton, and on a CPU where the C++ ops (``minivllm/fast/csrc``, built on
  first use) compiled.
  ``fast`` means the best native kernels for the tensor's device: the Triton
  kernels on CUDA, the C++ ops on a CPU. ``"minivllm.fast.triton"`` and
  ``"minivllm.fast.cpu"`` (import paths, below) pick one of the two
  explicitly, e.g. the Triton kernels on a CPU in Triton's interpreter.
- an import path such as ``"mypkg.my_kernels"``: a package or module that
  provides *some* components, as submodules or attributes named after them
  (``mypkg.my_kernels.attention``). Those override the default; the others
  come from ``ref``, with a warning naming them. This is how course
  assignments plug students' code in (see ``docs/course/``).
- a dict mapping component names to any of the above, e.g.
  ``{"attention": "fast", "scheduler": "ref"}``; unnamed components use the
  global default.

The global default is ``"auto"``, or the ``MINIVLLM_BACKEND`` environment
variable. Change it with :func:`set_backend`, or temporarily with
:func:`use_backend` as a context manager.

**One choice per engine.** The engine does not read the global spec while it
builds itself: it resolves its spec ONCE into a frozen :class:`Components`
record (component name -> module) and hands that record down, explicitly,
to everything it builds (scheduler, KV cache manager, block allocator,
worker and block tables, model layers, sampler, tensor-parallel workers)::

    components = backend.Components.resolve("fast")   # or a dict, a path, None
    components.attention                               # the module, by attribute
    components.get("sampler")                          # or by name
    components.impls["attention"]                      # "fast", "ref" or a path

So two engines with different backends live side by side in one process
(also when built from two threads at once). Classes built directly (tests,
benchmarks) without a record resolve the global spec once, at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import types
import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

#: Every component of the engine, in data-flow order. ``kind`` says whether a
#: component is host-side Python (runs anywhere) or a device kernel (its fast
#: twin is a Triton kernel on CUDA and a C++ op on a CPU).
COMPONENTS: Mapping[str, str] = MappingProxyType({
    "block_allocator": "host",
    "kv_cache_manager": "host",
    "scheduler": "host",
    "block_table": "host",
    "linear": "host",
    "quantization": "kernel",
    "cache_write": "kernel",
    "attention": "kernel",
    "layernorm": "kernel",
    "rotary": "kernel",
    "activation": "kernel",
    "model_runner": "host",
    "structured_output": "host",
    "lora": "kernel",
    "logits_processors": "host",
    "sampler": "host",
    "rejection_sampler": "host",
    "ngram_proposer": "host",
})

BUILTIN = ("ref", "fast", "auto")

BackendSpec = str | Mapping[str, str]

_global_spec: BackendSpec = os.environ.get("MINIVLLM_BACKEND", "auto")
_cache: dict[tuple[str, str], types.ModuleType] = {}
_warned: set[str] = set()


def _check_component(name: str) -> None:
    if name not in COMPONENTS:
        raise ValueError(
            f"unknown component {name!r}; the components are {sorted(COMPONENTS)}"
        )


def validate_spec(spec: BackendSpec) -> BackendSpec:
    """Raise ``ValueError`` if ``spec`` is not a valid backend spec; return it."""
    if isinstance(spec, Mapping):
        for name, sub in spec.items():
            _check_component(name)
            if not isinstance(sub, str) or isinstance(sub, Mapping):
                raise ValueError(f"backend for {name!r} must be a string, got {sub!r}")
        return dict(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"backend must be 'ref', 'fast', 'auto', an import path or a dict, got {spec!r}"
        )
    return spec


def set_backend(spec: BackendSpec) -> None:
    """Set the global backend spec (see the module docstring for the forms)."""
    global _global_spec
    _global_spec = validate_spec(spec)


def get_backend() -> BackendSpec:
    """The global backend spec now in force."""
    return _global_spec


@contextlib.contextmanager
def use_backend(spec: BackendSpec) -> Iterator[None]:
    """Context manager: use ``spec`` inside the ``with`` block, then restore."""
    global _global_spec
    old = _global_spec
    set_backend(spec)
    try:
        yield
    finally:
        _global_spec = old


def triton_available() -> bool:
    """True if Triton imports (it has no wheels off Linux)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    """True if Triton kernels will run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fast_kernels_unavailable() -> str | None:
    """Why the fast kernel twins cannot run on this machine's device, or None if they can.

    With CUDA they need Triton; on a CPU, the C++ ops.
    """
    import torch

    if torch.cuda.is_available():
        return None if triton_available() else "Triton is not installed"
    from minivllm.fast import cpu_ops

    why = cpu_ops.unavailable_reason()  # the first call builds the ops
    return None if why is None else f"the C++ CPU kernels are not available ({why})"


def _import_component(package: str, name: str) -> types.ModuleType | None:
    """``package.name`` as a submodule or attribute, or None if it has none."""
    key = (package, name)
    if key in _cache:
        return _cache[key]
    try:
        pkg = importlib.import_module(package)
    except ImportError as e:
        raise ValueError(f"backend {package!r} could not be imported: {e}") from e
    mod = getattr(pkg, name, None)
    if mod is None and hasattr(pkg, "__path__"):
        try:
            mod = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise  # the submodule exists but one of its imports is missing
            mod = None
    if mod is not None:
        _cache[key] = mod
    return mod


def _warn_once(why: str) -> None:
    """One warning per reason, however many components it sends to the ref."""
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"minivllm: {why}; using the ref implementation",
                      stacklevel=4)  # fmt: skip


def _fallback(name: str, why: str) -> types.ModuleType:
    _warn_once(why)
    return _import_component("minivllm.ref", name)


def resolve(name: str, spec: BackendSpec | None = None) -> str:
    """The implementation (``'ref'``, ``'fast'`` or an import path) for ``name``."""
    _check_component(name)
    spec = _global_spec if spec is None else validate_spec(spec)
    if isinstance(spec, Mapping):
        spec = spec.get(name, _global_spec if not isinstance(_global_spec, Mapping) else "ref")
        if isinstance(spec, Mapping):
            spec = "ref"
    if spec == "auto":
        if COMPONENTS[name] == "host":
            return "fast"
        why = fast_kernels_unavailable()
        if why is None:
            return "fast"
        if why.startswith("the C++"):  # a CPU expected them: say why it gets the ref
            _warn_once(why)
        return "ref"
    return spec


def get(name: str, spec: BackendSpec | None = None) -> types.ModuleType:
    """The module implementing component ``name`` under ``spec`` (default: global).

    ``fast`` kernels run natively: Triton on CUDA, the C++ ops on a CPU. If
    they cannot (no Triton with CUDA; the C++ build failed on a CPU), the ref
    twin is used and one warning says why. The Triton kernels on a CPU, in
    Triton's interpreter, are the import path ``minivllm.fast.triton``.
    """
    impl = resolve(name, spec)
    if impl == "ref":
        return _import_component("minivllm.ref", name)
    if impl == "fast":
        if COMPONENTS[name] == "kernel":
            missing = fast_kernels_unavailable()
            if missing is not None:
                return _fallback(name, missing)
        mod = _import_component("minivllm.fast", name)
        return mod if mod is not None else _fallback(name, f"{name} has no fast twin yet")
    mod = _import_component(impl, name)
    if mod is None:
        return _fallback(name, f"{impl!r} has no submodule or attribute {name!r}")
    return mod


def provides(package: str, name: str) -> bool:
    """True if import path ``package`` itself serves component ``name`` (no fallback)."""
    _check_component(name)
    return _import_component(package, name) is not None


def provider_name(obj: object) -> str:
    """A readable name for whatever serves a component: a module, a class, any object."""
    name = getattr(obj, "__name__", None)
    if isinstance(name, str):
        return name
    return f"<{type(obj).__module__}.{type(obj).__qualname__} object>"


def describe(spec: BackendSpec | None = None) -> dict[str, str]:
    """Which module (or object) serves each component, e.g. for logging at start-up."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback is visible in the result itself
        return {name: provider_name(get(name, spec)) for name in COMPONENTS}


@dataclasses.dataclass(frozen=True)
class Components:
    """The module serving each component, resolved once: an engine's frozen record.

    Built generically from :data:`COMPONENTS`, so a component added there
    needs no edit here. Pickles as its resolved choices (``impls``), so a
    tensor-parallel worker process rebuilds exactly the same record.

    Attributes:
        spec: the spec it was resolved from (``None`` if the global one).
        impls: component name -> ``"ref"``, ``"fast"`` or an import path, with
            every ``"auto"`` and every dict gap decided (read-only).
        modules: component name -> the module (or object) serving it (read-only).
    """

    spec: Any
    impls: Mapping[str, str]
    modules: Mapping[str, Any]

    @classmethod
    def resolve(cls, spec: BackendSpec | None = None) -> Components:
        """Resolve ``spec`` (None: the global spec, read once now) for every component."""
        spec = validate_spec(_global_spec if spec is None else spec)
        impls = {name: resolve(name, spec) for name in COMPONENTS}
        # The decided names, not the spec: a dict's gaps were filled from the
        # global spec just now, and must not be read again later.
        modules = {name: get(name, impl) for name, impl in impls.items()}
        return cls(spec, types.MappingProxyType(impls), types.MappingProxyType(modules))

    def get(self, name: str) -> Any:
        """The module serving component ``name``."""
        _check_component(name)
        return self.modules[name]

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not fields: `components.attention`.
        modules = self.__dict__.get("modules")
        if modules is not None and name in modules:
            return modules[name]
        raise AttributeError(f"{type(self).__name__} has no component {name!r}; "
                             f"the components are {sorted(COMPONENTS)}")

    def describe(self) -> dict[str, str]:
        """Which module (or object) serves each component, e.g. for logging."""
        return {name: provider_name(mod) for name, mod in self.modules.items()}

    def __reduce__(self):
        return (_components_from_impls, (dict(self.impls),))

    def __repr__(self) -> str:
        return f"Components({dict(self.impls)})"


def _components_from_impls(impls: dict[str, str]) -> Components:
    return Components.resolve(impls)


def as_components(spec: Components | BackendSpec | None = None) -> Components:
    """``spec`` if it is a :class:`Components` record already, else resolved now.

    None resolves the global spec: what classes built directly (tests,
    benchmarks) without an engine's record fall back to, once, at construction.
    """
    return spec if isinstance(spec, Components) else Components.resolve(spec)
