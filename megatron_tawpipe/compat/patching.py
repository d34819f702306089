"""How a run-time patch is described, checked, applied and undone (the registry is :mod:`.patches`).

A :class:`Patch` replaces attributes (its :class:`Target` s, ``"module:qualname"``) of megatron-core, torch
or Python; :func:`check` is its self-check, :func:`apply` replaces and returns an :class:`Applied` whose
:meth:`~Applied.undo` puts the originals back (also as a ``with`` block). Nothing is replaced unless every
target resolves and fits, and only registered targets can be replaced. Imports neither torch nor megatron:
a target's module is imported when the patch is checked.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from megatron_tawpipe.common.errors import PatchError
from megatron_tawpipe.compat import versions

SCOPES = ("scoped", "process", "override")


@dataclasses.dataclass(frozen=True)
class Target:
    """An attribute a patch replaces or relies on: ``"module:qualname"``; ``a|b`` as the last name: the first
    of them the release has.

    ``params``: parameters the replacement relies on (the target must be callable and take them);
    ``callable``: False for a plain value (only its presence is checked); ``optional``: absent in some
    supported releases (skipped there); ``given``: owned by a higher layer of this package, whose user passes
    the owning class in (this layer imports nothing above ``common``)."""

    path: str
    params: Tuple[str, ...] = ()
    callable: bool = True
    optional: bool = False
    given: bool = False

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def owner_path(self) -> List[str]:
        return self.path.split(":", 1)[1].split(".")[:-1]

    @property
    def names(self) -> List[str]:
        return self.path.split(":", 1)[1].split(".")[-1].split("|")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One run-time change: what it replaces (``targets``), what it relies on and leaves alone
    (``relies_on``), why, who supplies the replacement (``user``), the releases it is written for and its
    scope: ``scoped`` (applied for an object's lifetime or a ``with`` block, then undone; ``shared``: users
    at the same time share one application), ``process`` (applied for the process; applying again replaces
    the values, the originals kept, unless something else has replaced a value since: that is then the
    original; undone only by tests), ``override`` (a subclass overriding a hook: nothing is replaced, only
    checked)."""

    name: str
    targets: Tuple[Target, ...]
    why: str
    user: str
    scope: str
    megatron_core: Optional[versions.Range] = versions.MEGATRON_CORE_RANGE
    torch: Optional[versions.Range] = versions.TORCH_RANGE
    relies_on: Tuple[Target, ...] = ()
    shared: bool = False

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"patch {self.name}: scope {self.scope!r} is not one of {SCOPES}")

    @property
    def written_for(self) -> str:
        ranges = (("megatron-core", self.megatron_core), ("torch", self.torch))
        return ", ".join(f"{package} {versions.specifier(r)}" for package, r in ranges if r) or "any release"


@functools.lru_cache(maxsize=None)
def installed_version(package: str) -> str:
    """The installed megatron-core or torch ("megatron-core", "torch"), also where it runs from a source tree."""
    found = versions.installed(package)
    if found is None:
        module = {"megatron-core": "megatron.core.package_info"}.get(package, package)
        try:
            found = getattr(importlib.import_module(module), "__version__", None)
        except ImportError:
            found = None
    return found or "not installed"


def _fail(patch: Patch, problem: str) -> PatchError:
    found = ", ".join(f"{p} {installed_version(p)}" for p, r in (("megatron-core", patch.megatron_core),
                                                                  ("torch", patch.torch)) if r)
    context = (f"installed {found}; " if found else "") + f"written for {patch.written_for}"
    return PatchError(f"patch {patch.name}: {problem} ({context})")


def _check_versions(patch: Patch) -> None:
    for package, bounds in (("megatron-core", patch.megatron_core), ("torch", patch.torch)):
        if bounds is None:
            continue
        found = installed_version(package)
        if found == "not installed" or not versions.in_range(found, bounds):
            raise _fail(patch, f"{package} {found} is outside the releases it is written for")


def _owner(patch: Patch, target: Target, owners: Mapping[str, Any]):
    """The object holding ``target``'s attribute."""
    if target.given:
        if target.path not in owners:
            raise _fail(patch, f"{target.path} belongs to this package: its user passes the owning class in")
        owner = owners[target.path]
        found = f"{getattr(owner, '__module__', '?')}:{getattr(owner, '__qualname__', '?')}"
        if found != f"{target.module}:{'.'.join(target.owner_path)}":
            raise _fail(patch, f"{target.path} was given {found} as its owner")
        return owner
    try:
        owner = importlib.import_module(target.module)
    except ImportError as exc:
        raise _fail(patch, f"cannot import {target.module} ({exc})") from None
    for name in target.owner_path:
        if not hasattr(owner, name):
            raise _fail(patch, f"{target.path} is missing: {target.module} has no {'.'.join(target.owner_path)}")
        owner = getattr(owner, name)
    return owner


