"""Logits shaping end to end, with SmolLM2-135M: ``logit_bias``, ``allowed_token_ids``,
``bad_words`` and custom logits processors through ``LLM.generate`` and the engine's
step loop, under the selected backend (``--backend=ref|fast``).

Every check can fail: the token a bias forces is one the model would not pick;
the bad word is taken from an unconstrained greedy run that does produce it;
the custom processor's view of the batch is compared with the requests the
engine served at each step; speculative decoding must not change a shaped
greedy output, and must have verified drafts for that to mean something.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.logits_processor import LogitsProcessor

PROMPT = "The capital of France is"
MAX_MODEL_LEN = 256
ENGINE = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 27,
              max_num_seqs=8)


@pytest.fixture(scope="module")
def llm(smollm2_dir, request):
    engine = LLM(str(smollm2_dir), backend=request.config.getoption("--backend"), **ENGINE)
    yield engine
    engine.shutdown()


def gen(llm: LLM, prompt: str = PROMPT, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def ids(llm: LLM, **kw) -> list[int]:
    return list(gen(llm, **kw).outputs[0].token_ids)


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_a_plus_100_bias_forces_a_token_the_model_would_not_pick(llm):
    base = ids(llm, ignore_eos=True)
    x = llm.get_tokenizer().encode(" banana", add_special_tokens=False)[0]
    assert x not in base
    assert ids(llm, logit_bias={x: 100.0}, ignore_eos=True) == [x] * len(base)
    # -100 on the greedy first token: another one comes first
    assert ids(llm, logit_bias={base[0]: -100.0}, max_tokens=1)[0] != base[0]


def test_allowed_token_ids_restrict_every_token_greedy_random_and_n2(llm):
    tok = llm.get_tokenizer()
    allowed = sorted({tok.encode(w, add_special_tokens=False)[0]
                      for w in (" cat", " dog", " the", ".", " blue")})
    base = ids(llm, ignore_eos=True)
    assert not set(base) <= set(allowed)  # the model would leave the set
    assert set(ids(llm, allowed_token_ids=allowed, ignore_eos=True)) <= set(allowed)
    out = gen(llm, temperature=1.0, seed=3, n=2, max_tokens=12, ignore_eos=True,
              allowed_token_ids=allowed)
    assert len(out.outputs) == 2
    for completion in out.outputs:
        assert len(completion.token_ids) == 12
        assert set(completion.token_ids) <= set(allowed)


def _forms(llm: LLM, word: str) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(t, add_special_tokens=False) for t in (word.lstrip(), " " + word.lstrip())]


def test_a_one_token_bad_word_from_the_greedy_output_never_appears(llm):
    base = gen(llm, max_tokens=12)
    word = next(w for w in base.outputs[0].text.split() if w.isalpha() and len(w) >= 3)
    forms = _forms(llm, word)
    assert any(contains(list(base.outputs[0].token_ids), f) for f in forms)
    shaped = list(gen(llm, max_tokens=12, bad_words=[word]).outputs[0].token_ids)
    assert shaped and not any(contains(shaped, f) for f in forms)


def find_phrase(tok, tokens: list[int], lengths=(2,)) -> str | None:
    """A phrase of ``tokens`` (of one of ``lengths`` tokens, first found) that starts
    with a space and tokenizes back to the same ids."""
    for n in lengths:
        for i in range(len(tokens) - n + 1):
            text = tok.decode(tokens[i : i + n])
            if text.startswith(" ") and text.strip() and \
                    tok.encode(text, add_special_tokens=False) == tokens[i : i + n]:
                return text.strip()
    return None


def test_a_multi_token_bad_phrase_from_the_greedy_output_never_appears(llm):
    """A phrase of several tokens: only its last token is banned, after the others."""
    tok = llm.get_tokenizer()
    base = list(gen(llm, max_tokens=16, ignore_eos=True).outputs[0].token_ids)
    phrase = find_phrase(tok, base, (3, 2))
    assert phrase is not None, f"no multi-token phrase in {tok.decode(base)!r}"
    forms = [f for f in _forms(llm, phrase) if len(f) > 1]
    assert forms and any(contains(base, f) for f in forms)
    shaped = list(gen(llm, max_tokens=16, ignore_eos=True, bad_words=[phrase])
                  .outputs[0].token_ids)
    assert not any(contains(shaped, f) for f in _forms(llm, phrase))
    # up to the ban, nothing changed: the prefix of the phrase was still generated
    first = next(i for i in range(len(base)) if any(base[i : i + len(f)] == f for f in forms))
    assert shaped[: first] == base[: first]


def test_logprobs_are_of_the_logits_before_shaping(llm):
    """vLLM's raw_logprobs: forcing the second-best token leaves its logprob as it was."""
    raw = gen(llm, max_tokens=1, logprobs=5).outputs[0].logprobs[0]
    second = sorted(raw.items(), key=lambda kv: -kv[1].logprob)[1]
    shaped = gen(llm, max_tokens=1, logprobs=5, allowed_token_ids=[second[0]])
    assert shaped.outputs[0].token_ids[0] == second[0]
    got = shaped.outputs[0].logprobs[0][second[0]].logprob
    assert got == pytest.approx(second[1].logprob, abs=1e-4)


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_values_name_the_field_and_the_engine_serves_the_next_request(llm, kw, field):
    engine = llm.llm_engine
    free = engine.scheduler.num_free_blocks
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert engine.scheduler.num_free_blocks == free, "a refused request holds no block"
    assert not engine.has_unfinished_requests()
    assert len(ids(llm, max_tokens=3, ignore_eos=True)) == 3


