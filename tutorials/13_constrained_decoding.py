"""
13 · Constrained decoding: from a regex to a token mask
=======================================================

An application that parses the model's answer needs the answer to parse: a
JSON document with the right keys, a date in one format, one word out of
four. Asking nicely in the prompt works most of the time; *constrained
decoding* makes it work every time. Before each sampling step, the engine
computes which tokens may come next without leaving the language of valid
answers, and sets the logits of all the others to ``-inf``. This tutorial:

1. turns a regex into a DFA (Thompson's NFA, then subset construction) and
   draws it;
2. walks tokens through it to build token masks for a tiny vocabulary, and
   shows why tokens, not characters, are what makes it hard: a token spans
   several transitions, or half a character;
3. does the same for a JSON schema on SmolLM2's 49152-token vocabulary, and
   counts how many tokens each state allows;
4. times the reference twin (a Python walk of the vocabulary per DFA state)
   against the fast twin (xgrammar, vLLM's default engine);
5. asks SmolLM2 for a JSON answer through ``LLM.chat``, free and constrained.

The component is ``structured_output`` (:doc:`/structured_outputs`). It runs
in about a minute on a laptop CPU.
"""

# %%
import json
import time

import matplotlib

matplotlib.use("Agg")  # no window: the figures are saved as PNGs
import matplotlib.pyplot as plt
import torch
from _figures import figure_path  # tutorials/figures/, ignored by git

from minivllm import StructuredOutputsParams
from minivllm.fast import structured_output as fast_so
from minivllm.ref import structured_output as ref_so
from minivllm.structured_output.automata import DEAD, build_nfa, compile_dfa
from minivllm.structured_output.bitmask import unpack_bitmask
from minivllm.structured_output.json_schema import schema_to_regex
from minivllm.structured_output.regex import parse_regex
from minivllm.structured_output.vocab import TokenVocabulary

torch.set_num_threads(1)

# %% [markdown]
# 1 · From a regex to a DFA
# -------------------------
#
# Take JSON's integers: ``-?(0|[1-9][0-9]*)``. The regex is parsed into a tree
# of character sets, concatenations, alternations and repetitions; Thompson's
# construction turns the tree into an NFA (one start, one accepting state,
# epsilon edges for ``?``, ``|`` and ``*``); subset construction turns the NFA
# into a DFA, whose states are the *sets* of NFA states the text so far could
# have reached. The DFA reads **bytes**: here every character is one byte, but
# ``é`` would be two (``C3 A9``), and the automaton has a state for "half of an
# ``é``".

# %%
PATTERN = r"-?(0|[1-9][0-9]*)"
tree = parse_regex(PATTERN)
nfa, _, _ = build_nfa(tree)
dfa = compile_dfa(tree)
print(f"{PATTERN}: {len(nfa.eps)} NFA states, {dfa.num_states} DFA states")


def edge_labels(dfa):
    """(state, next state) -> the bytes that lead there, as ranges such as '1-9'."""
    edges = {}
    for s, row in enumerate(dfa.transitions):
        for b, t in enumerate(row):
            if t != DEAD:
                edges.setdefault((s, t), []).append(b)
    labels = {}
    for key, bs in edges.items():
        runs = []
        for b in bs:
            if runs and runs[-1][1] == b - 1:
                runs[-1][1] = b
            else:
                runs.append([b, b])
        labels[key] = ",".join(chr(a) if a == z else f"{chr(a)}-{chr(z)}" for a, z in runs)
    return labels


for (s, t), label in sorted(edge_labels(dfa).items()):
    print(f"  state {s} --[{label}]--> state {t}" + ("  (accepting)" if dfa.accepting[t] else ""))

