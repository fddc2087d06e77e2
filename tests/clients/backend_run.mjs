// A backend on RabbitMQ alone, with amqplib (docs/messages.md, "Run requests" and "Run events"): no runbrake,
// no Python, no HTTP. It requests a run and follows it to its end:
//
//   node backend_run.mjs AMQP_URL NAMESPACE SPEC_JSON
//
// 1. binds an exclusive queue to the topic exchange <ns>.events for every run and step event, before asking,
//    so no event of the run can come before the queue exists;
// 2. publishes the spec on <ns>.run-requests (confirmed, mandatory) with the direct reply-to and a
//    correlation_id, and awaits the answer {run_id, status, created};
// 3. prints the answer as one JSON line {"answer": …}, then one JSON line per event of that run
//    ({routing_key, message_id, body}, deduplicated by message_id: delivery is at least once) until its
//    run.completed, run.failed or run.cancelled, and exits 0.
// Exits 1 on any error, on an answer with errors, or after 60 s without the end (printed on stderr).
import { randomUUID } from "node:crypto";
import amqp from "amqplib";

const [url, namespace, spec] = process.argv.slice(2);
const requests = `${namespace}.run-requests`;
const endings = new Set(["run.completed", "run.failed", "run.cancelled"]);
const correlationId = randomUUID();

const connection = await amqp.connect(url);
let timer;
try {
  const channel = await connection.createConfirmChannel();
  await channel.assertExchange(`${namespace}.events`, "topic", { durable: true });
  const { queue } = await channel.assertQueue("", { exclusive: true, autoDelete: true });
  await channel.bindQueue(queue, `${namespace}.events`, "run.*");
  await channel.bindQueue(queue, `${namespace}.events`, "step.*");

  let runId = null;
  const early = [];  // events that came before the answer named the run
  const seen = new Set();
  let ended;
  const end = new Promise((resolve) => { ended = resolve; });
  const show = (event) => {
    if (event.body.run_id !== runId || seen.has(event.message_id)) return;
    seen.add(event.message_id);
    console.log(JSON.stringify(event));
    if (endings.has(event.routing_key)) ended();
  };
  await channel.consume(queue, (message) => {
    if (message === null) return;
    channel.ack(message);
    const event = { routing_key: message.fields.routingKey, message_id: message.properties.messageId,
                    body: JSON.parse(message.content.toString("utf8")) };
    if (runId === null) early.push(event); else show(event);
  });

  let answered;
  const answer = new Promise((resolve) => { answered = resolve; });
  await channel.consume("amq.rabbitmq.reply-to", (message) => {
    if (message && message.properties.correlationId === correlationId) answered(message.content.toString("utf8"));
  }, { noAck: true });
  let returned = false;
  channel.on("return", () => { returned = true; });
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error("the run did not end within 60 s")), 60_000);
  });
  await new Promise((resolve, reject) => {
    channel.publish(requests, requests, Buffer.from(spec),
      { contentType: "application/json", deliveryMode: 2, mandatory: true, replyTo: "amq.rabbitmq.reply-to",
        correlationId },
      (err) => (err ? reject(err) : resolve()));
  });
  if (returned) throw new Error(`unroutable: is a worker of namespace ${namespace} running?`);
  const reply = JSON.parse(await Promise.race([answer, timeout]));
  console.log(JSON.stringify({ answer: reply }));
  if (!reply.run_id) throw new Error(`the request was refused: ${JSON.stringify(reply)}`);
  runId = reply.run_id;
  early.splice(0).forEach(show);
  await Promise.race([end, timeout]);
  await channel.close();
} catch (error) {
  console.error(String(error));
  process.exitCode = 1;
} finally {
  clearTimeout(timer);
  await connection.close().catch(() => {});
}