def test_a_request_left_with_no_token_fails_alone(llm):
    tok = llm.get_tokenizer()
    x = tok.encode(" banana", add_special_tokens=False)[0]
    engine = llm.llm_engine
    engine.add_request(PROMPT, tok.encode(PROMPT), SamplingParams(
        max_tokens=4, allowed_token_ids=[x], bad_words=["banana"]), request_id="dead")
    engine.add_request(PROMPT, tok.encode(PROMPT), SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True), request_id="alive")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert finished["dead"].outputs[0].finish_reason == "error"
    assert len(finished["alive"].outputs[0].token_ids) == 4


# -- custom processors ------------------------------------------------------------------


class ForceToken(LogitsProcessor):
    """Forces ``extra_args["force"]`` for the requests that ask; records what it is told."""

    instances: list[ForceToken] = []

    def __init__(self, config, device, is_pin_memory):
        self.vocab_size = config.vocab_size
        self.force: dict[str, int] = {}
        self.live: set[str] = set()
        self.rows: list[str] = []
        self.steps: list[tuple[set[str], list[str]]] = []
        ForceToken.instances.append(self)

    @classmethod
    def validate_params(cls, sampling_params):
        t = (sampling_params.extra_args or {}).get("force")
        if t is not None and not isinstance(t, int):
            raise ValueError(f"extra_args['force'] must be a token id, got {t!r}")

    def update_state(self, batch_update):
        for rid in batch_update.removed:
            self.live.remove(rid)  # KeyError if told of a request it never saw
            self.force.pop(rid, None)
        for rid, params, _, _ in batch_update.added:
            assert rid not in self.live, "added twice"
            self.live.add(rid)
            if (params.extra_args or {}).get("force") is not None:
                self.force[rid] = params.extra_args["force"]
        self.rows = list(batch_update.rows)
        self.steps.append((set(self.live), list(self.rows)))

    def apply(self, logits):
        for i, rid in enumerate(self.rows):
            if rid in self.force:
                t = self.force[rid]
                logits[i] = float("-inf")
                logits[i, t] = 0.0
        return logits

    def is_argmax_invariant(self):
        return False