# %%
# Where to draw each state: the start on the left, the two accepting states on the right
# (this layout has no crossing edges).
where = {0: (0.0, 0.0), 1: (2.2, 0.0), 2: (4.4, 1.6), 3: (4.4, -1.6)}
cx = sum(x for x, _ in where.values()) / len(where)
assert dfa.num_states == len(where), "the drawing is laid out for this pattern's 4 states"
R = 0.32
fig, ax = plt.subplots(figsize=(6.5, 3.4))
for s, (x, y) in where.items():
    ax.add_patch(plt.Circle((x, y), R, fill=False))
    if dfa.accepting[s]:
        ax.add_patch(plt.Circle((x, y), R * 0.8, fill=False))
    ax.text(x, y, str(s), ha="center", va="center", fontsize=12)
for (s, t), label in edge_labels(dfa).items():
    (x0, y0), (x1, y1) = where[s], where[t]
    if s == t:  # a self-loop, drawn to the right of the state
        ax.add_patch(plt.Circle((x0 + 1.6 * R, y0), 0.6 * R, fill=False))
        ax.text(x0 + 2.5 * R, y0, label, va="center", fontsize=10)
        continue
    d = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5
    ux, uy = (x1 - x0) / d, (y1 - y0) / d  # unit vector along the edge
    ax.annotate("", xy=(x1 - R * ux, y1 - R * uy), xytext=(x0 + R * ux, y0 + R * uy),
                arrowprops=dict(arrowstyle="->"))
    mx, my = (x0 + x1) / 2, (y0 + y1) / 2
    side = 1 if abs(uy) < 1e-9 or (-uy * (mx - cx) + ux * my) > 0 else -1  # away from the middle
    ax.text(mx - 0.22 * side * uy, my + 0.22 * side * ux, label, ha="center", va="center",
            fontsize=10)
ax.annotate("start", xy=(-R, 0), xytext=(-1.3, 0), arrowprops=dict(arrowstyle="->"),
            va="center")
ax.set_xlim(-1.4, 5.8)
ax.set_ylim(-2.1, 2.1)
ax.set_aspect("equal")
ax.axis("off")
ax.set_title(f"the DFA of {PATTERN} (double circles: accepting)")
fig.tight_layout()
fig.savefig(figure_path("13_dfa.png"), dpi=120)

# %% [markdown]
# **Figure 13.1.** The DFA of JSON's integers, after minimisation (the subset
# construction gave one more state: "one digit read" and "several digits
# read" accept the same continuations, so they merge). From the start, ``-``
# leads to a state that still needs a digit; ``0`` to an accepting state with
# no way out (``01`` is not an integer); ``1-9`` to an accepting state that
# loops on any digit. Every missing edge goes to the dead state, not drawn:
# the text can no longer become a match.

# %% [markdown]
# 2 · Token masks: walking tokens, not characters
# -----------------------------------------------
#
# The model does not choose characters but tokens, and a token is a run of
# bytes. A token is allowed in a DFA state when *all* its bytes can be walked
# from that state without reaching the dead state: the text plus the token is
# still the beginning of some valid answer. That is the whole of
# ``token_mask`` in ``minivllm/ref/structured_output.py`` (and course task 20).
# EOS is allowed exactly in accepting states.
#
# A toy vocabulary shows the cases: ``-1`` takes two edges at once, ``7.``
# walks one edge and then dies on the ``.``, ``00`` dies on its second byte.

# %%
TOKENS = [b"-", b"0", b"7", b"12", b"-1", b"-0", b"00", b"7.", b"345", b"-x"]
vocab = TokenVocabulary(tuple(TOKENS) + (None,), eos_token_ids=(len(TOKENS),), kind="raw")
texts = ["", "-", "0", "12"]
masks = torch.stack([ref_so.token_mask(dfa, dfa.walk(0, t.encode()), vocab) for t in texts])
for text, mask in zip(texts, masks):
    names = [("EOS" if i == len(TOKENS) else TOKENS[i].decode()) for i in mask.nonzero().flatten()]
    print(f"after {text!r:6}: {names}")

# %%
fig, ax = plt.subplots(figsize=(7, 2.4))
ax.imshow(masks.int(), cmap="Greens", vmin=0, vmax=1.4, aspect="auto")
ax.set_xticks(range(len(TOKENS) + 1), [t.decode() for t in TOKENS] + ["EOS"])
ax.set_yticks(range(len(texts)), [f"after {t!r}" for t in texts])
for r in range(len(texts)):
    for c in range(len(TOKENS) + 1):
        ax.text(c, r, "✓" if masks[r, c] else "·", ha="center", va="center")
