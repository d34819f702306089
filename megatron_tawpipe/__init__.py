"""megatron_tawpipe: weight-passing pipeline parallelism (TawPipe, WeiPipe) for Megatron-Core."""

__version__ = "0.1.0"
