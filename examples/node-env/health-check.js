#!/usr/bin/env node
'use strict';
/**
 * Exit 0 when the server whose address is in READY_FILE answers grpc.health.v1 SERVING,
 * 1 otherwise, within 5 seconds: the container image's HEALTHCHECK.
 *
 *   node health-check.js /tmp/rollwire.ready
 */
const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const readyFile = process.argv[2] || '/tmp/rollwire.ready';
let address;
try {
  address = fs.readFileSync(readyFile, 'utf8').trim();
} catch (error) {
  console.error(`${readyFile}: no address yet (${error.code})`);
  process.exit(1);
}
const definition = protoLoader.loadSync(path.join(__dirname, 'health.proto'));
const { Health } = grpc.loadPackageDefinition(definition).grpc.health.v1;
const client = new Health(address, grpc.credentials.createInsecure());
client.Check({ service: '' }, { deadline: Date.now() + 5000 }, (error, reply) => {
  if (error) {
    console.error(`${address}: ${error.message}`);
    process.exit(1);
  }
  console.log(reply.status);
  process.exit(reply.status === 'SERVING' ? 0 : 1);
});
