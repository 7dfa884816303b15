"""The expert index of llmpar's checkpoints (``llmpar/checkpoint/experts.py``, ``expert_tp.py``) on rank files built
here: experts saved as etp shards (partitions cut mid-expert, over ep x etp x edp ranks) read back as the whole
global tensors, float64 on odd shapes, and the rows that several tp ranks wrote read once. One process, no engine
(the engines' round trips are in tests/test_moe_etp.py)."""

from __future__ import annotations

import pytest
import torch

from llmpar.checkpoint.expert_tp import shard_name
from llmpar.checkpoint.experts import ExpertIndex
from llmpar.checkpoint.files import CheckpointError
from llmpar.moe.expert_tp import shard_packed


class _Files:
    """Rank files as ``ExpertIndex`` reads them: {file name: its tree}."""

    def __init__(self, trees: dict[str, dict]) -> None:
        self.path, self.trees = "ckpt", trees

    def tree(self, fname: str) -> dict:
        return self.trees[fname]


def _index(trees: dict[str, dict]) -> ExpertIndex:
    meta = {"files": {f: {"experts": {}} for f in trees}}
    index = ExpertIndex(_Files(trees), meta)  # type: ignore[arg-type]
    index.open()
    return index


def _saved_as_etp_shards(whole: dict[str, torch.Tensor], ep: int, etp: int, edp: int) -> dict[str, dict]:
    """The rank files of an ep x etp x edp run holding ``whole`` ({name: [E, 2I, H] or [E, H, I]}): rank (p, t, d)
    writes partition d of its ep rank's rows of etp shard t, as pieces of the ep-stacked shards ``S_t``."""
    trees = {}
    for p in range(ep):
        for t in range(etp):
            for d in range(edp):
                params, pieces, datas, at = [], [], [], 0
                for name, w in whole.items():
                    layout = "gate_up" if name.endswith("gate_up_proj") else "down"
                    params.append({"name": name, "shape": list(w.shape), "etp": {"size": etp, "layout": layout}})
                    n = w.shape[0] // ep
                    mine = shard_packed(w[p * n : (p + 1) * n], layout, etp, t).reshape(-1)
                    cut = [len(mine) * k // edp for k in range(edp + 1)]  # cuts mid-expert
                    a, z = cut[d], cut[d + 1]
                    pieces.append([shard_name(name, t), p * len(mine) + a, p * len(mine) + z, at, 0])
                    datas.append(mine[a:z])
                    at += z - a
                buf = {"pieces": pieces, "steps": torch.tensor([7.0]), "params": torch.cat(datas)}
                trees[f"p{p}-t{t}-d{d}"] = {"experts": {"ep": ep, "params": params, "buffers": [buf]}}
    return trees


@pytest.mark.parametrize("ep,etp,edp", [(1, 2, 1), (2, 3, 2), (4, 2, 3)])
def test_etp_shards_read_back_as_the_whole_experts(ep: int, etp: int, edp: int):
    gen = torch.Generator().manual_seed(ep * 100 + etp * 10 + edp)
    e, i, h = 4, 6, 5
    whole = {
        "l.experts.gate_up_proj": torch.randn(e, 2 * i, h, generator=gen, dtype=torch.float64),
        "l.experts.down_proj": torch.randn(e, h, i, generator=gen, dtype=torch.float64),
    }
    index = _index(_saved_as_etp_shards(whole, ep, etp, edp))
    for name, w in whole.items():
        assert name in index and index.shapes[name] == tuple(w.shape) and index.keys(name) == ["params"]
        assert torch.equal(index.get(name, "params", 0, w.numel()).view(w.shape), w)
        for a, z in ((7, 50), (w.numel() - 13, w.numel())):  # ranges across experts and gate / up rows
            assert torch.equal(index.get(name, "params", a, z), w.reshape(-1)[a:z])
        assert index.step(name) == 7.0 and len(index.files_for(name, 0, 1)) == ep * etp * edp


def test_rows_written_by_several_tp_ranks_are_read_once_and_a_hole_is_named():
    w = torch.randn(24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = [{"name": "x", "shape": [4, 6]}]

    def tree(a: int, z: int) -> dict:
        buf = {"pieces": [["x", a, z, 0, 0]], "steps": torch.tensor([1.0]), "params": w[a:z].clone()}
        return {"experts": {"ep": 2, "params": params, "buffers": [buf]}}

    index = _index({"d0-tp0": tree(0, 12), "d0-tp1": tree(0, 12), "d1-tp0": tree(12, 24), "d1-tp1": tree(12, 24)})
    assert torch.equal(index.get("x", "params", 0, 24), w)  # was: "elements [12, 24) ... are in no rank file"
    assert torch.equal(index.get("x", "params", 5, 17), w[5:17])
    holed = _index({"d0-tp0": tree(0, 12), "d1-tp0": tree(14, 24)})
    with pytest.raises(CheckpointError, match=r"elements \[12, 24\) of expert param 'x' \(params\) are in no rank"):
        holed.get("x", "params", 0, 24)


def test_the_checkpoint_reads_the_etp_tag_the_engine_sets():
    """The checkpoint names the shards' tag itself (it sees the optimizer through protocol.py only): the same
    attribute as llmpar.zero.experts sets."""
    from llmpar.checkpoint import expert_tp
    from llmpar.zero.experts import ETP_LAYOUT

    assert expert_tp.ETP_LAYOUT == ETP_LAYOUT
    p = torch.nn.Parameter(torch.ones(2, 2))
    setattr(p, ETP_LAYOUT, "down")
    assert expert_tp.layout_of(p) == "down"
