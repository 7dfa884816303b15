"""Training loops shared by the ZeRO tests: the single-process references and the data-parallel loops they are
compared with (plain ZeroOptimizer on the small ``Net``s, and ``llmpar.initialize`` engines on the GPT)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmpar.optim import FusedAdamW

SEQ = 12
GPT_CFG = dict(vocab_size=64, n_layer=2, n_head=4, d_model=16, seq_len=SEQ)


def gpt_batch(step, n, vocab=64, seq=SEQ):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def reference_loop(net, groups, steps, gas, batch, loss_fn, clip, lr=2e-2, weight_decay=0.1):
    """Single-process FusedAdamW on the whole batch: ``batch(step, micro)`` -> (x, y); ``groups`` of (name, param)
    pairs as given to ZeroOptimizer; unused params get zero grads (as ZeRO gives them). Returns the losses."""
    plain = [{"params": [p for _, p in g["params"]], **{k: v for k, v in g.items() if k != "params"}} for g in groups]
    opt = FusedAdamW(plain, lr=lr, weight_decay=weight_decay)
    losses = []
    for s in range(steps):
        total = 0.0
        for m in range(gas):
            x, y = batch(s, m)
            loss = loss_fn(net, x, y) / gas
            loss.backward()
            total += loss.item()
        for p in net.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def zero_loop(opt, net, steps, gas, batch, loss_fn, micro):
    """The same training on this dp rank's slice of each batch with ZeroOptimizer ``opt``; returns the dp-mean
    losses (every step must be applied)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for s in range(steps):
        total = torch.zeros((), dtype=torch.float64)
        for m in range(gas):
            x, y = batch(s, m)
            x, y = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
            opt.set_gradient_accumulation_boundary(m == gas - 1)
            loss = loss_fn(net, x, y) / gas
            loss.backward()
            total += loss.detach().double()
        dist.all_reduce(total)
        assert opt.step()
        losses.append(total.item() / world)
    return losses


def engine_loop(engine, model, steps, micro, dp_mesh):
    """``llmpar.initialize`` training of the GPT on this dp rank's slice of ``gpt_batch``; returns dp-mean losses."""
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, micro * dp)
        x, y = x[dp_rank * micro : (dp_rank + 1) * micro], y[dp_rank * micro : (dp_rank + 1) * micro]
        loss = model.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t, group=dp_mesh.get_group())
        losses.append(t.item() / dp)
    return losses


def single_gpt_losses(model, steps, n, clip=0.3, lr=1e-2, weight_decay=0.1):
    """The GPT trained in one process with FusedAdamW on ``gpt_batch(step, n)`` (its trainable params only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = FusedAdamW(params, lr=lr, weight_decay=weight_decay)
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, n)
        loss = model.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_micro_steps(engine, model, g, micro=2, batch=3, vocab=61, seq=9):
    """``micro`` engine micro-steps (forward, backward, step) on random token batches drawn from generator ``g``;
    returns their losses."""
    losses = []
    for _ in range(micro):
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        loss = model.loss(engine(x[:, :-1]), x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses
