"""bench/memory.py (memory per rank under FakeTensorMode) on a 2-layer GPT of width 64 (vocabulary 256,
16 tokens) as rank 0 of 8 fake ranks, 2 replicas x 4 shards: the numbers each setup must give, exactly
where the layout fixes them (a fp32 parameter is 4 bytes; every dimension 0 of this GPT divides by 4, so
FSDP2's shards carry no padding).

The setups run in one subprocess, through the script's ``main`` as the command line does plus one
setup that fails on purpose: the fake process group is process-global, and the rest of the suite must
not see an initialised default group. What needs no group (the model's size, :class:`HostReads`, the
report) runs here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # ~25 s: every setup under FakeTensorMode in a subprocess; .ci/run runs it

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
LAYERS, D, VOCAB, SEQ, WORLD, REPLICAS, SHARDS = 2, 64, 256, 16, 8, 2, 4
SETUPS = ("adamw", "fsdp_adamw", "lioncub_onebit", "lioncub_pbit", "fsdp_lioncub_onebit", "localcub", "localcub_mean",
          "localcub_mean_host", "localcub_mean_delay1", "fsdp_localcub_mean", "fsdp_localcub_mean_host", "nodecub")
SLACK = 4096
"""Bytes allowed beyond a buffer's size for the small scalars an optimizer keeps beside it."""
WIDE = 512
"""The width of a second GPT (2 layers, 7.5M parameters: several of a round's chunks of 2^20 elements) on which
the LocalCub setups run too: there a round must hold a chunk, not the model."""
LOCAL = ("localcub", "localcub_mean", "localcub_mean_host", "localcub_mean_delay1", "fsdp_localcub_mean",
         "fsdp_localcub_mean_host")
ROUND_BYTES = {"localcub": 11, "localcub_mean": 17, "localcub_mean_host": 17, "localcub_mean_delay1": 20,
               "fsdp_localcub_mean": 17, "fsdp_localcub_mean_host": 17}
"""Bytes per element of a round's chunk at the round's peak (``rounds.py``'s ``Rounds.round_chunk``: "Δ, v, the
message and d of one chunk"), as measured: onebit's Δ (4; v is Δ without error feedback) and the finite check's
temporaries under the fake mode (7); the lane mean's Δ and v (8), q (4), the lanes (q + s, 4, and their bytes, 1);
streamed, also the mean of the round in flight (4), less its lanes (1 byte an element, freed there). Nothing of
the size of the model: one fp32 buffer of the model's size breaks every row's bound. With the outer state on the
host (``_host``) the same: a piece's copy of θ_s or e_i on the device is smaller than a chunk's buffers and freed
first."""

_SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from bench import memory
out = sys.argv[1]
memory.main(["--sizes", "{LAYERS}x{D}", "--vocab", "{VOCAB}", "--seq", "{SEQ}", "--world", "{WORLD}",
             "--shards", "{SHARDS}", "--optimizers", "{','.join(SETUPS)}", "--bf16", "{LAYERS}x{D}", "--out", out])

def broken(model, mesh, cfg):  # a setup the library refuses: its row carries the error and the line
    import lioncub
    return lioncub.LionCub(model.parameters(), aggregation="no-such-vote")

memory.SETUPS["broken"] = (None, broken, "a vote that does not exist")
rows = json.load(open(out))
rows.append(memory.measure("tiny", "broken", layers={LAYERS}, d={D}, vocab={VOCAB}, seq={SEQ}))
for name in {LOCAL!r}:  # the wide GPT: a round of several chunks
    rows.append(memory.measure("{LAYERS}x{WIDE}", name, layers={LAYERS}, d={WIDE}, vocab={VOCAB}, seq={SEQ},
                               world={WORLD}, replicas={REPLICAS}, shards={SHARDS}))
