"""``transformers.Trainer`` with llmpar doing ZeRO 0-3 (CPU offload, bf16 / fp16, tensor parallelism) in place of
DeepSpeed. A Trainer + DeepSpeed script changes its import line and nothing else:

    from llmpar.integrations.transformers import Trainer, TrainingArguments   # was: from transformers import ...
    args = TrainingArguments(output_dir="out", deepspeed="ds_config.json", bf16=True, ...)
    Trainer(model=model, args=args, train_dataset=ds).train()                  # torchrun --nproc_per_node N train.py

``TrainingArguments(deepspeed=...)`` here takes the DeepSpeed config (a dict or a JSON path) for llmpar instead of
starting DeepSpeed (``llmpar_config=`` is the same thing). ``Trainer(..., llmpar_config=...)`` also takes it. A script
whose arguments are transformers' own ``TrainingArguments`` (or a subclass of it, or ``HfArgumentParser``'s) keeps
them: once this module is imported, ``transformers.TrainingArguments(deepspeed=...)`` hands the config to llmpar the
same way (``args.deepspeed`` is None after it, ``args.llmpar_config`` holds it; said once in the log), so only the
``Trainer`` import changes. Arguments built before this module was imported have started DeepSpeed: refused.

What the Trainer does with it, as it does for DeepSpeed: the ``"auto"`` values are filled from the arguments
(``auto.fill_auto``); ``llmpar.initialize`` builds the engine at the start of ``train()``. Without an
``"optimizer"`` block the Trainer's own optimizer (``args.optim``: AdamW, its weight-decay groups) is handed to the
engine; without a ``"scheduler"`` block the Trainer's schedule (``args.lr_scheduler_type``, warmup) is, and the engine
steps it (not after a step skipped for fp16 overflow). Each micro-batch: forward, ``engine.backward`` (the loss
normalised by the Trainer, as for DeepSpeed), ``engine.step`` at the accumulation boundary the Trainer's loop sets
(clipping by ``gradient_clipping`` = ``max_grad_norm``); the logged ``grad_norm`` is the engine's.
Checkpoints: ``checkpoint-N/`` holds the model for ``from_pretrained`` (``engine.save_hf_model``: safetensors under
the model's names, config.json) and llmpar's sharded checkpoint (``global_stepN/``: params, optimizer, scheduler,
counters), with the Trainer's state and RNG files; ``train(resume_from_checkpoint=...)`` loads it into the engine
and resumes where it stopped. ``save_model()`` writes the gathered weights the same way.
``evaluate()`` / ``predict()`` (and evaluation during training) run the model's forward as training does: under
ZeRO-3 each unit module is gathered for its forward and freed after it; with several ranks ``model.generate``
defaults to ``synced_gpus=True``, as under DeepSpeed ZeRO-3. A ZeRO-3 config also makes ``from_config`` /
``from_pretrained`` called after these TrainingArguments are built build the model sharded (``zero3.py``), as
transformers does for DeepSpeed; an evaluate() before train() on such a model builds the engine first.
A ``"tensor_parallel"`` block splits the model with ``llmpar.parallelize`` and feeds the ranks of one
tensor-parallel group the same batches. A ``"context_parallel"`` block (or DeepSpeed's ``"sequence_parallel_size"``)
splits each sequence over its cp ranks (Llama / Qwen2 / Mistral, and the Mixtral / Qwen2-MoE / Qwen3-MoE mixtures of
experts, ``llmpar.context_parallel.hf``): the cp (x tp) ranks of a data-parallel group read the same batches (the
sampler shards over ``world / (cp * tp)`` ranks), the engine shards each one along the sequence, and the loss the
Trainer logs and optimises is the full-sequence one, equal to the same run without context parallelism
(``num_items_in_batch`` included). ``evaluate`` / ``predict`` run whole sequences.
"""

from __future__ import annotations

from llmpar.integrations.transformers.arguments import TrainingArguments
from llmpar.integrations.transformers.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
