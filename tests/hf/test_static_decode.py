"""Static-shape decoding (kvcompose.hf.static, kvcompose.runtime.schedule): the same tokens, evictions and memory as the eager path."""

import pytest
import torch

from conftest import SHORT_RUN_EVICTION, char_tokenizer, greedy, left_padded, use_torch_references
from sync_guard import HostSyncError, forced_step_kernels, no_host_sync
from kvcompose import Policy
from kvcompose.hf.static import STEP_RANGE, decode_signature, fast_generate
from kvcompose.runtime.schedule import Schedule, static_capacity

# Small budgets and periods so that every trigger fires within a short run.
POLICIES = {
    "fullkv": {},
    **SHORT_RUN_EVICTION,
    "fp8": {},
    "nvfp4": {},
    "kivi2": {"residual": 8},  # buffer of 40: groups of 32 leave it within the run
    "thinkv": {"budget": 48, "refresh": 16},
    "thinkv-tbe": {"budget": 48, "refresh": 16},
}
NEW_TOKENS = 40  # enough for every trigger above to fire, and for thinkv's refreshes and step-downs
QUICK = {"fp8", "nvfp4", "kivi2"}  # formats without eviction: a few buffer flushes suffice (interpreted kernels are slow)


def _run_both(model, policy, ids, mask, new):
    eager = policy.make_cache(model)
    expected = greedy(model, ids, mask, new, cache=eager)
    static = policy.make_cache(model)
    got = fast_generate(model, static, ids, mask, new)[:, ids.shape[1]:]
    return expected, got, eager, static


def _payload(cache):
    return sum(layer.store.memory()["payload"] for layer in cache.layers)


@pytest.mark.parametrize("preset", sorted(POLICIES))
def test_static_path_gives_the_eager_tokens_evictions_and_memory(llama, preset):
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])  # rows of different lengths: buffers fill on different steps
    new = 24 if preset in QUICK else NEW_TOKENS
    expected, got, eager, static = _run_both(llama, policy, ids, mask, new)
    assert torch.equal(expected, got)
    for e, st in zip(eager.layers, static.layers):  # the static ring, read oldest first, is the eager window
        for x, y in zip(e.recent_queries(), st.recent_queries()):
            assert (x is None and y is None) or torch.equal(x, y)
    a, b = eager.report(), static.report()
    assert a.evictions == b.evictions
    assert a.eviction_call_rate == b.eviction_call_rate
    assert a.refreshes == b.refreshes and a.thought_mix == b.thought_mix  # refreshes inside the steps
    if policy.evicts_in_place:  # no compaction: evicted slots stay allocated as holes until refilled
        pool = static.layers[0].store.regions[0].pool
        holes = len(static.layers) * ids.shape[0] * 2 * pool.payload_bytes_per_block
        assert _payload(eager) <= _payload(static) <= _payload(eager) + holes
    else:
        assert _payload(eager) == _payload(static)
    for x, y in zip(eager.layers, static.layers):  # the same tokens kept, at the same positions, stored alike
        vx, vy = x.store.view(), y.store.view()
        for r in range(ids.shape[0]):
            (px, kx, ux), (py, ky, uy) = _by_position(vx, r), _by_position(vy, r)
            assert torch.equal(px, py)
            torch.testing.assert_close(ky, kx, rtol=0, atol=1e-6)  # decoded: the same codes and scales
            torch.testing.assert_close(uy, ux, rtol=0, atol=1e-6)
    assert static.static_decoder.eager_steps <= new - 1


@pytest.mark.parametrize("preset", ["fp8", "kivi2", "rkv", "thinkv"])
def test_head_major_pools_keep_the_same_tokens_and_memory(llama, preset):
    """Eager and static decode with each head's slots together (``pool_layout="head"``) give the
    slot-major run's tokens and hold as many bytes."""
    _, ids, mask = left_padded([20, 13, 31])
    new = 24 if preset in QUICK else NEW_TOKENS
    runs = [_run_both(llama, Policy.from_preset(preset, **POLICIES[preset], pool_layout=layout), ids, mask, new)
            for layout in ("slot", "head")]
    (expected, got, eager, static), (head_expected, head_got, head_eager, head_static) = runs
    assert torch.equal(head_expected, expected) and torch.equal(head_got, got)
    assert _payload(head_eager) == _payload(eager) and _payload(head_static) == _payload(static)
    pool = head_static.layers[0].store.regions[0].pool
    assert not pool.flat_slots(pool.slots)[next(iter(pool.slots))].is_contiguous()


