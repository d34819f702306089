"""The table of Megatron-LM's flags (megatron_tawpipe/compat/flag_data/megatron_lm_flags.tsv): one class per
flag, in step with the parser and the rules, and the runtime answers every flag as its class says."""

import argparse
import importlib.util
import json

import pytest

from distributed_harness import run_ranks
from training_helpers import assert_close_rel, losses, tiny_args, train_rank

from megatron_tawpipe.arguments import ArgumentError, build_parser, parse_args
from megatron_tawpipe.compat import flag_rules, flag_table
from megatron_tawpipe.compat.megatron_lm import NOTICES, project_flags

TABLE = flag_table.read_table()
ROWS = sorted(TABLE.values(), key=lambda row: row.flag)
NO_EFFECT = [r for r in ROWS if r.cls == flag_rules.NO_EFFECT]
REFUSED = [r for r in ROWS if r.cls == flag_rules.REFUSED]
IMPLEMENTED = [r for r in ROWS if r.cls == flag_table.IMPLEMENTED]


def base():
    return tiny_args()


def words(row, value):
    """The flag with as many values as it takes."""
    count = {"0": 0, "?": 1, "+": 1, "*": 1}.get(row.nargs)
    return [row.flag] + [value] * (int(row.nargs) if count is None else count)


def test_every_flag_has_exactly_one_class():
    with open(flag_table.TABLE_PATH, encoding="utf-8") as handle:
        listed = [line.split("\t")[0] for line in handle if line.startswith("--")]
    assert len(listed) == len(set(listed)) == len(TABLE) > 1000
    for row in ROWS:
        assert row.cls in flag_table.CLASSES, row
        assert bool(row.reason) == (row.cls != flag_table.IMPLEMENTED), row
        assert "\n" not in row.reason and "\t" not in row.reason
    assert len(IMPLEMENTED) > 150 and len(NO_EFFECT) > 100 and len(REFUSED) > 300


def test_table_is_regenerated_from_the_recorded_parsers_and_the_rules():
    """python tools/megatron_lm_flags.py table gives the committed file (run it after changing the rules or
    the parser); the recorded lists hold every release's flags."""
    implemented = set(project_flags(build_parser()))
    text = flag_table.format_table(flag_table.build_table(flag_table.read_all_raw(), implemented))
    with open(flag_table.TABLE_PATH, encoding="utf-8") as handle:
        assert handle.read() == text, "the flag table is out of date: python tools/megatron_lm_flags.py table"
    raw = flag_table.read_all_raw()
    assert {len(raw["0.16"]), len(raw["0.19"])} == {680, 845}
    assert all(row.releases for row in ROWS)


def test_the_table_moves_a_flag_to_implemented_when_the_parser_defines_it():
    raw = flag_table.read_all_raw()
    rows = {r.flag: r for r in flag_table.build_table(raw, {"--moe-router-topk"})}
    assert rows["--moe-router-topk"].cls == flag_table.IMPLEMENTED
    rows = {r.flag: r for r in flag_table.build_table(raw, set())}
    topk = rows["--moe-router-topk"]
    assert topk.cls == flag_rules.REFUSED and "mixture-of-experts" in topk.reason


def test_implemented_flags_are_the_parsers_with_megatron_lms_defaults():
    ours = project_flags(build_parser())
    wrong_default, wrong_nargs = {}, {}
    for row in IMPLEMENTED:
        assert row.flag in ours, f"{row.flag} is implemented in the table but not defined by build_parser()"
        action = ours[row.flag]
        nargs = flag_table.action_nargs(action)
        if nargs != row.nargs and row.releases != flag_table.DEEPSPEED:
            wrong_nargs[row.flag] = (nargs, row.nargs)
        if row.default == flag_table.UNKNOWN or row.flag in flag_rules.DEFAULT_EXCEPTIONS:
            continue
        mine = json.loads(flag_table.json_default(action.default))
        if mine != row.default_value:
            wrong_default[row.flag] = (mine, row.default_value)
    assert not wrong_nargs, f"values per flag differ from Megatron-LM's: {wrong_nargs}"
    assert not wrong_default, (f"defaults differ from Megatron-LM's (list justified ones in flag_rules."
                               f"DEFAULT_EXCEPTIONS): {wrong_default}")
    for flag in flag_rules.DEFAULT_EXCEPTIONS:      # no stale exception
        assert TABLE[flag].cls == flag_table.IMPLEMENTED
        assert json.loads(flag_table.json_default(ours[flag].default)) != TABLE[flag].default_value, flag


def _without_notices(args):
    values = dict(vars(args))
    values.pop(NOTICES, None)
    return values


def test_no_effect_flags_give_one_notice_each_and_change_nothing(capsys, monkeypatch):
    from megatron_tawpipe.training.validate_args import validate_args

    plain = _without_notices(parse_args(base()))
    for row in NO_EFFECT:
        value = "1" if row.default_value in (flag_table.UNKNOWN, None, True, False) else str(row.default_value)
        given = words(row, value)
        args = parse_args(base() + given + given)       # given twice: still one notice
        notices = getattr(args, NOTICES)
        assert len(notices) == 1 and notices[0].startswith(row.flag) and row.reason in notices[0], (row, notices)
        assert _without_notices(args) == plain, row.flag
    # All of them in one run: validate_args prints each notice once.
    monkeypatch.setenv("RANK", "0")
    argv = base()
    for row in NO_EFFECT:
        argv += words(row, "1")
    capsys.readouterr()
    validate_args(parse_args(argv), world_size=1)
    out = capsys.readouterr().out.splitlines()
    for row in NO_EFFECT:
        mine = [line for line in out if line.startswith((f"notice: {row.flag}:", f"notice: {row.flag} "))]
        assert len(mine) == 1, (row.flag, mine)


def test_refused_flags_give_one_line_naming_them():
    for row in REFUSED:
        with pytest.raises(ArgumentError) as info:
            parse_args(base() + words(row, "not-the-default-7"))
        message = str(info.value)
        assert message.startswith(row.flag) and "\n" not in message and row.reason in message, (row, message)


def test_a_refused_flag_is_refused_except_at_megatron_lms_default():
    """Refused means refused for every value the table does not accept (tests/test_flag_values.py has the value
    rules): Megatron-LM's own default of a refused flag that takes a value is accepted with one notice
    (tests/test_flag_defaults.py), any other value refused naming the flag."""
    assert (TABLE["--moe-router-topk"].default_value, TABLE["--fp8-recipe"].default_value) == (2, "delayed")
    assert TABLE["--moe-router-topk"].accepted_values == TABLE["--fp8-recipe"].accepted_values == []
    assert TABLE["--moe-router-topk"].megatron_defaults == ["2"]
    assert TABLE["--fp8-recipe"].megatron_defaults == ["delayed"]
    for argv, message in ((["--moe-router-topk", "2"], "2 is Megatron-LM's default for --moe-router-topk; it has no "
                                                       "effect here because mixture-of-experts"),
                          (["--fp8-recipe", "delayed"], "delayed is Megatron-LM's default for --fp8-recipe; it has "
                                                        "no effect here because fp8 training is not supported yet")):
        notices = getattr(parse_args(base() + argv), NOTICES)
        assert len(notices) == 1 and notices[0].startswith(message), notices
    for argv, message in ((["--moe-router-topk", "4"], "--moe-router-topk 4: mixture-of-experts"),
                          (["--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise: fp8 training is not "
                                                           "supported yet")):
        with pytest.raises(ArgumentError, match="^" + message):
            parse_args(base() + argv)


def test_a_flag_the_table_lacks_is_unrecognized():
    with pytest.raises(ArgumentError, match=r"^unrecognized arguments: --not-a-megatron-flag$"):
        parse_args(base() + ["--not-a-megatron-flag"])


def test_answers_come_from_the_table_not_the_installed_megatron():
    """compat.megatron_lm imports nothing of megatron: the answers are the same under every release."""
    import ast
    import inspect

    from megatron_tawpipe.compat import megatron_lm

    for module in (megatron_lm, flag_table, flag_rules):
        tree = ast.parse(inspect.getsource(module))
        names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
        assert not [n for n in names if n.split(".")[0] in ("megatron", "torch")], (module.__name__, names)


def _megatron_lm_parser():
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.training") is None:
        return None
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        return None
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    return add_megatron_arguments(parser) or parser


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                    reason="megatron-core < 0.17 ships no megatron.training (CI's 0.16.1); checked under 0.19")
def test_installed_megatron_lm_parser_has_no_flag_missing_from_the_table():
    parser = _megatron_lm_parser()
    assert parser is not None
    missing = sorted(f.flag for f in flag_table.record_parser(parser) if f.flag not in TABLE)
    assert not missing, f"record the installed parser (tools/megatron_lm_flags.py record) and regenerate: {missing}"


# ---- megatron-core's own pipeline knobs ---------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "2", "--no-overlap-p2p-communication"],
     "--no-overlap-p2p-communication with --pipeline-schedule interleaved needs --pipeline-model-parallel-size > 2"),
    (["--pipeline-model-parallel-size", "2", "--overlap-p2p-communication-warmup-flush"],
     "--overlap-p2p-communication-warmup-flush needs --pipeline-schedule interleaved"),
    (["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1"),
])
def test_native_pipeline_knobs_refuse_what_megatron_core_refuses(extra, message):
    with pytest.raises(ArgumentError, match="^" + message):
        parse_args(base() + extra)


def test_native_pipeline_knobs_reach_megatron_cores_config_and_are_notices_under_weight_passing():
    from megatron_tawpipe.models.llama import native_pipeline_settings

    interleaved = parse_args(base() + ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
                                       "--overlap-p2p-communication-warmup-flush",
                                       "--microbatch-group-size-per-virtual-pipeline-stage", "4"])
    assert native_pipeline_settings(interleaved, 2, 2, False) == dict(
        overlap_p2p_comm=True, batch_p2p_comm=False, overlap_p2p_comm_warmup_flush=True,
        defer_embedding_wgrad_compute=False, wgrad_deferral_limit=0, microbatch_group_size_per_vp_stage=4)
    one_f_one_b = parse_args(base() + ["--pipeline-model-parallel-size", "2", "--defer-embedding-wgrad-compute",
                                       "--wgrad-deferral-limit", "3"])
    assert native_pipeline_settings(one_f_one_b, 2, None, True) == dict(
        overlap_p2p_comm=False, batch_p2p_comm=True, overlap_p2p_comm_warmup_flush=False,
        defer_embedding_wgrad_compute=True, wgrad_deferral_limit=3, microbatch_group_size_per_vp_stage=None)
    with pytest.raises(ValueError, match="--defer-embedding-wgrad-compute needs fused gradient accumulation"):
        native_pipeline_settings(one_f_one_b, 2, None, False)
    knobs = ["--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush",
             "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2", "--no-align-grad-reduce",
             "--disable-align-grad-reduce", "--no-align-param-gather",
             "--microbatch-group-size-per-virtual-pipeline-stage", "2"]
    assert not hasattr(parse_args(base() + ["--pipeline-schedule", "tawpipe"]), NOTICES)
    notices = getattr(parse_args(base() + ["--pipeline-schedule", "tawpipe"] + knobs), NOTICES)
    named = [n.split(":")[0] for n in notices]
    assert named == ["--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush",
                     "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "--no-align-grad-reduce",
                     "--no-align-param-gather", "--microbatch-group-size-per-virtual-pipeline-stage"]
    assert all("--pipeline-schedule tawpipe sends weights, not activations" in n for n in notices)


def test_interleaved_with_unaligned_reductions_matches_single_process():
    """Interleaved pp 2 x vp 2 x dp 2 with the distributed optimizer: Megatron-LM's default aligned gradient
    reduction and weight gather, and with --no-align-grad-reduce --no-align-param-gather and a micro-batch
    group of 4, train exactly like one process."""
    (reference,) = run_ranks(train_rank, 1, tiny_args())
    interleaved = ["--pipeline-schedule", "interleaved", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "2", "--use-distributed-optimizer",
                   "--overlap-grad-reduce", "--overlap-param-gather"]
    for extra in ([], ["--no-align-grad-reduce", "--no-align-param-gather",
                       "--microbatch-group-size-per-virtual-pipeline-stage", "4"]):
        for records in run_ranks(train_rank, 4, tiny_args(*interleaved, *extra)):
            assert_close_rel(losses(records), losses(reference), 1e-5, f"loss {extra}")
