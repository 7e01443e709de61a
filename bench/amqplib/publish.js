// Bare amqplib publisher with publisher confirms: one of the broker-ceiling
// publishers of `make bench` (bench/src/ceiling.rs runs it).
//
//   node publish.js AMQP_URL EXCHANGE ROUTING_KEY COUNT WINDOW PAD_LEN
//
// Publishes COUNT messages shaped like the relay's (persistent, mandatory,
// message_id, type, content_type, timestamp, headers aggregate_type and
// aggregate_id, the same 300-byte JSON body) on a ConfirmChannel, at most
// WINDOW unconfirmed at a time, and prints one JSON line:
//   {"events": N, "seconds": S, "cpu_seconds": C, "nacked": K, "returned": R}
// (C: this process's user + system CPU over the same interval)
// The clock runs from the first publish to the last confirm (connection and
// channel set-up excluded).
"use strict";

const amqp = require("amqplib");

// Must produce exactly what bench/src/workload.rs `payload` does.
function payload(i, padLen) {
  const z = (n, w) => String(n).padStart(w, "0");
  return (
    `{"pad": "${"x".repeat(padLen)}", "qty": ${1 + (i % 9)}, ` +
    `"sku": "SKU-${z(i % 1000000, 6)}", "customer": "c-${z(i, 9)}", "order_id": "${z(i, 9)}"}`
  );
}

function messageId(i) {
  // A UUID-shaped id, like the outbox table's.
  return `00000000-0000-4000-8000-${String(i.toString(16)).padStart(12, "0")}`;
}

async function main() {
  const [url, exchange, routingKey, countArg, windowArg, padArg] = process.argv.slice(2);
  const count = Number.parseInt(countArg, 10);
  const window = Number.parseInt(windowArg, 10);
  const padLen = Number.parseInt(padArg, 10);
  if (!url || !exchange || !routingKey || !(count > 0) || !(window > 0) || !(padLen >= 0)) {
    console.error("usage: node publish.js AMQP_URL EXCHANGE ROUTING_KEY COUNT WINDOW PAD_LEN");
    process.exit(2);
  }
  const conn = await amqp.connect(url);
  const ch = await conn.createConfirmChannel();
  let returned = 0;
  ch.on("return", () => {
    returned++;
  });

  let sent = 0;
  let confirmed = 0;
  let nacked = 0;
  let inFlight = 0;
  let waitingDrain = false;
  const timestamp = Math.floor(Date.now() / 1000);
  const start = process.hrtime.bigint();
  const cpu0 = process.cpuUsage();

  await new Promise((resolve) => {
    const onConfirm = (err) => {
      inFlight--;
      confirmed++;
      if (err) nacked++;
      if (confirmed === count) resolve();
      else if (!waitingDrain) pump();
    };
    function pump() {
      while (sent < count && inFlight < window) {
        const i = sent++;
        inFlight++;
        const ok = ch.publish(
          exchange,
          routingKey,
          // Built per message, as the Rust publishers (and the relay) do.
          Buffer.from(payload(i + 1, padLen)),
          {
            persistent: true,
            mandatory: true,
            messageId: messageId(i + 1),
            type: "OrderPlaced",
            contentType: "application/json",
            timestamp,
            headers: { aggregate_type: "order", aggregate_id: `order-${String(i + 1).padStart(9, "0")}` },
          },
          onConfirm,
        );
        if (!ok) {
          // The socket buffer is full: wait for it to drain.
          waitingDrain = true;
          ch.once("drain", () => {
            waitingDrain = false;
            pump();
          });
          return;
        }
      }
    }
    pump();
  });

  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  const cpu = process.cpuUsage(cpu0);
  const cpuSeconds = (cpu.user + cpu.system) / 1e6;
  await ch.close();
  await conn.close();
  console.log(JSON.stringify({ events: count, seconds, cpu_seconds: cpuSeconds, nacked, returned }));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : err);
  process.exit(1);
});
