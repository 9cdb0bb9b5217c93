"""Static-shape decoding: decode steps with fixed shapes, replayed as CUDA graphs on a GPU.

After an eager prefill every layer's store gets its capacity for the whole generation
(:meth:`LayerStore.fix_capacity`), so a decode step appends in place through
device-side indices and attends through the fused paged kernel with no host
synchronization. What differs between steps is known on the host in advance: a
:class:`Schedule` says which steps move a buffer group into blocks (``flush``) and which
must run eagerly (a trigger fires, the classifier refreshes), by running the policy's
own trigger on the counts that each step adds. Graph-safe evictions and classifier
refreshes happen inside the step too; the other steps replay one of the captured CUDA
graphs (one per combination of flush, eviction and refresh). Each variant runs once eagerly
before its capture, which compiles its kernels; a later decode in the same process whose
stores have the same layout (:func:`decode_signature`) captures it at its first step instead.
On CPU, or with ``graphs=False``, the same steps run eagerly: that is how the tests check
that this path gives the tokens of the eager path.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import weakref
import torch

from ..runtime.owner import OwningCache
from ..runtime.schedule import Schedule, StepPlan, static_capacity
from .compat import cache_kwargs
from .fusion import default_fuse, fused_layers
from .rotation_weights import rotation_in_weights
from .model_check import check_model

#: Name of a decode step's range in ``torch.profiler`` traces, followed by its :func:`step_kind`.
STEP_RANGE = "kvcompose decode step: "
#: The kinds of :func:`step_kind` that a fresh cache pays once per graph variant.
ONE_TIME_KINDS = ("warm-up", "capture")


def step_kind(plan: StepPlan, replay: bool, first: bool, graphs: bool) -> str:
    """How :meth:`StaticDecoder.summary` files a step's time: ``eager`` (runs eagerly by plan),
    ``warm-up`` (the eager run of a graph variant before its capture: one-time work, whatever
    the variant does), ``capture``, then the replays by what they do (``evict``, ``refresh``,
    ``replay``). Without graphs nothing is one-time work: the steps are filed by what they do
    (``evict``, ``refresh``, ``plain``)."""
    if plan.eager:
        return "eager"
    if graphs and not replay:
        return "warm-up"
    if first:
        return "capture"
    if plan.evict:
        return "evict"
    if plan.refresh:
        return "refresh"
    return "replay" if replay else "plain"


def decode_signature(cache, fused: bool) -> tuple:
    """What the compiled kernels of a static decode step depend on besides the model: the
    policy, whether the layers are fused, and every store's fixed layout
    (:meth:`~kvcompose.paging.store_static.StoreStatic.static_layout`)."""
    policy = json.dumps(cache.policy.to_config(), sort_keys=True, default=str)
    return fused, policy, tuple(layer.store.static_layout() for layer in cache.layers)


class StaticDecoder:
    """Runs decode steps of a prefilled cache in static mode; with ``graphs``, the steps that
    are not eager replay captured CUDA graphs. Each variant runs once eagerly first, which
    compiles its kernels, then is captured; a variant that already ran so in this process, on
    the same model with the same :func:`decode_signature`, is captured at its first step."""

    cache = OwningCache()  # weak: the cache owns this part

    def __init__(self, model, cache, next_positions: torch.Tensor, columns: int, graphs: bool,
                 profile: bool = False, fused: bool = False):
        self.model = model
        self.fused = fused  # the decoder layers run compiled (kvcompose.hf.fusion) during the steps
        self.rotation_in_weights = 0  # layers whose projections carry the value rotation (hf.rotation_weights)
        self.cache = cache
        B = next_positions.shape[0]
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=next_positions.device)
        # the rows' positions ([B, 1], as generate computes them from the mask) and the cache
        # position ([1]) in one tensor: a step advances both with one kernel
        self.counters = torch.cat([next_positions.reshape(B).long(), next_positions.new_full((1,), columns)])
        self.positions = self.counters[:B].view(B, 1)
        self.cache_position = self.counters[B:]
        self.graphs = graphs
        self.captured: dict[tuple[bool, bool, bool], tuple] = {}  # StepPlan.graph_key -> graph, logits
        # the variants whose kernels are compiled, shared by the decodes of the same model and signature
        self.warm: set[tuple[bool, bool, bool]] = _warmed_variants(model, decode_signature(cache, fused))
        self.warmed_before = len(self.warm)
        self.warm_ups = 0  # eager first runs of graph variants (graphs only)
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.eager_steps = 0
        self.eviction_steps = 0  # scheduled eviction steps (replayed once captured; refreshes included)
        self.refresh_steps = 0  # scheduled refresh steps without an eviction (replayed once captured)
        self.replays = 0  # replays of plain decode steps (not the ones that captured their graph)
        # profile (CUDA): events around every step by kind, and the host's own time per replayed step
        self.profile = profile
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event, str]] = []  # kind, span, variant
        self._host_s = 0.0
        self.started = time.perf_counter()  # the prefill is done on the device (fast_generate read its flags)
        self.replay_call_s = 0.0
        self.capture_host_s = 0.0  # the host's time in graph captures (between the profile's events)

    def _forward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, position_ids=self.positions, cache_position=self.cache_position,
                         use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, self.cache))
        return out.logits[:, -1]

    def begin_step(self) -> None:
        """Advance the host's counters for the next step (a replayed graph runs no Python)."""
        for layer in self.cache.layers:
            layer.store.columns_seen += 1
        self.cache.counters.begin_forward()

    def step(self, tokens: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Feed ``tokens`` ``[B]`` through one decode step planned by ``plan`` (after
        :meth:`begin_step`); returns logits ``[B, V]``. Under ``torch.profiler`` the step is
        a range named :data:`STEP_RANGE` plus its :func:`step_kind` (and `` flush`` when a
        recent buffer is encoded into blocks in it)."""
        key = plan.graph_key
        replay = not plan.eager and self.graphs and key in self.warm
        first = replay and key not in self.captured
        kind = step_kind(plan, replay, first, self.graphs)
        with torch.profiler.record_function(STEP_RANGE + kind + " flush" * plan.flush):
            return self._step(tokens, plan, replay, first, kind)

    def _step(self, tokens: torch.Tensor, plan: StepPlan, replay: bool, first: bool, kind: str) -> torch.Tensor:
        self.replay_call_s = 0.0
        key = plan.graph_key
        # profile: an eager step's GPU time starts with the step, a replay's at the replay
        began = _recorded_event() if self.profile and not replay else None
        self.ids.copy_(tokens[:, None])
        self.cache.step_plan = plan
        if not replay:
            if not plan.eager:
                self.warm.add(key)
                self.warm_ups += self.graphs
            self.eager_steps += plan.eager
            logits = self._forward()
        else:
            if first:  # capturing (host work between the profile's events), then the first replay: one-time work
                captured = time.perf_counter()
                self.captured[key] = self._capture()
                self.capture_host_s += time.perf_counter() - captured
            graph, logits = self.captured[key]
            if self.profile:
                began = _recorded_event()
            issued = time.perf_counter()
            graph.replay()
            # host time is measured on plain replays (an eviction step waits for the device),
            # not on the step that captured the graph: that is one-time work, like compiling
            plain = not (plan.evict or plan.refresh or first)
            if plain:
                self.replay_call_s = time.perf_counter() - issued
            self.replays += plain
        self.eviction_steps += plan.evict
        self.refresh_steps += plan.refresh and not plan.evict
        self.counters += 1  # positions and cache position
        if self.profile:
            self._events.append((kind, began, _recorded_event(), _variant(plan)))
        return logits

    def note_host(self, seconds: float) -> None:
        """Profiling: the host's wall time for one whole step (its replay call is taken out)."""
        if self.replay_call_s:
            self._host_s += seconds - self.replay_call_s

    def summary(self) -> dict:
        """Steps by kind (``warm_ups``: eager first runs of graph variants;
        ``variants_warmed_before``: variants an earlier decode of the same signature compiled;
        ``rotation_in_weights``: layers whose projections carried the value rotation)
        and, when profiling, milliseconds of decode time and steps by the
        kinds of :func:`step_kind`, host milliseconds per replayed plain step, the one-time
        work's milliseconds by kind and graph variant (``"warm-up evict"``) and the host's
        seconds in graph captures."""
        out = {"fused": self.fused, "rotation_in_weights": self.rotation_in_weights,
               "eager_steps": self.eager_steps, "eviction_steps": self.eviction_steps,
               "refresh_steps": self.refresh_steps, "replays": self.replays, "warm_ups": self.warm_ups,
               "variants_warmed_before": self.warmed_before}
        if self.profile and self._events:
            torch.cuda.synchronize()
            ms: dict[str, float] = {}
            steps: dict[str, int] = {}
            one_time: dict[str, float] = {}
            for kind, began, ended, variant in self._events:
                elapsed = began.elapsed_time(ended)
                ms[kind] = ms.get(kind, 0.0) + elapsed
                steps[kind] = steps.get(kind, 0) + 1
                if kind in ONE_TIME_KINDS:
                    one_time[f"{kind} {variant}"] = one_time.get(f"{kind} {variant}", 0.0) + elapsed
            out["ms_by_kind"] = ms
            out["one_time_ms_by_step"] = one_time
            out["capture_host_s"] = self.capture_host_s
            out["steps_by_kind"] = steps
            out["host_ms_per_replay"] = 1e3 * self._host_s / max(self.replays, 1)
        return out

    def release_graphs(self) -> None:
        """Free the captured graphs and their memory pool now: the cache keeps its decoder (for
        :meth:`summary`), so they would otherwise live as long as the cache, and a decoder
        caught in a reference cycle could be destroyed by Python's cycle collector in the
        middle of another capture (CUDA refuses that and the capture fails)."""
        self.captured.clear()
        self.pool = None

    def _capture(self) -> tuple:
        graph = torch.cuda.CUDAGraph()
        if any(d is not self and d.captured for d in _CAPTURING):
            gc.collect()  # graphs of other decoders the user dropped: destroy them now, not during the capture
        _CAPTURING.add(self)
        try:
            with self.cache.timer.paused():
                logits = capture_overlapped(graph, self.pool, self._forward)
        except RuntimeError as exc:
            raise RuntimeError(
                f"could not capture a CUDA graph of {type(self.model).__name__}'s decode step ({exc}); decode with "
                "fast_generate(..., graphs=False) (static shapes, no graphs) or policy.generate(..., fast=False)"
            ) from exc
        return graph, logits


#: A capture hands the ordinary pool's cached memory back first (a device synchronization) only
#: when less than this share of the device's memory is free: the graph's pool cannot reuse
#: what the ordinary pool caches (say, the scratch of an eager eviction step just before).
CAPTURE_FREE_SHARE = 0.25
_CAPTURE_STREAMS: dict[int, "torch.cuda.Stream"] = {}  # one side stream per device


def capture_overlapped(graph: "torch.cuda.CUDAGraph", pool, run):
    """Capture ``run()`` into ``graph`` (memory from ``pool``) and return its result, like
    ``torch.cuda.graph`` but without its device synchronization and ``empty_cache``: the
    capture records and runs nothing, so the steps already queued keep the device busy while
    the host captures. Capturing happens on a side stream, as ``torch.cuda.graph`` does."""
    free, total = torch.cuda.mem_get_info()
    if free < CAPTURE_FREE_SHARE * total:
        torch.cuda.empty_cache()
    device = torch.cuda.current_device()
    stream = _CAPTURE_STREAMS.get(device) or _CAPTURE_STREAMS.setdefault(device, torch.cuda.Stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = run()
        finally:
            graph.capture_end()
    return out


#: Graph variants (:attr:`StepPlan.graph_key`) that ran eagerly, by model and
#: :func:`decode_signature`: their kernels are compiled, so a later decode of the same layout
#: captures them without an eager first run.
_WARMED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, set]]" = weakref.WeakKeyDictionary()
#: Signatures remembered per model (the oldest is forgotten first): a server that sees many
#: prompt lengths keeps a bounded record.
SIGNATURES_KEPT = 64


