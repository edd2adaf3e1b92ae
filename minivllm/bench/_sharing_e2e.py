"""Sharing in the engine, measured: ``python -m minivllm.bench sharing`` (the default mode).

One prompt (``--prompt-len`` tokens, 512 by default) and ``--output-len``
generated tokens per sequence (64), on a real model (SmolLM2 by default):

- **parallel sampling**, ``n`` = 2, 4, 8: one request with ``SamplingParams(n)``
  (the prompt prefilled once, its blocks shared by fork) against the same
  work as ``n`` independent requests, with prefix caching off (every copy
  prefilled and stored: the paper's baseline) and on (the copies find the
  prompt's full blocks in the cache; only its last partial block is
  recomputed).
- **beam search**, widths 2, 4, 8: ``LLM.beam_search`` in the engine (beams
  fork, copy-on-write on the last block) against vLLM v1's way, the same
  search as independent one-token requests per step over prefix caching.

For each: generated tokens per second (wall clock, the engine built and
warmed up beforehand) and the KV blocks the pool held at its peak. The
memory saving is ``1 - peak blocks / peak blocks of the baseline without
sharing``, printed beside the paper's figures (6.1-9.8% for parallel
sampling, 37.6-55.2% for beam search, on Alpaca traces with OPT-13B: short
prompts, so the paper's parallel-sampling saving is small; a 512-token
prompt shared by 8 completions saves far more).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import MappingProxyType

from minivllm.sampling_params import BeamSearchParams, SamplingParams

PAPER = MappingProxyType({"parallel": "6.1-9.8%", "beam": "37.6-55.2%"})


@dataclass(frozen=True)
class Row:
    kind: str  # "parallel" or "beam"
    width: int
    mode: str  # "shared", "independent", "independent+prefix cache", "vllm-v1 requests"
    seconds: float
    tokens: int  # generated tokens (every sequence's)
    peak_blocks: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


class _Probe:
    """Runs an engine to completion, recording the peak of blocks held.

    The peak is read right after each ``schedule()`` (where blocks are
    allocated; a step frees its finished requests' blocks after its forward).
    """

    def __init__(self, llm) -> None:
        self.engine = llm.llm_engine
        self.peak = 0
        scheduler = self.engine.scheduler
        schedule = type(scheduler).schedule
        total = self.engine.cache_config.num_blocks

        def probed(*args, **kwargs):
            out = schedule(scheduler, *args, **kwargs)
            self.peak = max(self.peak, total - scheduler.num_free_blocks)
            return out

        scheduler.schedule = probed  # this engine's scheduler only, for this probe

    def drain(self) -> tuple[list, int]:
        engine, outs = self.engine, []
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
        del engine.scheduler.schedule  # the class's method again
        return outs, self.peak


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def parallel_rows(llm_plain, llm_cached, prompt: list[int], n: int, output_len: int,
                  seed: int = 0) -> list[Row]:
    """``n`` completions three ways (see the module docstring)."""
    kw = dict(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    rows = []
    for mode, llm, requests in (
            ("shared", llm_plain, [SamplingParams(n=n, seed=seed, **kw)]),
            ("independent", llm_plain, [SamplingParams(seed=seed + i, **kw) for i in range(n)]),
            ("independent+prefix cache", llm_cached,
             [SamplingParams(seed=seed + i, **kw) for i in range(n)])):
        probe = _Probe(llm)
        for sp in requests:
            probe.engine.add_request(None, prompt, sp)
        (outs, peak), seconds = _timed(probe.drain)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rows.append(Row("parallel", n, mode, seconds, tokens, peak))
        if llm is llm_cached:
            llm.llm_engine.scheduler.reset_prefix_cache()
    return rows


def beam_rows(llm_plain, llm_cached, prompt: list[int], width: int,
              output_len: int) -> tuple[list[Row], bool]:
    """A beam search in the engine, and the same search as one-token requests per step
    over prefix caching (vLLM v1's ``LLM.beam_search``); True if their best agree."""
    params = BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)
    probe = _Probe(llm_plain)
    probe.engine.add_beam_search(prompt, params)
    (outs, peak), seconds = _timed(probe.drain)
    ours = outs[0].outputs
    rows = [Row("beam", width, "shared", seconds, output_len * width, peak)]
    (best, peak2), seconds2 = _timed(lambda: _beam_by_requests(llm_cached, prompt, width,
                                                              output_len))
    rows.append(Row("beam", width, "vllm-v1 requests", seconds2, output_len * width, peak2))
    llm_cached.llm_engine.scheduler.reset_prefix_cache()
    return rows, list(ours[0].token_ids) == best


def _beam_by_requests(llm, prompt: list[int], width: int, output_len: int):
    """Beam search outside the engine: each step, one request per beam (one token,
    its top 2W log-probabilities), the prompt and history found in the prefix cache."""
    beams = [([], 0.0)]
    peak = 0
    for _ in range(output_len):
        probe = _Probe(llm)
        sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * width)
        ids = [probe.engine.add_request(None, prompt + tokens, sp) for tokens, _ in beams]
        outs, step_peak = probe.drain()
        peak = max(peak, step_peak)
        by_id = {o.request_id: o for o in outs}
        candidates = []
        for b, ((_, score), rid) in enumerate(zip(beams, ids)):
            top = by_id[rid].outputs[0].logprobs[0]
            candidates += [(score + lp.logprob, b, t) for t, lp in top.items()]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        beams = [(beams[b][0] + [t], s) for s, b, t in candidates[:width]]
    return beams[0][0], peak


