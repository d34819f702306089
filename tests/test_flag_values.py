"""Flags answered by their value: every Megatron-LM flag of the table that takes a value and is refused or has
no effect, given the values that ask for what pretrain_llama.py does (accepted, one notice, nothing changed)
and a value that asks for what it does not do (refused in one line naming the accepted values). The answers
come from the committed table, so they are the same under megatron-core 0.16.1 and 0.19."""

import argparse
import importlib.util
import shlex

import pytest

from training_helpers import flag_answer as answer, tiny_args, without_notices

from megatron_tawpipe.arguments import ArgumentError, parse_args
from megatron_tawpipe.compat import flag_defaults, flag_rules, flag_table, flag_values
from megatron_tawpipe.compat.megatron_lm import NOTICES

TABLE = flag_table.read_table()
VALUED = sorted((row for row in TABLE.values() if row.nargs != "0" and row.cls != flag_table.IMPLEMENTED),
                key=lambda row: row.flag)
RULED = [row for row in VALUED if row.accepted_values]


def given(row, value):
    """The flag with ``value`` as each of the values it takes."""
    count = {"?": 1, "+": 1, "*": 1}.get(row.nargs)
    return [row.flag] + [value] * (int(row.nargs) if count is None else count)


def plain_value(row):
    """A value to give a flag: Megatron-LM's default where it is one word or number, else 1."""
    value = row.default_value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or value == "":
        return "1"
    return str(value)


def test_the_table_decides_every_value_taking_flag():
    """Every refused flag that takes a value has its accepted values or is said to have none; the rules name
    only such flags, and the table holds them as the rules say."""
    assert flag_values.problems(TABLE.values()) == []
    assert {row.flag for row in RULED} == set(flag_values.VALUE_RULES)
    for row in RULED:
        rule = flag_values.VALUE_RULES[row.flag]
        assert row.cls == flag_rules.REFUSED and tuple(row.accepted_values) == rule.values, row
        assert row.no_effect_reason == rule.reason and "\t" not in rule.reason and "\n" not in rule.reason
    assert not [row for row in TABLE.values() if row.cls != flag_rules.REFUSED and row.accepted_values]
    assert flag_values.rule_count() == sum(len(row.accepted_values) for row in RULED) >= 25
    assert len(VALUED) > 400


def test_an_undecided_flag_or_a_stale_rule_is_reported():
    new = flag_table.Row("--a-new-release-flag", "1", "null", "0.20", flag_rules.REFUSED, "not supported")
    assert flag_values.problems(list(TABLE.values()) + [new]) == [
        "--a-new-release-flag: undecided -- give it a rule in VALUE_RULES (values that ask for what "
        "pretrain_llama.py does) or name it in WITHOUT_OFF_VALUE"]
    implemented = dict(TABLE)
    implemented["--rerun-mode"] = flag_table.Row("--rerun-mode", "1", '"validate_results"', "0.19",
                                                 flag_table.IMPLEMENTED, "")
    assert flag_values.problems(implemented.values()) == [
        "--rerun-mode: VALUE_RULES names it, but it is not a refused flag of the table that takes a value"]


def test_off_values_are_accepted_with_one_notice_and_change_nothing():
    plain = without_notices(parse_args(tiny_args()))
    wrong = []
    for row in VALUED:
        values = row.accepted_values if row.cls == flag_rules.REFUSED else [plain_value(row)]
        reason = row.no_effect_reason if row.cls == flag_rules.REFUSED else row.reason
        for value in values:
            argv = given(row, value)
            try:
                args = parse_args(tiny_args() + argv + argv)        # given twice: still one notice
            except ArgumentError as exc:
                wrong.append((argv, str(exc)))
                continue
            notices = getattr(args, NOTICES)
            if len(notices) != 1 or not notices[0].startswith(row.flag) or reason not in notices[0]:
                wrong.append((argv, notices))
            elif without_notices(args) != plain:
                wrong.append((argv, "changed the arguments"))
    assert not wrong, wrong


