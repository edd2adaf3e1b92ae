"""The rejection sampler: it changes the speed of decoding and nothing else.

Oracles, none of them the rejection sampler itself:

- greedy: plain argmax matching written here, and step-by-step plain greedy
  decoding through the ordinary sampler (penalties see the accepted drafts);
- sampling: a chi-square test over a small vocabulary, thousands of
  requests with their own seeds, that the token emitted at each position
  (the recovered token after a rejection, the bonus token after a full
  accept) is distributed as the target's ``p``, the float64 softmax of the
  processed logits, for draft distributions that agree, disagree badly, or
  are one-hot (n-gram); the same statistic rejects a plausible wrong rule;
- with no drafts the step is the plain sampler, token for token;
- the fast twin (torch, and the Triton kernel in the interpreter) equals the
  ref exactly under the same generators, on mixed batches (k = 0, 1, 3, 5).

Run: ``CI=true pytest -q tests/test_rejection_sampler.py --backend=ref`` (and ``--backend=fast``).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm import backend
from minivllm.fast import rejection_sampler as fast_rs
from minivllm.ref import rejection_sampler as ref_rs
from minivllm.ref import sampler as ref_sampler
from minivllm.request import Request
from minivllm.sampling_metadata import SamplingMetadata
from minivllm.sampling_params import SamplingParams
from minivllm.spec_decode.metadata import (
    MAX_SPEC_LEN,
    PLACEHOLDER_TOKEN_ID,
    SpecDecodeMetadata,
)


@pytest.fixture
def impl():
    return backend.get("rejection_sampler")


def requests(params: list[SamplingParams], outputs: list[list[int]] | None = None,
             eos_token_id: int | None = None) -> list[Request]:
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", [0, 1, 2], p, eos_token_id=eos_token_id)
        for t in (outputs[i] if outputs else []):
            r.append_output_token_ids(t)
        reqs.append(r)
    return reqs


def metadata(reqs: list[Request], vocab_size: int, seed: int = 0,
             device: str = "cpu") -> SamplingMetadata:
    """Fresh generators each call, so two builds draw the same numbers."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return SamplingMetadata.from_requests(reqs, vocab_size, device, gen, seeded_generators={})


def triton_runnable() -> bool:
    return backend.triton_available() and (torch.cuda.is_available()
                                           or backend.triton_interpreted())


