#!/usr/bin/env node
'use strict';
/**
 * An environment server written in Node.js, serving rollwire.v1.EnvService.
 *
 * It exists to show that rollwire needs nothing from an environment but the
 * contract in proto/v1/env.proto: this file loads that .proto at run time (no
 * generated code to drift), hosts one game with the same rules as rollwire's
 * Python GuessTheNumber, and honours the whole error contract, the optional
 * Multiplex stream and the standard grpc.health.v1 service.
 *
 *   node server.js --port 0 --ready-file /tmp/env.addr [--host 127.0.0.1]
 *
 * The bound "host:port" is written to the ready file (atomically) once the
 * server is serving; SIGTERM or SIGINT reports NOT_SERVING, lets calls finish,
 * removes the ready file and exits 0. A bad request is answered with a status
 * and never stops the server.
 */

const crypto = require('node:crypto');
const fs = require('node:fs');
const path = require('node:path');

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const ENV_PROTO = path.resolve(__dirname, '..', '..', 'proto', 'v1', 'env.proto');
const HEALTH_PROTO = path.join(__dirname, 'health.proto');
const ENV_SERVICE = 'rollwire.v1.EnvService';
const Status = grpc.status;

const USAGE = `usage: node server.js [--host HOST] [--port PORT] [--ready-file PATH]
                      [--max-sessions N] [--session-idle-seconds S]
                      [--max-action-bytes N] [--grace-seconds S]

  --host                  interface to bind (default 127.0.0.1)
  --port                  port to bind; 0 picks a free one (default 0)
  --ready-file            write the bound host:port here once serving
  --max-sessions          open sessions at once; Reset past this is RESOURCE_EXHAUSTED (default 4096)
  --session-idle-seconds  a session with no call for this long is closed (default 600)
  --max-action-bytes      largest action Step accepts, in UTF-8 bytes (default 65536)
  --grace-seconds         how long in-flight calls may run on after SIGTERM (default 5)`;

// ------------------------------------------------------------------ logging

/** One JSON object per line on stderr, the same shape rollwire's services log. */
function log(msg, extra = {}) {
  const line = { ts: new Date().toISOString(), service: 'node-env', msg, ...extra };
  process.stderr.write(`${JSON.stringify(line)}\n`);
}

// ------------------------------------------------------------- command line

const OPTIONS = {
  '--host': { key: 'host', parse: (v) => v },
  '--port': { key: 'port', parse: (v) => integerOption('--port', v, 0, 65535) },
  '--ready-file': { key: 'readyFile', parse: (v) => v },
  '--max-sessions': { key: 'maxSessions', parse: (v) => integerOption('--max-sessions', v, 1) },
  '--session-idle-seconds': { key: 'idleSeconds', parse: (v) => numberOption('--session-idle-seconds', v) },
  '--max-action-bytes': { key: 'maxActionBytes', parse: (v) => integerOption('--max-action-bytes', v, 1) },
  '--grace-seconds': { key: 'graceSeconds', parse: (v) => numberOption('--grace-seconds', v, 0) },
};

class UsageError extends Error {}

function integerOption(flag, text, min, max = Number.MAX_SAFE_INTEGER) {
  const value = Number(text);
  if (!/^\d+$/.test(text) || value < min || value > max) {
    throw new UsageError(`${flag} takes an integer from ${min} to ${max}, got ${JSON.stringify(text)}`);
  }
  return value;
}

function numberOption(flag, text, min = Number.MIN_VALUE) {
  const value = Number(text);
  if (text.trim() === '' || !Number.isFinite(value) || value < min) {
    throw new UsageError(`${flag} takes a number of at least ${min}, got ${JSON.stringify(text)}`);
  }
  return value;
}

