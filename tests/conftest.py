import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# megatron-core warns at import about missing optional GPU packages.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def pytest_configure(config):
    for pattern in (
        "ignore:.*Transformer Engine and Apex are not installed.*:UserWarning",
        "ignore::DeprecationWarning",
        "ignore::FutureWarning",
    ):
        config.addinivalue_line("filterwarnings", pattern)
