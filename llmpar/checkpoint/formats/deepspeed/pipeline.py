"""A checkpoint written by DeepSpeed's *pipeline* engine (``PipelineModule`` + ``PipelineEngine.save_checkpoint``),
read as it is, under the names of the unsplit ``PipelineModule`` (``2.fc.weight``, ``tied_modules.embed.weight``):
what llmpar's pipeline engine and a plain model with those names load. DeepSpeed 0.19's layout, ZeRO-1, pp stages,
dp data-parallel ranks per stage, tensor-parallel degree 1:

    DIR/TAG/layer_II-model_states.pt   one per layer I (the global index in the layer list) holding a
                                       ``state_dict`` (also layers without state: {}); ``layer_II-model_00-...`` when
                                       the topology has a "model" axis. Written by the stage holding layer I (its dp
                                       rank 0). A TiedLayerSpec called with ``forward_fn`` has no file; one called as
                                       a module is saved at its index, by every stage holding it, under the tied
                                       module's own keys (``weight``, not ``tied_modules.embed.weight``).
    DIR/TAG/mp_rank_SS_model_states.pt per stage S (DeepSpeed's model-parallel rank: the rank within the stages of one
                                       dp replica, ``stage x tp + tp rank``): "module" None, "param_shapes" (the
                                       stage's trained params in its ZeRO flat order; a tied weight in every stage
                                       holding it), "buffer_names", counters, "lr_scheduler", client_state,
                                       "checkpoint_parallel_dimensions" {"pp_degree", "tp_degree"}
    DIR/TAG/[bf16_]zero_pp_rank_R_mp_rank_SS_optim_states.pt   stage S's ZeRO-1 partition of dp rank R: the stage's
                                       flat fp32 masters and Adam moments over its ``param_shapes`` (``rank.py``)

Each stage is read by a :class:`~llmpar.checkpoint.formats.deepspeed.rank.RankCheckpoint` of its model-parallel rank;
this class joins them: a param held by several stages (a tied weight) is read from the lowest one (its copies are
equal: DeepSpeed sums their gradients over the stages). Buffers and frozen params come from the layer files (a tied
module's keys mapped back to ``tied_modules.KEY.``), which are all read when the checkpoint opens (small: weights
in the model's dtype), so a missing, truncated or foreign layer file fails then, naming it.

Without ZeRO (DeepSpeed's default for pipelines) each stage's optimizer is in its ``mp_rank_SS_model_states.pt``
("optimizer": torch's state dict, params by index; fp16: FP16_Optimizer's flat fp32 group and scaler), or, bf16, in
``bf16_zero_pp_rank_R_mp_rank_SS_optim_states.pt`` (BF16_Optimizer: flat partitions read as ZeRO-1's); "param_shapes"
is None: the files name no params, so ``model`` (the loading model's names, ``pipeline_names.py``) names them. fp32:
the masters are the layer files' weights. Not read (refused naming what was found): tp > 1.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from llmpar.checkpoint.files import CheckpointError
from llmpar.checkpoint.formats.deepspeed.files import LAYER_RE, detect, load_file, model_parallel_ranks
from llmpar.checkpoint.formats.deepspeed.pipeline_names import Stage, groups, infer
from llmpar.checkpoint.formats.deepspeed.rank import RankCheckpoint

TIED = "tied_modules."


class DeepSpeedPipelineCheckpoint(RankCheckpoint):
    """A DeepSpeed pipeline checkpoint (module docstring): the reader's interface over all its stages. ``pp``: the
    number of stages; ``stages[s]``: stage s's reader."""

    def __init__(
        self, path: str, mp_rank: int | None = None, model: dict | None = None, loaded: dict[str, Any] | None = None
    ) -> None:
        """``model``: {name: (shape, trained)} of the model loading it, which names the params of a checkpoint
        saved without ZeRO (``pipeline_names.py``); not needed otherwise. ``loaded``: files already read."""
        self.path = path
        found = detect(path)
        layers = {f: m for f in found if (m := LAYER_RE.match(f))}
        tp_ranks = sorted({int(m.group(2)) for m in layers.values() if m.group(2) is not None})
        if tp_ranks not in ([], [0]):
            raise CheckpointError(
                f"{path} is a DeepSpeed pipeline checkpoint with tensor-parallel ranks {tp_ranks} "
                "(layer_*-model_YY-model_states.pt): only tp=1 pipeline checkpoints are read"
            )
        mp = model_parallel_ranks(found)
        if 0 not in mp:
            raise CheckpointError(
                f"{path} has DeepSpeed pipeline layer files {sorted(layers)[:3]}... but no mp_rank_00_model_states.pt"
            )
        first = RankCheckpoint(path, mp_rank=0, loaded=loaded)
        dims = first.model.get("checkpoint_parallel_dimensions") or {}
        pp, tp = int(dims.get("pp_degree", len(mp))), int(dims.get("tp_degree", 1))
        if tp != 1:
            raise CheckpointError(
                f"{path}: DeepSpeed pipeline checkpoint of tp_degree={tp}: only tp=1 pipeline checkpoints are read"
            )
        if mp != list(range(pp)):
            raise CheckpointError(
                f"{path}: DeepSpeed pipeline checkpoint of pp_degree={pp} has the model states / "
                f"optimizer files of stages (mp_rank) {mp}, not 0..{pp - 1}"
            )
        self.pp = pp
        self.stages = [first] + [RankCheckpoint(path, mp_rank=s) for s in range(1, pp)]
        for s, st in enumerate(self.stages):
            if (st.kind, st.stage, st.dp, st.unnamed) != (first.kind, first.stage, first.dp, first.unnamed):
                raise CheckpointError(f"{path}: stage {s}'s files are {st.describe()}, stage 0's {first.describe()}")
        self.stage, self.dp, self.bf16, self.mp_rank, self.kind = first.stage, first.dp, first.bf16, 0, first.kind
        order = sorted(layers, key=lambda f: int(layers[f].group(1)))
        raw = {int(layers[f].group(1)): self._load_layer(f) for f in order}
        if first.unnamed:
            self._name_stages(raw, model)
        self.aliases: dict[str, str] = {}
        self.names: list[str] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._owner: dict[str, int] = {}
        for s, st in enumerate(self.stages):
            for name in st.names:
                if name in self._owner:  # a tied weight: every holder must agree on its shape
                    if st.shapes[name] != self.shapes[name]:
                        raise CheckpointError(
                            f"{path}: tied param {name!r} has shape {st.shapes[name]} in stage {s}"
                            f" and {self.shapes[name]} in stage {self._owner[name]}"
                        )
                    continue
                self._owner[name] = s
                self.names.append(name)
                self.shapes[name] = st.shapes[name]
        self._buffer_names = {n for st in self.stages for n in st.model.get("buffer_names") or ()}
        self.model = self._merged_model()
        self._layer_ids = sorted(int(m.group(1)) for m in layers.values())
        self._layers, self._origin = self._read_layers(order, raw)

    # ------------------------------------------------------------------ the layer files
    def _load_layer(self, f: str) -> dict[str, torch.Tensor]:
        sd = load_file(os.path.join(self.path, f))
        if not isinstance(sd, dict) or any(not isinstance(t, torch.Tensor) for t in sd.values()):
            raise CheckpointError(
                f"{os.path.join(self.path, f)} is not a DeepSpeed layer file (a state_dict of "
                f"tensors), it holds a {type(sd).__name__}"
            )
        return sd

    def _name_stages(self, raw: dict[int, dict[str, torch.Tensor]], model: dict | None) -> None:
        """Saved without ZeRO: each stage's params named from ``model`` (``pipeline_names.py``)."""
        if not model:
            raise CheckpointError(
                f"{self.path} is a DeepSpeed pipeline checkpoint without ZeRO ({self.kind} "
                "optimizer): its files name no params; load it with engine.load_checkpoint, whose "
                "model names them"
            )
        stages = []
        for s, st in enumerate(self.stages):
            buffers = {int(b.split(".", 1)[0]) for b in st.model.get("buffer_names") or () if b.split(".")[0].isdigit()}
            if st.stage == 0:
                opt = st.model.get("optimizer")
                sd = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else None
                if not isinstance(sd, dict) or len(sd.get("param_groups") or ()) != 1:
                    raise CheckpointError(
                        f"{self.path}: stage {s}'s model states file holds no one-group torch "
                        f"optimizer state dict ({type(opt).__name__}): not read"
                    )
                state = sd["state"]
                entries = [
                    tuple(state[i]["exp_avg"].shape) if "exp_avg" in state.get(i, {}) else None
                    for i in sd["param_groups"][0]["params"]
                ]
                stages.append(Stage(entries, None, buffers))
            else:
                sizes = st.flat_sizes()
                if len(sizes) != 1:
                    raise CheckpointError(
                        f"{self.path}: stage {s}'s {st.kind} holds {len(sizes)} param groups: not read"
                    )
                total = sizes[0]
                stages.append(Stage(None, (total, 0 if st.kind == "FP16_Optimizer" else 2 * st.dp - 1), buffers))
        model = {n: (tuple(int(d) for d in shape), bool(trained)) for n, (shape, trained) in model.items()}
        for st, (names, skip) in zip(self.stages, infer(model, raw, stages, self.path)):
            st.set_names(groups(names, model), skip)

    def _read_layers(
        self, files: list[str], raw: dict[int, dict[str, torch.Tensor]]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """{model name: tensor} of every layer file, and {model name: the file it came from}."""
        known = set(self.names) | self._buffer_names
        regular = {int(n.split(".", 1)[0]) for n in known if n.split(".", 1)[0].isdigit()}
        have = {int(LAYER_RE.match(f).group(1)): f for f in files}  # type: ignore[union-attr]
        lacking = sorted(regular - set(have))
        if lacking:
            i = lacking[0]
            held = sorted(n for n in known if n.startswith(f"{i}."))
            raise CheckpointError(
                f"DeepSpeed pipeline checkpoint {self.path} lacks layer file "
                f"layer_{i:02d}-model_states.pt (layer {i} holds {held[:4]} by the model states "
                f"files){f'; layers {lacking[1:]} lack theirs too' if len(lacking) > 1 else ''}"
            )
        module: dict[str, torch.Tensor] = {}
        origin: dict[str, str] = {}
        for i, f in sorted(have.items()):
            sd = raw[i]
            prefix = f"{i}." if i in regular or not sd else self._tied_prefix(f, sd, known)
            for key, t in sd.items():
                name = prefix + key
                if name in self.shapes and tuple(t.shape) != self.shapes[name]:
                    raise CheckpointError(
                        f"{os.path.join(self.path, f)}: {key!r} ({name!r}) has shape "
                        f"{tuple(t.shape)}, the model states files {self.shapes[name]}"
                    )
                if name not in module:  # a tied module saved by several stages: the lowest layer's copy
                    module[name], origin[name] = t, f
        return module, origin

    def _tied_prefix(self, f: str, sd: dict[str, torch.Tensor], known: set[str]) -> str:
        """``tied_modules.KEY.`` of the tied module whose state layer file ``f`` holds (found by its trained params'
        and buffers' names and shapes), or ``I.`` (a layer all of whose params are frozen)."""
        i = int(LAYER_RE.match(f).group(1))  # type: ignore[union-attr]
        keys = {n[len(TIED) :].split(".", 1)[0] for n in known if n.startswith(TIED)}
        fits = []
        for k in sorted(keys):
            want = {n[len(TIED) + len(k) + 1 :] for n in known if n.startswith(f"{TIED}{k}.")}
            if want <= set(sd) and all(
                tuple(sd[w].shape) == self.shapes.get(f"{TIED}{k}.{w}", tuple(sd[w].shape)) for w in want
            ):
                fits.append(k)
        if len(fits) > 1:
            raise CheckpointError(
                f"{os.path.join(self.path, f)}: the state of layer {i} ({sorted(sd)}) fits the tied "
                f"modules {fits} alike: which one it is cannot be told"
            )
        return f"{TIED}{fits[0]}." if fits else f"{i}."

    def _merged_model(self) -> dict[str, Any]:
        """Stage 0's model states with ``param_shapes`` of all stages (group by group, each name once)."""
        counts = {len(st.model.get("param_shapes") or []) for st in self.stages}
        if len(counts) != 1:
            raise CheckpointError(f"{self.path}: the stages hold {sorted(counts)} param groups: they cannot be joined")
        groups: list[OrderedDict] = [OrderedDict() for _ in range(counts.pop())]
        for st in self.stages:
            for g, shapes in enumerate(st.model["param_shapes"]):
                for name, shape in shapes.items():
                    groups[g].setdefault(name, shape)
        return {**self.stages[0].model, "param_shapes": groups, "buffer_names": sorted(self._buffer_names)}

    # ------------------------------------------------------------------ reads (by the stage holding the param)
    def file_of(self, name: str) -> str:
        """Where ``name`` is saved: its layer file, or the optimizer files of the stage holding it."""
        if name in self._owner and self.stage == 0:
            files = f"mp_rank_{self._owner[name]:02d}_model_states.pt"
            return files + (f", {self._origin[name]}" if name in self._origin else "")
        if name in self._owner:
            files = f"zero_pp_rank_*_mp_rank_{self._owner[name]:02d}_optim_states.pt"
            return files + (f", {self._origin[name]}" if name in self._origin else "")
        return self._origin.get(name, self.path)

    def describe(self) -> str:
        span = f", layer files of layers {min(self._layer_ids)}..{max(self._layer_ids)}" if self._layer_ids else ""
        how = {"ZeRO": f"ZeRO-{self.stage}", "torch": "no ZeRO (torch optimizer)"}.get(self.kind, self.kind)
        return f"pipeline of pp={self.pp} stages, {how} at dp={self.dp}{span}"

    def has(self, name: str, key: str) -> bool:
        name = self.source(name)
        if self.stage == 0 and key in ("params", "master"):  # no ZeRO, fp32: the weights are the layer files'
            return name in self._layers
        return self.stages[self._owner[name]].has(name, key)

    def read(self, name: str, key: str, a: int, z: int) -> torch.Tensor:
        name = self.source(name)
        if self.stage == 0 and key in ("params", "master"):
            if name not in self._layers:
                raise CheckpointError(
                    f"{self.path}: no layer file holds {name!r} (a tied module called only through forward_fn has none)"
                )
            return self._layers[name].reshape(-1)[a:z]
        return self.stages[self._owner[name]].read(name, key, a, z)

    def step(self, name: str) -> float:
        name = self.source(name)
        return self.stages[self._owner[name]].step(name)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self._layers.items() if n in self._buffer_names}

    def frozen(self) -> dict[str, torch.Tensor]:
        """The layer files' params that no stage trains (``requires_grad=False`` in DeepSpeed's run)."""
        return {n: t for n, t in self._layers.items() if n not in self.shapes and n not in self._buffer_names}

    def counters(self) -> dict[str, Any]:
        return self.stages[0].counters()

    def hyper(self) -> list[dict[str, Any]]:
        return self.stages[0].hyper()

    def scheduler(self) -> dict | None:
        return self.stages[0].scheduler()

    def client_state(self) -> dict:
        return self.stages[0].client_state()

    def release(self, name: str = "") -> None:
        for st in self.stages:
            st.release(name)


__all__ = ["DeepSpeedPipelineCheckpoint"]
