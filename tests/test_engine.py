"""The shared engine: the vote config, the shell (policy names, envelope, one fingerprint check),
the outer rules as objects, the one validation module."""
from __future__ import annotations
from tests import flat

import dataclasses

import pytest
import torch

from tests.flat import LionCub, LocalCub
from lioncub import Options
from lioncub.aggregations import SignVote
from lioncub.engine.config import VoteConfig
from lioncub.engine.shell import NONFINITE_POLICIES
from lioncub.optim.outer import OUTER_RULES, OuterLion, OuterNesterov, OuterSGD, make_outer
from lioncub.validate import check_choice, check_int, check_number
from tests.dist import run_workers


def _lin(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


# ------------------------------------------------------------------ the config
def test_vote_config_validates_once_is_frozen_and_resolves_auto_to_a_new_object():
    c = VoteConfig(vote="auto", seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vote = "onebit"
    picked = c.resolved("pbit", 4)
    assert (picked.vote, picked.bits, picked.seed, c.vote) == ("pbit", 4, 3, "auto")
    assert picked.method(3).bits == 4 and VoteConfig(vote="grad").method(3) is None
    with pytest.raises(ValueError, match=r"vote='auto' is resolved first"):
        c.method(2)
    with pytest.raises(ValueError, match=r"bits=2 lanes overflow with 4 workers"):
        VoteConfig(vote="pbit", bits=2).method(4)  # the world-size limit: checked for the world
    assert VoteConfig(vote="pbit", bits=2).method(3).bits == 2
    assert VoteConfig(bucket_mb=1).bucket_mb == 1.0 and isinstance(VoteConfig(bucket_mb=1).bucket_mb, float)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: SignVote(transport="majority"), ValueError, r"SignVote.transport must be one of \('sign_allreduce', "),
    (lambda: SignVote(transport="onebit", tie="up"), ValueError, r"SignVote.tie must be one of"),
    (lambda: SignVote(transport="gather", quantizer="l1"), ValueError, r"SignVote.quantizer applies to transport='pbit'"),
    (lambda: Options(fused="yes"), TypeError, r"Options.fused must be None, True or False, got 'yes'"),
    (lambda: Options(message_mb=-1), ValueError, r"Options.message_mb must be a number > 0, got -1"),
    (lambda: Options(seed=1.5), TypeError, r"Options.seed must be an int, got 1.5"),
    (lambda: Options(nonfinite="ignore"), ValueError, r"Options.nonfinite must be one of \('raise', 'skip'\)"),
    (lambda: Options(check_every=-1), ValueError, r"Options.check_every must be an int >= 0, got -1"),
    (lambda: Options(sync_dtype="fp16"), ValueError, r"Options.sync_dtype must be one of \('fp32', 'bf16'\)"),
    (lambda: Options(alpha=1e-4), ValueError, r"Options: give both alpha and beta"),
    (lambda: Options(round_share=1.5), ValueError, r"Options.round_share must be a number in \(0, 1\]"),
    (lambda: Options(min_local_steps=20, max_local_steps=10), ValueError, r"Options.min_local_steps must be at most"),
    (lambda: Options(outer_state="disk"), ValueError, r"Options.outer_state must be one of \('device', 'host'\)"),
    (lambda: Options(max_attempts=0), ValueError, r"Options.max_attempts must be an int >= 1, got 0"),
])
def test_each_setting_is_refused_by_the_object_it_was_given_to(make, exc, match):
    """A bad setting is refused once, where the user gave it: by its aggregation object or by ``Options``,
    naming the field (the engine's ``VoteConfig`` checks nothing again)."""
    with pytest.raises(exc, match=match):
        make()


def test_both_optimizers_hold_one_config_and_one_method_object():
    opt = LionCub(_lin().parameters(), vote="pbit", bits=4, tie="plus")
    loc = LocalCub(_lin().parameters(), vote="pbit", bits=4, tie="plus", local_steps=2)
    for o in (opt, loc):
        assert (o.vote, o.bits, o.tie, o.config.fingerprint()["tie"]) == ("pbit", 4, "plus", "plus")
        assert o.method.bits == 4 and o.method.tie == "plus"
    first = loc.method
    for _ in range(4):  # two rounds: the same method object, not one per round
        for p in loc.params:
            p.grad = torch.ones_like(p)
        loc.step()
    assert loc.rounds == 2 and loc.method is first


# ------------------------------------------------------------------ the shell
@pytest.mark.parametrize("spelling", ["skip", "skip_step", "skip_round"])
def test_one_nonfinite_policy_name_and_its_older_spellings(spelling):
    assert NONFINITE_POLICIES == ("raise", "skip")
    assert LionCub(_lin().parameters(), vote="onebit", nonfinite=spelling).nonfinite == "skip"
    assert LocalCub(_lin().parameters(), vote="onebit", nonfinite=spelling).nonfinite == "skip"


