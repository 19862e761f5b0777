"""A tiny random-weight Llama, built locally in well under a second, for LLM tests.

One set of weights is written twice: as a Hugging Face directory (transformers, mlx-lm)
and as a GGUF file (llama.cpp), so every runtime can be checked against the others
token for token. Needs only numpy, tokenizers, safetensors and gguf; no model hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end-of-turn token, ChatML style, also the eos
SPECIAL_TOKENS = (BOS, IM_START, IM_END)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# llama.cpp maps this pre-tokenizer name to the GPT-2 split regex, which is also what the
# `tokenizers` ByteLevel pre-tokenizer uses (note the hyphen: plain "gpt2" is refused).
GGUF_PRE_TOKENIZER = "gpt-2"

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A voice agent listens, thinks and speaks.
It hears the user through a microphone, finds where speech starts and stops, turns the
words into text, asks a language model for a reply, and reads that reply aloud.
Hello! How are you today? I am fine, thank you. What is the weather like in Paris?
It is sunny and warm, with a light wind from the west. Tell me a short story, please.
Once upon a time there was a small robot who wanted to learn how to sing. Every morning
it practised scales in the garden, and every evening it listened to the birds.
Numbers are useful too: one, two, three, four, five, six, seven, eight, nine, ten.
The meeting starts at 10:30 and ends at 11:15. Can you remind me later? Of course.
Latency matters: people notice a pause longer than half a second in a conversation.
"""


@dataclass(frozen=True)
class TinyLlamaConfig:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0 * 5  # not the default, so a runtime that ignores it fails
    vocab_target: int = 384

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class TinyLlama:
    hf_dir: Path  # config.json, model.safetensors, tokenizer.json, ...
    gguf_path: Path  # the same weights and tokenizer for llama.cpp
    eos_token_id: int
    vocab_size: int


def build_tiny_llama(out_dir: Path, seed: int = 0, config: TinyLlamaConfig = TinyLlamaConfig(),
                     chat_template: str = CHATML_TEMPLATE) -> TinyLlama:
    """Write a tiny random Llama as an HF directory and a GGUF under ``out_dir``; both carry
    ``chat_template`` (e.g. one with tools: tests/support/tools.py)."""
    out_dir = Path(out_dir)
    hf_dir = out_dir / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer(config.vocab_target)
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab()
    tokens = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    ids = {tok: vocab[tok] for tok in SPECIAL_TOKENS}
    _write_tokenizer_files(hf_dir, ids, chat_template, config.max_position_embeddings)

    weights = _random_weights(config, tokens, np.random.default_rng(seed))
    _write_hf_model(hf_dir, config, weights, ids, len(tokens))

    gguf_path = out_dir / "tiny-llama-f32.gguf"
    merges = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]
    _write_gguf(gguf_path, config, weights, tokens, merges, ids, chat_template)
    return TinyLlama(hf_dir=hf_dir, gguf_path=gguf_path, eos_token_id=ids[IM_END], vocab_size=len(tokens))


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _write_tokenizer_files(hf_dir: Path, ids: dict[str, int], chat_template: str, max_length: int) -> None:
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    _dump(
        hf_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": BOS,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,  # llama.cpp streams pieces as they are
            "model_max_length": max_length,
            "added_tokens_decoder": added,
            "additional_special_tokens": [IM_START, IM_END],
            "chat_template": chat_template,
        },
    )
    _dump(
        hf_dir / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": BOS,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )


def _random_weights(cfg: TinyLlamaConfig, tokens: list[str], rng) -> dict[str, np.ndarray]:
    """HF-named float32 weights, scaled so the logits spread widely.

    A wide logit spread keeps greedy argmax margins far above float32 noise, so torch,
    mlx and ggml agree. The lm_head rows of special tokens and of byte tokens that are not
    printable ASCII are zero: their logit stays 0 while the best token scores ~10, so
    greedy text is always printable and never ends early on eos.
    """
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
        w = rng.standard_normal((out_features, in_features)) * gain / np.sqrt(in_features)
        return w.astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((len(tokens), h)).astype(np.float32)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        weights |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": linear(q_out, h, 2.0),
            p + "self_attn.k_proj.weight": linear(kv_out, h, 2.0),
            p + "self_attn.v_proj.weight": linear(kv_out, h),
            p + "self_attn.o_proj.weight": linear(h, q_out),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": linear(i, h),
            p + "mlp.up_proj.weight": linear(i, h),
            p + "mlp.down_proj.weight": linear(h, i),
        }
    weights["model.norm.weight"] = norm(h)
    lm_head = linear(len(tokens), h, 4.0)
    lm_head[[n for n, tok in enumerate(tokens) if not _printable(tok)]] = 0.0
    weights["lm_head.weight"] = lm_head
    return weights


def _printable(token: str) -> bool:
    """Whether a byte-level BPE token decodes to printable ASCII (or a newline)."""
    if token in SPECIAL_TOKENS:
        return False
    from tokenizers.decoders import ByteLevel

    text = ByteLevel().decode([token])
    return all(ch == "\n" or 32 <= ord(ch) < 127 for ch in text)


def _write_hf_model(
    hf_dir: Path, cfg: TinyLlamaConfig, weights: dict[str, np.ndarray], ids: dict[str, int], vocab_size: int
) -> None:
    from safetensors.numpy import save_file

    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    _dump(
        hf_dir / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps,
            # mlx-lm reads only the top-level key, transformers 5 only rope_parameters.
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[BOS],
            "torch_dtype": "float32",
            "dtype": "float32",
            "use_cache": True,
        },
    )
    _dump(
        hf_dir / "generation_config.json",
        {
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[BOS],
        },
    )


def _rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split rope rows -> GGML's interleaved pairs (convert_hf_to_gguf.py)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path,
    cfg: TinyLlamaConfig,
    weights: dict[str, np.ndarray],
    tokens: list[str],
    merges: list,
    ids: dict[str, int],
    chat_template: str,
) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(GGUF_PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if tok in SPECIAL_TOKENS else gguf.TokenType.NORMAL for tok in tokens]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(ids[BOS])
    writer.add_eos_token_id(ids[IM_END])
    writer.add_pad_token_id(ids[BOS])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template)

    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        q = weights[p + "self_attn.q_proj.weight"]
        k = weights[p + "self_attn.k_proj.weight"]
        writer.add_tensor(b + "attn_norm.weight", weights[p + "input_layernorm.weight"])
        writer.add_tensor(b + "attn_q.weight", _rope_permute(q, cfg.num_attention_heads))
        writer.add_tensor(b + "attn_k.weight", _rope_permute(k, cfg.num_key_value_heads))
        writer.add_tensor(b + "attn_v.weight", weights[p + "self_attn.v_proj.weight"])
        writer.add_tensor(b + "attn_output.weight", weights[p + "self_attn.o_proj.weight"])
        writer.add_tensor(b + "ffn_norm.weight", weights[p + "post_attention_layernorm.weight"])
        writer.add_tensor(b + "ffn_gate.weight", weights[p + "mlp.gate_proj.weight"])
        writer.add_tensor(b + "ffn_up.weight", weights[p + "mlp.up_proj.weight"])
        writer.add_tensor(b + "ffn_down.weight", weights[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