# ----------------------------------------------------------------------------- chi-square


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs``, bins with expected < 5 pooled."""
    n = float(counts.sum())
    expected = probs.double() * n
    small = expected < 5
    obs, exp = counts.double()[~small], expected[~small]
    if small.any():
        obs = torch.cat([obs, counts.double()[small].sum()[None]])
        exp = torch.cat([exp, expected[small].sum()[None]])
    keep = exp > 0
    if ((obs > 0) & ~keep).any():
        return math.inf, max(int(keep.sum()) - 1, 1)  # a token with probability 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, max(int(keep.sum()) - 1, 1)


def critical_value(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at ``Phi(z)`` (z = 3.719: 1 - 1e-4), by Wilson-Hilferty."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def test_critical_value_matches_known_quantiles():
    # chi2 quantiles at 1 - 1e-4 (from tables); Wilson-Hilferty is within 8% here,
    # erring high (a slightly looser test) at small dof.
    for dof, table in ((1, 15.14), (4, 23.51), (6, 27.86), (20, 52.39)):
        assert 0 <= critical_value(dof) / table - 1 < 0.08, dof


V_SMALL = 6
NUM_TRIALS = 3000


def target_probs_oracle(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """float64 softmax of logits / T over the top-k (no ties in these logits)."""
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    return torch.softmax(scaled, dim=-1)


def draft_case(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor | None:
    """A draft distribution q per position (k, V), or None for one-hot (n-gram)."""
    k, vocab = p.shape[0] - 1, p.shape[1]
    if name == "similar":  # a good draft: p blurred
        q = 0.7 * p[:k] + 0.3 * torch.rand(k, vocab, generator=gen, dtype=torch.float64)
    elif name == "adversarial":  # q concentrated where p is smallest
        q = torch.full((k, vocab), 0.01, dtype=torch.float64)
        q[torch.arange(k), p[:k].argmin(dim=-1)] = 1.0
    elif name == "random":
        q = torch.rand(k, vocab, generator=gen, dtype=torch.float64) ** 3
    else:
        return None
    return q / q.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("case", ["similar", "adversarial", "random", "ngram_likely",
                                  "ngram_unlikely"])
def test_each_emitted_token_is_distributed_as_the_target(impl, case):
    """At every position, the emitted token (accepted draft, recovered or bonus) ~ p."""
    k, vocab, n = 3, V_SMALL, NUM_TRIALS
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    logits = torch.randn(k + 1, vocab, generator=gen) * 1.5  # (k + 1, V), one per position
    temperature, top_k = (0.7, 4) if case in ("random", "ngram_unlikely") else (1.0, 0)
    p = target_probs_oracle(logits, temperature, top_k)  # (k + 1, V) float64
    q = draft_case(case, p, gen)
    if q is None:  # n-gram: the same draft for every trial, a likely or an unlikely one
        pick = p[:k].argmax(-1) if case == "ngram_likely" else p[:k].argsort(-1)[:, 1]
        drafts = [pick.tolist()] * n
        draft_probs = None
    else:
        x = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen)
                         for j in range(k)], dim=1)  # (n, k), x_j ~ q_j
        drafts = x.tolist()
        draft_probs = q.float().repeat(n, 1)  # (n * k, V), request after request
    # Half the requests seeded (each its own generator), half from the engine's.
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=None,
                             seed=(10_000 + i) if i % 2 else None) for i in range(n)]
    spec = SpecDecodeMetadata.make(drafts, vocab)
    out = impl.rejection_sample(logits.repeat(n, 1), spec, draft_probs,
                                metadata(requests(params), vocab, seed=7))
    tokens, accepted = out.output_token_ids, out.num_accepted_tokens
    tested = 0
    for j in range(k + 1):
        reached = accepted >= j  # trials that emit a token at position j
        if int(reached.sum()) < 300:
            continue
        counts = torch.bincount(tokens[reached, j], minlength=vocab)
        stat, dof = chi_square(counts, p[j])
        assert stat < critical_value(dof), (case, j, stat, dof, counts.tolist())
        tested += 1
    assert tested >= 1
    if case in ("similar", "ngram_likely"):
        assert tested == k + 1, "the bonus position was reached too rarely to be tested"


def test_the_statistic_rejects_a_wrong_rule():
    """The chi-square above has power: recovering from p instead of max(p - q, 0) fails it."""
    vocab, n = V_SMALL, NUM_TRIALS
    gen = torch.Generator().manual_seed(3)
    p = target_probs_oracle(torch.randn(1, vocab, generator=gen) * 1.5, 1.0, 0)[0]
    q = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3
    q /= q.sum()
    x = torch.multinomial(q, n, replacement=True, generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    accept = u * q[x] < p[x]
    wrong = torch.where(accept, x, torch.multinomial(p, n, replacement=True, generator=gen))
    stat, dof = chi_square(torch.bincount(wrong, minlength=vocab), p)
    assert stat > critical_value(dof), (stat, dof)


# ----------------------------------------------------------------------------- greedy


def greedy_oracle(drafts: list[int], logits: torch.Tensor) -> list[int]:
    """Argmax matching, written from the definition."""
    argmax = [max(range(logits.shape[1]), key=lambda v: (logits[j, v].item(), -v))
              for j in range(logits.shape[0])]
    out = []
    for j, x in enumerate(drafts):
        out.append(argmax[j])
        if x != argmax[j]:
            return out
    return out + [argmax[len(drafts)]]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_argmax_matching(impl, seed):
    rng = random.Random(seed)
    vocab = rng.choice([5, 7, 50])
    ks = [rng.choice([0, 1, 3, 5]) for _ in range(rng.randrange(1, 7))]
    # Random rows mixed in, so the greedy path runs beside the random one.
    params = [SamplingParams(temperature=0.0 if rng.random() < 0.7 else 1.0, max_tokens=None)
              for _ in ks]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=torch.Generator().manual_seed(seed))
    argmax = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for k in ks:  # drafts mostly equal to the argmax, so runs of accepts happen
        drafts.append([argmax[row + j] if rng.random() < 0.75 else rng.randrange(vocab)
                       for j in range(k)])
        row += k + 1
    spec = SpecDecodeMetadata.make(drafts, vocab)
    out = impl.rejection_sample(logits, spec, None, metadata(requests(params), vocab))
    emitted = out.parse_output()
    row = 0
    for i, (k, p) in enumerate(zip(ks, params)):
        if p.temperature == 0.0:
            assert emitted[i] == greedy_oracle(drafts[i], logits[row : row + k + 1])
        row += k + 1


def test_greedy_with_penalties_equals_plain_greedy_decoding(impl):
    """Position j is penalised as if drafts 0..j-1 were already output (plain decoding)."""
    vocab, k = 7, 5
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=gen)
    logits[:, 3] += 3.0  # token 3 leads everywhere until penalties push it down
    params = SamplingParams(temperature=0.0, frequency_penalty=1.3, repetition_penalty=1.5,
                            min_tokens=0, max_tokens=None)
    outputs = [4, 3]
    # Plain greedy decoding, one position at a time, through the ordinary sampler.
    plain, history = [], list(outputs)
    for j in range(k + 1):
        (req,) = requests([params], [history])
        tok = int(ref_sampler.sample(logits[j : j + 1], metadata([req], vocab))
                  .sampled_token_ids[0])
        plain.append(tok)
        history.append(tok)
    for drafts in (plain[:k], plain[:2] + [(plain[2] + 1) % vocab] + plain[3:k]):
        spec = SpecDecodeMetadata.make([drafts], vocab)
        out = impl.rejection_sample(logits, spec, None,
                                    metadata(requests([params], [outputs]), vocab))
        n = next((j for j in range(k) if drafts[j] != plain[j]), k)
        assert out.parse_output()[0] == plain[: n + 1]


# ----------------------------------------------------------------------------- twins


def test_no_drafts_is_the_plain_sampler(impl):
    """k = 0 for every request: the same tokens as the sampler, same generators."""
    rng = random.Random(5)
    vocab = 33
    params = [SamplingParams(temperature=rng.choice([0.0, 0.6, 1.2]), top_k=rng.choice([0, 5]),
                             top_p=rng.choice([1.0, 0.8]), presence_penalty=rng.choice([0, 0.5]),
                             seed=rng.choice([None, i]), max_tokens=None) for i in range(12)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in params]
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(1)) * 2
    want = ref_sampler.sample(logits, metadata(requests(params, outputs), vocab, 3))
    spec = SpecDecodeMetadata.make([[] for _ in params], vocab)
    out = impl.rejection_sample(logits, spec, None, metadata(requests(params, outputs), vocab, 3))
    assert out.num_accepted_tokens.tolist() == [0] * len(params)
    assert out.output_token_ids[:, 0].tolist() == want.sampled_token_ids.tolist()


@st.composite
def batches(draw):
    """A mixed batch: greedy/random/seeded rows, filters, penalties, k in {0, 1, 3, 5}."""
    vocab = draw(st.sampled_from([5, 7, 33]))
    num = draw(st.integers(1, 5))
    params, ks = [], []
    for i in range(num):
        greedy = draw(st.booleans())
        params.append(SamplingParams(
            temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 1.7])),
            top_k=draw(st.sampled_from([0, 2, 4])), top_p=draw(st.sampled_from([1.0, 0.7])),
            min_p=draw(st.sampled_from([0.0, 0.1])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.8])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.4])),
            min_tokens=draw(st.sampled_from([0, 3])),
            seed=draw(st.sampled_from([None, 1000 + i])), max_tokens=None))
        ks.append(draw(st.sampled_from([0, 1, 3, 5])))
    seed = draw(st.integers(0, 2**16))
    return vocab, params, ks, seed, draw(st.booleans())


def run_case(fn, vocab, params, ks, seed, with_probs, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 2
    argmax = logits.argmax(-1).tolist()
    drafts, row = [], 0
    for k in ks:  # half of the drafts are the argmax, so acceptance runs are long
        drafts.append([argmax[row + j] if torch.rand(1, generator=gen) < 0.5
                       else int(torch.randint(vocab, (1,), generator=gen)) for j in range(k)])
        row += k + 1
    draft_probs = None
    if with_probs:
        draft_probs = torch.softmax(torch.randn(sum(ks), vocab, generator=gen) * 2, dim=-1)
    outputs = [[int(t) for t in torch.randint(vocab, (j % 3,), generator=gen)]
               for j in range(len(params))]
    spec = SpecDecodeMetadata.make(drafts, vocab, device)
    logits = logits.to(device)
    draft_probs = None if draft_probs is None else draft_probs.to(device)
    before = logits.clone()
    out = fn(logits, spec, draft_probs,
             metadata(requests(params, outputs, vocab - 1), vocab, seed, device))
    assert torch.equal(logits, before), "the input must not be modified"
    return drafts, out


def check_structure(drafts, out):
    """Accepted prefix of the drafts, one more token, then placeholders."""
    assert out.output_token_ids.shape == (len(drafts), max(map(len, drafts), default=0) + 1)
    for i, ids in enumerate(drafts):
        n = int(out.num_accepted_tokens[i])
        row = out.output_token_ids[i].tolist()
        assert 0 <= n <= len(ids)
        assert row[:n] == ids[:n] and row[n] != PLACEHOLDER_TOKEN_ID
        assert all(t == PLACEHOLDER_TOKEN_ID for t in row[n + 1 :])


@settings(max_examples=min(40, settings.default.max_examples))
@given(case=batches())
def test_fast_twin_equals_ref_exactly(case):
    """Same generators, same tokens: for backend.get's twin and the torch path itself."""
    impl = backend.get("rejection_sampler")
    drafts, want = run_case(ref_rs.rejection_sample, *case)
    check_structure(drafts, want)
    for fn in (impl.rejection_sample, fast_rs.rejection_sample_torch):
        _, got = run_case(fn, *case)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
        assert torch.equal(got.num_accepted_tokens, want.num_accepted_tokens)


