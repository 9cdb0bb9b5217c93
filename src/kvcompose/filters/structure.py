"""Structural equivalence check of ReasonCache's collaborative filter (stage 1, second phase).

From "ReasonCache: Accelerating Large Reasoning Model Serving through KV Cache Sharing"
(Chen et al., arXiv:2507.21433), §IV-A.

Two steps can share almost every token and still mean different things when
they are formal: ``2x+5=10`` and ``2x-5=10`` differ by one character. For steps
with formal content the filter therefore compares syntax trees, and only lets a
lexical candidate through when the trees are (nearly) the same, measured by the
ordered tree edit distance (Zhang–Shasha, unit costs). Prose has no syntax tree
and skips the check.

How a step's formal structure is found (:func:`structure_of`):

* **Segments.** The text is cut at Markdown fences (```` ``` ````); pieces
  between an opening and a closing fence are *fenced* (an unclosed last fence
  counts as fenced to the end, since a step boundary may fall inside a block),
  the rest is *plain*. A fenced piece loses its info string (`` ```python ``).
* **Code.** A fenced piece is code if it parses with :func:`ast.parse` after
  dedenting. A plain piece is code only if it parses *and* holds a statement
  that English cannot produce by accident: anything except a bare expression,
  ``pass``, ``break``, ``continue``, ``global`` or ``nonlocal`` -- and a bare
  expression still counts when it is a call with at least one argument. So
  ``x = a + 1``, ``def f(): ...``, ``print(x)`` are code, while ``Verify``,
  ``not sure`` or ``a + b`` are not. Code becomes a ``Module`` tree: each node
  is labelled by its AST class, followed by its identifiers (variable,
  function, argument, attribute and imported names) or, for a constant, its
  ``repr``; operators are child nodes (``Add``, ``Sub``, ...); load/store
  contexts are dropped.
* **Formulas.** Every other piece is scanned for formula spans: maximal runs of
  numbers (``12``, ``2.5``), one-letter variables (optionally with a numeric
  subscript: ``x1``, ``x_1``), the names ``sin cos tan log ln exp sqrt pi``,
  the operators ``+ - * / ^ = **``, parentheses and spaces (Unicode ``− × · ÷``
  are read as ``- * * /``, and ``==`` as ``=``). Any other character or word
  ends a span, so in ``So 2x+5=10, hence x = 2.5`` the spans are ``2x+5=10``
  and ``x = 2.5``. A span counts only if it has an operator and an operand.
  It is split at ``=``: one ``=`` gives an ``Eq`` node over the two sides,
  several give a ``chain`` node over all sides; each side is parsed by SymPy
  (``evaluate=False``, implicit multiplication and ``^`` as power; every
  variable is a plain symbol, so ``E`` or ``I`` are not constants). A SymPy
  leaf is labelled by its value (``5``, ``-1``, ``x``), an inner node by its
  class (``Add``, ``Mul``, ``Pow``, ``sin``); SymPy writes ``a - 5`` as
  ``Add(a, Mul(-1, 5))``, so it never matches ``a + 5``. A span that fails to
  parse is skipped.
* **Step tree.** The code and formula trees, in text order, become the
  children of a ``step`` node. A step with none of them is prose: ``None``.
* **Limits.** Parsing never raises on arbitrary text. Formula spans longer
  than :data:`MAX_SPAN_CHARS` are skipped, formula scanning is skipped on steps
  longer than :data:`MAX_FORMULA_STEP_CHARS`, and code parsing on steps longer
  than :data:`MAX_CODE_STEP_CHARS` (such a step may end up ``None``, i.e. it is
  treated as prose and left to the lexical and KV-distance filters).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

from ..validation import check_int

__all__ = [
    "MAX_CODE_STEP_CHARS",
    "MAX_FORMULA_STEP_CHARS",
    "MAX_SPAN_CHARS",
    "Tree",
    "structurally_compatible",
    "structure_of",
    "tree_edit_distance",
]

MAX_SPAN_CHARS = 200  # longer formula spans are skipped (parsing cost)
MAX_FORMULA_STEP_CHARS = 4000  # longer steps are not scanned for formulas
MAX_CODE_STEP_CHARS = 20000  # longer steps are not parsed as code

_N = TypeVar("_N")


@dataclass(frozen=True)
class Tree:
    """An ordered, labelled tree: the syntax tree of a step or of one of its parts."""

    label: str
    children: tuple[Tree, ...] = ()

    @property
    def size(self) -> int:
        """Number of nodes (counted without recursion, so deep trees are fine)."""
        count, stack = 0, [self]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children)
        return count


def _build(root: _N, label: Callable[[_N], str], children: Callable[[_N], Iterable[_N]]) -> Tree:
    """Convert any tree-shaped object into a :class:`Tree` without recursion."""
    stack: list[tuple[_N, Any, list[Tree]]] = [(root, iter(children(root)), [])]
    end = object()
    while True:
        node, it, built = stack[-1]
        child = next(it, end)
        if child is end:
            stack.pop()
            tree = Tree(label(node), tuple(built))
            if not stack:
                return tree
            stack[-1][2].append(tree)
        else:
            stack.append((child, iter(children(child)), []))


# ----------------------------------------------------------------------------- code

_NO_CODE_EVIDENCE = (ast.Expr, ast.Pass, ast.Break, ast.Continue, ast.Global, ast.Nonlocal)


def _parse_code(text: str) -> ast.Module | None:
    """The module ``text`` parses to, or None when it is not valid Python."""
    if len(text) > MAX_CODE_STEP_CHARS or not text.strip():
        return None
    try:
        return ast.parse(textwrap.dedent(text))
    except Exception:  # SyntaxError, ValueError (NUL bytes), RecursionError, MemoryError
        return None


def _looks_like_code(module: ast.Module) -> bool:
    """Whether a parsed plain-text piece holds a statement prose would not yield by chance."""
    for stmt in module.body:
        if not isinstance(stmt, _NO_CODE_EVIDENCE):
            return True
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            if stmt.value.args or stmt.value.keywords:
                return True
    return False


def _ast_label(node: ast.AST) -> str:
    """AST class name plus the node's identifiers or constant value."""
    name = type(node).__name__
    if isinstance(node, ast.Constant):
        return f"{name}:{node.value!r}"
    words: list[str] = []
    for _, value in ast.iter_fields(node):
        if isinstance(value, str):
            words.append(value)
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            words.extend(value)
    return f"{name}:{','.join(words)}" if words else name


