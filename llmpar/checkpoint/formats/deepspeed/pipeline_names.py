"""The param names of a DeepSpeed pipeline checkpoint saved without ZeRO, which its files do not record.

Without ZeRO, DeepSpeed 0.19's pipeline engine saves each stage's optimizer inside ``mp_rank_SS_model_states.pt``
("module" None, "param_shapes" None): torch's state dict, params by index (fp32; a param that never had a gradient
has no state), or the fp16 / bf16 optimizer's flat groups. The params are those of the stage's ``PipelineModule`` in
its registration order: the tied modules it builds first (``tied_modules.KEY.*``), then its layers by index
(``I.*``), each in its ``named_parameters`` order, which is its layer file's key order (``layer_II-model_states.pt``).
Which layers a stage holds is not saved either.

The names come from the model loading the checkpoint (``model``: {name: (shape, trained)}, the PipelineModule's
names). For each stage this finds the contiguous run of layers and the tied modules whose params, in that order,
match the stage's optimizer (count and each state's shape; the flat groups: their element count), with the model's
frozen params in the optimizer or not (both are DeepSpeed runs: ``model_parameters`` all params or the trained
ones), every layer with params or buffers on exactly one stage, each stage's ``buffer_names`` within its run. Of
several, those giving no param the model freezes a state are kept. One solution is used; none or several (equal
shapes side by side that the optimizer cannot tell apart) are refused naming the stage.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict

import torch

from llmpar.checkpoint.files import CheckpointError

TIED = "tied_modules."
Shape = tuple[int, ...]


class Stage:
    """What a stage's files say: ``entries`` (torch state: each param's state shape or None) or ``flat`` (the
    elements of its one flat group, and how many more the end padding may add); its ``buffers``' layer indices."""

    def __init__(self, entries: list[Shape | None] | None, flat: tuple[int, int] | None, buffers: set[int]) -> None:
        self.entries, self.flat, self.buffers = entries, flat, buffers

    def fits(self, names: list[str], shapes: dict[str, Shape]) -> bool:
        if self.entries is not None:
            return len(names) == len(self.entries) and all(
                e is None or e == shapes[n] for n, e in zip(names, self.entries)
            )
        total, slack = self.flat  # type: ignore[misc]
        return 0 <= total - sum(math.prod(shapes[n]) for n in names) <= slack


def _order(
    model: dict[str, tuple[Shape, bool]], layers: dict[int, dict[str, torch.Tensor]]
) -> tuple[dict[int, list[str]], dict[str, list[str]], list[str]]:
    """The model's params by layer index and by tied key, each in DeepSpeed's order, and the tied keys' order."""
    regular: dict[int, list[str]] = {}
    tied: dict[str, list[str]] = {}
    for name in model:
        head, _, rest = name.partition(".")
        if head.isdigit():
            regular.setdefault(int(head), []).append(name)
        elif name.startswith(TIED) and "." in name[len(TIED) :]:
            tied.setdefault(name[len(TIED) :].split(".", 1)[0], []).append(name)
        else:
            raise CheckpointError(
                f"param {name!r} is neither a layer's (I.*) nor a tied module's (tied_modules.*): "
                "it has no place in a DeepSpeed pipeline checkpoint"
            )
    for i, names in regular.items():
        keys = list(layers.get(i, {}))
        lost = [n for n in names if n.split(".", 1)[1] not in keys]
        if lost:
            raise CheckpointError(
                f"{lost[:3]} are not in the checkpoint's layer_{i:02d}-model_states.pt (keys {keys[:6]})"
            )
        names.sort(key=lambda n: keys.index(n.split(".", 1)[1]))
    first: dict[str, int] = {}
    for k, names in tied.items():  # the lowest layer file holding the tied module's keys, regular layers aside
        tails = [n[len(TIED) + len(k) + 1 :] for n in names]
        for i in sorted(layers):
            if (
                i not in regular
                and set(tails) <= set(layers[i])
                and all(tuple(layers[i][r].shape) == model[n][0] for r, n in zip(tails, names))
            ):
                keys = list(layers[i])
                names.sort(key=lambda n: keys.index(n[len(TIED) + len(k) + 1 :]))
                first[k] = i
                break
    order = sorted(tied, key=lambda k: (first.get(k, math.inf), k))
    return regular, tied, order


def infer(
    model: dict[str, tuple[Shape, bool]], layers: dict[int, dict[str, torch.Tensor]], stages: list[Stage], path: str
) -> list[tuple[list[str], set[str]]]:
    """Per stage: its optimizer's params by name, in order, and those of them the model does not train."""
    regular, tied, order = _order(model, layers)
    shapes = {n: s for n, (s, _) in model.items()}
    frozen = {n for n, (_, trained) in model.items() if not trained}
    runs = sorted(set(regular) | {i for st in stages for i in st.buffers})
    if len(order) > 6:
        raise CheckpointError(f"{path}: {len(order)} tied modules: too many to place by trial")
    subsets = [list(c) for r in range(len(order) + 1) for c in itertools.combinations(order, r)]
    found: list[list[tuple[list[str], set[str]]]] = []

    def walk(s: int, p: int, acc: list[tuple[list[str], set[str]]]) -> None:
        if len(found) > 16:
            return
        if s == len(stages):
            if p == len(runs) and {k for names, _ in acc for k in order if any(n in names for n in tied[k])} >= {
                k for k in order if any(model[n][1] for n in tied[k])
            }:
                found.append(list(acc))
            return
        st = stages[s]
        ends = [len(runs)] if s == len(stages) - 1 else range(p, len(runs) + 1)
        for q in ends:
            span = runs[p:q]
            if not st.buffers <= set(span):
                continue
            body = [n for i in span for n in regular.get(i, [])]
            seen: set[tuple[str, ...]] = set()
            for keys in subsets:
                for with_frozen in (True, False):
                    names = [n for k in keys for n in tied[k]] + body
                    if not with_frozen:
                        names = [n for n in names if n not in frozen]
                    if tuple(names) in seen or not st.fits(names, shapes):
                        continue
                    seen.add(tuple(names))
                    walk(s + 1, q, acc + [(names, {n for n in names if n in frozen})])

    walk(0, 0, [])
    if len(found) > 1:  # prefer the assignments giving no param this model freezes a state (DeepSpeed trained it)
        clash = [
            sum(
                e is not None and n in frozen
                for st, (names, _) in zip(stages, sol)
                if st.entries is not None
                for n, e in zip(names, st.entries)
            )
            for sol in found
        ]
        found = [sol for sol, c in zip(found, clash) if c == min(clash)]
    if not found:
        raise CheckpointError(
            f"{path}: DeepSpeed pipeline checkpoint without ZeRO: no split of this model's "
            f"{len(model)} params over its {len(stages)} stages matches the stages' optimizer states "
            "(another model, or another param order?)"
        )
    if len(found) > 1:
        a, b = found[0], found[1]
        s = next(i for i in range(len(stages)) if a[i][0] != b[i][0])
        raise CheckpointError(
            f"{path}: DeepSpeed pipeline checkpoint without ZeRO: stage {s}'s optimizer states fit "
            f"the params {a[s][0][:6]} and {b[s][0][:6]} alike (equal shapes side by side): which "
            "param each state belongs to cannot be told"
        )
    return found[0]


def groups(names: list[str], model: dict[str, tuple[Shape, bool]]) -> list[dict[str, Shape]]:
    """``param_shapes`` of one group."""
    return [OrderedDict((n, model[n][0]) for n in names)]


__all__ = ["Stage", "groups", "infer"]