def print_table(rows: list[Row]) -> None:
    print(f"{'kind':<9}{'width':>6}  {'mode':<26}{'tok/s':>9}{'vs indep.':>11}"
          f"{'peak blocks':>13}{'saving':>9}{'paper':>12}")
    base: dict[tuple[str, int], Row] = {}
    for r in rows:
        if r.mode in ("independent", "vllm-v1 requests"):
            base[(r.kind, r.width)] = r
    for r in rows:
        b = base.get((r.kind, r.width))
        ratio = f"{r.tokens_per_s / b.tokens_per_s:.2f}x" if b else "-"
        saving = (f"{100 * (1 - r.peak_blocks / b.peak_blocks):.1f}%"
                  if b and r.mode == "shared" else "")
        paper = PAPER[r.kind] if r.mode == "shared" else ""
        print(f"{r.kind:<9}{r.width:>6}  {r.mode:<26}{r.tokens_per_s:>9.1f}{ratio:>11}"
              f"{r.peak_blocks:>13}{saving:>9}{paper:>12}")


def run(model: str, prompt_len: int, output_len: int, widths: list[int], beam_widths: list[int],
        backend: str, dtype: str, block_size: int, seed: int = 0) -> list[dict]:
    """Build two engines (prefix caching off / on), warm them up, measure every row."""
    import random

    from minivllm import LLM

    kw = dict(backend=backend, dtype=dtype, device="cpu", block_size=block_size,
              max_model_len=prompt_len + output_len + 16, seed=seed)
    llm_plain = LLM(model, enable_prefix_caching=False, **kw)
    llm_cached = LLM(model, enable_prefix_caching=True, **kw)
    vocab = llm_plain.llm_engine.vocab_size
    rng = random.Random(seed)
    prompt = [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    for llm in (llm_plain, llm_cached):  # kernels built, caches touched
        llm.generate([{"prompt_token_ids": prompt[:64]}], warm, use_tqdm=False)
        llm.llm_engine.scheduler.reset_prefix_cache()
    rows, agree = [], []
    for n in widths:
        rows += parallel_rows(llm_plain, llm_cached, prompt, n, output_len, seed)
    for w in beam_widths:
        more, same = beam_rows(llm_plain, llm_cached, prompt, w, output_len)
        rows += more
        agree.append((w, same))
    print_table(rows)
    for w, same in agree:
        print(f"beam width {w}: best sequence {'equals' if same else 'DIFFERS FROM'} "
              f"the one-token-requests search's")
    for llm in (llm_plain, llm_cached):
        llm.shutdown()
    return [dict(kind=r.kind, width=r.width, mode=r.mode, seconds=r.seconds, tokens=r.tokens,
                 tokens_per_s=r.tokens_per_s, peak_blocks=r.peak_blocks) for r in rows]


__all__ = ["Row", "beam_rows", "parallel_rows", "print_table", "run"]
