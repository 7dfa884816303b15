"""``engine.compile()`` (DeepSpeed's) and the ``"compile"`` config block.

    engine, *_ = llmpar.initialize(model=model, config=cfg)
    engine.compile()                                   # backend="inductor", compile_kwargs=None
    engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False}, compiled_autograd_enabled=True)
    engine.is_compiled                                 # True

What is compiled (``torch.compile`` with ``backend`` and ``compile_kwargs``, on first call of each shape):
    ZeRO 0-2: the whole model with its hooks, as ``module.compile()`` does it (the same module object: names,
        ``state_dict`` keys and checkpoints do not change; ``model(x)`` called directly runs compiled too). The
        engine's own work around the forward stays outside the graph, in front of it: the token count of the
        progress lines (a forward pre-hook in eager mode) and, with ``overlap_param_gather``, the wait for the
        params' all-gather. The gradient reduction (``llmpar.zero.grads``) runs in post-accumulate-grad hooks during
        an eager backward, overlapping it as without compile. The optimizer step, the LR schedule and the loss
        scaling are outside the graph, so a new learning rate never recompiles it.
    ZeRO 0-2 with ``compiled_autograd_enabled=True``: ``engine.backward`` also compiles the backward (compiled
        autograd, the same backend); the reduction hooks are detached while it runs (a hook with collectives cannot
        be traced into one graph), and every unit's gradients are packed and reduced, in the layout's order, right
        after it (no overlap with the backward). ``loss.backward()`` called directly runs eager backward with hooks.
    ZeRO-3: each unit ZeRO-3 gathers is compiled as its own region, gather / release between regions
        (``llmpar.zero.compile.compile_stage3``).

The ``"compile"`` block is DeepSpeed 0.19's ``CompileConfig``: it configures DeepCompile (graph passes that move
ZeRO's gathers, reductions and offloads inside the compiled graph). Those passes have no meaning in llmpar (ZeRO
runs as above); every key is checked (types, pass names) and the non-default ones are named in one log line.
DeepSpeed does not compile because of the block either: ``engine.compile()`` does.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

import torch

from llmpar.validation import as_bool, as_int, check_keys

logger = logging.getLogger("llmpar")

PASSES = ("z1", "z3", "autosp", "autotp")  # DeepCompile's pass names (deepspeed/compile/config.py)


@dataclass(kw_only=True)
class CompileConfig:
    """DeepSpeed 0.19's ``"compile"`` block (DeepCompile's settings): accepted with its types checked, none acted on
    (llmpar compiles through ``engine.compile()``, ZeRO outside the graph at stages 0-2 and per unit at stage 3); the
    non-default values are named in one log line."""

    deepcompile: bool = False  # DeepCompile mode (ZeRO as graph passes)
    autoep_non_moe: bool = False  # compile the parents of AutoEP layers only
    free_activation: bool = False  # DeepCompile's eager freeing of activations
    free_activation_threshold: int = 10 * 1024 * 1024  # bytes
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False  # DeepCompile's graph dumps
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[str] | None = None  # DeepCompile's pass names: z1, z3, autosp, autotp
    enabled: bool = False  # older DeepSpeed's switch: only false (call engine.compile())
    backend: str = "inductor"  # older DeepSpeed's, with enabled: pass it to engine.compile(backend=...)
    kwargs: dict = field(default_factory=dict)  # older DeepSpeed's: engine.compile(compile_kwargs=...)


def compile_block(block: Any) -> CompileConfig:
    """``"compile"`` -> :class:`CompileConfig`; every key typed (bools, a byte count, pass names), an unknown key an
    error naming the nearest one. The non-default values are named in one log line: they have no meaning in llmpar."""
    if block is None:
        return CompileConfig()
    check_keys("compile", block, [f.name for f in fields(CompileConfig)])
    values: dict[str, Any] = {}
    for f in fields(CompileConfig):
        if f.name not in block:
            continue
        v = block[f.name]
        if f.name == "free_activation_threshold":
            values[f.name] = as_int("compile.free_activation_threshold", v, minimum=0)
        elif f.name == "passes":
            values[f.name] = _passes(v)
        elif f.name in ("backend", "kwargs"):
            kind = str if f.name == "backend" else dict
            if not isinstance(v, kind):
                raise TypeError(f'"compile.{f.name}" must be a {"string" if kind is str else "JSON object"}, got {v!r}')
            values[f.name] = v
        else:
            values[f.name] = as_bool(f"compile.{f.name}", v)
    if values.get("enabled"):
        raise ValueError(
            '"compile.enabled"=true: DeepSpeed 0.19 has no such switch and neither does llmpar: call '
            "engine.compile(backend=..., compile_kwargs=...) after llmpar.initialize"
        )
    cfg = CompileConfig(**values)
    default = CompileConfig()
    changed = {
        k: v for k, v in values.items() if k not in ("enabled", "backend", "kwargs") and v != getattr(default, k)
    }
    if changed:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(changed.items()))
        logger.info(
            f'"compile": {shown}: DeepCompile settings, accepted without effect: llmpar compiles the model through '
            "engine.compile() with ZeRO outside the graph (stages 0-2) or per ZeRO-3 unit (stage 3)"
        )
    return cfg


def _passes(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise TypeError(f'"compile.passes" must be a list of pass names ({", ".join(PASSES)}) or null, got {value!r}')
    bad = [p for p in value if p not in PASSES]
    if bad:
        raise ValueError(f'"compile.passes": unknown pass(es) {bad}; DeepCompile\'s passes are {", ".join(PASSES)}')
    return list(value)


# ------------------------------------------------------------------------------------------------ engine.compile
_COMPILE_KWARGS = tuple(p for p in inspect.signature(torch.compile).parameters if p not in ("model", "backend"))


@dataclass(kw_only=True)
class CompileState:
    """What ``engine.compile()`` set up on an engine (``engine._compiled``)."""

    backend: str | Callable
    kwargs: dict = field(default_factory=dict)
    compiled_autograd: bool = False
    stage: int = 0


def check_backend(backend: Any) -> str | Callable:
    """A ``torch.compile`` backend: a registered name (``torch._dynamo.list_backends``) or a callable."""
    if callable(backend):
        return backend
    if not isinstance(backend, str):
        raise TypeError(f"engine.compile(backend={backend!r}): expected a backend name (str) or a callable")
    names = set(torch._dynamo.list_backends(exclude_tags=())) | {"eager", "aot_eager", "inductor"}
    if backend not in names:
        raise ValueError(f"engine.compile(backend={backend!r}): not a torch.compile backend; known: {sorted(names)}")
    return backend


def check_kwargs(compile_kwargs: Any) -> dict:
    """``torch.compile``'s keyword arguments (``backend`` among them is dropped with a warning, as DeepSpeed does)."""
    if compile_kwargs is None:
        return {}
    if not isinstance(compile_kwargs, dict):
        raise TypeError(f"engine.compile(compile_kwargs={compile_kwargs!r}): expected a dict of torch.compile's args")
    kwargs = dict(compile_kwargs)
    if "backend" in kwargs:
        logger.warning("engine.compile: the `backend` in `compile_kwargs` is overridden by the `backend` argument")
        kwargs.pop("backend")
    bad = sorted(k for k in kwargs if k not in _COMPILE_KWARGS)
    if bad:
        raise ValueError(
            f"engine.compile(compile_kwargs=...): {bad} are not torch.compile arguments (accepted: "
            f"{', '.join(_COMPILE_KWARGS)})"
        )
    return kwargs