ax.set_title("allowed tokens (green) for -?(0|[1-9][0-9]*)")
fig.tight_layout()
fig.savefig(figure_path("13_token_masks.png"), dpi=120)

# %% [markdown]
# **Figure 13.2.** Token masks of the integer DFA for a ten-token vocabulary
# plus EOS, after four different texts. After ``""`` both ``-1`` and ``-0``
# are allowed (two edges in one token), ``7.`` is not although ``7`` is. After
# ``0`` only EOS: the integer is complete and nothing may follow. A character-
# level automaton is not enough to decide any of these: the walk has to go
# through every byte of every token.
#
# Half characters are the other trap. A byte-level BPE vocabulary (SmolLM2's,
# GPT-2's) contains tokens that stop in the middle of a UTF-8 character; in a
# byte-level DFA that is just a state like any other:

# %%
cafe = compile_dfa(parse_regex("caf(é|e)"))
half = b"\xc3"  # the first byte of é
state = cafe.walk(0, b"caf" + half)
print("after 'caf' + C3:", "alive" if state != DEAD else "dead",
      "| then A9 (é):", cafe.accepting[cafe.walk(state, b"\xa9")],
      "| then A8 (è):", cafe.walk(state, b"\xa8") == DEAD and "dead")

# %% [markdown]
# 3 · A JSON schema on SmolLM2's vocabulary
# -----------------------------------------
#
# A JSON schema without recursion is a regular language: the ref writes it out
# as a regex (``minivllm/structured_output/json_schema.py``, the way outlines
# does) in one fixed layout, the one ``json.dumps`` writes (separators ``", "``
# and ``": "``). Then the same construction, and the same walk, now over
# SmolLM2's 49152 tokens. How many tokens does each state allow?

# %%
from transformers import AutoTokenizer  # noqa: E402

from minivllm.model import registry  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(str(registry.ensure_model("smollm2")))
V = len(tokenizer)
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "中文"]},
                  "maxItems": 3}}, "required": ["name", "age", "languages"]}  # fmt: skip
ANSWER = json.dumps({"name": "Ada", "age": 36, "languages": ["English", "中文"]},
                    ensure_ascii=False)
print("the regex is", len(schema_to_regex(SCHEMA)), "characters long")
params = StructuredOutputsParams(json=SCHEMA)

start = time.perf_counter()
ref_backend = ref_so.StructuredOutputBackend(tokenizer, V)
fast_backend = fast_so.StructuredOutputBackend(tokenizer, V)
print(f"both backends built in {time.perf_counter() - start:.1f} s "
      f"(each reads the bytes of {V} tokens)")
answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
print(len(answer_ids) - 1, "tokens:", [tokenizer.decode([t]) for t in answer_ids[:-1]])

# %%
bitmask = ref_so.allocate_token_bitmask(1, V)
grammar = ref_backend.compile(params)
counts, prefixes, text = [], [], ""
for t in answer_ids:
    grammar.fill_bitmask(bitmask, 0)
    counts.append(int(unpack_bitmask(bitmask[0], V).sum()))
    prefixes.append(text)
    assert grammar.accept_tokens([t])
    text += tokenizer.decode([t]) if t != tokenizer.eos_token_id else ""
print("allowed tokens before each token of the answer:", counts)

# %%
fig, ax = plt.subplots(figsize=(7.5, 3.2))
ax.bar(range(len(counts)), counts, color="tab:green")
ax.set_yscale("log")
labels = ["EOS" if t == tokenizer.eos_token_id else json.dumps(tokenizer.decode([t]))[1:-1]
          for t in answer_ids]  # \uXXXX for the characters the default font lacks
ax.set_xticks(range(len(counts)), labels, rotation=70, fontsize=7)
ax.set_ylabel("allowed tokens (of 49152)")
ax.set_title("how many tokens the schema allows before each token of the answer")
fig.tight_layout()
fig.savefig(figure_path("13_allowed_counts.png"), dpi=120)

