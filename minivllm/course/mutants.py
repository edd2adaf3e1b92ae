"""Realistic buggy solutions, and the self-check that the tests catch every one.

Each :class:`Mutant` is the solution package (the ref, made into a package of
its own by :func:`~minivllm.course.student.make_student` with
``solution=True``) with one line changed, the way students and new kernels
actually get things wrong. ``minivllm course selfcheck`` builds each mutant
and grades its task: the task must fail. A mutant that survives means the
task's tests cannot tell that bug from a correct answer, so they must be
strengthened (never the mutant weakened).

A mutant's ``find`` text must occur exactly once in its module; when the ref
is rewritten, :func:`apply` says which mutant no longer applies.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from minivllm.course import child
from minivllm.course.manifest import get_task
from minivllm.course.student import make_student


@dataclass(frozen=True)
class Mutant:
    """One plausible bug: ``find`` replaced by ``replace`` in ``module``.py of the solution."""

    name: str
    task: str
    module: str
    find: str
    replace: str
    why: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant("free_drops_shared_block", "allocator", "block_allocator",
           "self.ref_counts[block_id] -= 1", "self.ref_counts[block_id] = 0",
           "free() of a shared block drops its ref count straight to 0"),
    Mutant("touch_keeps_block_in_free_queue", "allocator", "block_allocator",
           "self._remove_free(block_id)  # a hit on a free block: out of the middle", "pass",
           "a cache hit on a free block leaves it in the free queue"),
    Mutant("allocate_from_tail", "allocator", "block_allocator",
           "self.free_block_queue.pop(0)", "self.free_block_queue.pop()",
           "allocation recycles the most recently freed block (MRU, not LRU)"),
    Mutant("lookup_skips_misses", "prefix_caching", "block_allocator",
           "break  # chained hashes", "continue  # chained hashes",
           "the prefix look-up goes on after a miss"),
    Mutant("evict_keeps_hash", "prefix_caching", "block_allocator",
           "del self.cached_block_hash_to_block[block_hash]\n", "pass\n",
           "recycling a cached block leaves its hash pointing at it"),
    Mutant("slot_offset_wrong", "block_table", "block_table",
           "slots.append(table[pos // bs] * bs + pos % bs)",
           "slots.append(table[pos // bs] * bs + pos // bs)",
           "slot = block * block_size + pos // block_size (offset inside the block wrong)"),
    Mutant("hash_ignores_parent", "kv_cache_manager", "kv_cache_manager",
           "parent = hashes[i - 1] if i > 0 else request.root_block_hash", "parent = None",
           "a generated block is hashed without its parent"),
    Mutant("full_hit_computes_nothing", "kv_cache_manager", "kv_cache_manager",
           "max_hit_blocks = (request.num_tokens - 1) // self.block_size",
           "max_hit_blocks = request.num_tokens // self.block_size",
           "a fully cached prompt leaves no token to compute"),
    Mutant("admit_after_preempt", "scheduler", "scheduler",
           "token_budget > 0 and not preempted_req_ids:", "token_budget > 0:",
           "waiting requests are admitted in a step that preempted"),
    Mutant("preempt_head", "scheduler", "scheduler",
           "for r in reversed(self.running)", "for r in self.running",
           "preemption picks the oldest running request instead of the newest"),
    Mutant("lora_slots_ignored", "scheduler", "scheduler",
           "if not self._has_lora_slot(request):", "if False:",
           "admission ignores max_loras: the running requests need more adapter slots than exist"),
    Mutant("lora_passed_over_to_the_back", "scheduler", "scheduler",
           "self.waiting.extendleft(reversed(skipped))", "self.waiting.extend(skipped)",
           "a request passed over for want of an adapter slot loses its place in line"),
    Mutant("eps_outside_sqrt", "rms_norm", "layernorm",
           "normed = x32 * torch.rsqrt(mean_square + eps)",
           "normed = x32 / (torch.sqrt(mean_square) + eps)",
           "RMSNorm with eps outside the square root"),
    Mutant("fused_norms_x_not_sum", "fused_add_rms_norm", "layernorm",
           "return rms_norm(new_residual, weight, eps), new_residual",
           "return rms_norm(x, weight, eps), new_residual",
           "fused add+RMSNorm normalises x instead of x + residual"),
    Mutant("rope_wrong_pairing", "rope", "rotary",
           "a_idx, b_idx = slice(0, half), slice(half, rotary_dim)",
           "a_idx, b_idx = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)",
           "NeoX-style RoPE pairs neighbours (GPT-J pairing)"),
    Mutant("rope_sin_sign", "rope", "rotary",
           "out[..., a_idx] = a * cos - b * sin", "out[..., a_idx] = a * cos + b * sin",
           "RoPE rotates the first half the wrong way"),
    Mutant("silu_of_up", "silu_and_mul", "activation",
           "return F.silu(gate) * up", "return F.silu(up) * gate",
           "SiLU applied to the up projection instead of the gate"),
    Mutant("slot_zero_skipped", "cache_write", "cache_write",
           "valid = slot_mapping >= 0", "valid = slot_mapping > 0",
           "cache slot 0 treated as padding"),
    Mutant("causal_off_by_one", "paged_attention", "attention",
           "visible = k_pos[None, :] <= q_pos[:, None]",
           "visible = k_pos[None, :] <= q_pos[:, None] + 1",
           "a prefill row also attends to the next position (causal mask off by one)"),
    Mutant("gqa_tiled", "paged_attention", "attention",
           "kv_head = torch.arange(num_heads, device=query.device) // group",
           "kv_head = torch.arange(num_heads, device=query.device) % k_cache.shape[2]",
           "GQA: query head h reads KV head h % num_kv_heads instead of h // group"),
    Mutant("mask_ignores_context", "paged_attention", "attention",
           "q_pos = context_len + torch.arange(query_len, device=query.device)",
           "q_pos = torch.arange(query_len, device=query.device)",
           "the causal mask is not shifted by the cached context (chunks and decodes see too little)"),
    Mutant("top_p_strict", "sampler_filters", "sampler",
           "remove_sorted = (mass_before >= top_p[:, None])",
           "remove_sorted = (mass_before > top_p[:, None])",
           "top-p keeps the token that starts exactly at the boundary (> instead of >=)"),
    Mutant("min_p_le", "sampler_filters", "sampler",
           "probs < min_p[:, None] * max_prob", "probs <= min_p[:, None] * max_prob",
           "min-p drops the token exactly at the threshold"),
    Mutant("top_k_drops_ties", "sampler_filters", "sampler",
           "sorted_logits = logits.sort(dim=-1, descending=True, stable=True).values  # (N, V)\n"
           "    kth_largest = sorted_logits.gather(1, (top_k - 1)[:, None])  # (N, 1)\n"
           "    return logits.masked_fill(logits < kth_largest, _NEG_INF)",
           "order = logits.argsort(dim=-1, descending=True, stable=True)  # (N, V)\n"
           "    rank = order.argsort(dim=-1)\n"
           "    return logits.masked_fill(rank >= top_k[:, None], _NEG_INF)",
           "top-k keeps exactly k tokens, dropping ties with the k-th"),
    Mutant("repetition_output_only", "sampler_penalties", "sampler",
           "seen = in_prompt | in_output", "seen = in_output",
           "the repetition penalty ignores the prompt"),
    Mutant("logprob_rank_strict", "sampler_penalties", "sampler",
           "ranks = (logprobs >= sampled_logprob).sum(dim=-1)",
           "ranks = (logprobs > sampled_logprob).sum(dim=-1)",
           "the sampled token's rank counts only strictly better tokens (0-based)"),
    Mutant("row_bias_per_rank", "tp_linear", "linear",
           "y = y + self.bias  # once, after the reduce (not tp times)",
           "y = y + self.tp_size * self.bias",
           "the row-parallel bias is added on every rank before the all-reduce"),
    Mutant("kv_replica_mod", "tp_linear", "linear",
           "first_head = (rank // self.num_kv_head_replicas) * heads",
           "first_head = (rank % self.num_kv_head_replicas) * heads",
           "with tp > num_kv_heads, rank r holds KV head r % replicas instead of r // replicas"),
    Mutant("vocab_range_inclusive", "tp_linear", "linear",
           "mine = (input_ids >= start) & (input_ids < start + rows)",
           "mine = (input_ids >= start) & (input_ids <= start + rows)",
           "a token id on a rank boundary is looked up by two ranks"),
    Mutant("decode_acc_not_rescaled", "triton_decode", "attention_decode",
           "acc = acc * alpha[:, None] + pv",
           "acc = acc + pv",
           "the online softmax rescales the sum of exps but not the accumulated values"),
    Mutant("decode_tail_unmasked", "triton_decode", "attention_decode",
           'scores = tl.where(valid[None, :], scores, float("-inf"))', "scores = scores",
           "the last tile's padding positions join the softmax with score 0"),
    Mutant("cpp_silu_sign", "cpp_silu_and_mul", "csrc/activation.cpp",
           "g / (1.f + fast_exp(-g))", "g / (1.f + fast_exp(g))",
           "silu(g) = g / (1 + exp(g)): the sign of the exponent"),
    Mutant("int8_scale_over_255", "int8_gemv", "quantization",
           "scales = groups.abs().amax(dim=-1) / 127", "scales = groups.abs().amax(dim=-1) / 255",
           "the int8 scale spreads max|W| over 255 levels: weights clip at half their range"),
    Mutant("int8_truncates", "int8_gemv", "quantization",
           "q = torch.round(groups * inverse.unsqueeze(-1)).clamp(-127, 127)",
           "q = (groups * inverse.unsqueeze(-1)).trunc().clamp(-127, 127)",
           "the quantizer truncates towards zero instead of rounding to the nearest level"),
    Mutant("gemv_scale_wrong_axis", "int8_gemv", "quantization",
           "return (partial * scales).sum(dim=-1)  # (M, N)",
           "return partial.sum(dim=-1) * scales.mean(dim=-1)  # (M, N)",
           "the GEMV applies one averaged scale per row instead of each group's own"),
    Mutant("recover_from_p", "rejection_sampler", "rejection_sampler",
           "residual = torch.clamp(p - q, min=0)", "residual = p.clone()",
           "a rejected draft is replaced by a token from p instead of norm(max(p - q, 0))"),
    Mutant("greedy_emits_rejected_draft", "rejection_sampler", "rejection_sampler",
           "tokens.append(target)", "tokens.append(draft)",
           "greedy verification emits the rejected draft instead of the target's argmax"),
    Mutant("fork_forgets_ref_count", "fork_cow", "kv_cache_manager",
           "self.block_allocator.touch(blocks)  # one more holder each: the child", "pass",
           "fork gives the child the parent's blocks without taking a reference on them"),
    Mutant("cow_keeps_shared_block", "fork_cow", "kv_cache_manager",
           "            blocks[i] = new\n", "            pass\n",
           "copy-on-write records the copy but the request keeps (and writes into) the shared block"),
    Mutant("cow_copies_into_shared", "fork_cow", "kv_cache_manager",
           "self.blocks_to_copy.append((old, new))", "self.blocks_to_copy.append((new, old))",
           "copy-on-write copies the fresh block over the shared one (src and dst swapped)"),
    Mutant("mask_checks_first_byte_only", "token_mask", "structured_output",
           "        for byte in data:\n", "        for byte in data[:1]:\n",
           "a token is allowed when its first byte is, whatever its other bytes do"),
    Mutant("mask_needs_full_match", "token_mask", "structured_output",
           "            allowed_ids.append(token_id)\n",
           "            if dfa.accepting[s]:\n                allowed_ids.append(token_id)\n",
           "a token must complete a match, not just extend a prefix of one"),
    Mutant("mask_eos_always", "token_mask", "structured_output",
           "    if dfa.accepting[state]:\n", "    if True:\n",
           "EOS is allowed in every state, not only where the output may end"),
    Mutant("lora_no_adapter_uses_last_slot", "lora_delta", "lora",
           "            if slot < 0:  # this token's request runs the base model alone\n"
           "                continue\n", "",
           "slot -1 is not skipped: a[-1] gives a base-model token the last slot's adapter"),
    Mutant("lora_slices_overlap", "lora_delta", "lora",
           "        offset += width\n", "",
           "every output slice (q, k, v) is added into the first slice's columns"),
    Mutant("lora_scaling_ignored", "lora_delta", "lora",
           "y[t, offset : offset + width] += scale[slot] * delta",
           "y[t, offset : offset + width] += delta",
           "the adapter's scaling (alpha / r) is never applied"),
)


def apply(mutant: Mutant, package_dir: Path) -> None:
    """Edit ``package_dir/<module>.py`` (or ``<module>`` itself, a C++ source such as
    ``csrc/activation.cpp``) in place; ``ValueError`` if the mutant no longer applies."""
    path = package_dir / (mutant.module if "." in mutant.module else f"{mutant.module}.py")
    text = path.read_text()
    found = text.count(mutant.find)
    if found != 1:
        raise ValueError(f"mutant {mutant.name}: {mutant.find!r} occurs {found} times in "
                         f"{path.name} (must be once): update the mutant to the new solution")
    path.write_text(text.replace(mutant.find, mutant.replace))


def build(mutant: Mutant, dest: Path) -> str:
    """Write the mutant as package ``mutant_<name>`` under ``dest``; return its import name."""
    package = f"mutant_{mutant.name}"
    pkg_dir = make_student(dest, package, solution=True, overwrite=True)
    apply(mutant, pkg_dir)
    return package


@dataclass
class SelfCheckResult:
    """One mutant's fate: caught (its task failed) or survived."""

    mutant: Mutant
    caught: bool
    seconds: float
    evidence: str