def compile_engine(
    engine: Any,
    backend: Any = "inductor",
    compile_kwargs: dict | None = None,
    schedule: Any = None,
    compiled_autograd_enabled: bool = False,
) -> None:
    """``engine.compile(...)``: see the module docstring. A second call does nothing (DeepSpeed's), with a warning
    when it asks for another backend or other arguments."""
    backend = check_backend(backend)
    kwargs = check_kwargs(compile_kwargs)
    as_bool("compiled_autograd_enabled", compiled_autograd_enabled)
    if schedule is not None:
        if not isinstance(schedule, (list, tuple)):
            raise TypeError(
                f"engine.compile(schedule={schedule!r}): DeepCompile's schedule is a list of (step, passes)"
            )
        logger.info("engine.compile(schedule=...): DeepCompile's pass schedule, accepted without effect in llmpar")
    state = CompileState(
        backend=backend, kwargs=kwargs, compiled_autograd=compiled_autograd_enabled, stage=engine.config.zero.stage
    )
    done = getattr(engine, "_compiled", None)
    if done is not None:
        if (done.backend, done.kwargs, done.compiled_autograd) != (backend, kwargs, compiled_autograd_enabled):
            logger.warning(
                "engine.compile: the engine is already compiled (backend=%r); this call does nothing", done.backend
            )
        return
    pipeline = getattr(engine, "runner", None) is not None  # a PipelineEngine's stages (not imported: a cycle)
    if pipeline or not isinstance(engine.module, torch.nn.Module):
        raise ValueError(
            f"engine.compile() on a {type(engine).__name__} is not supported: compile the stages' blocks "
            "(torch.compile) before building the pipeline"
        )
    if state.stage == 3:
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True) at ZeRO stage 3: the units are gathered and their "
                "gradients reduced in hooks between the compiled regions; compiled autograd is not supported there"
            )
        from llmpar.zero.compile import compile_stage3

        compile_stage3(engine.optimizer, engine.module, backend, kwargs)
    else:
        _compile_whole(engine, backend, kwargs)
    engine._compiled = state
    logger.info(
        "engine.compile: backend=%s, ZeRO stage %d (%s)%s",
        getattr(backend, "__name__", backend),
        state.stage,
        "each ZeRO-3 unit a region" if state.stage == 3 else "the whole model",
        ", compiled autograd" if compiled_autograd_enabled else "",
    )