def _ast_children(node: ast.AST) -> list[ast.AST]:
    """Child nodes in field order, without the load/store/del context markers."""
    return [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr_context)]


def _code_tree(module: ast.Module) -> Tree | None:
    """The module as a :class:`Tree`, or None if it is too deep to convert safely."""
    try:
        return _build(module, _ast_label, _ast_children)
    except Exception:  # RecursionError from pathological inputs; never let it escape
        return None


# ----------------------------------------------------------------------------- formulas

_FUNCTIONS = frozenset({"sin", "cos", "tan", "log", "ln", "exp", "sqrt", "pi"})
_UNICODE_OPS = str.maketrans({"−": "-", "×": "*", "·": "*", "⋅": "*", "÷": "/"})
_TOKEN = re.compile(
    r"(?P<num>\d+(?:\.\d+)?)"
    r"|(?P<name>[A-Za-z]+(?:_?\d+)?)"
    r"|(?P<op>\*\*|==|[-+*/^=])"
    r"|(?P<paren>[()])"
    r"|(?P<space>[ \t]+)"
    r"|(?P<other>.)",
    re.S,
)


def _formula_name(name: str) -> bool:
    """A one-letter variable (with optional numeric subscript) or a known function name."""
    return name in _FUNCTIONS or len(name.rstrip("0123456789").rstrip("_")) == 1


