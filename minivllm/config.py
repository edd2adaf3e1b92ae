"""Configuration dataclasses, each checked when it is made.

A bad value raises ``ValueError`` naming the field, the value and the allowed
range, before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the blocks needed for ``a`` tokens with ``b`` tokens per block."""
    return -(-a // b)


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


#: The range of ``block_size`` (tokens per KV block): the one place it is written.
BLOCK_SIZE_RANGE = (1, 256)


def check_block_size(block_size: object) -> None:
    """Raise ``ValueError`` unless ``block_size`` is an int in :data:`BLOCK_SIZE_RANGE`."""
    lo, hi = BLOCK_SIZE_RANGE
    _require(isinstance(block_size, int) and not isinstance(block_size, bool)
             and lo <= block_size <= hi, "block_size", block_size, f"an int in [{lo}, {hi}]")


def check_chunked_prefill(enable_chunked_prefill: bool, max_num_batched_tokens: int,
                          max_model_len: int | None) -> None:
    """Without chunked prefill a whole prompt must fit in one step's token budget."""
    if not enable_chunked_prefill and max_model_len is not None:
        _require(max_num_batched_tokens >= max_model_len, "max_num_batched_tokens",
                 max_num_batched_tokens,
                 f">= max_model_len={max_model_len} when chunked prefill is off")


@dataclass
class CacheConfig:
    """The paged KV cache: how many blocks, of how many tokens each.

    Args:
        block_size: tokens per KV block (vLLM's default is 16).
        num_blocks: blocks in the pool. The engine fills it in from the memory
            budget; host-side tests set it directly.
        enable_prefix_caching: reuse full blocks whose token prefix matches
            (automatic prefix caching, keyed by chained block hashes).
    """

    block_size: int = 16
    num_blocks: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        check_block_size(self.block_size)
        _require(self.num_blocks >= 0, "num_blocks", self.num_blocks, ">= 0")


#: vLLM's scheduling policies (``--scheduling-policy``).
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Continuous-batching limits for one engine step.

    Args:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks plus
            decodes).
        max_model_len: longest sequence (prompt + output) allowed.
        enable_chunked_prefill: split prompts longer than the remaining budget
            across steps; off means a prompt is scheduled whole or not at all.
        num_lookahead_tokens: KV slots reserved beyond each scheduled chunk
            (vLLM's name): a draft-model proposer writes its drafts' K/V there
            after the step. 0 without one (n-gram drafts need no slots until
            they are verified, and then they are scheduled tokens).
        policy: vLLM's ``scheduling_policy``: ``"fcfs"`` (first come, first served)
            or ``"priority"`` (waiting requests by ``(priority, arrival_time)``,
            lower first; the running request with the largest is preempted first).
        max_loras: most distinct LoRA adapters among the running requests (the
            device's adapter slots, ``LoRAConfig.max_loras``); None without LoRA.
            A waiting request whose adapter would be one too many is skipped at
            admission and keeps its place (vLLM's scheduler does the same).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    policy: str = "fcfs"
    max_loras: int | None = None

    def __post_init__(self) -> None:
        _require(self.policy in SCHEDULING_POLICIES, "policy", self.policy,
                 f"one of {SCHEDULING_POLICIES}")
        _require(0 <= self.num_lookahead_tokens <= 32, "num_lookahead_tokens",
                 self.num_lookahead_tokens, "in [0, 32]")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        _require(self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        _require(self.max_loras is None or (isinstance(self.max_loras, int)
                                            and self.max_loras >= 1),
                 "max_loras", self.max_loras, "None or an int >= 1")
        check_chunked_prefill(self.enable_chunked_prefill, self.max_num_batched_tokens,
                              self.max_model_len)
