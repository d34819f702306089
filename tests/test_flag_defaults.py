"""A refused Megatron-LM flag given at Megatron-LM's own default value (megatron_tawpipe/compat/flag_defaults.py):
accepted with one notice that says so and why it changes nothing, as pretrain_llama.py runs the command line;
every other value still refused, naming the flag; switches, unknown defaults and defaults that ask for what is
not done here stay refused. The values come from the recorded parsers' defaults (flag_data/raw_*.tsv)."""

import pytest

from training_helpers import flag_answer as answer, tiny_args, without_notices

from megatron_tawpipe.arguments import ArgumentError, parse_args
from megatron_tawpipe.compat import flag_defaults, flag_rules, flag_table, flag_values
from megatron_tawpipe.compat.megatron_lm import NOTICES

TABLE = flag_table.read_table()
OFFLOAD = ("CPU offloading is not supported: weights, activations and optimizer state stay on the device")


def words(row, value):
    """The flag given ``value`` (a string, or a list for a flag taking several values)."""
    return [row.flag] + (list(value) if isinstance(value, list) else [value])


# ---- the rule, from the recorded defaults ------------------------------------------------------------------

def test_the_accepted_defaults_are_the_recorded_parsers_defaults():
    """Each refused value-taking flag accepts exactly its recorded defaults (releases with the table's nargs,
    known, not None or empty), unless its default asks for what is not done here; no other row has any."""
    raw = flag_table.read_all_raw()
    by_source = {source: {entry.flag: entry for entry in raw[source]} for source in flag_table.SOURCES}
    wrong = []
    for row in TABLE.values():
        expected = []
        if row.cls == flag_rules.REFUSED and row.nargs != "0" and row.flag not in flag_defaults.DEFAULT_ASKS_FOR:
            for source in flag_table.SOURCES:
                entry = by_source[source].get(row.flag)
                if entry is None or entry.nargs != row.nargs or entry.default == flag_table.UNKNOWN:
                    continue
                value = flag_defaults.command_line_value(entry.default, row.nargs)
                if value is not None and value not in expected:
                    expected.append(value)
        if row.megatron_defaults != expected:
            wrong.append((row.flag, row.megatron_defaults, expected))
    assert not wrong, wrong
    assert flag_defaults.problems(TABLE.values(), raw) == []
    accepting = [row for row in TABLE.values() if row.megatron_defaults]
    assert len(accepting) >= 130 and all(row.nargs != "0" for row in accepting)


def test_every_accepted_default_gives_one_notice_and_changes_nothing():
    plain = without_notices(parse_args(tiny_args()))
    wrong = []
    for row in TABLE.values():
        for value in row.megatron_defaults:
            argv = words(row, value)
            try:
                args = parse_args(tiny_args() + argv + argv)        # given twice: still one notice
            except ArgumentError as exc:
                wrong.append((argv, str(exc)))
                continue
            notices = getattr(args, NOTICES)
            if flag_values.matches(value, row.accepted_values):     # a value rule answers with its own reason
                ok = notices == [f"{' '.join(argv)}: {row.no_effect_reason}"]
            else:
                ok = (len(notices) == 1 and notices[0].startswith(f"{flag_defaults.shown(value)} is Megatron-LM's "
                                                                  f"default for {row.flag}; it has no effect here "
                                                                  "because ")
                      and row.reason in notices[0] and "\n" not in notices[0])
            if not ok:
                wrong.append((argv, notices))
            elif without_notices(args) != plain:
                wrong.append((argv, "changed the arguments"))
    assert not wrong, wrong


# ---- as pretrain_llama.py runs a command line ----------------------------------------------------------------

class _Validated(Exception):
    """Raised where training would start: the command line was parsed and validated."""


def run_until_training(argv):
    """pretrain_llama.py's entry point (run_training) up to where training starts: 'validated', or its exit
    status where the command line is refused."""
    from megatron_tawpipe.cli.pretrain import run_training

    def stop(args):
        raise _Validated()

    try:
        return run_training(argv, prog="pretrain_llama.py", check=stop)
    except _Validated:
        return "validated"