def test_a_custom_processor_sees_the_engines_batch_at_every_step(smollm2_dir, request, llm):
    ForceToken.instances.clear()
    custom = LLM(str(smollm2_dir), backend=request.config.getoption("--backend"),
                 logits_processors=[f"{__name__}:ForceToken"], **ENGINE)
    try:
        proc = ForceToken.instances[-1]
        engine, tok = custom.llm_engine, custom.get_tokenizer()
        x = tok.encode(" banana", add_special_tokens=False)[0]
        prompts = {"a": (PROMPT, 3), "b": ("Once upon a time", 6), "c": ("1, 2, 3,", 9)}
        for rid, (p, n) in prompts.items():
            extra = {"force": x} if rid == "a" else None
            engine.add_request(p, tok.encode(p), SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True, extra_args=extra), request_id=rid)
        with pytest.raises(ValueError, match="force"):
            engine.add_request(PROMPT, tok.encode(PROMPT), SamplingParams(
                extra_args={"force": "x"}), request_id="bad")
        sampled, gone, outputs, step = set(), set(), {}, 0
        while engine.has_unfinished_requests():
            if step == 4:
                engine.abort_request("c")
                gone.add("c")
            got = engine.step()
            step += 1
            stepped = {o.request_id for o in got}
            live, rows = proc.steps[-1]
            assert sorted(rows) == sorted(stepped), f"step {step}: rows {rows}"
            sampled |= stepped
            assert live == sampled - (gone - stepped), f"step {step}: view {live}"
            for o in got:
                outputs[o.request_id] = o
                if o.finished:
                    gone.add(o.request_id)
        assert list(outputs["a"].outputs[0].token_ids) == [x] * 3
        assert list(outputs["b"].outputs[0].token_ids) == \
            ids(llm, prompt="Once upon a time", max_tokens=6, ignore_eos=True)
        gen(custom, max_tokens=1)  # the next step tells it of everything that left
        assert not proc.live & {"a", "b", "c"}
    finally:
        custom.shutdown()


def test_logits_processors_refuses_what_is_not_a_processor(smollm2_dir):
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(str(smollm2_dir), logits_processors=["math:pi"], **ENGINE)
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(str(smollm2_dir), logits_processors=ForceToken, **ENGINE)


# -- composition: speculative decoding ---------------------------------------------------


def test_shaped_greedy_output_is_the_same_with_speculative_decoding(smollm2_dir, request):
    """n-gram drafts are verified against the shaped logits, each position continuing
    the drafts before it: the greedy output must not change, with drafts verified.

    Both engines run in float32, as the other equality tests of speculative decoding do
    (test_spec_decode_engine.py). In bfloat16 the ref's verification step (4 rows a
    sequence) and its decode steps (1 row) go through torch's CPU matmul at different
    shapes, which round differently; on a Zen 4 EPYC a near tie turned at the fourth
    token.
    """
    backend = request.config.getoption("--backend")
    plain = LLM(str(smollm2_dir), backend=backend, dtype="float32", **ENGINE)
    spec = None
    try:
        tok = plain.get_tokenizer()
        prompt = "a b c d a b c d a b c d a"  # the model repeats it: drafts are accepted
        base = list(gen(plain, prompt=prompt, max_tokens=24, ignore_eos=True)
                    .outputs[0].token_ids)
        # " c d": the drafts propose " c d a"; the row after a drafted " c" must ban " d"
        phrase = find_phrase(tok, base[1:])
        assert phrase is not None
        x = tok.encode(" five", add_special_tokens=False)[0]
        shaping = dict(bad_words=[phrase], logit_bias={x: 3.0})
        want = list(gen(plain, prompt=prompt, max_tokens=24, ignore_eos=True, **shaping)
                    .outputs[0].token_ids)
        assert want != base
        spec = LLM(str(smollm2_dir), backend=backend, dtype="float32",
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                   **ENGINE)
        engine = spec.llm_engine
        engine.add_request(prompt, tok.encode(prompt), SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, **shaping), request_id="s")
        drafts, final = 0, None
        while engine.has_unfinished_requests():
            outs, stats = engine.step_with_stats()
            drafts += stats.num_draft_tokens
            final = next((o for o in outs if o.finished), final)
        assert drafts > 0, "no drafts were verified: the test would prove nothing"
        got = list(final.outputs[0].token_ids)
        assert not any(contains(got, f) for f in _forms(plain, phrase))
        assert got == want
    finally:
        for engine_ in (spec, plain):
            if engine_ is not None:
                engine_.shutdown()
