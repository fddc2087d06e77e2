"""Where the documentation says the library's enqueue is: :class:`Producer` now lives with the rest of
the RabbitMQ contract in ``shared/messaging/producer.py``, which the worker imports too; re-exported here so
that ``from runbrake.broker.producer import Producer`` keeps working."""

from runbrake.shared.messaging.producer import Enqueued, Producer

__all__ = ["Enqueued", "Producer"]
