"""The shipped text, the byte tokenizer and the data-parallel batch loader."""

import pytest
import torch

from llmpar.data import BatchLoader, ByteTokenizer, available_texts, load_text, load_tokens


def test_shipped_text_is_there_and_sized():
    assert "shakespeare" in available_texts()
    text = load_text()
    assert 100_000 <= len(text.encode()) <= 500_000
    assert "Prospero" in text or "PROSPERO" in text
    with pytest.raises(ValueError, match="not shipped"):
        load_text("no-such-text")


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    s = "Full fathom five thy father lies; caf\u00e9 \u2014 ok"
    ids = tok.encode(s)
    assert ids.dtype == torch.int64 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == s
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([300])


def test_batches_shift_by_one_and_are_deterministic():
    tokens = load_tokens()
    loader = BatchLoader(tokens=tokens, batch_size=4, seq_len=32, seed=7)
    x, y = loader.batch(5)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    x2, _ = BatchLoader(tokens=tokens, batch_size=4, seq_len=32, seed=7).batch(5)
    assert torch.equal(x, x2)
    assert not torch.equal(x, loader.batch(6)[0])
    assert not torch.equal(x, BatchLoader(tokens=tokens, batch_size=4, seq_len=32, seed=8).batch(5)[0])


@pytest.mark.parametrize("dp", [2, 3])
def test_dp_ranks_get_disjoint_shares_of_the_global_batch(dp):
    tokens = torch.arange(10_000)  # every window is identified by its first token
    loaders = [BatchLoader(tokens=tokens, batch_size=5, seq_len=16, dp_rank=r, dp_size=dp, seed=1) for r in range(dp)]
    for step in (0, 3):
        xs = [ld.batch(step)[0] for ld in loaders]
        starts = torch.cat([x[:, 0] for x in xs])
        assert starts.unique().numel() == 5 * dp  # disjoint across ranks
        single = BatchLoader(tokens=tokens, batch_size=5 * dp, seq_len=16, seed=1).batch(step)[0]
        assert torch.equal(torch.cat(xs), single)  # rank order == the single-process batch


def test_loader_errors_name_the_argument():
    with pytest.raises(ValueError, match="dp_rank=2"):
        BatchLoader(tokens=torch.arange(100), batch_size=1, seq_len=4, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="too few"):
        BatchLoader(tokens=torch.arange(20), batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(tokens=torch.arange(100), batch_size=0, seq_len=4)
