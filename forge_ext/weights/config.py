"""YAML ``weights:``, how a trainer publishes weights for generators
(:mod:`forge_ext.weights.publish`): standard library only, so that a config is validated
before torch is imported (issue 38)."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_KEY_PREFIX = "policy_weights"
"""The torchstore key prefix of published weights (``weights.key_prefix``)."""

TRANSPORTS = ("direct", "dcp")
SAME_HOST = ("auto", "off")

FLOAT_DTYPES = ("float16", "half", "bfloat16", "float32", "float", "float64", "double",
                "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
"""The torch floating-point dtype names ``weights.dtype`` takes (tests/test_weights_publish.py
checks them against torch)."""


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    """How a trainer publishes weights for generators.

    Attributes:
        transport: ``"direct"`` (torchstore puts) or ``"dcp"`` (DCP files + a torchstore
            handle).
        dcp_path: folder that receives ``<dcp_path>/<policy_version>``; required for dcp. Must
            be on a filesystem the readers can see.
        keep_versions: committed versions kept; older ones this publisher created are deleted.
        dtype: generator dtype, e.g. ``"bfloat16"``; floating-point tensors are cast to it
            before publishing (except names passed as ``exclude_from_cast``). None keeps dtypes.
        key_prefix: torchstore key prefix; readers pass the same to ``fetch_weights``.
        chunk_mb: size of the chunks ``direct`` puts (MiB).
        run_id: identifies the run across restarts (the GRPO app uses its absolute
            ``output_dir``). With dcp, a folder ``<dcp_path>/<version>`` that an earlier
            process of the same run left (it crashed; the resumed trainer publishes the
            checkpoint's version again) is replaced; None never replaces an existing folder.
        same_host: ``"auto"``: with ``transport=direct``, publish into reused shared-memory
            slots when every rank of the group is on one host (readers must be on that host
            too); ``"off"``: always put chunks into torchstore (Monarch RPC, or RDMA when
            torchstore reports it), for readers on other hosts. YAML reads an unquoted
            ``off`` as ``false``, which means ``"off"`` here. No effect with ``dcp``.
        delta: publish, between full versions, only the elements whose bits changed since
            the version every reader holds (:mod:`forge_ext.weights.transports.delta`; pays
            in bf16 at small learning rates, see docs/weights.md). Requires
            ``transport: direct``; with ``same_host: auto`` on one host the full versions
            (anchors) go into the shared-memory slots and the deltas through torchstore.
        delta_anchor_every: with ``delta``, a full version at least every this many
            versions (also at the first one, on resume, and when a reader does not hold the
            last version); after a delta that did not pay (above half a full version's bytes:
            fp32, a large learning rate), this many full versions before a delta is tried
            again.
    """

    transport: str = "direct"
    dcp_path: str | None = None
    keep_versions: int = 2
    dtype: str | None = None
    key_prefix: str = DEFAULT_KEY_PREFIX
    chunk_mb: int = 16
    run_id: str | None = None
    same_host: str | bool = "auto"
    delta: bool = False
    delta_anchor_every: int = 20

    def __post_init__(self) -> None:
        if self.same_host is False:  # YAML 1.1: `same_host: off` is a boolean
            self.same_host = "off"
        if type(self.dtype).__name__ == "dtype":  # from Python: torch.bfloat16 -> "bfloat16"
            self.dtype = str(self.dtype).removeprefix("torch.")
        if isinstance(self.dcp_path, os.PathLike):
            self.dcp_path = os.fspath(self.dcp_path)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the offending ``weights.<field>``."""
        if self.transport not in TRANSPORTS:
            allowed = ", ".join(repr(t) for t in TRANSPORTS)
            raise ValueError(f"weights.transport={self.transport!r} must be one of {allowed}")
        if self.dcp_path is not None and not isinstance(self.dcp_path, str):
            raise ValueError(f"weights.dcp_path={self.dcp_path!r} must be None or a path")
        if self.transport == "dcp" and not self.dcp_path:
            raise ValueError("weights.dcp_path must be set when weights.transport='dcp'")
        if isinstance(self.keep_versions, bool) or not isinstance(self.keep_versions, int) or (
            self.keep_versions < 1
        ):
            raise ValueError(f"weights.keep_versions={self.keep_versions!r} must be an int >= 1")
        if self.dtype is not None:
            if not isinstance(self.dtype, str) or self.dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"weights.dtype={self.dtype!r} must be None or a torch floating-point "
                    "dtype name such as 'bfloat16'"
                )
        if not isinstance(self.key_prefix, str) or not self.key_prefix or (
            self.key_prefix.startswith(".") or self.key_prefix.endswith(".")
        ):
            raise ValueError(
                f"weights.key_prefix={self.key_prefix!r} must be non-empty and must not start "
                "or end with '.'"
            )
        if isinstance(self.chunk_mb, bool) or not isinstance(self.chunk_mb, int) or (
            self.chunk_mb < 1
        ):
            raise ValueError(f"weights.chunk_mb={self.chunk_mb!r} must be an int >= 1")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id):
            raise ValueError(f"weights.run_id={self.run_id!r} must be None or a non-empty string")
        if self.same_host not in SAME_HOST:
            allowed = ", ".join(repr(v) for v in SAME_HOST)
            raise ValueError(f"weights.same_host={self.same_host!r} must be one of {allowed}")
        if not isinstance(self.delta, bool):
            raise ValueError(f"weights.delta={self.delta!r} must be true or false")
        if self.delta and self.transport != "direct":
            raise ValueError(
                f"weights.delta=true needs weights.transport='direct' (got "
                f"{self.transport!r}): deltas travel as torchstore chunks; set it, or "
                "weights.delta=false"
            )
        if isinstance(self.delta_anchor_every, bool) or not isinstance(
            self.delta_anchor_every, int
        ) or self.delta_anchor_every < 1:
            raise ValueError(
                f"weights.delta_anchor_every={self.delta_anchor_every!r} must be an int >= 1"
            )

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)
