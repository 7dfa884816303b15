"""HuggingFace ``accelerate`` with llmpar doing ZeRO 0-3 in place of DeepSpeed. An accelerate + DeepSpeed script
changes its import line and nothing else:

    from llmpar.integrations.accelerate import Accelerator, DeepSpeedPlugin   # was: from accelerate import ...
    accelerator = Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, DummyOptim(params, lr=3e-4), train_dl,
                                                                 DummyScheduler(optimizer, total_num_steps=n))
    for x, y in train_dl:
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)            # the engine steps here, at the accumulation boundary
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # the engine's norm (it clipped already)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()   # no-ops, as under DeepSpeed

Launch with ``torchrun --nproc_per_node N train.py`` or ``accelerate launch`` with a config naming DeepSpeed
(``distributed_type: DEEPSPEED``, ``deepspeed_config_file``): without a ``deepspeed_plugin=`` the plugin is read from
the environment that launcher sets, as accelerate does. DeepSpeed is never started (nor needed, outside ``accelerate
launch``, whose DeepSpeed launcher imports it).

:class:`Accelerator` is accelerate's own, with its DeepSpeed route (``distributed_type == DEEPSPEED``) kept and the
engine underneath replaced: ``prepare`` fills the DeepSpeed config's ``"auto"`` values as accelerate does
(``train_micro_batch_size_per_gpu`` from the dataloaders' batch size, ``train_batch_size``,
``gradient_accumulation_steps`` from the plugin / the Accelerator, ``gradient_clipping`` from the plugin or 1.0, the
optimizer's lr / weight_decay (and betas / eps when given) from ``DummyOptim``, the scheduler's warmup and total steps
from ``DummyScheduler`` (total divided by the number of processes), bucket sizes from ``model.config.hidden_size``,
bf16 / fp16 from ``mixed_precision``, fp16 without DeepSpeed's ``auto_cast``: inputs are not cast) and builds the
engine with ``llmpar.initialize``. A real torch optimizer is mapped onto the ZeRO optimizer
(``llmpar.runtime.client``); a torch LR scheduler is stepped by accelerate's ``AcceleratedScheduler`` (once per
process per optimizer step, accelerate's rule) and its lrs are copied into the engine's optimizer; a
``DummyScheduler`` / the config's ``"scheduler"`` is stepped by the engine. Everything else (``accumulate``,
``backward``, ``save_state`` / ``load_state`` through the engine's checkpoint (a ``save_state`` between micro-steps
saves what DeepSpeed saves there, the accumulated gradients left out, said in the log), ``gather`` / ``reduce`` /
``gather_for_metrics``, ``print``, ``wait_for_everyone``, ...) is accelerate's code on the engine's
DeepSpeed-compatible API; ``get_state_dict`` / ``save_model`` gather the full weights (ZeRO-3: onto rank 0, None
elsewhere, as DeepSpeed), ``unwrap_model`` gives the engine's module. On a machine without CUDA, or with ``cpu=True``,
the ranks run on the CPU over gloo (stock accelerate drops DeepSpeed under ``cpu=True``).

Differences from accelerate + DeepSpeed: ``clip_grad_norm_`` with another ``max_norm`` than the engine's
``gradient_clipping`` is an error (DeepSpeed ignores it), ``load_state`` of a folder without the engine's checkpoint
is an error, ``get_state_dict`` gathers ZeRO-3 weights whatever ``stage3_gather_16bit_weights_on_model_save`` says,
``zero3_init_flag`` is off (build a model too big for one rank under ``llmpar.zero.Init``), one model per
Accelerator, no ``"tensor_parallel"`` / ``"pipeline"`` block, no fp8, no torch.compile (``dynamo_backend`` warns).
"""

from __future__ import annotations

from accelerate.utils import DeepSpeedPlugin
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

from llmpar.integrations.accelerate.accelerator import Accelerator

__all__ = ["Accelerator", "DeepSpeedPlugin", "DummyOptim", "DummyScheduler"]