def _formula_spans(text: str) -> list[tuple[str, frozenset[str]]]:
    """Formula-like spans of ``text`` with the variable names each one uses."""
    spans: list[tuple[str, frozenset[str]]] = []
    run: list[str] = []
    names: set[str] = set()
    has_op = has_operand = False

    def flush() -> None:
        span = "".join(run).strip()
        if has_op and has_operand and len(span) <= MAX_SPAN_CHARS:
            spans.append((span, frozenset(names)))

    for m in _TOKEN.finditer(text.translate(_UNICODE_OPS)):
        kind, tok = m.lastgroup, m.group()
        if kind == "name" and not _formula_name(tok):
            kind = "other"
        if kind == "other":
            flush()
            run, names, has_op, has_operand = [], set(), False, False
            continue
        if kind == "op":
            has_op = True
            tok = "=" if tok == "==" else tok
        elif kind in ("num", "name"):
            has_operand = True
            if kind == "name" and tok not in _FUNCTIONS:
                names.add(tok)
        run.append(tok)
    flush()
    return spans


@lru_cache(maxsize=1)
def _sympy() -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], type, type]:
    """SymPy's parser, transformations and namespace, imported once and on first use."""
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    namespace: dict[str, Any] = {}
    exec("from sympy import *", namespace)  # the namespace parse_expr would build per call
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    return parse_expr, transformations, namespace, sympy.Symbol, sympy.Basic


def _sympy_label(expr: Any) -> str:
    """Inner nodes by operator/function class, leaves by value."""
    return type(expr).__name__ if expr.args else str(expr)


def _formula_tree(span: str, names: frozenset[str]) -> Tree | None:
    """Tree of one span (``Eq``/``chain`` over its ``=``-separated sides), None if unparsable."""
    parse_expr, transformations, namespace, symbol, basic = _sympy()
    sides = span.split("=")
    trees: list[Tree] = []
    for side in sides:
        if not side.strip():
            return None
        local = {n: symbol(n) for n in names}
        try:
            expr = parse_expr(side, local_dict=local, global_dict=namespace,
                              transformations=transformations, evaluate=False)
            if not isinstance(expr, basic):  # e.g. a bare function name such as ``sin``
                return None
            trees.append(_build(expr, _sympy_label, lambda e: e.args))
        except Exception:  # TokenError, SyntaxError, SympifyError, TypeError, RecursionError, ...
            return None
    if len(trees) == 1:
        return trees[0]
    return Tree("Eq" if len(trees) == 2 else "chain", tuple(trees))


def _formula_trees(text: str) -> list[Tree]:
    """Trees of every parsable formula span in a plain piece of text."""
    trees = []
    for span, names in _formula_spans(text):
        tree = _formula_tree(span, names)
        if tree is not None:
            trees.append(tree)
    return trees


# ----------------------------------------------------------------------------- steps

_INFO_STRING = re.compile(r"[\w+.#-]*[ \t]*\n")


def _segments(text: str) -> list[tuple[bool, str]]:
    """``(fenced, piece)`` pairs in text order; odd pieces between ``` marks are fenced."""
    out = []
    for k, piece in enumerate(text.split("```")):
        fenced = k % 2 == 1
        if fenced:
            info = _INFO_STRING.match(piece)
            piece = piece[info.end():] if info else piece
        out.append((fenced, piece))
    return out


def _segment_trees(fenced: bool, piece: str, formulas: bool) -> list[Tree]:
    """Code tree of a piece if it is code, else the trees of its formula spans."""
    module = _parse_code(piece)
    if module is not None and module.body and (fenced or _looks_like_code(module)):
        tree = _code_tree(module)
        if tree is not None:
            return [tree]
    return _formula_trees(piece) if formulas else []


@lru_cache(maxsize=4096)
def _structure(text: str) -> Tree | None:
    """Cached body of :func:`structure_of` (a step is compared with many others)."""
    formulas = len(text) <= MAX_FORMULA_STEP_CHARS
    parts: list[Tree] = []
    for fenced, piece in _segments(text):
        parts.extend(_segment_trees(fenced, piece, formulas))
    return Tree("step", tuple(parts)) if parts else None


