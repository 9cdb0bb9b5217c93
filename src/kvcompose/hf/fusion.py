"""Fused decode steps: the model's decoder layers compiled by torch.compile (inductor) around the kvcompose attention.

A decode step of a Hugging Face decoder runs, per layer, a handful of matrix products and some
thirty small kernels: the RMS norms (a cast, a square, a mean, a reciprocal square root, two
products), the rotary embedding (products, a negation, a concatenation, sums), the SiLU-mul of
the MLP and the residual sums. At batch 16 each of those kernels moves a few hundred kilobytes
and costs its launch, so together they took about a third of a step's GPU time. Compiling
the decoder layer's ``forward`` lets inductor fuse that pointwise and reduction work into a few
kernels while the matrix products stay the same cuBLAS calls.

The decoder's rotary embedding and its final norm run once per step outside the layers; they
are compiled the same way (:func:`step_modules`), a kernel each instead of about seven.

The cache update and the kvcompose attention are opaque to the compiler
(``torch.compiler.disable``): each layer's forward compiles into the graphs before and after
them, and our store, kernels and policy run unchanged in between. The layer index each layer
passes to the cache is a constant of its graphs, so the compiler specializes once per layer
(the recompile limit is raised while fused layers run); the graphs do not change from step to
step, so the static decoder captures them in its CUDA graphs as before.

Why compile the model's own layers rather than write fused kernels for them: the same step
then fuses for every decoder transformers ships (Llama, Qwen, Mistral, ...), and the numerics
follow the model's code, including its casts (``emulate_precision_casts``): in fp32 the fused
step gives the eager one's tokens; in bf16 a fused chain of products and sums is rounded once,
not after every operation, so tokens may part after some steps.

The fused layers also compute each group of sibling projections (query, key and value; gate and
up) as one product over their stacked weights (:mod:`kvcompose.hf.projections`): fewer, larger
matrix products, which run closer to copy bandwidth at decode batch sizes.
"""

from __future__ import annotations

import functools
import types
from contextlib import contextmanager

import torch

from ..compiled import RECOMPILE_LIMIT, compiled_functions
from .attention import UnsupportedModelError
from .projections import deduplicate_products, stacked_projections

#: The compiler backend of fused steps ("inductor" fuses; "aot_eager" traces without fusing, for checks).
BACKEND = "inductor"


def _decoder(model):
    """The decoder inside a transformers model (the model itself for a bare decoder)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a transformers model: the ``layers`` list of its decoder."""
    layers = getattr(_decoder(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise UnsupportedModelError(
            f"cannot fuse the decode step of {type(model).__name__}: its decoder has no 'layers' module list "
            "(decode with fuse=False)")
    return layers


def step_modules(model) -> list[torch.nn.Module]:
    """The decoder's modules that run once per step outside its layers and fuse on their own:
    the rotary embedding (positions to cos and sin: a product, a concatenation, two
    transcendentals and casts) and the final norm, where the decoder has them."""
    decoder = _decoder(model)
    found = (getattr(decoder, name, None) for name in ("rotary_emb", "norm"))
    return [m for m in found if isinstance(m, torch.nn.Module)]


@functools.lru_cache(maxsize=None)
def compiled_forward(layer_class: type, backend=BACKEND):
    """One compiled ``forward`` per module class (decoder layer, rotary embedding, norm), shared
    by its instances (and by every model of that class in the process, so a second generation
    compiles nothing new)."""
    return torch.compile(layer_class.forward, backend=_with_merged_products(backend), dynamic=False)


def _with_merged_products(backend):
    """``backend`` (a name or a compile function) behind a pass that merges repeated products
    (:func:`~kvcompose.hf.projections.deduplicate_products`: the stacked projections' stand-ins)."""
    compile_graph = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    options = {"config_patches": {"emulate_precision_casts": True}} if backend == "inductor" else {}

    def compile_layer(graph_module: torch.fx.GraphModule, example_inputs):
        if deduplicate_products(graph_module.graph):
            graph_module.recompile()
        return compile_graph(graph_module, example_inputs, **options)

    return compile_layer


@contextmanager
def fused_layers(model, backend: str | None = None):
    """Within the block, ``model``'s decoder layers and :func:`step_modules` run their compiled
    ``forward`` (``backend``: default :data:`BACKEND`), and the policy's bookkeeping marked
    :func:`kvcompose.compiled.fused` runs compiled too; they get their own back on exit, whatever
    happens."""
    layers = decoder_layers(model)
    modules = list(layers) + step_modules(model)
    backend = backend or BACKEND
    limits = dict(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT)
    if hasattr(torch._dynamo.config, "invalidate_compile_context_weakrefs"):
        # dynamo drops its weak references to the traced tensors after compiling for its own
        # backends only; ours wraps one, and without this torch.utils.swap_tensors would then
        # refuse the model's weights (a `.to()` that swaps, loading with assign=True)
        limits["invalidate_compile_context_weakrefs"] = True
    with torch._dynamo.config.patch(**limits):
        for module in modules:
            module.forward = types.MethodType(compiled_forward(type(module), backend), module)
        try:
            with stacked_projections(layers), compiled_functions():
                yield
        except torch._dynamo.exc.TorchDynamoException as exc:
            raise RuntimeError(f"could not compile {type(layers[0]).__name__} for a fused decode step ({exc}); "
                               "decode with fast_generate(..., fuse=False)") from exc
        finally:
            for module in modules:
                module.__dict__.pop("forward", None)


def default_fuse(device: torch.device) -> bool:
    """Fuse by default on CUDA: on CPU the compile costs more than the small kernels it saves."""
    return device.type == "cuda"
