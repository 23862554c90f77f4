"""Whether a loss call records its per-step metrics (clip fraction, KL, DPO margins, ...).

Every rank that holds a sample's gathered log-probs calls the loss on it (its gradient needs each of
them), but a metric is a mean over samples and must count each sample alike. The step driver
(`megatron.step_loss`) records on the first rank of a micro-batch's CP group only: under static CP
every sample would be counted ``cp`` times anyway, but under dynamic CP a row's CP size varies from row
to row, so counting on every rank would weigh long sequences (more ranks) more. TP ranks all record
(every sample ``tp`` times: the means, ratios of two sums, are unchanged).

    with muted(process_groups.cp_rank != 0):
        loss = fn(sample_id, logprobs, mask)   # fn's metrics: `if recording(): self._sums += ...`
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

__all__ = ["MetricSums", "muted", "recording"]

_RECORDING: ContextVar[bool] = ContextVar("mcore_packing_recording_metrics", default=True)


def recording() -> bool:
    """True unless inside `muted(True)`."""
    return _RECORDING.get()


class MetricSums:
    """A loss's per-step metric sums, kept on the device until read: subclasses set ``METRIC_KEYS`` and
    call `_add` with one 0-d tensor per key (in that order) for each sample or pair they record."""

    METRIC_KEYS: tuple[str, ...] = ()
    _sums = None  # the sums, one float64 tensor (set by the first `_add`)

    @property
    def metrics(self) -> dict:
        """The per-step sums of ``METRIC_KEYS`` (read to the host once: call it after the step)."""
        values = self._sums.tolist() if self._sums is not None else [0.0] * len(self.METRIC_KEYS)
        return dict(zip(self.METRIC_KEYS, values, strict=True))

    def _add(self, values) -> None:
        import torch

        stacked = torch.stack(list(values)).double()
        self._sums = stacked if self._sums is None else self._sums + stacked


@contextlib.contextmanager
def muted(mute: bool = True):
    """Within the block, losses record no metrics (when ``mute``)."""
    token = _RECORDING.set(not mute)
    try:
        yield
    finally:
        _RECORDING.reset(token)