def test_pretrain_llama_accepts_the_activation_offload_fraction_default_with_a_notice(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    for value in ("1.0", "1"):                 # compared as numbers: 1 == 1.0
        capsys.readouterr()
        assert run_until_training(tiny_args("--activation-offload-fraction", value)) == "validated"
        out = capsys.readouterr().out.splitlines()
        mine = [line for line in out if "--activation-offload-fraction" in line]
        assert mine == [f"notice: {value} is Megatron-LM's default for --activation-offload-fraction; it has no "
                        f"effect here because {OFFLOAD}"], out


def test_pretrain_llama_refuses_another_activation_offload_fraction_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    capsys.readouterr()
    assert run_until_training(tiny_args("--activation-offload-fraction", "0.5")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pretrain_llama.py: error: --activation-offload-fraction 0.5: {OFFLOAD}; accepted: "
                   "--activation-offload-fraction 0.0 or --activation-offload-fraction 1.0 (Megatron-LM's default)"]


def test_the_value_rule_still_answers_its_own_values():
    assert answer(["--activation-offload-fraction", "0.0"]) == ("accepted", [
        "--activation-offload-fraction 0.0: nothing is offloaded to the CPU: weights, activations and optimizer "
        "state stay on the device"])
    # A value both rules accept: the value rule's reason.
    assert answer(["--error-injection-rate", "0"]) == ("accepted", ["--error-injection-rate 0: no errors are injected"])
    # A value rule's refused example that was Megatron-LM's default was moved off it.
    assert answer(["--fim-rate", "0.5"])[0] == answer(["--optimizer-offload-fraction", "1.0"])[0] == "accepted"
    assert answer(["--fim-rate", "0.9"])[0] == answer(["--optimizer-offload-fraction", "0.5"])[0] == "refused"


# ---- comparing values -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--activation-offload-fraction", "1"], ["--activation-offload-fraction", "1.00"],
    ["--activation-offload-fraction", "1e0"], ["--fp8-interval", "1.0"], ["--moe-router-topk", "2"],
    ["--moe-router-topk", "2.0"], ["--fp8-margin", "-0"], ["--fp8-recipe", "delayed"],
    ["--moe-router-load-balancing-type", "aux_loss"], ["--moe-aux-loss-coeff", "0"],
])
def test_defaults_compare_as_numbers_where_numeric_and_as_strings_otherwise(argv):
    outcome, notices = answer(argv)
    assert outcome == "accepted" and len(notices) == 1 and f"Megatron-LM's default for {argv[0]}" in notices[0]


@pytest.mark.parametrize("argv", [
    ["--activation-offload-fraction", "0.99"], ["--moe-router-topk", "4"], ["--moe-router-topk", "two"],
    ["--fp8-recipe", "Delayed"], ["--fp8-recipe", "tensorwise"], ["--moe-aux-loss-coeff", "0", "0"],
    ["--activation-offload-fraction", "nan"],
])
def test_other_values_stay_refused_naming_the_flag(argv):
    outcome, line = answer(argv)
    assert outcome == "refused" and line.startswith(argv[0]) and "(Megatron-LM's default)" in line, line


# ---- what the rule leaves refused -------------------------------------------------------------------------------

def test_switches_stay_refused():
    """A refused switch (nargs 0) has no value to give: refused however Megatron-LM's default reads."""
    switches = [row for row in TABLE.values() if row.cls == flag_rules.REFUSED and row.nargs == "0"]
    assert len(switches) > 100 and not [row for row in switches if row.megatron_defaults]
    for flag, why in (("--fine-grained-activation-offloading", OFFLOAD), ("--optimizer-cpu-offload", OFFLOAD),
                      ("--use-legacy-models", "legacy models are gone")):
        assert TABLE[flag].nargs == "0"
        outcome, line = answer([flag])
        assert outcome == "refused" and line.startswith(f"{flag}: {why}"), line
    # The default of the parameter does not let the switch that turns the feature on through.
    outcome, line = answer(["--activation-offload-fraction", "1.0", "--fine-grained-activation-offloading"])
    assert outcome == "refused" and line.startswith("--fine-grained-activation-offloading"), line


def test_a_default_that_asks_for_what_is_not_done_here_stays_refused():
    assert TABLE["--rerun-mode"].default_value == "validate_results" and not TABLE["--rerun-mode"].megatron_defaults
    outcome, line = answer(["--rerun-mode", "validate_results"])
    assert outcome == "refused" and line.endswith("; accepted: --rerun-mode disabled"), line
    assert TABLE["--megatron-fsdp-main-params-dtype"].default_value == "fp32"
    assert answer(["--megatron-fsdp-main-params-dtype", "fp32"])[0] == "refused"


def test_unknown_none_or_empty_defaults_accept_nothing():
    for flag in ("--hierarchical-context-parallel-sizes", "--max-seqlen-per-dp-cp-rank", "--num-experts",
                 "--DDP-impl", "--zero-stage-3-max-live-parameters"):
        row = TABLE.get(flag)
        if row is None:
            continue
        assert row.default_value in (None, flag_table.UNKNOWN, "") and row.megatron_defaults == [], row
    assert flag_defaults.command_line_value("null", "1") is None
    assert flag_defaults.command_line_value('""', "1") is None
    assert flag_defaults.command_line_value("?", "1") is None
    assert flag_defaults.command_line_value("[]", "+") is None
    assert flag_defaults.command_line_value("false", "1") is None
    assert flag_defaults.command_line_value('["p2p"]', "+") == ["p2p"]
    assert flag_defaults.command_line_value("0.0", "+") == ["0.0"]


def test_context_parallel_flags():
    """--context-parallel-size is this project's own flag; --cp-comm-type p2p (Megatron-LM's default) is the ring
    this project runs; the other types and the hierarchical sizes are refused."""
    assert TABLE["--context-parallel-size"].cls == flag_table.IMPLEMENTED
    assert answer(["--context-parallel-size", "1"]) == ("accepted", [])
    outcome, notices = answer(["--cp-comm-type", "p2p"])
    assert outcome == "accepted" and notices == [
        "p2p is Megatron-LM's default for --cp-comm-type; it has no effect here because context parallelism here "
        "is megatron-core's p2p ring over --context-parallel-size ranks: the other communication types (a2a, "
        "allgather, a2a+p2p), hierarchical and hybrid context parallelism are not supported"]
    for argv in (["--cp-comm-type", "a2a"], ["--cp-comm-type", "p2p", "p2p"],    # per-layer lists: not the default
                 ["--hierarchical-context-parallel-sizes", "2", "2"]):
        outcome, line = answer(argv)
        assert outcome == "refused" and line.startswith(" ".join(argv) + ": context parallelism here"), line
    assert answer(["--cp-comm-type", "a2a"])[1].endswith("; accepted: --cp-comm-type p2p (Megatron-LM's default)")


# ---- defaults that differ between releases ---------------------------------------------------------------------

def test_defaults_that_differ_between_releases_are_reviewed():
    """The rule accepts every covered release's default; where the recorded defaults differ, the check fails
    until the flag is reviewed (DIFFERING_DEFAULTS or DEFAULT_ASKS_FOR)."""
    assert TABLE["--moe-deepep-num-sms"].megatron_defaults == ["20"]          # 0.16's (0.19 leaves it unset)
    assert answer(["--moe-deepep-num-sms", "20"])[0] == "accepted"
    assert answer(["--moe-deepep-num-sms", "24"])[0] == "refused"
    raw = flag_table.read_all_raw()
    changed = dict(raw)
    changed["0.19"] = [flag_table.RawFlag(e.flag, e.nargs, "1" if e.flag == "--fp8-margin" else e.default, e.origin)
                       for e in raw["0.19"]]
    rows = flag_table.build_table(changed, [row.flag for row in TABLE.values() if row.cls == flag_table.IMPLEMENTED])
    margin = next(row for row in rows if row.flag == "--fp8-margin")
    assert margin.megatron_defaults == ["0", "1"]
    assert flag_defaults.problems(rows, changed) == [
        "--fp8-margin: Megatron-LM's default differs between releases -- name it in flag_defaults."
        "DIFFERING_DEFAULTS (every release's default is safe here) or DEFAULT_ASKS_FOR"]


def test_a_stale_review_or_a_value_rule_example_at_the_default_is_reported(monkeypatch):
    raw = flag_table.read_all_raw()
    monkeypatch.setitem(flag_defaults.DIFFERING_DEFAULTS, "--fp8-margin", "reviewed")
    monkeypatch.setitem(flag_defaults.DEFAULT_ASKS_FOR, "--use-legacy-models", "a switch")
    monkeypatch.setitem(flag_values.VALUE_RULES, "--fim-rate", flag_values.ValueRule(("0.0",), "off", "0.5"))
    assert flag_defaults.problems(TABLE.values(), raw) == [
        "--use-legacy-models: DEFAULT_ASKS_FOR names it, but it is not a refused flag of the table that takes a "
        "value with a recorded default",
        "--fp8-margin: DIFFERING_DEFAULTS names it, but its recorded defaults do not differ",
        "--fim-rate: the value rule's 'on' example '0.5' is Megatron-LM's default, which is accepted; give another"]
