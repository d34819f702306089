"""The emulated cluster as :func:`megatron_tawpipe.bench.benchmark.run_benchmark` takes it (``cluster=``):
namespaces left by killed runs deleted, the cluster built and described, and torn down after the runs."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

from tawpipe_lab.emulated_cluster import EmulatedCluster
from tawpipe_lab.netns import cleanup_stale


@contextlib.contextmanager
def benchmark_cluster(nodes: int, ranks_per_node: int, rate: str, burst: Optional[str] = None,
                      progress: Callable[[str], None] = print) -> Iterator[EmulatedCluster]:
    """``nodes`` x ``ranks_per_node`` with links shaped to ``rate`` (htb ``burst``, default the links')."""
    kwargs = {} if burst is None else {"burst": burst}
    gone = cleanup_stale()
    if gone:
        progress(f"deleted {len(gone)} network namespace(s) left by killed runs: {' '.join(gone)}")
    with EmulatedCluster(nodes, ranks_per_node, rate, **kwargs) as cluster:
        progress(cluster.describe())
        yield cluster
