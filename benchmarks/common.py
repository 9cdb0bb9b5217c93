"""Shared helpers for the kvcompose benchmarks.

- :class:`Scenario` / :func:`build_state`: one layer right after attention, holding
  ``candidates`` live tokens per sequence, exactly as :meth:`Policy.compress` sees it;
- :func:`evict`: the timed eviction step (score + select + gather/compact);
- :func:`environment` and :func:`write_json`: metadata and result files.

The state is built with the public store API (``LayerStore.append``,
``add_to_channel``) from random keys, values and recorded queries. Random data is
fine for speed: every evictor does the same work whatever the values.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from kvcompose import Policy
from kvcompose.evictors import EvictionContext
from kvcompose.paging import LayerStore, StoreView

PRESETS = ("rkv", "snapkv", "h2o", "streamingllm", "rpc")
BUFFER = 128  # R-KV's buffer: candidates = budget + BUFFER, one eviction every BUFFER decode steps
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ eviction state
@dataclass(frozen=True)
class Scenario:
    """One eviction of one layer: ``candidates`` live tokens per sequence, ``keep`` survive."""

    preset: str
    batch: int
    keep: int  # tokens each sequence keeps (the budget)
    candidates: int  # live tokens per sequence before the eviction
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    prompt: int = 64  # the first tokens were the prompt (rpc protects them)

    def describe(self) -> dict:
        out = dataclasses.asdict(self)
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out


@dataclass
class EvictionState:
    """One layer after attention, with the attributes of ``KVComposeLayer`` that ``Policy.compress`` reads."""

    policy: Policy
    store: LayerStore
    view: StoreView
    keep: torch.Tensor  # [B] int64
    queries: torch.Tensor | None  # [B, Hq, W, D], oldest first; None when the evictor reads no queries
    query_positions: torch.Tensor | None  # [B, W]
    scaling: float

    @property
    def query_valid(self) -> torch.Tensor | None:
        return None if self.query_positions is None else self.query_positions >= 0

    def fresh(self) -> "EvictionState":
        """A copy whose store can be compacted without touching this one (the view stays valid for it)."""
        return dataclasses.replace(self, store=copy.deepcopy(self.store))


def make_policy(scenario: Scenario) -> Policy:
    """The preset with its budget set to ``scenario.keep`` (rpc's interval trigger ignores the budget)."""
    return Policy.from_preset(scenario.preset, budget=scenario.keep)


def build_state(scenario: Scenario, device: torch.device | str, seed: int = 0) -> EvictionState:
    """A layer holding ``scenario.candidates`` random tokens per sequence (prompt first, then generated)."""
    s = scenario
    if not s.prompt < s.candidates or s.keep >= s.candidates:
        raise ValueError(f"need prompt < candidates and keep < candidates: {s}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=s.dtype)

    policy = make_policy(s)
    store = policy.make_store(s.batch, s.kv_heads, s.head_dim, s.dtype, device)
    for tokens in (s.prompt, s.candidates - s.prompt):  # prefill, then the generated tokens in one chunk
        shape = (s.batch, s.kv_heads, tokens, s.head_dim)
        store.append(randn(*shape), randn(*shape))
    view = store.view()
    for name in getattr(policy.evictor, "slot_channels", ()):  # h2o's accumulated attention
        store.add_to_channel(name, view, torch.rand(view.valid.shape, generator=gen, device=device))
    window = policy.query_window
    queries = positions = None
    if window:
        queries = randn(s.batch, s.q_heads, window, s.head_dim)
        last = store.columns_seen - window + torch.arange(window, device=device)
        positions = last.expand(s.batch, window).contiguous()
    keep = torch.full((s.batch,), s.keep, dtype=torch.long, device=device)
    return EvictionState(policy, store, view, keep, queries, positions, s.head_dim**-0.5)


def eviction_context(state: EvictionState) -> EvictionContext:
    """The context ``Policy.compress`` builds (with ``keep`` given instead of planned by the trigger)."""
    return state.policy.eviction_context(
        state.store, state.view, state.keep, state.queries, state.query_positions, state.scaling
    )


def evict(state: EvictionState) -> None:
    """The timed eviction step: build the context, score + select, gather the kept tokens (compact)."""
    policy = state.policy
    policy.pager.compact(state.store, state.view, policy.evictor.select(eviction_context(state)))


def kept_positions(store: LayerStore) -> torch.Tensor:
    """Sorted positions of the live tokens of each row, ``[B, n]`` (all rows must hold ``n``)."""
    view = store.view()
    big = torch.iinfo(torch.long).max
    pos = torch.where(view.valid, view.positions, big).sort(dim=1).values
    return pos[:, : int(view.valid.sum(1).max())]


def check_eviction(state: EvictionState) -> bool | None:
    """Run :func:`evict` on a copy and check it; returns whether it matches ``Policy.compress``.

    Every row must keep exactly ``keep`` tokens. Where the preset's own trigger fires
    on this state (all but rpc), ``Policy.compress`` must keep the same tokens, so
    the context built here cannot drift from the library's; None where it does not fire.
    """
    ours = state.fresh()
    evict(ours)
    live = ours.store.live_tokens()
    if not bool((live == state.keep).all()):
        raise AssertionError(f"{state.policy.name}: rows kept {live.tolist()} tokens, expected {state.keep.tolist()}")
    theirs = state.fresh()
    if not state.policy.compress(theirs, state.view):
        return None
    return bool(torch.equal(kept_positions(ours.store), kept_positions(theirs.store)))


# ------------------------------------------------------------------------ metadata
def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        if package == "kvcompose":  # run from a source tree (PYTHONPATH=src) without installing
            import kvcompose

            return kvcompose.__version__
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024)


def llama_model(smoke: bool, device: str = "cuda", dtype: torch.dtype | None = None, max_positions: int = 16384):
    """A random-weight Llama with Llama-3-8B shapes (bf16), or a tiny one for smoke runs (fp32);
    speed does not depend on the weights. Attention: ``kvcompose``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY_LLAMA if smoke else LLAMA3_8B), max_position_embeddings=max_positions,
                         attn_implementation="kvcompose")
    dtype = dtype or (torch.float32 if smoke else torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def environment() -> dict:
    """Where and with what a benchmark ran: date, host, hardware, versions, git commit."""
    cuda = torch.cuda.is_available()
    commit = _git("rev-parse", "HEAD")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "versions": {p: _version(p) for p in ("torch", "triton", "transformers", "kvcompose")},
        "git_commit": commit,
        "git_dirty": bool(_git("status", "--porcelain")) if commit else None,
    }


def write_json(path: str | Path, data: dict) -> Path:
    """Write ``data`` as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # a run killed mid-write leaves the old file whole
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)
    return path


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain fixed-width text table (numbers as given, right-aligned)."""
    cells = [headers] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