def test_numbers_are_accepted_however_they_are_written():
    for argv in (["--num-experts", "0"], ["--num-experts", "00"], ["--sample-rate", "1"],
                 ["--sample-rate", "1.00"], ["--glu-linear-offset", "0"], ["--glu-linear-offset", "-0.0"],
                 ["--null-tokenizer-pad-id", "-1"], ["--mid-level-dataset-surplus", "5e-3"]):
        assert answer(argv)[0] == "accepted", argv
    for argv in (["--num-experts", "0.0"], ["--sample-rate", "0.99"], ["--null-tokenizer-pad-id", "1"],
                 ["--rerun-mode", "Disabled"], ["--recompute-modules", "core_attn", "mlp"]):
        assert answer(argv)[0] == "refused", argv


def test_an_on_value_is_refused_naming_the_accepted_values():
    """(Megatron-LM's own default of a flag is accepted: tests/test_flag_defaults.py.)"""
    wrong = []
    for row in VALUED:
        if row.cls != flag_rules.REFUSED:
            continue
        rule = flag_values.VALUE_RULES.get(row.flag)
        value = rule.on if rule else plain_value(row)
        if not rule and row.megatron_defaults:
            value = "not-the-default-7"
        outcome, line = answer(given(row, value))
        accepted = " or ".join([f"{row.flag} {shlex.quote(v)}" for v in row.accepted_values] + [
            f"{row.flag} {flag_defaults.shown(v)} (Megatron-LM's default)" for v in row.megatron_defaults
            if not flag_values.matches(v, row.accepted_values)])
        if outcome != "refused" or not line.startswith(row.flag) or row.reason not in line or "\n" in line:
            wrong.append((row.flag, value, outcome, line))
        elif (rule or row.megatron_defaults) and not line.endswith(f"; accepted: {accepted}"):
            wrong.append((row.flag, value, line))
    assert not wrong, wrong


def test_rerun_mode_disabled_is_accepted_and_the_modes_that_rerun_are_refused():
    outcome, notices = answer(["--rerun-mode", "disabled"])
    assert outcome == "accepted" and notices == [
        "--rerun-mode disabled: each iteration runs once (megatron-core's rerun state machine, where a schedule "
        "uses it, stays in its disabled mode); a NaN loss or gradient stops the run "
        "(--check-for-nan-in-loss-and-grad), as in Megatron-LM's disabled mode"]
    for mode in ("validate_results", "report_stats"):
        assert answer(["--rerun-mode", mode]) == (
            "refused", f"--rerun-mode {mode}: gradient / loss checks beyond NaN detection are not made "
                       "(--check-for-nan-in-loss-and-grad is); accepted: --rerun-mode disabled")
    # An accepted value does not let a refused one through.
    assert answer(["--rerun-mode", "disabled", "--num-experts", "8"])[0] == "refused"
    assert answer(["--config-logger-dir", ""]) == ("accepted", [
        "--config-logger-dir '': an empty directory writes no configuration dumps, as here"])


def _megatron_lm_parser():
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False, exit_on_error=False)
    return add_megatron_arguments(parser) or parser


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron-core < 0.17 ships no megatron.training (CI's 0.16.1); checked under 0.19")
def test_the_accepted_and_on_values_are_values_megatron_lms_parser_takes():
    """Under a release that ships Megatron-LM's parser: each accepted value and each rule's 'on' value is one
    the flag takes there (its type and choices), so the rules speak of the flag's real values."""
    parser = _megatron_lm_parser()
    actions = parser._option_string_actions
    checked = 0
    for row in RULED:
        if row.flag not in actions:        # a flag of another source (Megatron-DeepSpeed's)
            continue
        rule = flag_values.VALUE_RULES[row.flag]
        for value in row.accepted_values + [rule.on]:
            parsed, _ = parser.parse_known_args(given(row, value))
            assert parsed is not None, (row.flag, value)
            checked += 1
    assert checked >= 40
