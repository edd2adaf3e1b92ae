"""One bad request hurts no one else (issue 14, items 1 and 2).

A failure is injected (monkeypatch, no hook in production code) into ONE
request at each stage of its life: while it is added, while its inputs are
prepared, while it is sampled, detokenized and matched against its stop
strings. The oracle is an undisturbed run of the same other requests: they
must finish with exactly those tokens, the failed request must end alone with
``finish_reason == "error"`` and its exception, no KV block may leak, and the
engine must serve the next request as before. Only a failure of the forward
pass is fatal.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.llm_engine import EngineConfig, LLMEngine
from minivllm.engine.output_processor import IncrementalDetokenizer
from minivllm.metadata import ScheduledRequest
from minivllm.outputs import RequestFailedError
from minivllm.worker import sampling

VICTIM = [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]  # a prompt length no other request has
OTHERS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33], [1, 2, 3]]


class Boom(RuntimeError):
    """The injected failure."""


def _others_params() -> list[SamplingParams]:
    # Greedy and seeded: both must be reproduced exactly whatever else fails.
    return [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=9, ignore_eos=True,
                           logprobs=2)]


def _victim_params() -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                          stop=["\x00\x01"], logprobs=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), device="cpu",
                                  dtype="float32", max_model_len=128, block_size=4,
                                  max_num_batched_tokens=16))


def _drain(engine) -> dict[str, object]:
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def _assert_worker_forgets(engine):
    """The sampling worker holds no request the engine forgot but the ones the next plan
    tells it of (vLLM v1's finished_req_ids travel with the next step too)."""
    sampler = engine.executor.worker.sampler
    held = set(sampler.requests) | set(sampler.seeded_generators)
    assert held <= set(engine.planner.forgotten)


def _run(engine, with_victim: bool):
    ids = [engine.add_request(None, p, sp) for p, sp in zip(OTHERS, _others_params())]
    victim = engine.add_request(None, VICTIM, _victim_params()) if with_victim else None
    final = _drain(engine)
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks  # no leak
    assert not engine.output_processor.states and not engine.planner.seen
    _assert_worker_forgets(engine)
    assert not engine.scheduler.requests
    return [final[i] for i in ids], (final.get(victim) if victim is not None else None)


@pytest.fixture(scope="module")
def undisturbed(engine):
    others, _ = _run(engine, with_victim=False)
    return [o.outputs[0].token_ids for o in others]


def _is_victim_request(r) -> bool:
    return r.prompt_token_ids == VICTIM


def _is_victim_detok(d) -> bool:
    return d.num_prompt_tokens == len(VICTIM)


def _inject_prepare(monkeypatch):
    real = ScheduledRequest.check_tokens

    def check(snapshot):
        if snapshot.num_prompt_tokens == len(VICTIM) and \
                snapshot.num_tokens - snapshot.num_prompt_tokens >= 2:
            raise Boom("prepare_inputs")
        return real(snapshot)

    monkeypatch.setattr(ScheduledRequest, "check_tokens", check)


def _inject_sample(monkeypatch):
    real = sampling.SamplingMetadata.from_requests

    def from_requests(requests, *args, **kwargs):
        if any(_is_victim_request(r) and r.num_output_tokens >= 3 for r in requests):
            raise Boom("sample")
        return real(requests, *args, **kwargs)

    monkeypatch.setattr(sampling.SamplingMetadata, "from_requests", from_requests)


def _inject_detokenize(monkeypatch):
    real = IncrementalDetokenizer._decode_next

    def decode_next(self):
        if _is_victim_detok(self) and self.num_output_tokens >= 4:
            raise Boom("detokenize")
        return real(self)

    monkeypatch.setattr(IncrementalDetokenizer, "_decode_next", decode_next)


def _inject_stop_strings(monkeypatch):
    real = IncrementalDetokenizer._check_stop_strings

    def check(self, num_new_chars):
        if _is_victim_detok(self) and self.num_output_tokens >= 2:
            raise Boom("stop strings")
        return real(self, num_new_chars)

    monkeypatch.setattr(IncrementalDetokenizer, "_check_stop_strings", check)


def _inject_logprobs(monkeypatch, engine):
    tok = engine.tokenizer
    real = tok.convert_ids_to_tokens
    calls = {"n": 0}

    def convert(ids):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Boom("logprobs")
        return real(ids)

    monkeypatch.setattr(tok, "convert_ids_to_tokens", convert)


STAGES = {"prepare_inputs": _inject_prepare, "sample": _inject_sample,
          "detokenize": _inject_detokenize, "stop_strings": _inject_stop_strings}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_failure_in_one_request_ends_it_alone(engine, undisturbed, monkeypatch, stage):
    with monkeypatch.context() as m:
        STAGES[stage](m)
        others, victim = _run(engine, with_victim=True)
    assert [o.outputs[0].token_ids for o in others] == undisturbed
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in others)
    assert isinstance(victim.error, Boom)
    assert victim.finished and victim.outputs[0].finish_reason == "error"
    # The engine serves the next requests as if nothing had happened.
    again, _ = _run(engine, with_victim=False)
    assert [o.outputs[0].token_ids for o in again] == undisturbed


