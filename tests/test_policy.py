"""The YAML policy layer (fxmem.policy) and sizes/budgets (fxmem.units)."""
from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from fxmem.errors import FxmemError, PolicyError
from fxmem.policy import (KNOWN_PASSES, Budget, PassSection, Policy, Size, VerifyOptions, options_class,
                          register_options, registered_options, unregister_options)
from fxmem.policy_loader import load_policy
from fxmem.policy_presets import list_presets, preset_path
from fxmem.units import format_bytes, format_size, parse_budget, parse_size


# ----------------------------------------------------------------------------------------- fake passes
@dataclass
class FakeInner:
    depth: int = 2
    tags: list[str] = field(default_factory=list)


@dataclass
class FakeCheckpoint:
    budget: Budget | None = None
    solver: Literal["auto", "greedy", "ilp"] = "auto"
    selective: bool = True
    max_regions: int = 8
    ratio: float = 0.5
    keep: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    limit: Size | None = None
    inner: FakeInner = field(default_factory=FakeInner)
    note: str | None = None

    def __post_init__(self):
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio: expected a number in [0, 1], got {self.ratio}")


@dataclass
class FakeAttention:
    rewrite: Literal["sdpa", "none"] = "sdpa"


@pytest.fixture
def fake():
    """Register options for checkpoint and attention only; other passes stay unregistered."""
    with registered_options({"checkpoint": FakeCheckpoint, "attention": FakeAttention}, clear=True):
        yield


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text).lstrip("\n"))
    return p


def error(spec, **kw) -> str:
    with pytest.raises(PolicyError) as ei:
        load_policy(spec, **kw)
    msg = str(ei.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


MINIMAL = {"version": 1}


# ----------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", ["low", "medium", "high", "inference"])
def test_each_preset_loads(name):
    pol = load_policy(name)
    assert isinstance(pol, Policy) and pol.version == 1 and pol.name == name
    assert pol.description
    assert list(pol.passes) == list(KNOWN_PASSES)
    assert Path(pol.source).name == f"{name}.yaml"
    assert preset_path(name).name == f"{name}.yaml"


def test_each_preset_loads_with_registered_options_for_all_passes():
    """The presets' keys must be plausible: validate them against options classes with those keys."""
    @dataclass
    class Attn:
        rewrite: Literal["sdpa", "none"] = "sdpa"

    @dataclass
    class Ckpt:
        budget: Budget | None = None
        solver: Literal["auto", "greedy", "ilp"] = "auto"
        selective: bool = True

    @dataclass
    class Off:
        activations: bool = True
        weights: bool = False
        tier: Literal["auto", "cpu", "disk"] = "auto"

    @dataclass
    class Prec:
        compute: Literal["fp32", "bf16", "fp16"] = "fp32"
        weights: Literal["fp32", "bf16", "int8", "nf4"] = "fp32"

    @dataclass
    class Prune:
        fraction: float = 0.1
        require_calibration: bool = True

    @dataclass
    class Gate:
        pass

    regs = {"attention": Attn, "checkpoint": Ckpt, "offload": Off, "precision": Prec, "pruning": Prune,
            "gating": Gate}
    with registered_options(regs, clear=True):
        for name in list_presets():
            pol = load_policy(name)
            assert all(isinstance(s.options, regs[n]) for n, s in pol.passes.items())


def test_preset_contents():
    low, medium, high, inf = (load_policy(n) for n in ("low", "medium", "high", "inference"))
    assert low.budget == Budget(fraction=0.7) and low.optimizer == "adamw" and low.mode == "train"
    assert low.enabled_passes == ("attention", "checkpoint")
    assert low.passes["attention"].raw == {"rewrite": "sdpa"}
    assert low.passes["checkpoint"].raw["solver"] == "auto"
    assert medium.extends == "low" and medium.budget == Budget(fraction=0.5)
    assert medium.optimizer == "adamw8bit" and medium.passes["precision"].raw["compute"] == "bf16"
    assert medium.enabled_passes == ("attention", "precision", "checkpoint")
    assert high.extends == "medium" and high.budget == Budget(fraction=0.3)
    assert high.optimizer == "adamw8bit"  # inherited through medium
    assert high.passes["pruning"].raw == {"fraction": 0.2, "require_calibration": True}
    assert high.passes["offload"].enabled and high.passes["checkpoint"].enabled
    assert not high.passes["gating"].enabled
    # lossy limits left to each kind of change (fxmem.lossguard.KIND_LIMITS), as the preset's header says
    assert high.verify.enabled and high.verify.lossy_tolerance is None and high.verify.top1_agreement is None
    assert inf.mode == "inference" and inf.optimizer == "none"
    assert inf.passes["precision"].raw["weights"] == "int8"
    assert inf.passes["pruning"].raw["fraction"] == 0.1
    assert not inf.passes["checkpoint"].enabled


def test_list_presets_and_unknown_preset():
    assert list_presets() == sorted(list_presets())
    assert {"low", "medium", "high", "inference"} <= set(list_presets())
    msg = error("hgih")
    assert "unknown preset 'hgih'" in msg and "did you mean 'high'" in msg and "low" in msg
    with pytest.raises(PolicyError, match="unknown preset"):
        preset_path("nope")


def test_search_dirs_hold_user_presets(tmp_path):
    write(tmp_path, "mine.yaml", """
        version: 1
        extends: low
        budget: 2GiB
    """)
    assert "mine" in list_presets(search_dirs=[tmp_path])
    pol = load_policy("mine", search_dirs=[tmp_path])
    assert pol.name == "mine" and pol.budget == Budget(bytes=2 * 1024**3)


def test_policy_error_is_fxmem_error():
    assert issubclass(PolicyError, FxmemError) and PolicyError.exit_code == 2


# ----------------------------------------------------------------------------------------- error cases
def test_unknown_top_level_key_suggests(tmp_path):
    p = write(tmp_path, "p.yaml", """
        version: 1
        # a comment
        budgte: 40%
    """)
    msg = error(p)
    assert msg.startswith(f"{p}:3 budgte: unknown key (did you mean 'budget'?)"), msg
    assert "known keys: version, name" in msg


def test_unknown_pass_lists_known_passes(tmp_path):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          attention: {enabled: true}
          chekpoint:
            enabled: true
    """)
    msg = error(p)
    assert msg.startswith(f"{p}:4 passes.chekpoint: unknown pass (did you mean 'checkpoint'?)"), msg
    assert "known passes: attention, pruning, gating, precision, checkpoint, offload" in msg


def test_unknown_option_in_registered_pass(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          checkpoint:
            enabled: true
            sovler: greedy
    """)
    msg = error(p)
    assert msg.startswith(f"{p}:5 passes.checkpoint.sovler: unknown option for pass 'checkpoint' "
                          "(did you mean 'solver'?)"), msg
    assert "known options: enabled, budget, solver" in msg


def test_unregistered_pass_keeps_raw_options(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          offload:
            tier: cpu
            anything: [1, 2]
    """)
    pol = load_policy(p)
    sec = pol.passes["offload"]
    assert sec.options is None and sec.raw == {"tier": "cpu", "anything": [1, 2]}
    assert sec.enabled and sec.line == 3 and sec.where == f"{p}:3"
    assert pol.unimplemented_passes() == ("offload",)


def test_wrong_bool(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          checkpoint:
            selective: yes please
    """)
    assert error(p) == f"{p}:4 passes.checkpoint.selective: expected a bool, got 'yes please'"


def test_enabled_must_be_bool_even_when_unregistered(tmp_path):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          gating:
            enabled: maybe
    """)
    assert error(p) == f"{p}:4 passes.gating.enabled: expected a bool, got 'maybe'"


def test_literal_choices_listed(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        mode: train
        passes:
          checkpoint: {solver: gredy}
    """)
    msg = error(p)
    assert msg == (f"{p}:4 passes.checkpoint.solver: expected one of 'auto', 'greedy', 'ilp', got 'gredy' "
                   "(did you mean 'greedy'?)")


def test_top_level_literals(tmp_path):
    p = write(tmp_path, "p.yaml", "version: 1\nmode: trian\n")
    msg = error(p)
    assert msg.startswith(f"{p}:2 mode: expected one of 'train', 'inference', got 'trian'")
    p = write(tmp_path, "q.yaml", "version: 1\noptimizer: adamw9bit\n")
    msg = error(p)
    assert f"{p}:2 optimizer: expected one of 'none', 'sgd'" in msg and "did you mean 'adamw8bit'" in msg


def test_bad_size_exact_message(tmp_path, fake):
    p = write(tmp_path, "high.yaml", """
        version: 1
        passes:
          checkpoint:
            budget: lots
    """)
    assert error(p) == f"{p}:4 passes.checkpoint.budget: expected a size like '4GiB' or '40%', got 'lots'"


def test_bad_budget_fraction_and_percent(tmp_path):
    p = write(tmp_path, "p.yaml", "version: 1\nbudget: 1.5\n")
    assert error(p).startswith(f"{p}:2 budget: expected a fraction in (0, 1]")
    p = write(tmp_path, "p.yaml", "version: 1\nbudget: 140%\n")
    assert error(p) == f"{p}:2 budget: expected a percentage in (0%, 100%], got '140%'"


def test_version_missing_wrong_and_not_int(tmp_path):
    p = write(tmp_path, "p.yaml", "name: x\nbudget: 40%\n")
    assert error(p) == f"{p}:1 version: missing; every policy file starts with 'version: 1'"
    p = write(tmp_path, "p.yaml", "# comment\nversion: 2\n")
    assert error(p) == f"{p}:2 version: unsupported policy version 2; this fxmem reads version 1"
    p = write(tmp_path, "p.yaml", "version: '1'\n")
    assert error(p) == f"{p}:1 version: expected the integer 1, got '1'"
    assert error({"budget": "40%"}) == "<dict> version: missing; every policy file starts with 'version: 1'"


def test_yaml_syntax_error_has_line(tmp_path):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          checkpoint:
            solver: [greedy
        budget: 40%
    """)
    msg = error(p)
    assert msg.startswith(f"{p}:") and "invalid YAML" in msg
    line = int(msg.split(":")[1])
    assert line in (4, 5)
    p = write(tmp_path, "q.yaml", "version: 1\n  bad: indent\n")
    assert error(p).startswith(f"{p}:2: invalid YAML")


def test_not_a_mapping_and_empty(tmp_path):
    p = write(tmp_path, "p.yaml", "- version: 1\n")
    assert error(p) == f"{p}:1: expected a mapping of policy settings (version: 1, passes: ...), got a list"
    p = write(tmp_path, "e.yaml", "# nothing\n")
    assert error(p) == f"{p}:1: expected a mapping of policy settings, got an empty file"
    p = write(tmp_path, "s.yaml", "just text\n")
    assert "got 'just text'" in error(p)


def test_duplicate_key(tmp_path):
    p = write(tmp_path, "p.yaml", "version: 1\nbudget: 40%\nbudget: 50%\n")
    assert error(p) == f"{p}:3 budget: duplicate key (first at line 2)"


def test_section_and_mapping_types(tmp_path, fake):
    p = write(tmp_path, "p.yaml", "version: 1\npasses: [checkpoint]\n")
    assert error(p).startswith(f"{p}:2 passes: expected a mapping of pass names")
    p = write(tmp_path, "p.yaml", "version: 1\npasses:\n  checkpoint: 3\n")
    assert error(p).startswith(f"{p}:3 passes.checkpoint: expected a mapping like {{enabled: true, ...}}")
    p = write(tmp_path, "p.yaml", "version: 1\nverify: strict\n")
    assert error(p) == f"{p}:2 verify: expected a mapping, got 'strict'"
    p = write(tmp_path, "p.yaml", "version: 1\nverify:\n  atol: -1\n")
    assert error(p) == f"{p}:3 verify.atol: expected a number >= 0, got -1.0"
    p = write(tmp_path, "p.yaml", "version: 1\nverify:\n  seed: 1.5\n")
    assert error(p) == f"{p}:3 verify.seed: expected an integer, got 1.5"


def test_verify_guard_limits_are_checked(tmp_path):
    """The guard of lossy changes reads verify.top1_agreement as a share, verify.outputs as one of three words."""
    p = write(tmp_path, "p.yaml", "version: 1\nverify:\n  top1_agreement: 97\n")
    assert error(p) == (f"{p}:3 verify.top1_agreement: expected a share in [0, 1] (0.97 = 97% of predictions "
                        "unchanged), got 97.0")
    p = write(tmp_path, "p.yaml", "version: 1\nverify:\n  outputs: logits\n")
    assert error(p).startswith(f"{p}:3 verify.outputs: expected one of 'auto', 'scores', 'values', got 'logits'")
    p = write(tmp_path, "p.yaml", "version: 1\nverify:\n  guard_items: 0\n")
    assert error(p) == f"{p}:3 verify.guard_items: expected an integer >= 1, got 0"
    pol = load_policy({"version": 1, "verify": {"top1_agreement": 0.9, "lossy_tolerance": None}})
    assert pol.verify.top1_agreement == 0.9 and pol.verify.lossy_tolerance is None


def test_typed_options_all_kinds(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          checkpoint:
            budget: 6GiB
            solver: ilp
            max_regions: 3
            ratio: 1            # ints are accepted for floats
            keep: [attn, mlp]
            weights: {a: 0.5, b: 2}
            limit: 512 MiB
            inner: {depth: 4, tags: [x]}
            note: null
    """)
    pol = load_policy(p)
    o = pol.passes["checkpoint"].options
    assert isinstance(o, FakeCheckpoint)
    assert o.budget == Budget(bytes=6 * 1024**3) and o.solver == "ilp" and o.max_regions == 3
    assert o.ratio == 1.0 and isinstance(o.ratio, float)
    assert o.keep == ["attn", "mlp"] and o.weights == {"a": 0.5, "b": 2.0}
    assert o.limit == 512 * 1024**2 and isinstance(o.limit, Size)
    assert o.inner == FakeInner(depth=4, tags=["x"]) and o.note is None
    assert pol.passes["checkpoint"].raw["limit"] == "512 MiB"
    # registered but absent: disabled with default options; unregistered absent: None
    assert pol.passes["attention"].options == FakeAttention() and not pol.passes["attention"].enabled
    assert pol.passes["gating"].options is None and not pol.passes["gating"].enabled


