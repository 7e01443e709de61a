#!/usr/bin/env python3
"""Demo consumer for integration/demo.sh.

Declares the topology the relay publishes into (the relay itself declares
nothing), then prints every message that reaches the queue until all the
expected routing keys have arrived. Exits 0 when they all did, 1 when some
did not arrive in time or a forbidden one (an event whose transaction was
rolled back) showed up.
"""

import argparse
import collections
import json
import pathlib
import sys
import time

import pika


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="AMQP URL")
    ap.add_argument("--exchange", default="outbox")
    ap.add_argument("--queue", default="demo")
    ap.add_argument("--ready", required=True, help="file to create once the queue is bound")
    ap.add_argument("--expect", default="", help="comma-separated routing keys that must arrive")
    ap.add_argument("--forbid", default="", help="comma-separated routing keys that must not")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--linger", type=float, default=2.0,
                    help="seconds to keep listening after the last expected message, "
                         "to catch late forbidden ones")
    args = ap.parse_args()

    expected = [k for k in args.expect.split(",") if k]
    missing = collections.Counter(expected)
    forbidden = {k for k in args.forbid.split(",") if k}

    conn = pika.BlockingConnection(pika.URLParameters(args.url))
    ch = conn.channel()
    ch.exchange_declare(args.exchange, exchange_type="topic", durable=True)
    ch.queue_declare(args.queue, durable=True)
    # Leftovers of an earlier run (against long-lived servers) would be
    # mistaken for this run's messages.
    ch.queue_purge(args.queue)
    ch.queue_bind(args.queue, args.exchange, routing_key="#")
    pathlib.Path(args.ready).touch()

    deadline = time.monotonic() + args.timeout
    bad = []
    count = 0
    for method, props, body in ch.consume(args.queue, inactivity_timeout=0.2):
        if method is not None:
            count += 1
            ch.basic_ack(method.delivery_tag)
            show(count, method.routing_key, props, body)
            if method.routing_key in forbidden:
                bad.append(method.routing_key)
            elif missing[method.routing_key] > 0:
                missing[method.routing_key] -= 1
                if not +missing:
                    deadline = min(deadline, time.monotonic() + args.linger)
        if time.monotonic() >= deadline:
            break
    ch.cancel()
    conn.close()

    ok = True
    if +missing:
        print(f"consumer: timed out after {args.timeout:.0f}s still waiting for "
              f"{sorted((+missing).elements())}", file=sys.stderr)
        ok = False
    if bad:
        print(f"consumer: received events that were rolled back: {bad}", file=sys.stderr)
        ok = False
    if ok:
        print(f"consumer: all {len(expected)} expected messages arrived "
              f"({count} in total)")
    return 0 if ok else 1


def show(n, routing_key, props, body):
    try:
        text = json.dumps(json.loads(body), sort_keys=True)
    except ValueError:
        text = body.decode("utf-8", "replace")
    print(f"[message {n}] routing_key={routing_key} message_id={props.message_id}")
    print(f"            body={text}")
    if props.headers:
        print(f"            headers={json.dumps(props.headers, sort_keys=True, default=str)}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
