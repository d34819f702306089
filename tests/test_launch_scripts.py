"""Published Megatron-LM launch scripts of dense GPT / Llama models, run with only the schedule changed.

Each file in ``tests/data/megatron_lm_scripts/`` holds one script's flags (``flags``, in the script's order;
``{...}`` stand for the paths the script takes from its environment), where it was published (``source``), how
it is scaled to CPU sizes (``scaled``: a flag's value replaced, never the flag) and what is swapped for a CPU
(``replaced``: each swap with its reason). Nothing else is changed: the command line is those flags plus
``--pipeline-schedule tawpipe``, on 2 CPU ranks. A flag that still stops a script is listed in ``STOPS`` with
the line that stops it: the script then runs without it (nothing else may stop it) and counts as an expected
failure, until the flag is answered and its entry has to go.

The CPU swaps, all listed in the data files:
  * ``--transformer-impl transformer_engine`` -> ``local`` and ``--attention-backend unfused`` -> ``local``:
    Transformer Engine's kernels need a CUDA GPU; ``local`` is megatron-core's own layers and attention.
  * ``--distributed-backend nccl`` -> ``gloo``: NCCL needs CUDA GPUs.
  * data and tokenizer files that are not public or not here (cluster blends, CI data sets, GPT-2 BPE files,
    Hugging Face hub tokenizers) -> the project's default corpus (built once per test session, as
    ``tools/build_default_corpus.py`` builds it) and its SentencePiece model; for another SentencePiece tokenizer type
    (its special tokens give other ids) part of the corpus is tokenized again by ``tools/preprocess_data.py``.
Pipeline sizes above 2 become 2 (the 2 ranks, which the weight pipeline takes); tensor parallel sizes become 1.
"""

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from distributed_harness import run_ranks

SCRIPTS_DIR = Path(__file__).parent / "data" / "megatron_lm_scripts"
SCRIPTS = sorted(path.stem for path in SCRIPTS_DIR.glob("*.json"))
REPO_ROOT = Path(__file__).resolve().parent.parent
RANKS = 2
CORPUS_DOCUMENTS = 300                            # of the default corpus, for a tokenizer type of its own


@functools.lru_cache(maxsize=1)
def default_corpus() -> Path:
    """The default corpus and its SentencePiece model (SentencePieceTokenizer's ids), built in the system's
    temporary folder (a clean clone has no data/default) and reused while its manifest matches."""
    from megatron_tawpipe.data.default_corpus import build_default_corpus

    out = Path(tempfile.gettempdir()) / f"tawpipe-launch-scripts-corpus-py{sys.version_info[0]}{sys.version_info[1]}"
    build_default_corpus(str(out), workers=1, log=lambda line: None)
    return out


def load_script(name):
    return json.loads((SCRIPTS_DIR / f"{name}.json").read_text())


def flag_items(tokens):
    """``[--flag, value, --switch, ...]`` as ``[(flag, value or None), ...]``."""
    items = []
    for token in tokens:
        if token.startswith("--"):
            items.append([token, None])
        else:
            assert items and items[-1][1] is None, f"value {token!r} follows no flag"
            items[-1][1] = token
    return [tuple(item) for item in items]


def cpu_items(script):
    """The script's flags with ``scaled`` values and ``replaced`` swaps applied, in the script's order (a swap's
    new flags take the place of its first flag)."""
    items = flag_items(script["flags"])
    scaled = dict(script["scaled"])
    for i, (flag, value) in enumerate(items):
        if flag in scaled:
            assert value is not None, f"{flag} takes no value to scale"
            items[i] = (flag, scaled.pop(flag))
    assert not scaled, f"scaled flags the script does not give: {sorted(scaled)}"
    for swap in script["replaced"]:
        old = flag_items(swap["flags"])
        positions = [items.index(item) for item in old]      # ValueError: the swap names what the script lacks
        first = min(positions)
        items = items[:first] + flag_items(swap["with"]) + [
            item for i, item in enumerate(items[first:], first) if i not in positions]
    return items


