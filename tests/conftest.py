import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# The measurement lab (tools/tawpipe_lab): not installed, found beside the tools that use it.
TOOLS = os.path.join(ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

# megatron-core warns at import about missing optional GPU packages.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

# Hugging Face's tokenizers library must not run threads across the forks the tests make.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# megatron-core's tokenizer libraries import transformers and tiktoken where installed (seconds): once here,
# inherited by every forked rank, rather than once per rank.
try:
    import megatron.core.tokenizers.text.libraries  # noqa: F401,E402
except ImportError:
    pass


def megatron_core_api_processes():
    """``(processes, left_out)`` from ``tests/megatron_core_api_files.txt``: the pytest processes of CI's second
    pass (newest megatron-core, Python 3.12), each ``(files, expression)`` (expression: the ``-k`` subset, or
    None), and the files left to the first pass with the reason."""
    processes, left_out = [], {}
    with open(os.path.join(TESTS, "megatron_core_api_files.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("- "):
                name, _, reason = line[2:].partition(":")
                left_out[name.strip()] = reason.strip()
            else:   # "FILE [FILE ...] [-k EXPRESSION]"
                files, _, expression = line.partition(" -k ")
                processes.append((files.split(), expression.strip() or None))
    return processes, left_out


def megatron_core_api_files():
    """``(selected, left_out)``: the test files of CI's second pass (newest megatron-core, Python 3.12), and
    those left to the first pass with the reason, from ``tests/megatron_core_api_files.txt``."""
    processes, left_out = megatron_core_api_processes()
    return [name for files, _ in processes for name in files], left_out


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs one CUDA device (skipped without one); run them with python -m pytest -m gpu tests "
        "on a GPU machine (tools/gpu_bringup.sh does)")
    config.addinivalue_line(
        "markers", "timing: asserts wall-clock durations or link rates, which a loaded machine stretches; left "
        "out of the default run, run alone with python -m pytest -m timing tests (CI's quiet step)")
    config.addinivalue_line(
        "markers", "megatron_core_api: in a file of CI's second pass (tests/megatron_core_api_files.txt), run "
        "under the newest megatron-core release")
    for pattern in (
        "ignore:.*Transformer Engine and Apex are not installed.*:UserWarning",
        "ignore::DeprecationWarning",
        "ignore::FutureWarning",
    ):
        config.addinivalue_line("filterwarnings", pattern)


def cuda_absent_reason():
    """Why the ``gpu`` tests cannot run here, or None when torch sees a CUDA device.

    ``torch.cuda.device_count`` asks NVML where it can, which leaves CUDA uninitialised in this process
    (``torch.cuda.is_available`` would initialise the driver, and the ranks that other tests fork could then
    not use CUDA)."""
    import torch

    if torch.cuda.device_count() < 1:
        return (f"needs one CUDA device: torch {torch.__version__} sees none (torch.cuda.device_count() is 0); "
                "run python -m pytest -m gpu tests on a GPU machine")
    return None


def pytest_collection_modifyitems(config, items):
    """Tests of the second pass's files are marked ``megatron_core_api``; ``gpu`` tests are skipped, with the
    reason, where torch sees no CUDA device."""
    import pytest

    selected = set(megatron_core_api_files()[0])
    for item in items:
        if os.path.basename(str(item.fspath)) in selected:
            item.add_marker(pytest.mark.megatron_core_api)
    if "timing" not in (config.getoption("markexpr") or ""):
        for item in items:
            if item.get_closest_marker("timing") is not None:
                item.add_marker(pytest.mark.skip(reason="a timing test: run alone, on a quiet machine, with "
                                                        "python -m pytest -m timing tests"))
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = cuda_absent_reason()
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
