// Publish one cancel request with amqplib (docs/messages.md, "Cancel requests"): no runbrake, no Python.
//
//   node publish_cancel_request.mjs AMQP_URL NAMESPACE RUN_ID [REASON] [REQUESTED_BY]
//
// Exits 0 once RabbitMQ confirmed the message; 1 on any error (printed on stderr).
import amqp from "amqplib";

const [url, namespace, runId, reason, requestedBy] = process.argv.slice(2);
const exchange = `${namespace}.cancel-requests`;
const body = { run_id: runId };
if (reason) body.reason = reason;
if (requestedBy) body.requested_by = requestedBy;

const connection = await amqp.connect(url);
try {
  const channel = await connection.createConfirmChannel();
  let returned = false;
  channel.on("return", () => { returned = true; });
  await new Promise((resolve, reject) => {
    channel.publish(exchange, exchange, Buffer.from(JSON.stringify(body)),
      { contentType: "application/json", deliveryMode: 2, mandatory: true },
      (err) => (err ? reject(err) : resolve()));
  });
  await channel.close();
  if (returned) throw new Error(`unroutable: is a worker of namespace ${namespace} running?`);
} catch (error) {
  console.error(String(error));
  process.exitCode = 1;
} finally {
  await connection.close().catch(() => {});
}
