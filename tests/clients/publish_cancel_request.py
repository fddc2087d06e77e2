"""Publish one cancel request on RabbitMQ alone (docs/messages.md, "Cancel requests"): plain pika, no runbrake.

    python publish_cancel_request.py AMQP_URL NAMESPACE BODY [USER_ID]

BODY is published as it is (with USER_ID as its user_id property, which RabbitMQ checks against the
connection's user, when given) (the tests also send malformed ones). Exit 0 once RabbitMQ confirmed
the message and routed it to a queue; 1 when it was returned unroutable (the queue is not declared:
no worker of the namespace ever started) or not confirmed.
"""

import sys

import pika
import pika.exceptions


def publish_cancel_request(amqp_url: str, namespace: str, body: bytes, user_id: str | None = None) -> None:
    exchange = f"{namespace}.cancel-requests"
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()  # basic_publish now waits for the broker's confirm
        channel.basic_publish(
            exchange=exchange,
            routing_key=exchange,  # the queue is bound with its own name, <ns>.cancel-requests
            body=body,
            properties=pika.BasicProperties(content_type="application/json", delivery_mode=2, user_id=user_id),
            mandatory=True,  # an unroutable message comes back instead of vanishing
        )
    finally:
        connection.close()


if __name__ == "__main__":
    url, namespace, text = sys.argv[1:4]
    user = sys.argv[4] if len(sys.argv) > 4 else None
    try:
        publish_cancel_request(url, namespace, text.encode("utf-8"), user)
    except (pika.exceptions.UnroutableError, pika.exceptions.NackError, pika.exceptions.AMQPError) as exc:
        print(f"not delivered: {exc!r}", file=sys.stderr)
        sys.exit(1)