@pytest.mark.skipif(not triton_runnable(), reason="needs Triton on CUDA or TRITON_INTERPRET=1")
@settings(max_examples=min(8, settings.default.max_examples))
@given(case=batches())
def test_triton_kernel_equals_ref_exactly(case):
    """The kernel on CUDA, or in Triton's interpreter on a CPU (small cases: it is slow)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    drafts, want = run_case(ref_rs.rejection_sample, *case, device=device)
    _, got = run_case(fast_rs.rejection_sample_triton, *case, device=device)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.num_accepted_tokens, want.num_accepted_tokens)


def test_seeded_request_ignores_the_rest_of_the_batch(impl):
    vocab = 7
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=None)
    other = SamplingParams(temperature=0.9, max_tokens=None)
    gen = torch.Generator().manual_seed(0)
    mine = torch.randn(4, vocab, generator=gen)
    drafts = [1, 2, 3]
    alone = impl.rejection_sample(mine, SpecDecodeMetadata.make([drafts], vocab), None,
                                  metadata(requests([seeded]), vocab, 1))
    rest = torch.randn(3, vocab, generator=gen)
    spec = SpecDecodeMetadata.make([[4], drafts, []], vocab)
    batch = impl.rejection_sample(torch.cat([rest[:2], mine, rest[2:]]), spec, None,
                                  metadata(requests([other, seeded, other]), vocab, 2))
    assert batch.parse_output()[1] == alone.parse_output()[0]


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_value_errors_naming_the_field(impl):
    vocab = 5
    spec = SpecDecodeMetadata.make([[1, 2], []], vocab)
    md = metadata(requests([SamplingParams(max_tokens=None)] * 2), vocab)
    good = torch.zeros(spec.num_logits, vocab)
    with pytest.raises(ValueError, match="target_logits"):
        impl.rejection_sample(torch.zeros(3, vocab), spec, None, md)
    with pytest.raises(ValueError, match="target_logits"):
        impl.rejection_sample(torch.zeros(spec.num_logits, vocab + 1), spec, None, md)
    with pytest.raises(ValueError, match="draft_probs"):
        impl.rejection_sample(good, spec, torch.zeros(3, vocab), md)
    with pytest.raises(ValueError, match="draft_probs"):
        impl.rejection_sample(good, spec, torch.zeros(2, vocab, dtype=torch.float64), md)
    with pytest.raises(ValueError, match="sampling_metadata"):
        impl.rejection_sample(good, spec, None, metadata(requests([SamplingParams()]), vocab))
    with pytest.raises(ValueError, match=r"draft_token_ids\[1\]"):
        SpecDecodeMetadata.make([[0], [5]], vocab)
    with pytest.raises(ValueError, match=r"draft_token_ids\[0\]"):
        SpecDecodeMetadata.make([[-1]], vocab)
    with pytest.raises(ValueError, match="MAX_SPEC_LEN"):
        SpecDecodeMetadata.make([[0] * (MAX_SPEC_LEN + 1)], vocab)
    with pytest.raises(ValueError, match="vocab_size"):
        SpecDecodeMetadata.make([[0]], 0)
