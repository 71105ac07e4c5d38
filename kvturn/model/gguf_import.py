"""Turn a GGUF file of a Llama or Qwen3 model into a Hugging Face model directory (what kvturn and transformers load).

llama.cpp's converter renamed the weights, quantized them, permuted the rows of Llama's Q and K projections for its
RoPE layout, and stored the tokenizer as metadata; each step is undone here, with llama.cpp's own reader (`gguf`).
"""
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvturn.model.config import ModelConfig
from kvturn.model.transformer import CausalLM

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4  # llama.cpp's token types: special, and added but not special

# How each `tokenizer.ggml.pre` cuts text before BPE (llama.cpp's llama-vocab.cpp, the models' own tokenizer.json).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {  # name -> (split regexes applied in turn, NFC-normalized first)
    "gpt2": ([GPT2_SPLIT], False),
    "smollm": ([r"\p{N}", GPT2_SPLIT], False),
    "qwen2": ([QWEN2_SPLIT], True),
    "llama-bpe": ([LLAMA3_SPLIT], False),
    "llama3": ([LLAMA3_SPLIT], False),
}


class UnsupportedGGUF(ValueError):
    pass


def field(reader: gguf.GGUFReader, key: str, default=None):
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def as_float32(value: float) -> float:
    """The shortest decimal that is the same float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config(reader: gguf.GGUFReader) -> dict:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUF(f"GGUF architecture {arch!r}; kvturn runs {sorted(ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in names:
        raise UnsupportedGGUF(f"RoPE scaling ({scaling}) is not supported by kvturn's model")
    heads = field(reader, f"{arch}.attention.head_count")
    hidden = field(reader, f"{arch}.embedding_length")
    rope_theta = as_float32(field(reader, f"{arch}.rope.freq_base", 10000.0))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    special = {key: field(reader, f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos", "padding")}
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(embedding.shape[1]) if len(embedding.shape) > 1 else len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": field(reader, f"{arch}.attention.key_length") or field(reader, f"{arch}.rope.dimension_count")
        or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": field(reader, f"{arch}.context_length"),
        "rms_norm_eps": as_float32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": special["bos"],
        "eos_token_id": special["eos"],
        "pad_token_id": special["padding"],
    }


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[parts[0]]}.{parts[1]}"
    raise UnsupportedGGUF(f"unknown tensor {gguf_name!r} in the GGUF")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` of Q/K rows: it interleaved each head's two rotary halves."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_weights(reader: gguf.GGUFReader, config: dict) -> dict[str, torch.Tensor]:
    weights = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.reshape([int(n) for n in reversed(tensor.shape)]).astype(np.float32)
        if config["model_type"] == "llama" and ".attn_q." in tensor.name:
            values = unpermute_rows(values, config["num_attention_heads"])
        elif config["model_type"] == "llama" and ".attn_k." in tensor.name:
            values = unpermute_rows(values, config["num_key_value_heads"])
        weights[hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(values))
    return weights


def check_complete(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    with torch.device("meta"):
        expected = {name: p.shape for name, p in CausalLM(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = [name for name in set(expected) & set(weights) if weights[name].shape != expected[name]]
    if missing or unexpected or wrong:
        raise UnsupportedGGUF(f"the GGUF's tensors do not make a {cfg.model_type} model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}")


def pre_tokenizer(name: str) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
    if name not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedGGUF(f"tokenizer.ggml.pre {name!r}; kvturn reads {sorted(PRE_TOKENIZER_SPLITS)}")
    splits, nfc = PRE_TOKENIZER_SPLITS[name]
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), normalizers.NFC() if nfc else None


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, in which a byte-level BPE vocabulary is written."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def hf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A byte-level BPE tokenizer from `tokenizer.ggml.*`, with control tokens special and user-defined ones added."""
    if field(reader, "tokenizer.ggml.model") != "gpt2":
        raise UnsupportedGGUF(f"tokenizer.ggml.model {field(reader, 'tokenizer.ggml.model')!r}; kvturn reads "
                              f"byte-level BPE ('gpt2') vocabularies")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = {(token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())): index
             for index, token in enumerate(tokens)}
    merges = [tuple(merge.split(" ", 1)) for merge in field(reader, "tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer, normalizer = pre_tokenizer(field(reader, "tokenizer.ggml.pre", "gpt2"))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type") or []
    # A token outside the byte alphabet marked special is a llama.cpp mislabel (it would grow the vocabulary).
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)
                                  for token, kind in zip(tokens, types)
                                  if kind == TOKEN_TYPE_CONTROL and set(token) <= alphabet])
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False)
                          for token, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED and token in vocab])
    return tokenizer


def tokenizer_config(reader: gguf.GGUFReader, config: dict) -> dict:
    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens.contents(index) if index is not None and index < len(tokens.data) else None
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"), "eos_token": token("eos"),
            "pad_token": token("padding"), "unk_token": token("unknown"),
            "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": bool(field(reader, "tokenizer.ggml.add_eos_token", False)),
            "model_max_length": config["max_position_embeddings"], "clean_up_tokenization_spaces": False}


def import_gguf(gguf_path: str | Path, out_dir: str | Path, source: dict | None = None) -> Path:
    """Write the model directory atomically (a half-written directory is never seen by a reader)."""
    reader = gguf.GGUFReader(str(gguf_path))
    out_dir = Path(out_dir)
    config = hf_config(reader)
    tokenizer = hf_tokenizer(reader)
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        weights = hf_weights(reader, config)
        check_complete(weights, ModelConfig.from_dir(staging))
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(staging / "tokenizer.json"))
        (staging / "generation_config.json").write_text(json.dumps(
            {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=2))
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(reader, config), indent=2))
        template = field(reader, "tokenizer.chat_template")
        if template:
            (staging / "chat_template.jinja").write_text(template)
        (staging / "kvturn-source.json").write_text(json.dumps(
            {"gguf": Path(gguf_path).name, "gguf_name": field(reader, "general.name"), **(source or {})}, indent=2))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
