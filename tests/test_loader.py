"""Loading: HF safetensors directories (single and sharded), GGUF files, SmolLM2.

Oracles: transformers' model on the same directory; for GGUF, the original
HF-named weights the file was written from (with llama.cpp's Q/K permutation
applied on the way in, as ``convert_hf_to_gguf.py`` does); for SmolLM2,
transformers' own GGUF reader (its own name mapping and Q/K un-permutation).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, PagedRunner, byte_tokenizer, hf_model, make_tiny_config, randomize_

from minivllm.model import ModelNotFoundError, load_model, registry, resolve_model_path
from minivllm.model.gguf_loader import permute_qk
from minivllm.model.loader import build_model, iterate_safetensors


def _prefill_logits(model, tokens: list[int], block_size: int = 4) -> torch.Tensor:
    return PagedRunner(model, block_size).step([(0, tokens)])[0]  # (L, vocab)


def _tokens(n: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- HF directories ------------------------------------------------------------


def test_sharded_safetensors_dir_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    config = make_tiny_config("qwen2", num_hidden_layers=3)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    byte_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2

    model, cfg, tok = load_model(tmp_path)
    assert cfg.num_hidden_layers == 3
    assert tok.decode(tok("héllo").input_ids) == "héllo"
    tokens = _tokens(11)
    with torch.no_grad():
        ref = hf_model(tmp_path)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens), ref, atol=1e-4, rtol=1e-4)


def test_dir_without_tokenizer_loads_with_none(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(make_tiny_config("mistral"), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    model, cfg, tok = load_model(tmp_path)
    assert tok is None and cfg.model_type == "mistral"


def test_tokenizer_keeps_chat_template_and_eos(tiny_model_dir):
    _, cfg, tok = load_model(tiny_model_dir("llama"))
    assert tok.eos_token_id == cfg.eos_token_id == 257
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|user|>hi<|assistant|>"


def test_unknown_model_errors_name_what_was_tried(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2") as e:
        resolve_model_path(tmp_path / "no_such_model")
    assert "no_such_model" in str(e.value)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)  # an empty directory
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="registered names"):
        registry.ensure_model("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype=torch.int8)


def test_missing_and_unexpected_weights_are_errors(tiny_model_dir):
    path = tiny_model_dir("llama")
    weights = dict(iterate_safetensors(path))
    config = make_tiny_config("llama")

    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight:k"):
        build_model(config).load_weights(partial.items())

    extra = dict(weights, **{"model.layers.0.mlp.extra.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="unexpected weight"):
        build_model(config).load_weights(extra.items())

    bad = dict(weights, **{"model.norm.weight": torch.zeros(7)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        build_model(config).load_weights(bad.items())


# -- GGUF ------------------------------------------------------------------------


def _write_gguf(path, hf, tokenizer) -> dict[str, torch.Tensor]:
    """Write ``hf`` as llama.cpp would; return the weights a perfect reader recovers.

    Norms stay F32, q/k/v go in F16 (exact enough to check the permutation
    bit for bit), everything else is Q8_0. The returned dict holds the
    original weights after that same rounding (F16 round trip, Q8_0
    quantize + dequantize), under their HF names.
    """
    import gguf
    import numpy as np

    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab()
    pads = [f"<pad{i}>" for i in range(cfg.vocab_size - len(vocab))]
    tokens = sorted(vocab, key=vocab.get) + pads
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
    w.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives none
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_chat_template(tokenizer.chat_template)

    names = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                   "post_attention_layernorm": "ffn_norm"}
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[1] == "layers":
            gname = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gname = f"{names[parts[-2]]}.{parts[-1]}"
        data = t.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = permute_qk(data, heads)  # what convert_hf_to_gguf.py does
        if data.ndim == 1:
            w.add_tensor(gname, data.astype(np.float32))
            expected[name] = t.clone()
        elif "self_attn" in name and "o_proj" not in name:
            w.add_tensor(gname, data.astype(np.float16))
            expected[name] = t.half().float()
        else:
            q8 = gguf.quants.quantize(t.numpy(), Q8_0)  # (not q/k: no permutation here)
            w.add_tensor(gname, q8, raw_dtype=Q8_0)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(q8, Q8_0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "llama_tied"])
def test_gguf_matches_original_weights(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    config = make_tiny_config(arch, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, seed=11)
    path = tmp_path / "tiny.gguf"
    expected = _write_gguf(path, hf, byte_tokenizer())

    model, cfg, tok = load_model(path)
    assert cfg.tie_word_embeddings == config.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 5000.0
    assert cfg.num_key_value_heads == config.num_key_value_heads
    assert tok.eos_token_id == config.eos_token_id
    assert tok.chat_template == byte_tokenizer().chat_template

    # Each fused parameter holds exactly the expected rows (this catches a wrong
    # or missing Q/K un-permutation: q/k are stored losslessly enough in F16).
    attn = model.model.layers[1].self_attn
    q_rows = attn.num_heads * attn.head_dim
    kv_rows = attn.num_kv_heads * attn.head_dim
    qkv = attn.qkv_proj.weight.reshape(-1, config.hidden_size)
    torch.testing.assert_close(qkv[:q_rows], expected["model.layers.1.self_attn.q_proj.weight"],
                               atol=0, rtol=0)
    torch.testing.assert_close(qkv[q_rows : q_rows + kv_rows],
                               expected["model.layers.1.self_attn.k_proj.weight"], atol=0, rtol=0)

    # End to end: transformers with the expected (rounded) weights is the oracle.
    hf.load_state_dict(expected, strict=False)
    tokens = _tokens(10, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens, 3), ref, atol=1e-4, rtol=1e-4)


# -- SmolLM2 ---------------------------------------------------------------------


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_reader(smollm2_dir):
    """Our converted SmolLM2 vs transformers' own reading of the same GGUF file.

    transformers maps names and un-permutes Q/K itself; both paths dequantize
    with the ``gguf`` package (transformers calls the same ``dequantize``), so
    this checks everything except the dequantization arithmetic, which the
    tiny GGUF test above checks against quantize-then-dequantize.
    """
    from transformers import LlamaForCausalLM as HFLlama
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = registry.gguf_file("smollm2")
    if gguf_path is None:
        pytest.skip("the SmolLM2 cache has no source .gguf")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model, cfg, tok = load_model(smollm2_dir)
    with torch.device("meta"):  # skip a random init of 135M parameters
        hf = HFLlama(cfg).eval()  # architecture from OUR config; weights from transformers
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False, assign=True)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # tied lm_head
    hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb = LlamaRotaryEmbedding(cfg)  # its buffers were made on meta
    assert tok.eos_token == "<|im_end|>" and "im_start" in tok.chat_template

    runner = PagedRunner(model, block_size=16, max_tokens=256)
    ids = [tok(p).input_ids for p in PROMPTS]
    ours = runner.step([(i, t) for i, t in enumerate(ids)])
    for i, t in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([t])).logits[0]
        torch.testing.assert_close(ours[i], ref, atol=2e-3, rtol=1e-3)
        assert torch.equal(ours[i].argmax(-1), ref.argmax(-1))


def test_parameters_are_built_in_their_dtype_without_a_process_default(tiny_model_dir,
                                                                        monkeypatch):
    """No ``torch.set_default_dtype``: two models of different dtypes built at once, in two
    threads, each get their own dtype, and the process's default is never touched."""
    from concurrent.futures import ThreadPoolExecutor

    def refuse(dtype):
        raise AssertionError("the loader must not change the process-wide default dtype")

    monkeypatch.setattr(torch, "set_default_dtype", refuse)
    path = str(tiny_model_dir("llama"))
    before = torch.get_default_dtype()

    def build(dtype):
        model, _, _ = load_model(path, dtype=dtype, device="cpu", components="ref")
        # The RoPE cache stays float32 by design; every parameter takes the model's dtype.
        return ({p.dtype for p in model.parameters()},
                model.model.rotary_emb.cos_sin_cache.dtype)

    dtypes = [torch.float32, torch.bfloat16, torch.float16] * 2
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(build, dtypes))
    assert got == [({d}, torch.float32) for d in dtypes]
    assert torch.get_default_dtype() == before
