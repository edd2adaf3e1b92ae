"""IncrementalDetokenizer vs the oracle ``tokenizer.decode(all_output_ids)`` and ``str.find``.

Tokenizers: a byte-level BPE trained here on a small multilingual corpus (no
model needed), a merge-free byte tokenizer (every multi-byte character is split
over several tokens), and SmolLM2's real tokenizer when it is available.
"""

from __future__ import annotations

import random

import pytest
from conftest import byte_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from minivllm.engine.output_processor import IncrementalDetokenizer
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 日本語 🚀 the quick brown fox jumps over the lazy dog.",
    "Ünïcödé tëxt, naïve café, façade; 東京 と 大阪 は 日本 の 都市 です。",
    "emoji: 🚀🔥👍🏽 and math ∑ ∫ √ ≠ ≤; Hello, hello, HELLO!",
    "def f(x):\n    return x * 2  # code too\n",
]
ALPHABET = list("abcdefgh hél wörld日本語🚀👍🏽∑,.!\n") + ["hello", " the", "日本", "🚀🚀"]


def trained_bpe():
    """A small byte-level BPE trained on CORPUS, wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["trained_bpe", "byte"])
def tokenizer(request):
    return trained_bpe() if request.param == "trained_bpe" else byte_tokenizer(chat=False)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def full_decode(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``ids`` in random chunks of 1-3 tokens; return every streamed delta."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        stop = detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_next_delta_text(finished=stop is not None or i >= len(ids)))
        if stop is not None:
            break
    return deltas


texts = st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30).map("".join)


@given(text=texts, prompt=texts, seed=st.integers(0, 1000))
def test_deltas_concatenate_to_full_decode(tokenizer, text, prompt, seed):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, ids, random.Random(seed))
    want = full_decode(tokenizer, ids)
    assert "".join(deltas) == want == detok.output_text
    if "\ufffd" not in want:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(8))
def test_random_ids_hold_back_only_incomplete_tail(tokenizer, seed):
    """Arbitrary ids (possibly invalid UTF-8): text is the full decode, or a prefix of it
    when the decode ends in U+FFFD (the last character may yet be completed; as in
    vLLM, the text since the last clean token boundary waits)."""
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(40)]
    # A prompt of whole characters: a character split across the prompt/output
    # boundary would (rightly) decode differently from the output alone.
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say: 日本", add_special_tokens=False).input_ids)
    deltas = stream(detok, ids, rng)
    want = full_decode(tokenizer, ids)
    got = "".join(deltas)
    assert got == detok.output_text
    assert want.startswith(got)
    assert got == want or want.endswith("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    eos = tokenizer.convert_tokens_to_ids("</s>")
    ids = tokenizer("héllo", add_special_tokens=False).input_ids + [eos]
    ids += tokenizer(" 日本", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    deltas = stream(detok, ids, random.Random(0))
    assert "".join(deltas) == full_decode(tokenizer, ids, skip_special_tokens=skip)


def pick_stops(rng: random.Random, text: str) -> list[str]:
    """1-3 stop strings: substrings of ``text`` (spanning token boundaries) or absent ones.

    None is a substring of another, so "first occurrence" (str.find) and
    "first to complete" (what a streaming detector can see) agree.
    """
    stops: list[str] = []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.8 and len(text) > 1:
            start = rng.randrange(len(text) - 1)
            stops.append(text[start : start + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["zzz", "🔥", "xyz!"]))
    return [s for s in stops if s and not any(s != o and s in o for o in stops)]


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(25))
def test_stop_strings_match_str_find(tokenizer, include, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(5, 40)))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    full = full_decode(tokenizer, ids)
    stops = list(dict.fromkeys(pick_stops(rng, full)))
    found = [(full.find(s), s) for s in stops if full.find(s) != -1]

    detok = IncrementalDetokenizer(tokenizer, [1, 2], stop=stops, include_stop_str_in_output=include)
    streamed = ""
    i, reason = 0, None
    while i < len(ids) and reason is None:
        reason = detok.update([ids[i]])
        i += 1
        delta = detok.get_next_delta_text(finished=reason is not None or i == len(ids))
        streamed += delta
        # Streamed text never shows anything the final text will not have.
        final_if_stopped = full[: min(found)[0] + (len(min(found)[1]) if include else 0)] \
            if found else full
        assert final_if_stopped.startswith(streamed)

    if found:
        index, stop_str = min(found)
        assert reason == stop_str
        want = full[: index + len(stop_str)] if include else full[:index]
    else:
        assert reason is None
        want = full
    assert detok.output_text == want
    assert streamed == want
    assert detok.stop_reason == reason


def test_hold_back_only_possible_stop_prefix(tokenizer):
    """Text that cannot start a stop string streams at once; a possible start waits."""
    detok = IncrementalDetokenizer(tokenizer, [], stop=["日本語!"])
    for piece, want in [("héllo ", "héllo "), ("日本", ""), ("x", "日本x"), ("日", "")]:
        detok.update(tokenizer(piece, add_special_tokens=False).input_ids)
        assert detok.get_next_delta_text() == want, piece
    assert detok.update(tokenizer("本語!", add_special_tokens=False).input_ids) == "日本語!"
    assert detok.output_text == "héllo 日本x"
    assert detok.get_next_delta_text() == ""


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = tokenizer("ab ab ab", add_special_tokens=False).input_ids
    first_b = next(i for i in range(len(ids)) if "b" in full_decode(tokenizer, ids[: i + 1]))
    detok = IncrementalDetokenizer(tokenizer, [], stop=["b"], min_tokens=first_b + 2)
    reasons = [detok.update([t]) for t in ids]
    assert reasons[first_b] is None
    assert "b" in reasons
    assert "b" in detok.output_text  # the early "b" stayed; a later one stopped it


def test_from_request(tokenizer):
    params = SamplingParams(stop=["!"], include_stop_str_in_output=True, skip_special_tokens=False)
    detok = IncrementalDetokenizer.from_request(tokenizer, Request("r", [1, 2, 3], params))
    assert detok.stop == ["!"] and detok.include_stop_str_in_output
    assert not detok.skip_special_tokens and detok.token_ids == [1, 2, 3]


def test_bad_stop_raises(tokenizer):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tokenizer, [], stop=[""])


# ---------------------------------------------------------------------------- real tokenizer

SMOL_TEXTS = [
    "The capital of France is Paris. It has the Eiffel Tower!",
    "héllo wörld 日本語 🚀 — naïve café… 👍🏽 done.",
]


@pytest.mark.parametrize("text", SMOL_TEXTS)
def test_smollm2_stream_and_stop(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok(text, add_special_tokens=False).input_ids
    prompt = tok("Say something:", add_special_tokens=False).input_ids
    full = full_decode(tok, ids)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, random.Random(1))
    assert "".join(deltas) == full
    assert not any("\ufffd" in d for d in deltas)
    # A stop string that spans a token boundary ("is Pa", "語 🚀").
    for stop in ("is Pa", "語 🚀", "Tower"):
        if stop not in full:
            continue
        detok = IncrementalDetokenizer(tok, prompt, stop=[stop, "never"])
        reasons = [detok.update([t]) for t in ids]
        assert stop in reasons
        assert detok.output_text == full[: full.find(stop)]
