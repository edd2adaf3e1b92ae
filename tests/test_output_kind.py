"""``RequestOutputKind``: cumulative, delta and final-only outputs of one engine.

The oracle for the deltas is the cumulative run of the same requests: the
concatenated delta texts, token ids and logprobs must equal the cumulative
run's final output exactly, also when a stop string straddles tokens (the
byte tokenizer makes every multi-character stop string straddle tokens) and
while a possible stop string is held back.
"""

from __future__ import annotations

import pytest

from minivllm import RequestOutputKind, SamplingParams
from minivllm.engine.llm_engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), device="cpu",
                                  dtype="float32", max_model_len=128, block_size=4))


def _params(kind, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 24)
    return SamplingParams(output_kind=kind, ignore_eos=True, **kw)


def _run(engine, prompts, params) -> dict[str, list]:
    """Every output the engine returns, per request, in order."""
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    seen: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
    return [seen[i] for i in ids]


PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def _stops_from(text: str) -> list[str]:
    """Stop strings cut from the middle of an unstopped text: they will match, across tokens."""
    mid = len(text) // 2
    return [text[mid : mid + 3], "\x00never\x00"] if len(text) >= 6 else ["\x00never\x00"]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_deltas_concatenate_to_the_cumulative_run(engine, logprobs):
    free = [_run(engine, PROMPTS, [_params(RequestOutputKind.CUMULATIVE, seed=s)
                                   for s in range(3)])]
    stops = [_stops_from(outs[-1].outputs[0].text) for outs in free[0]]
    for include in (False, True):
        def params(kind, include=include):
            return [_params(kind, seed=s, stop=stops[s], logprobs=logprobs,
                            include_stop_str_in_output=include) for s in range(3)]

        cumulative = _run(engine, PROMPTS, params(RequestOutputKind.CUMULATIVE))
        deltas = _run(engine, PROMPTS, params(RequestOutputKind.DELTA))
        finals = _run(engine, PROMPTS, params(RequestOutputKind.FINAL_ONLY))
        for cum, dl, fin in zip(cumulative, deltas, finals):
            want = cum[-1].outputs[0]
            assert len(fin) == 1 and fin[0].finished
            assert fin[0].outputs[0].text == want.text
            assert fin[0].outputs[0].token_ids == want.token_ids
            assert len(dl) == len(cum)  # one output per step, as cumulative
            assert [o.finished for o in dl] == [False] * (len(dl) - 1) + [True]
            assert "".join(o.outputs[0].text for o in dl) == want.text
            assert sum((o.outputs[0].token_ids for o in dl), []) == want.token_ids
            for o in dl:
                assert len(o.outputs[0].token_ids) == 1  # one new token per step
            if logprobs is None:
                assert all(o.outputs[0].logprobs is None for o in dl)
            else:
                assert sum((o.outputs[0].logprobs for o in dl), []) == want.logprobs
                assert dl[-1].outputs[0].cumulative_logprob == pytest.approx(
                    want.cumulative_logprob, abs=0)
            assert dl[-1].outputs[0].finish_reason == want.finish_reason
            assert dl[-1].outputs[0].stop_reason == want.stop_reason
            # A delta never shows text the cumulative run took back: each prefix
            # of the deltas is a prefix of the final text.
            shown = ""
            for o, c in zip(dl, cum):
                shown += o.outputs[0].text
                assert want.text.startswith(shown)
                assert c.outputs[0].text.startswith(shown)
        # The stop strings did cut at least one request (else the test proves little).
        assert any(outs[-1].outputs[0].stop_reason is not None for outs in cumulative)


def test_a_possible_stop_string_is_held_back_until_decided(engine):
    (outs,) = _run(engine, PROMPTS[:1], [_params(RequestOutputKind.CUMULATIVE, seed=7)])
    text = outs[-1].outputs[0].text
    # A stop string whose first two characters end the text after some step,
    # but which never completes: they are held back while it might, then released.
    step_texts = [o.outputs[0].text for o in outs[:-1] if len(o.outputs[0].text) >= 2]
    stop = step_texts[len(step_texts) // 2][-2:] + "\x00"
    (dl,) = _run(engine, PROMPTS[:1], [_params(RequestOutputKind.DELTA, seed=7, stop=[stop])])
    shown = [o.outputs[0].text for o in dl]
    assert "".join(shown) == text
    after_step = [len("".join(shown[: i + 1])) for i in range(len(shown))]
    full = [len(o.outputs[0].text) for o in outs]
    # While the text ends with the stop string's first two characters, they are not shown.
    held = [i for i, c in enumerate(outs) if c.outputs[0].text.endswith(stop[:2])
            and not c.finished]
    assert held, "the example must contain the held-back prefix"
    for i in held:
        assert after_step[i] <= full[i] - 2


def test_output_kind_is_validated():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=3)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_llm_generate_returns_full_outputs_whatever_the_kind(tiny_model_dir):
    from minivllm import LLM

    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", max_model_len=128)
    sp = [_params(k, seed=3) for k in RequestOutputKind]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 3,
                        sp, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].outputs[0].text == outs[2].outputs[0].text
    assert len(outs[1].outputs[0].token_ids) == 24
    assert sp[1].output_kind is RequestOutputKind.DELTA  # the caller's params are untouched
