"""From a regex tree to a byte-level DFA: Thompson's construction, then subsets.

What you learn here: how a regular expression becomes a table a token can be
walked through, one byte at a time.

1. **Characters become bytes.** Tokens of a byte-level BPE vocabulary are
   byte strings, and a token may end in the middle of a character (``é`` is
   ``C3 A9``; a token can hold just ``C3``). So the automaton reads bytes:
   each code-point range of a :class:`~.regex.CharSet` is spelled as a few
   sequences of byte ranges (:func:`utf8_sequences`: ``[U+0080, U+07FF]`` is
   ``[C2-DF][80-BF]``), exactly the UTF-8 encodings of the range.
2. **Thompson's construction** (:func:`build_nfa`) turns the tree into an NFA
   with one start and one accepting state: a byte range is an edge, a
   concatenation chains fragments, an alternation and a repetition add
   epsilon (empty) edges. Linear in the size of the tree.
3. **Subset construction** (:func:`compile_dfa`) turns the NFA into a DFA: a
   DFA state is the *set* of NFA states the input so far could have reached
   (closed under epsilon edges); reading byte ``b`` moves every member along
   its ``b`` edges. Bytes that no edge tells apart behave the same, so the
   256 bytes are first split into *byte classes* and one representative of
   each is tried (as RE2 and Rust's regex do), not all 256.
4. States from which no accepting state can be reached are **dead**: they
   become :data:`DEAD`, so a walk stops at the first byte that cannot lead to
   a match, and a token mask never allows a token that leads nowhere.
5. **Minimisation** (Moore's partition refinement, :func:`_minimize`): states
   that no continuation tells apart (both accept exactly the same suffixes)
   are merged. Every DFA state costs a walk of the whole vocabulary, so fewer
   states is fewer walks.

The result, :class:`DFA`, is a table ``transitions[state][byte] -> state``
with a flag per state saying whether the text so far is a full match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minivllm.structured_output.regex import Alt, CharSet, Concat, Node, Repeat

#: The state a walk falls into when no continuation can match.
DEAD = -1


class CompileTimeout(ValueError):
    """Building the DFA passed its deadline (a ``ValueError``: the request is refused)."""
#: Code points up to these need 1, 2 and 3 UTF-8 bytes; the rest (to 0x10FFFF) 4.
_UTF8_LIMITS = (0x7F, 0x7FF, 0xFFFF, 0x10FFFF)


def _encode(cp: int) -> bytes:
    # "surrogatepass": U+D800..U+DFFF get their 3-byte form, as xgrammar matches them.
    return chr(cp).encode("utf-8", "surrogatepass")


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The UTF-8 encodings of code points ``lo..hi`` as sequences of byte ranges.

    Each sequence is a list of ``(first byte, last byte)``, one per byte, and
    any choice of a byte from each range is the encoding of a code point in
    the range. E.g. ``utf8_sequences(0x80, 0x7FF) == [[(0xC2, 0xDF), (0x80, 0xBF)]]``.
    """
    out: list[list[tuple[int, int]]] = []
    start = 0
    for limit in _UTF8_LIMITS:  # first split by encoded length
        a, b = max(lo, start), min(hi, limit)
        if a <= b:
            _split(a, b, out)
        start = limit + 1
    return out


def _split(lo: int, hi: int, out: list) -> None:
    """Append sequences for ``lo..hi`` (all of one encoded length)."""
    n = len(_encode(lo))
    for i in range(1, n):
        # The low i continuation bytes carry 6 bits each. If lo and hi differ above them,
        # the range must start and end on full blocks of those bytes to be one sequence.
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m != 0:
                _split(lo, lo | m, out)
                _split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split(lo, (hi & ~m) - 1, out)
                _split(hi & ~m, hi, out)
                return
    out.append(list(zip(_encode(lo), _encode(hi))))


class NFA:
    """States with byte-range edges ``(lo, hi, target)`` and epsilon edges."""

    def __init__(self) -> None:
        self.byte_edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []

    def new_state(self) -> int:
        self.byte_edges.append([])
        self.eps.append([])
        return len(self.eps) - 1


def build_nfa(node: Node) -> tuple[NFA, int, int]:
    """Thompson's construction: ``(nfa, start, accept)`` for the tree ``node``."""
    nfa = NFA()
    start, accept = _fragment(nfa, node)
    return nfa, start, accept


def _fragment(nfa: NFA, node: Node) -> tuple[int, int]:
    """Add the states of ``node`` to ``nfa``; return its (start, accept) states."""
    s, f = nfa.new_state(), nfa.new_state()
    if isinstance(node, CharSet):
        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                cur = s
                for k, (a, b) in enumerate(seq):
                    nxt = f if k == len(seq) - 1 else nfa.new_state()
                    nfa.byte_edges[cur].append((a, b, nxt))
                    cur = nxt
    elif isinstance(node, Concat):
        cur = s
        for part in node.parts:
            ps, pf = _fragment(nfa, part)
            nfa.eps[cur].append(ps)
            cur = pf
        nfa.eps[cur].append(f)
    elif isinstance(node, Alt):
        for option in node.options:
            os_, of = _fragment(nfa, option)
            nfa.eps[s].append(os_)
            nfa.eps[of].append(f)
    elif isinstance(node, Repeat):
        cur = s
        for _ in range(node.min):  # the required copies, chained
            ps, pf = _fragment(nfa, node.node)
            nfa.eps[cur].append(ps)
            cur = pf
        if node.max is None:  # then a loop: skip it, or go round as often as you like
            ps, pf = _fragment(nfa, node.node)
            nfa.eps[cur].extend([ps, f])
            nfa.eps[pf].extend([ps, f])
        else:  # then max - min optional copies, each may end the repetition early
            for _ in range(node.max - node.min):
                ps, pf = _fragment(nfa, node.node)
                nfa.eps[cur].extend([ps, f])
                cur = pf
            nfa.eps[cur].append(f)
    else:
        raise TypeError(f"not a regex node: {node!r}")
    return s, f


