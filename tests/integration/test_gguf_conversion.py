"""A GGUF file as a Hugging Face folder (`ember.models.gguf.save_gguf_as_hf`, what the SmolLM2 examples' prepare.py
runs): a tiny llama GGUF with a byte-level BPE tokenizer, written here with gguf's own writer, converts to the
weights, config and tokenizer that transformers' GGUF loading gives without ember's caching, the file parsed once
instead of three times, and the folder loads back into a model whose logits equal the GGUF-loaded one's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from ember.models.gguf import save_gguf_as_hf  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32
BYTES = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "0", "1", "2", "+", "="]
MERGES = ["a b", "ab c", "Ġ a", "1 2"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def write_tiny_gguf(path) -> None:
    tokens = BYTES + [merge.replace(" ", "") for merge in MERGES] + SPECIALS
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
                           + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))
    head_dim = HIDDEN // HEADS
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", 1 + weight(HIDDEN))
        writer.add_tensor(f"{block}.attn_q.weight", weight(HIDDEN, HIDDEN))
        writer.add_tensor(f"{block}.attn_k.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"{block}.attn_v.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"{block}.attn_output.weight", weight(HIDDEN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_norm.weight", 1 + weight(HIDDEN))
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", 1 + weight(HIDDEN))
    writer.add_tensor("output.weight", weight(len(tokens), HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_folder_holds_what_transformers_reads_from_the_gguf_file_parsed_once(tmp_path, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file)
    direct = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    direct_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")

    parses = []
    reader_class = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: parses.append(args) or reader_class(*args, **kwargs))
    out_dir = save_gguf_as_hf(str(gguf_file), str(tmp_path / "hf"))
    assert len(parses) == 1  # transformers asks three times: for the config, the tokenizer and the weights
    assert gguf.GGUFReader is not reader_class  # the caller's own (here the counting one) is back after the conversion

    folder = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert folder.config.num_hidden_layers == LAYERS and folder.config.num_key_value_heads == KV_HEADS
    direct_weights, folder_weights = direct.state_dict(), folder.state_dict()
    assert sorted(direct_weights) == sorted(folder_weights)
    for name, tensor in direct_weights.items():
        assert torch.equal(tensor, folder_weights[name]), name
    text = "abc ab 12+1=2 zz"
    assert tokenizer(text)["input_ids"] == direct_tokenizer(text)["input_ids"]
    assert tokenizer.eos_token == direct_tokenizer.eos_token == "<|im_end|>"
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(folder(ids).logits, direct(ids).logits, rtol=0, atol=0)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        save_gguf_as_hf(str(tmp_path / "missing.gguf"), str(tmp_path / "hf"))