/** Parses `--flag value` and `--flag=value`; unknown flags are errors, not ignored. */
function parseArgs(argv) {
  const config = {
    host: '127.0.0.1',
    port: 0,
    readyFile: null,
    maxSessions: 4096,
    idleSeconds: 600,
    maxActionBytes: 64 * 1024,
    graceSeconds: 5,
  };
  for (let i = 0; i < argv.length; i += 1) {
    let [flag, value] = argv[i].split(/=(.*)/s, 2);
    if (flag === '--help' || flag === '-h') {
      process.stdout.write(`${USAGE}\n`);
      process.exit(0);
    }
    const option = OPTIONS[flag];
    if (option === undefined) throw new UsageError(`unknown argument ${JSON.stringify(argv[i])}`);
    if (value === undefined) {
      i += 1;
      if (i >= argv.length) throw new UsageError(`${flag} needs a value`);
      value = argv[i];
    }
    config[option.key] = option.parse(value);
  }
  return config;
}

// ------------------------------------------------- google.protobuf.Struct

/** A JS value as a google.protobuf.Value, in proto-loader's object form. */
function toValue(value) {
  if (value === null || value === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof value === 'bigint') return toValue(Number.isSafeInteger(Number(value)) ? Number(value) : String(value));
  if (typeof value === 'number') return { numberValue: value };
  if (typeof value === 'string') return { stringValue: value };
  if (typeof value === 'boolean') return { boolValue: value };
  if (Array.isArray(value)) return { listValue: { values: value.map(toValue) } };
  return { structValue: toStruct(value) };
}

function toStruct(object) {
  const fields = {};
  for (const [key, value] of Object.entries(object)) fields[key] = toValue(value);
  return { fields };
}

/** A google.protobuf.Value as a plain JS value (numbers stay doubles, as Struct sends them). */
function fromValue(value) {
  switch (value && value.kind) {
    case 'numberValue': return value.numberValue;
    case 'stringValue': return value.stringValue;
    case 'boolValue': return value.boolValue;
    case 'structValue': return fromStruct(value.structValue);
    case 'listValue': return ((value.listValue && value.listValue.values) || []).map(fromValue);
    default: return null;
  }
}

function fromStruct(struct) {
  const object = {};
  for (const [key, value] of Object.entries((struct && struct.fields) || {})) object[key] = fromValue(value);
  return object;
}

// ------------------------------------------------------------ the game

/** A refusal that becomes a gRPC status: the request was wrong, the server is fine. */
class EnvError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

/** The environment rejects this action; the server answers INVALID_ARGUMENT. */
class InvalidAction extends Error {}

/**
 * SplitMix64 as a generator of 64-bit BigInts. Small, fast enough for one draw
 * per episode, and every int64 seed gives its own stream, so the same seed
 * always gives the same target in this server.
 */
function splitMix64(seed) {
  let state = BigInt.asUintN(64, seed);
  return () => {
    state = BigInt.asUintN(64, state + 0x9e3779b97f4a7c15n);
    let z = state;
    z = BigInt.asUintN(64, (z ^ (z >> 30n)) * 0xbf58476d1ce4e5b9n);
    z = BigInt.asUintN(64, (z ^ (z >> 27n)) * 0x94d049bb133111ebn);
    return z ^ (z >> 31n);
  };
}

/** A uniform integer in [low, high]; rejection keeps wide ranges unbiased. */
function drawInteger(next64, low, high) {
  const span = high - low + 1n;
  const limit = (1n << 64n) - ((1n << 64n) % span);
  for (;;) {
    const draw = next64();
    if (draw < limit) return low + (draw % span);
  }
}

const NUMBER = /-?\d+/g;

/**
 * Find a hidden integer in [low, high] within max_turns guesses: the rules,
 * kwargs and texts of rollwire.envs.games.GuessTheNumber. The last integer in
 * the action is the guess; the reply is "higher", "lower" or "correct";
 * reward 1 for finding it; truncated after max_turns guesses.
 */
class GuessTheNumber {
  constructor(kwargs) {
    const unknown = Object.keys(kwargs).filter((key) => !['low', 'high', 'max_turns'].includes(key));
    if (unknown.length > 0) throw new TypeError(`unexpected keyword argument(s): ${unknown.join(', ')}`);
    const { low = 1, high = 100, max_turns: maxTurns = 10 } = kwargs;
    // Struct carries every number as a double: an integral one is an integer.
    if (![low, high, maxTurns].every((value) => Number.isSafeInteger(value))) {
      throw new TypeError('low, high and max_turns must be integers');
    }
    if (low > high) throw new RangeError(`low (${low}) must not exceed high (${high})`);
    if (maxTurns < 1) throw new RangeError('max_turns must be at least 1');
    Object.assign(this, { low, high, maxTurns, target: null, turns: 0 });
  }

