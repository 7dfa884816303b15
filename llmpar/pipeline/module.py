"""``PipelineModule``: DeepSpeed's pipeline model, a list of layers cut into stages, each rank building only its own.

    net = PipelineModule(layers=[LayerSpec(nn.Linear, 8, 32), nn.ReLU(inplace=True), LayerSpec(nn.Linear, 32, 4)],
                         loss_fn=nn.CrossEntropyLoss(), num_stages=2, partition_method="parameters")
    engine, *_ = llmpar.initialize(model=net, config={...}, training_data=dataset)   # a pipeline engine
    loss = engine.train_batch()

Construction follows DeepSpeed step by step, so that a script gets the same stages and the same initial weights:
join the job (``llmpar.init_distributed(pp=num_stages)``: the ``[pp, dp, tp=1]`` mesh, rank = stage x dp + dp rank as
DeepSpeed's topology), cut the layers (``specs.partition_layers``; ``"parameters"`` builds every LayerSpec once to
count it, drawing from the random generator as DeepSpeed does), build this stage's layers in order (a TiedLayerSpec
once per key per stage, registered under ``tied_modules.<key>``, the others under their layer index, as DeepSpeed
names them), move them to the device, and copy each tied weight from the lowest stage holding it to the others.

``pipeline_split()`` hands the stage to the runner (``llmpar.pipeline.split`` calls it): a :class:`PipeStage` whose
forward clones its inputs first, as DeepSpeed's engine does, so that an in-place first layer (``ReLU(inplace=True)``)
never writes into the buffer a stage received (or the batch), and a tuple from the previous stage reaches the first
layer as one tuple; tied weights are listed so that their gradients are summed over the stages holding them.
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from llmpar.distributed.collectives import all_gather_flat, all_reduce, as_group
from llmpar.distributed.init import init_distributed
from llmpar.pipeline.pipe_stage import CallLayer, PipeStage, TiedCall
from llmpar.pipeline.specs import LayerSpec, TiedLayerSpec, check_layers, layer_name, partition_layers

logger = logging.getLogger("llmpar")


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule`` (module docstring); arguments as DeepSpeed's, plus ``mesh=``: the
    ``[pp, dp, tp]`` mesh of ``llmpar.init_distributed(pp=...)`` to use instead of building one (tp must be 1).
    ``seed_layers`` seeds each layer's build with ``base_seed + index`` (``seed_fn``, default: random, numpy and
    torch); DeepSpeed's reseeding of every forward is not done. ``topology=`` and ``dynamic_shape=True`` are not
    supported."""

    def __init__(
        self,
        layers: Any,
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        *,
        mesh: Any = None,
    ) -> None:
        super().__init__()
        specs = check_layers(layers)
        if topology is not None:
            raise ValueError(
                "PipelineModule(topology=...) is not supported: pass num_stages= (pipeline x data "
                "parallel) or mesh= (llmpar.init_distributed(pp=...).mesh)"
            )
        if dynamic_shape:
            raise ValueError(
                "PipelineModule(dynamic_shape=True) is not supported: every step's micro-batches must "
                "have the shapes of the first step"
            )
        if (
            isinstance(activation_checkpoint_interval, bool)
            or not isinstance(activation_checkpoint_interval, int)
            or activation_checkpoint_interval < 0
        ):
            raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval!r} must be an int >= 0")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(outputs, labels), got {type(loss_fn).__name__}")
        for i, layer in enumerate(specs):
            if isinstance(layer, PipelineModule):
                raise TypeError(f"layers[{i}] is a PipelineModule: nested pipeline modules are not supported")
        self.mesh = _mesh(mesh, num_stages)
        self.num_stages = self.mesh["pp"].size()
        self.stage_id = self.mesh["pp"].get_local_rank()
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.partition_method = partition_method
        self._layer_specs = specs
        self._num_layers = len(specs)
        self._tie_attrs = _tie_attrs(specs)
        self.parts = partition_layers(specs, self.num_stages, partition_method)
        empty = [s for s in range(self.num_stages) if self.parts[s] == self.parts[s + 1]]
        if empty:
            raise ValueError(
                f"{len(specs)} layers cut into num_stages={self.num_stages} leave stages {empty} empty "
                f"(parts {self.parts}): give at least one layer per stage"
            )
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(self.layout())
        self.forward_funcs: list[Callable] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._blocks: list[tuple[str, nn.Module]] = []  # this stage's layers as named blocks (not registered here)
        self._build()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.mesh.device_type == "cuda"
            else torch.device(self.mesh.device_type)
        )
        self.to(device)
        self._device = device
        self._synchronize_tied_weights()

    # ------------------------------------------------------------------ DeepSpeed's public methods

    def forward(self, forward_input: Any) -> Any:
        """This stage's layers applied in order (the whole model when num_stages is 1)."""
        x = forward_input
        for fn in self.forward_funcs:
            x = fn(x)
        return x

    def partitions(self) -> list[int]:
        """The stage edges: stage s holds layers ``parts[s]:parts[s + 1]``."""
        return list(self.parts)

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer_idx={layer_idx} is outside [0, {self._num_layers})")
        return next(s for s in range(self.num_stages) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def set_checkpoint_interval(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"interval={interval!r} must be an int >= 0")
        self.activation_checkpoint_interval = interval

    def get_additional_losses(self) -> None:
        return None

    def layout(self) -> str:
        """The stages and their layers, as DeepSpeed prints them."""
        lines = [
            f"PipelineModule: {self._num_layers} layers -> {self.num_stages} stages, partition_method="
            f"{self.partition_method!r}"
        ]
        for s in range(self.num_stages):
            lines.append(f"stage={s} layers={self.parts[s + 1] - self.parts[s]}")
            lines += [
                f"    {i:2d}: {layer_name(self._layer_specs[i]) or self._layer_specs[i]!r}"
                for i in range(self.parts[s], self.parts[s + 1])
            ]
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ llmpar's hooks

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """This stage's layers as ``(layer index, module)`` blocks (``llmpar.pipeline.to_blocks``)."""
        return list(self._blocks)

    def pipeline_split(self, mesh: Any = None, verbose: bool = True) -> Any:
        """This rank's :class:`~llmpar.pipeline.stages.PipelineSplit` (a collective over pp: the stages' sizes)."""
        from llmpar.pipeline.stages import PipelineSplit, StageInfo

        if (
            mesh is not None
            and mesh is not self.mesh
            and (
                getattr(mesh, "mesh_dim_names", None) != self.mesh.mesh_dim_names
                or mesh["pp"].size() != self.num_stages
                or mesh["pp"].get_local_rank() != self.stage_id
            )
        ):
            raise ValueError(
                "the mesh given differs from the PipelineModule's (its pp axis or this rank's stage): "
                "pass the module's own mesh (net.mesh), or none"
            )
        pp_group = self.mesh["pp"].get_group()
        params = _unique(self.parameters())
        mine = torch.tensor(
            [sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)],
            dtype=torch.float64,
            device=self._device,
        )
        sizes = torch.empty(2 * self.num_stages, dtype=torch.float64, device=self._device)
        all_gather_flat(sizes, mine, pp_group)
        sizes_per_stage = sizes.view(self.num_stages, 2).tolist()
        stages = [
            StageInfo(
                index=s,
                pp_rank=s,
                blocks=[str(i) for i in range(self.parts[s], self.parts[s + 1])],
                params=int(n),
                param_bytes=int(b),
                cost=float(n),
            )
            for s, (n, b) in enumerate(sizes_per_stage)
        ]
        stage = PipeStage(
            self._blocks,
            stage_index=self.stage_id,
            checkpoint_interval=self.activation_checkpoint_interval,
            checkpoint_func=self.activation_checkpoint_func,
            checkpointable=self.checkpointable_layers,
        )
        result = PipelineSplit(
            pp=self.num_stages,
            virtual_stages=1,
            by=f"partition_method={self.partition_method}",
            boundaries=self.parts[1:-1],
            stages=stages,
            modules=[stage],
            stage_indices=[self.stage_id],
            pp_group=pp_group,
            pp_rank=self.stage_id,
            dp_group=self.mesh["dp"].get_group(),
            tied=self._tied_table(),
        )
        if verbose and dist.get_rank() == 0:
            logger.info(result.format())
        return result

    # ------------------------------------------------------------------ internals

    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                _seed(self.base_seed + idx, self.seed_fn)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = list(layer.tied_weight_attr)
                module = self.tied_modules[layer.key]
                if layer.forward_fn is None:
                    self.forward_funcs.append(module)
                    self._blocks.append((str(idx), module))
                else:
                    self.forward_funcs.append(functools.partial(layer.forward_fn, module))
                    self._blocks.append((str(idx), TiedCall(module, layer.forward_fn)))
                continue
            if isinstance(layer, LayerSpec):
                layer = layer.build()
            if isinstance(layer, nn.Module):
                self.add_module(str(idx), layer)
                self.forward_funcs.append(layer)
                self._blocks.append((str(idx), layer))
            else:
                self.forward_funcs.append(layer)
                self._blocks.append((str(idx), CallLayer(layer)))

    def _tied_keys(self) -> list[tuple[str, list[int]]]:
        """(key, the stages holding it) for every key held by more than one stage, sorted by key."""
        owners: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                owners.setdefault(layer.key, set()).add(self.stage_owner(idx))
        return [(key, sorted(stages)) for key, stages in sorted(owners.items()) if len(stages) > 1]

    def _tied_table(self) -> list[dict[int, str]]:
        """Per tied weight: {stage: its name in that stage's PipeStage}, the same list on every rank."""
        table = []
        for key, stages in self._tied_keys():
            where = {}
            for s in stages:
                idx = next(
                    i
                    for i in range(self.parts[s], self.parts[s + 1])
                    if isinstance(self._layer_specs[i], TiedLayerSpec) and self._layer_specs[i].key == key
                )
                where[s] = f"{idx}.module" if self._layer_specs[idx].forward_fn is not None else str(idx)
            table += [{s: f"{name}.{attr}" for s, name in where.items()} for attr in self._tie_attrs[key]]
        return table

    @torch.no_grad()
    def _synchronize_tied_weights(self) -> None:
        """Every stage holding a tied weight takes the lowest such stage's values (a sum over pp in which only that
        stage's copy is non-zero: exact)."""
        entries = [(key, attr, stages) for key, stages in self._tied_keys() for attr in self._tie_attrs[key]]
        if not entries:
            return
        pp_group = as_group(self.mesh["pp"])
        local = [
            _getattr(self.tied_modules[key], attr) if self.stage_id in stages else None for key, attr, stages in entries
        ]
        big = 2**62
        sizes = torch.tensor(
            [
                [p.numel() if p is not None else 0 for p in local],
                [-p.numel() if p is not None else -big for p in local],
            ],
            dtype=torch.int64,
            device=self._device,
        )
        all_reduce(sizes, pp_group, op="max")
        for (key, attr, _), hi, lo in zip(entries, sizes[0].tolist(), sizes[1].tolist()):
            if hi != -lo:
                raise ValueError(
                    f"the tied weight {key}.{attr} has {-lo} elements on one stage and {hi} on another: "
                    "give every TiedLayerSpec of a key the same module arguments"
                )
        flat = torch.zeros(sum(sizes[0].tolist()), dtype=torch.float64, device=self._device)
        offset = 0
        for p, n, (_, _, stages) in zip(local, sizes[0].tolist(), entries):
            if p is not None and self.stage_id == stages[0]:
                flat[offset : offset + n] = p.detach().reshape(-1)
            offset += n
        all_reduce(flat, pp_group)
        offset = 0
        for p, n in zip(local, sizes[0].tolist()):
            if p is not None:
                p.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def _mesh(mesh: Any, num_stages: int | None) -> Any:
    """The ``[pp, dp, tp]`` mesh: the one given (checked) or ``init_distributed(pp=num_stages)``'s."""
    if mesh is None:
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages= (or mesh=)")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages={num_stages!r} must be a positive int")
        world = init_distributed().world_size
        if world % num_stages:
            raise ValueError(f"num_stages={num_stages} must divide the world size {world}")
        return init_distributed(pp=num_stages).mesh
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if not {"pp", "dp", "tp"} <= set(names):
        raise ValueError(f"mesh has axes {names}: pass the [pp, dp, tp] mesh of llmpar.init_distributed(pp=...)")
    if mesh["tp"].size() != 1:
        raise ValueError(f"mesh has tp={mesh['tp'].size()}: a PipelineModule runs without tensor parallelism")
    if num_stages is not None and mesh["pp"].size() != num_stages:
        raise ValueError(f"num_stages={num_stages} but the mesh has pp={mesh['pp'].size()}")
    return mesh


def _tie_attrs(specs: list[Any]) -> dict[str, list[str]]:
    """Each key's tied_weight_attr (every spec of a key must agree)."""
    attrs: dict[str, list[str]] = {}
    for i, layer in enumerate(specs):
        if isinstance(layer, TiedLayerSpec):
            seen = attrs.setdefault(layer.key, layer.tied_weight_attr)
            if seen != layer.tied_weight_attr:
                raise ValueError(
                    f"layers[{i}]: TiedLayerSpec {layer.key!r} has tied_weight_attr="
                    f"{layer.tied_weight_attr} but an earlier one of that key has {seen}"
                )
    return attrs


def _getattr(module: nn.Module, path: str) -> torch.Tensor:
    out: Any = module
    for part in path.split("."):
        out = getattr(out, part)
    return out


def _seed(seed: int, seed_fn: Callable | None) -> None:
    if seed_fn is not None:
        seed_fn(seed)
        return
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed % 2**63)


def _unique(params: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


__all__ = ["PipelineModule"]
