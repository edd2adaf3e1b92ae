"""Speculative decoding in the engine changes nothing but the speed.

- greedy with n-gram speculation == greedy without == transformers, token for
  token, for k of 1, 3 and 5, with chunked prefill, prefix caching and a KV
  pool small enough to preempt; drafts were both accepted and rejected;
- the K/V slots rolled back after a verification are NaN-poisoned and the
  next steps' outputs do not change (no attention reads a rejected slot);
- EOS, stop token ids, stop strings and max_tokens inside an accepted run stop
  exactly where plain decoding stops;
- seeded sampling with speculation is reproducible and ignores the batch;
- a randomized scheduler state machine with drafts leaks no block and keeps
  ``num_computed_tokens`` and the prefix cache consistent;
- the back-off rule, the metrics and bad configs.

Runs under ``--backend=ref`` and ``--backend=fast``.
"""

from __future__ import annotations

import random

import pytest
from test_engine import greedy, hf_greedy, make_llm

from minivllm import SamplingParams
from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.outputs import StepStats
from minivllm.prefix_hash import hash_block_tokens
from minivllm.ref.scheduler import Scheduler as RefScheduler
from minivllm.request import Request
from minivllm.spec_decode.backoff import BackOff

BLOCK_SIZE = 4


def ngram(k: int, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4, **kw}


def repeating_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts with repeats (so n-gram drafts find matches), two sharing a prefix."""
    rng = random.Random(seed)
    phrase = [rng.randrange(256) for _ in range(9)]
    other = [rng.randrange(256) for _ in range(7)]
    return [phrase * 3 + phrase[:4], phrase * 3 + other, other * 4,
            [rng.randrange(256) for _ in range(13)]]


def run(llm, prompts, params, poison: bool = False):
    """Step the engine by hand; the outputs by prompt, and the summed spec counters.

    ``poison``: after every step, fill the K/V slots of every rejected draft
    (positions from ``num_computed_tokens`` to the end of what the step
    wrote) with NaN in every layer.
    """
    engine = llm.llm_engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    done, totals = {}, {"drafts": 0, "draft": 0, "accepted": 0, "preempted": 0, "poisoned": 0}
    while engine.has_unfinished_requests():
        before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        outs, stats = engine.step_with_stats()
        totals["drafts"] += stats.num_drafts
        totals["draft"] += stats.num_draft_tokens
        totals["accepted"] += stats.num_accepted_tokens
        totals["preempted"] += len(stats.preempted_req_ids)
        if poison:
            totals["poisoned"] += poison_rejected(engine, before, stats)
        for o in outs:
            if o.finished:
                done[o.request_id] = o.outputs[0]
    assert engine.scheduler.num_free_blocks == engine.cache_config.num_blocks, "leaked blocks"
    return [done[i] for i in ids], totals


def poison_rejected(engine, before: dict[str, int], stats: StepStats) -> int:
    """NaN into the slots this step wrote beyond each request's rolled-back length."""
    kv_caches = engine.executor.worker.kv_caches
    bs = engine.cache_config.block_size
    n = 0
    for req in engine.scheduler.running:
        rid = req.request_id
        if rid not in before or rid not in stats.num_scheduled_tokens:
            continue
        written_end = before[rid] + stats.num_scheduled_tokens[rid]
        blocks = engine.scheduler.get_block_ids(rid)
        for pos in range(req.num_computed_tokens, written_end):
            block, offset = blocks[pos // bs], pos % bs
            for k_cache, v_cache in kv_caches:
                k_cache[block, offset] = float("nan")
                v_cache[block, offset] = float("nan")
            n += 1
    return n


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_speculation_equals_plain_and_transformers(tiny_model_dir, k):
    path = tiny_model_dir("llama")
    prompts = repeating_prompts(seed=k)
    new_tokens = 40
    expected = hf_greedy(path, prompts, new_tokens)
    # Chunked prefill (a budget of 16), prefix caching (shared prefixes), and
    # a pool of 40 blocks of 4 for four requests of up to 76 tokens: preemption.
    kw = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=16, num_gpu_blocks_override=40)
    plain, _ = run(make_llm(path, **kw), prompts, greedy(new_tokens))
    spec, totals = run(make_llm(path, speculative_config=ngram(k), **kw), prompts,
                       greedy(new_tokens))
    assert [o.token_ids for o in plain] == expected
    assert [o.token_ids for o in spec] == expected
    assert 0 < totals["accepted"] < totals["draft"], totals  # some accepted, some rejected
    assert totals["preempted"] > 0


