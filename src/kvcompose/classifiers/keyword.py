"""Keyword classifier: label the recent segment by the cue phrases it contains.

This is the approach ThinKV ("ThinKV: Thought-Adaptive KV Cache Compression for
Efficient Reasoning Models", Ramachandran et al., arXiv:2510.01290) argues against
(keywords miss lexical variants), kept as a baseline and as a model-free classifier
for tests, demos and models without a sparsity calibration. The default table is the
paper's illustrative keyword list (Table 6). Two of its execution entries describe
content rather than words ("Mathematical equations", "Code syntax"); they are
represented here by the surface markers ``=`` and a code fence.

Matching rule, per text:

1. case-insensitive; curly apostrophes are read as straight ones;
2. the words of a phrase may be separated by any whitespace; a phrase that
   begins (ends) with a letter or digit must begin (end) at a word boundary, so
   ``"now"`` does not match inside ``"known"``;
3. matches do not overlap and the longest phrase wins at a position, so
   ``"But wait"`` counts once, as itself, not also as ``"wait"``;
4. the type with the most matches wins; a tie goes to the type listed first in
   ``priority`` (default T, then R, then E: a backtracking cue is the most specific
   signal in a segment, and execution markers such as ``=`` the least);
5. no match at all gives ``default``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..registry import register
from .base import SPARSITY_BIN_TYPES, THOUGHT_TYPES, Classifier, ClassifierInput, check_type

#: ThinKV Table 6, as phrases (see the module docstring for the two execution markers).
DEFAULT_KEYWORDS: dict[str, tuple[str, ...]] = {
    "R": ("Think", "Approach", "Remember", "Find", "Okay", "Suppose", "Verify"),
    "T": ("Wait", "Hmm", "Wait no", "Alternatively", "But wait", "Earlier I said that"),
    "E": ("Now", "The steps are", "=", "```"),
}


def _phrase_pattern(phrase: str) -> str:
    head = r"\b" if re.match(r"\w", phrase[0]) else ""
    tail = r"\b" if re.match(r"\w", phrase[-1]) else ""
    return head + r"\s+".join(re.escape(word) for word in phrase.split()) + tail


def _normalize(text: str) -> str:
    return text.replace("\u2019", "'").replace("\u2018", "'")


@register("classifier", "keyword")
@dataclass
class KeywordClassifier(Classifier):
    """Label each sequence's recent text by cue-phrase counts (ThinKV Table 6 keywords by default)."""

    keywords: dict[str, list[str]] | None = None  # per type, replaces that type's default list
    default: str = "R"  # type of a text with no match (the most important type, so nothing is under-kept)
    priority: str = "TRE"  # tie-break order among types with equally many matches

    needs = "text"

    def __post_init__(self) -> None:
        owner = f"{self.name} classifier"
        check_type(owner, "default", self.default)
        if not isinstance(self.priority, str) or sorted(self.priority) != sorted(THOUGHT_TYPES):
            raise ValueError(
                f"{owner}: priority must order each of {''.join(THOUGHT_TYPES)} once (e.g. 'TRE'), "
                f"got {self.priority!r}"
            )
        table = {k: list(v) for k, v in DEFAULT_KEYWORDS.items()}
        if self.keywords is not None:
            if not isinstance(self.keywords, dict):
                raise ValueError(f"{owner}: keywords must be a dict {{type: [phrases]}}, got {self.keywords!r}")
            for letter, phrases in self.keywords.items():
                check_type(owner, "keywords key", letter)
                if isinstance(phrases, str) or not all(isinstance(p, str) and p.strip() for p in phrases):
                    raise ValueError(
                        f"{owner}: keywords[{letter!r}] must be a list of non-empty strings, got {phrases!r}"
                    )
                table[letter] = [" ".join(_normalize(p).split()) for p in phrases]
        self._table = {k: v for k, v in table.items() if v}
        emitted = set(self._table) | {self.default}
        # Same index order as the sparsity classifier: lowest sparsity first.
        self._types = tuple(t for t in SPARSITY_BIN_TYPES[3] if t in emitted)
        owner_of: dict[str, str] = {}
        for letter, phrases in self._table.items():
            for p in phrases:
                prev = owner_of.setdefault(p.lower(), letter)
                if prev != letter:
                    raise ValueError(f"{owner}: phrase {p!r} is listed under both {prev!r} and {letter!r}")
        ordered = sorted(owner_of, key=len, reverse=True)  # longest first: the alternation prefers it
        self._regex = re.compile("|".join(f"({_phrase_pattern(p)})" for p in ordered), re.IGNORECASE)
        self._group_type = [owner_of[p] for p in ordered]
        self._rank = {t: self.priority.index(t) for t in THOUGHT_TYPES}

    @property
    def types(self) -> tuple[str, ...]:
        return self._types

    def counts(self, text: str) -> dict[str, int]:
        """Matches per type in one text (the evidence :meth:`classify_text` decides on)."""
        hits = dict.fromkeys(self._table, 0)
        if not hits:
            return hits
        for m in self._regex.finditer(_normalize(text)):
            hits[self._group_type[m.lastindex - 1]] += 1
        return hits

    def classify_text(self, text: str) -> str:
        """The type letter of one text."""
        hits = {t: n for t, n in self.counts(text).items() if n > 0}
        if not hits:
            return self.default
        return min(hits, key=lambda t: (-hits[t], self._rank[t]))

    def classify(self, signal: ClassifierInput) -> torch.Tensor:
        if signal.texts is None:
            raise ValueError("keyword classifier needs ClassifierInput.texts (the decoded recent segment)")
        idx = [self._types.index(self.classify_text(t)) for t in signal.texts]
        return torch.tensor(idx, dtype=torch.int64, device=signal.device)
