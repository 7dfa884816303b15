"""One model-parallel rank of a checkpoint written by DeepSpeed's ``engine.save_checkpoint`` (ZeRO 0-3, the
BF16 / FP16 optimizers), read as it is (``files.py`` describes the files): named element ranges of the fp32 master
weights and Adam moments, step counts, scheduler, counters and client_state, the terms of the reader protocol
(``formats/source.py``).

Flat order. Stages 1-2: group g's params in ``param_shapes[g]`` order, param i followed by
``param_alignment_paddings[g][i]`` elements, the group padded at its end and cut into dp partitions of P elements:
element e of a param at offset o is element ``(o + e) % P`` of rank ``(o + e) // P``'s partition. Stage 3: each
param alone is cut into dp chunks of ``c = ceil(numel / dp)`` (the last one padded); rank R's flat (its sub groups
in turn) holds its chunk of every param in ``param_shapes`` order: element e is at rank ``e // c``, position
``offset + e % c``.

BF16_Optimizer (bf16 without ZeRO, or pipelines) writes "single_partition_of_fp32_groups", "base_optimizer_state",
"group_paddings" (end padding only) and no "zero_stage": read as ZeRO-1 (``kind`` says which). fp16 without ZeRO
(FP16_Optimizer): "fp32_groups_flat" and its optimizer's flat state in the model states file, read as ZeRO-1 at dp=1.

Files are memory-mapped, each optimizer file when first read (:meth:`RankCheckpoint.release` lets them go).
``RankCheckpoint(path, mp_rank=S)`` reads the files of model-parallel rank S alone: a pipeline stage's
(``pipeline.py`` joins the stages) or a tensor-parallel rank's (``tensor_parallel.py`` merges them);
``open.open_deepspeed(path)`` opens a directory as whichever of the three it holds.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import (
    DS_KEYS,
    MOMENTS,
    Foreign,
    flat_slice,
    load_file,
    loss_scaler,
    mp_files,
    scalar,
)


class RankCheckpoint:
    """The DeepSpeed checkpoint in directory ``path`` (module docstring). ``names``: the trained params in DeepSpeed's
    order; ``shapes``: their full shapes; :meth:`read` / :meth:`step`: their states."""

    format = "deepspeed"

    def __init__(self, path: str, mp_rank: int | None = None, *, loaded: dict[str, Any] | None = None) -> None:
        """``mp_rank``: read the files of that model-parallel rank alone (a pipeline stage's, ``pipeline.py``);
        None: the directory, which must hold mp_rank_00's alone (``open.open_deepspeed`` opens the other layouts).
        ``loaded``: {file name: its object} of files already read (not read again)."""
        self.path = path
        files = mp_files(path, mp_rank)
        self.mp_rank, self.optim, zero_models, model_file = files
        self.bf16 = any(f.startswith("bf16_") for f in self.optim.values())
        self.model = (loaded or {}).get(model_file) or load_file(os.path.join(path, model_file))
        if not isinstance(self.model, dict) or "module" not in self.model:
            raise CheckpointError(
                f"{os.path.join(path, model_file)} is not a DeepSpeed model states file (no 'module' key)"
            )
        self._model_states: dict[int, dict] = {}  # ZeRO-3: dp rank -> its model states file, each read once
        if model_file.startswith("zero_pp_rank_"):  # dp rank 0's, read above
            self._model_states[zero_models[0]] = self.model
        self._opened: dict[int, dict] = {}
        self._frozen: dict[str, torch.Tensor] | None = None
        self.kind = "ZeRO"  # or "BF16_Optimizer" / "FP16_Optimizer": their flat groups read as ZeRO-1's
        opt = self.model.get("optimizer")
        if not self.optim and isinstance(opt, dict) and "fp32_groups_flat" in opt:  # fp16, no ZeRO: one flat group
            self.kind, self.optim = "FP16_Optimizer", {0: model_file}  # each, dp=1: ZeRO-1's layout at dp=1
            self._opened[0] = {
                "single_partition_of_fp32_groups": opt["fp32_groups_flat"],
                "partition_count": 1,
                "base_optimizer_state": opt["optimizer_state_dict"],
            }
        if not self.optim:
            self.stage, self.kind = 0, "torch"  # the optimizer's state dict in the model states file
        elif "zero_stage" not in self.zero_state(0) and "single_partition_of_fp32_groups" in self.zero_state(0):
            self.stage = 1  # BF16_Optimizer (bf16 with ZeRO-1 or none): ZeRO-1's flat partitions, no alignment pads
            self.kind = "BF16_Optimizer" if self.kind == "ZeRO" else self.kind
        else:
            self.stage = int(self.zero_state(0)["zero_stage"].args[0])
        self.dp = 1 if self.stage == 0 else self._partition_count()
        missing = [r for r in range(self.dp) if r not in self.optim] if self.stage else []
        extra = sorted(set(self.optim) - set(range(self.dp))) if self.stage else []
        if missing or extra:
            why = (
                f"lacks the optimizer files of dp ranks {missing}"
                if missing
                else (f"has optimizer files of dp ranks {extra} beyond its partition_count (files of another save?)")
            )
            raise CheckpointError(
                f"{path}: DeepSpeed ZeRO-{self.stage} checkpoint of dp={self.dp} {why} (found "
                f"{sorted(self.optim.values())})"
            )
        if self.stage == 3 and zero_models != list(range(self.dp)):
            raise CheckpointError(
                f"{path}: DeepSpeed ZeRO-3 checkpoint of dp={self.dp} has the model states files of "
                f"dp ranks {zero_models}"
            )
        self.aliases: dict[str, str] = dict(self.model.get("shared_params") or {})
        # a pipeline stage without ZeRO: "module" None, no param_shapes: no names until set_names (pipeline_names.py)
        self.unnamed = self.model["module"] is None and not isinstance(self.model.get("param_shapes"), list)
        self._skip: set[str] = set()
        self._layout()

    def set_names(self, groups: list[dict[str, tuple[int, ...]]], skip: set[str]) -> None:
        """Name the saved params of a checkpoint whose files do not (``unnamed``): ``groups`` in the optimizer's
        order, every param it holds (as ``param_shapes``); ``skip``: those of them not read as trained (frozen)."""
        self.model = {**self.model, "param_shapes": groups}
        self._skip, self.unnamed = set(skip), False
        self._layout()

    # ------------------------------------------------------------------ files
    def zero_state(self, rank: int) -> dict:
        """Optimizer file of dp rank ``rank``: its ``optimizer_state_dict``."""
        if rank not in self._opened:
            name = os.path.join(self.path, self.optim[rank])
            sd = load_file(name)
            if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
                raise CheckpointError(f"{name} is not a DeepSpeed ZeRO optimizer file (no 'optimizer_state_dict')")
            self._opened[rank] = sd["optimizer_state_dict"]
        return self._opened[rank]

    def model_states(self, rank: int) -> dict:
        """ZeRO-3: the model states file of dp rank ``rank`` (``zero_pp_rank_R_mp_rank_SS_model_states.pt``), read
        once."""
        if rank not in self._model_states:
            name = f"zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_model_states.pt"
            self._model_states[rank] = load_file(os.path.join(self.path, name))
        return self._model_states[rank]

    def release(self, name: str = "") -> None:
        """``name`` empty: let the optimizer files opened so far go (their mapped pages leave the process once no
        tensor holds them), each opened again when next read (an FP16_Optimizer's state lives in the model states
        file: kept). A param's files hold other params too: a release of one name keeps them."""
        if name:
            return
        if self.kind != "FP16_Optimizer":
            self._opened.clear()
        self._frozen = None
        self._model_states.clear()

    def _partition_count(self) -> int:
        count = self.zero_state(0).get("partition_count")
        counts = count if isinstance(count, list) else [count]
        if not counts or any(c != counts[0] for c in counts) or not isinstance(counts[0], int):
            raise CheckpointError(f"{self.path}: partition_count {count!r} (groups of another dp) is not read")
        return counts[0]

    def moments(self, rank: int) -> list[dict]:
        """Per group (stages 1-2) / sub group (stage 3), {state key: tensor} of rank ``rank``'s torch optimizer."""
        z = self.zero_state(rank)
        base = z["optimizer_state_dict"] if self.stage == 3 else z["base_optimizer_state"]
        if isinstance(base, list):  # elastic: per-group states, the step stored beside them
            return [{"step": z.get("base_optimizer_state_step", 0), **s} for s in base]
        return [base["state"].get(g, {}) for g in range(len(base["param_groups"]))]

    def _fp32(self, rank: int) -> list[torch.Tensor]:
        z = self.zero_state(rank)
        return list(z["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"])

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        self.names: list[str] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.where: dict[str, tuple[int, int]] = {}  # name -> (group / stage 0: param index, offset)
        if self.unnamed:
            return
        if self.stage == 0:
            self._layout0()
            return
        groups = self.model.get("param_shapes")
        if not isinstance(groups, list):
            raise CheckpointError(f"{self.path}: the model states file has no 'param_shapes'")
        pads = self.zero_state(0).get("param_alignment_paddings") if self.stage < 3 else None
        size3 = 0
        for g, shapes in enumerate(groups):
            at = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(int(d) for d in shape)
                if name not in self._skip:
                    self.names.append(name)
                    self.shapes[name] = tuple(int(d) for d in shape)
                if self.stage == 3:
                    self.where[name] = (0, size3)
                    size3 += -(-n // self.dp)
                else:
                    self.where[name] = (g, at)
                    at += n + (int(pads[g][i]) if pads else 0)
            if self.stage < 3:
                have = sum(self.part_size(g) for _ in range(self.dp))
                if at > have:
                    raise CheckpointError(
                        f"{self.path}: group {g} holds {at} elements by param_shapes but its "
                        f"{self.dp} partitions {have}"
                    )
        if self.stage == 3:
            have = sum(t.numel() for t in self._fp32(0))
            if have != size3:
                raise CheckpointError(
                    f"{self.path}: ZeRO-3 param_shapes make {size3} elements per rank, {self.optim[0]} holds {have}"
                )

    def _layout0(self) -> None:
        module, opt = self.model["module"], self.model.get("optimizer")
        if module is None:  # a pipeline stage: the names set_names gave, in the optimizer's order
            self._layout0_named(opt)
            return
        buffers = set(self.model.get("buffer_names") or ())
        seen: dict[tuple, str] = {}
        for name, t in module.items():
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else (name,)
            if name in buffers:
                continue
            if key in seen:
                self.aliases[name] = seen[key]
                continue
            seen[key] = name
            self.names.append(name)
            self.shapes[name] = tuple(t.shape)
        if not isinstance(opt, dict):
            return  # weights only (saved without an optimizer)
        sd = opt.get("optimizer_state_dict", opt)
        index = [i for group in sd["param_groups"] for i in group["params"]]
        if len(index) != len(self.names):
            raise CheckpointError(
                f"{self.path}: the optimizer holds {len(index)} params, the module "
                f"{len(self.names)}: they cannot be matched by order"
            )
        self._state0, self._fp32_0 = sd["state"], None
        if "fp32_groups" in opt:
            self._fp32_0 = [t for group in opt["fp32_groups"] for t in group]
        for k, name in enumerate(self.names):
            self.where[name] = (index[k], k)

    def _layout0_named(self, opt: Any) -> None:
        shapes = [(n, tuple(int(d) for d in s)) for g in self.model["param_shapes"] for n, s in g.items()]
        sd = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else None
        if sd is None or "param_groups" not in sd:
            raise CheckpointError(f"{self.path}: the model states file holds no torch optimizer state dict")
        index = [i for group in sd["param_groups"] for i in group["params"]]
        if len(index) != len(shapes):
            raise CheckpointError(f"{self.path}: the optimizer holds {len(index)} params, {len(shapes)} named")
        self._state0, self._fp32_0 = sd["state"], None
        for k, (name, shape) in enumerate(shapes):
            if name not in self._skip:
                self.names.append(name)
                self.shapes[name] = shape
                self.where[name] = (index[k], k)

    def flat_sizes(self) -> list[int]:
        """Stages 1-2: the elements of each group's flat fp32 copy over all dp partitions (end padding included)."""
        return [self.part_size(g) * self.dp for g in range(len(self.moments(0)))]

    def part_size(self, g: int) -> int:
        """Stages 1-2: the partition size of group ``g`` (the moments keep the end padding, the fp32 copy not)."""
        m = self.moments(0)[g]
        return m["exp_avg"].numel() if "exp_avg" in m else self._fp32(0)[g].numel()

    # ------------------------------------------------------------------ reads
    def file_of(self, name: str) -> str:
        """Where ``name`` is saved, for error messages ("" when the directory says it: one model states file)."""
        return ""

    def describe(self) -> str:
        """The layout in words, for messages."""
        if self.kind not in ("ZeRO", "torch"):
            return f"{self.kind} at dp={self.dp}"
        return f"ZeRO-{self.stage} at dp={self.dp}"

    def source(self, name: str) -> str:
        """The name ``name``'s values are stored under (a tied copy: its source), or a CheckpointError."""
        src = self.aliases.get(name, name)
        if src not in self.shapes:
            raise CheckpointError(f"param {name!r} is not in DeepSpeed checkpoint {self.path}")
        return src

    def has(self, name: str, key: str) -> bool:
        if key in ("params", "master"):
            return self.stage > 0 or key == "params" or self._fp32_0 is not None
        if key not in MOMENTS:
            return False
        if self.stage == 0:
            return hasattr(self, "_state0")
        return all(key in m for m in self.moments(0))

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        """Elements [a, z) of param ``name``'s state ``key`` ("params" / "master": the fp32 master weights,
        "exp_avg", "exp_avg_sq"), flat, as saved (fp32 unless DeepSpeed kept them otherwise)."""
        name = self.source(name)
        g, at = self.where[name]
        if self.stage == 0:
            if key in MOMENTS:  # a param without state (never stepped): torch's zeros
                st = self._state0.get(g, {})
                return st[key].reshape(-1)[a:z] if key in st else torch.zeros(z - a, dtype=torch.float32)
            t = self._fp32_0[at] if self._fp32_0 is not None else self.model["module"][name]
            return t.reshape(-1)[a:z]
        if self.stage == 3:
            c = -(-math.prod(self.shapes[name]) // self.dp)
            out = []
            for r in range(a // c, (z - 1) // c + 1):
                lo, hi = max(a, r * c) - r * c, min(z, (r + 1) * c) - r * c
                parts = self._fp32(r) if key in ("params", "master") else [m[key] for m in self.moments(r)]
                out.append(flat_slice(parts, at + lo, at + hi))
            return out[0] if len(out) == 1 else torch.cat(out)
        size, out = self.part_size(g), []
        for r in range((at + a) // size, (at + z - 1) // size + 1):
            lo, hi = max(at + a, r * size) - r * size, min(at + z, (r + 1) * size) - r * size
            t = self._fp32(r)[g] if key in ("params", "master") else self.moments(r)[g][key]
            out.append(flat_slice([t], lo, hi))
        return out[0] if len(out) == 1 else torch.cat(out)

    def step(self, name: str) -> float:
        """The optimizer step count of the group holding ``name`` (0 when it holds no state yet)."""
        name = self.source(name)
        g, at = self.where[name]
        if self.stage == 0:
            return scalar(self._state0.get(g, {}).get("step", 0)) if hasattr(self, "_state0") else 0.0
        if self.stage < 3:
            return scalar(self.moments(0)[g].get("step", 0))
        moments, start = self.moments(0), 0
        for m, t in zip(moments, self._fp32(0)):
            if at < start + t.numel():
                return scalar(m.get("step", 0))
            start += t.numel()
        return 0.0

    # ------------------------------------------------------------------ the rest of the run
    def buffers(self) -> dict[str, torch.Tensor]:
        """Module buffers, as saved."""
        names = self.model.get("buffer_names") or ()
        return {n: self.model["module"][n] for n in names if n in self.model["module"]}

    def frozen(self) -> dict[str, torch.Tensor]:
        """Frozen params (``requires_grad=False``) whole: stages 0-2 from the model states file, stage 3 from the
        chunks of every rank's model states file."""
        shapes = self.model.get("frozen_param_shapes") or {}
        if self.stage == 0 or not shapes:
            return {}
        if self.stage < 3:
            return {n: t for n, t in (self.model.get("frozen_param_fragments") or {}).items() if n in shapes}
        if self._frozen is None:  # every rank's model states file: read once
            chunks = [self.model_states(r).get("frozen_param_fragments") or {} for r in range(self.dp)]
            self._frozen = {
                n: torch.cat([c[n].reshape(-1) for c in chunks])[: math.prod(s)].view(tuple(s))
                for n, s in shapes.items()
            }
        return self._frozen

    def counters(self) -> dict[str, Any]:
        """Engine counters and the fp16 loss scaler as llmpar saves them (``Engine.restore_counters``)."""
        m = self.model
        out: dict[str, Any] = {
            "global_steps": int(m.get("global_steps", 0)),
            "global_samples": int(m.get("global_samples", 0)),
            "skipped_steps": int(m.get("skipped_steps", 0)),
        }
        scaler = self.zero_state(0).get("loss_scaler") if self.optim else None
        st = scaler.state if isinstance(scaler, Foreign) else {}
        opt = m.get("optimizer")
        if isinstance(opt, dict) and "cur_scale" in opt:  # stage 0, fp16 / bf16 optimizer
            st = {**opt, "dynamic": opt.get("dynamic_loss_scale", False)}
        if "cur_scale" in st:
            out["loss_scaler"] = loss_scaler(st)
        return out

    def groups(self) -> list[list[str]]:
        """The param groups' names in the optimizer's order (``param_shapes``; stage 0: one group)."""
        shapes = self.model.get("param_shapes") if self.stage > 0 else [dict.fromkeys(self.names)]
        return [list(g) for g in shapes or []]

    def hyper(self) -> list[dict[str, Any]]:
        """The torch optimizer's param groups (lr, betas, eps, weight_decay and the rest)."""
        if self.stage == 0:
            opt = self.model.get("optimizer")
            return list(opt.get("optimizer_state_dict", opt)["param_groups"]) if isinstance(opt, dict) else []
        z = self.zero_state(0)
        base = z["optimizer_state_dict"] if self.stage == 3 else z["base_optimizer_state"]
        return list(base["param_groups"]) if isinstance(base, dict) else []

    def scheduler(self) -> dict | None:
        return self.model.get("lr_scheduler")

    def client_state(self) -> dict:
        """The keys of the caller's ``client_state`` (DeepSpeed writes them beside its own)."""
        return {k: v for k, v in self.model.items() if k not in DS_KEYS}

    def ds_config(self) -> dict:
        return dict(self.model.get("ds_config") or {})

    def hf_config(self) -> dict:
        return {}

    def prepare(self, name: str, shape: tuple[int, ...]) -> None:
        pass


__all__ = ["RankCheckpoint"]
