"""flash-gdn: fast Gated DeltaNet (chunked prefill) kernels for NVIDIA Hopper, with a portable fallback."""

from .api import (
    ForwardSaved,
    GDNGrads,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_bwd,
    chunk_gated_delta_rule_fwd,
)

from .warmup import release_workspaces, warmup

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "ForwardSaved",
    "GDNGrads",
    "warmup",
    "release_workspaces",
    "__version__",
]