@pytest.mark.parametrize("snippet, path, expect", [
    ("keep: [attn, 3]", "passes.checkpoint.keep[1]", "expected a string, got 3"),
    ("keep: attn", "passes.checkpoint.keep", "expected a list of strings, got 'attn'"),
    ("weights: {a: big}", "passes.checkpoint.weights.a", "expected a number, got 'big'"),
    ("inner: {depth: deep}", "passes.checkpoint.inner.depth", "expected an integer, got 'deep'"),
    ("inner: {dpeth: 3}", "passes.checkpoint.inner.dpeth", "unknown key (did you mean 'depth'?)"),
    ("limit: 4 GBs", "passes.checkpoint.limit", "unknown unit 'GBs'"),
    ("max_regions: true", "passes.checkpoint.max_regions", "expected an integer, got true"),
    ("ratio: 3", "passes.checkpoint.ratio", "expected a number in [0, 1], got 3"),
    ("note: [a]", "passes.checkpoint.note", "expected a string, got a list"),
])
def test_typed_option_errors_name_path_and_line(tmp_path, fake, snippet, path, expect):
    p = write(tmp_path, "p.yaml", f"version: 1\npasses:\n  checkpoint:\n    enabled: true\n    {snippet}\n")
    msg = error(p)
    assert msg.startswith(f"{p}:5 {path}: "), msg
    assert expect in msg


def test_flow_style_lines_come_from_the_node_tree(tmp_path, fake):
    p = write(tmp_path, "p.yaml", """
        version: 1
        description: "solver: gredy appears here first"
        passes: {attention: {rewrite: sdpa},
                 checkpoint: {solver: gredy}}
    """)
    assert error(p).startswith(f"{p}:4 passes.checkpoint.solver: expected one of")


# ----------------------------------------------------------------------------------------- extends
def test_extends_deep_merge(tmp_path, fake):
    write(tmp_path, "base.yaml", """
        version: 1
        name: base
        description: the base
        budget: 50%
        passes:
          checkpoint:
            enabled: true
            solver: greedy
            keep: [a, b]
            weights: {x: 1.0}
          offload: {enabled: false, tier: cpu}
    """)
    child = write(tmp_path, "child.yaml", """
        version: 1
        extends: ./base.yaml
        passes:
          checkpoint:
            keep: [c]
            weights: {y: 2.0}
          offload: {tier: disk}
    """)
    pol = load_policy(child)
    o = pol.passes["checkpoint"].options
    assert o.solver == "greedy"  # inherited
    assert o.keep == ["c"]  # lists replace
    assert o.weights == {"x": 1.0, "y": 2.0}  # mappings merge
    assert pol.budget == Budget(fraction=0.5)
    assert pol.passes["offload"].raw == {"tier": "disk"} and not pol.passes["offload"].enabled
    assert pol.name == "child" and pol.description == ""  # identity is not inherited
    assert pol.extends == "./base.yaml"


def test_extends_preset_and_bool_shorthand(tmp_path):
    p = write(tmp_path, "p.yaml", """
        version: 1
        extends: high
        passes:
          offload: false
          gating:
    """)
    pol = load_policy(p)
    assert not pol.passes["offload"].enabled
    assert pol.passes["offload"].raw["tier"] == "auto"  # options kept from high
    # an inherited section keeps the parent's `enabled` (high disables gating explicitly) ...
    assert not pol.passes["gating"].enabled
    assert pol.budget == Budget(fraction=0.3)
    # ... while a section written only here, without `enabled`, is enabled
    assert load_policy({"version": 1, "passes": {"gating": None}}).passes["gating"].enabled


def test_error_in_parent_names_parent_file_and_line(tmp_path, fake):
    write(tmp_path, "parent.yaml", "version: 1\npasses:\n  checkpoint:\n    solver: bogus\n")
    child = write(tmp_path, "child.yaml", "version: 1\nextends: parent.yaml\nbudget: 40%\n")
    msg = error(child)
    assert msg.startswith("parent.yaml:4 passes.checkpoint.solver: expected one of") or \
        msg.startswith(f"{tmp_path / 'parent.yaml'}:4 passes.checkpoint.solver: expected one of"), msg


def test_child_value_fixes_parent_value(tmp_path, fake):
    write(tmp_path, "parent.yaml", "version: 1\npasses:\n  checkpoint:\n    solver: greedy\n")
    child = write(tmp_path, "child.yaml", "version: 1\nextends: parent.yaml\npasses:\n  checkpoint:\n"
                                          "    solver: wrong\n")
    assert error(child) .startswith(f"{child}:5 passes.checkpoint.solver:")