# %% [markdown]
# **Figure 13.3.** The number of SmolLM2 tokens the schema allows before each
# token of a valid answer (label: the token that comes next; log scale). In
# the structure (``{"``, the key names, ``": "``) only a handful are allowed,
# often a single one: the answer is forced. Inside the free string ``"Ada"``
# almost the whole vocabulary is (any token without a quote, backslash or
# control character, or one that closes the string and goes on with ``", "``).
# In the enum only the tokens that begin one of the three words.

# %% [markdown]
# 4 · The price of a mask: ref against fast
# -----------------------------------------
#
# The ref walks the whole vocabulary the first time any request reaches a DFA
# state, then keeps the row. The fast twin asks xgrammar, which parses with a
# pushdown automaton (so it also serves grammars and recursive schemas) and,
# when it compiles a constraint, precomputes for each parser position which
# tokens are always allowed, always refused, or depend on the stack. We time
# one step (``fill_bitmask`` + ``is_terminated`` + ``accept_tokens``) for each
# token of the answer: a cold request (the constraint just compiled), then a
# warm one (the same constraint again).


# %%
def step_times(backend, params, ids):
    bitmask = ref_so.allocate_token_bitmask(1, V)
    grammar, times = backend.compile(params), []
    for t in ids:
        start = time.perf_counter()
        grammar.fill_bitmask(bitmask, 0)
        grammar.is_terminated()
        grammar.accept_tokens([t])
        times.append(1e3 * (time.perf_counter() - start))
    return times


fresh = StructuredOutputsParams(json={**SCHEMA, "title": "fresh"})  # not compiled yet
timings = {}
for name, backend in (("ref", ref_backend), ("fast (xgrammar)", fast_backend)):
    timings[f"{name}, cold"] = step_times(backend, fresh, answer_ids)
    timings[f"{name}, warm"] = step_times(backend, fresh, answer_ids)
for name, ts in timings.items():
    print(f"{name:22s} mean {sum(ts) / len(ts):8.3f} ms per token, max {max(ts):8.3f} ms")

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
for (name, ts), style in zip(timings.items(), ["o-", "o:", "s-", "s:"]):
    ax.plot(range(len(ts)), ts, style, ms=3, label=name)
ax.set_yscale("log")
ax.set_xlabel("token of the answer")
ax.set_ylabel("ms per step (mask + accept)")
ax.set_title("SmolLM2 vocabulary, one JSON schema, one CPU thread")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(figure_path("13_mask_time.png"), dpi=120)

# %% [markdown]
# **Figure 13.4.** Time per step of constrained decoding along the answer,
# for each twin, on a cold request (the constraint just compiled) and a warm
# one (log scale). On the 2-core development machine (one thread, other work
# running) the ref's cold steps cost 30 to 100 ms each: one walk of the 49152
# tokens through the DFA for each state met for the first time (the dips are
# states already met in this answer: inside ``"Ada"``, between two digits).
# xgrammar's steps cost about 0.01 to 0.05 ms (0.5 ms at most, on the first
# and the last step), a thousand times less, cold or warm. On the warm request
# the ref only copies rows it has already computed, 0.01 to 0.05 ms, as cheap
# as xgrammar: precomputing every state's mask is what outlines does, and it
# serves small DFAs well; the cost is the first visit, which for large schemas
# (thousands of states) or grammars (no finite set of states at all) does not
# scale. The numbers printed above are this run's.

# %% [markdown]
# 5 · A JSON-schema answer from SmolLM2
# -------------------------------------
#
# The engine does all of the above for every constrained request of a batch
# (``minivllm/engine/structured.py``): it compiles the constraint when the
# request is added (a schema that does not compile is a ``ValueError`` before
# anything is queued), fills the constrained rows of a bitmask and applies it
# to the logits before each sampling step, feeds the sampled token to the
# request's grammar, and ends the request with ``finish_reason="stop"`` once
# nothing but EOS could follow. An unconstrained request in the same batch is
# not touched. Here is SmolLM2 asked the same question twice, greedily, once
# free and once under the schema above.

