"""The run-time patches (megatron_tawpipe/compat/patches.py) and the supported releases (compat/versions.py):
every patch's self-check passes on the installed megatron-core and torch and fails loudly, naming the patch,
on a release it does not fit; apply and undo put the very originals back; setup.py requires the same range;
no code outside compat/ changes megatron-core's, torch's or Python's modules behind the registry's back."""

import ast
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_tawpipe.common.errors import PatchError
from megatron_tawpipe.compat import cpu as cpu_compat
from megatron_tawpipe.compat import patches, patching, versions
from megatron_tawpipe.compat.patching import Patch, Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_tawpipe")
RECORD = "megatron_tawpipe.monitor.metrics:MetricsWriter.record"


def _owners():
    from megatron_tawpipe.monitor.metrics import MetricsWriter

    return {RECORD: MetricsWriter}


def _installed(patch: Patch) -> list:
    return [patching.installed_version(p) for p, r in (("megatron-core", patch.megatron_core), ("torch", patch.torch))
            if r]


# ---------------------------------------------------------------------------------------------- self-checks
@pytest.mark.parametrize("name", sorted(patches.REGISTRY))
def test_every_registered_patch_passes_its_self_check(name):
    patches.check(name, _owners())


def _break(monkeypatch, patch: Patch, target: Target) -> None:
    """``target`` as a release without it (or with another signature) would have it."""
    owner, _ = patching.resolve(patch, target, _owners())
    for name in target.names:
        if not hasattr(owner, name):
            continue
        if target.params:   # another signature: none of the parameters the replacement relies on
            monkeypatch.setattr(owner, name, lambda: None)
        else:
            monkeypatch.delattr(owner, name)


@pytest.mark.parametrize("name", sorted(patches.REGISTRY))
def test_a_self_check_fails_loudly_naming_the_patch_where_its_target_is_missing(name, monkeypatch):
    patch = patches.get(name)
    target = next(t for t in patch.targets if not t.optional)
    _break(monkeypatch, patch, target)
    with pytest.raises(PatchError) as info:
        patches.check(name, _owners())
    message = str(info.value)
    assert message.startswith(f"patch {name}: {target.path} ") and "\n" not in message, message
    assert all(version in message for version in _installed(patch)), message


def test_what_a_patch_relies_on_is_checked_too(monkeypatch):
    patch = patches.get("checkpoint-write-results-queue")
    _break(monkeypatch, patch, patch.relies_on[0])
    with pytest.raises(PatchError, match="patch checkpoint-write-results-queue: .*get_write_results_queue is missing"):
        patches.check(patch.name)


@pytest.mark.parametrize("package,version", [("megatron-core", "0.20.0"), ("megatron-core", "0.15.3"),
                                             ("torch", "2.5.1")])
def test_a_self_check_refuses_a_release_outside_the_range_it_is_written_for(package, version, monkeypatch):
    real = patching.installed_version
    monkeypatch.setattr(patching, "installed_version", lambda p: version if p == package else real(p))
    with pytest.raises(PatchError) as info:
        patches.check("pipeline-transfer-waits")
    assert str(info.value).startswith(f"patch pipeline-transfer-waits: {package} {version} is outside")
    assert "written for megatron-core >=0.16,<0.20, torch >=2.6" in str(info.value)


def test_the_deferred_linear_layers_check_their_hook_when_built(monkeypatch):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron_tawpipe.models.deferred_linear import DeferredColumnParallelLinear, WgradStore

    monkeypatch.setattr(ColumnParallelLinear, "_forward_impl", lambda: None)
    layer = DeferredColumnParallelLinear.__new__(DeferredColumnParallelLinear)
    with pytest.raises(PatchError, match="patch deferred-linear-forward-impl: .*ColumnParallelLinear._forward_impl"):
        layer._init_deferred(WgradStore())


# ---------------------------------------------------------------------------------------------- apply / undo
def _stand_in(original):
    if not callable(original):
        return object()

    def stand_in(*args, **kwargs):
        return original(*args, **kwargs)

    return stand_in


@pytest.mark.parametrize("name", sorted(n for n, p in patches.REGISTRY.items() if p.scope != "override"))
def test_apply_then_undo_restores_every_original_object(name):
    if patches.is_applied(name):
        pytest.skip(f"{name} is in place in this process (the CPU layer applied by an earlier test)")
    patch = patches.get(name)
    places = patching.check(patch, _owners())
    originals = {path: getattr(owner, attr) for path, (owner, attr) in places.items()}
    applied = patches.apply(name, wrap={path: _stand_in for path in places}, owners=_owners())
    try:
        assert patches.is_applied(name)
        for path, (owner, attr) in places.items():
            assert getattr(owner, attr) is not originals[path], path
    finally:
        applied.undo()
    assert not patches.is_applied(name)
    for path, (owner, attr) in places.items():
        assert getattr(owner, attr) is originals[path], path