  reset(seed) {
    const next64 = splitMix64(seed === null ? crypto.randomBytes(8).readBigUInt64LE() : seed);
    this.target = drawInteger(next64, BigInt(this.low), BigInt(this.high));
    this.turns = 0;
    const observation =
      `I am thinking of an integer between ${this.low} and ${this.high}. ` +
      `You have ${this.maxTurns} guesses. Answer with a single number.`;
    return { observation, info: { low: this.low, high: this.high, max_turns: this.maxTurns } };
  }

  step(action) {
    const numbers = action.match(NUMBER);
    if (numbers === null) throw new InvalidAction(`no integer in the action ${JSON.stringify(action.slice(0, 80))}`);
    const guess = BigInt(numbers[numbers.length - 1]);
    this.turns += 1;
    const info = { guess, turn: this.turns };
    if (guess === this.target) return { observation: 'correct', reward: 1, terminated: true, truncated: false, info };
    const observation = guess < this.target ? 'higher' : 'lower';
    return { observation, reward: 0, terminated: false, truncated: this.turns >= this.maxTurns, info };
  }
}

const ENVS = {
  guess_the_number: {
    spec: {
      env_id: 'guess_the_number',
      description: "Guess a hidden integer; each guess is answered 'higher' or 'lower'.",
      domain: 'game',
      gives_reward: true,
    },
    make: (kwargs) => new GuessTheNumber(kwargs),
  },
};

// ------------------------------------------------------------ sessions

/** Sessions keyed by a random id; the unary calls and Multiplex share them. */
class Sessions {
  constructor(config) {
    this.config = config;
    this.sessions = new Map();
  }

  /** Closes sessions idle past the limit, so abandoned episodes do not pile up. */
  sweep() {
    const cutoff = Date.now() - this.config.idleSeconds * 1000;
    for (const [id, session] of this.sessions) if (session.lastUsed < cutoff) this.sessions.delete(id);
  }

  reset(request) {
    const envId = request.env_id || '';
    const entry = Object.hasOwn(ENVS, envId) ? ENVS[envId] : undefined;
    if (entry === undefined) {
      throw new EnvError(Status.NOT_FOUND, `unknown env id ${JSON.stringify(envId)}; this server offers: ${Object.keys(ENVS).join(', ')}`);
    }
    if (this.sessions.size >= this.config.maxSessions) this.sweep();
    if (this.sessions.size >= this.config.maxSessions) {
      throw new EnvError(Status.RESOURCE_EXHAUSTED, `this server holds its limit of ${this.config.maxSessions} sessions; close finished ones or add servers`);
    }
    const kwargs = request.env_kwargs ? fromStruct(request.env_kwargs) : {};
    let env;
    try {
      env = entry.make(kwargs);
    } catch (error) {
      throw new EnvError(Status.INVALID_ARGUMENT, `cannot create ${JSON.stringify(envId)} with ${JSON.stringify(kwargs)}: ${error.message}`);
    }
    const hasSeed = request.seed !== undefined && request.seed !== null;
    const { observation, info } = env.reset(hasSeed ? BigInt(request.seed) : null);
    const sessionId = crypto.randomBytes(16).toString('hex');
    this.sessions.set(sessionId, { envId, env, done: false, lastUsed: Date.now() });
    return { session_id: sessionId, observation, info: toStruct(info) };
  }

  /** The live session, or NOT_FOUND; one idle past the limit counts as gone. */
  lookup(sessionId) {
    const session = this.sessions.get(sessionId);
    if (session !== undefined && Date.now() - session.lastUsed <= this.config.idleSeconds * 1000) return session;
    this.sessions.delete(sessionId);
    throw new EnvError(Status.NOT_FOUND, `unknown or expired session ${JSON.stringify(sessionId)}; call Reset to start one`);
  }

