// Consume one run's events from <ns>.events with amqplib (docs/messages.md, "Run events"): no runbrake, no Python.
//
//   node consume_run_events.mjs AMQP_URL NAMESPACE
//
// Binds an exclusive queue to the topic exchange for every run and step event ("run.*", "step.*"), prints
// "ready" once bound, reads the run id to follow from stdin's first line, then prints one JSON line per
// event of that run ({routing_key, message_id, headers, body}) until its run.completed (or run.failed,
// run.cancelled), and exits 0. Events are deduplicated by message_id (delivery is at least once).
// Exits 1 on any error (printed on stderr).
import amqp from "amqplib";
import readline from "node:readline";

const [url, namespace] = process.argv.slice(2);
const exchange = `${namespace}.events`;
const endings = new Set(["run.completed", "run.failed", "run.cancelled"]);

const connection = await amqp.connect(url);
try {
  const channel = await connection.createChannel();
  await channel.assertExchange(exchange, "topic", { durable: true });
  const { queue } = await channel.assertQueue("", { exclusive: true, autoDelete: true });
  await channel.bindQueue(queue, exchange, "run.*");
  await channel.bindQueue(queue, exchange, "step.*");
  console.log("ready");
  const lines = readline.createInterface({ input: process.stdin });
  const runId = await new Promise((resolve) => lines.once("line", (line) => resolve(line.trim())));
  lines.close();
  const seen = new Set();
  await new Promise((resolve, reject) => {
    channel.consume(queue, (message) => {
      if (message === null) { reject(new Error("the consumer was cancelled")); return; }
      channel.ack(message);
      const headers = message.properties.headers || {};
      if (headers["x-runbrake-run-id"] !== runId || seen.has(message.properties.messageId)) return;
      seen.add(message.properties.messageId);
      const event = {
        routing_key: message.fields.routingKey,
        message_id: message.properties.messageId,
        headers,
        body: JSON.parse(message.content.toString("utf8")),
      };
      console.log(JSON.stringify(event));
      if (endings.has(event.routing_key)) resolve();
    }).catch(reject);
  });
  await channel.close();
} catch (error) {
  console.error(String(error));
  process.exitCode = 1;
} finally {
  await connection.close().catch(() => {});
}