def _check_one(mutant: Mutant, tmp: str) -> SelfCheckResult:
    from minivllm.course.grade import run_tests, score

    task = get_task(mutant.task)
    start = time.perf_counter()
    report, _ = run_tests(f"mutant_{mutant.name}", [task], pythonpath=[tmp], stop_early=True)
    (result,) = score([task], report)
    evidence = result.failures[0]["message"] if result.failures else "all tests passed"
    return SelfCheckResult(mutant, result.score == 0, time.perf_counter() - start,
                           " ".join(evidence.split())[:200])


def selfcheck(names: list[str] | None = None, tasks: list[str] | None = None, jobs: int = 2,
              log=print) -> list[SelfCheckResult]:
    """Grade every mutant (or those named / of those tasks) on its task; report each.

    ``jobs`` mutants are graded at once (each in its own pytest process).
    """
    from concurrent.futures import ThreadPoolExecutor

    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    chosen = [m for m in MUTANTS if (not names or m.name in names)
              and (not tasks or m.task in tasks)]
    if names and len(chosen) != len(set(names)):
        known = ", ".join(m.name for m in MUTANTS)
        raise ValueError(f"unknown mutant in {names}; the mutants are: {known}")
    for name in tasks or []:
        get_task(name)  # a clear error for an unknown task
    with tempfile.TemporaryDirectory(prefix="minivllm-mutants-") as tmp:
        for mutant in chosen:
            build(mutant, Path(tmp))
        with ThreadPoolExecutor(jobs) as pool:
            try:
                results = list(pool.map(lambda m: _check_one(m, tmp), chosen))
            except BaseException:  # Ctrl-C, SIGTERM: end the children, then the threads
                child.stop_all()
                raise
    for r in results:
        log(f"{'caught  ' if r.caught else 'SURVIVED'} {r.mutant.task:<18} {r.mutant.name:<32} "
            f"{r.seconds:5.1f}s  {r.evidence[:80]}")
    return results
