"""The public API (docs/api.md): two classes, the aggregation objects, Options; README's "Which one do I use".

* every README row's line runs on a real 2-rank gloo group and leaves the replicas identical;
* the public classes take at most 12 keyword arguments each, and exactly the ones listed here;
* each aggregation object builds exactly the engine settings its docstring names, and runs bit for bit as the
  engine built from those settings directly (an independent path: ``engine_lioncub`` / ``LocalCub._configure``);
* every refusal is one line naming the object's field or the argument.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import lioncub
from lioncub import LaneMean, Mean, OneBitMean, Options, Outer, ScatterMean, SignVote, Streaming
from tests.dist import run_workers

ROOT = Path(__file__).resolve().parents[1]


def readme_rows() -> list[tuple[str, str]]:
    """(situation, code) of each row of README's "Which one do I use" table."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Which one do I use"):]
    section = section[:section.index("\n## ", 5)]
    rows = re.findall(r"^\| (.+?) \| `(.+)` \|$", section, re.M)
    return [(what, code) for what, code in rows if what != "situation"]


def test_the_readme_table_has_at_most_six_rows_of_one_line_each():
    rows = readme_rows()
    assert 4 <= len(rows) <= 6, rows
    assert all("\n" not in code and code.startswith("opt = lioncub.") for _, code in rows), rows


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _rows_worker(rank, world):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lioncub.ddp.hook import register

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # node_groups(): 2 nodes of one rank each
    out = []
    for what, code in readme_rows():
        model = _model()
        ns = dict(lioncub=lioncub, model=model, register=register, fully_shard=fully_shard)
        if "mesh" in code:
            ns["mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        if "ddp_model" in code:
            ns["ddp_model"] = model = DDP(model)
        exec(code, ns)
        opt = ns["opt"]
        g = torch.Generator().manual_seed(rank)
        for _ in range(getattr(opt, "H", 10)):  # LocalCub: its first round (10 steps; 'auto' here: its floor, 50)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        flat = torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                          for p in model.parameters()])
        got = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(got, flat)
        out.append(dict(row=what, cls=type(opt).__name__, identical=all(torch.equal(got[0], t) for t in got),
                        moved=not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in _model().parameters()])),
                        synced=getattr(opt, "synced", None)))
    return out


def test_every_readme_row_runs_on_gloo_and_keeps_the_replicas_identical():
    results = run_workers(_rows_worker, 2, timeout_s=240)
    rows = results[0]
    assert len(rows) == len(readme_rows())
    for r in rows:
        assert r["identical"] and r["moved"], r
        assert r["synced"] in (None, True), r  # LocalCub: its first round ended
    classes = [r["cls"] for r in rows]
    assert classes.count("NodeCub") == 1 and "LocalCub" in classes and "LionCub" in classes, classes


# ----------------------------------------------------------------------------------------------- signatures
def _keywords(cls) -> list[str]:
    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]


def test_the_public_classes_take_at_most_twelve_keyword_arguments():
    assert _keywords(lioncub.LionCub) == ["lr", "betas", "weight_decay", "aggregation", "process_group", "manager",
                                          "overlap", "model", "options"]
    assert _keywords(lioncub.LocalCub) == ["lr", "betas", "weight_decay", "local_steps", "aggregation", "inner",
                                           "outer", "streaming", "process_group", "manager", "model", "options"]
    assert all(len(_keywords(c)) <= 12 for c in (lioncub.LionCub, lioncub.LocalCub))


def test_the_defaults_are_the_recommended_settings():
    sig = inspect.signature(lioncub.LionCub.__init__).parameters
    assert sig["aggregation"].default == "onebit-mean"
    sig = inspect.signature(lioncub.LocalCub.__init__).parameters
    assert (sig["local_steps"].default, sig["aggregation"].default, sig["inner"].default, sig["outer"].default) == (
        5, ScatterMean(bits=2), "adamw", "sgd")
    assert LaneMean() == LaneMean(bits=8, error_feedback=True) and ScatterMean().bits == 4


