"""The RabbitMQ contract: every queue, exchange and message body (``wire``), the Dramatiq broker
configured for long runs (``rabbitmq``), and the publishers of run messages (``producer``) and cancel
wake-ups (``cancel``).

Both sides use it: the entry points (``runbrake.broker``) publish through it and the worker
(``runbrake.worker``) consumes through it, so it lives below both (docs/architecture.md, "Layers").
It is the only part of ``runbrake.shared`` that imports pika or Dramatiq; the domain modules beside it
know nothing of RabbitMQ (the contracts in pyproject.toml, ``[tool.importlinter]``).
"""