def test_an_override_is_only_checked():
    with pytest.raises(PatchError, match="nothing to apply"):
        patches.apply("deferred-linear-forward-impl")


def test_pipeline_waits_are_shared_by_trainers_alive_together_and_undone_by_the_last():
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron_tawpipe.baselines.native import report_pipeline_waits

    original = P2PCommunicator._communicate
    first, second = report_pipeline_waits(), report_pipeline_waits()
    reporting = P2PCommunicator._communicate
    assert reporting is not original
    first.undo()
    first.undo()   # twice: nothing more
    assert P2PCommunicator._communicate is reporting
    second.undo()
    assert P2PCommunicator._communicate is original


def test_the_collective_counter_and_its_iteration_snapshots_are_undone():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron_tawpipe.bench.collective_bytes import CollectiveCounter, install_in_training
    from megatron_tawpipe.monitor.metrics import MetricsWriter

    all_reduce, c10d_all_reduce, record = dist.all_reduce, c10d.all_reduce, MetricsWriter.record
    counter = CollectiveCounter(rank=0, ranks_per_node=1).install()
    snapshots = install_in_training(counter)
    assert dist.all_reduce is c10d.all_reduce and dist.all_reduce.__wrapped__ is all_reduce
    assert MetricsWriter.record is not record
    with pytest.raises(PatchError, match="patch collective-bytes: already applied"):
        CollectiveCounter(rank=0, ranks_per_node=1).install()
    snapshots.undo()
    counter.uninstall()
    assert dist.all_reduce is all_reduce and c10d.all_reduce is c10d_all_reduce and MetricsWriter.record is record


def test_a_process_patch_applied_again_keeps_the_first_original():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if patches.is_applied("checkpoint-write-results-queue"):
        pytest.skip("a checkpoint was written in this process")
    original, first, second = filesystem_async._results_queue, object(), object()
    applied = patches.apply("checkpoint-write-results-queue", replace={patches.WRITE_RESULTS_QUEUE: first})
    patches.apply("checkpoint-write-results-queue", replace={patches.WRITE_RESULTS_QUEUE: second})
    assert filesystem_async._results_queue is second
    applied.undo()
    assert filesystem_async._results_queue is original


def test_the_rank0_warning_hook_is_applied_once():
    from megatron_tawpipe.compat.extensions import missing_extension_warnings_once

    if patches.is_applied("rank0-warnings-once"):
        pytest.skip("in place in this process")
    with warnings.catch_warnings():   # the filters it adds go again
        original = warnings.showwarning
        missing_extension_warnings_once(0)
        hook = warnings.showwarning
        missing_extension_warnings_once(0)
        assert warnings.showwarning is hook is not original
        patches.undo("rank0-warnings-once")   # a process's patch: tests end it
        assert warnings.showwarning is original and not patches.is_applied("rank0-warnings-once")


# ---------------------------------------------------------------------------------------------- the mechanism
class Base:
    def hook(self, x):
        return x


class Derived(Base):
    def own(self, x):
        return x


def _local(*paths: str, **fields) -> Patch:
    return Patch(name="local", targets=tuple(Target(f"{__name__}:{p}", params=("x",)) for p in paths),
                 why="test", user="test", scope="scoped", megatron_core=None, torch=None, **fields)


def test_an_inherited_attribute_is_removed_again_not_copied():
    patch = _local("Derived.hook")
    with patching.apply(patch, replace={f"{__name__}:Derived.hook": lambda self, x: -x}):
        assert Derived().hook(2) == -2 and "hook" in vars(Derived)
    assert "hook" not in vars(Derived) and Derived.hook is Base.hook


def test_nothing_is_replaced_unless_every_target_fits(monkeypatch):
    patch = _local("Derived.own", "Base.hook")
    own = Derived.own
    monkeypatch.setattr(Base, "hook", lambda self: None)   # another signature
    with pytest.raises(PatchError, match="patch local: .*Base.hook no longer takes x"):
        patching.apply(patch, replace={f"{__name__}:Derived.own": lambda self, x: x})
    assert Derived.own is own and not patching.is_applied(patch)


def test_a_process_patch_replaced_by_someone_else_since_is_applied_over_what_is_there(monkeypatch):
    path = f"{__name__}:Derived.own"
    patch = Patch(name="local-process", targets=(Target(path, params=("x",)),), why="test", user="test",
                  scope="process", megatron_core=None, torch=None)
    wrap = {path: lambda original: lambda self, x: ("wrapped", original)}
    patching.apply(patch, wrap=wrap)

    def theirs(self, x):
        return x

    monkeypatch.setattr(Derived, "own", theirs)   # (as a test's warnings.catch_warnings() puts its hook back)
    applied = patching.apply(patch, wrap=wrap)
    assert Derived().own(1) == ("wrapped", theirs)
    applied.undo()
    assert Derived.own is theirs and not patching.is_applied(patch)


def test_only_registered_targets_are_replaced():
    with pytest.raises(PatchError, match="torch.cuda:is_available: not a registered target"):
        patches.apply("pipeline-transfer-waits", replace={"torch.cuda:is_available": lambda: True})


def test_the_cpu_layers_table_is_its_registered_patch():
    table = {f"{module}:{attr}" for module, attr, _ in cpu_compat._patch_table()}
    assert table == {target.path for target in patches.get("cpu-without-cuda").targets}


# ---------------------------------------------------------------------------------------------- the range
def test_the_range_helper():
    for accepted in ("0.16.0", "0.16.1", "0.17.0rc1", "0.19.2"):
        assert versions.in_range(accepted, versions.MEGATRON_CORE_RANGE), accepted
    for refused in ("0.15.0", "0.15.3", "0.20.0", "0.20.0rc0", "1.0"):
        assert not versions.in_range(refused, versions.MEGATRON_CORE_RANGE), refused
    assert versions.in_range("2.13.0+cpu", versions.TORCH_RANGE) and versions.in_range("2.6", versions.TORCH_RANGE)
    assert not versions.in_range("2.5.1", versions.TORCH_RANGE)
    assert versions.requirement("megatron-core") == "megatron-core>=0.16,<0.20"
    assert versions.parse_specifier("megatron-core>=0.16,<0.20") == ("0.16", "0.20")
    with pytest.raises(ValueError, match="only '>=' and '<'"):
        versions.parse_specifier("megatron-core~=0.16")


def test_setup_py_requires_the_supported_range(monkeypatch):
    import runpy
    import setuptools

    given = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    monkeypatch.chdir(ROOT)
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    required = {re.split(r"[<>=!~; \[]", r, maxsplit=1)[0]: r for r in given["install_requires"]}
    assert versions.parse_specifier(required["megatron-core"]) == versions.MEGATRON_CORE_RANGE == ("0.16", "0.20")
    assert versions.parse_specifier(required["torch"]) == versions.TORCH_RANGE


def test_versions_py_runs_on_its_own_without_torch():
    """setup.py runs it before torch and megatron-core are installed."""
    code = ("import runpy, sys; v = runpy.run_path(sys.argv[1]); "
            "assert not {'torch', 'megatron', 'megatron_tawpipe'} & set(sys.modules), sorted(sys.modules); "
            "print(v['requirement']('megatron-core'))")
    out = subprocess.run([sys.executable, "-I", "-c", code, os.path.join(PACKAGE, "compat", "versions.py")],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "megatron-core>=0.16,<0.20"


# ---------------------------------------------------------------------------------------------- nothing else
SCANNED = ("torch", "megatron", "warnings", "megatron_tawpipe")


def _changes(source: str):
    """``(line, what)`` of every assignment to an attribute of (and setattr/delattr on) a module or class
    imported from torch, megatron, warnings or this package, also through a name bound to one of them
    (``for module in (dist, c10d): setattr(module, ...)``, ``m = importlib.import_module(...)``)."""
    tree = ast.parse(source)
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in SCANNED)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in SCANNED:
            bound.update(a.asname or a.name for a in node.names)

    def refers(value) -> bool:
        while isinstance(value, ast.Attribute):
            value = value.value
        if isinstance(value, ast.Call):
            return "import_module" in ast.unparse(value.func)
        return isinstance(value, ast.Name) and value.id in bound

    for _ in range(3):   # names bound to such modules, then names bound to those
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and refers(node.value):
                bound.add(node.targets[0].id)
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) \
                    and isinstance(node.iter, (ast.Tuple, ast.List)) and any(refers(e) for e in node.iter.elts):
                bound.add(node.target.id)
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, ast.Delete) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args and refers(node.args[0]):
            yield node.lineno, ast.unparse(node)
        for target in targets:
            if isinstance(target, ast.Attribute) and refers(target.value):
                yield node.lineno, ast.unparse(target)


def test_the_scan_finds_a_change():
    source = ("import torch.distributed as dist\nimport torch.distributed.distributed_c10d as c10d\n"
              "from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator\n"
              "from megatron_tawpipe.monitor.metrics import MetricsWriter\nimport importlib\n"
              "P2PCommunicator._communicate = None\nMetricsWriter.record = None\n"
              "for module in (dist, c10d):\n    setattr(module, 'send', None)\n"
              "m = importlib.import_module('torch.cuda')\nm.synchronize = None\n"
              "def f(self, args):\n    self.x = args.y = 1\n")
    assert sorted(line for line, _ in _changes(source)) == [6, 7, 9, 11]


def test_no_module_outside_compat_changes_megatron_torch_or_python_modules():
    """Every run-time change goes through the registry (compat/patches.py)."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        if os.path.relpath(folder, PACKAGE).split(os.sep)[0] == "compat":
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    found += [f"{os.path.relpath(path, ROOT)}:{line}: {what}" for line, what in _changes(handle.read())]
    assert not found, "register these in megatron_tawpipe/compat/patches.py:\n" + "\n".join(found)