json.dump(rows, open(out, "w"))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "memory.json"
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    wide = f"{LAYERS}x{WIDE}"  # the wide GPT's rows as "name@2x512"
    return out, {r["optimizer"] + (f"@{wide}" if r["size"] == wide else ""): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def rows(run):
    return run[1]


def _gpt():
    sys.path.insert(0, str(ROOT))
    from bench import memory

    with torch.device("meta"):
        return memory, memory.GPT(LAYERS, D, VOCAB)


def test_the_model_has_the_parameters_its_formula_says():
    memory, model = _gpt()
    n = sum(p.numel() for p in model.parameters())  # the tied embedding once
    assert n == memory.gpt_params(LAYERS, D, VOCAB)
    for name, (low, high) in {"125M": (124e6, 126e6), "1.3B": (1.25e9, 1.35e9), "7B": (6.5e9, 7e9),
                              "70B": (64e9, 70e9)}.items():  # each size is what its name says
        assert low < memory.gpt_params(*memory.SIZES[name]) < high, name


def test_host_reads_answer_zero_and_real_tensors_keep_their_values():
    from torch._subclasses.fake_tensor import FakeTensorMode

    memory, _ = _gpt()
    real = torch.tensor([3, 4])
    reads = memory.HostReads()
    with FakeTensorMode(), reads:
        assert torch.ones(3, dtype=torch.int64).tolist() == [0, 0, 0]
        assert bool(torch.ones((), dtype=torch.bool)) is False
        assert torch.zeros(2).tolist() == [1.0, 1.0]  # floats answer 1.0: a step count or a scale
        assert (real + 1).tolist() == [4, 5]  # all-real tensors run as they are
    assert reads.reads == 3 + 1 + 2


def test_every_setup_runs_and_the_failing_one_names_the_library_line(rows):
    for name in SETUPS + ("fsdp_lioncub_onebit_bf16",):
        assert rows[name]["error"] is None, rows[name]
    broken = rows["broken"]
    assert broken["error"].startswith("ValueError") and "no-such-vote" in broken["error"], broken
    assert broken["raised_at"].startswith("lioncub/") and ".py:" in broken["raised_at"], broken


def test_parameters_and_gradients_are_four_bytes_each(rows):
    for name in SETUPS:
        r = rows[name]
        assert r["bytes"]["params"] == r["bytes"]["grads"] == 4 * r["local_params"], name
    bf16 = rows["fsdp_lioncub_onebit_bf16"]
    assert bf16["bytes"]["params"] == bf16["bytes"]["grads"] == 2 * bf16["local_params"]


def test_adamw_keeps_two_fp32_moments_and_a_step_count(rows):
    _, model = _gpt()
    tensors = len(list(model.parameters()))
    for name in ("adamw", "fsdp_adamw"):
        r = rows[name]
        n = r["local_params"]
        assert r["bytes"]["state"] == 8 * n + 4 * tensors, name  # exp_avg, exp_avg_sq; a fp32 step each
        assert r["bytes"]["kept"] == 0, name
        assert r["bytes"]["transient"] == 4 * n, name  # foreach AdamW: sqrt(exp_avg_sq), one temporary


def test_lioncub_keeps_one_momentum_and_at_most_one_message(rows):
    for name, message_bits in (("lioncub_onebit", 1), ("lioncub_pbit", 4), ("fsdp_lioncub_onebit", 1)):
        r = rows[name]
        n = r["local_params"]
        assert r["bytes"]["state"] == 4 * n, name  # one fp32 momentum per local parameter
        assert 0 < r["bytes"]["kept"] <= n * message_bits // 8 + SLACK, name  # pbit: 4-bit lanes for 8 voters
        assert r["bytes"]["transient"] < n, name  # under 1 byte per parameter
    bf16 = rows["fsdp_lioncub_onebit_bf16"]
    assert bf16["bytes"]["state"] == 2 * bf16["local_params"]  # the momentum in the parameters' dtype


def test_fsdp2_holds_one_shard_of_the_model(rows):
    _, model = _gpt()
    assert all(p.shape[0] % SHARDS == 0 for p in model.parameters())
    for fsdp, plain in (("fsdp_adamw", "adamw"), ("fsdp_lioncub_onebit", "lioncub_onebit")):
        assert rows[fsdp]["local_params"] * SHARDS == rows[plain]["local_params"] == rows[plain]["params"]
        for key in ("params", "grads"):
            assert rows[fsdp]["bytes"][key] * SHARDS == rows[plain]["bytes"][key], (fsdp, key)
    assert rows["fsdp_lioncub_onebit"]["bytes"]["state"] * SHARDS == rows["lioncub_onebit"]["bytes"]["state"]


def test_voters_are_the_replicas_under_fsdp2_and_the_world_without(rows):
    assert rows["fsdp_lioncub_onebit"]["voters"] == REPLICAS
    assert rows["lioncub_onebit"]["voters"] == rows["lioncub_pbit"]["voters"] == WORLD
    assert rows["nodecub"]["voters"] == WORLD // SHARDS  # one voter per node of S ranks


def test_localcub_and_nodecub_state(rows):
    local = rows["localcub"]
    assert local["bytes"]["state"] == 8 * local["local_params"]  # θ_s and the inner Lion's momentum
    for name, per_param in (("localcub_mean", 12), ("localcub_mean_delay1", 16), ("fsdp_localcub_mean", 12)):
        row = rows[name]  # + the residual (error feedback); + o_i, where the round in flight began (delay=1)
        assert row["bytes"]["state"] == per_param * row["local_params"], name
    streamed = rows["localcub_mean_delay1"]  # kept: the round's 8-bit lanes in flight, one byte an element
    assert streamed["local_params"] <= streamed["bytes"]["kept"] <= streamed["local_params"] + SLACK
    assert rows["fsdp_localcub_mean"]["local_params"] * SHARDS == rows["localcub_mean"]["local_params"]  # no padding
    for name in ("localcub_mean", "fsdp_localcub_mean"):  # outer_state='host': θ_s and e_i off the device
        device, host = rows[name], rows[f"{name}_host"]
        n = host["local_params"]
        assert host["bytes"]["state"] == 4 * n and host["bytes"]["host"] == 8 * n, name  # the inner Lion's momentum
        assert device["bytes"]["host"] == 0 and host["bytes"]["peak"] <= device["bytes"]["peak"] - 8 * n + SLACK, name
    node = rows["nodecub"]
    n = node["local_params"]
    assert 4 * n // SHARDS <= node["bytes"]["state"] < 4 * n  # rank 0's share of the momenta: at least 1/S


def test_the_peak_holds_everything_kept(rows):
    for name in SETUPS:
        b = rows[name]["bytes"]
        held = b["params"] + b["grads"] + b["state"]  # before the step (LocalCub's first round makes its `kept`)
        assert b["peak"] >= held + b["transient"] and b["peak"] >= held + b["kept"], name
        assert math.isclose(rows[name]["per_param"]["peak"], b["peak"] / rows[name]["local_params"], abs_tol=1e-3)


def test_a_rounds_transient_is_one_chunk_not_the_model(rows):
    """LocalCub's step that ends a round, and the round alone, hold at most :data:`ROUND_BYTES` per element of
    one chunk (a round's chunks: at most ``round_chunk`` elements and a 16th of the model, not below 2^20;
    the whole model when it is smaller): on the small GPT (one chunk) and on the wide one (several). The
    headroom under each bound is less than one fp32 buffer of the rank's parameters: a model-size temporary
    in a round fails here (bench/_fakemem.py's peaks hold ``peak >= after`` by construction: these do not)."""
    from tests.flat import LocalCub
    from lioncub.chunks import chunk_cap

    for name in LOCAL:
        for key in (name, f"{name}@{LAYERS}x{WIDE}"):
            r = rows[key]
            assert r["error"] is None, r
            n = r["local_params"]
            chunk = min(n, chunk_cap(n, LocalCub.round_chunk))
            bound = ROUND_BYTES[name] * chunk + SLACK
            assert 0 < r["round_transient"] <= bound, (key, r["round_transient"], bound, r["round_at"])
            assert r["bytes"]["transient"] <= bound, (key, r["bytes"]["transient"], bound, r["transient_at"])
            assert bound - r["round_transient"] < 4 * n, key  # (the bound is tight enough to see a model-size buffer)
        wide = rows[f"{name}@{LAYERS}x{WIDE}"]["local_params"]
        assert wide > chunk_cap(wide, LocalCub.round_chunk), name  # the wide GPT's round: more than one chunk
    assert rows[f"localcub@{LAYERS}x{WIDE}"]["local_params"] >= 7 * (1 << 20)  # replicated: 7 chunks and more


def test_report_only_rebuilds_the_table(run, tmp_path):
    out, rows = run
    memory, _ = _gpt()
    md = out.with_suffix(".md")
    written = md.read_text()
    again = tmp_path / "again.md"
    assert memory.main(["--report-only", "--out", str(out), "--md", str(again)]) == 0
    table = again.read_text()
    sizes = (f"| {LAYERS}x{D} |", f"| {LAYERS}x{WIDE} |", "| tiny |")
    lines = [ln for ln in table.splitlines() if ln.startswith(sizes)]
    assert len(lines) == len(rows)  # one line per row, the failed one (added after the script wrote) included
    assert {ln for ln in written.splitlines() if ln.startswith(f"| {LAYERS}x{D} |")} <= set(lines)
    assert "error at lioncub/" in table