def _closure(nfa: NFA, states) -> frozenset[int]:
    """Every NFA state reachable from ``states`` by epsilon edges (``states`` included)."""
    seen = set(states)
    stack = list(states)
    while stack:
        for t in nfa.eps[stack.pop()]:
            if t not in seen:
                seen.add(t)
                stack.append(t)
    return frozenset(seen)


def byte_classes(nfa: NFA) -> list[int]:
    """A representative byte of every class of bytes no edge of ``nfa`` tells apart."""
    cuts = {0}
    for edges in nfa.byte_edges:
        for lo, hi, _ in edges:
            cuts.add(lo)
            if hi < 255:
                cuts.add(hi + 1)
    return sorted(cuts)  # each cut starts a class; its first byte represents it


@dataclass(frozen=True)
class DFA:
    """A byte-level DFA: ``transitions[state][byte]`` is the next state or :data:`DEAD`.

    ``accepting[state]``: the bytes read so far are a full match. State 0 is
    the start. Every state can still reach an accepting state.
    """

    transitions: tuple[tuple[int, ...], ...]
    accepting: tuple[bool, ...]

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading ``data`` from ``state`` (:data:`DEAD` if no match can follow)."""
        for b in data:
            state = self.transitions[state][b]
            if state == DEAD:
                return DEAD
        return state


def compile_dfa(node: Node, max_states: int = 50_000, deadline: float | None = None) -> DFA:
    """The DFA of regex tree ``node``, by subset construction; dead states removed.

    ``ValueError`` if it would need more than ``max_states`` states, if
    ``time.monotonic()`` passes ``deadline`` while building, or if the
    language is empty (no string matches).
    """
    nfa, start, accept = build_nfa(node)
    reps = byte_classes(nfa)
    bounds = reps[1:] + [256]
    ids = {_closure(nfa, [start]): 0}
    sets = list(ids)
    rows: list[list[int]] = []
    while len(rows) < len(sets):
        if deadline is not None and time.monotonic() > deadline:
            raise CompileTimeout(f"building the DFA took too long ({len(sets)} states so far)")
        current = sets[len(rows)]
        row = [DEAD] * 256
        for rep, end in zip(reps, bounds):
            moved = [t for s in current for lo, hi, t in nfa.byte_edges[s] if lo <= rep <= hi]
            if not moved:
                continue
            target = _closure(nfa, moved)
            if target not in ids:
                if len(sets) >= max_states:
                    raise ValueError(f"the DFA needs more than max_states={max_states} states")
                ids[target] = len(sets)
                sets.append(target)
            row[rep:end] = [ids[target]] * (end - rep)
        rows.append(row)
    accepting = [accept in s for s in sets]
    return _minimize(_prune(rows, accepting), reps)


def _prune(rows: list[list[int]], accepting: list[bool]) -> DFA:
    """Drop states that cannot reach an accepting state; renumber (start stays 0)."""
    incoming: list[set[int]] = [set() for _ in rows]
    for s, row in enumerate(rows):
        for t in row:
            if t != DEAD:
                incoming[t].add(s)
    live = {s for s, acc in enumerate(accepting) if acc}
    stack = list(live)
    while stack:
        for s in incoming[stack.pop()]:
            if s not in live:
                live.add(s)
                stack.append(s)
    if 0 not in live:
        raise ValueError("no string matches the constraint (its language is empty)")
    order = [s for s in range(len(rows)) if s in live]
    new_id = {s: i for i, s in enumerate(order)}
    transitions = tuple(tuple(new_id.get(t, DEAD) for t in rows[s]) for s in order)
    return DFA(transitions, tuple(accepting[s] for s in order))


def _minimize(dfa: DFA, reps: list[int]) -> DFA:
    """Merge equivalent states (Moore): split blocks until no byte tells members apart.

    Start from two blocks, accepting and not; a state's signature is its block
    and the blocks its transitions lead to (one byte per byte class, ``reps``,
    suffices); states with different signatures go to different blocks; repeat
    until nothing splits. The start state's block becomes state 0.
    """
    block = [int(a) for a in dfa.accepting]
    while True:
        signatures = [(block[s], tuple(-1 if row[b] == DEAD else block[row[b]] for b in reps))
                      for s, row in enumerate(dfa.transitions)]
        ids: dict[tuple, int] = {}
        new_block = [ids.setdefault(sig, len(ids)) for sig in signatures]  # state 0 -> block 0
        if len(ids) == len(set(block)):
            break
        block = new_block
    block = new_block
    first = {}  # one member per block, to read its row
    for s, b in enumerate(block):
        first.setdefault(b, s)
    transitions = tuple(tuple(DEAD if t == DEAD else block[t] for t in dfa.transitions[first[b]])
                        for b in range(len(first)))
    return DFA(transitions, tuple(dfa.accepting[first[b]] for b in range(len(first))))
