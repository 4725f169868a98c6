"""What a publish or a fetch of policy weights raises (:mod:`forge_ext.weights.publish`,
:mod:`forge_ext.weights.fetch`), in one place below both and below every transport."""

from __future__ import annotations

from forge_ext.runtime import disk


class WeightsPublishError(RuntimeError):
    """A publish failed on at least one rank; nothing of that version is visible."""


class WeightsWriteError(WeightsPublishError, disk.OutputWriteError):
    """A publish failed because a rank could not write its data (dcp: a full disk, a
    read-only or unwritable ``weights.dcp_path``, a quota); ``path`` is what it wrote."""


class WeightsVersionNotFoundError(KeyError):
    """The requested policy version has no commit record: never published, still being
    published, failed half-way, or already deleted by retention."""

    def __init__(self, version: int, key_prefix: str, committed: list[int]) -> None:
        self.version = version
        self.key_prefix = key_prefix
        self.committed = committed
        super().__init__(
            f"policy_version={version} is not committed under key_prefix={key_prefix!r} "
            f"(committed versions: {committed}); it was never published, is still being "
            "published, failed, or was deleted by retention"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])

    def __reduce__(self):  # picklable, so it reaches the controller from an actor intact
        return type(self), (self.version, self.key_prefix, self.committed)


class WeightsFetchError(RuntimeError):
    """A committed version could not be read back: its transport failed (for ``dcp``, the
    checkpoint folder was removed or damaged after the commit; for a same-host version, this
    process is on another host or sees another ``/dev/shm``, or the publisher stopped).
    Derives from ``Exception``, unlike DCP's own ``CheckpointException``, so callers'
    ``except Exception`` catch it."""


class WeightsChecksumError(WeightsFetchError):
    """A delta, once applied, did not give the published data (the checksum of the named
    tensor differs): a value lost or corrupted in transport, or a base that was not the one
    the delta was computed from. The tensor's data are then wrong: fetch a full version."""


class WeightsDeltaBaseError(WeightsFetchError):
    """A delta version was asked for by a reader that does not hold its base version: it
    needs a full version (an anchor). Carries ``version``, ``base`` and ``holding``."""

    def __init__(self, version: int, base: int, holding: int | None) -> None:
        self.version, self.base, self.holding = version, base, holding
        super().__init__(
            f"policy_version={version} is a delta on version {base}, and this reader holds "
            f"{'no version' if holding is None else f'version {holding}'}: it needs a full "
            "version (publish with reader_base=None, or fetch the next anchor)"
        )

    def __reduce__(self):  # picklable, so it reaches the controller from an actor intact
        return type(self), (self.version, self.base, self.holding)
