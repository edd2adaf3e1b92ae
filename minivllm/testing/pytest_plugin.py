"""pytest plugin: ``pytest --backend=ref|fast|auto|<import path>``.

Installed through the ``pytest11`` entry point, so any checkout with minivllm
installed gets the option. Equivalence tests are written once: they ask
``backend.get(component)`` for the implementation under test and compare it
with ``minivllm.ref`` or an independent oracle (plain torch, transformers).

Without CUDA, ``--backend=fast`` (and ``auto`` pointed at fast kernels) runs
the Triton kernels in Triton's interpreter. ``TRITON_INTERPRET=1`` must be set
before Triton is first imported, so it is set here, in ``pytest_configure``,
before any test module is collected.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default="ref",
        help="minivllm backend under test: ref (default), fast, auto, or an import path "
        "to a module providing some components (e.g. mypkg.my_kernels)",
    )


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    spec = config.getoption("--backend")
    if spec != "ref" and not _has_cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minivllm import backend
    from minivllm.testing import strategies  # noqa: F401  (registers hypothesis profiles)

    backend.set_backend(spec)
    config.addinivalue_line("markers", "cuda: needs a CUDA device")


def pytest_report_header(config: pytest.Config) -> list[str]:

    interp = " (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return [f"minivllm backend: {config.getoption('--backend')}{interp}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backend_spec(request: pytest.FixtureRequest) -> str:
    """The ``--backend`` value under test."""
    return request.config.getoption("--backend")
