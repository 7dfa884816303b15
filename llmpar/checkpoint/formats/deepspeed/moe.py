"""DeepSpeed's MoE checkpoints (``engine.save_checkpoint`` of a model holding ``deepspeed.moe.layer.MoE`` layers),
read with every expert under its global index: the same names as an ep=1 model's (``llmpar.moe.layer.MoE`` keeps
DeepSpeed's state-dict names), so any reader of the protocol's users (the loader, ``convert``, ``consolidate``) sees
the whole model.

DeepSpeed 0.19's files beside a dense checkpoint's (``files.py``):

    layer_L_expert_E_mp_rank_00_model_states.pt  {name with the global expert id: weight} of expert E of the L-th MoE
                                                 layer (module order), written by edp rank 0 of the ep rank holding it
    mp_rank_00_model_states.pt                  "module" without the experts; "param_shapes" (ZeRO) names dp rank 0's
                                                 experts by their *local* index; "num_experts" [per layer]
    [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt  (ZeRO 1-2) the optimizer's groups as the script made them
                                                 (``split_params_into_different_moe_groups_for_optimizer``: the dense
                                                 groups, then the experts' {"name": "ep_size_<ep>", "moe": True});
                                                 an expert group is partitioned over its ``partition_count[g] = edp``
                                                 ranks holding the same experts, so ``ep = dp / edp``
    expp_rank_R_mp_rank_00_optim_states.pt      (no ZeRO) {"optimizer": ep rank R's torch state dict: the dense params
                                                 and then its local experts, by index}; the model states file's
                                                 "optimizer" is ep rank 0's

Ranks (DeepSpeed's ``groups._create_expert_and_data_parallel``): dp rank R is ep rank ``R % ep`` and edp rank
``R // ep`` (``"use_data_before_expert_parallelism": true``: ep rank ``R // edp``, edp rank ``R % edp``). Local expert
i of ep rank r in a layer of ``E_local`` experts per rank is global expert ``r E_local + i``; its state in an expert
group sits at the group's flat offset of the local name, in edp partition ``offset // P`` of the ranks of ep rank r.

Checked when it opens (a ``CheckpointError`` naming the file or group): each layer has its ``E = E_local ep`` expert
files and no more, ``num_experts`` and the groups' ``ep_size_<ep>`` names agree, ``edp`` divides dp (without ZeRO:
ep divides each layer's expert files), and each expert's fp32 master at both ends equals its expert file's weights.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed import moe_checks
from llmpar.checkpoint.formats.deepspeed.files import MOMENTS, flat_slice, load_file, scalar
from llmpar.checkpoint.formats.deepspeed.moe_checks import LOCAL_RE
from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint

EXPERT_FILE_RE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def expert_files(path: str) -> list[str]:
    """The expert files (and the expert optimizer files of a run without ZeRO) in directory ``path``."""
    if not os.path.isdir(path):
        return []
    return sorted(f for f in os.listdir(path) if EXPERT_FILE_RE.match(f) or EXPP_RE.match(f))


class DeepSpeedMoECheckpoint(RankCheckpoint):
    """A DeepSpeed MoE checkpoint directory (module docstring): ``names`` are the dense params and every expert's
    params under their global names, in the optimizer's group order (an expert group: ep rank 0's experts, then ep
    rank 1's, ...); :meth:`groups` keeps DeepSpeed's groups (the experts in theirs)."""

    def __init__(self, path: str, *, loaded: dict[str, Any] | None = None) -> None:
        found = expert_files(path)
        self.expert_ids: dict[tuple[int, int], str] = {
            (int(m.group(1)), int(m.group(2))): f for f in found if (m := EXPERT_FILE_RE.match(f)) and m.group(1)
        }
        if any((m := EXPERT_FILE_RE.match(f)) and m.group(1) is None for f in found):
            raise CheckpointError(
                f"{path} is a DeepSpeed MoE checkpoint ({len(found)} expert files: {found[:3]}) in DeepSpeed's old "
                "naming, without a MoE layer id (expert_E_mp_rank_MM_model_states.pt): not read; llmpar reads "
                "layer_L_expert_E_mp_rank_MM_model_states.pt (DeepSpeed 0.19 writes them)"
            )
        if any(int(EXPERT_FILE_RE.match(f).group(3)) for f in self.expert_ids.values()):  # type: ignore[union-attr]
            raise CheckpointError(
                f"{path} holds expert files of model-parallel ranks > 0: DeepSpeed MoE checkpoints of a "
                "tensor-parallel model (expert tensor parallelism) are not read"
            )
        self._expp = {int(m.group(1)): f for f in found if (m := EXPP_RE.match(f))}
        self._expert_sd: dict[tuple[int, int], dict] = {}
        self.xwhere: dict[str, tuple[int, int, int]] = {}  # global expert name -> (group, offset / index, ep rank)
        self.ep: dict[int, int] = {}  # expert group -> its ep
        self.layer_of: dict[str, int] = {}  # layer prefix -> its MoE layer id in the file names (module order)
        super().__init__(path, loaded=loaded)
        if self.stage == 3:
            raise CheckpointError(f"{path}: a ZeRO-3 checkpoint with expert files (DeepSpeed's MoE runs ZeRO 0-2)")

    # ------------------------------------------------------------------ files
    def expert_file(self, layer: int, expert: int) -> dict:
        """The weights of global expert ``expert`` of MoE layer ``layer`` (its expert file, read once)."""
        if (layer, expert) not in self._expert_sd:
            name = f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
            sd = load_file(os.path.join(self.path, name))
            if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
                raise CheckpointError(f"{os.path.join(self.path, name)} is not a DeepSpeed expert file")
            self._expert_sd[(layer, expert)] = sd
        return self._expert_sd[(layer, expert)]

    def release(self, name: str = "") -> None:
        super().release(name)
        if not name:
            self._expert_sd.clear()

    def _partition_count(self) -> int:
        """dp (the dense groups' partition count; each expert group's is its edp), the groups' ep checked."""
        z = self.zero_state(0)
        count = z.get("partition_count")
        given = list(count) if isinstance(count, (list, tuple)) else [count]
        groups = self._torch_groups()
        if len(given) != len(groups) or not all(isinstance(c, int) and c > 0 for c in given):
            raise CheckpointError(f"{self.path}: partition_count {count!r} for {len(groups)} param groups")
        counts: list[int] = [c for c in given if isinstance(c, int)]
        dense = {c for c, g in zip(counts, groups) if not g.get("moe")}
        if len(dense) != 1:
            raise CheckpointError(f"{self.path}: the dense param groups have partition counts {sorted(dense)}")
        dp = dense.pop()
        for g, (c, group) in enumerate(zip(counts, groups)):
            if not group.get("moe"):
                continue
            if dp % c:
                raise CheckpointError(
                    f"{self.path}: expert param group {g} ({group.get('name')!r}) is partitioned over {c} "
                    f"expert-data-parallel ranks, which do not divide the dp={dp} ranks"
                )
            self.ep[g] = dp // c
            named = re.fullmatch(r"ep_size_(\d+)", str(group.get("name", "")))
            if named and int(named.group(1)) != dp // c:
                raise CheckpointError(
                    f"{self.path}: expert param group {g} is named {group['name']!r} but partitioned over {c} of "
                    f"dp={dp} ranks (ep={dp // c}): files of different runs?"
                )
        return dp

    def _torch_groups(self) -> list[dict]:
        if self.stage == 0:
            opt = self.model.get("optimizer")
            sd = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else None
            return list(sd["param_groups"]) if isinstance(sd, dict) and "param_groups" in sd else []
        base = self.zero_state(0)["base_optimizer_state"]
        return list(base["param_groups"]) if isinstance(base, dict) else []

    def dp_rank(self, g: int, ep_rank: int, edp_rank: int) -> int:
        """The dp rank holding edp partition ``edp_rank`` of expert group ``g`` of ep rank ``ep_rank``."""
        ep = self.ep[g]
        if (self.model.get("ds_config") or {}).get("use_data_before_expert_parallelism"):
            return ep_rank * (self.dp // ep) + edp_rank
        return edp_rank * ep + ep_rank

    # ------------------------------------------------------------------ layout
    def _layout(self) -> None:
        if self.stage == 0:
            self._layout_no_zero()
        else:
            super()._layout()  # every group by its local names: the dense ones kept, the experts' renamed below
            groups = self._torch_groups()
            local = {
                g: [n for n in shapes] for g, shapes in enumerate(self.model["param_shapes"]) if groups[g].get("moe")
            }
            at = {n: self.where.pop(n)[1] for names in local.values() for n in names}
            shapes = {n: self.shapes.pop(n) for n in at}
            self.names = [n for n in self.names if n not in at]
            self._globalize({g: [(n, at[n]) for n in names] for g, names in local.items()}, shapes)
        moe_checks.check_files(self)

    def _layout_no_zero(self) -> None:
        """No ZeRO: the torch state dicts' params by index, the dense ones in module order, then the experts in the
        order of the layers and their expert files."""
        self.names, self.shapes, self.where = [], {}, {}
        self._layout0_dense()
        ep = len(self._expp)
        groups = self._torch_groups()
        if ep == 0 or sorted(self._expp) != list(range(ep)):
            raise CheckpointError(
                f"{self.path}: a DeepSpeed MoE checkpoint without ZeRO has the expert optimizer files of ep ranks "
                f"{sorted(self._expp)} (expp_rank_R_mp_rank_00_optim_states.pt, R = 0 .. ep - 1)"
            )
        layers = sorted({layer for layer, _ in self.expert_ids})
        per = {layer: sum(1 for key in self.expert_ids if key[0] == layer) for layer in layers}
        order: list[str] = []
        for layer in layers:
            if per[layer] % ep:
                raise CheckpointError(
                    f"{self.path}: MoE layer {layer} has {per[layer]} expert files, which ep={ep} (the expp_rank "
                    "optimizer files) does not divide"
                )
            for i in range(per[layer] // ep):  # ep rank 0's local experts, renamed to their local index
                for n in self.expert_file(layer, i):
                    m = LOCAL_RE.match(n)
                    if m is None:
                        raise CheckpointError(f"{self.path}: expert file of layer {layer} holds {n!r}")
                    order.append(f"{m.group(1)}{i}{m.group(3)}")
        index = {g: list(group["params"]) for g, group in enumerate(groups) if group.get("moe")}
        if sum(len(v) for v in index.values()) != len(order):
            raise CheckpointError(
                f"{self.path}: the optimizer's expert groups hold {sum(len(v) for v in index.values())} params, "
                f"ep rank 0's expert files {len(order)}"
            )
        local, k = {}, 0
        for g, idx in index.items():
            self.ep[g] = ep
            local[g] = [(order[k + j], i) for j, i in enumerate(idx)]
            k += len(idx)
        self._globalize(local)

    def _layout0_dense(self) -> None:
        """The dense params of the module (ep rank 0's torch state dict in the model states file), by the indices
        of the groups that are not the experts'."""
        buffers = set(self.model.get("buffer_names") or ())
        module, opt = self.model["module"], self.model.get("optimizer")
        sd = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else None
        if not isinstance(module, dict) or not isinstance(sd, dict) or "param_groups" not in sd:
            raise CheckpointError(f"{self.path}: the model states file holds no module or torch optimizer state dict")
        index = [i for group in sd["param_groups"] if not group.get("moe") for i in group["params"]]
        dense = [n for n in module if n not in buffers]
        if len(index) != len(dense):
            raise CheckpointError(
                f"{self.path}: the optimizer's dense groups hold {len(index)} params, the module {len(dense)}"
            )
        self._state0, self._fp32_0 = sd["state"], None
        for k, name in enumerate(dense):
            self.names.append(name)
            self.shapes[name] = tuple(module[name].shape)
            self.where[name] = (index[k], k)

    def _globalize(self, local: dict[int, list[tuple[str, int]]], shapes: dict | None = None) -> None:
        """Name every ep rank's experts of each expert group globally (``local``: group -> [(ep rank 0's local
        name, its offset or index)]; ``shapes``: {local name: shape} where ``param_shapes`` gives them)."""
        self.per_rank: dict[str, int] = {}  # layer prefix -> experts per ep rank
        for names in local.values():
            for n, _ in names:
                m = LOCAL_RE.match(n)
                if m is None:
                    raise CheckpointError(f"{self.path}: {n!r} of an expert param group is not a MoE expert's")
                self.per_rank[m.group(1)] = max(self.per_rank.get(m.group(1), 0), int(m.group(2)) + 1)
        self.groups_: list[list[str]] = []
        for g, names in local.items():
            for r in range(self.ep[g]):
                for n, at in names:
                    m = LOCAL_RE.match(n)
                    assert m is not None
                    gname = f"{m.group(1)}{r * self.per_rank[m.group(1)] + int(m.group(2))}{m.group(3)}"
                    self.xwhere[gname] = (g, at, r)
                    self.names.append(gname)
                    if shapes:
                        self.shapes[gname] = tuple(shapes[n])
        self.ep_of = {
            p: next(self.ep[g] for g, ns in local.items() if any(n.startswith(p) for n, _ in ns)) for p in self.per_rank
        }

    def expert_of(self, gname: str) -> tuple[int, int]:
        m = LOCAL_RE.match(gname)
        assert m is not None
        return self.layer_of[m.group(1)], int(m.group(2))

    def check_experts(self) -> None:
        """Each expert's fp32 master at both ends equals its expert file's weights (``moe_checks.py``)."""
        moe_checks.check_experts(self)

    def num_experts(self) -> dict[str, int]:
        """{MoE layer (module name): its experts, all ep ranks'}."""
        return {p.split(".deepspeed_moe.")[0]: k * self.ep_of[p] for p, k in self.per_rank.items()}

    def fits(self, names: list[str]) -> None:
        """A CheckpointError when a model whose trained params are ``names`` has another expert count in one of the
        checkpoint's MoE layers (``moe_checks.py``)."""
        moe_checks.fits(self, names)

    # ------------------------------------------------------------------ reads
    def describe(self) -> str:
        layers = ", ".join(
            f"{p.split('.deepspeed_moe')[0]}: {k * self.ep_of[p]} experts" for p, k in self.per_rank.items()
        )
        eps = sorted(set(self.ep_of.values()))
        return f"{super().describe()}, MoE written at ep={eps[0] if len(eps) == 1 else eps} ({layers})"

    def file_of(self, name: str) -> str:
        if name in self.xwhere:
            layer, e = self.expert_of(name)
            return f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
        return ""

    def has(self, name: str, key: str) -> bool:
        if name in self.xwhere and self.stage == 0:  # the weights are the masters (state_key: "master" read so)
            return key == "params" or key in MOMENTS
        return super().has(name, key)

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        name = self.source(name)
        if name not in self.xwhere:
            return super().read(name, key, a, z)
        g, at, r = self.xwhere[name]
        if self.stage == 0:
            if key in MOMENTS:
                st = self._expp_state(r).get(at, {})
                return st[key].reshape(-1)[a:z] if key in st else torch.zeros(z - a, dtype=torch.float32)
            layer, e = self.expert_of(name)
            return self.expert_file(layer, e)[name].reshape(-1)[a:z]
        size, out = self.part_size(g), []
        for p in range((at + a) // size, (at + z - 1) // size + 1):
            lo, hi = max(at + a, p * size) - p * size, min(at + z, (p + 1) * size) - p * size
            rank = self.dp_rank(g, r, p)
            t = self._fp32(rank)[g] if key in ("params", "master") else self.moments(rank)[g][key]
            out.append(flat_slice([t], lo, hi))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _expp_state(self, r: int) -> dict:
        key = ("expp", r)
        if key not in self._opened:  # type: ignore[comparison-overlap]
            name = os.path.join(self.path, self._expp[r])
            sd = load_file(name)
            opt = sd.get("optimizer") if isinstance(sd, dict) else None
            if not isinstance(opt, dict) or "state" not in opt:
                raise CheckpointError(f"{name} is not a DeepSpeed expert optimizer file (no 'optimizer' state dict)")
            self._opened[key] = opt["state"]  # type: ignore[index]
        return self._opened[key]  # type: ignore[index]

    def step(self, name: str) -> float:
        name = self.source(name)
        if name not in self.xwhere:
            return super().step(name)
        g, at, r = self.xwhere[name]
        if self.stage == 0:
            return scalar(self._expp_state(r).get(at, {}).get("step", 0))
        return scalar(self.moments(self.dp_rank(g, r, 0))[g].get("step", 0))

    def groups(self) -> list[list[str]]:
        """DeepSpeed's param groups: the dense ones, then each expert group's params of every ep rank."""
        by: dict[int, list[str]] = {}
        for name in self.names:
            g = self.xwhere[name][0] if name in self.xwhere else (self.where[name][0] if self.stage > 0 else -1)
            by.setdefault(g, []).append(name)
        if self.stage == 0:  # the dense params in the torch groups that are not the experts'
            dense = [g for g, group in enumerate(self._torch_groups()) if not group.get("moe")]
            by[dense[0] if dense else 0] = by.pop(-1, []) + by.get(dense[0] if dense else 0, [])
        return [by[g] for g in sorted(by)]

    def client_state(self) -> dict:
        return {k: v for k, v in super().client_state().items() if k != "num_experts"}


__all__ = ["DeepSpeedMoECheckpoint", "EXPERT_FILE_RE", "EXPP_RE", "expert_files"]