def test_rolled_back_slots_are_never_read(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = repeating_prompts(seed=11)
    expected = hf_greedy(path, prompts, 32)
    llm = make_llm(path, block_size=BLOCK_SIZE, speculative_config=ngram(4),
                   enable_prefix_caching=False)
    outs, totals = run(llm, prompts, greedy(32), poison=True)
    assert totals["poisoned"] > 0, "no draft was rejected: the test proves nothing"
    assert [o.token_ids for o in outs] == expected


def _longest_run(llm, prompt, params):
    """The plain tokens, and (start, length) of the longest run one spec step emitted."""
    engine = llm.llm_engine
    rid = engine.add_request(None, prompt, params)
    runs, tokens = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            new = o.outputs[0].token_ids[len(tokens):]
            runs.append((len(tokens), len(new)))
            tokens = list(o.outputs[0].token_ids)
    assert rid is not None
    return tokens, max(runs, key=lambda r: r[1])


def test_stops_inside_an_accepted_run_cut_where_plain_decoding_does(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompt = repeating_prompts(seed=5)[0]
    spec_cfg = ngram(5)
    tokens, (start, length) = _longest_run(make_llm(path, speculative_config=spec_cfg),
                                           prompt, greedy(48))
    assert length >= 3, "no multi-token run to stop inside"
    i = start + 1  # a token strictly inside the run
    # Pick the first token from the middle of the run that appears nowhere before it.
    while tokens[i] in tokens[:i] and i < start + length - 1:
        i += 1
    stop_tok = tokens[i]
    tok = make_llm(path).get_tokenizer()
    stop_str = tok.decode(tokens[i - 1 : i + 1])
    cases = {
        "max_tokens": (SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True), None),
        "stop_token_ids": (SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                          stop_token_ids=[stop_tok]), None),
        "eos": (SamplingParams(temperature=0, max_tokens=48), stop_tok),
        "stop_string": (SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                       stop=[stop_str]), None),
        "logprobs": (SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True,
                                    logprobs=2), None),
    }
    for name, (params, eos) in cases.items():
        results = []
        for cfg in (None, spec_cfg):
            llm = make_llm(path, speculative_config=cfg)
            if eos is not None:
                llm.llm_engine.eos_token_id = eos  # this test's EOS: a token inside the run
            (out,), _ = run(llm, [prompt], params)
            lps = None if out.logprobs is None else [
                {t: round(lp.logprob, 4) for t, lp in d.items()} for d in out.logprobs]
            results.append((out.token_ids, out.text, out.finish_reason, out.stop_reason, lps))
        assert results[0] == results[1], name
        if name != "stop_string":  # the string may occur earlier; the others stop at i
            assert len(results[0][0]) == i + 1, name


def test_seeded_sampling_with_speculation_is_reproducible(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = repeating_prompts(seed=2)
    params = [SamplingParams(temperature=0.5, top_k=2, max_tokens=32, ignore_eos=True,
                             seed=100 + i)
              for i in range(len(prompts))]
    llm = make_llm(path, speculative_config=ngram(3))
    first, totals = run(llm, prompts, params)
    again, _ = run(llm, prompts, params)
    alone, _ = run(llm, prompts[:1], params[:1])
    assert totals["accepted"] > 0
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids == alone[0].token_ids


def test_scheduler_state_machine_with_drafts():
    """Random drafts and acceptance against a tiny pool: no leak, lengths consistent."""
    rng = random.Random(0)
    for trial in range(6):
        cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=rng.choice([5, 8, 32]),
                              max_model_len=64)
        sched = type_of_scheduler()(cfg, CacheConfig(BLOCK_SIZE, 24, True))
        shared = [rng.randrange(50) for _ in range(8)]
        for i in range(6):
            own = [rng.randrange(50) for _ in range(rng.randint(1, 12))]
            prompt = (shared if i % 2 else []) + own
            sched.add_request(Request(f"{trial}-{i}", prompt, SamplingParams(
                max_tokens=rng.randint(1, 30), ignore_eos=True)))
        for _ in range(400):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            sampled = {}
            for r in out.scheduled_requests:
                n = out.num_scheduled_tokens[r.request_id]
                drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
                assert n == 1 + len(drafts) or not drafts
                held = len(sched.get_block_ids(r.request_id)) * BLOCK_SIZE
                assert r.num_computed_tokens + n <= held  # slots for every scheduled token
                if r.num_computed_tokens + n - len(drafts) == r.num_tokens:
                    accepted = rng.randint(0, len(drafts))
                    sampled[r.request_id] = [*drafts[:accepted], rng.randrange(50)]
            sched.update_from_output(out, sampled)
            for r in sched.running:
                assert r.num_computed_tokens <= r.num_tokens
                if r.num_output_tokens and r.num_computed_tokens >= r.num_prompt_tokens:
                    assert r.num_computed_tokens == r.num_tokens - 1
                # Cached blocks hold final tokens only, under their true hashes.
                n_cached = sched.kv_cache_manager.num_cached_blocks.get(r.request_id, 0)
                assert n_cached * BLOCK_SIZE <= r.num_tokens
                parent = None
                for b in range(n_cached):
                    parent = hash_block_tokens(
                        parent, r.all_token_ids[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE])
                    assert r.block_hashes[b] == parent
                cap = min(3, r.max_tokens - r.num_output_tokens - 1)
                if r.num_computed_tokens == r.num_tokens - 1 and cap > 0:
                    r.spec_token_ids = [rng.randrange(50) for _ in range(rng.randint(0, cap))]
        assert not sched.has_unfinished_requests()
        assert sched.num_free_blocks == 24