def test_extends_cycle(tmp_path):
    a = write(tmp_path, "a.yaml", "version: 1\nextends: b.yaml\n")
    write(tmp_path, "b.yaml", "version: 1\nextends: a.yaml\n")
    msg = error(a)
    assert "b.yaml:2 extends: extends cycle: " in msg and msg.endswith("a.yaml -> b.yaml -> a.yaml")
    s = write(tmp_path, "self.yaml", "version: 1\nextends: ./self.yaml\n")
    assert "extends cycle: " in error(s)


def test_extends_missing_preset_and_file(tmp_path):
    p = write(tmp_path, "p.yaml", "version: 1\nextends: hihg\n")
    msg = error(p)
    assert msg.startswith(f"{p}:2 extends: unknown preset 'hihg' (did you mean 'high'?); presets: ")
    p = write(tmp_path, "q.yaml", "version: 1\nextends: missing.yaml\n")
    assert error(p).startswith(f"{p}:2 extends: policy file not found: missing.yaml")
    p = write(tmp_path, "r.yaml", "version: 1\nextends: 3\n")
    assert error(p) == f"{p}:2 extends: expected a preset name or a path to a .yaml file, got 3"


def test_missing_file():
    assert error("nope/none.yaml") == "nope/none.yaml: no such policy file"


# ----------------------------------------------------------------------------------------- overrides
def test_overrides(fake):
    pol = load_policy("high", overrides=["passes.checkpoint.solver=greedy", "budget=40%",
                                         "passes.precision.enabled=false", "verify.atol=1e-6",
                                         "passes.checkpoint.keep=[a, b]", "passes.offload=false"])
    assert pol.passes["checkpoint"].options.solver == "greedy"
    assert pol.passes["checkpoint"].options.keep == ["a", "b"]
    assert pol.budget == Budget(fraction=0.4)
    assert not pol.passes["precision"].enabled
    assert pol.passes["precision"].raw["compute"] == "bf16"
    assert not pol.passes["offload"].enabled and pol.passes["offload"].raw["tier"] == "auto"
    assert pol.verify.atol == 1e-6
    assert load_policy("low", overrides=["budget="]).budget is None
    assert load_policy("low", overrides="budget=2G").budget == Budget(bytes=2 * 1024**3)


@pytest.mark.parametrize("override, expect", [
    ("passes.chekpoint.solver=greedy", "--set 'passes.chekpoint.solver=greedy' passes.chekpoint: unknown pass "
                                       "(did you mean 'checkpoint'?)"),
    ("budgte=40%", "--set 'budgte=40%' budgte: unknown key (did you mean 'budget'?)"),
    ("budget=lots", "--set 'budget=lots' budget: expected a size like '4GiB' or '40%', got 'lots'"),
    ("passes.checkpoint.solver=gredy", "--set 'passes.checkpoint.solver=gredy' passes.checkpoint.solver: "
                                       "expected one of 'auto', 'greedy', 'ilp', got 'gredy'"),
    ("passes.checkpoint.sovler=greedy", "--set 'passes.checkpoint.sovler=greedy' passes.checkpoint.sovler: "
                                        "unknown option for pass 'checkpoint' (did you mean 'solver'?)"),
    ("budget.x=1", "--set 'budget.x=1' budget: is '70%', not a mapping"),
    ("budget", "--set 'budget': expected KEY=VALUE"),
    ("passes..x=1", "--set 'passes..x=1': 'passes..x' is not a key path"),
    ("extends=high", "--set 'extends=high' extends: cannot be set with --set"),
    ("passes.precision.enabled=yes please", "--set 'passes.precision.enabled=yes please' "
                                            "passes.precision.enabled: expected a bool, got 'yes please'"),
])
def test_bad_overrides_name_the_override(fake, override, expect):
    assert error("low", overrides=[override]).startswith(expect)


def test_overrides_on_policy_object(fake):
    pol = load_policy("low")
    assert load_policy(pol) is pol
    new = load_policy(pol, overrides=["passes.checkpoint.solver=ilp"])
    assert new.passes["checkpoint"].options.solver == "ilp" and pol.passes["checkpoint"].options.solver == "auto"
    assert new.source == pol.source and new.budget == pol.budget


# ----------------------------------------------------------------------------------------- dict policies
def test_dict_policy(fake):
    pol = load_policy({"version": 1, "budget": "4GiB", "passes": {"checkpoint": {"solver": "greedy"}}})
    assert pol.source == "<dict>" and pol.name == "custom"
    assert pol.budget == Budget(bytes=4 * 1024**3)
    assert pol.passes["checkpoint"].enabled and pol.passes["checkpoint"].options.solver == "greedy"
    assert pol.passes["checkpoint"].line is None
    assert error({"version": 1, "passes": {"checkpoint": {"budget": "lots"}}}) == \
        "<dict> passes.checkpoint.budget: expected a size like '4GiB' or '40%', got 'lots'"
    assert error({"version": 1, "mdoe": "train"}).startswith("<dict> mdoe: unknown key (did you mean 'mode'?)")


