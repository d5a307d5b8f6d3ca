// A Node.js backend's producer: celery-node with its default options, connected as the
// fleet's `producer` Redis user, enqueues text requests (the documented Celery message:
// task `fleet.text`, kwargs {"request": envelope}) and reads their results through
// celery-node's Redis result backend. Run by tests/integration/test_celery_node.py.
//
// Environment: FLEET_PRODUCER_URL (the URL the README gives for celery-node), JOBS (how
// many valid texts). One more request has a wrong input key and must fail INVALID_INPUT.
// Prints one JSON line per request, in submit order:
//   {"id", "status": "SUCCESS", "dim", "norm"} or {"id", "status", "exc_type", "code"}.
"use strict";

const celery = require("celery-node");

const url = process.env.FLEET_PRODUCER_URL;
const jobs = Number(process.env.JOBS || "40");
const client = celery.createClient(url, url, "text");
const task = client.createTask("fleet.text");

function envelope(inputs) {
  const now = Date.now();
  return {
    v: 1, modality: "text", priority: "normal", submitted_ms: now,
    deadline_ms: now + 60000, model: null, inputs,
  };
}

const inputs = [];
for (let i = 0; i < jobs; i += 1) {
  inputs.push({ text: `A Node.js backend asks for embedding number ${i}.` });
}
inputs.push({ txt: "a wrong input key" });


function outcome(handle) {
  return handle.get(90000).then(
    (result) => {
      const e = result.embedding;
      const norm = Math.sqrt(e.reduce((s, v) => s + v * v, 0));
      return { id: handle.taskId, status: "SUCCESS", dim: e.length, norm };
    },
    // celery-node rejects with an Error named after the state, carrying the stored result's
    // fields: the fleet's FAILURE result is {"exc_type", "exc_message": [message, code], ...}
    (err) => ({
      id: handle.taskId, status: err.message, exc_type: err.exc_type || null,
      code: Array.isArray(err.exc_message) ? err.exc_message[1] : null,
    }),
  );
}

// Connected first: each send before then would add listeners of its own to the connection.
client
  .isReady()
  .then(() => {
    const handles = inputs.map((x) => task.applyAsync([], { request: envelope(x) }));
    return Promise.all(handles.map(outcome));
  })
  .then((outcomes) => {
    for (const o of outcomes) process.stdout.write(`${JSON.stringify(o)}\n`);
    return client.disconnect();
  })
  .then(
    () => process.exit(0),
    (err) => {
      process.stderr.write(`${err.stack || err}\n`);
      process.exit(1);
    },
  );
