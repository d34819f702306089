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

# Hugging Face's tokenizers library must not run threads across the forks the tests make.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# megatron-core's tokenizer libraries import transformers and tiktoken where installed (seconds): once here,
# inherited by every forked rank, rather than once per rank.
try:
    import megatron.core.tokenizers.text.libraries  # noqa: F401,E402
except ImportError:
    pass


def pytest_configure(config):
    for pattern in (
        "ignore:.*Transformer Engine and Apex are not installed.*:UserWarning",
        "ignore::DeprecationWarning",
        "ignore::FutureWarning",
    ):
        config.addinivalue_line("filterwarnings", pattern)