def _by_position(view, row: int):
    """Positions, keys and values ``[H, n, D]`` of a row's live tokens, in position order."""
    live = view.valid[row]
    order = view.positions[row].masked_fill(~live, torch.iinfo(view.positions.dtype).max).argsort()[: int(live.sum())]
    return view.positions[row][order], view.keys[row][:, order], view.values[row][:, order]


def test_schedule_predicts_exactly_the_steps_whose_trigger_fires(llama):
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([20, 13, 31])
    eager = policy.make_cache(llama)
    greedy(llama, ids, mask, NEW_TOKENS, cache=eager)
    static = policy.make_cache(llama)
    fast_generate(llama, static, ids, mask, NEW_TOKENS)
    # Every scheduled eviction step of the static path is an eviction step of the eager path and
    # vice versa; R-KV's selection is graph-safe, so none of them runs eagerly.
    assert static.static_decoder.eviction_steps == eager.report().eviction_steps
    assert static.static_decoder.eager_steps == 0 and eager.report().eviction_steps > 1
    assert static.report().eviction_steps == eager.report().eviction_steps


def test_profiler_ranges_name_each_step_by_what_it_does(llama):
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fast_generate(llama, cache, ids, mask, NEW_TOKENS)
    kinds = [e.name.removeprefix(STEP_RANGE) for e in prof.events() if e.name.startswith(STEP_RANGE)]
    decoder = cache.static_decoder
    assert len(kinds) == NEW_TOKENS - 1  # the prefill gave the first token
    assert sum(k.startswith("evict") for k in kinds) == decoder.eviction_steps > 0
    assert "plain" in kinds and any(k.endswith(" flush") for k in kinds)
    assert set(kinds) <= {"plain", "evict", "plain flush", "evict flush"}


@pytest.mark.parametrize("preset", ["thinkv", "h2o", "rkv"])
def test_static_step_keeps_every_state_tensor_in_place(llama, preset):
    """What a captured CUDA graph needs: a step writes into the tensors it read, never new ones."""
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    fast_generate(llama, cache, ids, mask, 2)  # prefill + one step: static mode entered

    def tensors(c):
        out = {}
        for i, layer in enumerate(c.layers):
            s = layer.store
            named = {"buf_k": s.buf_k, "buf_len": s.buf_len, "tokens_seen": s.tokens_seen, "column": s.column,
                     "queries": layer.queries, **{f"meta.{n}": t for n, t in s.buf_meta.items()}}
            for j, r in enumerate(s.regions):
                named.update({f"r{j}.table": r.table, f"r{j}.length": r.length, f"r{j}.blocks": r.num_blocks})
            for name, p in s.pools.items():
                named.update({f"{name}.{n}": t for n, t in {**p.slots, **p.meta}.items()})
            out.update({(i, n): t.data_ptr() for n, t in named.items() if t is not None})
        return out

    before = tensors(cache)
    decoder = cache.static_decoder
    schedule = Schedule(cache, 40)
    token = torch.zeros(ids.shape[0], dtype=torch.long)
    with torch.inference_mode():
        for _ in range(40):  # flushes, refreshes and segment evictions included
            decoder.begin_step()
            decoder.step(token, schedule.next())
            schedule.sync()
    cache.step_plan = None
    assert tensors(cache) == before


def test_sync_guard_refuses_host_reads():
    t = torch.arange(4)
    with no_host_sync():
        for read in (lambda: bool(t.sum()), lambda: t[t > 1], lambda: t.sum().item(), lambda: t.tolist(),
                     lambda: torch.tensor([1, 2]), lambda: t.cpu(), lambda: t.numpy(), lambda: t.nonzero(),
                     lambda: torch.nonzero(t), lambda: torch.argwhere(t), lambda: t.unique(),
                     lambda: torch.unique(t), lambda: t.masked_select(t > 1), lambda: torch.where(t > 1)):
            with pytest.raises(HostSyncError):
                read()
        with pytest.raises(HostSyncError, match="Tensor.item reads a device value"):
            t.sum().item()
        with pytest.raises(HostSyncError, match="torch.unique has a data-dependent output size"):
            torch.unique(t)
        t[t.clamp(max=2)] = t.flip(0)  # tensor values through tensor indices are fine
        assert torch.equal(torch.where(t > 1, t, 0), t.where(t > 1, 0))  # both values given: fixed size
    assert "cpu" not in vars(torch.Tensor) and torch.unique is torch.functional.unique  # restored as they were
    assert torch.where(torch.arange(4) > 1)[0].tolist() == [2, 3] and torch.arange(3).cpu().numpy().sum() == 3  # restored