def test_dict_policy_extends_preset():
    pol = load_policy({"version": 1, "extends": "medium", "budget": 0.25})
    assert pol.budget == Budget(fraction=0.25) and pol.optimizer == "adamw8bit" and pol.extends == "medium"
    assert pol.name == "custom"


def test_bad_spec_type():
    assert "expected a preset name" in error(42)


# ----------------------------------------------------------------------------------------- registry
def test_register_options_checks_the_class():
    before = options_class("gating")  # the real pass's class when passes/gating.py was imported earlier
    with registered_options(clear=True):
        @register_options("gating")
        @dataclass
        class G:
            threshold: float = 0.1

        assert options_class("gating") is G
        register_options("gating", G)  # same class again: fine
        with pytest.raises(ValueError, match="already has options class"):
            register_options("gating", FakeAttention)
        register_options("gating", FakeAttention, replace=True)
        unregister_options("gating")
        assert options_class("gating") is None

        @dataclass
        class NoDefault:
            x: int

        @dataclass
        class Reserved:
            enabled: bool = True

        @dataclass
        class Unsupported:
            x: set = field(default_factory=set)

        with pytest.raises(TypeError, match="needs a default"):
            register_options("gating", NoDefault)
        with pytest.raises(TypeError, match="reserved"):
            register_options("gating", Reserved)
        with pytest.raises(TypeError, match="unsupported option type"):
            register_options("gating", Unsupported)
        with pytest.raises(TypeError, match="dataclass"):
            register_options("gating", dict)
    assert options_class("gating") is before  # the registry is restored on exit


def test_registered_options_restores_registry():
    before = options_class("checkpoint")
    with registered_options({"checkpoint": FakeCheckpoint}):
        assert options_class("checkpoint") is FakeCheckpoint
    assert options_class("checkpoint") is before


def test_extra_test_pass_names(fake):
    @dataclass
    class T:
        n: int = 1

    register_options("toy_pass", T)
    pol = load_policy({"version": 1, "passes": {"toy_pass": {"n": 3}}})
    assert pol.passes["toy_pass"].options == T(3) and list(pol.passes)[:6] == list(KNOWN_PASSES)
    assert "toy_pass" not in load_policy(MINIMAL).passes


# ----------------------------------------------------------------------------------------- output
def test_to_dict_deterministic_and_round_trips(fake):
    pol = load_policy("high", overrides=["passes.checkpoint.limit=1536MiB"])
    d = pol.to_dict()
    assert list(d) == ["version", "name", "description", "mode", "budget", "budget_strict", "optimizer", "passes", "verify"]
    assert list(d["passes"]) == list(KNOWN_PASSES)
    assert list(d["passes"]["checkpoint"])[:3] == ["enabled", "budget", "solver"]
    assert d["budget"] == "30%" and d["passes"]["checkpoint"]["limit"] == "1536MiB"
    assert json.dumps(d) == json.dumps(load_policy("high", overrides=["passes.checkpoint.limit=1536MiB"]).to_dict())
    assert load_policy(d).to_dict() == d
    text = pol.dump_yaml()
    assert text.startswith("# resolved policy 'high' from ") and "(extends medium)" in text
    assert load_policy(yaml.safe_load(text)).to_dict() == d


def test_passsection_to_dict():
    s = PassSection(enabled=True, options=None, raw={"b": 1, "a": 2}, line=3)
    assert s.to_dict() == {"enabled": True, "b": 1, "a": 2}
    assert VerifyOptions().lossy_tolerance is None and VerifyOptions().outputs == "auto"


# ----------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("text, n", [
    ("6GiB", 6 * 1024**3), ("512 MiB", 512 * 1024**2), ("1.5GB", 1_500_000_000), ("4096", 4096),
    ("16G", 16 * 1024**3), ("2k", 2048), ("3 KB", 3000), ("1 TiB", 1024**4), ("12 B", 12), ("0", 0),
    ("1.5KiB", 1536), (4096, 4096), ("10 gib", 10 * 1024**3),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text, expect", [
    ("lots", "expected a size like '4GiB' or '512 MiB', got 'lots'"),
    ("4 GBs", "unknown unit 'GBs'"), ("-1G", "negative"), ("1.5", "whole number of bytes"), (True, "got True"),
])
def test_parse_size_errors(text, expect):
    with pytest.raises(ValueError, match=None) as ei:
        parse_size(text)
    assert expect in str(ei.value)


