"""Sphinx configuration for the minivllm book (``make docs``; see docs/about.rst).

The book is built from the sources as they are:

- ``tutorials/NN_*.py`` (percent-format scripts) are executed by sphinx-gallery into
  pages with their output, figures and .py / .ipynb downloads (generated under
  ``docs/tutorials/``, which git ignores);
- ``docs/*.md`` and the course handouts ``docs/course/*.md`` are read by myst-parser;
- the API reference (docs/api.rst) is generated from the docstrings by autodoc + napoleon.

Part I lists tutorials 01-08 and Part II every tutorial numbered 09 and above, found
when the book is built (the ``minivllm-tutorials`` directive below), so a new chapter
needs no edit here.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
TUTORIALS = ROOT / "tutorials"

# The tutorials import their sibling helper module (`from _figures import figure_path`),
# and sphinx-gallery's parallel workers are fresh processes: both need the folders on
# PYTHONPATH, not only on this process's sys.path.
for path in (ROOT, TUTORIALS):
    sys.path.insert(0, str(path))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), str(TUTORIALS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
# The PNGs the tutorials save themselves go under the build folder; the pages show the
# figures sphinx-gallery captures from the open matplotlib figures.
os.environ.setdefault("MINIVLLM_FIGURES", str(DOCS / "_build" / "tutorial-figures"))
os.environ.setdefault("MPLBACKEND", "Agg")
# Without CUDA the tutorials run the Triton kernels in Triton's interpreter; it must be
# chosen before anything imports Triton, and one process executes several tutorials.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

project = "minivllm"
author = "the minivllm authors"
copyright = "2026, the minivllm authors"  # noqa: A001 (Sphinx's name)
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx_gallery.gen_gallery",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "tutorials/*.md5", "tutorials/*.codeobj.json"]
nitpicky = False  # type hints name many torch / stdlib types that have no page here

# -- the tutorials -------------------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": str(TUTORIALS),
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/\d\d_[^/]*\.py$",  # execute every numbered tutorial
    "ignore_pattern": r"^_|__init__\.py$",  # not the helper _figures.py
    "within_subsection_order": "FileNameSortKey",
    "abort_on_example_error": False,  # run them all, then fail the build listing each
    # Each tutorial runs once, one after the other by default. sphinx-gallery can run them
    # in parallel (MINIVLLM_DOCS_JOBS=2), in joblib's loky worker processes, but there the
    # tensor-parallel chapter's worker processes fail to start (multiprocessing inherits
    # loky's start method), and the tutorials already use every core: chapter 06 starts
    # rank processes, chapter 08 a server thread and its clients.
    "parallel": int(os.environ.get("MINIVLLM_DOCS_JOBS", "1")),
    "download_all_examples": False,
    "show_signature": False,
    "remove_config_comments": True,
    "reset_modules": ("matplotlib",),
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
    "first_notebook_cell": None,
    "min_reported_time": 0,
    "capture_repr": (),
    "thumbnail_size": (400, 280),
}

# -- the markdown pages --------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# -- the API reference ---------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# -- HTML ----------------------------------------------------------------------------
html_theme = "furo"
html_title = "minivllm: the book"
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"  # without one the browser asks for /favicon.ico: a 404
html_show_sourcelink = False
html_copy_source = False
pygments_style = "sphinx"

# Every page is built from scratch by `make docs` (it removes docs/_build first), so a
# stale page can never hide a warning.


class TutorialList(SphinxDirective):
    """``.. minivllm-tutorials::`` a toctree of the tutorials numbered FIRST..LAST.

    Options ``:first:`` and ``:last:`` (inclusive; ``:last:`` defaults to 99). With no
    tutorial in the range yet, it writes the directive's content (a placeholder
    sentence) instead.
    """

    has_content = True
    option_spec = {"first": directives.nonnegative_int, "last": directives.nonnegative_int}

    def run(self) -> list[nodes.Node]:
        first, last = self.options.get("first", 1), self.options.get("last", 99)
        stems = sorted(
            p.stem
            for p in TUTORIALS.glob("[0-9][0-9]_*.py")
            if first <= int(p.name[:2]) <= last
        )
        for stem in stems:  # a new tutorial changes the part page: rebuild it
            self.env.note_dependency(str(TUTORIALS / f"{stem}.py"))
        if stems:
            lines = [".. toctree::", "   :maxdepth: 1", ""] + [f"   /tutorials/{s}" for s in stems]
        else:
            lines = list(self.content)
        node = nodes.section() if stems else nodes.container()
        self.state.nested_parse(StringList(lines, source=self.get_source_info()[0]), 0, node)
        return list(node.children)


def _gallery_index_is_not_a_chapter(app, docname: str, source: list[str]) -> None:
    """The gallery's own index lists every tutorial; the parts list them instead.

    It stays as an orphan thumbnail page (linked from Part I), without its toctree, so
    each tutorial has one parent in the book's navigation.
    """
    if docname == "tutorials/index":
        text = re.sub(r"\.\. toctree::\n   :hidden:\n\n(?:   .*\n)+", "", source[0])
        source[0] = ":orphan:\n\n" + text


def setup(app):
    app.add_directive("minivllm-tutorials", TutorialList)
    app.connect("source-read", _gallery_index_is_not_a_chapter)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
