"""Network namespaces and tc from Python: the ``ip``/``tc`` commands the emulated cluster runs.

Running a command (:func:`run`), the prerequisites (root, ``ip`` and ``tc``), listing, probing and
deleting namespaces — including :func:`cleanup_stale`, which removes what a killed (SIGKILL)
emulated cluster left behind — the per-namespace ``/etc/netns/NAME`` directory, and the htb
commands that shape one interface (:func:`htb_commands`, with tc's size syntax for the burst).

Namespaces this package creates are named ``twp<pid>n<k>`` (nodes), ``twp<pid>sw`` (the switch),
optionally with ``c<i>`` after the pid, or ``twp<pid>probe``. Requires root (CAP_NET_ADMIN and
CAP_SYS_ADMIN) and iproute2. No torch.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from typing import List, Sequence, Tuple

from megatron_tawpipe.common.errors import ClusterError

NAME_PREFIX = "twp"
NETNS_ETC = "/etc/netns"
ROOT_MESSAGE = "needs root (CAP_NET_ADMIN) to create network namespaces"
HTB_QUANTUM = 200000

_STALE_RE = re.compile(r"^%s(\d+)(?:c\d+)?(?:n\d+|sw|probe)$" % NAME_PREFIX)
_TC_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)b?\s*$", re.IGNORECASE)
_TC_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (text output captured); with ``check``, raise ClusterError naming it if it fails."""
    proc = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{shlex.join(argv)}` failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def check_prerequisites() -> None:
    """Raise ClusterError unless we are root and ``ip`` and ``tc`` are installed."""
    if os.geteuid() != 0:
        raise ClusterError(f"{ROOT_MESSAGE}; run as root (e.g. with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2")


def list_namespaces() -> List[str]:
    """Names of the network namespaces registered under /var/run/netns."""
    proc = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def namespaces_available() -> Tuple[bool, str]:
    """Whether network namespaces can be created here, and why not if they cannot."""
    try:
        check_prerequisites()
    except ClusterError as e:
        return False, str(e)
    name = f"{NAME_PREFIX}{os.getpid()}probe"
    proc = run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        return False, (f"`ip netns add` failed: {proc.stderr.strip()} ({ROOT_MESSAGE}, "
                       "and a writable /var/run/netns)")
    run(["ip", "netns", "delete", name], check=False)
    return True, ""


def add_namespace(name: str) -> None:
    """``ip netns add NAME``; ClusterError (saying root is needed) if that fails."""
    proc = run(["ip", "netns", "add", name], check=False)
    if proc.returncode != 0:
        raise ClusterError(f"`ip netns add {name}` failed: {proc.stderr.strip()} ({ROOT_MESSAGE})")


def delete_namespace(name: str) -> None:
    """``ip netns delete NAME`` (errors ignored) and its /etc/netns/NAME."""
    run(["ip", "netns", "delete", name], check=False)
    remove_etc(name)


def remove_etc(name: str) -> None:
    """Remove /etc/netns/NAME (the per-namespace hosts file) and /etc/netns if left empty."""
    path = os.path.join(NETNS_ETC, name)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(NETNS_ETC)
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def netns_pids(name: str) -> List[int]:
    """Processes running inside namespace ``name``."""
    proc = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def kill_namespace_processes(names: Sequence[str], grace: float) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL, every process inside ``names``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        pids = [pid for name in names for pid in netns_pids(name)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(netns_pids(name) for name in names):
                return
            time.sleep(0.05)


def cleanup_stale(prefix: str = NAME_PREFIX, grace: float = 2.0) -> List[str]:
    """Delete namespaces left by earlier invocations that were killed with SIGKILL.

    Only namespaces named like ours (``twp<pid>n<k>``, ``twp<pid>sw``, optionally
    with ``c<i>`` after the pid) whose creating process no longer exists are
    touched.  Processes still running inside them are killed first.  Returns
    the deleted names.
    """
    stale = []
    for name in list_namespaces():
        m = _STALE_RE.match(name)
        if m and name.startswith(prefix) and not pid_alive(int(m.group(1))):
            stale.append(name)
    kill_namespace_processes(stale, grace)
    for name in stale:
        delete_namespace(name)
    return stale


# ------------------------------------------------------------------------------------------ shaping (tc)
def check_tc_size(size: str) -> str:
    """``size`` stripped, if it is a tc size (``2m``, ``64k``, ``15000``, ``2mb``); else ValueError."""
    if not _TC_SIZE_RE.match(str(size)):
        raise ValueError(f"bad size {size!r}: use a tc size such as 2m, 64k or 15000")
    return str(size).strip()


def tc_size_bytes(size: str) -> int:
    """Bytes of a tc size: as tc reads it, k/m/g are powers of 1024 (``2m`` is 2 MiB)."""
    m = _TC_SIZE_RE.match(str(size))
    if not m:
        raise ValueError(f"bad size {size!r}: use a tc size such as 2m, 64k or 15000")
    return int(float(m.group(1)) * _TC_SIZE_UNITS[m.group(2).lower()])


def htb_commands(namespace: str, dev: str, rate: str, burst: str) -> List[List[str]]:
    """The tc commands that shape what ``dev`` of ``namespace`` sends to ``rate`` (a tc rate, passed
    as written): an htb root qdisc with one class, ``rate R ceil R burst B cburst B``."""
    return [["tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
             "default", "10"],
            ["tc", "-n", namespace, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
             "rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", str(HTB_QUANTUM)]]


def unshape(namespace: str, dev: str) -> None:
    """Delete the root qdisc of ``dev`` (errors ignored: there may be none)."""
    run(["tc", "-n", namespace, "qdisc", "del", "dev", dev, "root"], check=False)
