"""Every mistake a user can make on the command line is one line through argparse (exit 2)
that names the flag and value, never a worker's traceback. Each case below was a traceback
(or silently ignored) before ``lioncub train`` checked its inputs before starting workers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lioncub.cli import main

TINY = ["--model", "gpt-tiny", "--batch-size", "2", "--block-size", "16", "--steps", "1", "--no-progress",
        "--no-compare", "--nproc", "2"]
FT_TINY = ["--model", "gpt-tiny", "--batch-size", "2", "--block-size", "16", "--no-progress"]  # --ft: no --steps


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "tiny.txt").write_text("hello")
    (d / "text.txt").write_text("To be, or not to be, that is the question. " * 60)
    (d / "noclasses").mkdir()
    (d / "a_file").write_text("")
    (d / "run").mkdir()
    (d / "run" / "metrics.jsonl").write_text('{"kind": "step", "step": 1, "loss": 2.0, "train_time": 0.1}\n')
    np.savez(d / "few.npz", x=np.zeros((4, 8, 8), np.float32), y=np.zeros(4, np.int64))
    return d


def bad_inputs(d):
    cache = ["--cache-dir", str(d / "cache"), "--out", str(d / "out")]
    text = ["--data", str(d / "text.txt")] + cache
    cases = [
        (["train", *TINY, "--data", "/nonexistent", *cache],
         "--data '/nonexistent': not found or not text data; a GPT model takes 'shakespeare', a directory"),
        (["train", *TINY, "--data", str(d / "few.npz"), *cache], "not a .txt file; a GPT model takes"),
        (["train", *TINY, "--data", str(d / "tiny.txt"), *cache], "tokens too small for block_size 16 with 2 workers"),
        (["train", *TINY, "--block-size", "100", "--nproc", "3", *text],
         "val.bin holds 2 windows of --block-size 100 + 1 tokens; each of the 3 workers needs one"),
        (["train", *TINY, "--vocab-size", "10", *text], "--vocab-size 10: the data has 256 token values"),
        (["train", *TINY, "--vote", "pbit", "--bits", "2", "--nproc", "4", *text],
         "--bits/--quantizer: bits=2 lanes overflow with 4 workers for quantizer=None (need bits >= 4)"),
        (["train", *TINY, "--vote", "gather", "--quantizer", "l1", *text],
         "SignVote.quantizer applies to transport='pbit', got transport='gather'"),  # (the object's own refusal)
        (["train", *TINY, "--optimizer", "lion", "--bits", "4", *text], "bits=4 apply to optimizer='lioncub' only"),
        (["train", *TINY, "--model", "resnet18", "--data", "shakespeare", *cache],
         "--data 'shakespeare': not found; an image model takes 'digits', an .npz file or an image folder"),
        (["train", *TINY, "--model", "resnet18", "--data", str(d / "noclasses"), *cache], "has no class sub-folders"),
        (["train", *TINY, "--model", "resnet18", "--data", str(d / "few.npz"), "--batch-size", "8", *cache],
         "images is smaller than batch_size 8"),
        (["train", *TINY, "--data", str(d / "text.txt"), "--out", str(d / "a_file" / "run")],
         "cannot write the run directory there (Not a directory)"),
        (["train", *TINY, "--resume", "/nonexistent", *text],
         "--resume: '/nonexistent' is neither a checkpoint directory nor a run directory with ckpt/latest"),
        (["train", *TINY, "--nproc", "0", *text], "nproc must be >= 1, got 0"),
        (["train", *TINY, "--vote", "onebit", "--nodes", "3", "--nproc", "4", *text],
         "--nodes 3 must divide the number of workers, 4 (nodes of equal size)"),
        (["train", *TINY, "--vote", "onebit", "--nodes", "2", "--overlap", *text],
         "overlap=True is not supported with nodes > 1"),
        (["train", *TINY, "--vote", "onebit", "--no-shard", *text], "shard=False applies to nodes > 1 only"),
        (["train", *TINY, "--pace", "timed", *text], "pace='timed' apply to local_steps > 1 only"),
        (["train", *TINY, "--optimizer", "lion", "--pace", "timed", *text],
         "pace='timed' apply to optimizer='lioncub' only"),
        (["train", *TINY, "--pace", "fast", *text], "argument --pace: invalid choice: 'fast'"),
        (["train", *TINY, "--steps", "4", "--local-steps", "2", "--vote", "grad", "--pace", "timed", *text],
         "--pace timed: each worker takes its own steps a round, so the run stops and evaluates on the agreed clock: "
         "give --budget SECONDS"),
        (["train", *TINY, "--steps", "4", "--local-steps", "2", "--vote", "grad", "--pace", "timed", "--budget", "5",
          "--ckpt-every", "4", *text],
         "--pace timed: each worker takes its own steps a round; --ckpt-every counts steps: leave it 0"),
        (["train", "--ft", *FT_TINY, "--vote", "grad", "--local-steps", "5", "--pace", "timed", *text],
         "--ft: --pace timed needs every replica's steps in each round; torchft's quorum decides who is in a round"),
        (["train", *TINY, "--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
        (["train", "--ft", *FT_TINY, "--vote", "onebit", "--local-steps", "5", *text],
         "--ft: a replica left out of a quorum must add nothing to its sums: vote='grad', vote='sign_allreduce'"),
        (["train", "--ft", *FT_TINY, "--replicas", "1", *text], "--replicas must be >= 2 for fault tolerance, got 1"),
        (["train", "--ft", *FT_TINY, "--kill-every", "10", "--replicas", "2", *text],
         "--kill-every needs --replicas > --min-replicas (a kill leaves 1 of the 2 a round needs)"),
        (["train", "--ft-replica", "0", *FT_TINY, *text], "--ft-replica needs --lighthouse ADDR or TORCHFT_LIGHTHOUSE"),
        (["train", *TINY, "--vote", "majority"], "argument --vote: invalid choice: 'majority'"),
        (["train", *TINY, "--link", "fast"], "--link: rate must be None, bits/s > 0, or like '1gbit'"),
        (["prepare", "--data", "/nonexistent.txt"], "data must be 'shakespeare' or a .txt file; got '/nonexistent.txt'"),
        (["prepare", "--data", str(d / "text.txt"), "--out", str(d / "a_file" / "tok")],
         "cannot write there (Not a directory)"),
        (["plot", "/nonexistent"], "'/nonexistent' has no metrics.jsonl"),
        (["plot", str(d / "run"), "-o", str(d / "a_file" / "loss.png")], "--output"),
        (["analyze", "--workers", "0"], "workers must be >= 1, got 0"),
    ]
    if not torch.cuda.is_available():
        cases.append((["train", *TINY, "--device", "cuda", *text],
                      "--device: device='cuda' was asked for but CUDA is not available"))
    return cases


def test_each_bad_input_is_one_argparse_line_naming_it(files, capsys):
    for argv, message in bad_inputs(files):
        with pytest.raises(SystemExit, match="2") as exc:
            main(argv)
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert exc.value.code == 2, (argv, err)
        assert last.startswith(f"lioncub {argv[0]}: error: ") and message in last, (argv, err)
        assert "Traceback" not in err, (argv, err)