def test_parse_budget():
    assert parse_budget("40%") == Budget(fraction=0.4) == parse_budget(0.4)
    assert parse_budget("6GiB") == Budget(bytes=6 * 1024**3)
    assert parse_budget(4096) == Budget(bytes=4096)
    assert parse_budget("100%").resolve(1000) == 1000
    assert parse_budget("33%").resolve(1000) == 330
    assert parse_budget("1GiB").resolve(12) == 1024**3
    assert str(parse_budget(0.4)) == "40%" and str(parse_budget("6GiB")) == "6GiB"
    for b in ("12.5%", "1.5GiB", 1 / 3, "7%", 123457):
        assert parse_budget(str(parse_budget(b))) == parse_budget(b)
    with pytest.raises(ValueError) as ei:
        parse_budget("lots")
    assert str(ei.value) == "expected a size like '4GiB' or '40%', got 'lots'"
    for bad in ("0%", "150%", 0.0, 1.5, 0, -3, "0GiB", None, True):
        with pytest.raises(ValueError):
            parse_budget(bad)
    with pytest.raises(Exception):
        Budget(bytes=5).bytes = 6  # frozen
    with pytest.raises(ValueError):
        Budget(bytes=1, fraction=0.5)


def test_format_bytes_and_size():
    assert format_bytes(12) == "12 B"
    assert format_bytes(312 * 1024) == "312.0 KiB"
    assert format_bytes(1.5 * 1024**3) == "1.50 GiB"
    assert format_bytes(1024) == "1.00 KiB"
    assert format_bytes(1023.99 * 1024) == "1.00 MiB"
    assert format_bytes(-3.25 * 1024**2) == "-3.25 MiB"
    assert format_bytes(0) == "0 B"
    for n in (0, 1, 1000, 4096, 1536, 1_500_000_000, 6 * 1024**3, 123457, 1536 * 1024**2):
        assert parse_size(format_size(n)) == n
    assert format_size(6 * 1024**3) == "6GiB" and format_size(1_500_000_000) == "1500MB"


def test_yaml_anchors_and_merge_keys(tmp_path):
    # YAML mechanics only: with no options classes registered the sections stay raw (the real passes' options
    # would reject 'solver' for offload, which is right but not what this test is about).
    p = write(tmp_path, "p.yaml", """
        version: 1
        passes:
          checkpoint: &ck
            enabled: true
            solver: greedy
          offload:
            <<: *ck
            tier: cpu
    """)
    with registered_options(clear=True):
        pol = load_policy(p)
    assert pol.passes["offload"].raw == {"solver": "greedy", "tier": "cpu"} and pol.passes["offload"].enabled


def test_missing_file_hints_at_preset():
    assert error("./high") == "./high: no such policy file (did you mean the preset 'high'?)"


def test_error_in_a_preset_names_the_preset_file(tmp_path):
    write(tmp_path, "team.yaml", "version: 1\nextends: low\n\nmode: training\n")
    msg = error("team", search_dirs=[tmp_path])
    assert msg.startswith("team.yaml:4 mode: expected one of 'train', 'inference', got 'training'"), msg


def test_presets_treat_their_budget_as_a_target_and_explicit_budgets_are_strict():
    for name in ("low", "medium", "high"):
        assert load_policy(name).budget_strict is False
    assert load_policy("low", overrides=["budget=2GiB", "budget_strict=true"]).budget_strict is True
    assert load_policy({"version": 1}).budget_strict is True


# ----------------------------------------------------------------------------------------- reading with limits
def _laughs(levels: int, flow: bool = False) -> str:
    """A "billion laughs" document: each level a list of 9 aliases to the level before (9**levels values); as a
    policy file, or (`flow`) as one flow mapping for a --set value."""
    names = "abcdefghijklmnop"
    entries = ["a: &a [x,x,x,x,x,x,x,x,x]"]
    entries += [f"{names[i]}: &{names[i]} [{','.join(['*' + names[i - 1]] * 9)}]" for i in range(1, levels)]
    return "{" + ", ".join(entries) + "}" if flow else "\n".join(["version: 1"] + entries) + "\n"


def _refused_unexpanded(spec, **kw) -> str:
    """The PolicyError message, refused with little memory: nothing was expanded (an expansion would hold hundreds
    of MiB; the peak is measured, not timed, so a loaded CI machine cannot fail it)."""
    import tracemalloc
    msg = error(spec, **kw)
    tracemalloc.start()
    try:
        assert error(spec, **kw) == msg
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2 ** 20, (peak, msg)
    return msg


