"""megatron-core's missing Transformer Engine / Apex warnings: each distinct one once on rank 0, none elsewhere."""

import subprocess
import sys

SCRIPT = r"""
import warnings
from megatron_tawpipe.compat.extensions import missing_extension_warnings_once
missing_extension_warnings_once({rank})
missing_extension_warnings_once({rank})
for where in ("a", "b", "c"):
    warnings.filterwarnings("default", message="unrelated")    # a library changing the filters in between
    warnings.warn_explicit("Transformer Engine and Apex are not installed. Falling back to X", UserWarning, where, 1)
    warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, where, 2)
warnings.warn_explicit("something else", UserWarning, "d", 3)
"""


def _stderr(rank: int) -> str:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(rank=rank)], capture_output=True, text=True,
                          check=True).stderr


def test_each_missing_extension_warning_once_on_rank_0():
    err = _stderr(0)
    assert err.count("Falling back to X") == 1 and err.count("Falling back to Torch Norm") == 1, err
    assert "something else" in err


def test_no_missing_extension_warning_on_other_ranks():
    err = _stderr(3)
    assert "not installed" not in err and "something else" in err, err
