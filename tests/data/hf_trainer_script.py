"""A transformers.Trainer fine-tuning script, run by DeepSpeed or by llmpar with one import changed:

    torchrun --nproc_per_node 2 hf_trainer_script.py --backend deepspeed|llmpar --model llama --stage 3 --out o.json

A tiny model from its config (random weights, vocab 67), random token data, a DeepSpeed config with "auto" values.
Writes {"loss": [per-step loss], "grad_norm": [...], "lr": [...]} (rank 0) to --out; the test compares the backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import transformers


def model_config(kind: str, tie: bool):
    import transformers

    common = dict(
        vocab_size=67,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    raise ValueError(f"--model {kind}")


def build_model(kind: str, tie: bool):
    import transformers

    config = model_config(kind, tie)
    return (transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM)(config)


@dataclasses.dataclass
class ScriptArguments(transformers.TrainingArguments):
    """A script's arguments as fine-tuning scripts write them: transformers' TrainingArguments and a field of
    its own."""

    max_seq_length: int = dataclasses.field(default=11)


def add_pad_token(model) -> None:
    """What SFT scripts do after adding a pad token to the tokenizer: one more row in the embeddings (and an untied
    LM head), drawn from the old rows' mean and covariance (transformers' default)."""
    torch.manual_seed(1)
    model.resize_token_embeddings(68)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 96, seq: int = 11, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 67, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


EVAL = Tokens(n=16, seq=11, seed=99)  # 4 batches of 4: 2 per rank at dp 2
PROMPT = Tokens(n=2, seq=5, seed=7).x


def ds_config(stage: int, offload: bool, tp: int, hf_schedule: bool) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto", "overlap_comm": False},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        },
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
    if not hf_schedule:
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    if stage == 3:
        cfg["zero_optimization"].update(
            {
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "gather_16bit_weights_on_model_save": True,
            }
        )  # DeepSpeed's name
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        del cfg["optimizer"]["params"]["torch_adam"]
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["deepspeed", "llmpar"], required=True)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--offload", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--hf-schedule", action="store_true", help="no scheduler block: the Trainer's linear schedule")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--zero-init", action="store_true", help="llmpar: build the model inside llmpar.zero.Init()")
    ap.add_argument(
        "--auto-build",
        action="store_true",
        help="build by AutoModelForCausalLM.from_config after the "
        "TrainingArguments (sharded by the ZeRO-3 config, as transformers does for DeepSpeed)",
    )
    ap.add_argument(
        "--eval",
        action="store_true",
        help="an eval set: evaluated every 10 steps, then evaluate(), predict() and generate() after training",
    )
    ap.add_argument("--eval-first", action="store_true", help="evaluate() before train()")
    ap.add_argument(
        "--resize",
        action="store_true",
        help="add a pad token after the arguments: "
        "model.resize_token_embeddings(68), as SFT scripts do (under ZeRO-3: on the sharded build)",
    )
    ap.add_argument(
        "--stock-args",
        action="store_true",
        help="llmpar: the script's arguments subclass transformers.TrainingArguments (only the Trainer import changed)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    if a.backend == "llmpar":
        from llmpar.integrations.transformers import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    from transformers import TrainerCallback

    if a.stock_args:  # the script's own arguments class, over transformers' (not llmpar's) TrainingArguments
        TrainingArguments = ScriptArguments  # noqa: N806

    torch.manual_seed(0)
    if a.zero_init:  # the same weights as the plain build below, never whole on one rank
        import llmpar

        with llmpar.zero.Init():
            model = build_model(a.model, tie=not a.untied)
    elif not a.auto_build:
        model = build_model(a.model, tie=not a.untied)
    evaluating = a.eval or a.eval_first
    args = TrainingArguments(
        output_dir=a.output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=a.steps,
        learning_rate=2e-3,
        warmup_steps=3,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=42,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        deepspeed=ds_config(a.stage, a.offload, a.tp, a.hf_schedule),
        disable_tqdm=True,
        bf16=a.bf16,
        per_device_eval_batch_size=4,
        eval_strategy="steps" if a.eval else "no",
        eval_steps=10,
    )
    if a.auto_build:  # after the arguments: transformers / llmpar build it sharded under a ZeRO-3 config
        import transformers

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config(a.model, tie=not a.untied))
    record = {
        "sharded_build": all(p.is_meta for p in model.parameters()),
        "training": False,
        "eval_steps": [],
        "args_class": type(args).__name__,
        "args_deepspeed": args.deepspeed is not None,
    }
    if a.resize:
        add_pad_token(model)

    class Record(TrainerCallback):
        rows: list = []

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "eval_loss" in logs and record["training"]:  # evaluation during training
                record["eval_steps"].append([state.global_step, float(logs["eval_loss"])])
            if logs and "loss" in logs:
                self.rows.append(
                    {
                        "step": state.global_step,
                        "loss": float(logs["loss"]),
                        "grad_norm": float(logs.get("grad_norm") or 0.0),
                        "lr": float(logs.get("learning_rate") or 0.0),
                    }
                )

    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[Record()], eval_dataset=EVAL if evaluating else None
    )
    if a.eval_first:
        record["eval_first"] = trainer.evaluate()["eval_loss"]
    record["training"] = True
    trainer.train(resume_from_checkpoint=a.resume)
    record["training"] = False
    if a.eval:  # the trained model: evaluated, predicted, and greedy generation from the same prompt on every rank
        record["eval_final"] = trainer.evaluate()["eval_loss"]
        pred = trainer.predict(EVAL)
        record["predict_loss"] = pred.metrics["test_loss"]
        record["predict_logits"] = torch.as_tensor(pred.predictions[:2]).tolist()
        with torch.no_grad():
            record["generated"] = trainer.model.generate(
                PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0
            ).tolist()
    final = os.path.join(a.output_dir, "final")
    if int(os.environ.get("RANK", "0")) == 0:
        rows = Record.rows
        with open(a.out, "w") as f:
            json.dump(
                {
                    "step": [r["step"] for r in rows],
                    "loss": [r["loss"] for r in rows],
                    "grad_norm": [r["grad_norm"] for r in rows],
                    "lr": [r["lr"] for r in rows],
                    "final": final,
                    **record,
                },
                f,
            )
    if os.environ.get("HF_SCRIPT_SAVE", "1") == "1":
        trainer.save_model(final)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # torch 2.13's gloo teardown at interpreter exit aborts now and then ("terminate called without an active
    # exception", under DeepSpeed and llmpar alike, about 1 run in 5): the run's work is done and written, leave
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
