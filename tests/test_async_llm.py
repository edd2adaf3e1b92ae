"""``AsyncLLM`` in-process: deltas, aborts, back-pressure and engine failure.

The oracle is ``LLM.generate`` on the same tiny model: the deltas of a request
must join into exactly its offline text, whatever else runs at the same time.
"""

from __future__ import annotations

import asyncio

import pytest
from server_utils import offline_backend

from minivllm import LLM, SamplingParams
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, held_back
from minivllm.engine.llm_engine import EngineConfig, LLMEngine


@pytest.fixture
def spec(request):
    return offline_backend(request.config.getoption("--backend"))


def make(path, spec, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), backend=spec, device="cpu",
                                  max_model_len=256, **kw))


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_held_back_is_the_longest_tail_that_may_become_a_stop_string() -> None:
    assert held_back("Paris.\n\nTh", ["\n\nThe"]) == 4
    assert held_back("Paris.", ["\n\nThe"]) == 0
    assert held_back("abcab", ["abcabd", "b"]) == 5
    assert held_back("xyz", []) == 0


def test_concurrent_deltas_join_into_the_offline_text(tiny_model_dir, spec) -> None:
    path = tiny_model_dir("llama")
    prompts = ["one", "two two", "three three three", "four"]
    text = LLM(str(path), backend=spec, device="cpu", max_model_len=256).generate(
        "two two", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    stop = text[6:8]  # a stop string that really occurs: deltas must never show it
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True,
                             stop=[stop] if i == 1 else None) for i in range(4)]
    offline = LLM(str(path), backend=spec, device="cpu", max_model_len=256).generate(
        prompts, params, use_tqdm=False)
    llm = AsyncLLM(make(path, spec))

    async def one(prompt, sp):
        deltas = [d async for d in llm.generate(prompt, sp)]
        return deltas

    async def main():
        try:
            return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
        finally:
            await llm.shutdown()

    results = run(main())
    for deltas, want in zip(results, offline):
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        assert sum(len(d.token_ids) for d in deltas) == len(want.outputs[0].token_ids)
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == want.outputs[0].finish_reason
    assert results[1][-1].finish_reason == "stop"
    assert all(stop not in "".join(d.text for d in deltas[:k])
               for deltas in results[1:2] for k in range(len(deltas) + 1))


def test_abort_and_early_exit_free_every_block(tiny_model_dir, spec) -> None:
    engine = make(tiny_model_dir("llama"), spec)
    num_blocks = engine.cache_config.num_blocks
    llm = AsyncLLM(engine)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        try:
            stream = await llm.add_request("abc" * 10, long, request_id="a")
            agen = llm.stream_outputs(stream)
            await agen.__anext__()
            assert engine.scheduler.num_free_blocks < num_blocks
            await llm.abort("a")
            assert engine.scheduler.num_free_blocks == num_blocks  # at once, not later
            await agen.aclose()
            # A consumer that stops iterating aborts its request too.
            async for _ in llm.generate("xyz" * 10, long, request_id="b"):
                break
            for _ in range(100):  # the abort is applied before the next engine step
                if llm.num_in_flight == 0 and llm.last_stats.num_free_blocks == num_blocks:
                    break
                await asyncio.sleep(0.05)
            assert llm.last_stats.num_free_blocks == num_blocks
            assert not engine.has_unfinished_requests()
        finally:
            await llm.shutdown()

    run(main())


def test_a_full_queue_is_refused_at_once(tiny_model_dir, spec) -> None:
    llm = AsyncLLM(make(tiny_model_dir("llama"), spec, max_num_seqs=1), max_waiting_requests=1)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                await llm.add_request("x" * 300, long)  # refused, and not counted
            await llm.add_request("a", long)
            await llm.add_request("b", long)
            with pytest.raises(QueueFullError, match="max-waiting-requests"):
                await llm.add_request("c", long)
        finally:
            await llm.shutdown()

    run(main())


def test_an_engine_failure_reaches_every_request_and_later_ones(tiny_model_dir, spec) -> None:
    engine = make(tiny_model_dir("llama"), spec)
    real_step = engine.step_with_stats
    calls = []

    def failing_step():  # a fault injected after a few real steps
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("tensor-parallel worker 1 died (exitcode -9)")
        return real_step()

    engine.step_with_stats = failing_step
    llm = AsyncLLM(engine)

    async def consume(prompt):
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True)):
            pass

    async def main():
        try:
            results = await asyncio.gather(*(consume(p) for p in ("a", "bb", "ccc")),
                                           return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) and "worker 1 died" in str(r)
                       for r in results), results
            with pytest.raises(EngineDeadError):
                await consume("d")
        finally:
            await llm.shutdown()

    run(main())
