"""``prompt_logprobs``, ``echo`` and ``priority`` over HTTP, with the official ``openai`` client.

vLLM's fields: completions return ``prompt_logprobs`` on each choice, chat on the
response; each is one entry per prompt token, ``null`` for the first, then
``{token_id: {"logprob", "rank", "decoded_token"}}``. ``echo=true`` starts the
completion text with the prompt, and with ``logprobs`` the prompt's tokens lead
the logprobs (the first one ``null``). The oracle for the prompt's values is
transformers' forward over the prompt; for the generated part, the offline engine.
The server runs ``--scheduling-policy priority``, so the ``priority`` field is taken
(the order it makes is tested offline, in ``test_priority_scheduling.py``).
"""

from __future__ import annotations

import openai
import pytest
import torch
from conftest import hf_model
from server_utils import ServerProcess, offline_backend, server_backend

from minivllm import LLM, SamplingParams

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, request):
    """A served tiny model, its offline LLM, and its directory (for transformers)."""
    spec = server_backend(request.config.getoption("--backend"))
    path = str(tiny_model_dir("llama"))
    server = ServerProcess(path, "--backend", spec, "--max-model-len", str(MAX_MODEL_LEN),
                           "--served-model-name", "tiny", "--max-num-batched-tokens", "8",
                           "--scheduling-policy", "priority", "--dtype", "float32")
    # float32 pinned on both sides: the oracle is transformers in float32, and "auto" is
    # bfloat16 on a CPU with avx512_bf16 (logprobs 1e-2 apart instead of 1e-4).
    llm = LLM(path, backend=offline_backend(spec), device="cpu", max_model_len=MAX_MODEL_LEN,
              dtype="float32")
    try:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                            timeout=60), llm, path
    finally:
        llm.shutdown()
        server.stop()


def oracle(path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]  # row j - 1 scores prompt token j


def check_json(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        entry = {int(t): v for t, v in entries[j].items()}
        top = torch.topk(ref[j - 1], k)
        assert set(entry) == {prompt[j], *top.indices.tolist()}
        assert entry[prompt[j]]["logprob"] == pytest.approx(ref[j - 1, prompt[j]].item(),
                                                            abs=1e-4)
        assert entry[prompt[j]]["rank"] == int((ref[j - 1] >= ref[j - 1, prompt[j]]).sum())
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t]["logprob"] == pytest.approx(v, abs=1e-4)


def test_completions_prompt_logprobs_on_each_choice(tiny) -> None:
    """Token-id prompts of 1, 7 and 19 tokens (the server chunks prefill by 8), n=2."""
    c, _, path = tiny
    for prompt in ([5], list(range(40, 47)), [(i * 37) % 250 for i in range(19)]):
        out = c.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                   n=2, extra_body={"prompt_logprobs": 3})
        assert len(out.choices) == 2
        for choice in out.choices:
            check_json(choice.prompt_logprobs, prompt, oracle(path, prompt), 3)
    plain = c.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None


def test_echo_leads_with_the_prompt_streamed_or_not(tiny) -> None:
    c, llm, path = tiny
    text = "The quick brown fox"
    want = llm.generate(text, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                             logprobs=2), use_tqdm=False)[0]
    prompt, gen = want.prompt_token_ids, want.outputs[0]
    ref = oracle(path, prompt)
    kw = dict(model="tiny", prompt=text, echo=True, temperature=0, max_tokens=4,
              extra_body={"ignore_eos": True})
    full = c.completions.create(**kw).choices[0]
    assert full.text == text + gen.text and full.logprobs is None
    lp = c.completions.create(logprobs=2, **kw).choices[0]
    assert lp.text == text + gen.text
    assert len(lp.logprobs.tokens) == len(prompt) + 4
    assert lp.logprobs.token_logprobs[0] is None and lp.logprobs.top_logprobs[0] is None
    want_prompt = [ref[j - 1, prompt[j]].item() for j in range(1, len(prompt))]
    want_gen = [d[t].logprob for d, t in zip(gen.logprobs, gen.token_ids)]
    assert lp.logprobs.token_logprobs[1:] == pytest.approx(want_prompt + want_gen, abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.logprobs.top_logprobs[1:])
    chunks = list(c.completions.create(stream=True, logprobs=2, **kw))
    assert "".join(ch.choices[0].text for ch in chunks) == text + gen.text
    streamed = [v for ch in chunks if ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(want_prompt + want_gen, abs=1e-4)


def test_chat_prompt_logprobs_on_the_response(tiny) -> None:
    c, llm, path = tiny
    messages = [{"role": "user", "content": "Say hi"}]
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    out = c.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                    max_tokens=3, extra_body={"prompt_logprobs": 2})
    assert out.choices[0].message.content == want.outputs[0].text
    check_json(out.prompt_logprobs, want.prompt_token_ids,
               oracle(path, want.prompt_token_ids), 2)


@pytest.mark.parametrize("fields,word", [
    (dict(extra_body={"prompt_logprobs": -2}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs=21"),  # max_logprobs 20
    (dict(extra_body={"prompt_logprobs": 1}, stream=True), "stream"),
    (dict(extra_body={"prompt_logprobs": 1, "use_beam_search": True}, n=2), "beam"),
])
def test_bad_prompt_logprobs_are_400_naming_the_field(tiny, fields, word) -> None:
    c, _, _ = tiny
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, **fields)
    assert word in e.value.message
    assert e.value.body["param"] == "prompt_logprobs"


def test_priority_field_is_taken_and_checked(tiny) -> None:
    """Any int is taken under the priority policy (the text is the offline engine's); a
    non-int or one outside int64 is a 400 naming ``priority``."""
    c, llm, _ = tiny
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    for priority in (-5, 0, 7):
        out = c.completions.create(model="tiny", prompt="Hello", temperature=0, max_tokens=3,
                                   extra_body={"ignore_eos": True, "priority": priority})
        assert out.choices[0].text == want
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                     max_tokens=2, extra_body={"priority": 3})
    assert chat.choices[0].finish_reason == "length"
    for bad in (2**63, "high", 1.5):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                 extra_body={"priority": bad})
        assert "priority" in e.value.message