def test_each_state_entry_is_the_same_envelope_and_another_kind_is_refused():
    opt = LionCub(_lin().parameters(), vote="onebit")
    loc = LocalCub(_lin().parameters(), vote="onebit", local_steps=2)
    for o, key in ((opt, "lioncub"), (loc, "local")):
        env = o.state_dict()[key]
        assert {"kind", "config", "counters", "rank", "world_size", "generator"} <= env.keys()
        assert env["kind"] == type(o).__name__ and env["config"] == o.fingerprint()
    with pytest.raises(ValueError, match=r"state_dict has no 'lioncub' entry: it was not saved by LionCub"):
        opt.load_state_dict(loc.state_dict())
    with pytest.raises(ValueError, match=r"state_dict has no 'local' entry: it was not saved by LocalCub"):
        loc.load_state_dict(opt.state_dict())
    forged = opt.state_dict()
    forged["lioncub"]["kind"] = "NodeCub"
    with pytest.raises(ValueError, match=r"state_dict was saved by NodeCub, not LionCub"):
        LionCub(_lin().parameters(), vote="onebit").load_state_dict(forged)


def test_localcub_refuses_another_tie_rule_and_another_rank():
    saved = LocalCub(_lin().parameters(), vote="onebit", local_steps=2).state_dict()
    with pytest.raises(ValueError, match=r"saved with tie='alternate' but this optimizer has tie='minus'"):
        LocalCub(_lin().parameters(), vote="onebit", local_steps=2, tie="minus").load_state_dict(saved)
    saved["local"]["rank"], saved["local"]["world_size"] = 1, 2
    with pytest.raises(ValueError, match=r"state of rank 1 of 2, but this is rank 0 of 1"):
        LocalCub(_lin().parameters(), vote="onebit", local_steps=2).load_state_dict(saved)


def _nodecub_in_node_check(rank, world):
    import lioncub

    layout = lioncub.node_groups(2)  # one node of two ranks: no cross-node peer to compare with
    model = torch.nn.Linear(4, 3 if rank == 0 else 2)
    try:
        flat.NodeCub(model.parameters(), layout=layout, vote="onebit", shard=False)
    except ValueError as exc:
        return str(exc)
    return None


def test_nodecub_checks_the_ranks_inside_a_node():
    """The same-model check runs over the whole world: two ranks of one node that build different
    models are refused (a check over the cross-node group alone never compared them)."""
    errors = run_workers(_nodecub_in_node_check, 2)
    assert all(e is not None and "model differs across ranks: rank 1 has parameter 0" in e for e in errors)


# ------------------------------------------------------------------ the outer rules
def test_outer_rules_are_objects_in_a_registry_and_take_what_they_use():
    assert OUTER_RULES == {"sgd": OuterSGD, "nesterov": OuterNesterov, "lion": OuterLion}
    rule = make_outer("nesterov", lr=2.0, momentum=0.5)
    assert (rule.name, rule.lr, rule.momentum, rule.state_keys) == ("nesterov", 2.0, 0.5, ("outer_m",))
    assert make_outer("lion", lr=1.0, betas=(0.5, 0.25)).betas == (0.5, 0.25)
    assert make_outer("sgd", lr=3.0).state_keys == ()
    loc = LocalCub(_lin().parameters(), vote="onebit", outer="lion", outer_lr=4.0, outer_betas=(0.5, 0.25))
    assert (loc.outer, loc.outer_lr, loc.rule.betas) == ("lion", 4.0, (0.5, 0.25))
    assert all(s["outer_m"].dtype == torch.float32 for s in loc.state.values())
    with pytest.raises(ValueError, match=r"outer must be one of \('sgd', 'nesterov', 'lion'\), got 'adam'"):
        make_outer("adam", lr=1.0)
    with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\), got 1.5"):
        make_outer("sgd", lr=1.0, momentum=1.5)


def test_an_outer_rule_steps_the_start_exactly():
    start, d = torch.tensor([1.0, -2.0]), torch.tensor([1.0, -1.0])  # a vote u
    state = {}
    rule = OuterNesterov(2.0, 0.5)
    rule.init_state(start, state)
    rule.step(start, d, state, lr=0.25, signed=True)  # d' = 0.25·u; b = d'; θ -= 2·(d' + 0.5·b)
    assert torch.equal(state["outer_m"], torch.tensor([0.25, -0.25]))
    assert torch.equal(start, torch.tensor([0.25, -1.25]))
    OuterSGD(3.0).step(start, torch.tensor([0.5, 0.0]), {}, lr=0.25, signed=False)  # θ -= 3·d
    assert torch.equal(start, torch.tensor([-1.25, -1.25]))


# ------------------------------------------------------------------ one validation module
def test_the_validation_words_are_one_line_naming_the_argument():
    with pytest.raises(ValueError, match=r"^local_steps must be an int >= 1, got 0$"):
        check_int("local_steps", 0, 1)
    with pytest.raises(ValueError, match=r"^n_workers must be an int in \[1, 253\], got True$"):
        check_int("n_workers", True, 1, 253)
    with pytest.raises(ValueError, match=r"^H \(steps between synchronisations\) must be an int >= 1, got 0$"):
        check_int("H", 0, 1, what="steps between synchronisations")
    with pytest.raises(ValueError, match=r"^rate must be a number >= 0, got -1$"):
        check_number("rate", -1, positive=False)
    assert check_choice("nonfinite", "skip_step", ("raise", "skip"), aliases={"skip_step": "skip"}) == "skip"