def structure_of(text: str) -> Tree | None:
    """The formal structure of a step (code and formula trees), or None for prose.

    None means there is nothing formal to compare, so the structural check is
    bypassed for the step. See the module docstring for the exact rules. Never
    raises on any string.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return _structure(text)


# ----------------------------------------------------------------------------- tree edit distance


def _postorder(tree: Tree) -> tuple[list[str], list[int]]:
    """Labels in postorder and, per node, the postorder index of its leftmost leaf."""
    labels: list[str] = []
    leftmost: list[int] = []
    stack: list[list[Any]] = [[tree, 0, None]]  # node, next child, leftmost leaf so far
    while stack:
        frame = stack[-1]
        node, k = frame[0], frame[1]
        if k < len(node.children):
            frame[1] = k + 1
            stack.append([node.children[k], 0, None])
            continue
        stack.pop()
        index = len(labels)
        left = index if frame[2] is None else frame[2]
        labels.append(node.label)
        leftmost.append(left)
        if stack and stack[-1][2] is None:
            stack[-1][2] = left
    return labels, leftmost


def _keyroots(leftmost: list[int]) -> list[int]:
    """Nodes whose leftmost leaf no ancestor shares: the root and every node with a left sibling."""
    last: dict[int, int] = {}
    for i, left in enumerate(leftmost):
        last[left] = i
    return sorted(last.values())


def _signature(tree: Tree) -> list[tuple[str, int]]:
    """Preorder (label, child count) list: equal lists mean equal ordered trees."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        out.append((node.label, len(node.children)))
        stack.extend(reversed(node.children))
    return out


def tree_edit_distance(a: Tree, b: Tree) -> int:
    """Ordered tree edit distance with unit insert, delete and relabel costs.

    Zhang–Shasha dynamic programme: for each pair of keyroots a forest-distance
    table is filled, and subtree distances found on the way are kept in ``td``
    for reuse by the later, larger keyroots. Iterative, so tree depth is not
    limited by Python's recursion limit; cost is O(|a| |b| min(depth, leaves)^2).
    """
    if _signature(a) == _signature(b):
        return 0
    la, lefta = _postorder(a)
    lb, leftb = _postorder(b)
    td = [[0] * len(lb) for _ in la]
    for i in _keyroots(lefta):
        li = lefta[i]
        rows = i - li + 2
        for j in _keyroots(leftb):
            lj = leftb[j]
            cols = j - lj + 2
            fd = [[0] * cols for _ in range(rows)]
            for y in range(1, cols):
                fd[0][y] = y
            for x in range(1, rows):
                fd[x][0] = x
                i1 = li + x - 1
                whole_i = lefta[i1] == li
                prev, cur = fd[x - 1], fd[x]
                label_i, td_i, p = la[i1], td[i1], lefta[i1] - li
                for y in range(1, cols):
                    j1 = lj + y - 1
                    best = min(prev[y], cur[y - 1]) + 1
                    if whole_i and leftb[j1] == lj:
                        d = prev[y - 1] + (label_i != lb[j1])
                        d = best if best < d else d
                        td_i[j1] = d
                    else:
                        d = fd[p][leftb[j1] - lj] + td_i[j1]
                        d = best if best < d else d
                    cur[y] = d
    return td[-1][-1]


def _label_bound(a: Tree, b: Tree) -> int:
    """Cheap lower bound on the edit distance: labels one tree has that the other lacks."""
    ca = Counter(label for label, _ in _signature(a))
    cb = Counter(label for label, _ in _signature(b))
    return max(sum((ca - cb).values()), sum((cb - ca).values()))


def structurally_compatible(a: Tree | None, b: Tree | None, max_distance: int = 0) -> bool:
    """Whether two steps may share KV cache as far as their formal structure goes.

    Two prose steps (both None) pass, as the check does not apply to them; a
    formal step never matches a prose one; two formal steps pass when their
    edit distance is at most ``max_distance`` (0, the paper's setting, demands
    identical trees).
    """
    check_int("max_distance", max_distance, 0, noun="an integer")
    if a is None or b is None:
        return a is None and b is None
    if max_distance == 0:
        return _signature(a) == _signature(b)
    if abs(a.size - b.size) > max_distance or _label_bound(a, b) > max_distance:
        return False
    return tree_edit_distance(a, b) <= max_distance
