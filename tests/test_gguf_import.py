"""A GGUF written as llama.cpp writes one (renamed, Q/K rows permuted, tokenizer as metadata) turns back into the
Hugging Face directory it came from: the same weights, hyper-parameters, tokens and chat template."""
import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from typer.testing import CliRunner

from kvturn.cli import app
from kvturn.model import pull
from kvturn.model.gguf_import import LAYER_NAMES, TOP_LEVEL_NAMES, UnsupportedGGUF, import_gguf
from kvturn.model.tokenizer import ChatTokenizer

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXTS = ["def main():\n    return 42  # the answer\n", "<|im_start|>user\nHello, world!<|im_end|>\n",
         "  indented\n\n\ttabs, ünïcödé and 12345 digits<|endoftext|>"]


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Llama's Q and K rows."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    top = {v: k for k, v in TOP_LEVEL_NAMES.items()}
    layer = {v: k for k, v in LAYER_NAMES.items()}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, index, rest = stem.split(".", 3)
    return f"blk.{index}.{layer[rest]}.{kind}"


def write_gguf(model_dir, path, pre: str = "gpt2", drop: str | None = None) -> dict:
    """model_dir as llama.cpp would convert it; returns its HF weights."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = config["model_type"]
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    vocab = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = sorted(vocab["model"]["vocab"], key=vocab["model"]["vocab"].get)
    specials = {t["content"] for t in vocab["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["model"]["merges"]])
    writer.add_eos_token_id(vocab["model"]["vocab"]["<|im_end|>"])
    writer.add_pad_token_id(vocab["model"]["vocab"]["<|endoftext|>"])
    writer.add_chat_template(TEMPLATE)
    for name, value in sorted(weights.items()):
        if name == drop:
            continue
        if arch == "llama" and ".q_proj." in name:
            value = llama_cpp_permute(value, config["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            value = llama_cpp_permute(value, config["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.mark.parametrize("which", ["tiny_model_dir", "llama_model_dir"])
def test_a_gguf_converts_back_to_the_directory_it_came_from(which, request, tmp_path):
    model_dir = request.getfixturevalue(which)
    weights = write_gguf(model_dir, tmp_path / "model.gguf")
    out = import_gguf(tmp_path / "model.gguf", tmp_path / "out")
    converted = load_file(str(out / "model.safetensors"))
    assert set(converted) == set(weights)
    for name, value in weights.items():
        assert np.array_equal(converted[name], value), name  # Llama's Q and K rows un-permuted exactly
    original = json.loads((model_dir / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "rope_theta", "tie_word_embeddings", "eos_token_id"):
        assert config[key] == original[key], key
    assert (out / "chat_template.jinja").read_text() == TEMPLATE


def test_the_rebuilt_tokenizer_encodes_and_decodes_as_the_original(tiny_model_dir, tmp_path):
    write_gguf(tiny_model_dir, tmp_path / "model.gguf")
    out = import_gguf(tmp_path / "model.gguf", tmp_path / "out")
    original, rebuilt = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json")), ChatTokenizer(out)
    for text in TEXTS:
        ids = original.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text) == ids, text
        assert rebuilt.tokenizer.encode(text, add_special_tokens=False).ids == ids, text
        assert rebuilt.decode(ids) == original.decode(ids)
    assert rebuilt.eos_token_id == original.token_to_id("<|im_end|>")


def test_a_gguf_kvturn_cannot_run_is_refused_and_leaves_nothing(tiny_model_dir, tmp_path):
    write_gguf(tiny_model_dir, tmp_path / "pre.gguf", pre="made-up")
    with pytest.raises(UnsupportedGGUF, match="made-up"):
        import_gguf(tmp_path / "pre.gguf", tmp_path / "out")
    write_gguf(tiny_model_dir, tmp_path / "short.gguf", drop="model.layers.0.self_attn.q_norm.weight")
    with pytest.raises(UnsupportedGGUF, match="q_norm"):
        import_gguf(tmp_path / "short.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pre.gguf", "short.gguf"]


def test_models_pull_converts_a_local_gguf_that_serve_then_finds_by_name(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTURN_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(tiny_model_dir, tmp_path / "model.gguf")
    runner = CliRunner()
    missing = runner.invoke(app, ["bench", "--compare", "--model", "mine"])
    assert missing.exit_code == 2 and "`kvturn models pull NAME [--gguf FILE]`" in missing.output
    unpulled = runner.invoke(app, ["bench", "--compare", "--model", "smollm2"])
    assert unpulled.exit_code == 2 and "run `kvturn models pull smollm2`" in unpulled.output
    result = runner.invoke(app, ["models", "pull", "mine", "--gguf", str(tmp_path / "model.gguf")])
    assert result.exit_code == 0, result.output
    assert pull.resolve("mine") == tmp_path / "cache" / "models" / "mine"
    assert pull.resolve(str(tiny_model_dir)) == tiny_model_dir
    listed = runner.invoke(app, ["models", "list"]).output
    assert "mine" in listed and "Qwen3ForCausalLM" in listed and "not pulled" in listed  # smollm2 is known
    bad = runner.invoke(app, ["models", "pull", "../escape", "--gguf", str(tmp_path / "model.gguf")])
    assert bad.exit_code == 2 and not (tmp_path / "cache" / "escape").exists()


def reference_pre_tokenizer(pre: str):
    """How each model's own tokenizer.json (or transformers, for the regexes) cuts text before BPE."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    if pre == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_each_pre_tokenizer_cuts_text_as_the_models_own(pre):
    from kvturn.model.gguf_import import pre_tokenizer
    ours, _ = pre_tokenizer(pre)
    reference = reference_pre_tokenizer(pre)
    for text in TEXTS + ["It's 2024: I'VE got 1234567 tokens\r\n\r\n  and   spaces!!\n", "x=[1,2];\tdone\n\n"]:
        assert [p for p, _ in ours.pre_tokenize_str(text)] == [p for p, _ in reference.pre_tokenize_str(text)], text