def _warmed_variants(model, signature: tuple) -> set:
    """The set of variants warmed under ``signature`` on ``model`` (new and empty if none),
    which the caller adds to; it becomes the newest signature."""
    by_signature = _WARMED.setdefault(model, {})
    variants = by_signature.pop(signature, set())
    by_signature[signature] = variants
    while len(by_signature) > SIGNATURES_KEPT:
        by_signature.pop(next(iter(by_signature)))
    return variants

#: Decoders that have captured graphs. A full garbage collection takes time in proportion to
#: the process's Python objects (a compiled model adds many), so the one before a capture runs
#: only where another decoder still holds graphs (its run did not reach
#: :meth:`StaticDecoder.release_graphs`).
_CAPTURING: "weakref.WeakSet[StaticDecoder]" = weakref.WeakSet()


def _variant(plan: StepPlan) -> str:
    """The graph variant of a step, as :meth:`StaticDecoder.summary` names one-time work."""
    return "+".join(name for name, on in zip(("flush", "evict", "refresh"), plan.graph_key) if on) or "plain"


def _recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def fast_generate(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  max_new_tokens: int = 256, eos_token_id=None, pad_token_id: int | None = None,
                  graphs: bool | None = None, profile: bool = False,
                  reserve_new_tokens: int | None = None, fuse: bool | None = None,
                  fold_rotation: bool = True) -> torch.Tensor:
    """Greedy decoding on a fresh kvcompose ``cache`` through the static-shape path; returns
    ``[B, prompt + new]`` ids like ``model.generate(..., do_sample=False)``.

    The way to decode fast when you drive the model yourself: it replaces
    ``model.generate(**inputs, cache=cache, do_sample=False)``. ``graphs``: replay
    captured CUDA graphs (default: on CUDA). Rows that produced an EOS continue with
    ``pad_token_id``, and decoding stops when all have (one host synchronization per step,
    only when ``eos_token_id`` is given). ``profile`` (CUDA): time the steps by kind, see
    :meth:`StaticDecoder.summary` (``cache.static_decoder``). ``reserve_new_tokens``: size the
    stores for this many new tokens instead of ``max_new_tokens`` (memory measurements of a
    longer generation from a shorter run). ``fuse``: run the decoder layers compiled by
    torch.compile during the decode steps, which fuses their small kernels (see
    :mod:`kvcompose.hf.fusion`; default: on CUDA). The prefill runs uncompiled either way.
    ``fold_rotation``: under a policy with a rotation, the decode steps' value and output
    projections carry the value rotation (:mod:`kvcompose.hf.rotation_weights`: one launch per
    layer less, for one more copy of those weights while decoding); False rotates in the cache."""
    _check_can_run(model, cache, input_ids, max_new_tokens, graphs)
    graphs = input_ids.is_cuda if graphs is None else graphs
    fuse = default_fuse(input_ids.device) if fuse is None else fuse
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as model.generate computes them
    eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=input_ids.device).reshape(-1)
    if eos is not None and pad_token_id is None:
        raise ValueError("pad_token_id is needed with eos_token_id (rows that finished continue with it)")
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache),
                    use_cache=True, logits_to_keep=1)
        tokens = [out.logits[:, -1].argmax(-1)]
        cache.check_errors()
        finished = None if eos is None else torch.isin(tokens[0], eos)
        if max_new_tokens > 1 and not (finished is not None and bool(finished.all())):
            reserve = max(max_new_tokens, reserve_new_tokens or 0)
            kept = cache.most_tokens_held()
            cache.fix_capacity(static_capacity(cache.policy, input_ids.shape[1], reserve, kept),
                               columns_limit=input_ids.shape[1] + reserve)
            decoder = StaticDecoder(model, cache, positions[:, -1:] + 1, input_ids.shape[1], graphs, profile, fuse)
            cache.static_decoder = decoder
            try:
                folding = rotation_in_weights(model, cache) if fold_rotation else contextlib.nullcontext(0)
                with folding as decoder.rotation_in_weights, \
                        fused_layers(model) if fuse else contextlib.nullcontext():
                    try:
                        _decode(decoder, Schedule(cache, max_new_tokens - 1), tokens, finished, eos, pad_token_id)
                    finally:  # before the fused layers' weights are restored, which allocates
                        decoder.release_graphs()
            finally:
                cache.step_plan = None
        cache.check_errors()
    return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)