def test_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    p = write(tmp_path, "laughs.yaml", _laughs(9))  # 9**9 = 387 million strings once expanded
    assert p.stat().st_size < 350
    msg = _refused_unexpanded(str(p))
    assert msg.startswith(f"{p}:") and "expands to more than 10000 values (nested YAML aliases)" in msg, msg
    line = int(msg.split(":")[1].split()[0])
    assert p.read_text().splitlines()[line - 1].startswith(msg.split(":")[2].strip()), msg  # the key on that line
    # the same document as a --set value, and merge keys (<<) that double a mapping at each level
    msg = _refused_unexpanded("low", overrides=["passes.checkpoint.keep=" + _laughs(9, flow=True)])
    assert msg.startswith("--set 'passes.checkpoint.keep=") and "expands to more than 10000 values" in msg, msg
    merges = ["version: 1", "m0: &m0 {a: 1, b: 2}"]
    merges += [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}" for i in range(1, 40)]
    q = write(tmp_path, "merges.yaml", "\n".join(merges) + "\n")
    msg = _refused_unexpanded(str(q))
    assert msg.startswith(f"{q}:") and "merge keys (<<) expand a mapping to more than 10000 entries" in msg, msg


@pytest.mark.parametrize("style", ["flow", "block", "flow-mapping"])
def test_deep_nesting_is_refused_naming_the_line(tmp_path, style):
    depth = 5000 if style != "block" else 200
    if style == "flow":
        text = "version: 1\nx: " + "[" * depth + "]" * depth + "\n"
    elif style == "flow-mapping":
        text = "version: 1\nx: " + "{a: " * depth + "1" + "}" * depth + "\n"
    else:
        text = "version: 1\n" + "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + "v: 1\n"
    p = write(tmp_path, "deep.yaml", text)
    msg = _refused_unexpanded(str(p))
    assert msg.startswith(f"{p}:") and "nested more than 64 levels deep" in msg, msg
    assert int(msg.split(":")[1]) == (2 if style != "block" else 65)


def test_huge_policy_file_and_value_are_refused_unread(tmp_path, monkeypatch):
    p = tmp_path / "huge.yaml"
    with open(p, "wb") as f:  # sparse: 64 MiB that nothing should read
        f.write(b"version: 1\n")
        f.truncate(64 * 2 ** 20)
    msg = _refused_unexpanded(str(p))
    assert msg == f"{p}: {64 * 2 ** 20} bytes; a policy is read only up to 1048576 bytes (1 MiB)", msg
    msg = _refused_unexpanded("low", overrides=["passes.checkpoint.keep=[" + "1," * 600_000 + "1]"])
    assert msg.startswith("--set ") and "bytes; a policy is read only up to 1048576 bytes" in msg


def test_many_aliases_and_long_extends_chains_are_refused(tmp_path):
    refs = ", ".join(["*a"] * 300)
    p = write(tmp_path, "refs.yaml", f"version: 1\na: &a 1\nb: [{refs}]\n")
    msg = _refused_unexpanded(str(p))
    assert msg.startswith(f"{p}:3:") and "more than 256 YAML aliases" in msg, msg
    write(tmp_path, "c0.yaml", "version: 1\n")
    for i in range(1, 40):
        write(tmp_path, f"c{i}.yaml", f"version: 1\nextends: ./c{i - 1}.yaml\n")
    msg = error(str(tmp_path / "c39.yaml"))
    assert "extends: the extends chain is longer than 32 files" in msg, msg
    assert load_policy(str(tmp_path / "c20.yaml")).version == 1  # 21 files: fine


def test_presets_read_the_same_with_limits():
    """What the limited reader makes of each preset is what PyYAML's safe loader makes of it (with the policy
    reader's float rule): limits change nothing for real policies."""
    from fxmem.policy_yaml import PolicyYamlLoader, parse_yaml
    for name in list_presets():
        text = preset_path(name).read_text()
        data, _ = parse_yaml(text, name)
        assert data == yaml.load(text, Loader=PolicyYamlLoader)
    # a realistic user file with anchors, merge keys and a --set value using them reads as before
    text = textwrap.dedent("""
        version: 1
        extends: high
        base: &base {enabled: true, solver: greedy}
        passes:
          checkpoint: {<<: *base, solver: auto}
    """)
    data, _ = parse_yaml(text, "user.yaml")
    assert data == yaml.load(text, Loader=PolicyYamlLoader)


def test_a_dict_policy_that_contains_itself_is_refused_naming_the_key():
    spec = {"version": 1, "passes": {}}
    spec["passes"]["checkpoint"] = spec
    msg = _refused_unexpanded(spec)
    assert msg.startswith("<dict> passes.checkpoint.passes") and "nested more than 64 levels deep" in msg, msg
    loop = []
    loop.append(loop)
    msg = _refused_unexpanded({"version": 1, "passes": {"checkpoint": {"keep": loop}}})
    assert msg.startswith("<dict> passes.checkpoint.keep") and "contains itself" in msg, msg