def test_a_failure_while_building_logprobs_ends_that_request_alone(engine, monkeypatch):
    # Only the third of the others asks for logprobs: it alone may fail.
    with monkeypatch.context() as m:
        _inject_logprobs(m, engine)
        others, _ = _run(engine, with_victim=False)
    assert [o.error is None for o in others] == [True, True, False]
    assert isinstance(others[2].error, Boom)


def test_a_failure_while_adding_leaves_nothing_behind(engine, undisturbed, monkeypatch):
    blocks = engine.scheduler.num_free_blocks
    # The crash: a seed torch.Generator refuses, set after the params were made.
    sp = _victim_params()
    sp.seed = 2**70
    with pytest.raises(ValueError, match="seed"):
        engine.add_request(None, VICTIM, sp)
    with monkeypatch.context() as m:
        def explode(*a, **k):
            raise Boom("detokenizer state")
        m.setattr(IncrementalDetokenizer, "from_request", classmethod(explode))
        with pytest.raises(Boom):
            engine.add_request(None, VICTIM, _victim_params(), request_id="v")
    with monkeypatch.context() as m:
        m.setattr(engine.structured, "compile",
                  lambda params: (_ for _ in ()).throw(Boom("grammar")))
        with pytest.raises(Boom):
            engine.add_request(None, VICTIM, _victim_params(), request_id="v")
    # A request that can never fit is refused by the scheduler, the last check.
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(None, VICTIM * 20, SamplingParams(max_tokens=1))
    assert not engine.output_processor.states and not engine.planner.seen
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == blocks
    others, _ = _run(engine, with_victim=False)
    assert [o.outputs[0].token_ids for o in others] == undisturbed


def test_a_failed_forward_pass_is_fatal(engine, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(engine.executor, "execute_model",
                  lambda step_input: (_ for _ in ()).throw(Boom("forward")))
        engine.add_request(None, OTHERS[0], SamplingParams(max_tokens=2))
        with pytest.raises(Boom):
            engine.step()
    engine.abort_request(list(engine.scheduler.requests))
    _drain(engine)  # the abort's block-table change reaches the worker


def test_llm_generate_finishes_the_others_then_names_the_failed_prompt(tiny_model_dir,
                                                                        monkeypatch):
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32", max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in [OTHERS[0], VICTIM, OTHERS[1]]]
    params = [_others_params()[0], _victim_params(), _others_params()[1]]
    want = llm.generate([prompts[0], prompts[2]], [params[0], params[2]], use_tqdm=False)
    with monkeypatch.context() as m:
        _inject_sample(m)
        with pytest.raises(RequestFailedError, match=r"prompts\[1\]") as info:
            llm.generate(prompts, params, use_tqdm=False)
    err = info.value
    assert isinstance(err.__cause__, Boom) and [f[0] for f in err.failed] == [1]
    got = [err.outputs[0], err.outputs[2]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    sched = llm.llm_engine.scheduler
    assert sched.num_free_blocks == llm.llm_engine.cache_config.num_blocks


def test_a_step_of_prefill_chunks_alone_still_advances(engine):
    """A step that samples nothing (a long prompt's first chunks) must still move the
    prompt on: a regression where such a step skipped the scheduler's update looped
    forever on the same chunk."""
    prompt = list(range(1, 50))  # 49 tokens with a 16-token budget: 3 steps sample nothing
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=3,
                                                    ignore_eos=True))
    for _ in range(20):  # 4 prefill steps + 2 decodes; a bound, not a wait
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks
