"""Benchmark: peak host memory (RSS) per rank of building a HuggingFace Llama and starting ZeRO-3 on it, plain vs
sharded, at dp=2 on CPU/gloo. One fresh torchrun job per case (the peak is a process's high-water mark):

    plain_config       LlamaForCausalLM(cfg) on every rank, then llmpar.initialize (ZeRO-3 shards it)
    sharded_config     llmpar TrainingArguments(deepspeed=<ZeRO-3 config>), then AutoModelForCausalLM.from_config:
                       built inside llmpar.zero.Init automatically (as transformers does for DeepSpeed), materialised
                       one unit at a time by initialize
    plain_pretrained   AutoModelForCausalLM.from_pretrained(dir) without the arguments (whole on every rank)
    sharded_pretrained the same after the arguments: each param read from the safetensors when its unit is materialised

Columns: peak RSS over the RSS after imports, at the end of the build and after initialize (MB, the larger of the two
ranks), the model's fp32 size, the params gathered at once at initialize (``init_peak_numel``) and whether the
sharded build equals the plain one (params gathered, compared with ``torch.equal``).

    python bench/bench_hf_zero3_init.py                  # launches torchrun itself, one job per case
    python bench/bench_hf_zero3_init.py --hidden 256 --layers 4

Results: bench/results/hf_zero3_init.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
CASES = ("plain_config", "sharded_config", "plain_pretrained", "sharded_pretrained")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _zero3() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3},
    }


def rank_run(args) -> None:
    import transformers

    import llmpar
    from llmpar.integrations.transformers import TrainingArguments

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    base = _rss_mb()
    keep = None
    if args.case.startswith("sharded"):
        keep = TrainingArguments(output_dir=args.dir, report_to=[], use_cpu=True, deepspeed=_zero3())
    torch.manual_seed(0)
    if args.case.endswith("config"):
        model = (
            transformers.AutoModelForCausalLM.from_config(_config(args))
            if keep is not None
            else transformers.LlamaForCausalLM(_config(args))
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.dir)
    built = _peak_mb() - base
    meta = all(p.is_meta for p in model.parameters())
    engine, opt, _, _ = llmpar.initialize(model=model, config=_zero3())
    started = _peak_mb() - base
    state = engine.module_state_dict()  # rank 0: the full weights, compared with the plain build / checkpoint
    same = None
    del keep  # the arguments gone: the reference below is built plainly
    gc.collect()
    if rank == 0:
        torch.manual_seed(0)
        ref = (
            transformers.LlamaForCausalLM(_config(args))
            if args.case.endswith("config")
            else transformers.AutoModelForCausalLM.from_pretrained(args.dir)
        )
        same = all(torch.equal(state[n], p.detach()) for n, p in ref.state_dict().items() if n in state)
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        rows, {"built": built, "started": started, "meta": meta, "init_peak_numel": opt.init_peak_numel, "same": same}
    )
    if rank == 0:
        print("RESULT " + json.dumps(rows))
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--case", choices=CASES, default=None, help="(internal) the case one torchrun job runs")
    p.add_argument("--dir", default=None, help="(internal) the checkpoint directory")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_run(args)
        return
    import transformers

    from baselines import torchrun

    flags = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(1)
        model = transformers.LlamaForCausalLM(_config(args))
        psi = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        for case in CASES:
            out = torchrun(__file__, [*flags, "--case", case, "--dir", tmp], args.nproc)
            ranks = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            rows.append(
                {
                    "case": case,
                    "build_peak_mb": max(r["built"] for r in ranks),
                    "initialize_peak_mb": max(r["started"] for r in ranks),
                    "model_fp32_mb": psi * 4 / 2**20,
                    "built_on_meta": all(r["meta"] for r in ranks),
                    "init_peak_numel": max(r["init_peak_numel"] for r in ranks),
                    "equals_plain": ranks[0]["same"],
                }
            )
    print(json.dumps(rows, indent=1))
    if not args.no_write:
        from harness import write_results

        meta = {
            "model": f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} untied "
            f"({psi / 1e6:.1f}M params, fp32)",
            "dp": args.nproc,
            "peak": "ru_maxrss over the RSS after imports, the larger rank",
        }
        write_results("hf_zero3_init", rows, meta)


if __name__ == "__main__":
    main()
