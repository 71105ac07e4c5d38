import hashlib
import json

from kvturn.model.config import ModelConfig
from kvturn.model.make_model import make_model
from kvturn.model.tokenizer import ChatTokenizer


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_writes_the_same_bytes(tmp_path):
    a, b = make_model(tmp_path / "a", "tiny", seed=3), make_model(tmp_path / "b", "tiny", seed=3)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert digest(a / name) == digest(b / name), name


def test_other_seed_changes_the_weights_only(tmp_path, tiny_model_dir):
    other = make_model(tmp_path / "c", "tiny", seed=1)
    assert digest(other / "model.safetensors") != digest(tiny_model_dir / "model.safetensors")
    assert digest(other / "tokenizer.json") == digest(tiny_model_dir / "tokenizer.json")


def test_directory_is_a_qwen3_hf_model(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert cfg.has_qk_norm and cfg.num_key_value_heads < cfg.num_attention_heads


def test_tokenizer_round_trips_text_and_renders_the_chat_template(tiny_model_dir):
    tok = ChatTokenizer(tiny_model_dir)
    text = "def add(a, b):\n    return a + b  # ünïcödé"
    assert tok.decode(tok.encode(text)) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]


def test_segment_cached_encoding_equals_whole_text_encoding(tiny_model_dir):
    tok = ChatTokenizer(tiny_model_dir)
    history = [{"role": "system", "content": "You are terse.  " * 40}]
    for turn in range(4):
        history.append({"role": "user", "content": f" step {turn}:\n\tdef f(x):  return x ** {turn}  " * 20})
        rendered = tok.apply_chat_template(history)
        assert tok.encode(rendered) == tok.tokenizer.encode(rendered, add_special_tokens=False).ids
        history.append({"role": "assistant", "content": "ok<|im_end|>and then " * 15})


def test_a_cached_model_written_with_a_shorter_context_gets_this_presets_config(tmp_path, monkeypatch, tiny_model_dir):
    """A cache directory an older kvturn wrote (16,384 positions) is brought up to the preset without rewriting its
    weights, so a user's and CI's caches serve 131,072 positions too."""
    import shutil
    from kvturn.model.make_model import PRESETS, default_model_dir
    old = tmp_path / "embedded-tiny-seed0"
    shutil.copytree(tiny_model_dir, old)
    for name, field in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        config = json.loads((old / name).read_text())
        (old / name).write_text(json.dumps({**config, field: 16384}))
    weights = (old / "model.safetensors").stat()
    monkeypatch.setenv("KVTURN_CACHE_DIR", str(tmp_path))
    assert default_model_dir("tiny") == old
    assert ModelConfig.from_dir(old).max_position_embeddings == PRESETS["tiny"].max_position_embeddings == 131072
    assert json.loads((old / "tokenizer_config.json").read_text())["model_max_length"] == 131072
    assert digest(old / "config.json") == digest(tiny_model_dir / "config.json")
    assert (old / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns
