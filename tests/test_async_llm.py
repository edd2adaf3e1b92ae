"""``AsyncLLM`` in-process: deltas, aborts, back-pressure and engine failure.

The oracle is ``LLM.generate`` on the same tiny model: the deltas of a request
must join into exactly its offline text, whatever else runs at the same time.
"""

from __future__ import annotations

import asyncio

import pytest
from server_utils import offline_backend

from minivllm import LLM, SamplingParams
from minivllm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from minivllm.engine.llm_engine import EngineConfig, LLMEngine


@pytest.fixture
def spec(request):
    return offline_backend(request.config.getoption("--backend"))


def make(path, spec, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), backend=spec, device="cpu",
                                  max_model_len=256, **kw))


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


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


def test_one_engine_serves_two_event_loops_one_after_the_other(tiny_model_dir, spec) -> None:
    # A second asyncio.run used to get "Future attached to a different loop"
    # from the first loop's future, and the engine thread died of it.
    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(str(path), backend=spec, device="cpu", max_model_len=256).generate(
        ["first", "second"], params, use_tqdm=False)
    llm = AsyncLLM(make(path, spec))

    async def text(prompt):
        return "".join([d.text async for d in llm.generate(prompt, params)])

    async def second():
        try:
            return await text("second")
        finally:
            await llm.shutdown()

    assert run(text("first")) == want[0].outputs[0].text
    assert run(second()) == want[1].outputs[0].text


def test_a_batch_is_one_command_scheduled_in_one_step(tiny_model_dir, spec) -> None:
    # 16 prompts x n=8 through the server's code path: all 16 prompts prefilled once, in
    # the first step; their 8 completions each fork from it (parallel sampling).
    from minivllm.entrypoints.openai.protocol import CompletionRequest
    from minivllm.entrypoints.openai.serving import OpenAIServing

    engine = make(tiny_model_dir("llama"), spec, max_num_seqs=128, max_num_batched_tokens=2048)
    steps = []
    llm = AsyncLLM(engine, stat_loggers=[lambda stats, it: steps.append(stats)])
    serving = OpenAIServing(llm, "tiny")
    prompts = [f"prompt number {i}" for i in range(16)]

    async def main():
        try:
            return await serving.create_completion(CompletionRequest(
                prompt=prompts, n=8, max_tokens=2, seed=1, ignore_eos=True))
        finally:
            serving.close()
            await llm.shutdown()

    out = run(main())
    assert len(out["choices"]) == 128 and out["usage"]["completion_tokens"] == 256
    assert len(steps[0].num_scheduled_tokens) == 16, steps[0]
    assert sum(steps[0].num_scheduled_tokens.values()) == \
        sum(len(engine.tokenizer.encode(p)) for p in prompts)
    assert len(steps[1].num_scheduled_tokens) == 128, steps[1]  # every completion decodes


def test_a_batch_with_one_bad_request_queues_none(tiny_model_dir, spec) -> None:
    from minivllm.engine.async_llm import InvalidRequestError

    engine = make(tiny_model_dir("llama"), spec)
    num_blocks = engine.cache_config.num_blocks
    scheduled = set()
    llm = AsyncLLM(engine, stat_loggers=[lambda st, it: scheduled.update(st.num_scheduled_tokens)])
    ok = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main():
        try:
            with pytest.raises(InvalidRequestError, match="request 2 of 3") as e:
                await llm.add_requests([("a b c", ok, None), ("d e f", ok, None),
                                        ([999_999], ok, None)])
            assert e.value.index == 2 and "prompt_token_ids" in e.value.reason
            assert llm.num_in_flight == 0 and not engine.has_unfinished_requests()
            assert engine.scheduler.num_free_blocks == num_blocks
            # Nothing of the refused batch runs later either.
            deltas = [d async for d in llm.generate("g", SamplingParams(max_tokens=3))]
            assert deltas[-1].finished and not engine.has_unfinished_requests()
            assert scheduled == {deltas[-1].request_id}
        finally:
            await llm.shutdown()

    run(main())


def test_closing_the_generator_aborts_at_once(tiny_model_dir, spec) -> None:
    # aclose() runs generate()'s finally, which closes the inner stream at
    # once (aclosing) instead of leaving it to garbage collection.
    import contextlib

    engine = make(tiny_model_dir("llama"), spec)
    llm = AsyncLLM(engine)

    async def main():
        try:
            async with contextlib.aclosing(
                    llm.generate("abc", SamplingParams(max_tokens=200, ignore_eos=True))) as g:
                async for _ in g:
                    break
            assert llm.num_in_flight == 0  # no await in between: the abort is queued
            for _ in range(100):
                if llm.last_stats.num_free_blocks == engine.cache_config.num_blocks:
                    break
                await asyncio.sleep(0.05)
            assert llm.last_stats.num_free_blocks == engine.cache_config.num_blocks
        finally:
            await llm.shutdown()

    run(main())


def test_a_consumer_that_falls_behind_gets_its_deltas_merged(tiny_model_dir, spec) -> None:
    # The stream keeps one pending item however many steps ran unread, and
    # what it hands over joins into the offline text and tokens.
    path = tiny_model_dir("llama")
    text = LLM(str(path), backend=spec, device="cpu", max_model_len=256).generate(
        "slow reader", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    stop = text[10:12]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                            logprobs=1)
    want = LLM(str(path), backend=spec, device="cpu", max_model_len=256).generate(
        "slow reader", params, use_tqdm=False)[0].outputs[0]
    llm = AsyncLLM(make(path, spec))

    async def main():
        try:
            stream = await llm.add_request("slow reader", params)
            while llm.num_in_flight:  # read nothing until the request has finished
                await asyncio.sleep(0.05)
            return [d async for d in llm.stream_outputs(stream)]
        finally:
            await llm.shutdown()

    deltas = run(main())
    assert len(deltas) == 1
    d = deltas[0]
    assert d.text == want.text and d.token_ids == want.token_ids
    assert d.finished and d.finish_reason == "stop" and d.stop_reason == stop
    assert len(d.logprobs) == len(want.token_ids) == d.num_output_tokens