def _check_can_run(model, cache, input_ids, max_new_tokens: int, graphs: bool | None) -> None:
    check_model(model)
    if cache.policy.needs_text:
        raise ValueError(f"static decode: policy {cache.policy.name!r}'s {cache.policy.needs_text} reads the generated "
                         "text on the host after every step; decode eagerly (model.generate with "
                         "streamer=cache.token_streamer(...), or policy.generate(..., fast=False))")
    if cache.observers:
        raise ValueError("static decode does not run attention observers; decode eagerly (fast=False) to observe")
    if not cache.fused_attention:
        raise ValueError("static decode attends through the fused paged kernel; this cache has fused_attention=False "
                         "(decode it with model.generate, or policy.generate(..., fast=False))")
    if cache.layers[0].store is not None:
        raise ValueError("static decode needs a fresh cache (policy.make_cache(model), or cache.reset())")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if graphs and not input_ids.is_cuda:
        raise ValueError("graphs=True needs the model and inputs on a CUDA device")


def _decode(decoder: StaticDecoder, schedule: Schedule, tokens: list, finished, eos, pad_token_id) -> None:
    """The decode loop: plan, step, pick the greedy token; appends to ``tokens``. Synchronizes
    only at eager steps (to read errors and counts) and, with ``eos``, to stop when all rows finished."""
    cache = decoder.cache
    token = tokens[-1]
    for _ in range(schedule.remaining):
        if decoder.profile:  # the host's own time per step, with nothing queued before it
            torch.cuda.synchronize()
        began = time.perf_counter()
        decoder.begin_step()
        plan = schedule.next()
        token = decoder.step(token, plan).argmax(-1)
        if plan.eager or plan.evict:
            cache.check_errors()
            schedule.sync()
        if eos is not None:
            token = torch.where(finished, pad_token_id, token)
            finished |= torch.isin(token, eos)
        tokens.append(token)
        decoder.note_host(time.perf_counter() - began)
        if eos is not None and bool(finished.all()):
            return
