// Request one run with amqplib and print the answer (docs/messages.md, "Run requests"): no runbrake, no Python.
//
//   node request_run.mjs AMQP_URL NAMESPACE SPEC_JSON
//
// Publishes the spec on <ns>.run-requests with publisher confirms and mandatory, and awaits the answer on
// RabbitMQ's direct reply-to (amq.rabbitmq.reply-to), matched by correlation_id. Prints the answer as one JSON
// line and exits 0; exits 1 on any error or after 60 s without an answer (printed on stderr).
import { randomUUID } from "node:crypto";
import amqp from "amqplib";

const [url, namespace, spec] = process.argv.slice(2);
const exchange = `${namespace}.run-requests`;
const correlationId = randomUUID();

const connection = await amqp.connect(url);
let timer;
try {
  const channel = await connection.createConfirmChannel();
  let returned = false;
  channel.on("return", () => { returned = true; });
  let answered;
  const answer = new Promise((resolve) => { answered = resolve; });
  // Direct reply-to: consume the pseudo-queue (no ack) before publishing with replyTo naming it.
  await channel.consume("amq.rabbitmq.reply-to", (message) => {
    if (message && message.properties.correlationId === correlationId) answered(message.content.toString("utf8"));
  }, { noAck: true });
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error("no answer within 60 s")), 60_000);
  });
  await new Promise((resolve, reject) => {
    channel.publish(exchange, exchange, Buffer.from(spec),
      { contentType: "application/json", deliveryMode: 2, mandatory: true, replyTo: "amq.rabbitmq.reply-to",
        correlationId },
      (err) => (err ? reject(err) : resolve()));
  });
  if (returned) throw new Error(`unroutable: is a worker of namespace ${namespace} running?`);
  console.log(await Promise.race([answer, timeout]));
  await channel.close();
} catch (error) {
  console.error(String(error));
  process.exitCode = 1;
} finally {
  clearTimeout(timer);
  await connection.close().catch(() => {});
}
