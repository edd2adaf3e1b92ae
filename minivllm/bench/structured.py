"""Structured outputs, component level: ``python -m minivllm.bench structured``.

For each twin of ``structured_output`` (the ref's DFA walk, the fast twin's
xgrammar) on SmolLM2's tokenizer (49152 tokens), and each of a few fixed
constraints (a JSON schema, a regex, a choice, ``json_object``):

- **set-up**: building the backend from the tokenizer (once per engine);
- **compile**: the first ``compile`` of the constraint (then cached);
- **mask per token**: the output is a fixed valid answer, tokenized by
  SmolLM2's own tokenizer; for each of its tokens, the time of
  ``fill_bitmask`` + ``is_terminated`` (what the engine asks before sampling)
  and ``accept_tokens`` (after), mean and p99 over the tokens. "cold" is the
  first request of a newly compiled constraint (the ref walks the whole
  vocabulary at each DFA state it meets for the first time), "warm" a second
  request with the same constraint (the ref's per-state masks are cached).
- **apply**: ``apply_token_bitmask_inplace`` on (B, 49152) float32 logits with
  every row constrained, at B = 1 and 64.
- **engines** (``--engines``): why the fast twin uses xgrammar. The same cases
  through xgrammar and llguidance directly (their own tokenizer set-up, compile,
  and fill + accept per token; llguidance with the same separators).

Ratios (ref / fast) come from the same run. Times are wall-clock medians or
means of ``time.perf_counter`` on this machine; on a shared CPU read the ratios,
not the absolute numbers.

- **end to end** (``--no-e2e`` skips it): SmolLM2 answering with the json_schema
  case's schema against the same prompts unconstrained, ms per output token at
  B = 1 and B = 64 (``--batch-sizes``) and their ratio (:func:`bench_end_to_end`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minivllm.sampling_params import StructuredOutputsParams

#: The json_schema case's schema, as JSON text (a string: a module constant that cannot change).
PERSON = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"},
    "email": {"type": "string"},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "中文"]},
                  "minItems": 1, "maxItems": 3},
    "score": {"type": "number"}},
    "required": ["name", "age", "languages"]}, ensure_ascii=False)  # fmt: skip
#: (name, constraint, a valid answer): the answers are tokenized by SmolLM2's tokenizer.
CASES = (
    ("json_schema", StructuredOutputsParams(json=PERSON),
     json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                 "languages": ["English", "French"], "score": 9.75}, ensure_ascii=False)),
    ("regex", StructuredOutputsParams(regex=r"(19|20)\d\d-(0[1-9]|1[0-2])-\d\d, [A-Z][a-z]+ "
                                            r"[A-Z][a-z]+ \((\+\d{1,3} )?\d{3}-\d{4}\)"),
     "2024-03-15, Grace Hopper (+1 555-0199)"),
    ("choice", StructuredOutputsParams(choice=["positive", "negative", "neutral",
                                               "mixed feelings"]), "mixed feelings"),
    ("json_object", StructuredOutputsParams(json_object=True),
     json.dumps({"answer": [1, 2, {"ok": True}], "note": "fine"})),
)


def _tokenizer():
    from transformers import AutoTokenizer

    from minivllm.model import registry

    return AutoTokenizer.from_pretrained(str(registry.ensure_model("smollm2")))


def _step_times(so, params, tokens: list[int], bitmask: torch.Tensor) -> list[float]:
    """Seconds per token: fill the mask, ask whether to stop, accept the token."""
    grammar = so.compile(params)
    times = []
    for t in tokens:
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        grammar.is_terminated()
        if not grammar.accept_tokens([t]):
            raise RuntimeError(f"the answer's token {t} was refused: fix the case")
        times.append(time.perf_counter() - start)
    return times


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.99 * (len(xs) - 1)))]


def bench_masks(impls: dict, tokenizer, vocab_size: int) -> list[dict]:
    """One row per (twin, case): set-up, compile, mask per token cold and warm (ms)."""
    rows = []
    for impl_name, impl in impls.items():
        start = time.perf_counter()
        so = impl.StructuredOutputBackend(tokenizer, vocab_size)
        setup = time.perf_counter() - start
        bitmask = impl.allocate_token_bitmask(1, vocab_size)
        for name, params, answer in CASES:
            tokens = tokenizer.encode(answer, add_special_tokens=False)
            tokens.append(tokenizer.eos_token_id)
            start = time.perf_counter()
            so.compile(params)
            compile_s = time.perf_counter() - start
            cold = _step_times(so, params, tokens, bitmask)
            warm = _step_times(so, params, tokens, bitmask)
            rows.append(dict(twin=impl_name, case=name, tokens=len(tokens), setup_ms=1e3 * setup,
                             compile_ms=1e3 * compile_s,
                             cold_mean_ms=1e3 * statistics.mean(cold), cold_p99_ms=1e3 * _p99(cold),
                             warm_mean_ms=1e3 * statistics.mean(warm), warm_p99_ms=1e3 * _p99(warm)))
    return rows


def bench_apply(impls: dict, vocab_size: int, batch_sizes=(1, 64), repeats: int = 20) -> list[dict]:
    """``apply_token_bitmask_inplace`` on (B, V) float32 logits, every row masked (median ms)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batch_sizes:
        logits = torch.randn(b, vocab_size, generator=g)
        words = torch.randint(-(2**31), 2**31 - 1, (b, (vocab_size + 31) // 32), generator=g,
                              dtype=torch.int64).to(torch.int32)
        for impl_name, impl in impls.items():
            times = []
            for _ in range(repeats):
                x = logits.clone()
                start = time.perf_counter()
                impl.apply_token_bitmask_inplace(x, words)
                times.append(time.perf_counter() - start)
            rows.append(dict(twin=impl_name, batch=b, apply_ms=1e3 * statistics.median(times)))
    return rows


def bench_engines(tokenizer, vocab_size: int) -> list[dict]:
    """xgrammar and llguidance on the same cases and answers: set-up, compile, ms per token."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch

    from minivllm.fast import structured_output as fast_so
    from minivllm.structured_output.constraint import choice_regex

    start = time.perf_counter()
    xgr_backend = fast_so.StructuredOutputBackend(tokenizer, vocab_size)
    xgr_setup = time.perf_counter() - start
    start = time.perf_counter()
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    llg_setup = time.perf_counter() - start
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    matcher = llguidance.LLMatcher
    rows = []
    for name, params, answer in CASES:
        tokens = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        start = time.perf_counter()
        xgr_backend._compile(*_key(params))
        xgr_compile = time.perf_counter() - start
        xgr_times = _step_times(xgr_backend, params, tokens, fast_so.allocate_token_bitmask(
            1, vocab_size))
        start = time.perf_counter()
        if params.kind in ("json", "json_object"):
            schema = params.json_schema() if params.kind == "json" else {"type": "object"}
            grammar = matcher.grammar_from_json_schema(schema, overrides=options)
        else:
            pattern = params.regex if params.kind == "regex" else choice_regex(params.choice)
            grammar = matcher.grammar_from_regex(pattern)
        m = matcher(llg_tokenizer, grammar)
        llg_compile = time.perf_counter() - start
        bitmask, llg_times = llg_torch.allocate_token_bitmask(1, vocab_size), []
        for t in tokens:
            start = time.perf_counter()
            llg_torch.fill_next_token_bitmask(m, bitmask, 0)
            if not m.consume_token(t):
                raise RuntimeError(f"llguidance refused the answer's token {t}: {m.get_error()}")
            llg_times.append(time.perf_counter() - start)
        for engine, setup, comp, times in (("xgrammar", xgr_setup, xgr_compile, xgr_times),
                                           ("llguidance", llg_setup, llg_compile, llg_times)):
            rows.append(dict(engine=engine, case=name, setup_ms=1e3 * setup,
                             compile_ms=1e3 * comp, mean_ms=1e3 * statistics.mean(times),
                             p99_ms=1e3 * _p99(times)))
    return rows


def _key(params):
    from minivllm.structured_output.constraint import constraint_key

    return constraint_key(params)


E2E_PROMPT = ("Describe a famous scientist as a JSON object with their name, age, email, "
              "languages and a score.")


def bench_end_to_end(twins=("fast",), batch_sizes=(1, 64), model: str = "smollm2",
                     max_tokens: int = 96, repeats: int = 2, backend=None) -> list[dict]:
    """End to end: ms per output token constrained (the json_schema case) vs unconstrained.

    For each twin and batch size ``B``: ``B`` copies of a chat prompt asking for
    the json_schema case's kind of answer, sampled (temperature 0.7, seeds
    ``0..B-1``) with ``SamplingParams(structured_outputs=...)``; then the same
    prompts unconstrained with ``ignore_eos`` and each request's ``max_tokens``
    set to what its constrained twin produced, so both runs decode the same
    number of tokens with the same batch over time. Prefix caching is off (a
    second run would find the prompt cached). A warm-up run first (it compiles
    the constraint, and warms the ref's per-state masks, so the ref is timed
    warm); then ``repeats`` rounds of one constrained and one unconstrained
    run, alternated so that a change in the machine's load hits both, and the
    best of each. ``speed`` is unconstrained ms per token over constrained
    (1.0: constraints cost nothing). ``mask_ms``: the time of the engine's own
    structured-output calls (``bitmask`` + ``advance``; the worker's apply is not
    counted) per output token in
    the constrained runs, and ``mask_share`` their share of the run: a figure a
    busy machine disturbs less than a ratio of two runs.
    """
    from minivllm import LLM, SamplingParams

    params = CASES[0][1]
    rows = []
    for twin in twins:
        spec = dict(backend or {})
        spec["structured_output"] = twin
        llm = LLM(model, backend=spec or None, enable_prefix_caching=False,
                  max_num_seqs=max(batch_sizes), max_model_len=512)
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": E2E_PROMPT}],
                                       tokenize=False, add_generation_prompt=True)
        prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        spent = _time_structured_calls(llm.llm_engine.structured)
        try:
            for b in batch_sizes:
                constrained = [SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens,
                                              structured_outputs=params) for i in range(b)]
                outs = llm.generate([prompt] * b, constrained, use_tqdm=False)  # warm-up
                lengths = [len(o.outputs[0].token_ids) for o in outs]
                plain = [SamplingParams(temperature=0.7, seed=i, max_tokens=n, ignore_eos=True)
                         for i, n in enumerate(lengths)]
                best = {"constrained": float("inf"), "unconstrained": float("inf")}
                mask_s = wall_s = 0.0
                for _ in range(repeats):
                    for name, sps in (("constrained", constrained), ("unconstrained", plain)):
                        spent[0] = 0.0
                        start = time.perf_counter()
                        llm.generate([prompt] * b, sps, use_tqdm=False)
                        elapsed = time.perf_counter() - start
                        best[name] = min(best[name], elapsed)
                        if name == "constrained":
                            mask_s, wall_s = mask_s + spent[0], wall_s + elapsed
                times = {name: 1e3 * t / sum(lengths) for name, t in best.items()}
                valid = sum(_valid_json(o.outputs[0].text) for o in outs)
                rows.append(dict(twin=twin, batch=b, tokens=sum(lengths),
                                 mask_ms=1e3 * mask_s / (repeats * sum(lengths)),
                                 mask_share=mask_s / wall_s,
                                 constrained_ms=times["constrained"],
                                 unconstrained_ms=times["unconstrained"],
                                 speed=times["unconstrained"] / times["constrained"],
                                 valid=valid))
        finally:
            llm.shutdown()
    return rows


def _time_structured_calls(so) -> list[float]:
    """Wrap the engine's ``bitmask`` and ``advance`` (on this instance only) to add
    their wall time to the returned one-element list."""
    spent = [0.0]

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    so.bitmask, so.advance = timed(so.bitmask), timed(so.advance)
    return spent


def _valid_json(text: str) -> bool:
    """True if ``text`` is a JSON document valid under the json_schema case's schema."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), json.loads(PERSON))
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.bench structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--twins", nargs="+", default=["ref", "fast"], choices=["ref", "fast"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--engines", action="store_true",
                   help="also time xgrammar against llguidance (needs llguidance)")
    p.add_argument("--no-e2e", action="store_true",
                   help="skip the end-to-end part (SmolLM2 generating, constrained or not)")
    p.add_argument("--e2e-twins", nargs="+", default=["fast"], choices=["ref", "fast"],
                   help="twins timed end to end (default: fast; the ref is timed warm)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from minivllm import backend

    impls = {name: backend.get("structured_output", name) for name in args.twins}
    tokenizer = _tokenizer()
    vocab_size = len(tokenizer)
    masks = bench_masks(impls, tokenizer, vocab_size)
    print(f"SmolLM2 tokenizer, V = {vocab_size}, {torch.get_num_threads()} threads")
    print(f"{'twin':<5}{'case':<13}{'tokens':>7}{'set-up':>9}{'compile':>9}"
          f"{'cold mean':>11}{'cold p99':>10}{'warm mean':>11}{'warm p99':>10}   (ms)")
    for r in masks:
        print(f"{r['twin']:<5}{r['case']:<13}{r['tokens']:>7}{r['setup_ms']:>9.0f}"
              f"{r['compile_ms']:>9.2f}{r['cold_mean_ms']:>11.3f}{r['cold_p99_ms']:>10.3f}"
              f"{r['warm_mean_ms']:>11.3f}{r['warm_p99_ms']:>10.3f}")
    if {"ref", "fast"} <= set(impls):
        by = {(r["twin"], r["case"]): r for r in masks}
        for name, _, _ in CASES:
            ref, fast = by["ref", name], by["fast", name]
            print(f"  {name}: mask per token ref / fast = "
                  f"{ref['cold_mean_ms'] / fast['cold_mean_ms']:.0f}x cold, "
                  f"{ref['warm_mean_ms'] / fast['warm_mean_ms']:.1f}x warm")
    applied = bench_apply(impls, vocab_size, args.batch_sizes)
    for r in applied:
        print(f"apply {r['twin']:<5} B = {r['batch']:<3} {r['apply_ms']:8.3f} ms")
    engines = bench_engines(tokenizer, vocab_size) if args.engines else []
    for r in engines:
        print(f"{r['engine']:<11}{r['case']:<13} set-up {r['setup_ms']:6.0f} ms  compile "
              f"{r['compile_ms']:7.2f} ms  per token {r['mean_ms']:7.3f} ms mean, "
              f"{r['p99_ms']:7.3f} ms p99")
    e2e = [] if args.no_e2e else bench_end_to_end(args.e2e_twins, args.batch_sizes)
    if e2e:
        print("end to end, SmolLM2, json_schema case (ms per output token; speed = "
              "unconstrained / constrained, target >= 0.95 at B = 1, >= 0.9 at B = 64)")
        print(f"{'twin':<5}{'B':>4}{'tokens':>8}{'unconstrained':>15}{'constrained':>13}"
              f"{'speed':>8}{'mask ms/tok':>13}{'mask share':>12}{'valid':>8}")
        for r in e2e:
            print(f"{r['twin']:<5}{r['batch']:>4}{r['tokens']:>8}{r['unconstrained_ms']:>15.2f}"
                  f"{r['constrained_ms']:>13.2f}{r['speed']:>8.2f}{r['mask_ms']:>13.3f}"
                  f"{r['mask_share']:>11.1%}{r['valid']:>5}/{r['batch']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(masks=masks, apply=applied, engines=engines,
                                                  end_to_end=e2e),
                                             indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