# %%
import jsonschema  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402

llm = LLM("smollm2", max_model_len=512)
messages = [{"role": "user", "content": "Describe a famous scientist as JSON: their name, "
             "their age and the languages they spoke."}]
answers = {}
for name, constraint in (("unconstrained", None), ("constrained", params)):
    sp = SamplingParams(temperature=0, max_tokens=80, structured_outputs=constraint)
    start = time.perf_counter()
    out = llm.chat(messages, sp, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    answers[name] = out.text
    print(f"{name} ({len(out.token_ids)} tokens, finish_reason={out.finish_reason!r}, "
          f"{1e3 * seconds / len(out.token_ids):.0f} ms per token):\n  {out.text}")

# %%
for name, text in answers.items():
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        print(f"{name}: valid under the schema")
    except (ValueError, jsonschema.ValidationError) as e:
        print(f"{name}: not a valid answer ({type(e).__name__})")
llm.shutdown()

# %% [markdown]
# Free, the model answers in prose (or in JSON with other keys, or cut in the
# middle): nothing a program could read. Constrained, the same model, the same
# greedy choice among the *allowed* tokens, writes a document the schema
# accepts, in ``json.dumps``'s spacing; what it says is still the model's
# (the facts may be wrong: the mask fixes the form, not the content). The cost
# per token is the mask: tens of microseconds with xgrammar against a decode
# step of tens of milliseconds, so the two runs above cost about the same per
# token (on a busy machine the printed times are noisy).
# ``python -m minivllm.bench structured`` measures it properly: ms per output
# token constrained against unconstrained at B = 1 and B = 64.
#
# Over HTTP the same constraint comes through OpenAI's ``response_format``
# (``{"type": "json_schema", "json_schema": {"name": ..., "schema": SCHEMA}}``),
# vLLM's ``structured_outputs`` extra, or ``tools`` with ``tool_choice``, whose
# answer comes back as OpenAI ``tool_calls`` (:doc:`/structured_outputs`).

# %% [markdown]
# What you built
# --------------
#
# A regex (or a JSON schema written as one) becomes a byte-level DFA; a token
# is allowed in a state when all its bytes walk through without dying, EOS
# when the state is accepting; the row of a state is computed once and copied
# after. The code is ``minivllm/structured_output/`` (regex, automata, JSON
# schema, vocabulary, bitmask), ``minivllm/ref/structured_output.py`` (the
# walk, the per-request ``Grammar``), ``minivllm/fast/structured_output.py``
# (xgrammar, and the C++ / Triton kernels that apply the bitmask), and, in the
# engine, ``minivllm/engine/structured.py`` (compile at add, mask before
# sampling, accept and finish after).

# %% [markdown]
# The test command
# ----------------
#
# The twins must allow exactly the same tokens at every step of random
# generations under hypothesis-drawn regexes and schemas, on a small BPE
# vocabulary and on SmolLM2's; the text that comes out must match:
#
# .. code-block:: bash
#
#    pytest -q tests/test_structured_output.py tests/test_structured_output_api.py \
#        tests/test_token_bitmask.py --backend=ref
#    pytest -q tests/test_structured_output.py tests/test_structured_output_api.py \
#        tests/test_token_bitmask.py --backend=fast
#
# and in the engine and the server, outputs validated by ``re``, ``jsonschema``
# and the choices, under preemption, chunked prefill, ``n > 1`` and beside
# unconstrained requests that must not change:
#
# .. code-block:: bash
#
#    pytest -q tests/test_structured_engine.py tests/test_structured_server.py --backend=fast

# %% [markdown]
# The course task
# ---------------
#
# Task 20 ``token_mask`` (:doc:`/course/20_token_mask`) has you write
# ``token_mask`` of ``minivllm/ref/structured_output.py`` in your student
# package: the DFA walk that builds a token mask.
#
# .. code-block:: bash
#
#    minivllm course make-student hw
#    PYTHONPATH=hw pytest -q --backend=minivllm_student --task token_mask