def resolve(patch: Patch, target: Target, owners: Mapping[str, Any]) -> Optional[Tuple[Any, str]]:
    """``(owner, attribute)`` of ``target`` after checking its shape; None for an optional one that is absent."""
    owner = _owner(patch, target, owners)
    name = next((n for n in target.names if hasattr(owner, n)), None)
    if name is None:
        if target.optional:
            return None
        raise _fail(patch, f"{target.path} is missing")
    value = getattr(owner, name)
    if (target.callable or target.params) and not callable(value):
        raise _fail(patch, f"{target.path} is not callable ({type(value).__name__})")
    if target.params:
        try:
            parameters = inspect.signature(value).parameters
        except (TypeError, ValueError):
            raise _fail(patch, f"{target.path} has no signature to check") from None
        missing = [p for p in target.params if p not in parameters]
        if missing:
            raise _fail(patch, f"{target.path} no longer takes {', '.join(missing)} "
                               f"(it takes {', '.join(parameters) or 'nothing'})")
    return owner, name


def check(patch: Patch, owners: Optional[Mapping[str, Any]] = None) -> Dict[str, Tuple[Any, str]]:
    """The self-check: the installed releases are those ``patch`` is written for, and every target and
    everything it relies on is there with the expected shape; raises :class:`PatchError` naming the patch,
    the target and the installed versions otherwise. Returns ``{target path: (owner, attribute)}``."""
    owners = owners or {}
    _check_versions(patch)
    for target in patch.relies_on:
        resolve(patch, target, owners)
    found = {}
    for target in patch.targets:
        place = resolve(patch, target, owners)
        if place is not None:
            found[target.path] = place
    return found


class Applied:
    """One application of a patch; :meth:`undo` (or leaving a ``with`` block) ends it."""

    def __init__(self, state: "_State"):
        self._state: Optional[_State] = state

    def undo(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.release()

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


class _State:
    """A patch in place: the originals it replaced and how many users share it."""

    def __init__(self, patch: Patch):
        self.patch = patch
        self.users = 0
        self.saved: Dict[Tuple[int, str], list] = {}   # (id(owner), attr) -> [owner, attr, own, original, ours]

    def _ours(self, owner, name: str) -> Optional[list]:
        """What was saved of ``owner.name`` while the value there is still the one put there here."""
        saved = self.saved.get((id(owner), name))
        return saved if saved is not None and getattr(owner, name) is saved[4] else None

    def original(self, owner, name: str):
        saved = self._ours(owner, name)
        return saved[3] if saved else getattr(owner, name)

    def replace(self, owner, name: str, value) -> None:
        if self._ours(owner, name) is None:   # the first time, or replaced by someone else since: that is the original
            own = not inspect.isclass(owner) or name in vars(owner)   # a class's own, or inherited
            self.saved[(id(owner), name)] = [owner, name, own, getattr(owner, name), None]
        setattr(owner, name, value)
        self.saved[(id(owner), name)][4] = value

    def release(self) -> None:
        if _active.get(self.patch.name) is not self:   # ended already
            return
        self.users -= 1
        if self.users > 0:
            return
        for owner, name, own, original, _ in reversed(list(self.saved.values())):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        _active.pop(self.patch.name, None)


_active: Dict[str, _State] = {}


def is_applied(patch: Patch) -> bool:
    return patch.name in _active


def undo(patch: Patch) -> None:
    """End ``patch`` whoever applied it (a process's patch: tests)."""
    state = _active.get(patch.name)
    if state is not None:
        state.users = 1
        state.release()


def apply(patch: Patch, replace: Optional[Mapping[str, Any]] = None,
          wrap: Optional[Mapping[str, Callable[[Any], Any]]] = None,
          owners: Optional[Mapping[str, Any]] = None) -> Applied:
    """Check ``patch``, then set each target of ``replace`` to its value and each of ``wrap`` to
    ``wrapper(original)``; targets not named are left alone. Nothing is changed if any check fails."""
    replace, wrap = dict(replace or {}), dict(wrap or {})
    if patch.scope == "override":
        raise _fail(patch, "a subclass overrides the hook: there is nothing to apply, only to check")
    registered = {target.path for target in patch.targets}
    unknown = sorted((set(replace) | set(wrap)) - registered) + sorted(set(replace) & set(wrap))
    if unknown:
        raise _fail(patch, f"{', '.join(unknown)}: not a registered target of this patch (or given twice)")
    places = check(patch, owners)
    absent = sorted(path for path in set(replace) | set(wrap) if path not in places)
    if absent:
        raise _fail(patch, f"{', '.join(absent)}: absent in this release, nothing to replace")
    state = _active.get(patch.name)
    if state is not None and patch.scope == "scoped":
        if not patch.shared:
            raise _fail(patch, "already applied (one application at a time)")
        state.users += 1
        return Applied(state)
    new = [(*places[path], value) for path, value in replace.items()]
    for path, wrapper in wrap.items():
        owner, name = places[path]
        new.append((owner, name, wrapper(state.original(owner, name) if state else getattr(owner, name))))
    if state is None:
        state = _active[patch.name] = _State(patch)
        state.users = 1
    for owner, name, value in new:
        state.replace(owner, name, value)
    return Applied(state)
