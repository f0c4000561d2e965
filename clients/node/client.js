'use strict';
// A small Node.js client for encoderd: loads protos/encoderd/v1/encoderd.proto at run time
// (@grpc/proto-loader), no generated code. Every call returns a Promise.
//
//   const { EncoderClient } = require('./client');
//   const client = new EncoderClient('127.0.0.1:50051');
//   const { embeddings } = await client.embed(['hello world']);
//
// encoderd.proto imports google/api/annotations.proto and google/rpc/status.proto: give
// the directory that holds google/api and google/rpc (the googleapis protos) as
// options.includeDirs or in ENCODERD_PROTO_INCLUDE (':'-separated). The Python package
// googleapis-common-protos ships them:
//   python3 -c "import google.api, pathlib; print(pathlib.Path(google.api.__path__[0]).parents[1])"

const path = require('node:path');
const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const REQUEST_ID = 'x-request-id';

function includeDirs(extra) {
  const fromEnv = (process.env.ENCODERD_PROTO_INCLUDE || '').split(path.delimiter).filter(Boolean);
  const dirs = [PROTO_ROOT, ...(extra || []), ...fromEnv];
  if (!dirs.some((dir) => fs.existsSync(path.join(dir, 'google', 'api', 'annotations.proto')))) {
    throw new Error('google/api/annotations.proto not found: set ENCODERD_PROTO_INCLUDE (or options.includeDirs) ' +
                    'to the googleapis protos, e.g. those of the Python package googleapis-common-protos');
  }
  return dirs;
}

function loadEncoderService(extraIncludeDirs) {
  const definition = protoLoader.loadSync('encoderd/v1/encoderd.proto', {
    includeDirs: includeDirs(extraIncludeDirs),
    keepCase: true,      // field names as in the .proto (relevance_score, prompt_tokens)
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).encoderd.v1.Encoder;
}

class EncoderClient {
  /**
   * @param {string} address host:port of encoderd (or of an Envoy in front of several)
   * @param {{includeDirs?: string[], credentials?: grpc.ChannelCredentials, deadlineMs?: number}} [options]
   */
  constructor(address, options = {}) {
    const Encoder = loadEncoderService(options.includeDirs);
    this.deadlineMs = options.deadlineMs ?? 30000;
    this.stub = new Encoder(address, options.credentials || grpc.credentials.createInsecure());
  }

  /** Call one unary RPC; resolves to {response, requestId} and rejects with a grpc error (err.code). */
  call(method, request, { requestId, deadlineMs } = {}) {
    const metadata = new grpc.Metadata();
    if (requestId) metadata.set(REQUEST_ID, requestId);
    const deadline = new Date(Date.now() + (deadlineMs ?? this.deadlineMs));
    return new Promise((resolve, reject) => {
      let headers = new grpc.Metadata();
      const call = this.stub[method](request, metadata, { deadline }, (err, response) => {
        if (err) {
          // encoderd puts the request id in the trailers of a failed call.
          err.requestId = (err.metadata && err.metadata.get(REQUEST_ID)[0]) || undefined;
          reject(err);
        } else {
          resolve({ response, requestId: headers.get(REQUEST_ID)[0] });
        }
      });
      call.on('metadata', (md) => { headers = md; });
    });
  }

  /** Vectors for `inputs`, in order: {embeddings: number[][], usage, model, requestId}. */
  async embed(inputs, { model = '', normalize, dimensions = 0, requestId } = {}) {
    const request = { model, inputs, dimensions };
    if (normalize !== undefined) request.normalize = normalize;
    const { response, requestId: id } = await this.call('Embed', request, { requestId });
    return { model: response.model, embeddings: response.embeddings.map((e) => e.values), usage: response.usage,
             requestId: id };
  }

  /** Documents scored against `query`, best first: {results: [{index, relevance_score, document}], ...}. */
  async rerank(query, documents, { model = '', topN = 0, returnDocuments = false, requestId } = {}) {
    const { response, requestId: id } = await this.call('Rerank', {
      model, query, documents, top_n: topN, return_documents: returnDocuments,
    }, { requestId });
    return { model: response.model, results: response.results, usage: response.usage, requestId: id };
  }

  /** Per input, every label with its score, best first. */
  async classify(inputs, { model = '', requestId } = {}) {
    const { response, requestId: id } = await this.call('Classify', { model, inputs }, { requestId });
    return { model: response.model, results: response.results.map((r) => r.labels), usage: response.usage,
             requestId: id };
  }

  close() {
    this.stub.close();
  }
}

module.exports = { EncoderClient, loadEncoderService, status: grpc.status };
