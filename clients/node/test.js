'use strict';
// Runs against a live encoderd (tests/integration/test_node_client.py starts one):
//   ENCODERD_ADDRESS=127.0.0.1:50051 ENCODERD_PROTO_INCLUDE=/path/to/googleapis node --test test.js
// ENCODERD_EMBED_MODEL / ENCODERD_RERANK_MODEL name the models when several are served.

const test = require('node:test');
const assert = require('node:assert/strict');
const { EncoderClient, status } = require('./client');

const address = process.env.ENCODERD_ADDRESS || '127.0.0.1:50051';
const embedModel = process.env.ENCODERD_EMBED_MODEL || '';
const rerankModel = process.env.ENCODERD_RERANK_MODEL || '';

const client = new EncoderClient(address);
test.after(() => client.close());

const norm = (v) => Math.sqrt(v.reduce((sum, x) => sum + x * x, 0));
const dot = (a, b) => a.reduce((sum, x, i) => sum + x * b[i], 0);

test('Embed returns one normalized vector per input, in order', async () => {
  const texts = ['The cat sat on the mat.', 'A cat was sitting on a mat.', 'Quarterly revenue grew by 4%.'];
  const out = await client.embed(texts, { model: embedModel, requestId: 'node-embed-1' });
  assert.equal(out.embeddings.length, 3);
  assert.equal(out.requestId, 'node-embed-1');
  assert.ok(out.usage.prompt_tokens > texts.length);
  for (const v of out.embeddings) {
    assert.ok(v.length > 0);
    assert.ok(Math.abs(norm(v) - 1) < 1e-4);
  }
  const [cat1, cat2, revenue] = out.embeddings;
  assert.ok(dot(cat1, cat2) > dot(cat1, revenue), 'paraphrases are closer than unrelated text');
  const alone = await client.embed([texts[2]], { model: embedModel });
  assert.ok(Math.abs(dot(alone.embeddings[0], revenue) - 1) < 1e-4, 'same text, same vector, whatever the batch');
});

test('Embed with dimensions truncates (Matryoshka) and re-normalizes', async () => {
  const out = await client.embed(['short vector please'], { model: embedModel, dimensions: 32 });
  assert.equal(out.embeddings[0].length, 32);
  assert.ok(Math.abs(norm(out.embeddings[0]) - 1) < 1e-4);
});

test('Rerank returns every document once, sorted best first', async () => {
  const documents = ['Paris is the capital of France.', 'Bananas are yellow.', 'The Eiffel Tower is in Paris.'];
  const out = await client.rerank('What is the capital of France?', documents,
                                  { model: rerankModel, returnDocuments: true });
  assert.deepEqual(out.results.map((r) => r.index).sort(), [0, 1, 2]);
  const scores = out.results.map((r) => r.relevance_score);
  assert.deepEqual(scores, [...scores].sort((a, b) => b - a));
  for (const r of out.results) {
    assert.ok(r.relevance_score >= 0 && r.relevance_score <= 1, 'sigmoid scores');
    assert.equal(r.document, documents[r.index]);
  }
  const top = await client.rerank('What is the capital of France?', documents, { model: rerankModel, topN: 1 });
  assert.equal(top.results.length, 1);
  assert.equal(top.results[0].index, out.results[0].index);
});

test('errors carry their gRPC status and the request id', async () => {
  await assert.rejects(client.embed(['x'], { model: 'no-such-model', requestId: 'node-err-1' }), (err) => {
    assert.equal(err.code, status.NOT_FOUND);
    assert.match(err.details, /not served/);
    assert.equal(err.requestId, 'node-err-1');
    return true;
  });
  await assert.rejects(client.embed([], { model: embedModel }), (err) => err.code === status.INVALID_ARGUMENT);
});