  step(request) {
    const sessionId = request.session_id || '';
    const action = request.action || '';
    const session = this.lookup(sessionId);
    const size = Buffer.byteLength(action, 'utf8');
    if (size > this.config.maxActionBytes) {
      throw new EnvError(Status.RESOURCE_EXHAUSTED, `action of ${size} bytes exceeds the limit of ${this.config.maxActionBytes}`);
    }
    session.lastUsed = Date.now();
    if (session.done) {
      throw new EnvError(Status.FAILED_PRECONDITION, 'the episode has ended; call Reset for a new one or Close this session');
    }
    let result;
    try {
      result = session.env.step(action);
    } catch (error) {
      if (error instanceof InvalidAction) {
        throw new EnvError(Status.INVALID_ARGUMENT, `env ${JSON.stringify(session.envId)} rejected the action: ${error.message}`);
      }
      this.sessions.delete(sessionId);
      log('env step failed', { env_id: session.envId, error: String(error && error.stack) });
      throw new EnvError(Status.INTERNAL, `env ${JSON.stringify(session.envId)} failed in step: ${error}; the session is closed`);
    }
    session.done = result.terminated || result.truncated;
    return { ...result, info: toStruct(result.info) };
  }

  close(request) {
    return { existed: this.sessions.delete(request.session_id || '') };
  }
}

// ------------------------------------------------------------ handlers

/** The status for a failed call; anything but an EnvError is our bug, reported as INTERNAL. */
function toStatus(error) {
  if (error instanceof EnvError) return { code: error.code, details: error.message };
  log('unexpected error', { error: String(error && error.stack) });
  return { code: Status.INTERNAL, details: `internal error in the node env server: ${error}` };
}

function unary(handle) {
  return (call, callback) => {
    let reply;
    try {
      reply = handle(call.request);
    } catch (error) {
      callback(toStatus(error));
      return;
    }
    callback(null, reply);
  };
}

/** Answers one EnvCall of a Multiplex batch; a failure becomes an in-band CallError. */
function answer(sessions, envCall) {
  const callId = envCall.call_id || '0';
  try {
    switch (envCall.call) {
      case 'reset': return { call_id: callId, reset: sessions.reset(envCall.reset) };
      case 'step': return { call_id: callId, step: sessions.step(envCall.step) };
      case 'close': return { call_id: callId, close: sessions.close(envCall.close) };
      default: throw new EnvError(Status.INVALID_ARGUMENT, 'the call carries none of reset, step or close');
    }
  } catch (error) {
    const status = toStatus(error);
    return { call_id: callId, error: { code: status.code, message: status.details } };
  }
}

function multiplex(sessions) {
  return (call) => {
    // Every call here runs to completion synchronously, so each batch is
    // answered by one reply batch, in order; the stream lives until the client
    // half-closes or goes away.
    call.on('data', (batch) => {
      const replies = (batch.calls || []).map((envCall) => answer(sessions, envCall));
      if (call.writableEnded || call.destroyed) return;
      try {
        call.write({ replies });
      } catch (error) {
        // A reply we cannot encode is our bug: end this stream with it, keep serving.
        call.destroy(toStatus(error));
      }
    });
    call.on('end', () => call.end());
    call.on('error', () => {}); // a client that goes away mid-stream is not our failure
  };
}

/** grpc.health.v1: SERVING for the whole server ('') and for EnvService until shutdown. */
class Health {
  constructor(serving) {
    this.statuses = new Map(serving.map((name) => [name, 'SERVING']));
    this.watchers = new Set();
  }

  check(call, callback) {
    const status = this.statuses.get(call.request.service || '');
    if (status === undefined) callback({ code: Status.NOT_FOUND, details: `unknown service ${JSON.stringify(call.request.service)}` });
    else callback(null, { status });
  }

  watch(call) {
    const service = call.request.service || '';
    const watcher = { call, service };
    this.watchers.add(watcher);
    call.on('cancelled', () => this.watchers.delete(watcher));
    call.on('error', () => this.watchers.delete(watcher));
    call.write({ status: this.statuses.get(service) || 'SERVICE_UNKNOWN' });
  }