# ------------------------------------------------------------------------------- the objects' engine settings
@pytest.mark.parametrize("agg, want", [
    (Mean(), dict(vote="grad", grad_dtype="fp32")),
    (Mean("bf16"), dict(vote="grad", grad_dtype="bf16")),
    (SignVote(), dict(vote="pbit", bits=None, quantizer=None, tie="alternate", error_feedback="none",
                      stochastic_signs=False)),
    (SignVote("onebit", tie="hold", error_feedback="both"), dict(vote="onebit", bits=None, quantizer=None, tie="hold",
                                                                  error_feedback="both", stochastic_signs=False)),
    (OneBitMean(), dict(vote="onebit", aggregate="mean", tie="alternate", mean_adapt=1.25, mean_range=30.0,
                        mean_norm="arithmetic", mean_restart=50)),
])
def test_an_every_step_aggregation_is_exactly_its_settings(agg, want):
    assert agg.for_step() == want


@pytest.mark.parametrize("agg, want", [
    (Mean(), dict(vote="grad")),
    (SignVote("onebit", error_feedback="worker"), dict(vote="onebit", bits=None, quantizer=None, tie="alternate",
                                                       error_feedback=True)),
    (LaneMean(), dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean", error_feedback=True)),
    (LaneMean(4, error_feedback=False), dict(vote="pbit", bits=4, quantizer="l1", aggregate="mean",
                                             error_feedback=False)),
    (ScatterMean(2), dict(vote="onebit", bits=2, aggregate="mean", error_feedback=True)),
])
def test_a_round_aggregation_is_exactly_its_settings(agg, want):
    assert agg.for_round() == want


def _side_by_side(pairs, rank: int, steps: int) -> bool:
    """``steps`` steps of each (model, optimizer) pair on the same batches; whether the models end equal."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        for m, o in pairs:
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    (a, _), (b, _) = pairs
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _same_bits_worker(rank, world):
    from lioncub.optim.lioncub import engine_lioncub

    cases = [(OneBitMean(), dict(vote="onebit", aggregate="mean")), (SignVote(), dict(vote="pbit")),
             (SignVote("onebit", error_feedback="server"), dict(vote="onebit", error_feedback="server")),
             (Mean("bf16"), dict(vote="grad", grad_dtype="bf16"))]
    out = []
    for agg, flat in cases:
        a, b = _model(), _model()
        opt_a = lioncub.LionCub(a.parameters(), lr=1e-2, weight_decay=0.1, aggregation=agg,
                                options=Options(bucket_mb=0.0005))
        opt_b = engine_lioncub(list(b.parameters()), 1e-2, (0.9, 0.99), 0.1, bucket_mb=0.0005, **flat)
        out.append(_side_by_side([(a, opt_a), (b, opt_b)], rank, 5))
    rounds = [(dict(aggregation=ScatterMean(2), outer=Outer("nesterov", lr=0.7), streaming=Streaming(2, eager=True)),
               dict(vote="onebit", aggregate="mean", bits=2, error_feedback=True, outer="nesterov", outer_lr=0.7,
                    delay=1, fragments=2, eager=True, inner="adamw")),
              (dict(), dict(vote="onebit", bits=2, aggregate="mean", error_feedback=True, inner="adamw")),
              (dict(aggregation=LaneMean()), dict(vote="pbit", bits=8, quantizer="l1", aggregate="mean",
                                                  error_feedback=True, inner="adamw"))]
    for public, flat in rounds:
        a, b = _model(), _model()
        opt_a = lioncub.LocalCub(a.parameters(), lr=1e-2, local_steps=4, **public)
        opt_b = torch.optim.Optimizer.__new__(lioncub.LocalCub)
        opt_b._configure(list(b.parameters()), 1e-2, local_steps=4, **flat)
        out.append(_side_by_side([(a, opt_a), (b, opt_b)], rank, 9))
    return out


def test_the_objects_run_bit_for_bit_as_the_engine_built_from_their_settings():
    """The public constructor against the engine built from the flat settings directly, 3 ranks: a wrong
    translation (a field dropped, a default changed) moves a bit."""
    for got in run_workers(_same_bits_worker, 3):
        assert got == [True] * 7, got


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("make, match", [
    (lambda: LaneMean(bits=3), r"LaneMean.bits must be None or one of \(2, 4, 8\), got 3"),
    (lambda: ScatterMean(bits=3), r"ScatterMean.bits must be one of \(1, 2, 4, 8\), got 3"),
    (lambda: SignVote("pbit", bits=16), r"SignVote.bits must be None or one of"),
    (lambda: SignVote("onebit", bits=4), r"SignVote.bits is the lane width of transport='pbit'"),
    (lambda: SignVote("morse"), r"SignVote.transport must be one of"),
    (lambda: SignVote(error_feedback="owner"), r"SignVote.error_feedback must be one of"),
    (lambda: OneBitMean(adapt=0.5), r"OneBitMean.adapt must be a finite number >= 1"),
    (lambda: OneBitMean(tie="hold"), r"OneBitMean.tie must be one of"),
    (lambda: Mean("fp16"), r"Mean.dtype must be one of"),
    (lambda: Outer("adam"), r"Outer.rule must be one of"),
    (lambda: Streaming(0), r"Streaming.fragments must be an int >= 1"),
    (lambda: OneBitMean().for_round(), r"OneBitMean shares a momentum across every step; for local steps use"),
    (lambda: ScatterMean().for_step(), r"ScatterMean averages a round's Δ; every step use OneBitMean"),
    (lambda: LaneMean().for_step(), r"LaneMean averages a round's Δ; every step use OneBitMean"),
    (lambda: Mean("bf16").for_round(), r"a round averages Δ in fp32"),
    (lambda: SignVote("onebit", error_feedback="server").for_round(), r"SignVote.error_feedback='server'"),
    (lambda: SignVote(stochastic_signs=True).for_round(), r"SignVote.stochastic_signs"),
    (lambda: SignVote("onebit", tie="hold").for_round(), r"SignVote.tie='hold'"),
    (lambda: SignVote("gather", error_feedback="server").for_step(), r"error_feedback='server' needs chunk owners"),
])
def test_each_object_refuses_in_one_line_naming_its_field(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make()
    assert "\n" not in str(err.value)


def _refusal_worker(rank, world):
    p = [torch.nn.Parameter(torch.zeros(4))]
    out = {}
    for key, make in {
        "string": lambda: lioncub.LionCub(p, aggregation="vote"),
        "type": lambda: lioncub.LocalCub(p, aggregation=dict(bits=4)),
        "round_on_step": lambda: lioncub.LionCub(p, aggregation=ScatterMean()),
        "step_on_round": lambda: lioncub.LocalCub(p, aggregation=OneBitMean()),
        "option_step": lambda: lioncub.LionCub(p, options=Options(outer_state="host")),
        "option_round": lambda: lioncub.LocalCub(p, options=Options(bucket_mb=1.0)),
        "attempts": lambda: lioncub.LocalCub(p, options=Options(max_attempts=3)),
        "options_type": lambda: lioncub.LionCub(p, options=dict(seed=1)),
        "streaming": lambda: lioncub.LocalCub(p, streaming="yes"),
        "outer": lambda: lioncub.LocalCub(p, outer=0.7),
        "node_overlap": lambda: lioncub.LionCub(p, process_group=lioncub.node_groups(1), overlap=True),
    }.items():
        try:
            make()
            out[key] = None
        except (ValueError, TypeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def test_the_constructors_refuse_in_one_line_naming_the_argument():
    out = run_workers(_refusal_worker, 2)[0]
    want = {
        "string": r"ValueError: LionCub: aggregation must be one of \('mean', 'sign-vote', 'onebit-mean', "
                  r"'lane-mean', 'scatter-mean'\)",
        "type": r"TypeError: LocalCub: aggregation must be one of .* got dict",
        "round_on_step": r"ValueError: ScatterMean averages a round's Δ",
        "step_on_round": r"ValueError: OneBitMean shares a momentum across every step",
        "option_step": r"ValueError: LionCub: Options.outer_state does not apply to LionCub",
        "option_round": r"ValueError: LocalCub: Options.bucket_mb does not apply to LocalCub",
        "attempts": r"ValueError: LocalCub: Options.max_attempts counts a torchft manager's agreements",
        "options_type": r"TypeError: LionCub: options must be a lioncub.Options, got dict",
        "streaming": r"TypeError: LocalCub: streaming must be a bool, an int \(fragments\) or a lioncub.Streaming",
        "outer": r"TypeError: LocalCub: outer must be 'sgd', 'nesterov', 'lion' or a lioncub.Outer, got float",
        "node_overlap": r"ValueError: LionCub: overlap=True with a node layout",
    }
    for key, pattern in want.items():
        assert out[key] is not None and re.match(pattern, out[key]) and "\n" not in out[key], (key, out[key])


def test_a_manager_builds_the_torchft_optimizer_from_the_same_class():
    """``LocalCub(..., manager=m)`` / ``LionCub(..., manager=m)`` are the torchft optimizers: their own refusals
    answer (a manager with asynchronous quorums, an aggregation a missing replica would change)."""
    pytest.importorskip("torchft")
    from lioncub.ft import FTLionCub, FTLocalCub

    class Manager:
        _use_async_quorum = True

    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        lioncub.LocalCub(p, manager=Manager(), aggregation=LaneMean())
    with pytest.raises(ValueError, match="under torchft a round's aggregation must be a sum .* got ScatterMean"):
        lioncub.LocalCub(p, manager=Manager())  # the default's owners cannot leave a replica out
    with pytest.raises(ValueError, match="LionCub with a torchft manager votes with SignVote"):
        lioncub.LionCub(p, manager=Manager())
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        lioncub.LionCub(p, manager=Manager(), aggregation=SignVote())
    assert issubclass(FTLocalCub, lioncub.LocalCub) and issubclass(FTLionCub, FTLocalCub)
    assert lioncub.LocalCub.__new__(lioncub.LocalCub, p, manager=Manager()).__class__ is FTLocalCub


# ------------------------------------------------------------------------------------------- the command's flag
def _cli_worker(rank, world):
    import argparse

    from lioncub.harness.config import TrainConfig, aggregation_fields
    from lioncub.harness.method import make_optimizer

    out = {}
    cases = [("onebit-mean", 1, None, None), ("sign-vote", 1, "onebit", None), ("mean", 1, None, None),
             ("lane-mean", 2, None, 4), ("scatter-mean", 2, None, 2), ("sign-vote", 2, "pbit", None),
             ("mean", 2, None, None)]
    for name, H, vote, bits in cases:
        args = argparse.Namespace(aggregate="vote", vote=vote, bits=bits, grad_dtype="fp32")
        fields = aggregation_fields(name, args, local=H != 1)
        config = TrainConfig(model="gpt-tiny", local_steps=H, steps=2, eval_every=2, **fields)
        opt = make_optimizer(config, [dict(params=list(_model().parameters()))])
        out[f"{name}/H{H}/{vote}/{bits}"] = repr(opt.aggregation)
    return out


def test_lioncub_train_aggregation_flag_builds_the_same_object():
    """``lioncub train --aggregation NAME [--vote V] [--bits B]``: the harness's optimizer holds exactly the object
    the library would be given (its settings made by the object itself)."""
    got = run_workers(_cli_worker, 1)[0]
    assert got == {
        "onebit-mean/H1/None/None": repr(OneBitMean()),
        "sign-vote/H1/onebit/None": repr(SignVote("onebit")),
        "mean/H1/None/None": repr(Mean()),
        "lane-mean/H2/None/4": repr(LaneMean(bits=4)),
        "scatter-mean/H2/None/2": repr(ScatterMean(bits=2)),
        "sign-vote/H2/pbit/None": repr(SignVote("pbit")),
        "mean/H2/None/None": repr(Mean()),
    }, got


@pytest.mark.parametrize("argv, match", [
    (["--aggregation", "scatter-mean", "--aggregate", "mean"], "--aggregation names the aggregation; --aggregate is"),
    (["--aggregation", "onebit-mean", "--vote", "pbit"], "--vote picks the collective of --aggregation sign-vote"),
    (["--aggregation", "scatter-mean"], "ScatterMean averages a round's Δ; every step use OneBitMean"),
    (["--aggregation", "lane-mean", "--bits", "1", "--local-steps", "2"], r"LaneMean.bits must be None or one of"),
])
def test_lioncub_train_aggregation_flag_refusals(argv, match, capsys):
    from lioncub.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--no-compare", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and re.search(match, err), err