def compile_times() -> dict[str, float]:
    """Seconds ``torch.compile`` spent in this process, by phase (``torch._dynamo.utils.compile_times``, summed over
    every compiled graph); empty before the first compile."""
    from torch._dynamo.utils import compile_times as dynamo_times

    got = dynamo_times(repr="csv", aggregate=True)
    if not isinstance(got, tuple):
        return {}
    names, values = got
    return {str(n): float(v) for n, v in zip(names, values)}


def _compile_whole(engine: Any, backend: str | Callable, kwargs: dict) -> None:
    """ZeRO 0-2: ``module.compile()``, with the engine's token count and the params' wait in front of the graph
    (eager) instead of in a forward pre-hook that the graph would have to trace."""
    module: torch.nn.Module = engine.module
    hook = getattr(engine, "_token_hook", None)
    if hook is not None:
        hook.remove()
        engine._token_hook = None
    inner = module._call_impl  # the module's call with its hooks, traced inline from a frame of ours (a frame in
    # torch.nn itself, e.g. an nn.Sequential's, is one torch.compile would skip: nothing would be compiled)

    def traced(*args: Any, **kw: Any) -> Any:
        return inner(*args, **kw)

    from llmpar.distributed.funcol import with_dynamic_rows  # torch._dynamo: only once something compiles

    graph = with_dynamic_rows(torch.compile(traced, backend=backend, **kwargs), module)  # MoE over ep > 1 ranks
    wait = getattr(engine.optimizer, "wait_params", None)

    def call(*args: Any, **kw: Any) -> Any:
        if wait is not None:
            wait()  # overlap_param_gather: the gather lands before the graph reads the params
        engine._count_tokens(module, args, kw)
        return graph(*args, **kw)

    module._compiled_call_impl = call  # what nn.Module.__call__ runs instead of _call_impl (as module.compile() sets)


@contextlib.contextmanager
def backward_context(engine: Any) -> Iterator[None]:
    """Around ``engine.backward``'s ``loss.backward()``: compiled autograd when the engine was compiled with it (the
    reduction hooks detached, every unit reduced right after); nothing otherwise."""
    state = getattr(engine, "_compiled", None)
    if state is None or not state.compiled_autograd or torch.compiler.is_compiling():
        yield
        return
    from torch._dynamo import compiled_autograd

    reducers, opt = [], engine.optimizer  # the optimizer's, then its experts' (a nested ZeroOptimizer over edp)
    while opt is not None:
        if getattr(opt, "reducer", None) is not None:
            reducers.append(opt.reducer)
        opt = getattr(opt, "experts", None)
    compiler = torch.compile(backend=state.backend, **state.kwargs)
    for reducer in reducers:
        reducer.remove_hooks()
    try:
        with compiled_autograd._enable(compiler):
            yield
    finally:
        for reducer in reducers:
            reducer.attach_hooks()
    for reducer in reducers:
        reducer.reduce_after_backward()


__all__ = ["CompileConfig", "backward_context", "compile_block", "compile_engine"]
