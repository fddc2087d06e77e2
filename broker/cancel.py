"""Where the documentation says the library's cancel is: :func:`cancel_run` now lives in
``shared/messaging/cancel.py``, which the worker's cancel-request consumer imports too; re-exported here so
that ``from runbrake.broker.cancel import cancel_run`` keeps working."""

from runbrake.shared.messaging.cancel import CancelPublisher, CancelResult, cancel_run

__all__ = ["CancelPublisher", "CancelResult", "cancel_run"]
