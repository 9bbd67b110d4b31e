"""The paper's instruments on a tiny GPT trained with LionCub on 4 gloo workers (CPU, loopback).

Trains ``gpt-tiny`` (untied embeddings by default) with 4-bit Lion Cub and no momentum
sync on disjoint shards of the harness's Shakespeare text (random tokens if the corpus
is not installed; the JSON says which), and measures along the way:

* the tie rate of the vote, overall and per layer (every ``tie_every`` steps);
* every ``every`` steps (:func:`lioncub.instruments.analyze`): the distribution of c
  (Fig. 3), sign match / flip / zero per quantizer and bit width (Fig. 4), per-layer
  momentum std across workers (Fig. 6), and the adaptive policy's sketched divergence
  beside the exact one (which tensors would it sync?);
* then a second run with ``momentum_sync=Adaptive(threshold)`` that counts which tensors
  the adaptive policy actually averaged and what it cost.

Writes ``instruments.json``, CSVs and PNGs into ``--out``. Usage::

    PYTHONPATH=src python3 examples/instruments_gpt.py --steps 300 --out docs/figures/instruments

The same as ``lioncub analyze``: a thin wrapper of :mod:`lioncub.harness.analyze`, where
``AnalyzeConfig``, ``run(config)`` and ``main(argv)`` live.
"""
from __future__ import annotations

import argparse
import json
import sys

from lioncub.harness.analyze import AnalyzeConfig, add_arguments, config_from_args, main, run, write_outputs

__all__ = ["AnalyzeConfig", "main", "run", "write_outputs"]


def script(argv: list[str] | None = None) -> int:
    """``lioncub analyze``, printing the measured run's loss as it fell before the summary."""
    parser = argparse.ArgumentParser(description="the paper's instruments on a tiny GPT")
    add_arguments(parser)
    try:
        cfg = config_from_args(parser.parse_args(argv))
    except ValueError as exc:
        parser.error(str(exc))
    result = run(cfg)
    losses = result["measured"]["loss"]
    stride = max(1, len(losses) // 6)
    for record in losses[::stride] + ([losses[-1]] if (len(losses) - 1) % stride else []):
        print(f"step {record['step']} loss {record['loss']:.4f}")
    print(json.dumps(result["summary"], indent=1, default=float))
    print(f"wrote {cfg.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(script())
