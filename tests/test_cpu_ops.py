"""The C++ CPU kernels (``torch.ops.minivllm.*``) against float64 oracles and the ref.

Each op is called through its fast-twin wrapper (``minivllm.fast.<component>.*_cpu``)
on awkward shapes: head dims 24/40/80/96/128, GQA groups 1/2/4/7, block sizes
1/3/16/32, odd lengths, contexts ending on and just past a block boundary,
chunked prefill over a cached prefix, unused cache slots poisoned with NaN
(any read outside a sequence's blocks shows), float32 and bfloat16, and
RMSNorm rows so small that ``eps`` dominates. The oracles are written here from
the formulas, in float64; the ref twin is the second witness.

These tests run under every ``--backend`` (the ops are always tested where they
build) and skip, with the build's reason, where they do not.
Run: ``pytest -q tests/test_cpu_ops.py``.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_utils import assert_close, examples

import minivllm.ref.activation as ref_activation
import minivllm.ref.attention as ref_attention
import minivllm.ref.layernorm as ref_layernorm
import minivllm.ref.rotary as ref_rotary
from minivllm import backend, cpu_target
from minivllm.fast import activation, attention, cache_write, cpu_ops, layernorm, rotary
from minivllm.metadata import AttentionMetadata

pytestmark = pytest.mark.skipif(not cpu_ops.available(),
                                reason=f"the C++ ops did not build: {cpu_ops.unavailable_reason()}")

HEAD_DIMS = [24, 40, 80, 96, 128]
GROUPS = [1, 2, 4, 7]
BLOCK_SIZES = [1, 3, 16, 32]
DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- attention
def paged_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed):
    """``seqs``: (query_len, seq_len) pairs. Blocks in random order, unused slots NaN."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(s / block_size) for _, s in seqs]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32)
    k = torch.full((num_blocks * block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v = k.clone()
    slots, first = [], 0
    for i, (_, seq_len) in enumerate(seqs):
        blocks = perm[first : first + per_seq[i]]
        first += per_seq[i]
        tables[i, : len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(seq_len)
        s = blocks[pos // block_size] * block_size + pos % block_size
        slots.append(s)
        k[s] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v[s] = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
    query = torch.randn(sum(q for q, _ in seqs), num_kv_heads * group, head_dim,
                        generator=g).to(dtype)  # fmt: skip
    md = AttentionMetadata.build([q for q, _ in seqs], [s for _, s in seqs], tables,
                                 torch.full((query.shape[0],), -1, dtype=torch.int64))  # fmt: skip
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return query, k.view(shape), v.view(shape), md, slots


def attention_oracle(query, k_cache, v_cache, seqs, slots, scale):
    """softmax(q k^T * scale + causal mask shifted by the context) v, in float64, head by head."""
    k_flat = k_cache.flatten(0, 1).double()
    v_flat = v_cache.flatten(0, 1).double()
    group = query.shape[1] // k_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    start = 0
    for (q_len, seq_len), s in zip(seqs, slots):
        ctx = seq_len - q_len
        for h in range(query.shape[1]):
            q = query[start : start + q_len, h].double()  # (q_len, D)
            k, v = k_flat[s, h // group], v_flat[s, h // group]  # (seq_len, D)
            scores = q @ k.T * scale
            future = torch.arange(seq_len)[None, :] > ctx + torch.arange(q_len)[:, None]
            scores[future] = -math.inf
            out[start : start + q_len, h] = torch.softmax(scores, dim=-1) @ v
        start += q_len
    return out


def check_attention(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed):
    query, k_cache, v_cache, md, slots = paged_batch(seqs, num_kv_heads, group, head_dim,
                                                     block_size, dtype, seed)  # fmt: skip
    scale = head_dim**-0.5
    out = attention.paged_attention_cpu(query, k_cache, v_cache, md, scale)  # NaN-poisoned cache
    assert out.shape == query.shape and out.dtype == dtype
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    assert_close(out, attention_oracle(query, clean_k, clean_v, seqs, slots, scale), dtype,
                 scale=1.5)  # fmt: skip
    assert_close(out, ref_attention.paged_attention(query, clean_k, clean_v, md, scale), dtype)


def seq_lists(max_context=80, max_query=40):
    """Decodes, prefills, and chunks over a cached prefix, 1 to 4 sequences."""
    one = st.tuples(st.one_of(st.just(1), st.integers(1, max_query)),
                    st.integers(0, max_context)).map(lambda t: (t[0], t[0] + t[1]))  # fmt: skip
    return st.lists(one, min_size=1, max_size=4)


@settings(max_examples=examples(40))
@given(seqs=seq_lists(), num_kv_heads=st.integers(1, 3), group=st.sampled_from(GROUPS),
       head_dim=st.sampled_from(HEAD_DIMS), block_size=st.sampled_from(BLOCK_SIZES),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_attention_mixed_batches(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed):
    check_attention(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed)


@pytest.mark.parametrize("block_size", [3, 16, 32])
def test_attention_block_boundaries(block_size):
    """Contexts ending exactly on, one before and one past a block boundary; long decodes."""
    b = block_size
    seqs = [(1, b), (1, b + 1), (1, 2 * b - 1), (1, 300), (b, 2 * b), (b + 1, 3 * b + 1)]
    check_attention(seqs, 2, 2, 40, block_size, torch.float32, seed=block_size)


def test_attention_chunked_prefill_over_cached_prefix():
    """Query tiles that start mid-sequence: a 70-token chunk after a 45-token prefix, GQA 7."""
    check_attention([(70, 115), (1, 5), (33, 33)], 1, 7, 24, 16, torch.bfloat16, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_decode_split_by_kv_head_gives_the_batched_bits(dtype):
    """Batch-1 decode has one work item, which the kernel cuts by KV head so both threads
    work; heads are independent, so the sequence's output is bit for bit its output in a
    batch of more sequences than threads (not cut)."""
    seqs = [(1, 300), (1, 17), (1, 40), (1, 5)]
    query, k_cache, v_cache, md, _ = paged_batch(seqs, 3, 3, 40, 16, dtype, seed=11)
    scale = 40**-0.5
    batched = attention.paged_attention_cpu(query, k_cache, v_cache, md, scale)
    alone_md = AttentionMetadata.build([1], [300], md.block_tables[:1],
                                       torch.full((1,), -1, dtype=torch.int64))
    alone = attention.paged_attention_cpu(query[:1], k_cache, v_cache, alone_md, scale)
    assert torch.equal(alone, batched[:1])


def test_attention_reads_a_strided_query():
    """The model passes q as a view of its fused qkv projection (token stride > H * D)."""
    seqs = [(5, 40), (1, 17), (12, 12), (1, 70)]
    query, k_cache, v_cache, md, slots = paged_batch(seqs, 2, 3, 40, 16, torch.float32, seed=5)
    qkv = torch.randn(query.shape[0], query.shape[1] + 4, 40)  # (T, H + 2 H_kv, D)
    qkv[:, : query.shape[1]] = query
    view = qkv[:, : query.shape[1]]  # (T, H, D) with token stride (H + 4) * D
    assert not view.is_contiguous()
    scale = 40**-0.5
    out = attention.paged_attention_cpu(view, k_cache, v_cache, md, scale)
    clean_k, clean_v = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    assert_close(out, attention_oracle(query, clean_k, clean_v, seqs, slots, scale),
                 torch.float32, scale=1.5)  # fmt: skip


# ----------------------------------------------------------------------------- cache write
@settings(max_examples=examples(25))
@given(num_tokens=st.integers(1, 40), num_kv_heads=st.integers(1, 3),
       head_dim=st.sampled_from(HEAD_DIMS), block_size=st.sampled_from(BLOCK_SIZES),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_reshape_and_cache(num_tokens, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(num_tokens / block_size) + 2
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]  # strided views
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slot_mapping = torch.where(torch.rand(num_tokens, generator=g) < 0.3, -1, slots)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):  # the oracle: one token at a time
        if slot >= 0:
            k_exp[slot // block_size, slot % block_size] = key[t]
            v_exp[slot // block_size, slot % block_size] = value[t]
    cache_write.reshape_and_cache_cpu(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_exp, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_exp, equal_nan=True, rtol=0, atol=0)


def test_reshape_and_cache_rejects_a_slot_outside_the_cache():
    cache = torch.zeros(2, 4, 1, 8)
    key = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside"):
        cache_write.reshape_and_cache_cpu(key, key, cache, cache.clone(), torch.tensor([0, 8]))


# ----------------------------------------------------------------------------- RMSNorm
def rms_oracle(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@settings(max_examples=examples(25))
@given(rows=st.integers(1, 37), hidden=st.sampled_from([8, 24, 130, 576, 1000]),
       magnitude=st.sampled_from([1e-4, 1e-3, 1.0, 30.0]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_rms_norm(rows, hidden, magnitude, dtype, seed):
    """Magnitudes 1e-4 and 1e-3 make mean(x^2) comparable to eps: dropping eps fails."""
    g = torch.Generator().manual_seed(seed)
    eps = 1e-6
    x = (torch.randn(rows, hidden, generator=g) * magnitude).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    out = layernorm.rms_norm_cpu(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, rms_oracle(x, w, eps), dtype, scale=2)
    assert_close(out, ref_layernorm.rms_norm(x, w, eps), dtype)


@settings(max_examples=examples(25))
@given(rows=st.integers(1, 37), hidden=st.sampled_from([8, 24, 130, 576, 1000]),
       magnitude=st.sampled_from([1e-3, 1.0]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_fused_add_rms_norm_in_place(rows, hidden, magnitude, dtype, seed):
    """Returns (norm(x + r), x + r), written into x and r themselves."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * magnitude).to(dtype)
    r = (torch.randn(rows, hidden, generator=g) * magnitude).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    x_in, r_in = x.clone(), r.clone()
    out, new_r = layernorm.fused_add_rms_norm_cpu(x_in, r_in, w, 1e-6)
    assert out.data_ptr() == x_in.data_ptr() and new_r.data_ptr() == r_in.data_ptr()
    s = x.double() + r.double()
    assert_close(new_r, s, dtype)
    assert_close(out, rms_oracle(new_r, w, 1e-6), dtype, scale=2)
    ref_out, ref_r = ref_layernorm.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert_close(new_r, ref_r, dtype)
    assert_close(out, ref_out, dtype)


# ----------------------------------------------------------------------------- SiLU-and-mul
@settings(max_examples=examples(25))
@given(rows=st.integers(1, 9), inter=st.sampled_from([1, 7, 24, 1100, 1536, 2051]),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_silu_and_mul(rows, inter, dtype, seed):
    """Gates up to |x| ~ 40 exercise both tails of the polynomial exp."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * inter, generator=g) * 8).to(dtype)
    out = activation.silu_and_mul_cpu(x)
    gate, up = x.double()[:, :inter], x.double()[:, inter:]
    assert_close(out, gate / (1 + torch.exp(-gate)) * up, dtype, scale=2)
    assert_close(out, ref_activation.silu_and_mul(x), dtype)


# ----------------------------------------------------------------------------- RoPE
def rope_oracle(positions, x, cache, is_neox):
    """Rotate feature pair (a, b) as the complex number a + ib times e^(i * angle)."""
    half = cache.shape[-1] // 2
    cos, sin = cache[positions, :half].double(), cache[positions, half:].double()
    x64 = x.double()
    pairs = (slice(0, half), slice(half, 2 * half)) if is_neox else \
        (slice(0, 2 * half, 2), slice(1, 2 * half, 2))  # fmt: skip
    z = torch.complex(x64[..., pairs[0]], x64[..., pairs[1]]) * torch.complex(cos, sin)[:, None]
    out = x64.clone()
    out[..., pairs[0]], out[..., pairs[1]] = z.real, z.imag
    return out


@settings(max_examples=examples(25))
@given(tokens=st.integers(1, 17), num_kv_heads=st.integers(1, 3), group=st.sampled_from(GROUPS),
       head_dim=st.sampled_from(HEAD_DIMS), partial=st.booleans(), is_neox=st.booleans(),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))  # fmt: skip
def test_rotary(tokens, num_kv_heads, group, head_dim, partial, is_neox, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rot = head_dim // 2 if partial and head_dim % 4 == 0 else head_dim
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(torch.arange(300).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (300, rot)
    positions = torch.randint(0, 300, (tokens,), generator=g)
    qkv = torch.randn(tokens, (group + 2) * num_kv_heads, head_dim, generator=g).to(dtype)
    q, k = qkv[:, : group * num_kv_heads], qkv[:, group * num_kv_heads : -num_kv_heads]
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = rotary.apply_rotary_emb_cpu(positions, q, k, cache, is_neox)
    assert q_out.data_ptr() == q.data_ptr()  # in place, on the strided views
    assert_close(q_out, rope_oracle(positions, q0, cache, is_neox), dtype, scale=2)
    assert_close(k_out, rope_oracle(positions, k0, cache, is_neox), dtype, scale=2)
    q_ref, k_ref = ref_rotary.apply_rotary_emb(positions, q0, k0, cache, is_neox)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


# ----------------------------------------------------------------------------- the op layer
def test_ops_are_registered_with_schemas():
    """Registered torch ops: mutated arguments are annotated, so torch.compile can trace them."""
    schema = str(torch.ops.minivllm.fused_add_rms_norm.default._schema)
    assert "Tensor(a!) input" in schema and "Tensor(b!) residual" in schema
    for name in ("paged_attention", "reshape_and_cache", "rms_norm", "silu_and_mul",
                 "rotary_embedding"):  # fmt: skip
        assert "!" in str(getattr(torch.ops.minivllm, name).default._schema)


def test_rms_norm_under_torch_compile():
    def f(x, w):
        out = torch.empty_like(x)
        torch.ops.minivllm.rms_norm(out, x, w, 1e-6)
        return out * 2

    x, w = torch.randn(5, 24), torch.randn(24)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_close(compiled(x, w), 2 * ref_layernorm.rms_norm(x, w, 1e-6), torch.float32)


def test_fast_on_a_cpu_means_the_cpp_ops():
    assert backend.get("layernorm", "fast").rms_norm_cpu is layernorm.rms_norm_cpu
    assert backend.resolve("attention", "auto") == "fast"
    assert backend.get("attention", "minivllm.fast.cpu").paged_attention is \
        attention.paged_attention_cpu  # fmt: skip


def test_a_build_for_another_cpu_has_its_flags_and_a_folder_of_its_own(monkeypatch):
    """MINIVLLM_CPU_ARCH builds for another CPU (an AVX2 laptop's code paths on a newer
    one): its -march, the macro that keeps the run-time ISA choices within it, and a cache
    folder of its own (never a rebuild over the native library); not a name: refused."""
    monkeypatch.delenv(cpu_target.ARCH_ENV, raising=False)
    native_flags, native_name = cpu_ops.compile_flags(), cpu_ops._extension_name()
    assert cpu_target.target_arch() == "native" and "-DMINIVLLM_FOREIGN_ARCH" not in native_flags
    monkeypatch.setenv(cpu_target.ARCH_ENV, "x86-64-v3")
    flags = cpu_ops.compile_flags()
    assert "-DMINIVLLM_FOREIGN_ARCH" in flags and cpu_ops._extension_name() != native_name
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    for bad in ("x86-64-v3; rm -rf /", "-O0", "two words"):
        monkeypatch.setenv(cpu_target.ARCH_ENV, bad)
        with pytest.raises(ValueError, match="MINIVLLM_CPU_ARCH must be a compiler"):
            cpu_ops.compile_flags()


def test_a_failed_build_falls_back_to_ref_with_one_warning():
    """Without the ops (as after a failed build) every kernel is the ref's, and one warning says why."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from minivllm import backend\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    mods = [backend.get(n, 'auto').__name__ for n, kind in backend.COMPONENTS.items()\n"
        "            if kind == 'kernel'] + [backend.get('attention', 'fast').__name__]\n"
        "print(mods); print(len([x for x in w if 'C++' in str(x.message)]))\n"
    )
    env = dict(os.environ, MINIVLLM_NO_CPP="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()  # fmt: skip
    assert all(m.startswith("minivllm.ref.") for m in eval(out[0])), out[0]
    assert out[1] == "1", out


def test_spawned_ranks_build_the_ops_before_spawning(monkeypatch):
    """``"mp"`` ranks on a CPU with a fast twin: the parent builds (or loads) the C++ ops
    before it spawns anyone, so no rank waits on the build lock past its rendezvous;
    with only ref twins, or on CUDA, nothing is built."""
    from types import SimpleNamespace

    from minivllm.executor import rank_starters

    calls = []
    monkeypatch.setattr(cpu_ops, "available", lambda: calls.append("build") or True)
    cpu = torch.device("cpu")
    fast = SimpleNamespace(impls={"attention": "fast", "scheduler": "ref"})
    ref = SimpleNamespace(impls={"attention": "ref", "scheduler": "my_pkg.scheduler"})
    assert rank_starters.build_cpu_ops_first(cpu, fast) and calls == ["build"]
    assert not rank_starters.build_cpu_ops_first(cpu, ref)
    assert not rank_starters.build_cpu_ops_first(torch.device("cuda"), fast)
    assert calls == ["build"]

    class NoSpawn(RuntimeError):
        pass

    def spawn_context(method):  # the first thing start() does after the build
        calls.append("spawn")
        raise NoSpawn

    monkeypatch.setattr(rank_starters.mp, "get_context", spawn_context)
    config = SimpleNamespace(device="cpu", num_ranks=2)
    monkeypatch.setattr(rank_starters, "rank_devices", lambda device, n: [cpu] * n)
    with pytest.raises(NoSpawn):
        rank_starters.SpawnedRanks().start(config, fast)
    assert calls == ["build", "build", "spawn"]
