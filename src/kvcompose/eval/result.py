"""What a comparison hands back: per-step replays pooled into records, and the files written from them."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .metrics import MEMORY_BASIS, TOPK
from .replays import Replay
from .trajectory import TRAJECTORY_ATTENTION, Trajectory


def _r(x: float, digits: int = 6):
    """``x`` to ``digits`` significant digits, NaN as ``None``: JSON stays short and valid."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return float(f"{x:.{digits}g}")


def _rounded(values: torch.Tensor, digits: int = 6) -> list:
    return [_r(x, digits) for x in values.tolist()]


def _aggregate(replays: list[Replay], trajectories: list[Trajectory]) -> tuple[dict, list[dict]]:
    """Pool the valid steps of every prompt: one aggregate dict and per-prompt per-step arrays."""
    pooled: dict[str, list[torch.Tensor]] = {"memory_pct": [], "agree": [], "kl": [], "delta_nll": [], "recall": []}
    final, layers, per_prompt = [], [], []
    for rep, traj in zip(replays, trajectories):
        valid = traj.valid
        series = {"memory_pct": rep.memory_pct, "agree": rep.agree.double(), "kl": rep.kl,
                  "delta_nll": rep.nll - rep.nll_full, "recall": rep.recall}
        for key, values in series.items():
            pooled[key].append(values[valid])
        if rep.recall_layers.numel():
            layers.append(rep.recall_layers[valid])
        for b in range(valid.shape[0]):  # loop over prompts, for the per-prompt JSON arrays
            n = int(traj.steps[b])
            per_prompt.append({
                "agree": rep.agree[b, :n].int().tolist(),
                "kl": _rounded(rep.kl[b, :n]),
                "nll": _rounded(rep.nll[b, :n]),
                "delta_nll": _rounded(series["delta_nll"][b, :n]),
                "recall": _rounded(rep.recall[b, :n], 4),
                "memory_pct": _rounded(series["memory_pct"][b, :n], 5),
                "kv_bytes": [round(x) for x in rep.kv_bytes[b, :n].tolist()],
                "full_kv_bytes": [round(x) for x in rep.full_kv_bytes[b, :n].tolist()],
            })
            final.append(float(series["memory_pct"][b, n - 1]))
    mean = {key: float(torch.cat(parts).mean()) for key, parts in pooled.items()}
    per_layer = torch.cat(layers).mean(0).tolist() if layers else []
    agg = {
        "memory_pct_mean": mean["memory_pct"],
        "memory_pct_final": sum(final) / len(final),
        "agreement": mean["agree"],
        "kl_mean": mean["kl"],
        "delta_nll_mean": mean["delta_nll"],
        "recall_mean": mean["recall"],
        "recall_per_layer": [_r(x, 4) for x in per_layer],
        "steps": int(sum(int(t.steps.sum()) for t in trajectories)),
        "evictions": sum(r.evictions for r in replays),
        "peak_kv_bytes": max(r.peak_kv_bytes for r in replays),
        "seconds": sum(r.seconds for r in replays),
    }
    return agg, per_prompt


def policy_record(label: str, policy, replays: list[Replay], trajectories: list[Trajectory]) -> dict:
    """One policy's entry in :attr:`FidelityResult.policies`: its config, aggregates and per-step arrays."""
    agg, per_prompt = _aggregate(replays, trajectories)
    record = {"label": label, "preset": policy.name, "config": policy.to_config(), "aggregates": agg,
              "per_prompt": per_prompt}
    if replays and replays[0].sharing:  # block sharing: counts summed over batches, rates recomputed
        record["sharing"] = _sharing_totals([r.sharing for r in replays])
    return record


def _sharing_totals(reports: list[dict]) -> dict:
    """Sharing counts of several batches added up (with their share rate and filter time per step)."""
    total = {k: sum(r[k] for r in reports) for k in ("steps", "shareable_blocks", "decisions", "shared_blocks")}
    total["share_rate"] = total["shared_blocks"] / total["shareable_blocks"] if total["shareable_blocks"] else 0.0
    steps = total["steps"]
    total["filter_ms_per_step"] = (sum(r["filter_ms_per_step"] * r["steps"] for r in reports) / steps) if steps else 0.0
    return total


def prompt_records(trajectories: list[Trajectory], replays: list[Replay], tokenizer, prompts: list[str]) -> list[dict]:
    """One entry per prompt: its trajectory's tokens and text, full-KV NLL, and where EOS masking changed a pick.

    ``replays`` are any one policy's replays of ``trajectories``: every replay carries ``nll_full``.
    """
    records = []
    for traj, rep in zip(trajectories, replays):
        for b in range(traj.tokens.shape[0]):
            n = int(traj.steps[b])
            toks = traj.tokens[b, :n].tolist()
            records.append({
                "prompt_tokens": int(traj.attention_mask[b].sum()),
                "steps": n,
                "tokens": toks,
                "text": tokenizer.decode(toks, skip_special_tokens=False) if tokenizer is not None else None,
                "nll_full": _rounded(rep.nll_full[b, :n]),
                "suppressed_token_ids": list(traj.suppressed_ids),
                "suppressed_before_step": traj.suppress_before,
                "suppression_changed_argmax_at": torch.nonzero(traj.suppression_mattered[b, :n]).flatten().tolist(),
            })
    for i, rec in enumerate(records):
        rec["prompt"] = prompts[i] if i < len(prompts) else None
    return records


