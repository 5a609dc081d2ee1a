// Preloaded into every Bun script the sandbox runs: process.stdout/stderr.write
// become synchronous, so process.exit() right after a large write cannot drop
// output still queued in Bun (console.log is synchronous already).
//
// Lazily: touching process.stdout costs Bun node:stream and node:fs, tens of
// milliseconds that most scripts (console.log only) never need. Bun builds each
// stdio stream on first use and marks it with `stream._isStdio = true`, a plain
// assignment, so a setter for that one internal name on Object.prototype sees
// the stream being born and patches it then. Any other object assigning
// `_isStdio` just gets an ordinary own property, as before.
let writeSync;

function makeSynchronous(stream) {
  const fd = stream.fd;
  if (fd !== 1 && fd !== 2) return;
  stream.write = function (chunk, encoding, callback) {
    if (typeof encoding === "function") { callback = encoding; encoding = undefined; }
    writeSync ??= require("node:fs").writeSync;
    let buffer = typeof chunk === "string"
      ? Buffer.from(chunk, encoding)
      : Buffer.from(chunk.buffer ?? chunk, chunk.byteOffset, chunk.byteLength);
    while (buffer.length) {
      try { buffer = buffer.subarray(writeSync(fd, buffer)); }
      catch (error) { if (error.code === "EAGAIN") { Bun.sleepSync(1); continue; } throw error; }
    }
    if (callback) queueMicrotask(callback);
    return true;
  };
}

Object.defineProperty(Object.prototype, "_isStdio", {
  configurable: true,
  enumerable: false,
  get() { return undefined; },
  set(value) {
    Object.defineProperty(this, "_isStdio", { value, writable: true, configurable: true, enumerable: true });
    if (value === true) makeSynchronous(this);
  },
});