def guard_replayed_steps(monkeypatch) -> None:
    """Run every step that the GPU would replay from a graph (not the eager ones) under
    :func:`no_host_sync`."""
    from kvcompose.hf import static

    forward = static.StaticDecoder._forward

    def guarded(self):
        if self.cache.step_plan.eager:
            return forward(self)
        with no_host_sync():
            return forward(self)

    monkeypatch.setattr(static.StaticDecoder, "_forward", guarded)


def head_dim_64_llama(device: str = "cpu"):
    """A 2-layer random Llama with head dim 64, where the compiled kernels take every format."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).to(device).eval()
    model.set_attn_implementation("kvcompose")
    return model


@pytest.mark.parametrize("preset", sorted(POLICIES))
def test_steps_between_eager_ones_never_read_the_device(llama, preset, monkeypatch):
    """What CUDA graph capture needs, checked on CPU: no host synchronization in the steps that
    the GPU replays (every preset; eager steps may synchronize, and no built-in preset has any:
    evictions and classifier refreshes are scheduled inside the steps)."""
    guard_replayed_steps(monkeypatch)
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    fast_generate(llama, cache, ids, mask, 24)
    decoder = cache.static_decoder
    assert decoder.eager_steps == 0
    if preset.startswith("thinkv"):  # refresh = 16: one refresh (and segment-end eviction) in 23 steps
        assert decoder.eviction_steps + decoder.refresh_steps == 1


def test_a_later_decode_of_the_same_layout_knows_which_variants_are_compiled():
    """The graph variants a decode ran are remembered by model and decode signature: a later
    decode with the same layout captures them without an eager first run; another layout
    (a shorter prompt here) does not count them."""
    model = head_dim_64_llama()
    policy = Policy.from_preset("h2o", **POLICIES["h2o"])
    _, ids, mask = left_padded([20, 13, 31])
    caches = [policy.make_cache(model) for _ in range(3)]
    for cache, cut in zip(caches, (0, 0, 1)):
        fast_generate(model, cache, ids[:, cut:], mask[:, cut:], 24)
    first, again, shorter = (cache.static_decoder for cache in caches)
    assert len(first.warm) >= 2  # plain steps and evictions
    assert first.summary()["variants_warmed_before"] == 0 == shorter.summary()["variants_warmed_before"]
    assert again.summary()["variants_warmed_before"] == len(first.warm)
    assert decode_signature(caches[0], False) == decode_signature(caches[1], False) != decode_signature(caches[2], False)


def test_a_model_remembers_a_bounded_number_of_signatures(monkeypatch):
    from kvcompose.hf import static

    monkeypatch.setattr(static, "SIGNATURES_KEPT", 2)
    model = torch.nn.Linear(1, 1)
    static._warmed_variants(model, ("a",)).add((False, False, False))
    static._warmed_variants(model, ("b",))
    assert static._warmed_variants(model, ("a",)) == {(False, False, False)}  # now the newest
    static._warmed_variants(model, ("c",))
    assert list(static._WARMED[model]) == [("a",), ("c",)]


def _state_tensors(obj, path="cache", out=None, seen=None) -> dict:
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples, by path
    (models and the static decoder left out: not state that a step keeps)."""
    out, seen = ({}, set()) if out is None else (out, seen)
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif id(obj) not in seen and not isinstance(obj, (str, int, float, bool, type, torch.nn.Module)) \
            and obj is not None:
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = ((f"{path}[{k!r}]", v) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            items = ((f"{path}[{i}]", v) for i, v in enumerate(obj))
        else:
            items = ((f"{path}.{k}", v) for k, v in getattr(obj, "__dict__", {}).items() if k != "static_decoder")
        for sub_path, value in items:
            _state_tensors(value, sub_path, out, seen)
    return out


@pytest.mark.parametrize("preset", sorted(POLICIES))
def test_every_tensor_a_step_keeps_exists_before_the_first_step(llama, preset, monkeypatch):
    """A tensor first made inside a captured step would belong to the graph, its making replayed
    at every step; a decode that captures without an eager first run (an earlier decode of the
    same layout compiled the kernels) relies on this."""
    from kvcompose.hf import static

    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    cache = policy.make_cache(llama)
    decode, before = static._decode, {}

    def noted_decode(decoder, *args):
        before.update({path: id(t) for path, t in _state_tensors(cache).items()})
        return decode(decoder, *args)

    monkeypatch.setattr(static, "_decode", noted_decode)
    fast_generate(llama, cache, ids, mask, 24)
    made = sorted(path for path, t in _state_tensors(cache).items() if before.get(path) != id(t))
    assert before and made == []


def test_capacity_follows_the_trigger():
    assert static_capacity(Policy.from_preset("fullkv"), 100, 50) == 150
    assert static_capacity(Policy.from_preset("rkv", budget=64), 100, 500) == 100 + 128 + 16
    assert static_capacity(Policy.from_preset("rkv", budget=64), 10, 20) == 30
    assert static_capacity(Policy.from_preset("rpc"), 10, 9000) == 9010  # no bound: the whole length
    # tbe keeps the prompt and at least 4 tokens of every completed segment: 31 + 12 x 4 = 79 > budget 40
    thinkv = Policy.from_preset("thinkv", budget=40, refresh=8, block_size=4, group_size=4)
    assert static_capacity(thinkv, 31, 100) == 79 + 8 + 4
    # the newest 30 tokens are never evicted either (thinkv-int keeps a share of its budget whole)
    assert static_capacity(Policy.from_preset("thinkv", budget=40, refresh=8, block_size=4, group_size=4,
                                              protect_recent=30), 31, 100) == 79 + 30 + 8 + 4


def test_a_prompt_cut_at_the_prefill_reserves_the_budget_not_the_prompt(llama):
    """R-KV evicts a long prompt down to its budget at the end of the prefill: static decode
    then reserves room for the budget and the trigger's headroom, and decodes the eager tokens."""
    policy = Policy.from_preset("rkv", budget=32, trigger={"buffer": 8})
    _, ids, mask = left_padded([100, 70, 90])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 30)
    assert torch.equal(expected, got)
    store = static.layers[0].store
    reserved = max(r.table.shape[1] * r.pool.block_size for r in store.regions)
    assert reserved < ids.shape[1] < static_capacity(policy, ids.shape[1], 30)  # the prompt's reservation