@dataclass
class FidelityResult:
    """Per-policy aggregates, per-prompt per-step arrays, the self-check and the run's metadata."""

    policies: list[dict]  # {label, preset, config, aggregates, per_prompt: [{metric: [per step]}]}
    prompts: list[dict]  # {prompt, prompt_tokens, steps, tokens, text, nll_full, ...}
    self_check: dict
    metadata: dict = field(default_factory=dict)

    def rows(self) -> list[dict]:
        """One flat dict per policy: label, preset and the aggregates."""
        return [{"label": p["label"], "preset": p["preset"], **p["aggregates"]} for p in self.policies]

    @property
    def _topk(self) -> int:
        return self.metadata.get("replay", {}).get("topk", TOPK)

    @property
    def _basis(self) -> str:
        return self.metadata.get("replay", {}).get("memory_basis", MEMORY_BASIS)

    def markdown(self) -> str:
        """The comparison table as markdown."""
        head = ["policy", "KV mem % (mean)", "KV mem % (final)", "top-1 agree %", "mean KL", "ΔNLL",
                f"top-{self._topk} recall %"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
        for r in self.rows():
            lines.append("| " + " | ".join([
                r["label"], f"{r['memory_pct_mean']:.1f}", f"{r['memory_pct_final']:.1f}",
                f"{100 * r['agreement']:.2f}", f"{r['kl_mean']:.2e}", f"{r['delta_nll_mean']:+.4f}",
                f"{100 * r['recall_mean']:.1f}",
            ]) + " |")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"metadata": self.metadata, "self_check": self.self_check, "prompts": self.prompts,
                "policies": self.policies}

    def save(self, out_dir: str | Path, stem: str = "fidelity") -> dict[str, Path]:
        """Write ``fidelity.json``, ``fidelity.md`` and ``fidelity.png`` under ``out_dir``."""
        from .plot import plot_fidelity

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        paths["md"].write_text(self.report_markdown() + "\n", encoding="utf-8")
        plot_fidelity(self.rows(), paths["png"], title=self._title(), topk=self._topk, basis=self._basis)
        return paths

    def _title(self) -> str:
        m = self.metadata
        return (f"{m.get('model', {}).get('name', 'model')}: {len(self.prompts)} prompts × "
                f"{m.get('trajectory', {}).get('max_new_tokens', '?')} tokens")

    def report_markdown(self) -> str:
        """The markdown file: what was run, the self-check, the table and what the columns mean."""
        m = self.metadata
        tr = m.get("trajectory", {})
        versions = m.get("versions", {})
        steps = sum(p["steps"] for p in self.prompts)
        k = self._topk
        lines = [
            f"# Fidelity: {self._title()}",
            "",
            f"{m.get('date', '')} · kvcompose {versions.get('kvcompose', '?')} · "
            f"torch {versions.get('torch', '?')} · "
            f"transformers {versions.get('transformers', '?')} · "
            f"runtime {m.get('runtime_s', 0):.0f} s",
            "",
            f"Greedy full-KV trajectories ({tr.get('attention', TRAJECTORY_ATTENTION)} attention, "
            f"min {tr.get('min_new_tokens')} / max {tr.get('max_new_tokens')} new tokens, {steps} steps in all), "
            "replayed token by token under each policy.",
            "",
            f"**{self.self_check['message']}**",
            "",
            self.markdown(),
            "",
            "KV mem %: the cache's `report().kv_bytes` (payload, metadata, buffer, block rounding) over a "
            f"full {self._basis} KV cache of the same tokens, averaged over steps (mean) and at the last step (final). "
            "top-1 agree: the policy's argmax equals the trajectory token. mean KL: KL(full ‖ policy) of the "
            "next-token distributions, nats. ΔNLL: mean NLL of the trajectory token under the policy minus under "
            f"full KV, nats. top-{k} recall: share of the {k} keys with the highest full-KV attention (per layer "
            "and query head) that the policy's cache still holds when it attends at that step.",
        ]
        sel = m.get("selection", {})
        if sel.get("calibration"):
            lines += ["", "Calibrated on the first prompt"
                      + (f" (matched memory: target {sel['match_memory']}% of full KV, geometric bisection over each "
                         "preset's budget, or RPC's period)" if sel.get("match_memory") is not None else "") + ":"]
            lines += [f"- {calibration_line(c)}" for c in sel["calibration"]]
        return "\n".join(lines)


def calibration_line(c: dict) -> str:
    """One calibration record in words: a budget matched to a memory target, or the random
    sharing baseline's rate matched to ReasonCache's."""
    if "matched_to" in c:
        return (f"{c['preset']}: {c['knob']}={c['value']:.3f}, the {c['matched_to']} "
                f"({c['shared_blocks']} of {c['shareable_blocks']} sealed step blocks)")
    miss = "" if c.get("reached", True) else ", NOT reachable with this knob on this prompt"
    return f"{c['preset']}: {c['knob']}={c['value']} → {c['measured_pct']:.1f}% measured (target {c['target_pct']:g}%{miss})"
