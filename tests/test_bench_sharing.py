"""The sharing simulation (``python -m minivllm.bench sharing``) against independent counts.

Parallel sampling has a closed form: once every completion has written its
first token, the prompt's full blocks are held once and each completion holds
the rest of its own blocks (its copy of the partial prompt block included).
Beam search is checked for consistency: the pool holds exactly the distinct
blocks of the live beams' tables, never more than without sharing, and one
beam saves nothing.
"""

from __future__ import annotations

import json

import pytest

from minivllm.bench import _sharing_e2e as sharing_e2e
from minivllm.bench import sharing
from minivllm.config import cdiv


@pytest.mark.parametrize("prompt_len, lens, bs", [
    (19, [30, 58, 44, 71], 16), (17, [9, 9, 2], 4), (8, [5, 12], 4), (1, [3, 1, 4, 1, 5], 3)])
def test_parallel_sampling_matches_the_closed_form(prompt_len, lens, bs):
    run = sharing.parallel_sampling(prompt_len, lens, bs)
    assert run.blocks_shared[0] == cdiv(prompt_len, bs)  # the prefill, alone
    shared_full = prompt_len // bs
    for t in range(1, len(run.blocks_shared)):
        # Decode step t computes token prompt_len + t of each completion still going.
        live = [prompt_len + t for n in lens if t <= n]
        expected = shared_full + sum(cdiv(x, bs) - shared_full for x in live)
        assert run.blocks_shared[t] == expected, f"step {t}"
        assert run.blocks_unshared[t] == sum(cdiv(x, bs) for x in live)
    # One copy per completion but the last writer, if the prompt ends inside a block.
    assert run.num_copies == (len(lens) - 1 if prompt_len % bs else 0)


@pytest.mark.parametrize("width, bs, seed", [(1, 4, 0), (2, 16, 1), (4, 3, 2), (6, 5, 3)])
def test_beam_search_holds_exactly_its_beams_blocks(width, bs, seed):
    run = sharing.beam_search(13, width, 25, bs, seed)
    for shared, unshared, table in zip(run.blocks_shared, run.blocks_unshared, run.tables):
        assert shared == len({b for blocks in table.values() for b in blocks})
        assert shared <= unshared
        assert len(table) <= width
    if width == 1:
        assert run.blocks_shared == run.blocks_unshared and run.num_copies == 0
    else:
        assert run.saving > 0


def test_cli_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sharing.json"
    assert sharing.main(["--simulate", "--prompt-len", "9", "--output-len", "12", "--block-size", "4",
                         "--widths", "1", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["width"]) for r in rows] == [
        ("parallel", 1), ("beam", 1), ("parallel", 3), ("beam", 3)]
    assert rows[0]["saving"] == 0 and "peak saving" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(ValueError, match="prompt_len"):
        sharing.parallel_sampling(0, [3])
    with pytest.raises(ValueError, match="width"):
        sharing.beam_search(5, 0, 3)


def test_engine_run_on_a_tiny_model(tiny_model_dir, capsys):
    """The engine mode end to end (tiny sizes): every row, and the beams agree with the
    one-token-requests search; sharing holds fewer blocks than independent requests."""
    rows = sharing_e2e.run(str(tiny_model_dir("llama")), prompt_len=40, output_len=6,
                           widths=[3], beam_widths=[2], backend="ref", dtype="float32",
                           block_size=8)
    out = capsys.readouterr().out
    assert "best sequence equals" in out and "37.6-55.2%" in out
    by_mode = {(r["kind"], r["mode"]): r for r in rows}
    shared, alone = by_mode[("parallel", "shared")], by_mode[("parallel", "independent")]
    assert shared["tokens"] == alone["tokens"] == 18
    assert shared["peak_blocks"] == 5 + 3 * 1  # 5 prompt blocks shared, 1 own block each
    assert alone["peak_blocks"] == 3 * 6
    assert by_mode[("beam", "shared")]["tokens"] == 12
