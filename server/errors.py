"""The errors the batcher and the executors raise, each with the HTTP status it stands for.

They are :class:`kiln.KilnError` subclasses like every error kiln raises on purpose, and each carries a
``status`` so the HTTP layer can answer without a table of its own: 503 for a full queue or a server that
is shutting down (both subclasses of :class:`QueueFull`, so one handler that adds ``Retry-After`` covers
them), 504 for a request that ran out of time, 400 for a request whose own batch is larger than the model
allows (an :class:`kiln.InputError`, like every other bad-input error), 500 for a worker that died.
"""
from __future__ import annotations

from kiln.errors import ExecutionError, InputError, KilnError


class QueueFull(KilnError):
    """The model's queue holds ``queue_size`` requests already: answer 503 with ``Retry-After``."""

    status = 503

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # a hint for the Retry-After header (seconds)


class Draining(QueueFull):
    """The batcher is draining (graceful shutdown) and takes no new requests: also a 503."""


class RequestTimeout(KilnError):
    """A request was not answered within its timeout (queued or running): 504. A request that times out
    while queued is dropped from the queue; one that was already running has its result discarded."""

    status = 504


class BatchTooLarge(InputError):
    """A request's own batch dim exceeds the model's ``max_batch_size``: a client error (400)."""

    status = 400


class WorkerError(KilnError):
    """The worker process running a request died (or the executor was closed under it): 500."""

    status = 500


class RegionTooSmall(ExecutionError):
    """An output asked for in a CUDA shared memory region does not fit it (known only once the batch ran):
    a client error (400). An ExecutionError, so a stacked batch is re-run request by request and only the
    request that named the small region fails."""

    status = 400