def test_each_region_reserves_what_it_holds_plus_the_tokens_to_come(llama, monkeypatch):
    """ThinKV's classes split a long prompt: a class's region reserves what its fullest row has
    written plus the tokens still to come (the new ones and the recent buffer), not the whole
    sequence once per class, and the static path still decodes the eager tokens."""
    from kvcompose.paging.region import Region

    policy = Policy.from_preset("thinkv-tbq", block_size=4, group_size=4)  # no eviction: the whole sequence
    _, ids, mask = left_padded([100, 70, 90])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 12)
    static.check_errors()
    assert torch.equal(expected, got)
    whole = -(-static_capacity(policy, ids.shape[1], 12) // 4)  # blocks per row for the whole sequence
    widths = [r.table.shape[1] for r in static.layers[0].store.regions]
    assert len(widths) == 3 and max(widths) <= whole and sum(widths) < 3 * whole
    monkeypatch.setattr(Region, "width_to_come", lambda self, width, incoming: width)  # every region: everything
    every = policy.make_cache(llama)
    assert torch.equal(fast_generate(llama, every, ids, mask, 12)[:, ids.shape[1]:], expected)
    assert static.report().allocated_bytes < every.report().allocated_bytes


def test_static_path_refuses_what_it_cannot_run(llama):
    policy = Policy.from_preset("fullkv")
    _, ids, mask = left_padded([5, 7])
    with pytest.raises(ValueError, match="fused_attention=False"):
        fast_generate(llama, policy.make_cache(llama, fused_attention=False), ids, mask, 4)
    cache = policy.make_cache(llama)
    cache.observers.append(lambda *a: None)
    with pytest.raises(ValueError, match="observers"):
        fast_generate(llama, cache, ids, mask, 4)
    with pytest.raises(ValueError, match="graphs=True needs"):
        fast_generate(llama, policy.make_cache(llama), ids, mask, 4, graphs=True)
    used = policy.make_cache(llama)
    fast_generate(llama, used, ids, mask, 3)
    with pytest.raises(ValueError, match="fresh cache"):
        fast_generate(llama, used, ids, mask, 3)


def test_policy_generate_fast_matches_eager_and_refuses_sampling(llama):
    tok = char_tokenizer()
    policy = Policy.from_preset("snapkv", budget=32, trigger={"buffer": 8})
    a = policy.generate(llama, tok, ["abc", "hello world"], max_new_tokens=24, fast=False, do_sample=False)
    b = policy.generate(llama, tok, ["abc", "hello world"], max_new_tokens=24, fast=True)
    assert a.sequences == b.sequences
    assert a.report.evictions == b.report.evictions
    with pytest.raises(ValueError, match="fast=False"):
        policy.generate(llama, tok, ["abc"], max_new_tokens=4, fast=True, do_sample=True)


CALIBRATED = {"classifier": {"name": "sparsity_kde", "thresholds": [0.5, 0.8], "layers": [0, 1]}}
# Per preset: overrides that bring its scheduled work into a short run (every kernel interpreted:
# a step takes seconds), and the kinds of step of that run ("F" flush, "X" eviction, "R" refresh):
# the kinds a 20-token run with the POLICIES settings has, in 6 tokens.
GUARDED_RUNS = {"h2o": ({}, {"", "F"}), "kivi2": ({"residual": 2}, {"", "F"}),
                "rkv": ({"trigger": {"buffer": 2}}, {"", "F", "X", "FX"}),
                "thinkv": ({**CALIBRATED, "refresh": 4}, {"", "F", "XR"})}
GUARDED_TOKENS = 6


@pytest.mark.parametrize("preset", sorted(GUARDED_RUNS), ids=["h2o", "kivi2", "rkv", "thinkv-calibrated"])
def test_kernel_launching_code_of_the_replayed_steps_never_reads_the_device(preset, monkeypatch):
    """The host code around the per-step kernels (on CPU it only runs with the kernels forced
    into the interpreter) is what a CUDA graph captures too: it must not copy host data or
    synchronize. The tokens match the references' run, and the run has every kind of step its
    schedule makes (flushes, evictions, refreshes). ThinKV with calibrated layers also
    measures their sparsity in its (captured) refresh steps."""
    guarded_run(preset, monkeypatch)


@pytest.mark.parametrize("preset", ["kivi2", "rkv", "thinkv"])
def test_head_major_pools_decode_the_slot_major_tokens(preset, monkeypatch):
    """``Policy.pool_layout="head"``: every per-step kernel (appends, attention, evictions, packs
    and slot copies) on pools whose rows lie by head gives the slot-major reference run's tokens."""
    guarded_run(preset, monkeypatch, layout="head")


def guarded_run(preset: str, monkeypatch, layout: str = "slot") -> None:
    from kvcompose.hf.static import StaticDecoder
    from kvcompose.quantizers.codec import QuantCodec

    overrides, kinds = GUARDED_RUNS[preset]
    model = head_dim_64_llama()
    policy = Policy.from_preset(preset, **{**POLICIES[preset], **overrides, "pool_layout": layout})
    reference = Policy.from_preset(preset, **{**POLICIES[preset], **overrides})
    _, ids, mask = left_padded([20, 13, 31])
    with monkeypatch.context() as patch:  # the reference run: quantizers by their torch references
        use_torch_references(patch)
        expected = fast_generate(model, reference.make_cache(model), ids, mask, GUARDED_TOKENS)
    probe, step = QuantCodec._probe, StaticDecoder.step
    plans = []

    def probe_by_reference(codec, device):  # a codec's one-time encode at set-up, before any step
        with monkeypatch.context() as patch:
            use_torch_references(patch)
            probe(codec, device)

    def recorded_step(decoder, tokens, plan):
        plans.append(plan)
        return step(decoder, tokens, plan)

    monkeypatch.setattr(QuantCodec, "_probe", probe_by_reference)
    monkeypatch.setattr(StaticDecoder, "step", recorded_step)
    guard_replayed_steps(monkeypatch)
    picked = forced_step_kernels(monkeypatch)
    cache = policy.make_cache(model)
    assert torch.equal(fast_generate(model, cache, ids, mask, GUARDED_TOKENS), expected)
    pool = cache.layers[0].store.regions[0].pool
    assert pool.flat_slots(pool.slots)[next(iter(pool.slots))].is_contiguous() == (layout == "slot")
    assert cache.static_decoder.eager_steps == 0  # every step was guarded
    assert {"_append_token_kernel", "_paged_partial_kernel"} <= picked
    if preset == "thinkv":  # R and E share a row reserve: evictions pack and release its blocks
        assert {"_pack_plan_kernel", "_release_kernel"} <= picked, picked
    assert {"".join(c for c, on in zip("FXR", p.graph_key) if on) for p in plans} == kinds


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fullkv", "nvfp4", "rkv", "thinkv", "streamingllm", "h2o"])
def test_graph_replay_gives_the_eager_static_tokens(preset):
    """The first graphed decode runs each variant eagerly before capturing it; a later one of
    the same layout captures each at its first step. Both give the unreplayed tokens."""
    model = head_dim_64_llama("cuda")
    policy = Policy.from_preset(preset, **POLICIES[preset])
    _, ids, mask = left_padded([20, 13, 31])
    ids, mask = ids.cuda(), mask.cuda()
    caches = [policy.make_cache(model) for _ in range(3)]
    first = fast_generate(model, caches[0], ids, mask, 60, graphs=True)
    plain = fast_generate(model, caches[1], ids, mask, 60, graphs=False)
    later = fast_generate(model, caches[2], ids, mask, 60, graphs=True)
    assert torch.equal(plain, first) and torch.equal(plain, later)
    warmed, again = caches[0].static_decoder, caches[2].static_decoder
    assert warmed.warm_ups > 0 and warmed.replays > 0 and again.replays > 0
    assert again.warm_ups == 0 and again.warmed_before == warmed.warm_ups


@pytest.mark.parametrize("pager,holes,run", [("gather", None, 0), ("ct", None, 0), ("gather", 0, 0), ("ct", 1, 0),
                                              ("ct", 1, 16)],
                         ids=["gather", "ct", "gather-reserve", "ct-reserve", "ct-reserve-empty-blocks"])
def test_static_compaction_keeps_the_eager_tokens_without_reading_the_device(pager, holes, run):
    """Both pagers in static mode: the same kept tokens (positions, keys, values, classes) as the
    eager pager after the same eviction, with fixed shapes and no host synchronization. With a
    row reserve (``holes`` given), the two classes' regions share their pool's blocks: ``ct``
    packs the rows whose holes reach a block and both give emptied blocks back, so the regions
    hold what the eager pager leaves them, and the static view spans the reserve once. ``run``:
    drop the first ``run`` positions and most after them, so that whole blocks are empty before
    the packing."""
    from kvcompose.pagers import ContinuousThinkingPager, GatherPager
    from kvcompose.paging import DenseCodec, LayerStore

    def filled():
        codecs = {"R": DenseCodec(torch.float32), "T": DenseCodec(torch.float32)}
        store = LayerStore(3, 2, 8, torch.float32, torch.device("cpu"), block_size=4, group_size=4, codecs=codecs)
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(3, 2, 30, 8, generator=g), torch.randn(3, 2, 30, 8, generator=g)
        real = torch.ones(3, 30, dtype=torch.bool)
        real[1, :9] = False  # a left-padded row
        store.append(k, v, real, torch.randint(0, 2, (3, 30), generator=g))
        return store

    make = (lambda: GatherPager()) if pager == "gather" else (lambda: ContinuousThinkingPager(max_hole_blocks=holes))
    eager, static = filled(), filled()
    static.fix_capacity(48, hole_blocks=holes)
    assert [r.static_holes for r in static.regions] == [holes != 0] * 2  # gather's flushes look for none
    shared = static.regions[0].reserve
    assert (shared is not None) == (holes is not None) and static.regions[1].reserve is shared
    free_before = None if shared is None else shared.count.clone()

    def keep_for(view):  # the same rule on both layouts: drop every third position, or the first `run` and
        if run:  # two of three after them (whole blocks empty, and rows with a block of holes to pack)
            return view.valid & (view.positions >= run) & (view.positions % 3 == 1)
        return view.valid & (view.positions % 3 != 0)

    make().compact(eager, eager.view(), keep_for(eager.view()))
    view = static.view()
    keep = keep_for(view)
    # regions that share a reserve share their view's columns: the reserve's width, not each table's
    widths = sum(r.table.shape[1] for r in static.regions)
    assert view.block_columns == 4 * (widths if shared is None else shared.width) < 4 * widths + (shared is None)
    with no_host_sync():
        make().compact(static, view, keep)

    def kept(store):
        v = store.view()
        out = []
        for r in range(3):
            live = v.valid[r]
            order = torch.argsort(v.positions[r][live])
            out.append((v.positions[r][live][order], v.keys[r][:, live][:, order], v.values[r][:, live][:, order],
                        v.classes[r][live][order]))
        return out

    for a, b in zip(kept(eager), kept(static)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    report = [s.live_tokens().tolist() for s in (eager, static)]
    assert report[0] == report[1] and int(static.evictions_on_device) == 1
    if shared is None:
        return
    # the regions hold the eager pager's blocks, the rest went back to the reserve, no block twice
    for e, st in zip(eager.regions, static.regions):
        assert torch.equal(e.length, st.length) and torch.equal(e.num_blocks, st.num_blocks)
        cols = torch.arange(st.table.shape[1])[None, :]
        assert torch.equal(st.table >= 0, cols < st.num_blocks[:, None])
    for r in range(3):
        held = torch.cat([st.table[r][st.table[r] >= 0] for st in static.regions] + [shared.ids[r, :shared.count[r]]])
        assert held.numel() == shared.width and held.unique().numel() == held.numel()
    assert int((shared.count - free_before).sum()) > 0
    # the next group of every row goes where the eager store puts it, taking blocks from the reserve
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 4, 8, generator=g), torch.randn(3, 2, 4, 8, generator=g)
    cls = torch.randint(0, 2, (3, 4), generator=g)
    eager.append(k, v, None, cls)
    with no_host_sync():
        for t in range(4):
            static.append_step(k[:, :, t:t + 1], v[:, :, t:t + 1], cls[:, t], flush=True)
    static.check_errors()
    for a, b in zip(kept(eager), kept(static)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.slow
def test_thinkv_static_path_matches_eager_after_the_ct_pager_moves_tokens(llama):
    """Long enough for the eager ct pager to move tokens into holes (static mode never moves
    them): ThinKV's selection must not depend on which slots its tokens lie in."""
    policy = Policy.from_preset("thinkv-tbe", budget=48, refresh=16)
    _, ids, mask = left_padded([20, 13, 31])
    expected, got, _, _ = _run_both(llama, policy, ids, mask, 100)
    assert torch.equal(expected, got)  # failed while tbe fed K-means its segments in slot order


def test_static_capacity_covers_what_tbe_cannot_evict(llama):
    """A budget below what ThinKV's step-downs can reach (prompt + 4 tokens per completed
    segment) still decodes on the static path, with the eager tokens. Its classes, all in one
    pool here (unquantized), draw from one reserve per row instead of reserving the capacity
    each; the run's step-downs pack holes and give emptied blocks back for later groups (the
    compaction test above checks those moves against the eager pager)."""
    policy = Policy.from_preset("thinkv-tbe", budget=40, refresh=8, block_size=4, group_size=4)
    _, ids, mask = left_padded([20, 13, 31])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 60)
    static.check_errors()
    assert torch.equal(expected, got)
    assert int(eager.layers[0].store.live_tokens().max()) > 40  # the eager path keeps more than the budget too
    regions = static.layers[0].store.regions
    reserve = regions[0].reserve
    assert regions[1].reserve is reserve and regions[2].reserve is reserve is not None
    per_class = sum(r.table.shape[1] for r in regions) * ids.shape[0]  # blocks that a reservation per class takes
    assert regions[0].pool.capacity <= regions[0].reserve.width * ids.shape[0] + 1 < per_class  # + the trash block


def test_static_capacity_covers_the_protected_newest_tokens(llama):
    """thinkv-int's layout: TBE under a budget whose newest two thirds are never evicted, on a
    run longer than the budget (prompt + protected tokens + step-downs pass the budget)."""
    policy = Policy.from_preset("thinkv-int", budget=48, refresh=8, block_size=4, group_size=4,
                                precision={"R": None, "E": None, "T": None})
    _, ids, mask = left_padded([20, 13, 31])
    expected, got, eager, static = _run_both(llama, policy, ids, mask, 60)
    static.check_errors()
    assert torch.equal(expected, got)
    assert int(eager.layers[0].store.live_tokens().max()) > 48