  /** Reports NOT_SERVING everywhere and ends the watches, so shutdown need not wait on them. */
  shutdown() {
    for (const name of this.statuses.keys()) this.statuses.set(name, 'NOT_SERVING');
    for (const { call, service } of this.watchers) {
      if (!call.writableEnded && !call.destroyed) {
        call.write({ status: this.statuses.get(service) || 'SERVICE_UNKNOWN' });
        call.end();
      }
    }
    this.watchers.clear();
  }
}

// ------------------------------------------------------------ serving

function loadServices() {
  const options = { keepCase: true, longs: String, enums: String, defaults: false, oneofs: true };
  const env = grpc.loadPackageDefinition(protoLoader.loadSync(ENV_PROTO, options));
  const health = grpc.loadPackageDefinition(protoLoader.loadSync(HEALTH_PROTO, options));
  return { envService: env.rollwire.v1.EnvService.service, healthService: health.grpc.health.v1.Health.service };
}

function writeAtomically(file, text) {
  fs.mkdirSync(path.dirname(file), { recursive: true });
  const temporary = path.join(path.dirname(file), `.${path.basename(file)}.${process.pid}.tmp`);
  fs.writeFileSync(temporary, text);
  fs.renameSync(temporary, file);
}

/** The host a local client should dial for a server bound to `host`. */
function connectableHost(host) {
  if (host === '0.0.0.0' || host === '') return '127.0.0.1';
  if (host === '::' || host === '[::]') return '[::1]';
  return host.includes(':') && !host.startsWith('[') ? `[${host}]` : host;
}

function main() {
  let config;
  try {
    config = parseArgs(process.argv.slice(2));
  } catch (error) {
    if (!(error instanceof UsageError)) throw error;
    process.stderr.write(`${USAGE}\nserver.js: ${error.message}\n`);
    process.exit(2);
  }
  const { envService, healthService } = loadServices();
  const sessions = new Sessions(config);
  const health = new Health(['', ENV_SERVICE]);
  const server = new grpc.Server();
  server.addService(envService, {
    ListEnvs: unary(() => ({ envs: Object.values(ENVS).map((entry) => entry.spec) })),
    Reset: unary((request) => sessions.reset(request)),
    Step: unary((request) => sessions.step(request)),
    Close: unary((request) => sessions.close(request)),
    Multiplex: multiplex(sessions),
  });
  server.addService(healthService, { Check: (call, callback) => health.check(call, callback), Watch: (call) => health.watch(call) });

  const sweeper = setInterval(() => sessions.sweep(), Math.min(config.idleSeconds * 250, 5000));
  sweeper.unref();
  let address = null;
  let stopping = false;

  const finish = () => {
    clearInterval(sweeper);
    if (config.readyFile && address !== null) {
      try {
        if (fs.readFileSync(config.readyFile, 'utf8').trim() === address) fs.unlinkSync(config.readyFile);
      } catch {
        // Already gone, or someone else's now: nothing of ours to remove.
      }
    }
    log('stopped');
    process.exit(0);
  };
  const stop = (signal) => {
    if (stopping) return;
    stopping = true;
    log('stopping', { signal, grace_seconds: config.graceSeconds });
    health.shutdown();
    // In-flight calls (an open Multiplex stream, say) get the grace period,
    // then are cancelled; the last timer makes sure the process ends.
    setTimeout(() => server.forceShutdown(), config.graceSeconds * 1000).unref();
    setTimeout(finish, config.graceSeconds * 1000 + 2000).unref();
    server.tryShutdown(finish);
  };
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('SIGINT', () => stop('SIGINT'));

  const bindHost = config.host.includes(':') && !config.host.startsWith('[') ? `[${config.host}]` : config.host;
  server.bindAsync(`${bindHost}:${config.port}`, grpc.ServerCredentials.createInsecure(), (error, port) => {
    if (error) {
      log('cannot start', { error: `cannot listen on ${bindHost}:${config.port}: ${error.message}` });
      process.exit(1);
    }
    address = `${connectableHost(config.host)}:${port}`;
    if (config.readyFile) writeAtomically(config.readyFile, `${address}\n`);
    log('serving', { address, services: [ENV_SERVICE], envs: Object.keys(ENVS) });
  });
}

main();