def type_of_scheduler():
    from minivllm import backend

    return backend.get("scheduler").Scheduler


def test_lookahead_slots_are_reserved_and_never_cached():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3)
    sched = type_of_scheduler()(cfg, CacheConfig(BLOCK_SIZE, 16, True))
    req = Request("a", list(range(8)), SamplingParams(max_tokens=8))
    sched.add_request(req)
    sched.schedule()
    # 8 prompt tokens + 3 lookahead slots: 3 blocks; only the 2 full prompt blocks cached.
    assert len(sched.get_block_ids("a")) == 3
    assert sched.kv_cache_manager.num_cached_blocks["a"] == 2
    assert issubclass(type_of_scheduler(), RefScheduler)


def test_backoff_pauses_low_acceptance_and_doubles():
    b = BackOff(window=2, min_acceptance=0.5, min_pause=4, max_pause=8)
    b.record("r", 0, 3, step=0)
    assert b.may_propose("r", 1)  # the window is not full yet
    b.record("r", 1, 3, step=1)  # 1 of 6 < 0.5: pause 4 steps
    assert not b.may_propose("r", 2) and not b.may_propose("r", 5) and b.may_propose("r", 6)
    b.record("r", 0, 2, step=6)
    b.record("r", 0, 2, step=7)  # again: the pause doubles
    assert not b.may_propose("r", 15) and b.may_propose("r", 16)
    b.record("r", 3, 3, step=16)
    b.record("r", 3, 3, step=17)  # a good window: no pause, and the length resets
    assert b.may_propose("r", 18)


def test_disable_by_batch_size_and_random_text_backs_off(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = repeating_prompts(seed=3)
    llm = make_llm(path, speculative_config=ngram(3, disable_by_batch_size=2))
    _, totals = run(llm, prompts[:2], greedy(16))
    # Both run together until the end: never speculated.
    assert totals["draft"] == 0


def test_metrics_export_spec_decode_counters():
    pytest.importorskip("prometheus_client")
    from minivllm.engine.async_llm import IterationStats
    from minivllm.entrypoints.openai.metrics import PrometheusStatLogger

    stats = StepStats(step=0, num_scheduled_tokens={"a": 4, "b": 3}, decode_req_ids=frozenset(
        {"a", "b"}), preempted_req_ids=(), finished_req_ids=(), num_running=2, num_waiting=0,
        num_blocks=8, num_free_blocks=4, num_drafts=2, num_draft_tokens=5,
        num_accepted_tokens=3, num_accepted_tokens_per_pos=(2, 1, 0))
    assert stats.draft_acceptance_rate == 3 / 5
    assert stats.mean_acceptance_length == 1 + 3 / 2
    assert stats.num_decode_tokens == 7
    logger = PrometheusStatLogger("m")
    logger(stats, IterationStats(now=0.0))
    text = logger.render().decode()
    for line in ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 2.0',
                 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 5.0',
                 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 3.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",'
                 'position="1"} 1.0'):
        assert line in text


@pytest.mark.parametrize("bad,field", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "method": "medusa"}, "method"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
])
def test_bad_speculative_config_is_a_value_error(tiny_model_dir, bad, field):
    with pytest.raises(ValueError, match=f"speculative_config.{field}"):
        make_llm(tiny_model_dir("llama"), speculative_config=bad)



def test_speculation_with_pipeline_parallelism_is_refused():
    from minivllm.engine.llm_engine import EngineConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size=1"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, pipeline_parallel_size=2)

@pytest.mark.slow
def test_tp2_with_speculation_matches_transformers(tiny_model_dir):
    from test_tp_engine import _tp_llm

    path = tiny_model_dir("llama")
    prompts = repeating_prompts(seed=4)[:2]
    llm = _tp_llm(path, 2, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
                  speculative_config=ngram(3))
    try:
        outs, totals = run(llm, prompts, greedy(24))
    finally:
        llm.shutdown()
    assert totals["accepted"] > 0
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 24)


def test_bench_latency_speculative_config_runs(tiny_model_dir, tmp_path, capsys):
    import json

    from minivllm.bench.latency import main

    out = tmp_path / "spec.json"
    assert main(["--model", str(tiny_model_dir("llama")), "--dtype", "float32", "--device",
                 "cpu", "--speculative-config", json.dumps(ngram(3)), "--spec-batch-sizes",
                 "1", "2", "--output-len", "12", "--num-iters", "1", "--input-len", "16",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["batch_size"]) for r in rows] == [
        ("grounded", 1), ("grounded", 2), ("random", 1), ("random", 2)]
    assert all(r["identical"] for r in rows if r["workload"] == "grounded")
    assert "speed-up" in capsys.readouterr().out
