"""Request one run on RabbitMQ alone and print the answer (docs/messages.md, "Run requests"): plain pika, no
runbrake. With ``--door steer`` or ``--door continue``, a steer or a continue request instead ("Steer requests",
"Continue requests"): the same publish, on ``<ns>.steer-requests`` or ``<ns>.continue-requests``.

    python request_run.py AMQP_URL NAMESPACE BODY [--door run|steer|continue] [--no-reply] [--message-id ID]
                          [--reply-to QUEUE] [--exclusive-queue] [--user-id USER]

BODY (a run spec, or anything: the tests also send malformed ones; ``-`` reads it from stdin) is published
as it is, with publisher confirms and ``mandatory``. By default the answer is awaited on RabbitMQ's direct
reply-to, matched by ``correlation_id``, and printed on stdout as one JSON line (``--exclusive-queue``: on a
server-named exclusive queue of this connection instead, as RabbitMQ's RPC tutorial does); ``--reply-to`` names another
queue to answer (the answer is then not awaited), ``--no-reply`` asks for none; ``--user-id``
sets the user_id property (RabbitMQ refuses one that is not the connection's user).

Exit 0 once the request was confirmed (and answered, when awaited); 1 when it was returned unroutable (no
worker of the namespace ever started), not confirmed, or not answered within 60 s.
"""

import argparse
import sys
import time
import uuid

import pika
import pika.exceptions

ANSWER_TIMEOUT_S = 60


def request_run(amqp_url: str, namespace: str, body: bytes, *, reply: bool = True, message_id: str | None = None,
                reply_to: str | None = None, user_id: str | None = None, door: str = "run",
                exclusive_queue: bool = False) -> bytes | None:
    """Publish a run (steer, continue) request; return the answer's body (None when no answer is awaited)."""
    exchange = f"{namespace}.{door}-requests"
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()  # basic_publish now waits for the broker's confirm
        correlation_id = uuid.uuid4().hex
        awaited = reply and reply_to is None
        answers: list[bytes] = []
        if awaited:
            # Direct reply-to: consume the pseudo-queue, without acks, before publishing a request that names it.
            # Or the RPC tutorial's way: a server-named queue exclusive to this connection.
            reply_to = (channel.queue_declare(queue="", exclusive=True).method.queue if exclusive_queue
                        else "amq.rabbitmq.reply-to")
            channel.basic_consume(reply_to, auto_ack=True, on_message_callback=lambda _c, _m, properties, answer: (
                answers.append(answer) if properties.correlation_id == correlation_id else None))
        channel.basic_publish(
            exchange=exchange,
            routing_key=exchange,  # the queue is bound with its own name, <ns>.<door>-requests
            body=body,
            properties=pika.BasicProperties(content_type="application/json", delivery_mode=2,
                                            reply_to=reply_to if reply else None,
                                            correlation_id=correlation_id if reply else None,
                                            message_id=message_id, user_id=user_id),
            mandatory=True,  # an unroutable request comes back instead of vanishing
        )
        if not awaited:
            return None
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not answers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {ANSWER_TIMEOUT_S} s")
            connection.process_data_events(time_limit=1)
        return answers[0]
    finally:
        connection.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("namespace")
    parser.add_argument("body")
    parser.add_argument("--no-reply", action="store_true")
    parser.add_argument("--message-id")
    parser.add_argument("--reply-to")
    parser.add_argument("--user-id")
    parser.add_argument("--exclusive-queue", action="store_true")
    parser.add_argument("--door", choices=["run", "steer", "continue"], default="run")
    args = parser.parse_args()
    try:
        body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode("utf-8")
        answer = request_run(args.url, args.namespace, body, reply=not args.no_reply,
                             message_id=args.message_id, reply_to=args.reply_to, user_id=args.user_id,
                             door=args.door, exclusive_queue=args.exclusive_queue)
    except (pika.exceptions.AMQPError, TimeoutError) as exc:
        print(f"not answered: {exc!r}", file=sys.stderr)
        sys.exit(1)
    if answer is not None:
        print(answer.decode("utf-8"))
