"""Smoke tests of the benchmark scripts that produce headline tables (bench/*.py).

Each script runs in a subprocess at tiny sizes (seconds), ``OMP_NUM_THREADS=1``,
``PYTHONPATH=src``, its JSON written under ``tmp_path``; the test checks that the JSON
has the structure the script's docstring and table promise: a row per method, positive
times, parts that add up, and byte counts that agree with the α-β model where the
script reports both. Nothing here checks performance.

The emulated-cluster scripts (step_time, nodes, net_probe, overlap on the testbed) need
root and network namespaces: they are marked ``root`` (tests/conftest.py skips them
without it, fails them under ``LIONCUB_REQUIRE=root``) and check that every namespace
the script created is gone afterwards.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
TINY_GPT = ["--layers", "1", "--embd", "64", "--vocab", "256", "--tokens", "8"]  # n_head=8 divides 64


def _bench(script: str, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``bench/<script>`` as bench/README.md does: ``python3 -m bench.<name>`` from the root."""
    proc = subprocess.run([sys.executable, "-m", f"bench.{Path(script).stem}", *map(str, args)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def netns_clean():
    """Yields a checker: ``check(prefix)`` asserts no namespace ``{prefix}-*`` outlived the script
    (only the script's own prefix: other tests may hold namespaces of their own meanwhile)."""
    require("root")
    before = _namespaces()

    def check(prefix: str) -> None:
        left = sorted(ns for ns in _namespaces() - before if ns.startswith(prefix + "-"))
        assert not left, f"namespaces left behind: {left}"

    return check


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _nonneg(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def _wire_matches_model(wire: float, model: float, what: str) -> None:
    # the veth counter counts headers, acks and the odd barrier on top of the payload the model counts
    assert 0.98 * model <= wire <= 1.6 * model + 8192, f"{what}: wire {wire:.0f} B vs model {model:.0f} B"


# --- emulated cluster (root) -----------------------------------------------------------------


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
@pytest.mark.root
def test_step_time(tmp_path, netns_clean):
    from bench import step_time as st
    out = tmp_path / "step_time.json"
    proc = _bench("step_time.py", "--workers", "2", "--rates", "1gbit", "--steps", "1", "--warmup", "1",
                  *TINY_GPT, "--out", out)
    netns_clean("lcs")
    data = json.loads(out.read_text())
    assert (tmp_path / "step_time.png").stat().st_size > 0
    assert data["args"]["workers"] == 2 and len(data["results"]) == 1
    res = data["results"][0]
    assert res["rate"] == "1gbit" and res["rate_bps"] == pytest.approx(1e9) and res["workers"] == 2
    assert res["beta"] == pytest.approx(1e-9) and _nonneg(res["alpha"]) and _pos(res["calibrate_beta"])
    labels = [label for label, _ in st.METHODS]
    assert [r["method"] for r in res["rows"]] == labels
    n = res["rows"][0]["n"]
    assert n > 0
    by = {r["method"]: r for r in res["rows"]}
    for r in res["rows"]:
        assert r["n"] == n, r["method"]
        for k in ("step", "compute", "compute_max", "model_s", "ideal_s", "ideal_own_compute_s",
                  "speedup_fp32", "speedup_bf16", "wire_bytes", "model_bytes"):
            assert _pos(r[k]), (r["method"], k, r[k])
        for k in ("pack", "collective", "unpack", "apply"):
            assert _nonneg(r[k]), (r["method"], k, r[k])
        # the parts are the split of the step (``other`` is the remainder)
        assert sum(r[p] for p in st.PARTS) == pytest.approx(r["step"], rel=1e-6, abs=1e-9)
        assert r["compute_max"] >= r["compute"]
        assert r["speedup_fp32"] == pytest.approx(by["lion fp32"]["step"] / r["step"])
        assert r["speedup_bf16"] == pytest.approx(by["lion bf16"]["step"] / r["step"])
        _wire_matches_model(r["wire_bytes"], r["model_bytes"], r["method"])
    assert by["lion fp32"]["speedup_fp32"] == pytest.approx(1.0)
    # the compressed votes send less than the fp32 allreduce, the 1-bit ones the least
    assert by["lion bf16"]["model_bytes"] < by["lion fp32"]["model_bytes"]
    for m in ("sign int8", "gather 1-bit", "onebit", "pbit 4", "pbit 8 l1"):
        assert by[m]["wire_bytes"] < by["lion fp32"]["wire_bytes"], m
    assert set(res["measured_gamma"]) == {"sign_allreduce", "gather", "onebit", "pbit"}
    assert set(res["auto"]) == {"default_gamma", "measured_gamma", "costs_measured_gamma"}
    assert len(res["per_rank"]) == 2
    assert "auto picks" in proc.stdout and "adamw fp32" in proc.stdout


@pytest.mark.slow  # 4 ranks x 9 methods: ~8-10 s on 2 shared cores
@pytest.mark.root
def test_nodes(tmp_path, netns_clean):
    out = tmp_path / "nodes.json"
    _bench("nodes.py", "--steps", "1", "--warmup", "1", *TINY_GPT, "--out", out)
    netns_clean("lcn")
    res = json.loads(out.read_text())["result"]
    assert (res["workers"], res["nodes"], res["rate"]) == (4, 2, "1gbit")
    votes, layouts = ("lion fp32", "onebit", "pbit"), ("flat", "nodes", "nodes all")
    assert [r["method"] for r in res["rows"]] == [f"{v} {lay}" for v in votes for lay in layouts]
    by = {r["method"]: r for r in res["rows"]}
    for r in res["rows"]:
        for k in ("step", "compute_max", "node_tx_bytes", "speedup_vs_lion_fp32_flat"):
            assert _pos(r[k]), (r["method"], k, r[k])
        assert r["n"] == res["rows"][0]["n"] > 0
        assert r["compute_max"] <= r["step"] * 1.5 + 0.05  # (compute_max may be another rank's)
        assert r["speedup_vs_lion_fp32_flat"] == pytest.approx(by["lion fp32 flat"]["step"] / r["step"])
    # only what crosses nodes is counted: the fp32 payload is at least ~4n/2 per node (half the ring)
    n = res["rows"][0]["n"]
    assert by["lion fp32 flat"]["node_tx_bytes"] >= 4 * n * 0.9
    for v in ("onebit", "pbit"):  # the compressed votes send less across nodes than fp32
        for lay in layouts:
            assert by[f"{v} {lay}"]["node_tx_bytes"] < by["lion fp32 flat"]["node_tx_bytes"], (v, lay)
    # NodeCub shards: each rank votes on half the model, so a node sends less than with shard=False
    assert by["lion fp32 nodes"]["node_tx_bytes"] < by["lion fp32 nodes all"]["node_tx_bytes"]
    assert len(res["per_rank"]) == 4


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
@pytest.mark.root
def test_net_probe(tmp_path, netns_clean):
    out = tmp_path / "net_probe.json"
    sizes = [0.25, 1.0]
    _bench("net_probe.py", "--workers", "2", "--rates", "1gbit,none", "--sizes-mib", "0.25,1", "--repeats", "1",
           "--out", out)
    netns_clean("lcbprobe")
    data = json.loads(out.read_text())
    assert data["sizes_mib"] == sizes and data["repeats"] == 1
    assert [r["rate"] for r in data["results"]] == ["1gbit", "unshaped"]
    shaped, unshaped = data["results"]
    assert shaped["rate_bps"] == pytest.approx(1e9) and unshaped["rate_bps"] is None
    for res in data["results"]:
        assert res["workers"] == 2 and [r["mib"] for r in res["rows"]] == sizes
        for k in ("calibrate_beta_s_per_bit", "calibrate_gbit_s", "wall_s"):
            assert _pos(res[k]), (res["rate"], k)
        assert _nonneg(res["calibrate_alpha_s"]) and _nonneg(res["barrier_tx_bytes"])
        for r in res["rows"]:
            # ring allreduce: 2(P-1)/P · B sent per worker, B = MiB of fp32
            assert r["model_bytes"] == pytest.approx(2 * (2 - 1) / 2 * r["mib"] * 2**20)
            assert _pos(r["seconds"]) and _pos(r["bus_gbit_s"])
            assert r["bus_gbit_s"] == pytest.approx(r["model_bytes"] * 8 / r["seconds"] / 1e9)
            _wire_matches_model(r["wire_tx_bytes"], r["model_bytes"], f"{res['rate']} {r['mib']} MiB tx")
            _wire_matches_model(r["wire_rx_bytes"], r["model_bytes"], f"{res['rate']} {r['mib']} MiB rx")
            assert r["wire_ratio"] == pytest.approx(r["wire_tx_bytes"] / r["model_bytes"])
            if res["rate_bps"] is None:
                assert r["model_seconds"] is None and r["time_ratio"] is None
            else:
                assert r["model_seconds"] == pytest.approx(r["model_bytes"] * 8 / res["rate_bps"])
                assert r["time_ratio"] == pytest.approx(r["seconds"] / r["model_seconds"])


def _check_overlap(data: dict, methods: list[str], buckets: list[float]) -> None:
    rows = data["rows"]
    assert [(r["method"], r["bucket_mb"]) for r in rows] == [(m, b) for m in methods for b in buckets]
    for r in rows:
        for k in ("compute", "comm", "no_overlap", "overlap", "ideal", "serial", "speedup"):
            assert _pos(r[k]), (r["method"], r["bucket_mb"], k, r[k])
        assert r["n_buckets"] >= 1 and r["n"] > 0
        assert r["ideal"] == pytest.approx(max(r["compute"], r["comm"]))
        assert r["serial"] == pytest.approx(r["compute"] + r["comm"])
        assert r["rest"] == pytest.approx(r["no_overlap"] - r["serial"])
        assert r["speedup"] == pytest.approx(r["no_overlap"] / r["overlap"])
        assert r["recovered"] == pytest.approx((r["no_overlap"] - r["overlap"]) / min(r["compute"], r["comm"]))
    for m in methods:  # a smaller bucket_mb splits the same model into at least as many buckets
        nb = [r["n_buckets"] for r in rows if r["method"] == m]
        assert nb == sorted(nb, reverse=True) and nb[0] > 1, (m, nb)
    assert len(data["per_rank"]) == data["workers"] == 2


OVERLAP_TINY = ["--workers", "2", "--buckets", "0.05,1", "--rounds", "1", "--warmup", "1", *TINY_GPT]


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
@pytest.mark.root
def test_overlap_testbed(tmp_path, netns_clean):
    out = tmp_path / "overlap.json"
    _bench("overlap.py", *OVERLAP_TINY, "--out", out)
    netns_clean("lco")
    data = json.loads(out.read_text())
    assert data["where"].startswith("netem testbed, 2 workers, 1gbit")
    _check_overlap(data, ["pbit 4", "onebit"], [0.05, 1.0])


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
def test_overlap_loopback(tmp_path):
    out = tmp_path / "overlap.json"
    _bench("overlap.py", "--loopback", *OVERLAP_TINY, "--methods", "pbit 4", "--out", out)
    data = json.loads(out.read_text())
    assert data["where"].startswith("LOOPBACK")
    _check_overlap(data, ["pbit 4"], [0.05, 1.0])


# --- loopback gloo groups and single-process kernels (no root) ---------------------------------


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
def test_soak(tmp_path):
    out = tmp_path / "soak.json"
    steps, nan_every = 60, 20
    proc = _bench("soak.py", "--world", "2", "--steps", steps, "--warmup", "10", "--nan-every", nan_every,
                  "--check-every", "10", "--growth-limit-mib", "64", "--out", out)
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["replicas_identical"] is True and s["skipped_steps_agree"] is True and s["memory_flat"] is True
    assert _pos(s["wall_s"]) and math.isfinite(s["max_peak_growth_mib"])
    assert data["config"]["steps"] == steps and data["config"]["world"] == 2
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        # one NaN every nan_every steps, on one rank: every rank skips those steps together
        assert r["skipped_steps"] == steps // nan_every
        assert r["steps_done"] + r["skipped_steps"] == steps
        assert r["replicas_identical"] is True and r["n_buckets"] > 1 and r["n_params"] > 0
        assert _pos(r["step_ms_median"]) and r["step_ms_p99"] >= r["step_ms_median"]
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
        for key in ("mem_start", "mem_end"):
            assert _pos(r[key]["rss_mib"]) and r[key]["peak_mib"] >= r[key]["rss_mib"]
        assert r["mem_end"]["peak_mib"] >= r["mem_start"]["peak_mib"]
    assert "replicas identical: True" in proc.stdout


def test_vote_bench(tmp_path):
    out = tmp_path / "vote_bench.json"
    n = 100_000
    proc = _bench("vote_bench.py", "--n", n, "--world", "2", "--reps", "1", "--out", out)
    data = json.loads(out.read_text())
    assert (data["n"], data["world"], data["reps"]) == (n, 2, 1)
    labels = ["grad fp32 allreduce", "grad bf16 allreduce", "sign_allreduce int8", "gather 1-bit",
              "onebit all_to_all", "pbit binary (4-bit lanes)", "pbit l1 8-bit lanes"]
    assert [r["method"] for r in data["rows"]] == labels
    by = {r["method"]: r for r in data["rows"]}
    for r in data["rows"]:
        assert _pos(r["total_s"]) and _pos(r["collective_s"]), r["method"]
        assert _nonneg(r["quantize_pack_s"]) and _nonneg(r["unpack_vote_s"]), r["method"]
        # each part is the slowest rank's, maybe not the rank with the slowest total: part by part
        for k in ("quantize_pack_s", "collective_s", "unpack_vote_s"):
            assert r[k] <= r["total_s"], (r["method"], k)
        # our accounting of the bytes sent is the α-β model's
        assert _pos(r["bytes_sent"]) and r["bytes_sent"] == pytest.approx(r["model_bytes"], rel=0.01), r["method"]
    fp32 = by["grad fp32 allreduce"]["bytes_sent"]
    assert fp32 == pytest.approx(2 * (2 - 1) / 2 * 4 * n, rel=0.01)  # ring: 2(P-1)/P · 4n B
    expect = {"grad bf16 allreduce": 2, "sign_allreduce int8": 4, "gather 1-bit": 32, "onebit all_to_all": 32,
              "pbit binary (4-bit lanes)": 16, "pbit l1 8-bit lanes": 4}  # fp32 / bytes at P = 2
    for m, ratio in expect.items():
        assert fp32 / by[m]["bytes_sent"] == pytest.approx(ratio, rel=0.02), m
    assert f"n={n:,} elements" in proc.stdout


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
def test_opt_step(tmp_path):
    out = tmp_path / "opt_step.json"
    proc = _bench("opt_step.py", "--steps", "1", "--layers", "1", "--embd", "96", "--vocab", "256", "--out", out)
    data = json.loads(out.read_text())
    assert list(data) == ["grad fp32", "onebit", "gather", "pbit4", "pbit8 l1", "sign int8", "onebit mean"]
    for label, v in data.items():
        assert set(v) == {"step", "pack", "coll", "unpack", "apply"}, label
        assert _pos(v["step"]), label
        assert all(_nonneg(v[k]) for k in ("pack", "coll", "unpack", "apply")), (label, v)
        # the parts are timed inside the step (``other`` = the rest: never negative beyond timer noise)
        assert v["pack"] + v["coll"] + v["unpack"] + v["apply"] <= v["step"] * 1.01 + 1e-6, (label, v)
    assert f"wrote {out}" in proc.stdout


def test_kernels(tmp_path):
    from lioncub import fused

    out = tmp_path / "kernels.json"
    mib, world = 0.25, 4
    _bench("kernels.py", "--mib", mib, "--world", world, "--repeats", "1", "--out", out)
    data = json.loads(out.read_text())
    n = int(mib * 2**20) // 4
    assert (data["n"], data["world"], data["threads"]) == (n, world, 1)
    base = ["quantize+pack 1-bit", "quantize+pack 4-bit", "vote 1-bit x P -> int8", "vote 1-bit x P -> fp32",
            "onebit vote (chunk)", "onebit unpack -> int8", "onebit unpack -> fp32", "vote 4-bit -> int8",
            "vote 4-bit -> fp32"]
    fused_rows = ["fused encode m,g -> 1-bit", "fused encode m,g -> 4-bit", "fused apply from bits",
                  "fused apply from int8 u", "fused c m,g -> fp32", "fused L1 lanes c -> 8-bit"]
    # (the subprocess builds or finds the same cached fused loops as this process)
    assert [r["stage"] for r in data["rows"]] == base + (fused_rows if fused.available() else [])
    chunk = -(-n // (8 * world)) * 8
    for r in data["rows"]:
        assert r["bytes"] in (n, 4 * n, world * chunk // 8), r
        for k in ("gbps", "old_gbps", "copy_gbps", "frac_of_copy", "old_frac_of_copy", "speedup"):
            assert _pos(r[k]), (r["stage"], k, r[k])
        assert r["speedup"] == pytest.approx(r["gbps"] / r["old_gbps"])
        assert r["frac_of_copy"] == pytest.approx(r["gbps"] / r["copy_gbps"])
        assert r["old_frac_of_copy"] == pytest.approx(r["old_gbps"] / r["copy_gbps"])
    by = {r["stage"]: r for r in data["rows"]}
    assert by["vote 1-bit x P -> int8"]["bytes"] == n and by["vote 1-bit x P -> fp32"]["bytes"] == 4 * n


# --- the scripts behind hand-assembled result files (issue 36, item 5) --------------------------


def _committed(name: str) -> dict:
    return json.loads((BENCH / "results" / name).read_text())


def test_nodes_convergence_dry_run_is_the_committed_command():
    lines = _bench("nodes_convergence.py", "--dry-run").stdout.splitlines()
    assert lines[0] == _committed("nodes_convergence.json")["command"]
    runs = [(r["vote"], r["nodes"]) for r in _committed("nodes_convergence.json")["runs"]]
    assert lines[1:] == [lines[0].replace("{onebit,pbit}", v).replace("{1,2}", str(n)) for v, n in runs]


@pytest.mark.slow  # two 4-rank lioncub train runs: ~30 s on 2 shared cores
def test_nodes_convergence_tiny(tmp_path):
    out = tmp_path / "nc.json"
    _bench("nodes_convergence.py", "--model", "gpt-tiny", "--steps", "2", "--eval-every", "1", "--eval-batches",
           "1", "--votes", "pbit", "--nodes", "1,2", "--out", out, timeout=300)
    data, committed = json.loads(out.read_text()), _committed("nodes_convergence.json")
    assert list(data) == list(committed) and data["command"].endswith("--vote {pbit} --nodes {1,2} --nproc 4 "
                                                                      "--eval-every 1 --eval-batches 1 --no-compare --seed 0")
    assert [(r["label"], r["vote"], r["nodes"]) for r in data["runs"]] == [("lioncub-pbit", "pbit", 1),
                                                                           ("lioncub-pbit-2nodes", "pbit", 2)]
    for r in data["runs"]:
        assert list(r) == list(committed["runs"][0])
        assert [e["step"] for e in r["evals"]] == [1, 2]
        assert r["final_val_loss"] == r["evals"][-1]["val_loss"]  # the summary's, exactly
    flat, nodes = data["runs"]
    # 2 voters (one per node) instead of 4: narrower lanes, and a rank votes on its half of the model
    assert 0 < nodes["bytes_sent_per_step"] < flat["bytes_sent_per_step"] / 2


def _flags(line: str) -> dict:
    words = line.split()
    return {w[2:].replace("-", "_"): v for w, v in zip(words, words[1:]) if w.startswith("--")}


def test_local_grid_dry_run_is_the_committed_grids():
    lines = _bench("local_grid.py", "--dry-run").stdout.splitlines()
    grids = _committed("local_grid.json")["grids"]
    assert len(lines) == len(grids) == 3
    for line, grid in zip(lines, grids):
        assert line.startswith("python3 -m bench.race ")
        flags, recorded = _flags(line), grid["args"]
        for key in ("methods", "lr_adamw", "lr_lion", "rate", "steps", "eval_batches", "warmup", "workers",
                    "layers", "heads", "embd", "block", "batch"):
            assert flags[key] == str(recorded[key]), (grid["name"], key)
        assert float(flags["eval_every"]) == recorded["eval_every"] and int(flags["seeds"]) == recorded["seed"]
        assert grid["name"].startswith(f"grid{lines.index(line) + 1} ")


@pytest.mark.slow  # a bench script's tiny run (~5-7 s): .ci/run runs it after the suite
@pytest.mark.root
def test_local_grid_tiny(tmp_path, netns_clean):
    out = tmp_path / "grid.json"
    _bench("local_grid.py", "--grids", "grid3", "--steps", "2", "--workers", "2", "--layers", "1", "--embd", "32",
           "--block", "16", "--batch", "1", "--out", out, timeout=300)
    netns_clean("lct")
    data, committed = json.loads(out.read_text()), _committed("local_grid.json")
    assert list(data) == list(committed) and len(data["grids"]) == 1
    grid = data["grids"][0]
    assert grid["name"] == committed["grids"][2]["name"]
    assert grid["args"]["steps"] == 2 and grid["args"]["methods"] == committed["grids"][2]["args"]["methods"]
    assert [r["method"] for r in grid["runs"]] == committed["grids"][2]["args"]["methods"].split(",")
    for r in grid["runs"]:
        assert set(committed["grids"][2]["runs"][0]) <= set(r) and r["status"] == "ok"
        assert r["steps"] == 50 and r["evals"][-1]["step"] == 50  # H = 50: the first sync point at or after 2
        assert set(r["evals"][-1]) == set(committed["grids"][2]["runs"][0]["evals"][-1])
    # the grad vote with an AdamW inner loop is DiLoCo (the grid's sanity check), bit for bit
    by = {r["method"]: r["evals"][-1]["val"] for r in grid["runs"]}
    assert by["lcub-grad-h50-nest0.7-adamw"] == by["diloco-h50"]