def corpus_for(tokenizer_type, root):
    """The default corpus's data prefix as ``tokenizer_type`` tokenizes it with the default SentencePiece model:
    the committed one for SentencePieceTokenizer, else the first documents preprocessed by tools/preprocess_data.py
    (ids differ between SentencePiece tokenizer types: their special tokens differ)."""
    if tokenizer_type == "SentencePieceTokenizer":
        return default_corpus() / "corpus_text_document"
    prefix = root / tokenizer_type / "corpus"
    if not prefix.parent.exists():
        prefix.parent.mkdir(parents=True)
        with open(default_corpus() / "corpus.jsonl") as source:
            documents = [next(source) for _ in range(CORPUS_DOCUMENTS)]
        (prefix.parent / "corpus.jsonl").write_text("".join(documents))
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"),
                               "--input", str(prefix.parent / "corpus.jsonl"), "--append-eod", "--workers", "1",
                               "--output-prefix", str(prefix), "--tokenizer-type", tokenizer_type,
                               "--tokenizer-model", str(default_corpus() / "tokenizer.model")],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(f"{prefix}_text_document")


def cpu_argv(script, tmp, corpora=None):
    """The command line: the script's flags scaled and swapped, paths filled in, ``--pipeline-schedule tawpipe``."""
    items = cpu_items(script)
    corpus = default_corpus() / "corpus_text_document"
    if corpora is not None and any(value and "{corpus}" in value for _, value in items):
        corpus = corpus_for(dict(items).get("--tokenizer-type"), corpora)
    paths = {"save": tmp / "ckpt", "tensorboard": tmp / "tensorboard", "data_cache": tmp / "cache",
             "wandb": tmp / "wandb", "wandb_exp": "launch-script", "corpus": corpus,
             "tokenizer_model": default_corpus() / "tokenizer.model"}
    argv = []
    for flag, value in items:
        argv.append(flag)
        if value is not None:
            for name, path in paths.items():
                value = value.replace("{" + name + "}", str(path))
            assert "{" not in value, f"{flag} {value}: a path placeholder the test does not fill"
            argv.append(value)
    return argv + ["--pipeline-schedule", "tawpipe"]


def _train_rank(rank, argv):
    """One rank: Megatron-LM's order (parse, validate flags and data, train). A refused flag comes back as its line."""
    from megatron_tawpipe.arguments import parse_args
    from megatron_tawpipe.data import validate_data_args
    from megatron_tawpipe.distributed.initialize import destroy
    from megatron_tawpipe.training import pretrain
    from megatron_tawpipe.training.forward_step import gpt_forward_step
    from megatron_tawpipe.training.validate_args import validate_args

    try:
        args = validate_args(parse_args(argv))
        validate_data_args(args)
    except (ValueError, FileNotFoundError) as exc:        # ArgumentError is a ValueError
        return {"refused": str(exc)}
    try:
        return {"records": [record.to_json() for record in pretrain(args, gpt_forward_step)]}
    finally:
        destroy()


def run_script(argv):
    """``("records", records)`` of the last rank, or ``("refused", line)`` when the flags stop the run."""
    per_rank = run_ranks(_train_rank, RANKS, argv, timeout=600)
    refused = [result["refused"] for result in per_rank if "refused" in result]
    return ("refused", refused[0]) if refused else ("records", per_rank[-1]["records"])


def train(argv):
    outcome, value = run_script(argv)
    assert outcome == "records", f"stopped at: {value}"
    return value


def without(argv, flag):
    """``argv`` less ``flag`` and its values."""
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


# Flags that still stop a script here, each with the start of the line that stops it. Such a script is run
# without them, to show that nothing else stops it, and is reported as an expected failure; once a flag is
# answered, its entry must go (the test fails while an entry names a flag that no longer stops the script).
STOPS = {}

# Resume tests that fail here, with what the failure says.
RESUME_FAILS = {}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return tmp_path_factory.mktemp("corpora")


def test_scripts_are_recorded_with_sources():
    """At least six scripts, each with its repository, path and commit, and a reason for every swap."""
    assert len(SCRIPTS) >= 6
    for name in SCRIPTS:
        script = load_script(name)
        assert set(script["source"]) >= {"repository", "path", "commit", "date"}, name
        assert len(script["source"]["commit"]) == 40, name
        assert all(swap["why"] for swap in script["replaced"]), name


def test_published_off_values_are_answered_by_their_value():
    """A refused flag that a script gives the value asking for what this project does (NVIDIA's
    gpt3_mcore_reruns_disable gives --rerun-mode disabled) is accepted for that value, with its notice."""
    from megatron_tawpipe.compat.flag_table import read_table

    table = read_table()
    answered = []
    for name in SCRIPTS:
        for flag, value in cpu_items(load_script(name)):
            row = table.get(flag)
            if row is not None and row.accepted_values:
                assert row.answer(value) == ("no-effect", row.no_effect_reason), (name, flag, value)
                answered.append((flag, value))
    assert ("--rerun-mode", "disabled") in answered


@pytest.mark.parametrize("script", SCRIPTS)
def test_nothing_but_the_listed_swaps_leaves_the_command_line(script, tmp_path):
    """Every flag of the script reaches the command line with its value, or its scaled value; only the flags a
    swap names are exchanged, for the flags it gives."""
    data = load_script(script)
    final = flag_items(cpu_argv(data, tmp_path))
    swapped_out = {flag for swap in data["replaced"] for flag, _ in flag_items(swap["flags"])}
    swapped_in = {flag for swap in data["replaced"] for flag, _ in flag_items(swap["with"])}
    finals = dict(final)
    for flag, value in flag_items(data["flags"]):
        if flag in swapped_out:
            continue
        assert flag in finals, f"{flag} was dropped"
        assert finals[flag] == data["scaled"].get(flag, value) or "{" in (value or ""), (flag, finals[flag])
    added = {flag for flag, _ in final} - {flag for flag, _ in flag_items(data["flags"])}
    assert added <= swapped_in | {"--pipeline-schedule"}, added


@pytest.mark.parametrize("script", SCRIPTS)
def test_launch_script_trains_under_tawpipe(script, corpora, tmp_path, monkeypatch):
    """The script's command line (scaled, CPU swaps only) trains under tawpipe on 2 CPU ranks."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    data = load_script(script)
    argv = cpu_argv(data, tmp_path, corpora)
    stops = dict(STOPS.get(script, {}))
    stopped = []
    while True:
        outcome, value = run_script(argv)
        if outcome == "records":
            break
        flag = next((f for f, line in stops.items() if value.startswith(line)), None)
        assert flag is not None, f"stopped at: {value}"
        stopped.append(value)
        del stops[flag]
        argv = without(argv, flag)
    assert not stops, f"no longer stopped by {sorted(stops)}: remove them from STOPS"
    expect = data["expect"]
    assert_trained(value, argv, expect, tmp_path)
    if "resume_to" in expect:       # the script is a resume test: the same command, longer, picks up the run
        try:
            assert_resumes(argv, expect, tmp_path / "ckpt")
        except AssertionError as exc:
            if script not in RESUME_FAILS or RESUME_FAILS[script] not in str(exc):
                raise
            stopped.append(f"resuming: {RESUME_FAILS[script]}")
        else:
            assert script not in RESUME_FAILS, "resumes now: remove its RESUME_FAILS entry"
    if stopped:
        pytest.xfail("stops at: " + " | ".join(stopped))


def assert_trained(records, argv, expect, tmp_path):
    iterations = expect["iterations"]
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1)), records
    loss = [r["lm_loss"] for r in records]
    assert all(math.isfinite(value) for value in loss), loss
    vocab = 250 if "NullTokenizer" in argv else 8000
    # A fresh model guesses about uniformly over its (padded) vocabulary; two or three steps barely move that.
    assert 0.8 * math.log(vocab) < loss[0] < 1.25 * math.log(vocab), loss
    assert loss[-1] <= loss[0] * 1.02, loss

    save = tmp_path / "ckpt"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(iterations)
    assert (save / f"iter_{iterations:07d}").is_dir()
    for kept in expect.get("checkpoints_kept", []):
        assert (save / f"iter_{kept:07d}").is_dir(), sorted(os.listdir(save))
    for removed in expect.get("checkpoints_removed", []):
        assert not (save / f"iter_{removed:07d}").exists(), sorted(os.listdir(save))
    if "--log-progress" in argv:      # Megatron-LM's line for every save (its prefix says whether it is async)
        prefix = "Saving async checkpoint" if "--async-save" in argv else "Saved checkpoint"
        assert f"{prefix}\tIteration: {iterations}\t" in (save / "progress.txt").read_text()
    if "--tensorboard-dir" in argv:
        assert any(name.startswith("events.") for name in os.listdir(tmp_path / "tensorboard"))


def assert_resumes(argv, expect, save):
    argv = list(argv)
    argv[argv.index("--train-iters") + 1] = str(expect["resume_to"])
    resumed = train(argv)
    assert [r["iteration"] for r in resumed] == list(range(expect["iterations"] + 1, expect["resume_to"] + 1)), resumed
    assert math.isfinite(resumed[-1]["lm_loss"])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(expect["resume_to"])
